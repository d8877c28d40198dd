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
"""

from __future__ import annotations

import asyncio
import logging
import re
import shlex
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tasks.slurm.ssh import SlurmConnectionError, SlurmTarget, connect
from tasks.slurm.states import (
    ACCOUNTING_OFF,
    JOB_ID_PATTERN,
    JSON_MIN_VERSION,
    NOT_FOUND,
    SACCT_FORMAT,
    JobInfo,
    JobNotFoundError,
    SlurmError,
    parse_sacct,
    parse_scontrol_json,
    parse_scontrol_text,
    parse_slurm_version,
)

if TYPE_CHECKING:
    import asyncssh  # imported where a command runs: see tasks.slurm.ssh

log = logging.getLogger(__name__)

ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


@dataclass(frozen=True)
class CommandResult:
    """What a remote command returned: exit status (-1 when killed by a signal), stdout, stderr."""

    status: int
    stdout: str
    stderr: str


@dataclass(frozen=True)
class NodeSize:
    """One node as Slurm describes it: its name, CPUs and memory (RealMemory, in MB)."""

    name: str
    cpus: int
    mem_mb: int


def _check_job_id(job_id: str | int) -> str:
    """A job id is interpolated into remote shell commands: accept only Slurm's id shapes."""
    text = str(job_id).strip()
    if not JOB_ID_PATTERN.match(text):
        raise ValueError(f"not a Slurm job id: {job_id!r} (expected digits, e.g. 1234, 1234_5 or 1234+0)")
    return text


def _remote_path(path: str) -> str:
    """SFTP does not expand '~': ``~/x`` becomes ``x``, which SFTP and a login shell both take from $HOME."""
    if path in ("~", "~/"):
        return "."
    return path[2:] if path.startswith("~/") else path


def _env_lines(env: Mapping[str, str]) -> str:
    """``NAME=value`` lines for the remote shell's ``export``; names are checked, values are one line."""
    for name, value in env.items():
        if not ENV_NAME.match(name) or "\n" in value:
            raise ValueError(f"cannot pass environment variable {name!r} to a Slurm job: the name must be a "
                             "shell identifier and the value a single line")
    return "".join(f"{name}={value}\n" for name, value in env.items())


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

    async def _exec(self, command: str, timeout_s: float | None = None, label: str | None = None,
                    stdin: str | None = None) -> CommandResult:
        """Run ``command`` remotely within the timeout, ``stdin`` written to its standard input; ``label``
        names it in errors instead of the full command line."""
        import asyncssh

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
            if stdin is not None:  # given only to commands that read it to its end: the channel stays open
                process.stdin.write(stdin)
                process.stdin.write_eof()
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
        import asyncssh

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

    async def submit(self, script: str, remote_dir: str, sbatch_args: Sequence[str] = (),
                     env: Mapping[str, str] | None = None) -> str:
        """Upload ``script`` into ``remote_dir`` and ``sbatch`` it from there; the new job's id.

        ``remote_dir`` (absolute, or relative to the remote home) is also the job's working directory
        unless ``sbatch_args`` say otherwise. ``env`` (credentials, say) reaches the job through sbatch's
        environment: its values travel on the SSH channel's standard input, never in a command line (which
        ``ps`` shows) or a file. sbatch's complaints come back as ``SlurmError``.
        """
        lines = _env_lines(env or {})
        filename = f"job-{uuid.uuid4().hex[:12]}.sbatch"
        path = await self._upload(script, remote_dir, filename)
        args = " ".join(shlex.quote(arg) for arg in sbatch_args)
        workdir = shlex.quote(_remote_path(remote_dir))
        # The script's name, not its path: a relative remote_dir would be resolved twice after the cd.
        # sbatch exports its whole environment to the job by default (--export=ALL).
        command = (f"cd {workdir} && while IFS= read -r assignment; do export \"$assignment\"; done && "
                   f"sbatch --parsable {args} {shlex.quote(filename)}")
        result = await self._exec(command, label="sbatch", stdin=lines)
        if result.status != 0:
            raise SlurmError(f"sbatch rejected the job (exit {result.status}): "
                             f"{result.stderr.strip() or result.stdout.strip()}")
        # --parsable prints "<id>" or "<id>;<cluster>"; warnings may precede it on stdout.
        lines = [line.strip() for line in result.stdout.splitlines() if line.strip()]
        job_id = lines[-1].split(";")[0] if lines else ""
        if not JOB_ID_PATTERN.match(job_id):
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
        if NOT_FOUND in combined.lower():
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
        if NOT_FOUND in combined.lower():
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
        if result.status != 0 or any(marker in message.lower() for marker in ACCOUNTING_OFF):
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
        if NOT_FOUND in lowered or "already completing or completed" in lowered:
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

    async def prune(self, parent: str, keep: int, quiet_minutes: int = 24 * 60) -> None:
        """Remove the subdirectories of ``parent`` beyond the newest ``keep``, except those where anything
        changed in the last ``quiet_minutes`` (a job that still runs writes its logs there)."""
        quoted = shlex.quote(_remote_path(parent))
        await self.run(f"cd {quoted} 2>/dev/null || exit 0; ls -1t | tail -n +{int(keep) + 1} | "
                       "while IFS= read -r d; do [ -d \"$d\" ] && "
                       f"[ -z \"$(find \"$d\" -mmin -{int(quiet_minutes)} -print -quit)\" ] && "
                       "rm -rf -- \"$d\"; done; exit 0")

    async def node_sizes(self, partition: str | None = None) -> list[NodeSize]:
        """The nodes of ``partition`` (the cluster's default partition when None) with their CPUs and
        memory, largest first, from sinfo (one line per node and partition)."""
        listing = await self.run("sinfo -h -N -o '%P|%N|%c|%m'")
        sizes = []
        for line in listing.splitlines():
            fields = line.strip().split("|")
            if len(fields) != 4 or not (fields[2].isdigit() and fields[3].isdigit()):
                continue
            name = fields[0].rstrip("*")
            if name == partition or (partition is None and fields[0].endswith("*")):
                sizes.append(NodeSize(fields[1], int(fields[2]), int(fields[3])))
        unique = list(dict.fromkeys(sizes))  # a node listed once per state it is in
        return sorted(unique, key=lambda size: (-size.cpus, -size.mem_mb, size.name))

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
