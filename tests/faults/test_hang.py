"""A worker that hangs in a collective after step 1 fails the run within dist.step_timeout_s, never silently.

A test-only entry point wraps ``traincore.run.cli.main``, run with ``--nproc-per-node 2`` (its workers fork
from it, patch included): rank 1 sleeps for an hour on its second call of ``train_step``, so rank 0 waits in
step 2's first collective. With ``dist.step_timeout_s`` small (the start-up allowance,
``dist.init_timeout_s``, stays at 900 s) rank 0 must raise an error that names the timeout and the fix, the
launcher's agent (torch elastic's, as under torchrun) must tear the hung rank down, and no process of the run
may be left.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from faultlib import TINY, child_env, kill_tree, still_running, train_args, wait_for
from ranks import process_tree

STEP_TIMEOUT_S = 5
# Rank 0's wait is STEP_TIMEOUT_S; on top come its error path, the agent's monitor interval (0.1 s) and
# the teardown of rank 1, all slow on a busy 2-core machine. Far below the 900 s start-up allowance.
MARGIN_S = 30
HANG_MARK = "test: rank 1 hangs in step 2"

HANGING_ENTRY = f'''
"""Test only: traincore.train's CLI with rank 1 sleeping inside its second training step."""
import os
import sys
import time

import traincore.run.steps
import traincore.run.trainer
import traincore.run.cli

real_step = traincore.run.trainer.train_step
calls = 0


def hanging_step(*args, **kwargs):
    global calls
    calls += 1
    if calls == 2 and os.environ["RANK"] == "1":
        print("{HANG_MARK}", flush=True)
        time.sleep(3600)
    return real_step(*args, **kwargs)


traincore.run.trainer.train_step = traincore.run.steps.train_step = hanging_step
sys.exit(traincore.run.cli.main())
'''


def test_hung_worker_fails_the_run_within_the_step_timeout(fault_data, tmp_path):
    script, log = tmp_path / "hanging_train.py", tmp_path / "run.log"
    script.write_text(HANGING_ENTRY)
    config = {**TINY, "dist": {"step_timeout_s": STEP_TIMEOUT_S, "init_timeout_s": 900}}
    command = [sys.executable, str(script), *train_args(fault_data, tmp_path / "run", "--nproc-per-node", "2",
                                                        "--max-steps", "50", config=config)]
    with log.open("w") as sink:
        process = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT, env=child_env(),
                                   start_new_session=True)
    try:
        wait_for(lambda: HANG_MARK in log.read_text(errors="replace") or process.poll() is not None, 300,
                 "rank 1 to hang")
        hung_at, run_pids = time.monotonic(), process_tree(process.pid)
        code = process.wait(timeout=STEP_TIMEOUT_S + MARGIN_S + 60)
        detected_s = time.monotonic() - hung_at
    finally:
        if process.poll() is None:  # only while unreaped: a reaped pid may belong to another process
            kill_tree(process.pid)
            process.wait()
    left = still_running(run_pids, script.name.encode())
    for pid in left:  # the agent should have torn them down; never leave a worker sleeping for an hour
        os.kill(pid, signal.SIGKILL)
    text = log.read_text(errors="replace")
    assert HANG_MARK in text, text[-4000:]
    print(f"\nhang detected and the run ended {detected_s:.1f} s after rank 1 hung "
          f"(dist.step_timeout_s={STEP_TIMEOUT_S}, bound {STEP_TIMEOUT_S + MARGIN_S} s)")
    assert code != 0, text[-4000:]
    assert STEP_TIMEOUT_S * 0.75 <= detected_s < STEP_TIMEOUT_S + MARGIN_S, text[-4000:]
    # The error says what timed out and what to do, rather than gloo's bare "Timed out waiting 5000ms".
    assert "CollectiveTimeoutError: rank 0: a collective timed out after step 1" in text, text[-4000:]
    assert f"dist.step_timeout_s={STEP_TIMEOUT_S} s" in text and "raise dist.step_timeout_s" in text
    assert "look at the other ranks' logs" in text
    assert len(run_pids) >= 3, run_pids  # the agent and both workers were seen, so the check covers them
    assert not left, f"processes of the run still alive after it ended: {left}"
