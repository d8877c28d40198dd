"""tests/scopes.py: under pytest-xdist a shared scope runs on one worker in order, and the longest scope
starts first."""

from __future__ import annotations

import json
import re
from pathlib import Path

pytest_plugins = ["pytester"]

TESTS_DIR = Path(__file__).resolve().parent


def test_a_shared_scope_runs_on_one_worker_and_the_longest_scope_starts_first(pytester):
    # Each test appends "<worker> <nodeid>" to one log as it runs.
    log = pytester.path / "order.log"
    pytester.makeconftest(f"""
import os
import scopes
from pathlib import Path
scopes.SHARED_SCOPES = ("cluster/",)
scopes.DURATIONS = Path({str(pytester.path / "durations.json")!r})
pytest_plugins = ["scopes"]

def pytest_runtest_call(item):
    with open({str(log)!r}, "a") as handle:
        handle.write(os.environ["PYTEST_XDIST_WORKER"] + " " + item.nodeid + "\\n")
""")
    body = "import time\n" + "".join(f"def test_{i}():\n    time.sleep(0.2)\n" for i in range(3))
    for name in ("cluster/test_a.py", "cluster/test_b.py", "test_quick.py", "test_long.py", "test_mid.py"):
        (pytester.path / name).parent.mkdir(exist_ok=True)
        (pytester.path / name).write_text(body)
    (pytester.path / "durations.json").write_text(json.dumps(
        {"test_long.py": 50.0, "cluster/test_a.py": 10.0, "cluster/test_b.py": 10.0, "test_mid.py": 30.0}))
    result = pytester.runpytest_subprocess("-n", "2", "-p", "no:cacheprovider", "-o", "addopts=",
                                           "-o", f"pythonpath={TESTS_DIR}")
    result.assert_outcomes(passed=15)
    runs = [line.split(" ", 1) for line in log.read_text().splitlines()]
    workers = {nodeid: worker for worker, nodeid in runs}
    cluster = [nodeid for _, nodeid in runs if nodeid.startswith("cluster/")]
    # Both cluster files on one worker, one after the other, each in its own order.
    assert len({workers[nodeid] for nodeid in cluster}) == 1
    assert cluster == [f"cluster/test_{f}.py::test_{i}" for f in "ab" for i in range(3)]
    # The two longest scopes (test_long 50 s, test_mid 30 s; the cluster's two files 20 s) start first, one
    # per worker, though the cluster has more tests; the long file does not end the run.
    firsts = {}
    for worker, nodeid in runs:
        firsts.setdefault(worker, nodeid)
    started_first = sorted(re.sub(r"::.*", "", nodeid) for nodeid in firsts.values())
    assert started_first == ["test_long.py", "test_mid.py"]
    assert re.sub(r"::.*", "", runs[-1][1]) != "test_long.py"
