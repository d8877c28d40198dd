"""What a finished Slurm job tells its user: one headline, rank 0's summary, or the first failure with the
stderr of the node it happened on and the step a retry resumes from."""

from __future__ import annotations

import signal
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from tasks.slurm.job import job_outcome, node_stderr, task_failures
from tasks.slurm.states import JobInfo, Outcome
from tasks.storage import resume_note

TAIL_LINES = 40  # of a failed node's stderr (and of a finished job's stdout) in its message
ERROR_LINES = 60  # of the first failure's error document (the end of its traceback)
# Only for these states does Slurm's exit code describe the job's own end: a job Slurm cancelled or timed
# out shows 0:0 or the signal Slurm sent, which says nothing about the task.
_EXIT_STATES = frozenset({"FAILED", "OUT_OF_MEMORY"})

Tail = Callable[[str, int], Awaitable[str]]  # (remote path, lines) -> the file's last lines


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def headline(job: JobInfo, target: str, preempted_by: str | None = None) -> str:
    """``Slurm job 12 FAILED, exit code 1 on hpc-login``: the state, how it ended where that means
    something, Slurm's reason and the cluster. A job whose nodes stopped on a signal from Slurm
    (``preempted_by``: a time limit's warning, or a preemption with a grace time) and ended on their own
    says so instead of FAILED."""
    if preempted_by and job.state in _EXIT_STATES:
        return (f"Slurm job {job.job_id} signalled ({preempted_by}: its time limit was near, or it was "
                f"preempted) on {target}")
    text = f"Slurm job {job.job_id} {job.state}"
    if job.state in _EXIT_STATES:
        if job.signal:
            text += f", killed by {_signal_name(job.signal)}"
        elif job.exit_code is not None:
            text += f", exit code {job.exit_code}"
    if job.reason:
        text += f" ({job.reason})"
    return f"{text} on {target}"


async def success_message(job: JobInfo, target: str, tail: Tail) -> str:
    """Where it ran and its log, then rank 0's summary lines (``train: ...``) from the job's stdout."""
    lines = [f"Slurm job {job.job_id} COMPLETED on {job.node_count or '?'} node(s) of {target}; log "
             f"{job.stdout_path}"]
    if job.stdout_path:
        stdout = await tail(job.stdout_path, TAIL_LINES)
        lines += [line for line in stdout.splitlines() if line.startswith("train:")]
    return "\n".join(lines)


def _last_lines(text: str, count: int) -> str:
    lines = text.splitlines()
    return "\n".join((["..."] if len(lines) > count else []) + lines[-count:])


@dataclass(frozen=True)
class JobEnd:
    """How a finished job ended, for its task: the outcome, the message, and the signal that preempted it
    (None unless its nodes stopped on one and saved what they could)."""

    outcome: Outcome
    message: str
    preempted_by: str | None = None


async def failure_message(job: JobInfo, target: str, output_prefix: str, checkpoint_root: str,
                          tail: Tail) -> JobEnd:
    """A failed job's outcome (from its state and the nodes' error documents) and its message: the
    headline, the first failure (node, rank and signal where one killed a worker, the end of its error),
    where a retry resumes, and the last lines of the failed node's stderr (else the job's)."""
    failures = task_failures(output_prefix)
    outcome = job_outcome(job, failures)
    preempted_by = failures[0].preempted_by if failures and outcome is Outcome.RETRYABLE else None
    parts = [headline(job, target, preempted_by)]
    stderr = job.stderr_path
    if failures:
        first = failures[0]
        parts += [f"first failure: {first.summary()}", _last_lines(first.message, ERROR_LINES)]
        if first.node and stderr:
            stderr = node_stderr(stderr, job.job_id, first.node)
    if outcome is Outcome.RETRYABLE:
        parts.append(resume_note(checkpoint_root))
    if stderr:
        text = await tail(stderr, TAIL_LINES)
        if text.strip():
            parts.append(f"last lines of {stderr}:\n{text.rstrip()}")
    return JobEnd(outcome, "\n".join(parts), preempted_by)
