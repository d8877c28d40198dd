"""Why a train task's workers failed: the first failing rank, its exit code or signal, the end of its stderr.

torch elastic's ChildFailedError holds each failed worker's exit code (a negative one for a signal) and, for
a Python exception, the traceback from its error file; what a worker printed last (a C++ or NCCL abort, an
OOM message) is only in its stderr, which the kfpytorch plugin lets through to the pod's log, mixed with
every other worker's. So each worker copies its stderr into a file of its own (:func:`captured_stderr`),
and the task's error starts with the first failure and that file's last lines (:func:`first_failure`).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # tasks.slurm.job reads preemption_signal on every Slurm node, without torch
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

STDERR_DIR_ENV = "TRAIN_WORKER_STDERR_DIR"
"""Set by the train task for its workers: the directory of their ``rank-<N>.log`` stderr copies."""
TAIL_LINES = 15
# first_failure()'s opening words for a worker ended by a signal, as killed_rank() reads them back.
# The first words of a preempted attempt's error (traincore.run.preemption.Preempted.headline, and
# tasks.train.stop_preempted's and tasks.slurm.job's own when no step was saved).
_PREEMPTED = re.compile(r"\b(?:preempted at step \d+|stopped) by (SIG[A-Z]+)\b")
_KILLED = re.compile(r"\brank (\d+) failed first \(killed by ([^,]+), pid")
# Signals that end a worker from outside, so the worker leaves no error file: the OOM killer or a lost node
# (SIGKILL), eviction or preemption (SIGTERM, SIGINT, SIGHUP), a write to a vanished peer (SIGPIPE), NCCL's
# watchdog aborting a collective that a lost peer never joined (SIGABRT). A worker's own crash (SIGSEGV,
# SIGBUS, SIGILL, SIGFPE) is not among them: it stays a user error.
VANISHED_SIGNALS = frozenset({signal.SIGKILL, signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGPIPE,
                              signal.SIGABRT})


@contextlib.contextmanager
def captured_stderr(rank: int) -> Iterator[None]:
    """Copy this worker's stderr (file descriptor 2: Python, C++ and NCCL output alike) into
    ``$TRAIN_WORKER_STDERR_DIR/rank-<rank>.log`` while it still reaches the original stderr.

    Through a ``tee`` process in a session of its own: it outlives a SIGKILLed worker and writes every line
    the worker wrote (a copying thread would die with the worker and lose what the pipe still held), and
    neither a Ctrl-C to the terminal's process group nor a signal to the job's processes stops it while the
    worker saves its step; it exits once every writer of the pipe has.
    """
    directory = os.environ.get(STDERR_DIR_ENV)
    if not directory:
        yield
        return
    sys.stderr.flush()
    original = os.dup(2)
    # Signals ignored (inherited through exec): Slurm signals every process of a job step, a tee too.
    command = 'trap "" TERM INT HUP USR1; exec tee -a "$0"'
    tee = subprocess.Popen(["sh", "-c", command, str(Path(directory) / f"rank-{rank}.log")],
                           stdin=subprocess.PIPE, stdout=original, stderr=subprocess.DEVNULL,
                           start_new_session=True)
    os.dup2(tee.stdin.fileno(), 2)
    tee.stdin.close()
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(original, 2)  # the pipe's last write end here closes: tee reads to the end and exits
        os.close(original)
        with contextlib.suppress(subprocess.TimeoutExpired):  # loader processes may still hold the pipe
            tee.wait(timeout=10)


def stderr_tail(directory: str | Path | None, rank: int, lines: int = TAIL_LINES) -> list[str]:
    """The last ``lines`` lines rank ``rank`` wrote to its stderr, if it was captured."""
    if not directory:
        return []
    try:
        text = (Path(directory) / f"rank-{rank}.log").read_bytes()[-64 * 1024:]
    except OSError:
        return []
    return text.decode(errors="replace").splitlines()[-lines:]


def first_failure(error: ChildFailedError, directory: str | Path | None) -> str:
    """"rank R failed first (killed by SIGKILL, pid P)" and the last lines of its stderr."""
    rank, failure = error.get_first_failure()
    how = (f"killed by {failure.signal_name()}" if failure.exitcode < 0 else f"exit code {failure.exitcode}")
    text = f"rank {rank} failed first ({how}, pid {failure.pid})"
    tail = stderr_tail(directory, rank)
    if tail:
        text += ". The last lines of its stderr:\n" + "\n".join(f"  {line}" for line in tail)
    return text


def killed_rank(message: str) -> tuple[int, str] | None:
    """(rank, signal name) of the worker a signal killed, read from an error that :func:`first_failure`
    began (as a Slurm node's error document carries it); None when the first failure was not a kill."""
    match = _KILLED.search(message)
    return (int(match.group(1)), match.group(2)) if match else None


def preemption_signal(message: str) -> str | None:
    """The signal that stopped a preempted train task (a time limit's warning, an eviction, a preemption),
    read from its error: the preemption's own (``preempted at step N by SIGTERM``), or one that stopped it
    before a step (``stopped by SIGTERM ...``); None for any other error."""
    match = _PREEMPTED.search(message)
    return match.group(1) if match else None


def vanished_workers(error: ChildFailedError) -> list[str]:
    """The failed workers that a signal from outside ended before they could report an error.

    flytekitplugins-kfpytorch 1.16 calls a worker's failure recoverable only when the worker itself raised
    FlyteRecoverableException (it leaves a marker file next to its torch-elastic error file); a worker killed
    by a signal writes neither file, so a vanished peer would fail the task as a user error, without retries.
    """
    vanished = []
    for rank, failure in sorted(error.failures.items()):
        if failure.exitcode < 0 and -failure.exitcode in VANISHED_SIGNALS and not os.path.isfile(
                failure.error_file):
            vanished.append(f"rank {rank} ({failure.signal_name()}, pid {failure.pid})")
    return vanished
