"""The Slurm backend end to end on the loopback cluster: `pyflyte run` through the connector, two nodes,
checkpoints shared with the local backend, failures and cancellations reported as a user would see them."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tasks.launch import train_task_for
from tasks.plan import LaunchInputError, plan_run
from tasks.types import SlurmSettings, StagedDataset, Topology
from traincore.checkpoint.format import read_checkpoint
from traincore.data.manifest import Manifest
from traincore.presets import preset

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
PYFLYTE = str(Path(sys.executable).parent / "pyflyte")
JOB_NAME = "flyte-torch-train"


def pipeline(*args: str, cwd: Path, timeout: float = 420) -> subprocess.CompletedProcess:
    """`pyflyte run workflows/pipeline.py training_pipeline ARGS` as a user runs it."""
    workflow = str(ROOT / "workflows" / "pipeline.py")
    # No local task cache: its entries would point into this test session's temporary staging directory
    # and outlive it in the user's ~/.flyte.
    env = {**os.environ, "FLYTE_LOCAL_CACHE_ENABLED": "false"}
    return subprocess.run([PYFLYTE, "run", workflow, "training_pipeline", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=timeout, env=env)


def output(run: subprocess.CompletedProcess | tuple[str, str]) -> str:
    out, err = (run.stdout, run.stderr) if isinstance(run, subprocess.CompletedProcess) else run
    return f"{out}\n{err}"


def new_jobs(cluster, before: dict[int, tuple[str, int]]) -> dict[int, tuple[str, int]]:
    return {job: info for job, info in cluster.finished().items() if job not in before}


def test_pipeline_trains_on_two_nodes_and_shares_checkpoints_with_the_local_backend(slurm_loopback, tmp_path):
    """Local DDP, then two Slurm nodes sharding the model with FSDP from that checkpoint, then local DDP
    again from theirs: one checkpoint root across backends, parallelisms and world sizes."""
    root = tmp_path / "checkpoints"
    common = ("--checkpoint_uri", str(root), "--nproc_per_node")
    local = pipeline("--max_steps", "10", *common, "2", cwd=tmp_path)
    assert local.returncode == 0, output(local)[-3000:]

    before = slurm_loopback.finished()
    slurm = pipeline("--backend", "slurm", "--slurm_target", slurm_loopback.alias, "--nnodes", "2",
                     "--parallelism", "fsdp", "--max_steps", "20", *common, "1", cwd=tmp_path)
    text = output(slurm)
    assert slurm.returncode == 0, text[-3000:]
    assert "on 2 node(s)" in text and "resumed from step 10" in text and "trained 20 steps" in text, text
    assert "on slurm, fsdp" in text, text
    assert re.search(r"test accuracy: 0\.\d+", text), text
    assert list(new_jobs(slurm_loopback, before).values()) == [("COMPLETED", 2)]
    step20 = sorted(root.glob("step-*20"))
    assert step20, sorted(p.name for p in root.iterdir())
    _, saved = read_checkpoint(step20[-1])
    assert saved["step"] == 20 and saved["meta"]["world_size"] == 2  # nodes x processes

    back = pipeline("--max_steps", "30", *common, "2", cwd=tmp_path)
    assert back.returncode == 0 and "resumed from step 20" in output(back), output(back)[-3000:]


def slurm_task(cluster_alias: str, nnodes: int = 1, nproc: int = 1, **settings: str):
    topology = Topology(backend="slurm", nnodes=nnodes, nproc_per_node=nproc,
                        slurm=SlurmSettings(target=cluster_alias, setup=f"source {sys.prefix}/bin/activate",
                                            **settings))
    return train_task_for(topology, preset("debug"))


def test_python_exception_in_the_job_fails_the_task_with_its_message(slurm_loopback, synthetic_dir,
                                                                     tmp_path):
    dataset = StagedDataset.from_manifest(synthetic_dir, Manifest.load(synthetic_dir))
    too_big = preset("debug").with_overrides({"loader.batch_size": 500})  # checked inside the job
    task = slurm_task(slurm_loopback.alias)
    before = slurm_loopback.finished()
    with pytest.raises(Exception) as failure:
        task(config=too_big, dataset=dataset, checkpoint_root=str(tmp_path / "ckpt"))
    message = str(failure.value)
    assert "loader.batch_size=500 exceeds the 80 training samples" in message, message
    assert re.search(r"Slurm job \d+ FAILED", message) and "the task failed: " in message, message
    assert [state for state, _ in new_jobs(slurm_loopback, before).values()] == ["FAILED"]


def start_long_run(cluster_alias: str, cwd: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [PYFLYTE, "run", str(ROOT / "workflows" / "pipeline.py"), "training_pipeline", "--backend", "slurm",
         "--slurm_target", cluster_alias, "--nproc_per_node", "1", "--max_steps", "100000"],
        cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def running_job(cluster, deadline_s: float = 120) -> int:
    """The id of our training job once Slurm runs it and its Python processes are up."""
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        listed = cluster.ssh("squeue", "-h", "-n", JOB_NAME, "-t", "R", "-o", "%i", check=False).stdout
        listed = listed.split()
        procs = subprocess.run(["pgrep", "-f", "pyflyte-execute.*task-key"], capture_output=True, text=True)
        if listed and procs.stdout.strip():
            return int(listed[0])
        time.sleep(1)
    raise AssertionError("the training job did not start running")


def finish(process: subprocess.Popen, timeout: float = 120) -> str:
    try:
        out, err = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        raise
    return output((out, err))


def test_scancel_from_outside_aborts_the_task(slurm_loopback, tmp_path):
    process = start_long_run(slurm_loopback.alias, tmp_path)
    job = running_job(slurm_loopback)
    slurm_loopback.ssh("scancel", str(job))
    text = finish(process)
    assert process.returncode != 0, text[-3000:]
    assert f"Slurm job {job} CANCELLED" in text, text[-3000:]
    assert slurm_loopback.finished()[job][0] == "CANCELLED"


def test_a_job_killed_on_its_node_fails_the_task_with_its_state(slurm_loopback, tmp_path):
    process = start_long_run(slurm_loopback.alias, tmp_path)
    job = running_job(slurm_loopback)
    time.sleep(2)
    subprocess.run(["pkill", "-KILL", "-f", "pyflyte-execute.*task-key"], check=True)  # an OOM kill, say
    text = finish(process)
    assert process.returncode != 0, text[-3000:]
    assert re.search(rf"Slurm job {job} FAILED.*exit code 137", text, re.S), text[-3000:]  # 128 + SIGKILL
    assert slurm_loopback.finished()[job][0] == "FAILED"


PLAN = dict(source="digits", preset="digits", config_overrides="", epochs=0, max_steps=10, backend="slurm",
            nnodes=1, nproc_per_node=1, gpus_per_node=0, accelerator="", max_restarts=0, parallelism="ddp",
            checkpoint_uri="",
            slurm_partition="", slurm_account="", slurm_time_limit="", slurm_sbatch_flags="", slurm_setup="")


def test_plan_checks_the_cluster_before_anything_stages(slurm_loopback):
    plan = plan_run(**PLAN | dict(slurm_target=slurm_loopback.alias, nnodes=2))
    assert plan.topology.slurm.setup == f"source {sys.prefix}/bin/activate"  # this run's environment
    with pytest.raises(LaunchInputError, match=r"nnodes=3 exceeds the 2 node\(s\) of the default partition"):
        plan_run(**PLAN | dict(slurm_target=slurm_loopback.alias, nnodes=3))
    with pytest.raises(LaunchInputError, match=r"no partition 'gpu'"):
        plan_run(**PLAN | dict(slurm_target=slurm_loopback.alias, slurm_partition="gpu"))
    started = time.monotonic()
    with pytest.raises(LaunchInputError, match=r"slurm_target='127\.0\.0\.1'.*(refused|not known)"):
        plan_run(**PLAN | dict(slurm_target="127.0.0.1"))  # no sshd on port 22 (or an unknown host key)
    assert time.monotonic() - started < 30
