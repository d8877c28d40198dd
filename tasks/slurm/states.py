"""Slurm job states and how to read them: every state mapped to an Outcome, and the parsers of scontrol
(text and JSON), sacct and ``scontrol --version`` output. No I/O: tests/tasks/slurm/ feeds it
outputs captured from real clusters.

Job states (Slurm 22.05 to 24.x; base states and state flags, see https://slurm.schedmd.com/job_state_codes.html)
map to an ``Outcome``:

==============================================================  ==========
PENDING, CONFIGURING, POWER_UP_NODE, REQUEUED, REQUEUE_FED,       QUEUED
REQUEUE_HOLD, RESV_DEL_HOLD, EXPEDITING
RUNNING, COMPLETING, SUSPENDED, STOPPED, SIGNALING, STAGE_OUT,    RUNNING
RESIZING, UPDATE_DB
COMPLETED                                                         SUCCEEDED
FAILED, OUT_OF_MEMORY, SPECIAL_EXIT                               FAILED
TIMEOUT, PREEMPTED, NODE_FAIL, BOOT_FAIL, LAUNCH_FAILED,          RETRYABLE
RECONFIG_FAIL, DEADLINE
CANCELLED, REVOKED                                                ABORTED
==============================================================  ==========

Choices worth knowing:

- TIMEOUT is RETRYABLE: the job asks for a warning signal before its time limit (tasks/slurm/job.py), saves
  a checkpoint on it, and the retry resumes from there; a job that makes no progress at all still ends
  once Flyte's retry budget is spent.
- COMPLETING is RUNNING: the epilog still runs on the nodes; the final state follows.
- DEADLINE is RETRYABLE: Slurm ends a job that can no longer finish before its ``--deadline`` because of
  how busy the cluster was, not because of the job's code; a later attempt can fit, and Flyte's retry
  budget bounds how often that is tried.
- REQUEUE_HOLD, RESV_DEL_HOLD are QUEUED: the job waits for a release by an operator; ``reason`` says so.
- When Slurm reports a base state together with flags (``scontrol --json`` from 23.11 on), the flag that
  Slurm's own text output would show wins (COMPLETING, STAGE_OUT, CONFIGURING, RESIZING, REQUEUED, ...), so
  the text and JSON forms of one job give one outcome. LAUNCH_FAILED and RECONFIG_FAIL mark a job that
  Slurm requeues itself: they only make it RETRYABLE once its base state is final; POWER_UP_NODE makes a
  RUNNING job QUEUED (its nodes still boot).
- An unrecognised state is never a success. While the controller still lists the job it counts as RUNNING
  (with a warning and the raw state in ``reason``): the controller forgets finished jobs after MinJobAge and
  ``sacct`` then decides; in ``sacct`` output (finished jobs only) an unrecognised state is FAILED.
"""

from __future__ import annotations

import enum
import json
import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)


class SlurmError(RuntimeError):
    """A Slurm command failed or its output could not be understood."""


class JobNotFoundError(SlurmError):
    """The job is unknown to the controller (never existed, or forgotten after MinJobAge)."""


class Outcome(str, enum.Enum):
    """What a job's Slurm state means for the caller (a Flyte connector maps these to phases)."""

    QUEUED = "QUEUED"
    RUNNING = "RUNNING"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    RETRYABLE = "RETRYABLE"
    ABORTED = "ABORTED"


# Base states: exactly one per job (JOB_STATE_BASE in slurm.h).
BASE_STATE_OUTCOMES: dict[str, Outcome] = {
    "PENDING": Outcome.QUEUED,
    "RUNNING": Outcome.RUNNING,
    "SUSPENDED": Outcome.RUNNING,
    "COMPLETED": Outcome.SUCCEEDED,
    "CANCELLED": Outcome.ABORTED,
    "FAILED": Outcome.FAILED,
    "TIMEOUT": Outcome.RETRYABLE,
    "NODE_FAIL": Outcome.RETRYABLE,
    "PREEMPTED": Outcome.RETRYABLE,
    "BOOT_FAIL": Outcome.RETRYABLE,
    "DEADLINE": Outcome.RETRYABLE,
    "OUT_OF_MEMORY": Outcome.FAILED,
}

# State flags (JOB_STATE_FLAGS): what each means when it is the only word Slurm printed.
FLAG_STATE_OUTCOMES: dict[str, Outcome] = {
    "COMPLETING": Outcome.RUNNING,
    "CONFIGURING": Outcome.QUEUED,
    "POWER_UP_NODE": Outcome.QUEUED,
    "REQUEUED": Outcome.QUEUED,
    "REQUEUE_FED": Outcome.QUEUED,
    "REQUEUE_HOLD": Outcome.QUEUED,
    "RESV_DEL_HOLD": Outcome.QUEUED,
    "EXPEDITING": Outcome.QUEUED,
    "STOPPED": Outcome.RUNNING,
    "SIGNALING": Outcome.RUNNING,
    "STAGE_OUT": Outcome.RUNNING,
    "UPDATE_DB": Outcome.RUNNING,
    "RESIZING": Outcome.RUNNING,
    "SPECIAL_EXIT": Outcome.FAILED,
    "REVOKED": Outcome.ABORTED,
    "LAUNCH_FAILED": Outcome.RETRYABLE,
    "RECONFIG_FAIL": Outcome.RETRYABLE,
}

STATE_OUTCOMES: dict[str, Outcome] = {**BASE_STATE_OUTCOMES, **FLAG_STATE_OUTCOMES}

# The flags Slurm's job_state_string() prints instead of the base state, in its order of precedence
# (src/common/slurm_protocol_defs.c): following it makes the JSON list agree with the text form.
_DISPLAY_FLAGS = ("COMPLETING", "STAGE_OUT", "CONFIGURING", "RESIZING", "REQUEUED", "REQUEUE_FED",
                  "REQUEUE_HOLD", "SPECIAL_EXIT", "STOPPED", "REVOKED", "RESV_DEL_HOLD", "SIGNALING")
_LIVE_BASES = frozenset({"PENDING", "RUNNING", "SUSPENDED"})
_REQUEUE_FAILURE_FLAGS = ("LAUNCH_FAILED", "RECONFIG_FAIL")

JOB_ID_PATTERN = re.compile(r"^\d+(_\d+)?(\+\d+)?$")
NOT_FOUND = "invalid job id specified"
ACCOUNTING_OFF = ("accounting storage is disabled", "slurmdbd", "accounting_storage/none")
_NONE_WORDS = frozenset({"", "none", "(null)", "n/a"})


@dataclass(frozen=True)
class JobInfo:
    """One Slurm job as the caller needs it.

    ``state`` is Slurm's base state where the output names it (JSON lists), else the one word Slurm
    printed (text and sacct show a flag such as COMPLETING instead of the base state); ``flags`` holds
    the other words. ``exit_code`` and ``signal`` come from ``ExitCode=N:S``; they are only meaningful
    once the job has ended (Slurm shows 0:0 while it waits). ``restarts`` counts Slurm's requeues of the job
    (after NODE_FAIL, say); a QUEUED job with restarts waits to run again.
    """

    job_id: str
    state: str
    outcome: Outcome
    exit_code: int | None = None
    reason: str | None = None
    stdout_path: str | None = None
    stderr_path: str | None = None
    node_count: int | None = None
    flags: tuple[str, ...] = ()
    signal: int | None = None
    restarts: int = 0

    @property
    def finished(self) -> bool:
        """True once the outcome is final (neither QUEUED nor RUNNING)."""
        return self.outcome not in (Outcome.QUEUED, Outcome.RUNNING)


# ----------------------------------------------------------------------------------------- state mapping


def normalise_state(word: str) -> str:
    """One Slurm state word in canonical form: upper case, ``CANCELLED by 0`` -> ``CANCELLED``, and a
    column-truncated ``OUT_OF_ME+`` (sacct's fixed-width output) -> ``OUT_OF_MEMORY`` when unambiguous."""
    text = word.strip().upper()
    text = text.split()[0] if text else ""
    if text.endswith("+"):
        stem = text.rstrip("+")
        matches = [name for name in STATE_OUTCOMES if name.startswith(stem)]
        text = matches[0] if len(matches) == 1 else stem
    return text


def classify_states(words: Sequence[str], unknown: Outcome = Outcome.RUNNING) -> tuple[str, tuple[str, ...],
                                                                                       Outcome, list[str]]:
    """Map the state words Slurm reported for one job to ``(state, flags, outcome, unrecognised words)``.

    ``unknown`` is the outcome when nothing is recognised (see the module docstring); an unrecognised
    word never lets a job count as SUCCEEDED.
    """
    names = [name for name in (normalise_state(word) for word in words) if name]
    if not names:
        raise SlurmError("Slurm reported no job state at all; cannot tell what the job is doing")
    unrecognised = [name for name in names if name not in STATE_OUTCOMES]
    base = next((name for name in names if name in BASE_STATE_OUTCOMES), None)
    flags = [name for name in names if name in FLAG_STATE_OUTCOMES]
    display = next((flag for flag in _DISPLAY_FLAGS if flag in flags), None)
    if display:
        outcome = FLAG_STATE_OUTCOMES[display]
    elif base in _LIVE_BASES:
        outcome = Outcome.QUEUED if "POWER_UP_NODE" in flags else BASE_STATE_OUTCOMES[base]
    elif base and any(flag in flags for flag in _REQUEUE_FAILURE_FLAGS):
        outcome = Outcome.RETRYABLE
    elif base:
        outcome = BASE_STATE_OUTCOMES[base]
    elif flags:
        outcome = FLAG_STATE_OUTCOMES[flags[0]]
    else:
        outcome = unknown
    if unrecognised and outcome is Outcome.SUCCEEDED:
        outcome = unknown
    state = base or (flags[0] if flags else names[0])
    rest = list(names)
    rest.remove(state)
    return state, tuple(rest), outcome, unrecognised


def _with_unrecognised(reason: str | None, unrecognised: list[str], outcome: Outcome,
                       job_id: str) -> str | None:
    """Log and record state words this module does not know (a newer Slurm), without stopping a poll."""
    if not unrecognised:
        return reason
    note = f"unrecognised Slurm job state {'+'.join(unrecognised)}, treated as {outcome.value}"
    log.warning("job %s: %s", job_id, note)
    return f"{reason}; {note}" if reason else note


def _clean(value: Any) -> str | None:
    """Slurm's 'nothing here' spellings (None, (null), empty) as None; other values as stripped text."""
    if value is None:
        return None
    text = str(value).strip()
    return None if text.lower() in _NONE_WORDS else text


def parse_exit_code(text: str | None) -> tuple[int | None, int | None]:
    """``"3:0"`` -> ``(3, 0)``: Slurm's ExitCode is exit status, colon, signal number."""
    match = re.match(r"^\s*(\d+)(?::(\d+))?", text or "")
    if not match:
        return None, None
    signal = int(match.group(2)) if match.group(2) is not None else None
    return int(match.group(1)), signal


def _leading_int(text: str | None) -> int | None:
    """The first integer in ``text`` (``NumNodes=2-2`` while pending, ``2`` once running), else None."""
    match = re.match(r"^\s*(\d+)", text or "")
    return int(match.group(1)) if match else None


# ------------------------------------------------------------------------------------------------ parsers

_TEXT_KEY = re.compile(r"(?:^|\s)([A-Za-z][\w:/]*)=")


def _scontrol_fields(line: str) -> dict[str, str]:
    """``Key=Value Key=Value`` of one ``scontrol show job -o`` line; values may hold '=' or spaces."""
    matches = list(_TEXT_KEY.finditer(line))
    fields: dict[str, str] = {}
    for index, match in enumerate(matches):
        end = matches[index + 1].start() if index + 1 < len(matches) else len(line)
        fields.setdefault(match.group(1), line[match.end():end].strip())
    return fields


def parse_scontrol_text(line: str) -> JobInfo:
    """Parse one line of ``scontrol show job -o ID`` (every Slurm version, the only form on 22.05)."""
    fields = _scontrol_fields(line.strip())
    if "JobId" not in fields or "JobState" not in fields:
        raise SlurmError(f"cannot read scontrol output (no JobId/JobState): {line.strip()[:200]!r}")
    job_id = fields["JobId"]
    state, flags, outcome, unrecognised = classify_states([fields["JobState"]], Outcome.RUNNING)
    exit_code, signal = parse_exit_code(fields.get("ExitCode"))
    reason = _with_unrecognised(_clean(fields.get("Reason")), unrecognised, outcome, job_id)
    return JobInfo(job_id=job_id, state=state, outcome=outcome, exit_code=exit_code, reason=reason,
                   stdout_path=_clean(fields.get("StdOut")), stderr_path=_clean(fields.get("StdErr")),
                   node_count=_leading_int(fields.get("NumNodes")), flags=flags, signal=signal,
                   restarts=_leading_int(fields.get("Restarts")) or 0)


def _number(value: Any) -> int | None:
    """An integer from Slurm JSON: a number, or ``{"set": true, "number": N}`` (data_parser >= 0.0.40)."""
    if isinstance(value, dict):
        if not value.get("set", True) or value.get("infinite"):
            return None
        value = value.get("number")
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _json_exit_code(value: Any) -> tuple[int | None, int | None]:
    """Exit status and signal from the JSON ``exit_code``: an int (older data parsers) or an object
    ``{"status": ..., "return_code": N | {"number": N}, "signal": {"id" | "signal_id": ...}}``."""
    if isinstance(value, dict):
        signal_obj = value.get("signal") or {}
        signal = _number(signal_obj.get("id", signal_obj.get("signal_id"))) if isinstance(signal_obj, dict) \
            else None
        return _number(value.get("return_code")), signal
    if isinstance(value, str):
        return parse_exit_code(value)
    return _number(value), None


def _json_job(text: str, job_id: str) -> dict[str, Any]:
    """The record for ``job_id`` in ``scontrol --json show job`` output."""
    try:
        document = json.loads(text)
    except ValueError as exc:
        raise SlurmError(f"scontrol --json printed something that is not JSON ({exc}): "
                         f"{text[:200]!r}") from exc
    jobs = document.get("jobs") if isinstance(document, dict) else None
    if not jobs:
        errors = document.get("errors") if isinstance(document, dict) else None
        if errors and NOT_FOUND in json.dumps(errors).lower():
            raise JobNotFoundError(f"job {job_id} is not known to slurmctld")
        raise SlurmError(f"scontrol --json lists no job {job_id}: {text[:300]!r}")
    wanted = str(job_id).split("_")[0].split("+")[0]
    return next((job for job in jobs if str(job.get("job_id")) == wanted), jobs[0])


def parse_scontrol_json(text: str, job_id: str) -> JobInfo:
    """Parse ``scontrol --json show job ID`` (Slurm >= 23.02): ``job_state`` is a string in 23.02 and a
    list of base state and flags from 23.11; ``exit_code`` is a number or an object (see _json_exit_code)."""
    job = _json_job(text, job_id)
    raw_state = job.get("job_state")
    words = [raw_state] if isinstance(raw_state, str) else list(raw_state or [])
    state, flags, outcome, unrecognised = classify_states(words, Outcome.RUNNING)
    exit_code, signal = _json_exit_code(job.get("exit_code"))
    reason = _with_unrecognised(_clean(job.get("state_reason")), unrecognised, outcome, str(job_id))
    return JobInfo(job_id=str(job.get("job_id", job_id)), state=state, outcome=outcome, exit_code=exit_code,
                   reason=reason, stdout_path=_clean(job.get("standard_output")),
                   stderr_path=_clean(job.get("standard_error")), node_count=_number(job.get("node_count")),
                   flags=flags, signal=signal, restarts=_number(job.get("restart_cnt")) or 0)


SACCT_FORMAT = "JobID,State,ExitCode,NNodes,Reason"


def parse_sacct(text: str, job_id: str | None = None) -> JobInfo:
    """Parse ``sacct -X --parsable2 --noheader --format JobID,State,ExitCode,NNodes,Reason`` output.

    sacct answers for jobs the controller has forgotten, i.e. finished ones, so an unrecognised state
    there is FAILED (with the raw state in ``reason``), never RUNNING forever.
    """
    rows = [line.split("|") for line in text.splitlines() if line.strip()]
    if job_id is not None:
        rows = [row for row in rows if row[0] == str(job_id)] or rows
    if not rows:
        raise JobNotFoundError(f"sacct has no record of job {job_id or '(any)'}")
    row = rows[0] + [""] * (5 - len(rows[0]))
    found_id, raw_state, raw_exit, raw_nodes, raw_reason = row[:5]
    state, flags, outcome, unrecognised = classify_states([raw_state], Outcome.FAILED)
    exit_code, signal = parse_exit_code(raw_exit)
    reason = _with_unrecognised(_clean(raw_reason), unrecognised, outcome, found_id)
    return JobInfo(job_id=found_id, state=state, outcome=outcome, exit_code=exit_code, reason=reason,
                   node_count=_leading_int(raw_nodes), flags=flags, signal=signal)


def parse_slurm_version(text: str) -> tuple[int, int, int]:
    """``slurm 22.05.8`` / ``slurm-wlm 23.11.4`` (``scontrol --version``) -> ``(22, 5, 8)``."""
    match = re.search(r"(\d+)\.(\d+)(?:\.(\d+))?", text)
    if not match:
        raise SlurmError(f"cannot read a Slurm version from {text.strip()[:100]!r}")
    return int(match.group(1)), int(match.group(2)), int(match.group(3) or 0)


JSON_MIN_VERSION = (23, 2, 0)  # scontrol --json arrived in 23.02
