"""tests/budget.py: a test over the budget fails, by name, and the run reports its wall time."""

from __future__ import annotations

pytest_plugins = ["pytester"]


def test_a_test_over_the_budget_fails_and_the_run_reports_its_time(pytester):
    pytester.makeconftest("""
import budget
budget.TEST_BUDGET_S = 0.3
pytest_plugins = ["budget"]
""")
    pytester.makepyfile(test_sample="""
import time

def test_quick():
    pass

def test_slow():
    time.sleep(0.5)
""")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-o", "addopts=",
                                           "-o", f"pythonpath={BUDGET_DIR}")
    result.assert_outcomes(passed=2, errors=1)  # test_slow's call passed; its budget fails at teardown
    result.stdout.fnmatch_lines(["*test_sample.py::test_slow took * s (setup, call and teardown), over the "
                                 "suite's budget of 0.3 s a test*",
                                 "*this run: * s of wall time for 2 tests*"])


BUDGET_DIR = __import__("pathlib").Path(__file__).resolve().parent
