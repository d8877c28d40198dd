"""The preemption watch: a signal becomes a stop at a step boundary every rank agrees on; handlers and the
grace timer are the run's only."""

from __future__ import annotations

import functools
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_dist import CFG, run_ranks, two_rank_env  # noqa: F401  (a module beside this one, and its fixture)

from traincore.exitcodes import PREEMPTED_EXIT_CODE
from traincore.run.dist import distributed
from traincore.run.preemption import (
    PREEMPTION_SIGNALS,
    PROMPT_STEP_S,
    Preempted,
    PreemptionWatch,
    clear_record,
    grace_warning,
    read_record,
    write_record,
)


def test_the_record_says_where_the_run_stopped_and_what_it_saved(tmp_path):
    saved = Preempted(412, "SIGTERM", str(tmp_path / "step-000412"))
    assert str(saved) == (f"preempted at step 412 by SIGTERM: checkpoint step-412 saved in {tmp_path}; the "
                          "same command resumes from it")
    lost = Preempted(7, "SIGINT", None, resumes_from=5)
    assert str(lost) == ("preempted at step 7 by SIGINT: no checkpoint of it was saved; the same command "
                         "resumes from the committed step 5")
    # Nothing committed before either: never a word about a checkpoint to resume from.
    assert str(Preempted(3, "SIGTERM", None)) == (
        "preempted at step 3 by SIGTERM: no checkpoint of it was saved; nothing is committed, so the same "
        "command starts from the beginning")
    assert read_record(tmp_path) is None
    write_record(tmp_path / "root", saved)
    assert str(read_record(tmp_path / "root")) == str(saved)
    write_record(tmp_path / "root", lost)
    assert str(read_record(tmp_path / "root")) == str(lost)
    clear_record(tmp_path / "root")
    assert read_record(tmp_path / "root") is None
    (tmp_path / "root" / "preempted.json").write_text("{torn")
    assert read_record(tmp_path / "root") is None


def test_a_signal_becomes_a_stop_and_closing_restores_the_handlers_and_stops_the_grace_timer():
    before = {signum: signal.getsignal(signum) for signum in PREEMPTION_SIGNALS}
    watch = PreemptionWatch(grace_s=1.0)
    try:
        assert watch.agree() == (False, False) and watch.agree(save_due=True) == (False, True)
        os.kill(os.getpid(), signal.SIGUSR1)
        os.kill(os.getpid(), signal.SIGTERM)  # a second signal changes nothing
        assert watch.agree().stop and watch.signal_name == "SIGUSR1"
    finally:
        watch.close()
    assert {signum: signal.getsignal(signum) for signum in PREEMPTION_SIGNALS} == before
    # The grace timer would end this process (pytest with it) with os._exit 1 s after the signal.
    time.sleep(1.5)


# A process whose grace runs out: argv[1] "main" or "other" (the rank that prints), argv[2] "quick" or
# "hang" (a records copy to a store that never answers). It says "ready", then waits to be signalled.
OUT_OF_GRACE = """
import sys, threading
from traincore.run.preemption import PreemptionWatch

def copy():
    print("copying", flush=True)
    if sys.argv[2] == "hang":
        threading.Event().wait()
    print("copied", flush=True)

stays = "the committed checkpoint step 40 in /ckpt stays the one a resume loads"
watch = PreemptionWatch(grace_s=0.2, main=sys.argv[1] == "main", committed=lambda: stays)
watch.last_copy = copy
print("ready", flush=True)
threading.Event().wait()
"""


def test_a_grace_that_runs_out_copies_the_records_in_the_time_left_and_one_rank_says_so():
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "3"}
    runs = {case: subprocess.Popen([sys.executable, "-c", OUT_OF_GRACE, *case], env=env, text=True,
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            for case in (("main", "quick"), ("other", "hang"))}
    took = {}
    for case, process in runs.items():
        assert process.stdout.readline() == "ready\n", process.stderr.read()
        sent = time.monotonic()
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=10) == PREEMPTED_EXIT_CODE
        took[case] = time.monotonic() - sent
    out = {case: (process.stdout.read(), process.stderr.read()) for case, process in runs.items()}
    assert out["main", "quick"] == ("copying\ncopied\n", (
        "preempted by SIGTERM: the step and its checkpoint did not finish within "
        "checkpoint.preemption_grace_s=0.2; exiting: the committed checkpoint step 40 in /ckpt stays the one "
        "a resume loads\n"))
    stdout, stderr = out["other", "hang"]
    assert stdout == "copying\n" and "did not finish in the" in stderr, stderr
    assert "preempted by" not in stderr  # one rank speaks for the run
    # The copy had what was left before the launcher's SIGKILL (3 s after the signal, less a 1 s margin),
    # and the process still exited before that SIGKILL.
    assert 1.5 < took["other", "hang"] < 3, took


# A run that fails after its signal, long before its grace (20 s) runs out: as a rank does whose collective
# lost a peer that had exited on its own grace. argv[1]: the exception the run ends on.
FAILS_IN_GRACE = """
import sys, time
from traincore.run.preemption import Preempted, PreemptionWatch

error = {"RuntimeError": RuntimeError("Connection closed by peer"), "Preempted": Preempted(7, "SIGTERM", "c")}
with PreemptionWatch(grace_s=20, committed=lambda: "step 5 stays the one a resume loads") as watch:
    print("ready", flush=True)
    while watch.signal_name is None:
        time.sleep(0.01)
    raise error[sys.argv[1]]
"""


@pytest.mark.parametrize("error", ["RuntimeError", "Preempted"])
def test_a_run_that_fails_after_its_signal_ends_at_once_as_a_preempted_one(error):
    process = subprocess.Popen([sys.executable, "-c", FAILS_IN_GRACE, error], text=True,
                               env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE)
    assert process.stdout.readline() == "ready\n", process.stderr.read()
    sent = time.monotonic()
    process.send_signal(signal.SIGTERM)
    code = process.wait(timeout=15)
    stderr = process.stderr.read()
    if error == "Preempted":  # a finished stop unwinds as it is: its own handler reports it
        assert code == 1 and "Traceback" in stderr and "did not finish" not in stderr, stderr
        return
    assert code == PREEMPTED_EXIT_CODE and time.monotonic() - sent < 10, stderr
    assert stderr == ("preempted by SIGTERM: the step and its checkpoint did not finish within "
                      "checkpoint.preemption_grace_s=20 (the run failed first: RuntimeError: Connection "
                      "closed by peer); exiting: step 5 stays the one a resume loads\n")


def test_a_grace_the_launchers_sigkill_cuts_short_is_named_with_the_limit_and_the_fix(monkeypatch, caplog):
    assert grace_warning(20, {}) is None
    default = grace_warning(45, {})
    assert default.startswith("checkpoint.preemption_grace_s=45 is not under the 30 s after which a "
                              "signalled worker is SIGKILLed (TORCH_ELASTIC_SHUTDOWN_TIMEOUT")
    assert "Lower checkpoint.preemption_grace_s under 30" in default
    assert "TORCH_ELASTIC_SHUTDOWN_TIMEOUT" in default and "terminationGracePeriodSeconds" in default
    lowered = grace_warning(20, {"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "15"})
    assert "under the 15 s after which a signalled worker is SIGKILLed (TORCH_ELASTIC_SHUTDOWN_TIMEOUT=15)" \
        in lowered
    assert grace_warning(45, {"PET_SHUTDOWN_TIMEOUT": "60", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "15"}) is None
    # A run says it once, on its main rank.
    for name in ("PET_SHUTDOWN_TIMEOUT", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"):
        monkeypatch.delenv(name, raising=False)
    with caplog.at_level(logging.WARNING, logger="traincore.run.preemption"):
        for main in (True, False):
            PreemptionWatch(grace_s=45, main=main).close()
    assert [record.getMessage() for record in caplog.records] == [default]


def _stop_step(rank: int, out_dir: Path, signal_step: int = 3, step_s: float = 0.0) -> dict:
    """Steps 1..20 of ``step_s`` each; only rank 1 is signalled, in the middle of its step ``signal_step``.
    The step after which each rank stops."""
    with distributed(CFG):
        watch = PreemptionWatch(grace_s=20.0, world_size=2)
        try:
            for step in range(1, 21):
                time.sleep(step_s / 2)
                if rank == 1 and step == signal_step:
                    os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(step_s / 2)
                if watch.agree().stop:
                    return {"stopped_after": step, "signal": watch.signal_name}
            watch.finish()
            return {"stopped_after": None, "signal": watch.signal_name}
        finally:
            watch.close()


@pytest.mark.usefixtures("two_rank_env")
def test_ranks_signalled_at_different_steps_stop_after_the_same_one(tmp_path):
    records = run_ranks(_stop_step, tmp_path)
    # Rank 1's flag goes into the agreement started after step 3, which every rank reads after step 4.
    assert [record["stopped_after"] for record in records] == [4, 4]
    assert [record["signal"] for record in records] == [None, "SIGTERM"]


@pytest.mark.usefixtures("two_rank_env")
def test_with_long_steps_ranks_stop_after_the_step_the_signal_arrived_in(tmp_path):
    assert PROMPT_STEP_S < 0.3
    records = run_ranks(functools.partial(_stop_step, signal_step=5, step_s=0.3), tmp_path)
    # Steps 1 and 2 show the steps are long (agreed after step 3); from then on each boundary reads its own
    # agreement, so the signal of step 5 stops every rank after step 5, not after step 6.
    assert [record["stopped_after"] for record in records] == [5, 5]


def _save_steps(rank: int, out_dir: Path) -> dict:
    """Steps 1..10; each rank's interval runs out at a step of its own (rank 0 after step 6, rank 1 after
    step 3, and says so until it saved). The steps at which each rank saves."""
    with distributed(CFG):
        watch = PreemptionWatch(grace_s=20.0, world_size=2)
        saved, due_from = [], 6 if rank == 0 else 3
        try:
            for step in range(1, 11):
                due = step >= due_from and not saved
                if watch.agree(save_due=due).save:
                    saved.append(step)
            watch.finish()
            return {"saved": saved}
        finally:
            watch.close()


@pytest.mark.usefixtures("two_rank_env")
def test_ranks_whose_intervals_run_out_at_different_steps_save_together_once(tmp_path):
    records = run_ranks(_save_steps, tmp_path)
    # Rank 1's interval ran out at step 3: every rank saves after step 4, and nobody proposes it again.
    assert [record["saved"] for record in records] == [[4], [4]]
