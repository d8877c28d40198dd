"""The preemption watch: a signal becomes a stop at a step boundary every rank agrees on; handlers and the
grace timer are the run's only."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
from test_dist import CFG, run_ranks, two_rank_env  # noqa: F401  (a module beside this one, and its fixture)

from traincore.run.dist import distributed
from traincore.run.preemption import (
    PREEMPTION_SIGNALS,
    Preempted,
    PreemptionWatch,
    clear_record,
    read_record,
    write_record,
)


def test_the_record_says_where_the_run_stopped_and_what_it_saved(tmp_path):
    saved = Preempted(412, "SIGTERM", str(tmp_path / "step-000412"))
    assert str(saved) == (f"preempted at step 412 by SIGTERM: checkpoint step-412 saved in {tmp_path}; the "
                          "same command resumes from it")
    lost = Preempted(7, "SIGINT", None)
    assert str(lost) == ("preempted at step 7 by SIGINT: no checkpoint of it was saved; the same command "
                         "resumes from the last complete one")
    assert read_record(tmp_path) is None
    write_record(tmp_path / "root", saved)
    assert str(read_record(tmp_path / "root")) == str(saved)
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


def _stop_step(rank: int, out_dir: Path) -> dict:
    """Steps 1..20; only rank 1 is signalled, after its step 3. The step after which each rank stops."""
    with distributed(CFG):
        watch = PreemptionWatch(grace_s=30.0, world_size=2)
        try:
            for step in range(1, 21):
                if rank == 1 and step == 3:
                    os.kill(os.getpid(), signal.SIGTERM)
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


def _save_steps(rank: int, out_dir: Path) -> dict:
    """Steps 1..10; each rank's interval runs out at a step of its own (rank 0 after step 6, rank 1 after
    step 3, and says so until it saved). The steps at which each rank saves."""
    with distributed(CFG):
        watch = PreemptionWatch(grace_s=30.0, world_size=2)
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
