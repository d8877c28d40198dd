"""The tests' child-process helpers: a child that outlives its timeout is killed, and the failure says where
each process of its tree waited."""

from __future__ import annotations

import time

import pytest
from ranks import forkserver, wait_exit


def test_a_child_past_its_timeout_is_killed_with_where_it_waited():
    child = forkserver().Process(target=time.sleep, args=(120,), name="sleeper")
    child.start()
    with pytest.raises(AssertionError) as failed:
        wait_exit(child, timeout=1)
    assert child.exitcode == -9  # killed, not left running
    report = str(failed.value)
    assert report.startswith("sleeper still ran after 1 s; where its processes waited:\npid "), report
    assert f"pid {child.pid} [" in report and "State:\tS (sleeping)" in report, report
    # Its one thread's stack, Python and native: a sleep in the C library under BaseProcess.run.
    assert f'Thread {child.pid} (idle): "MainThread"' in report and "time_sleep" in report, report
    assert "BaseProcess.run (multiprocessing/process.py" in report, report
