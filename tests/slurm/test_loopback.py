"""The loopback Slurm cluster (scripts/slurm-loopback): two nodes, each in its own network namespace, used
through the ssh alias that `up` writes into ~/.ssh/config (as a user or the Slurm backend would)."""

from __future__ import annotations

import os
import random
import subprocess
import textwrap
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from conftest import LoopbackCluster  # tests/slurm/conftest.py (only for annotations)

pytestmark = pytest.mark.slurm


@pytest.fixture
def job_dir(tmp_path: Path) -> Path:
    """tmp_path, readable by the job steps: the nodes share this machine's filesystem."""
    tmp_path.chmod(0o755)
    return tmp_path


def test_status_exits_zero(slurm_loopback: LoopbackCluster) -> None:
    status = slurm_loopback.script_cmd("status")
    assert status.returncode == 0, status.stdout + status.stderr
    node_lines = [line for line in status.stdout.splitlines() if line.startswith("node ")]
    assert len(node_lines) == 2, status.stdout


def test_two_node_job_completes(slurm_loopback: LoopbackCluster, job_dir: Path) -> None:
    job = slurm_loopback.sbatch("--nodes", "2", "--ntasks-per-node", "1", f"--chdir={job_dir}",
                                f"--output={job_dir}/%j.out", "--wrap", "srun hostname")
    assert slurm_loopback.wait_finished(job) == ("COMPLETED", 2)
    assert f"{job} COMPLETED 2" in slurm_loopback.script_cmd("jobs").stdout.splitlines()
    hostnames = (job_dir / f"{job}.out").read_text().split()
    assert len(hostnames) == 2 and len(set(hostnames)) == 2, hostnames  # each node prints its own name


def test_second_node_reaches_first(slurm_loopback: LoopbackCluster, job_dir: Path) -> None:
    """What a multi-node rendezvous needs: node 2 connects over TCP to a server on node 1, by name."""
    port = random.randint(20000, 29000)
    (job_dir / "xnode.py").write_text(textwrap.dedent(f"""
        import os, socket, sys, time
        first = sys.argv[1]
        if os.environ["SLURM_PROCID"] == "0":
            server = socket.create_server((socket.gethostbyname(socket.gethostname()), {port}))
            server.settimeout(30)
            conn, (peer, _) = server.accept()
            conn.sendall(f"{{socket.gethostname()}} saw {{peer}}".encode())
            conn.close()
        else:
            deadline = time.monotonic() + 30
            while True:
                try:
                    with socket.create_connection((first, {port}), timeout=2) as conn:
                        print(socket.gethostname(), "->", conn.recv(200).decode(), flush=True)
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.2)
    """))
    (job_dir / "xnode.sh").write_text(textwrap.dedent("""\
        #!/bin/bash
        first=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
        srun python3 xnode.py "$first"
    """))
    job = slurm_loopback.sbatch("--nodes", "2", "--ntasks-per-node", "1", "--time", "2",
                                f"--chdir={job_dir}", f"--output={job_dir}/%j.out", str(job_dir / "xnode.sh"))
    state = slurm_loopback.wait_finished(job)
    output = (job_dir / f"{job}.out").read_text()
    assert state == ("COMPLETED", 2), output
    client, arrow, server, saw, peer = output.split()
    assert (arrow, saw) == ("->", "saw") and client != server, output
    # The server saw the client node's own address: the connection crossed from one namespace to the other.
    node = slurm_loopback.ssh("scontrol", "show", "node", "-o", client).stdout
    assert f"NodeAddr={peer} " in node, (output, node)


def test_cancelled_job_is_reported_cancelled(slurm_loopback: LoopbackCluster, job_dir: Path) -> None:
    job = slurm_loopback.sbatch(f"--chdir={job_dir}", f"--output={job_dir}/%j.out", "--wrap", "sleep 300")
    slurm_loopback.wait_state(job, "RUNNING")
    slurm_loopback.ssh("scancel", str(job))
    assert slurm_loopback.wait_finished(job) == ("CANCELLED", 1)
    assert f"{job} CANCELLED 1" in slurm_loopback.script_cmd("jobs").stdout.splitlines()


def test_host_key_is_verified(slurm_loopback: LoopbackCluster, tmp_path: Path) -> None:
    strict = ["ssh", "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=yes"]
    ok = subprocess.run([*strict, slurm_loopback.alias, "true"], capture_output=True, text=True, timeout=30)
    assert ok.returncode == 0, ok.stderr

    empty = tmp_path / "known_hosts"
    empty.write_text("")
    refused = subprocess.run([*strict, "-o", f"UserKnownHostsFile={empty}",
                              "-o", "GlobalKnownHostsFile=/dev/null", slurm_loopback.alias, "true"],
                             capture_output=True, text=True, timeout=30)
    assert refused.returncode != 0
    assert "Host key verification failed" in refused.stderr, refused.stderr


def test_jobs_lists_a_requeued_job_once_with_its_last_state(tmp_path: Path) -> None:
    """jobcomp has a record per end of a job; `jobs` reads it without the cluster (no root needed)."""
    (tmp_path / "jobcomp.txt").write_text(
        "JobId=5 UserId=u(0) JobState=NODE_FAIL NodeCnt=2\nJobId=6 JobState=TIMEOUT NodeCnt=1\n"
        "JobId=5 UserId=u(0) JobState=COMPLETED NodeCnt=2\n")
    script = Path(__file__).parents[2] / "scripts" / "slurm-loopback"
    listed = subprocess.run([str(script), "jobs"], capture_output=True, text=True,
                            env={**os.environ, "SLURM_LOOPBACK_DIR": str(tmp_path)})
    assert listed.stdout.splitlines() == ["5 COMPLETED 2", "6 TIMEOUT 1"], listed.stderr
