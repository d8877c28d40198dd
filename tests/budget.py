"""The suite's time budget, checked on every run: no test may take more than TEST_BUDGET_S, and the whole
run's wall time is reported with its slowest tests (docs/development.md gives the table and the goal).

A test's time is its setup, call and teardown together, so a session fixture's start-up counts against
the first test that asks for it, as it does against the suite. Each test's report also carries the CPU
seconds its process and the children it reaped spent (`cpu_s` in --junitxml's properties), and the summary
gives the machine's busy CPU time over the run: against wall time x cores, that says how much a faster
machine or more parallel workers could still gain. Loaded from tests/conftest.py.
"""

from __future__ import annotations

import json
import os
import resource
import time
from pathlib import Path

import pytest

TEST_BUDGET_S = 120.0
SUITE_GOAL_S = 20 * 60  # `make test` on the 2-core CI machine
_spent: dict[str, float] = {}  # where the test runs: the verdict
_reported: dict[str, float] = {}  # where the reports arrive (also a distributing controller): the summary
_cpu_at_setup: dict[str, float] = {}
_started = time.monotonic()


def _process_cpu() -> float:
    """CPU seconds of this process and of the children it has reaped."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def _machine_busy() -> float:
    """CPU seconds every core of the machine has spent busy since boot (/proc/stat; 0 where absent)."""
    try:
        fields = [int(value) for value in open("/proc/stat").readline().split()[1:]]
    except (OSError, ValueError):
        return 0.0
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


_busy_at_start = _machine_busy()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    _cpu_at_setup[item.nodeid] = _process_cpu()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    """Fail a test in its last phase (teardown) when its three phases took more than the budget."""
    outcome = yield
    report = outcome.get_result()
    _spent[item.nodeid] = _spent.get(item.nodeid, 0.0) + report.duration
    if report.when == "teardown" and item.nodeid in _cpu_at_setup:
        report.user_properties.append(("cpu_s", round(_process_cpu() - _cpu_at_setup.pop(item.nodeid), 2)))
    if report.when == "teardown" and _spent[item.nodeid] > TEST_BUDGET_S and report.passed:
        report.outcome = "failed"
        report.longrepr = (f"{item.nodeid} took {_spent[item.nodeid]:.0f} s (setup, call and teardown), over "
                           f"the suite's budget of {TEST_BUDGET_S:g} s a test: make it cheaper (a shared "
                           "fixture, fewer steps, a run another test already makes) or split it")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--budget-durations", metavar="PATH",
                     help="write each test file's seconds (setup, call and teardown of its tests) to PATH as "
                          "JSON: tests/durations.json orders the files for pytest-xdist (tests/conftest.py)")


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _reported[report.nodeid] = _reported.get(report.nodeid, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter) -> None:
    """The run's wall time against the goal, and which tests took longest."""
    if not _reported:
        return
    wall = time.monotonic() - _started
    busy = _machine_busy() - _busy_at_start
    slowest = sorted(_reported.items(), key=lambda kv: kv[1], reverse=True)[:5]
    over = [nodeid for nodeid, spent in _reported.items() if spent > TEST_BUDGET_S]
    terminalreporter.write_sep("-", "time budget")
    terminalreporter.write_line(f"this run: {wall:.0f} s of wall time for {len(_reported)} tests (the whole "
                                f"suite's goal: {SUITE_GOAL_S // 60} min on 2 cores); over "
                                f"{TEST_BUDGET_S:.0f} s: {len(over)}")
    cores = os.cpu_count() or 1
    terminalreporter.write_line(f"the machine's cores were busy {busy:.0f} CPU s of {wall * cores:.0f} "
                                f"({cores} cores x the wall time)")
    for nodeid, spent in slowest:
        terminalreporter.write_line(f"  {spent:6.1f} s  {nodeid}")
    target = terminalreporter.config.getoption("budget_durations")
    if target:
        files: dict[str, float] = {}
        for nodeid, spent in _reported.items():
            path = nodeid.split("::", 1)[0]
            files[path] = files.get(path, 0.0) + spent
        ordered = {path: round(spent, 1) for path, spent in sorted(files.items(), key=lambda kv: -kv[1])}
        Path(target).write_text(json.dumps(ordered, indent=1) + "\n")
        terminalreporter.write_line(f"wrote the seconds of {len(files)} test files to {target}")
