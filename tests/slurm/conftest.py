"""The loopback Slurm cluster (scripts/slurm-loopback) as a session fixture.

`slurm_loopback` runs `scripts/slurm-loopback up` once per session (idempotent: a cluster that is already
up costs a couple of seconds) and `down` at the end only when a test session brought the cluster up.
Several pytest sessions may share the cluster at once: each holds a lease (a file named after its pid)
under $SLURM_LOOPBACK_DIR/test-sessions, and the last one out takes the cluster down, never one that
another session still uses. A cluster someone started by hand is left running. When the cluster cannot
start (not root, no apt, ...) the tests are skipped with the reason, or fail under CI=true.
"""

from __future__ import annotations

import fcntl
import os
import re
import shlex
import shutil
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "slurm-loopback"
SESSIONS = Path(os.environ.get("SLURM_LOOPBACK_DIR", "/var/tmp/slurm-loopback")) / "test-sessions"
STARTED_BY_TESTS = SESSIONS / "started-by-tests"


def _start_time(pid: int) -> str | None:
    """A process's start time (field 22 of /proc/PID/stat): a pid plus this names one process."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


@contextmanager
def _sessions_lock() -> Iterator[None]:
    SESSIONS.mkdir(parents=True, exist_ok=True)
    with open(SESSIONS / ".lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield


def _other_live_sessions() -> list[Path]:
    """Leases of other pytest sessions that still run (stale leases are removed)."""
    live = []
    for lease in SESSIONS.glob("pid-*"):
        pid = int(lease.name.removeprefix("pid-"))
        if pid == os.getpid():
            continue
        if _start_time(pid) is not None and _start_time(pid) == lease.read_text().strip():
            live.append(lease)
        else:
            lease.unlink(missing_ok=True)
    return live


def _unavailable(reason: str) -> None:
    message = f"loopback Slurm cluster unavailable: {reason}"
    if os.environ.get("CI") == "true":
        pytest.fail(message, pytrace=False)
    pytest.skip(message)


@dataclass(frozen=True)
class LoopbackCluster:
    """Handle on the running cluster: the ssh alias and helpers that go through it."""

    alias: str
    script: Path

    def ssh(self, *command: str, timeout: float = 60, check: bool = True) -> subprocess.CompletedProcess:
        """Run COMMAND (an argument list, quoted here for the remote shell) through the ssh alias."""
        return subprocess.run(["ssh", "-o", "BatchMode=yes", self.alias, shlex.join(command)],
                              capture_output=True, text=True, timeout=timeout, check=check,
                              stdin=subprocess.DEVNULL)

    def sbatch(self, *args: str) -> int:
        """Submit with `sbatch --parsable ARGS` through ssh; returns the job id."""
        out = self.ssh("sbatch", "--parsable", *args).stdout.strip()
        match = re.fullmatch(r"(\d+)(;\S+)?", out.splitlines()[-1] if out else "")
        assert match, f"unexpected sbatch output: {out!r}"
        return int(match.group(1))

    def script_cmd(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
        return subprocess.run([str(self.script), *args], capture_output=True, text=True, timeout=timeout)

    def finished(self) -> dict[int, tuple[str, int]]:
        """`slurm-loopback jobs` as {job id: (state, node count)}."""
        jobs: dict[int, tuple[str, int]] = {}
        for line in self.script_cmd("jobs").stdout.splitlines():
            fields = line.split()
            if len(fields) == 3 and fields[0].isdigit():
                jobs[int(fields[0])] = (fields[1], int(fields[2]))
        return jobs

    def wait_finished(self, job_id: int, timeout: float = 60) -> tuple[str, int]:
        """Poll `jobs` until JOB_ID is listed; returns (state, node count)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = self.finished().get(job_id)
            if found:
                return found
            time.sleep(0.5)
        state = self.ssh("scontrol", "show", "job", "-o", str(job_id), check=False).stdout
        raise AssertionError(f"job {job_id} not finished after {timeout:.0f} s: {state}")

    def wait_state(self, job_id: int, want: str, timeout: float = 30) -> None:
        """Poll squeue until JOB_ID is in state WANT (e.g. RUNNING)."""
        deadline = time.monotonic() + timeout
        state = ""
        while time.monotonic() < deadline:
            state = self.ssh("squeue", "-h", "-j", str(job_id), "-o", "%T", check=False).stdout.strip()
            if state == want:
                return
            time.sleep(0.5)
        raise AssertionError(f"job {job_id} not {want} after {timeout:.0f} s (last: {state!r})")


@pytest.fixture(scope="session")
def slurm_loopback() -> Iterator[LoopbackCluster]:
    if not SCRIPT.exists():
        _unavailable(f"{SCRIPT} is missing")
    if os.geteuid() != 0:
        _unavailable("scripts/slurm-loopback needs root (network namespaces, daemons)")
    if not (shutil.which("apt-get") or shutil.which("slurmctld")):
        _unavailable("neither Slurm nor apt-get is installed")
    if not shutil.which("ssh"):
        _unavailable("no ssh client")

    lease = SESSIONS / f"pid-{os.getpid()}"
    with _sessions_lock():
        status = subprocess.run([str(SCRIPT), "status"], capture_output=True, text=True, timeout=60)
        was_up = status.returncode == 0
        try:
            up = subprocess.run([str(SCRIPT), "up"], capture_output=True, text=True, timeout=1200)
        except subprocess.TimeoutExpired:
            _unavailable("`slurm-loopback up` did not finish within 20 minutes")
        if up.returncode != 0:
            tail = "\n".join((up.stderr or up.stdout).strip().splitlines()[-8:])
            _unavailable(f"`slurm-loopback up` exited {up.returncode}:\n{tail}")
        if not was_up:
            STARTED_BY_TESTS.touch()
        lease.write_text(_start_time(os.getpid()) or "")
    alias = up.stdout.strip().splitlines()[-1].strip()

    yield LoopbackCluster(alias=alias, script=SCRIPT)

    with _sessions_lock():
        lease.unlink(missing_ok=True)
        if STARTED_BY_TESTS.exists() and not _other_live_sessions():
            subprocess.run([str(SCRIPT), "down"], capture_output=True, text=True, timeout=300)
            STARTED_BY_TESTS.unlink(missing_ok=True)


BRIDGE_ADDRESS = "10.233.71.1"  # scripts/slurm-loopback's HOST_IP: the host side of both nodes' network


@pytest.fixture(scope="session")
def bridge_s3(slurm_loopback, tmp_path_factory):
    """A local S3 server (moto) on the loopback cluster's bridge, so that the nodes reach it too."""
    from s3_server import start_s3_server

    yield from start_s3_server(tmp_path_factory.mktemp("bridge-s3"), host=BRIDGE_ADDRESS)
