"""tasks.slurm.client against the real two-node loopback cluster (scripts/slurm-loopback, Slurm 22.05.8 here).

The ``slurm_loopback`` fixture (tests/slurm/conftest.py) brings the cluster up and names its ssh Host alias;
the client connects through that alias with the host key verified against ~/.ssh/known_hosts, as a user
would. The cluster shares this machine's filesystem, so pytest's tmp_path serves as the remote job directory.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
from ports import closed_port

from tasks.slurm.client import SlurmClient
from tasks.slurm.ssh import SlurmConnectionError, SlurmTarget, connect, host_alias_known
from tasks.slurm.states import JobInfo, Outcome, SlurmError

pytestmark = pytest.mark.slurm

POLL_S = 0.5
JOB_DEADLINE_S = 90  # the loopback cluster starts jobs within seconds; this only bounds a broken run


@pytest.fixture
def slurm_cluster(slurm_loopback, tmp_path) -> str:
    """The cluster's ssh alias; tmp_path made readable for the job steps (as tests/slurm/test_loopback.py)."""
    tmp_path.chmod(0o755)
    return slurm_loopback.alias


def run(coro: Awaitable[object]) -> object:
    return asyncio.run(asyncio.wait_for(coro, timeout=180))


async def wait_until(slurm: SlurmClient, job_id: str, done: Callable[[JobInfo], bool]) -> JobInfo:
    """Poll ``slurm.job`` until ``done`` holds (bounded by JOB_DEADLINE_S)."""
    deadline = time.monotonic() + JOB_DEADLINE_S
    while True:
        info = await slurm.job(job_id)
        if done(info):
            return info
        if time.monotonic() > deadline:
            raise AssertionError(f"job {job_id} still {info.state} after {JOB_DEADLINE_S} s: {info}")
        await asyncio.sleep(POLL_S)


def batch_script(body: str) -> str:
    return f"#!/bin/bash\nset -u\n{body}\n"


def output_args(directory: Path) -> list[str]:
    return ["--output", f"{directory}/%j.out", "--error", f"{directory}/%j.err", "--time", "5"]


def test_job_that_succeeds(slurm_cluster, tmp_path):
    async def main():
        async with SlurmClient(SlurmTarget(slurm_cluster)) as slurm:
            assert await slurm.slurm_version() >= (22, 5, 0)
            job_id = await slurm.submit(batch_script("echo hello from $SLURM_JOB_ID"), str(tmp_path),
                                        output_args(tmp_path) + ["--job-name", "client-ok"])
            info = await wait_until(slurm, job_id, lambda i: i.finished)
            assert (info.job_id, info.state, info.outcome, info.exit_code) == (job_id, "COMPLETED",
                                                                               Outcome.SUCCEEDED, 0)
            assert info.stdout_path == f"{tmp_path}/{job_id}.out"
            assert await slurm.tail(info.stdout_path, 5) == f"hello from {job_id}\n"

    run(main())


def test_job_that_exits_3_fails_with_its_stderr(slurm_cluster, tmp_path):
    async def main():
        async with SlurmClient(SlurmTarget(slurm_cluster)) as slurm:
            script = batch_script("echo 'about to fail' >&2\necho 'loss went NaN at step 7' >&2\nexit 3")
            job_id = await slurm.submit(script, str(tmp_path), output_args(tmp_path))
            info = await wait_until(slurm, job_id, lambda i: i.finished)
            assert (info.state, info.outcome, info.exit_code, info.reason) == ("FAILED", Outcome.FAILED, 3,
                                                                               "NonZeroExitCode")
            assert info.stderr_path == f"{tmp_path}/{job_id}.err"
            assert await slurm.tail(info.stderr_path, 1) == "loss went NaN at step 7\n"
            assert await slurm.tail(f"{tmp_path}/nonexistent.err", 5) == ""

    run(main())


def test_cancel_a_running_job(slurm_cluster, tmp_path):
    async def main():
        async with SlurmClient(SlurmTarget(slurm_cluster)) as slurm:
            job_id = await slurm.submit(batch_script("sleep 300"), str(tmp_path), output_args(tmp_path))
            running = await wait_until(slurm, job_id, lambda i: i.outcome is not Outcome.QUEUED)
            assert running.outcome is Outcome.RUNNING
            await slurm.cancel(job_id)
            info = await wait_until(slurm, job_id, lambda i: i.finished)
            assert (info.state, info.outcome) == ("CANCELLED", Outcome.ABORTED)
            await slurm.cancel(job_id)  # cancelling an ended job again is not an error

    run(main())


def test_two_node_job_and_partition_size(slurm_cluster, tmp_path):
    async def main():
        async with SlurmClient(SlurmTarget(slurm_cluster)) as slurm:
            assert await slurm.partition_nodes() == 2
            assert await slurm.partition_nodes("debug") == 2
            with pytest.raises(SlurmError, match="no partition 'gpu-nope'"):
                await slurm.partition_nodes("gpu-nope")
            job_id = await slurm.submit(batch_script("srun hostname | sort"), str(tmp_path),
                                        output_args(tmp_path) + ["--nodes", "2", "--ntasks-per-node", "1"])
            info = await wait_until(slurm, job_id, lambda i: i.finished)
            assert (info.outcome, info.node_count) == (Outcome.SUCCEEDED, 2)
            assert len(set((await slurm.tail(info.stdout_path, 10)).split())) == 2

    run(main())


def test_sbatch_rejection_and_unknown_jobs(slurm_cluster, tmp_path):
    """sbatch's own error comes back; a job id the controller does not know goes to sacct, and this
    cluster has no accounting, which the error says (Slurm 22.05 prints its own message for that)."""
    async def main():
        async with SlurmClient(SlurmTarget(slurm_cluster)) as slurm:
            with pytest.raises(SlurmError, match="sbatch rejected the job .*[Ii]nvalid partition"):
                await slurm.submit(batch_script("true"), str(tmp_path), ["--partition", "gpu-nope"])
            with pytest.raises(SlurmError, match="accounting is unavailable"):
                await slurm.job("987654")

    run(main())


CONNECT_TIMEOUT_S = 5.0
MARGIN_S = 3.0


@pytest.mark.parametrize(("case", "expected"), [
    ("wrong-host", "cannot resolve host 'slurm-loopback-nonexistent.invalid'"),
    ("wrong-port", "connection refused by 127.0.0.1:"),
    ("unknown-host-key", "is not known .* ssh-keyscan -p \\d+ 127.0.0.1 >> "),
    ("missing-key", "SSH key file .*no-such-key does not exist"),
])
def test_connection_errors_are_specific_and_bounded(slurm_cluster, tmp_path, case, expected):
    empty_known_hosts = tmp_path / "known_hosts"
    empty_known_hosts.write_text("")
    targets = {
        "wrong-host": SlurmTarget("slurm-loopback-nonexistent.invalid", connect_timeout_s=CONNECT_TIMEOUT_S),
        "wrong-port": SlurmTarget(slurm_cluster, port=closed_port(), connect_timeout_s=CONNECT_TIMEOUT_S),
        "unknown-host-key": SlurmTarget(slurm_cluster, known_hosts=str(empty_known_hosts),
                                        connect_timeout_s=CONNECT_TIMEOUT_S),
        "missing-key": SlurmTarget(slurm_cluster, key_file=str(tmp_path / "no-such-key"),
                                   connect_timeout_s=CONNECT_TIMEOUT_S),
    }
    start = time.monotonic()
    with pytest.raises(SlurmConnectionError, match=expected):
        run(connect(targets[case]))
    assert time.monotonic() - start < CONNECT_TIMEOUT_S + MARGIN_S


def test_the_real_host_key_is_accepted(slurm_cluster):
    assert host_alias_known(slurm_cluster)  # the Host block `slurm-loopback up` wrote, as asyncssh reads it

    async def main():
        conn = await connect(SlurmTarget(slurm_cluster, connect_timeout_s=CONNECT_TIMEOUT_S))
        try:
            result = await conn.run("echo $SLURM_CONF", check=True, timeout=10)
            assert result.stdout.strip().endswith("slurm.conf")
        finally:
            conn.close()

    run(main())
