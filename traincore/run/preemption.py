"""Preemption: a signalled run finishes its step, saves it on every rank and exits, within a grace budget.

Kubernetes evicts a pod with SIGTERM and SIGKILLs it after its termination grace (30 s by default; a GKE
spot node gives about 25 s), Slurm signals a job before its time limit (``--signal``) or on preemption,
torchrun forwards SIGTERM and SIGINT to its workers (and SIGKILLs them 30 s later), and a person presses
Ctrl-C. :class:`PreemptionWatch` turns any of SIGTERM, SIGINT and SIGUSR1 into a request to stop; the
signal handler only records it, since collectives or I/O inside a handler can deadlock. At each step
boundary the ranks agree on whether to stop, and on whether to save (``checkpoint.every_s``: a wall-clock
interval that runs out on each rank's own clock): a three-element all-reduce (MAX: stop, save, a long
step) on a gloo group of the watch's own, started at one boundary and read at the next, so it overlaps a
step instead of adding a round trip to it (while steps take PROMPT_STEP_S or longer, each boundary reads
its own instead). All ranks read the same result at the same boundary, so they stop (or save) after the
same step even when the signal reached them, or their clocks ran out, at different steps. The Trainer then
saves that step and raises :class:`Preempted`.

The budget (``checkpoint.preemption_grace_s``) counts from the first signal. When it runs out before the
save is committed, the process exits with :data:`PREEMPTED_EXIT_CODE` without unwinding: its exit commits,
prunes and deletes nothing, and a save still being written has no commit marker, so a resume loads the last
complete checkpoint, never a torn one. Before it exits, the rank that keeps the run's records copies them to
the durable root (``last_copy``) in the time left before the launcher's SIGKILL
(:func:`launcher_kill_after`), so a preempted attempt keeps them however it ends.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Mapping
from datetime import timedelta
from pathlib import Path
from types import FrameType
from typing import NamedTuple

import torch
import torch.distributed as dist

from traincore.checkpoint import Store, as_store
from traincore.exitcodes import PREEMPTED_EXIT_CODE

PREEMPTION_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
SHUTDOWN_TIMEOUT_ENV = ("PET_SHUTDOWN_TIMEOUT", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT")
"""Where a worker reads its launcher's shutdown timeout: torchrun's ``--shutdown-timeout`` as an environment
variable, then torch elastic's own (both launchers read them; the flag itself never reaches a worker)."""
DEFAULT_KILL_AFTER_S = 30.0
"""Seconds from a signal to the SIGKILL when nothing says otherwise: torch elastic's shutdown timeout and
Kubernetes' terminationGracePeriodSeconds both default to 30."""
EXIT_MARGIN_S = 1.0
"""Kept free before the launcher's SIGKILL: it counts from when the launcher got the signal, a little before
this process did."""
PROMPT_STEP_S = 0.25
"""A step at least this long makes every boundary wait for its own agreement: a stop then comes after the
step the signal arrived in (half a step's wait on average) instead of the one after it, which matters when
steps take seconds and the grace is 20 s (a 1 GB state into an object store: bench/preemption.py). The wait
is one all-reduce of three integers on gloo, under a millisecond on one node: under 0.4% of such a step.
Shorter steps keep the overlapped agreement, where a millisecond would be a measurable share."""
RECORD_FILE = "preempted.json"
"""Written by rank 0 into the checkpoint root when the run stops on a signal: step, signal, checkpoint (and
the committed step a resume loads when that save failed). The root, not the output directory: a launcher and
its (spawned) workers may not share the latter."""

log = logging.getLogger(__name__)


class Preempted(Exception):
    """The run stopped on a signal after ``step``; ``checkpoint`` is the directory that holds that step, or
    None when no checkpoint of it could be saved, and then ``resumes_from`` is the committed step a resume
    loads instead (None: nothing is committed, a resume starts from the beginning)."""

    def __init__(self, step: int, signal_name: str, checkpoint: str | None, resumes_from: int | None = None):
        self.step, self.signal_name, self.checkpoint = step, signal_name, checkpoint
        self.resumes_from = resumes_from
        if checkpoint:
            then = "the same command resumes from it"
        elif resumes_from is not None:
            then = f"the same command resumes from the committed step {resumes_from}"
        else:
            then = "nothing is committed, so the same command starts from the beginning"
        super().__init__(f"{self.headline}; {then}")

    @property
    def headline(self) -> str:
        """Where the run stopped and what it saved, without the advice (which depends on the launcher)."""
        where = self.checkpoint.rsplit("/", 1)[0] if self.checkpoint else None
        saved = (f"checkpoint step-{self.step} saved in {where}" if self.checkpoint
                 else "no checkpoint of it was saved")
        return f"preempted at step {self.step} by {self.signal_name}: {saved}"

    def to_record(self) -> dict:
        return {"step": self.step, "signal": self.signal_name, "checkpoint": self.checkpoint,
                "resumes_from": self.resumes_from}

    @classmethod
    def from_record(cls, record: dict) -> Preempted:
        resumes_from = record.get("resumes_from")
        return cls(int(record["step"]), str(record["signal"]), record.get("checkpoint"),
                   None if resumes_from is None else int(resumes_from))


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


def launcher_kill_after(environ: Mapping[str, str] = os.environ) -> tuple[float, str]:
    """Seconds from a signal to the launcher's SIGKILL, and where that figure comes from (for messages)."""
    for name in SHUTDOWN_TIMEOUT_ENV:
        value = environ.get(name, "").strip()
        try:
            return float(value), f"{name}={value}"
        except ValueError:
            continue
    return DEFAULT_KILL_AFTER_S, ("TORCH_ELASTIC_SHUTDOWN_TIMEOUT, torch elastic's shutdown timeout, and "
                                  "Kubernetes' terminationGracePeriodSeconds both default to 30 s")


def grace_warning(grace_s: float, environ: Mapping[str, str] = os.environ) -> str | None:
    """Why a grace of ``grace_s`` cannot work under this process's launcher (its SIGKILL comes first), naming
    the value, the limit and the fix; None when the grace fits."""
    kill_after, source = launcher_kill_after(environ)
    if grace_s < kill_after:
        return None
    return (f"checkpoint.preemption_grace_s={grace_s:g} is not under the {kill_after:g} s after which a "
            f"signalled worker is SIGKILLed ({source}): a save that needs the whole grace is killed before "
            "it ends, and the run's records miss their last copy. Lower checkpoint.preemption_grace_s under "
            f"{kill_after:g}, or raise the limit above it: TORCH_ELASTIC_SHUTDOWN_TIMEOUT for torchrun and "
            "torch elastic, and the pod's terminationGracePeriodSeconds on Kubernetes")


class Agreement(NamedTuple):
    """What every rank does at a step boundary, the same on all of them."""

    stop: bool
    save: bool


class PreemptionWatch:
    """Signal handlers for one run (restored by :meth:`close`) and the ranks' agreement on when to stop and
    when to save.

    ``committed`` says what a resume would load (e.g. "the committed checkpoint step 40 in ... stays the one
    a resume loads"), for the out-of-time message, which only the ``main`` rank prints, as it alone warns
    about a grace the launcher's SIGKILL cuts short (:func:`grace_warning`). ``last_copy``, when set, copies
    the run's records when the grace runs out, in the time left before that SIGKILL.
    """

    def __init__(self, grace_s: float, world_size: int = 1, committed: Callable[[], str] | None = None, *,
                 main: bool = True):
        self.grace_s, self.main = grace_s, main
        self.committed = committed
        self.last_copy: Callable[[], None] | None = None
        self.kill_after_s = launcher_kill_after()[0]
        self.signal_name: str | None = None
        self.deadline: float | None = None
        self._kill_at: float | None = None
        self._previous: dict[int, object] = {}
        self._timer: threading.Timer | None = None
        self._ending = threading.Lock()
        self._group = self._flags = self._work = None
        self._prompt, self._boundary_at = False, None
        if main and (warning := grace_warning(grace_s)):
            log.warning(warning)
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
        now = time.monotonic()
        self.deadline, self._kill_at = now + self.grace_s, now + self.kill_after_s
        self._timer = threading.Timer(self.grace_s, self._out_of_time)
        # Not a daemon: once the grace has run out, this process ends here (exit code 75, the records
        # copied), never on a main thread that meanwhile failed over a peer that exited.
        self._timer.daemon = False
        self._timer.start()

    def _out_of_time(self, failure: BaseException | None = None) -> None:
        """Copy the records, say (once, on the main rank) what a resume loads, and exit without unwinding;
        ``failure``: the error that ended the run first, within the grace.

        The exit commits, prunes and deletes nothing: a save still being written has no commit marker and is
        never loaded. One that commits while the records are copied is complete, and ``committed`` names it.
        """
        if not self._ending.acquire(blocking=False):  # the timer and a failed run's unwinding both got here
            threading.Event().wait()  # the first one ends the process
        self._copy_records()
        if self.main:
            stays = (self.committed() if self.committed
                     else "the last complete checkpoint stays the one a resume loads")
            first = f" (the run failed first: {type(failure).__name__}: {failure})" if failure else ""
            print(f"preempted by {self.signal_name}: the step and its checkpoint did not finish within "
                  f"checkpoint.preemption_grace_s={self.grace_s:g}{first}; exiting: {stays}", flush=True,
                  file=sys.stderr)
        os._exit(PREEMPTED_EXIT_CODE)

    def _copy_records(self) -> None:
        """Run ``last_copy`` for at most the time left before the launcher's SIGKILL (a store that hangs
        must not keep this process from exiting 75 on its own)."""
        if self.last_copy is None:
            return
        left = self._kill_at - EXIT_MARGIN_S - time.monotonic()
        if left <= 0:
            log.warning("no time is left before the launcher's SIGKILL to copy the run's records")
            return
        copy = threading.Thread(target=self.last_copy, name="records-last-copy", daemon=True)
        copy.start()
        copy.join(left)
        if copy.is_alive():
            log.warning("the last copy of the run's records did not finish in the %.1f s left before the "
                        "launcher's SIGKILL", left)

    def agree(self, save_due: bool = False) -> Agreement:
        """At a step boundary, on every rank: whether every rank stops here (any rank was signalled) and
        whether every rank saves here (any rank's ``save_due``: its ``checkpoint.every_s`` ran out).

        Distributed, the answer is the one agreed from the flags of the previous boundary (a collective
        started there, read here, so it overlaps a step); this boundary's flags go into the next one. A
        rank whose save the agreement already calls for does not propose another. Once the ranks have agreed
        that a step took PROMPT_STEP_S or longer, each boundary also waits for its own flags' agreement (see
        PROMPT_STEP_S); every rank reads that from the same agreement, so all wait at the same boundaries.
        """
        now = time.monotonic()
        long_step = self._boundary_at is not None and now - self._boundary_at >= PROMPT_STEP_S
        self._boundary_at = now
        if self._group is None:
            return Agreement(stop=self.signal_name is not None, save=save_due)
        agreed = self._read() if self._work is not None else Agreement(stop=False, save=False)
        if agreed.stop:
            return agreed
        self._flags = torch.tensor([int(self.signal_name is not None), int(save_due and not agreed.save),
                                    int(long_step)], dtype=torch.int32)
        self._work = dist.all_reduce(self._flags, op=dist.ReduceOp.MAX, group=self._group, async_op=True)
        if not self._prompt:
            return agreed
        now_agreed = self._read()
        return Agreement(stop=now_agreed.stop, save=agreed.save or now_agreed.save)

    def _read(self) -> Agreement:
        """Wait for the agreement in flight; note whether it calls for prompt agreements from now on."""
        self._work.wait()
        self._work = None
        self._prompt = bool(self._flags[2])
        return Agreement(stop=bool(self._flags[0]), save=bool(self._flags[1]))

    def finish(self) -> None:
        """The loop ended normally: wait for the last agreement every rank started."""
        if self._work is not None:
            self._work.wait()
            self._work = None

    def __enter__(self) -> PreemptionWatch:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: object) -> None:
        """A run that fails after a signal, before its grace runs out, ends as one whose grace ran out (exit
        75, the records copied, the main rank saying what a resume loads): its peers' grace ran out first
        and the collective it waited in lost them. Only a finished stop (:class:`Preempted`) unwinds."""
        if exc is not None and not isinstance(exc, Preempted) and self._timer is not None:
            self._timer.cancel()
            self._out_of_time(exc)
        self.close()

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
