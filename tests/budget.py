"""The suite's time budget, checked on every run: no test may take more than TEST_BUDGET_S, and the whole
run's wall time is reported with its slowest tests (docs/development.md gives the table and the goal).

A test's time is its setup, call and teardown together, so a session fixture's start-up counts against
the first test that asks for it, as it does against the suite. Loaded from tests/conftest.py.
"""

from __future__ import annotations

import time

import pytest

TEST_BUDGET_S = 120.0
SUITE_GOAL_S = 20 * 60  # `make test` on the 2-core CI machine
_spent: dict[str, float] = {}  # where the test runs: the verdict
_reported: dict[str, float] = {}  # where the reports arrive (also a distributing controller): the summary
_started = time.monotonic()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    """Fail a test in its last phase (teardown) when its three phases took more than the budget."""
    outcome = yield
    report = outcome.get_result()
    _spent[item.nodeid] = _spent.get(item.nodeid, 0.0) + report.duration
    if report.when == "teardown" and _spent[item.nodeid] > TEST_BUDGET_S and report.passed:
        report.outcome = "failed"
        report.longrepr = (f"{item.nodeid} took {_spent[item.nodeid]:.0f} s (setup, call and teardown), over "
                           f"the suite's budget of {TEST_BUDGET_S:g} s a test: make it cheaper (a shared "
                           "fixture, fewer steps, a run another test already makes) or split it")


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _reported[report.nodeid] = _reported.get(report.nodeid, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter) -> None:
    """The run's wall time against the goal, and which tests took longest."""
    if not _reported:
        return
    wall = time.monotonic() - _started
    slowest = sorted(_reported.items(), key=lambda kv: kv[1], reverse=True)[:5]
    over = [nodeid for nodeid, spent in _reported.items() if spent > TEST_BUDGET_S]
    terminalreporter.write_sep("-", "time budget")
    terminalreporter.write_line(f"this run: {wall:.0f} s of wall time for {len(_reported)} tests (the whole "
                                f"suite's goal: {SUITE_GOAL_S // 60} min on 2 cores); over "
                                f"{TEST_BUDGET_S:.0f} s: {len(over)}")
    for nodeid, spent in slowest:
        terminalreporter.write_line(f"  {spent:6.1f} s  {nodeid}")
