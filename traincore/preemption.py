"""Preemption: a signalled run finishes its step, saves it on every rank and exits, within a grace budget.

Kubernetes evicts a pod with SIGTERM and SIGKILLs it after its termination grace (30 s by default; a GKE
spot node gives about 25 s), Slurm signals a job before its time limit (``--signal``) or on preemption,
torchrun forwards SIGTERM and SIGINT to its workers (and SIGKILLs them 30 s later), and a person presses
Ctrl-C. :class:`PreemptionWatch` turns any of SIGTERM, SIGINT and SIGUSR1 into a request to stop; the
signal handler only records it, since collectives or I/O inside a handler can deadlock. At each step
boundary the ranks agree on whether to stop, and on whether to save (``checkpoint.every_s``: a wall-clock
interval that runs out on each rank's own clock): a two-element all-reduce (MAX) on a gloo group of the
watch's own, started at one boundary and read at the next, so it overlaps a step instead of adding a round
trip to it. All ranks read the same result at the same boundary, so they stop (or save) after the same
step even when the signal reached them, or their clocks ran out, at different steps. The Trainer then
saves that step and raises :class:`Preempted`.

The budget (``checkpoint.preemption_grace_s``) counts from the first signal. When it runs out before the
save is committed, the process exits with :data:`PREEMPTED_EXIT_CODE` at once: its save never gets a
commit marker, so a resume loads the last complete checkpoint, never a torn one.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from types import FrameType
from typing import NamedTuple

import torch
import torch.distributed as dist

from traincore.checkpoint import Store, as_store

PREEMPTED_EXIT_CODE = 75
"""Exit code of a preempted run (EX_TEMPFAIL, "try again"): the same command resumes it."""
PREEMPTION_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
RECORD_FILE = "preempted.json"
"""Written by rank 0 into the checkpoint root when the run stops on a signal: step, signal, checkpoint. The
root, not the output directory: a launcher and its (spawned) workers may not share the latter."""

log = logging.getLogger(__name__)


class Preempted(Exception):
    """The run stopped on a signal after ``step``; ``checkpoint`` is the directory that holds that step, or
    None when no checkpoint of it could be saved."""

    def __init__(self, step: int, signal_name: str, checkpoint: str | None):
        self.step, self.signal_name, self.checkpoint = step, signal_name, checkpoint
        super().__init__(f"{self.headline}; the same command resumes from "
                         f"{'it' if checkpoint else 'the last complete one'}")

    @property
    def headline(self) -> str:
        """Where the run stopped and what it saved, without the advice (which depends on the launcher)."""
        where = self.checkpoint.rsplit("/", 1)[0] if self.checkpoint else None
        saved = (f"checkpoint step-{self.step} saved in {where}" if self.checkpoint
                 else "no checkpoint of it was saved")
        return f"preempted at step {self.step} by {self.signal_name}: {saved}"

    def to_record(self) -> dict:
        return {"step": self.step, "signal": self.signal_name, "checkpoint": self.checkpoint}

    @classmethod
    def from_record(cls, record: dict) -> Preempted:
        return cls(int(record["step"]), str(record["signal"]), record.get("checkpoint"))


def write_record(root: str | Path | Store, preempted: Preempted) -> None:
    """Leave the outcome where a launcher that saw only its workers end (torchrun, a Flyte task) finds it."""
    as_store(root).write_bytes(RECORD_FILE, json.dumps(preempted.to_record()).encode())


def read_record(root: str | Path | Store) -> Preempted | None:
    """The preemption a run left in its checkpoint ``root``, or None (no record, or an unreadable one)."""
    try:
        return Preempted.from_record(json.loads(as_store(root).read_bytes(RECORD_FILE)))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def clear_record(root: str | Path | Store) -> None:
    """Remove an earlier attempt's record, so it is never taken for this run's."""
    as_store(root).remove_file(RECORD_FILE)


class Agreement(NamedTuple):
    """What every rank does at a step boundary, the same on all of them."""

    stop: bool
    save: bool


class PreemptionWatch:
    """Signal handlers for one run (restored by :meth:`close`) and the ranks' agreement on when to stop and
    when to save."""

    def __init__(self, grace_s: float, world_size: int = 1, committed: Callable[[], str] | None = None):
        self.grace_s = grace_s
        self.committed = committed  # names the newest committed checkpoint, for the out-of-time message
        self.signal_name: str | None = None
        self.deadline: float | None = None
        self._previous: dict[int, object] = {}
        self._timer: threading.Timer | None = None
        self._group = self._flags = self._work = None
        if world_size > 1 and dist.is_initialized():
            # A group of its own: the agreement's collective never interleaves with the training backend's
            # or the checkpointer's (whose commits run collectives from a background thread).
            self._group = dist.new_group(backend="gloo", timeout=timedelta(minutes=2))
        self._install()

    def _install(self) -> None:
        """Only the main thread may set handlers; elsewhere (a Trainer in a thread) signals keep theirs."""
        if threading.current_thread() is not threading.main_thread():
            log.debug("not in the main thread: preemption signals are not watched")
            return
        for signum in PREEMPTION_SIGNALS:
            self._previous[signum] = signal.signal(signum, self._on_signal)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        """Record the first signal and start the grace; later ones (torchrun forwards Ctrl-C again) wait."""
        if self.signal_name is not None:
            return
        self.signal_name = signal.Signals(signum).name
        self.deadline = time.monotonic() + self.grace_s
        self._timer = threading.Timer(self.grace_s, self._out_of_time)
        self._timer.daemon = True
        self._timer.start()

    def _out_of_time(self) -> None:
        # Exit without unwinding: a save still being written has no commit marker and is never loaded.
        latest = self.committed() if self.committed else "the last complete checkpoint"
        print(f"preempted by {self.signal_name}: the step and its checkpoint did not finish within "
              f"checkpoint.preemption_grace_s={self.grace_s:g}; exiting: {latest} stays the one a resume "
              "loads", flush=True, file=sys.stderr)
        os._exit(PREEMPTED_EXIT_CODE)

    def agree(self, save_due: bool = False) -> Agreement:
        """At a step boundary, on every rank: whether every rank stops here (any rank was signalled) and
        whether every rank saves here (any rank's ``save_due``: its ``checkpoint.every_s`` ran out).

        Distributed, the answer is the one agreed from the flags of the previous boundary (a collective
        started there, read here, so it overlaps a step); this boundary's flags go into the next one. A
        rank whose save the agreement already calls for does not propose another.
        """
        if self._group is None:
            return Agreement(stop=self.signal_name is not None, save=save_due)
        agreed = Agreement(stop=False, save=False)
        if self._work is not None:
            self._work.wait()
            agreed = Agreement(stop=bool(self._flags[0]), save=bool(self._flags[1]))
        if not agreed.stop:
            self._flags = torch.tensor([int(self.signal_name is not None), int(save_due and not agreed.save)],
                                       dtype=torch.int32)
            self._work = dist.all_reduce(self._flags, op=dist.ReduceOp.MAX, group=self._group, async_op=True)
        return agreed

    def finish(self) -> None:
        """The loop ended normally: wait for the last agreement every rank started."""
        if self._work is not None:
            self._work.wait()
            self._work = None

    def close(self) -> None:
        """Restore the signal handlers there were, stop the grace timer (whoever called close is unwinding on
        its own: an error document or an exit code still has to be written) and drop the watch's group."""
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous = {}
        if self._timer is not None:
            self._timer.cancel()
        if self._group is not None:
            dist.destroy_process_group(self._group)
            self._group = self._work = None
