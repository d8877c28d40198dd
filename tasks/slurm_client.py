"""A small Slurm client over SSH: verified host keys, sbatch / scontrol / sacct / scancel, all job states.

No flytekit import: the Flyte connector (tasks/) wraps this module, and it is tested without Flyte.

Why not flytekitplugins-slurm's helpers: they poll ``scontrol --json`` (absent on Slurm 22.05, so every job
looks failed there), map few job states, disable host-key checking, take no port and call ``sys.exit`` on a
connection error. Here:

- ``connect`` applies the user's ``~/.ssh/config`` (a Host alias brings HostName, Port, User, IdentityFile),
  always verifies the server's host key against known_hosts and turns every failure (unknown host, wrong
  port, refused, unknown or changed host key, missing key, rejected key, timeout) into a
  ``SlurmConnectionError`` that names the problem and the fix. Every network step has a timeout.
- ``SlurmClient.job`` reads ``scontrol --json`` where the cluster has it (23.02+; detected once per
  connection), else the one-line text form of ``scontrol show job``; once the controller has forgotten a job
  (MinJobAge after it ended) it asks ``sacct``, and says so plainly when accounting is not available.

Job states (Slurm 22.05 to 24.x; base states and state flags, see https://slurm.schedmd.com/job_state_codes.html)
map to an ``Outcome``:

==============================================================  ==========
PENDING, CONFIGURING, POWER_UP_NODE, REQUEUED, REQUEUE_FED,       QUEUED
REQUEUE_HOLD, RESV_DEL_HOLD, EXPEDITING
RUNNING, COMPLETING, SUSPENDED, STOPPED, SIGNALING, STAGE_OUT,    RUNNING
RESIZING, UPDATE_DB
COMPLETED                                                         SUCCEEDED
FAILED, TIMEOUT, OUT_OF_MEMORY, SPECIAL_EXIT                      FAILED
PREEMPTED, NODE_FAIL, BOOT_FAIL, LAUNCH_FAILED, RECONFIG_FAIL,   RETRYABLE
DEADLINE
CANCELLED, REVOKED                                                ABORTED
==============================================================  ==========

Choices worth knowing:

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

import asyncio
import enum
import errno
import fnmatch
import json
import logging
import os
import re
import shlex
import socket
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import asyncssh

log = logging.getLogger(__name__)


class SlurmError(RuntimeError):
    """A Slurm command failed or its output could not be understood."""


class SlurmConnectionError(SlurmError):
    """The SSH connection to the Slurm login node could not be made or was lost."""


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
    "TIMEOUT": Outcome.FAILED,
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

_JOB_ID = re.compile(r"^\d+(_\d+)?(\+\d+)?$")
_NOT_FOUND = "invalid job id specified"
_ACCOUNTING_OFF = ("accounting storage is disabled", "slurmdbd", "accounting_storage/none")
_NONE_WORDS = frozenset({"", "none", "(null)", "n/a"})


@dataclass(frozen=True)
class JobInfo:
    """One Slurm job as the caller needs it.

    ``state`` is Slurm's base state where the output names it (JSON lists), else the one word Slurm
    printed (text and sacct show a flag such as COMPLETING instead of the base state); ``flags`` holds
    the other words. ``exit_code`` and ``signal`` come from ``ExitCode=N:S``; they are only meaningful
    once the job has ended (Slurm shows 0:0 while it waits).
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
                   node_count=_leading_int(fields.get("NumNodes")), flags=flags, signal=signal)


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
        if errors and _NOT_FOUND in json.dumps(errors).lower():
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
                   flags=flags, signal=signal)


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


# ------------------------------------------------------------------------------------------------ ssh


@dataclass(frozen=True)
class SlurmTarget:
    """Where the Slurm login node is and how to reach it.

    ``host`` is a Host alias from ``~/.ssh/config`` (its HostName, Port, User and IdentityFile apply) or a
    hostname. ``port``/``user``/``key_file`` override the config. ``known_hosts`` defaults to what the ssh
    config names (UserKnownHostsFile), else ``~/.ssh/known_hosts``. With ``key_file`` set only that key is
    offered (no agent keys), so what authenticates is predictable.
    """

    host: str
    port: int | None = None
    user: str | None = None
    key_file: str | None = None
    known_hosts: str | None = None
    connect_timeout_s: float = 20.0
    command_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        if not self.host or any(ch.isspace() for ch in self.host):
            raise ValueError(f"SlurmTarget.host must be an ssh Host alias or a hostname, got {self.host!r}")
        if self.port is not None and not 0 < self.port < 65536:
            raise ValueError(f"SlurmTarget.port must be between 1 and 65535, got {self.port}")
        if self.connect_timeout_s <= 0 or self.command_timeout_s <= 0:
            raise ValueError("SlurmTarget timeouts must be positive seconds, got "
                             f"connect_timeout_s={self.connect_timeout_s}, "
                             f"command_timeout_s={self.command_timeout_s}")


@dataclass(frozen=True)
class _Endpoint:
    """Where an alias really points once the ssh config is applied (for error messages)."""

    alias: str
    host: str
    port: int
    user: str

    def __str__(self) -> str:
        via = f" (Host alias {self.alias!r})" if self.alias != self.host else ""
        return f"{self.user}@{self.host}:{self.port}{via}"


def host_alias_known(alias: str, config_path: str | os.PathLike[str] | None = None) -> bool:
    """True when ``~/.ssh/config`` (or ``config_path``) has a ``Host`` pattern other than ``*`` that matches
    ``alias``: a pre-flight check that a configured alias was not mistyped. ``Include`` is not followed."""
    path = Path(config_path) if config_path else Path("~/.ssh/config").expanduser()
    try:
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return False
    for line in lines:
        words = line.split("#", 1)[0].replace("=", " ").split()
        if len(words) < 2 or words[0].lower() != "host":
            continue
        patterns = words[1:]
        negated = any(fnmatch.fnmatch(alias, p[1:]) for p in patterns if p.startswith("!"))
        if not negated and any(p != "*" and not p.startswith("!") and fnmatch.fnmatch(alias, p)
                               for p in patterns):
            return True
    return False


def _known_hosts_db(target: SlurmTarget, configured: Any) -> tuple[asyncssh.SSHKnownHosts, list[str]]:
    """The known_hosts entries to verify against, read from the files that apply, and those files.

    Reading them here (not leaving it to asyncssh) makes sure verification can never be switched off:
    asyncssh treats ``known_hosts=None`` (which ``UserKnownHostsFile none`` in ssh config produces) as
    'accept any key'.
    """
    if target.known_hosts:
        files = [os.path.expanduser(target.known_hosts)]
        if not os.path.isfile(files[0]):
            raise SlurmConnectionError(
                f"known_hosts file {files[0]} does not exist: create it with the server's verified host key "
                f"(ssh-keyscan -p PORT HOST > {files[0]}) or leave SlurmTarget.known_hosts unset")
    elif configured is None:
        raise SlurmConnectionError(
            f"the ssh config for {target.host!r} disables host key checking (UserKnownHostsFile none); this "
            "client always verifies host keys: remove that line or set SlurmTarget.known_hosts")
    elif configured in ((), [], b""):
        files = [os.path.expanduser("~/.ssh/known_hosts")]
    else:
        entries = [configured] if isinstance(configured, str) else list(configured)
        files = [os.path.expanduser(str(entry)) for entry in entries]
    existing = [path for path in files if os.path.isfile(path)]
    db = asyncssh.read_known_hosts(existing) if existing else asyncssh.import_known_hosts("")
    return db, files


async def _client_options(target: SlurmTarget) -> tuple[asyncssh.SSHClientConnectionOptions, _Endpoint,
                                                        list[str]]:
    """asyncssh options: ~/.ssh/config applied, our overrides, and a known_hosts that is always checked."""
    kwargs: dict[str, Any] = {"connect_timeout": target.connect_timeout_s,
                              "login_timeout": target.connect_timeout_s}
    if target.port is not None:
        kwargs["port"] = target.port
    if target.user:
        kwargs["username"] = target.user
    if target.key_file:
        key_path = os.path.expanduser(target.key_file)
        if not os.path.isfile(key_path):
            raise SlurmConnectionError(
                f"SSH key file {key_path} does not exist: point key_file at an existing private key, or "
                f"leave it unset to use ssh-agent / the IdentityFile of Host {target.host!r} in "
                "~/.ssh/config")
        kwargs.update(client_keys=[key_path], agent_path=None)
    try:
        # config=() loads ~/.ssh/config as asyncssh.connect does (the options default, None, loads nothing)
        options = await asyncssh.SSHClientConnectionOptions.construct(config=(), host=target.host, **kwargs)
    except asyncssh.KeyImportError as exc:
        raise SlurmConnectionError(
            f"cannot load the SSH private key for {target.host!r}: {exc}. An encrypted key must be loaded "
            "into ssh-agent (ssh-add) and key_file left unset") from None
    except FileNotFoundError as exc:
        raise SlurmConnectionError(
            f"{exc.filename} does not exist but the ssh config for {target.host!r} names it (IdentityFile or "
            "CertificateFile in ~/.ssh/config): fix the path there, or set SlurmTarget.key_file") from None
    except (OSError, ValueError) as exc:
        raise SlurmConnectionError(f"invalid SSH settings for {target.host!r} (ssh config or SlurmTarget): "
                                   f"{exc}") from None
    db, files = _known_hosts_db(target, options.known_hosts)
    options = await asyncssh.SSHClientConnectionOptions.construct(options, known_hosts=db)
    endpoint = _Endpoint(target.host, options.host, options.port, options.username)
    return options, endpoint, files


def _host_key_message(endpoint: _Endpoint, files: list[str]) -> str:
    """Unknown versus changed host key: both refused, with the fix for each."""
    pattern = endpoint.host if endpoint.port == 22 else f"[{endpoint.host}]:{endpoint.port}"
    target_file = files[0] if files else "~/.ssh/known_hosts"
    existing = [path for path in files if os.path.isfile(path)]
    try:
        db = asyncssh.read_known_hosts(existing) if existing else asyncssh.import_known_hosts("")
        known = bool(db.match(endpoint.host, "", endpoint.port)[0])
    except (OSError, ValueError):
        known = False
    if known:
        return (f"the host key of {endpoint} has CHANGED: it differs from the one in {', '.join(existing)}. "
                "This may be an attack; if the server was reinstalled, verify its new key, then remove the "
                f"old entry (ssh-keygen -R '{pattern}' -f {target_file}) and add the new one "
                f"(ssh-keyscan -p {endpoint.port} {endpoint.host} >> {target_file})")
    return (f"the host key of {endpoint} is not known (not in {', '.join(files) or target_file}); host keys "
            "are always verified. After checking its fingerprint, add it: "
            f"ssh-keyscan -p {endpoint.port} {endpoint.host} >> {target_file}")


def _is_refused(exc: OSError) -> bool:
    """asyncio reports several refused addresses (::1 and 127.0.0.1) as one OSError without errno."""
    return isinstance(exc, ConnectionRefusedError) or exc.errno == errno.ECONNREFUSED or (
        exc.errno is None and f"[Errno {errno.ECONNREFUSED}]" in str(exc))


def _connection_error(exc: BaseException, endpoint: _Endpoint, files: list[str], timeout_s: float) -> str:
    """A message that names the problem with this connection attempt and how to fix it."""
    fix_port = (f"Port for Host {endpoint.alias!r} in ~/.ssh/config or SlurmTarget.port"
                if host_alias_known(endpoint.alias) else "SlurmTarget.port (or a Host alias, ~/.ssh/config)")
    if isinstance(exc, asyncssh.HostKeyNotVerifiable):
        return _host_key_message(endpoint, files)
    if isinstance(exc, asyncssh.PermissionDenied):
        return (f"authentication failed for {endpoint}: the server accepted none of the offered keys. Check "
                f"User and IdentityFile for Host {endpoint.alias!r} in ~/.ssh/config (or SlurmTarget.user / "
                "key_file) and that the public key is in the remote ~/.ssh/authorized_keys")
    if isinstance(exc, asyncio.TimeoutError):
        return (f"no SSH connection to {endpoint} within {timeout_s:g} s: the host or port is wrong, the "
                f"host is down, or a firewall drops the packets. Check HostName and {fix_port}")
    if isinstance(exc, socket.gaierror):
        return (f"cannot resolve host {endpoint.host!r} ({exc.strerror}): use a Host alias defined in "
                "~/.ssh/config or a resolvable hostname")
    if isinstance(exc, OSError) and _is_refused(exc):
        return (f"connection refused by {endpoint.host}:{endpoint.port}: nothing listens on that port. Check "
                f"{fix_port}, and that sshd runs there")
    if isinstance(exc, OSError):
        return f"cannot reach {endpoint}: {exc}. Check HostName and {fix_port}"
    if isinstance(exc, asyncssh.DisconnectError):
        return (f"the SSH handshake with {endpoint} failed ({exc.reason}): is {endpoint.port} an SSH port? "
                f"Check {fix_port}")
    return f"SSH connection to {endpoint} failed: {type(exc).__name__}: {exc}"


async def connect(target: SlurmTarget) -> asyncssh.SSHClientConnection:
    """Open an SSH connection to the Slurm login node, host key verified, within ``connect_timeout_s``.

    Raises ``SlurmConnectionError`` with a specific message for every failure; never exits the process.
    """
    options, endpoint, files = await _client_options(target)
    log.info("connecting to Slurm login node %s", endpoint)
    try:
        # asyncssh bounds TCP connect + handshake + auth by connect_timeout; the outer bound is a backstop.
        return await asyncio.wait_for(asyncssh.connect(target.host, options=options),
                                      timeout=target.connect_timeout_s + 5)
    except (OSError, asyncssh.Error, asyncio.TimeoutError) as exc:
        message = _connection_error(exc, endpoint, files, target.connect_timeout_s)
        raise SlurmConnectionError(message) from None


# ------------------------------------------------------------------------------------------------ client


@dataclass(frozen=True)
class CommandResult:
    """What a remote command returned: exit status (-1 when killed by a signal), stdout, stderr."""

    status: int
    stdout: str
    stderr: str


def _check_job_id(job_id: str | int) -> str:
    """A job id is interpolated into remote shell commands: accept only Slurm's id shapes."""
    text = str(job_id).strip()
    if not _JOB_ID.match(text):
        raise ValueError(f"not a Slurm job id: {job_id!r} (expected digits, e.g. 1234, 1234_5 or 1234+0)")
    return text


def _remote_path(path: str) -> str:
    """SFTP does not expand '~': ``~/x`` becomes ``x``, which SFTP and a login shell both take from $HOME."""
    if path in ("~", "~/"):
        return "."
    return path[2:] if path.startswith("~/") else path


@dataclass
class SlurmClient:
    """One SSH connection to a Slurm login node, used as ``async with SlurmClient(target) as slurm:``."""

    target: SlurmTarget
    _conn: asyncssh.SSHClientConnection | None = field(default=None, init=False, repr=False)
    _json: bool | None = field(default=None, init=False, repr=False)
    _version: tuple[int, int, int] | None = field(default=None, init=False, repr=False)

    async def __aenter__(self) -> SlurmClient:
        self._conn = await connect(self.target)
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Close the connection (bounded: a dead peer must not hang the caller)."""
        conn, self._conn = self._conn, None
        if conn is None:
            return
        conn.close()
        try:
            await asyncio.wait_for(conn.wait_closed(), timeout=self.target.connect_timeout_s)
        except asyncio.TimeoutError:
            log.warning("SSH connection to %s did not close within %s s", self.target.host,
                        self.target.connect_timeout_s)

    def _connection(self) -> asyncssh.SSHClientConnection:
        if self._conn is None:
            raise SlurmError("SlurmClient is not connected: use it as 'async with SlurmClient(target) as c:'")
        return self._conn

    async def _exec(self, command: str, timeout_s: float | None = None,
                    label: str | None = None) -> CommandResult:
        """Run ``command`` remotely within the timeout; ``label`` names it in errors instead of the full
        command line (which may carry sbatch --export values)."""
        limit = timeout_s or self.target.command_timeout_s
        name = label or command
        host = self.target.host
        try:
            process = await asyncio.wait_for(
                self._connection().create_process(command, encoding="utf-8", errors="replace"), limit)
        except asyncio.TimeoutError:
            raise SlurmConnectionError(f"{host}: no session for {name!r} within {limit:g} s") from None
        except (OSError, asyncssh.Error) as exc:
            raise SlurmConnectionError(f"{host}: SSH connection lost running {name!r}: {exc}") from None
        try:
            done = await process.wait(timeout=limit)
        except asyncio.TimeoutError:
            process.close()  # closing the channel makes sshd hang up on the remote command
            raise SlurmError(f"{host}: {name!r} did not finish within {limit:g} s") from None
        except (OSError, asyncssh.Error) as exc:
            raise SlurmConnectionError(f"{host}: SSH connection lost running {name!r}: {exc}") from None
        status = done.exit_status if done.exit_status is not None and done.exit_status >= 0 else -1
        return CommandResult(status, str(done.stdout or ""), str(done.stderr or ""))

    async def run(self, command: str, timeout_s: float | None = None) -> str:
        """Run a shell command on the login node; its stdout, or ``SlurmError`` with its stderr."""
        result = await self._exec(command, timeout_s)
        if result.status != 0:
            raise SlurmError(f"{self.target.host}: {command!r} exited with {result.status}: "
                             f"{result.stderr.strip() or result.stdout.strip()}")
        return result.stdout

    async def slurm_version(self) -> tuple[int, int, int]:
        """The cluster's Slurm version from ``scontrol --version`` (asked once per connection)."""
        if self._version is None:
            self._version = parse_slurm_version(await self.run("scontrol --version"))
        return self._version

    async def missing_commands(self, names: Sequence[str]) -> list[str]:
        """Pre-flight: which of ``names`` (e.g. sbatch, srun) are not on the remote PATH."""
        missing = []
        for name in names:
            result = await self._exec(f"command -v {shlex.quote(name)}")
            if result.status != 0:
                missing.append(name)
        return missing

    async def _upload(self, text: str, remote_dir: str, filename: str) -> str:
        """Write ``text`` to ``remote_dir/filename`` over SFTP (creating the directory); the remote path."""
        directory = _remote_path(remote_dir).rstrip("/") or "/"
        path = f"{directory}/{filename}" if directory != "/" else f"/{filename}"

        async def upload() -> None:
            async with self._connection().start_sftp_client() as sftp:
                await sftp.makedirs(directory, exist_ok=True)
                async with sftp.open(path, "w") as handle:
                    await handle.write(text)

        try:
            await asyncio.wait_for(upload(), self.target.command_timeout_s)
        except asyncio.TimeoutError:
            raise SlurmError(f"{self.target.host}: uploading {path} did not finish within "
                             f"{self.target.command_timeout_s:g} s") from None
        except asyncssh.SFTPError as exc:
            raise SlurmError(f"{self.target.host}: cannot write {path} over SFTP: {exc.reason}") from None
        except asyncssh.ChannelOpenError as exc:
            raise SlurmError(f"{self.target.host}: the SSH server offers no SFTP ({exc.reason}); enable it "
                             "in sshd_config: 'Subsystem sftp internal-sftp'") from None
        return path

    async def submit(self, script: str, remote_dir: str, sbatch_args: Sequence[str] = ()) -> str:
        """Upload ``script`` into ``remote_dir`` and ``sbatch`` it from there; the new job's id.

        ``remote_dir`` (absolute, or relative to the remote home) is also the job's working directory
        unless ``sbatch_args`` say otherwise. sbatch's complaints come back as ``SlurmError``.
        """
        path = await self._upload(script, remote_dir, f"job-{uuid.uuid4().hex[:12]}.sbatch")
        args = " ".join(shlex.quote(arg) for arg in sbatch_args)
        workdir = shlex.quote(_remote_path(remote_dir))
        command = f"cd {workdir} && sbatch --parsable {args} {shlex.quote(path)}"
        result = await self._exec(command, label="sbatch")
        if result.status != 0:
            raise SlurmError(f"sbatch rejected the job (exit {result.status}): "
                             f"{result.stderr.strip() or result.stdout.strip()}")
        # --parsable prints "<id>" or "<id>;<cluster>"; warnings may precede it on stdout.
        lines = [line.strip() for line in result.stdout.splitlines() if line.strip()]
        job_id = lines[-1].split(";")[0] if lines else ""
        if not _JOB_ID.match(job_id):
            raise SlurmError(f"sbatch printed no job id: stdout={result.stdout.strip()!r} "
                             f"stderr={result.stderr.strip()!r}")
        log.info("submitted Slurm job %s (%s, %d bytes)", job_id, path, len(script))
        return job_id

    async def _use_json(self) -> bool:
        """Whether this cluster's scontrol has --json (23.02+); asked once per connection."""
        if self._json is None:
            self._json = await self.slurm_version() >= JSON_MIN_VERSION
        return self._json

    async def _job_from_json(self, job_id: str) -> JobInfo | None:
        """Status via ``scontrol --json``; None when this scontrol turns out not to support it."""
        result = await self._exec(f"scontrol --json show job {job_id}")
        combined = f"{result.stdout}\n{result.stderr}"
        if _NOT_FOUND in combined.lower():
            raise JobNotFoundError(f"job {job_id} is not known to slurmctld")
        if result.status == 0:
            try:
                return parse_scontrol_json(result.stdout, job_id)
            except JobNotFoundError:
                raise
            except SlurmError as exc:
                log.warning("scontrol --json unusable here (%s); using the text form from now on", exc)
        else:
            log.warning("scontrol --json failed (%s); using the text form from now on",
                        combined.strip()[:200])
        self._json = False
        return None

    async def _job_from_text(self, job_id: str) -> JobInfo:
        """Status via ``scontrol show job -o`` (one line per job record)."""
        result = await self._exec(f"scontrol show job -o {job_id}")
        combined = f"{result.stdout}\n{result.stderr}"
        if _NOT_FOUND in combined.lower():
            raise JobNotFoundError(f"job {job_id} is not known to slurmctld")
        if result.status != 0:
            raise SlurmError(f"scontrol show job {job_id} failed (exit {result.status}): {combined.strip()}")
        lines = [line for line in result.stdout.splitlines() if line.strip()]
        chosen = next((line for line in lines if f"JobId={job_id} " in f"{line} "), lines[0] if lines else "")
        return parse_scontrol_text(chosen)

    async def _job_from_sacct(self, job_id: str) -> JobInfo:
        """Status from accounting, for jobs the controller no longer lists."""
        result = await self._exec(f"sacct -j {job_id} -X --parsable2 --noheader --format {SACCT_FORMAT}")
        message = (result.stderr.strip() or result.stdout.strip())
        if result.status != 0 or any(marker in message.lower() for marker in _ACCOUNTING_OFF):
            raise SlurmError(
                f"job {job_id} is no longer listed by slurmctld (it ended more than MinJobAge ago) and job "
                f"accounting is unavailable, so its final state is unknown: sacct says {message!r}. Poll "
                "more often than MinJobAge (scontrol show config | grep MinJobAge) or enable accounting "
                "(slurmdbd)")
        try:
            return parse_sacct(result.stdout, job_id)
        except JobNotFoundError:
            raise JobNotFoundError(f"job {job_id} is known neither to slurmctld nor to accounting (sacct): "
                                   "is the id right, and is this the cluster it was submitted to?") from None

    async def job(self, job_id: str | int) -> JobInfo:
        """The job's state: scontrol (JSON where supported, else text), then sacct once scontrol forgot it."""
        job_id = _check_job_id(job_id)
        try:
            if await self._use_json():
                info = await self._job_from_json(job_id)
                if info is not None:
                    return info
            return await self._job_from_text(job_id)
        except JobNotFoundError:
            return await self._job_from_sacct(job_id)

    async def cancel(self, job_id: str | int) -> None:
        """``scancel`` the job; a job that already ended or is gone counts as cancelled (idempotent)."""
        job_id = _check_job_id(job_id)
        result = await self._exec(f"scancel {job_id}")
        message = (result.stderr.strip() or result.stdout.strip())
        if result.status == 0 and not message:
            return
        lowered = message.lower()
        if _NOT_FOUND in lowered or "already completing or completed" in lowered:
            log.info("scancel %s: job already ended (%s)", job_id, message)
            return
        if result.status != 0:
            raise SlurmError(f"scancel {job_id} failed (exit {result.status}): {message}")
        log.warning("scancel %s: %s", job_id, message)

    async def tail(self, path: str, lines: int = 50) -> str:
        """The last ``lines`` lines of a remote file (e.g. a job's stderr); empty when it does not exist."""
        if lines <= 0:
            raise ValueError(f"lines must be positive, got {lines}")
        quoted = shlex.quote(_remote_path(path))
        return await self.run(f"if [ -f {quoted} ]; then tail -n {int(lines)} -- {quoted}; fi")

    async def partition_nodes(self, partition: str | None = None) -> int:
        """Node count of ``partition`` (the cluster's default partition when None), from sinfo."""
        listing = await self.run("sinfo -h -o '%P|%D'")
        counts: dict[str, int] = {}
        default = None
        for line in listing.splitlines():
            name, _, count = line.strip().partition("|")
            if not name or not count.strip().isdigit():
                continue
            if name.endswith("*"):
                name = default = name[:-1]
            counts[name] = counts.get(name, 0) + int(count)
        wanted = partition if partition is not None else default
        if wanted is None:
            raise SlurmError(f"{self.target.host}: the cluster has no default partition; name one "
                             f"(partitions: {', '.join(sorted(counts)) or 'none'})")
        if wanted not in counts:
            raise SlurmError(f"{self.target.host}: no partition {wanted!r} "
                             f"(partitions: {', '.join(sorted(counts)) or 'none'})")
        return counts[wanted]
