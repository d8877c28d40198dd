"""The Slurm backend end to end on the loopback cluster: `pyflyte run` through the connector, two nodes,
checkpoints shared with the local backend, failures and cancellations reported as a user would see them."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from tasks.launch import train_task_for
from tasks.slurm.job import warning_lead_s
from tasks.train import CPU_PER_PROCESS, MEM_GIB_PER_PROCESS
from tasks.types import SlurmSettings, StagedDataset, Topology
from traincore.checkpoint import Store, complete_steps, read_marker, step_dir, step_store, verify_checkpoint
from traincore.checkpoint.format import read_checkpoint
from traincore.config.presets import preset
from traincore.data.manifest import Manifest
from traincore.exitcodes import PREEMPTED_EXIT_CODE

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
PYFLYTE = str(Path(sys.executable).parent / "pyflyte")
SLURM_TIME_CHECK_S = 30  # slurmctld's PERIODIC_TIMEOUT: how often it checks time limits (not configurable)


def pipeline(*args: str, cwd: Path, timeout: float = 420, workflow: str = "pipeline.py:training_pipeline",
             **env: str) -> subprocess.CompletedProcess:
    """`pyflyte run workflows/pipeline.py training_pipeline ARGS` (or another ``file:workflow`` of
    workflows/) as a user runs it."""
    file, name = workflow.split(":")
    # No local task cache: its entries would point into this test session's temporary staging directory
    # and outlive it in the user's ~/.flyte.
    env = {**os.environ, "FLYTE_LOCAL_CACHE_ENABLED": "false", **env}
    return subprocess.run([PYFLYTE, "run", str(ROOT / "workflows" / file), name, *args], cwd=cwd,
                          capture_output=True, text=True, timeout=timeout, env=env)


def output(run: subprocess.CompletedProcess | tuple[str, str]) -> str:
    out, err = (run.stdout, run.stderr) if isinstance(run, subprocess.CompletedProcess) else run
    return f"{out}\n{err}"


def new_jobs(cluster, before: dict[int, tuple[str, int]]) -> dict[int, tuple[str, int]]:
    return {job: info for job, info in cluster.finished().items() if job not in before}


# One checkpoint root in an object store, across backends, parallelisms, modes and world sizes: local DDP,
# then two Slurm nodes sharding the model with FSDP from that checkpoint, every rank writing its dcp shards
# into an S3 bucket (a local server the nodes reach over the cluster's bridge), then local DDP again from
# theirs. Three tests, one run each, in that order (module fixtures: each run is made once).


@dataclass(frozen=True)
class SharedRoot:
    """The checkpoint root in the bucket, the flags and environment every run of it uses, and its cwd."""

    uri: str
    store: Store
    model: str
    env: dict[str, str]
    cwd: Path

    def local(self, max_steps: int) -> subprocess.CompletedProcess:
        """A local DDP run of two processes on this root."""
        return pipeline("--max_steps", str(max_steps), "--checkpoint_uri", self.uri,
                        "--config_overrides", f"{{{self.model}}}", "--nproc_per_node", "2", cwd=self.cwd,
                        **self.env)


@dataclass(frozen=True)
class SlurmRun:
    """The two-node run: its output, the Slurm jobs that ended meanwhile and the secret it was given."""

    run: subprocess.CompletedProcess
    jobs: dict[int, tuple[str, int]]
    secret: str


@pytest.fixture(scope="module")
def shared_root(bridge_s3, tmp_path_factory) -> SharedRoot:
    uri = f"s3://{bridge_s3.bucket}/slurm-{uuid.uuid4().hex[:8]}"
    # The example team package's model (examples/teamnet, on PYTHONPATH as an installed package would be),
    # on every backend and world size of this root.
    model = '"model": {"name": "teamnet.models:resnet_tiny", "kwargs": {"width": 8, "depth": 1}}'
    env = {**bridge_s3.env, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "examples"),
                                                                       os.environ.get("PYTHONPATH")]))}
    return SharedRoot(uri, Store(uri, bridge_s3.storage_options), model, env,
                      tmp_path_factory.mktemp("shared-root"))


@pytest.fixture(scope="module")
def local_first(shared_root) -> subprocess.CompletedProcess:
    return shared_root.local(max_steps=10)


@pytest.fixture(scope="module")
def slurm_second(slurm_loopback, shared_root, local_first) -> SlurmRun:
    assert local_first.returncode == 0, f"the local run failed:\n{output(local_first)[-3000:]}"
    before = slurm_loopback.finished()
    secret = f"not-a-real-key-{uuid.uuid4().hex}"  # reaches the job through sbatch's environment only
    # On Slurm the job's environment is the login shell's plus slurm_setup: the package goes on its path
    # there, as docs/own-model.md tells users.
    setup = f"source {sys.prefix}/bin/activate && export PYTHONPATH={shared_root.env['PYTHONPATH']}"
    run = pipeline("--backend", "slurm", "--slurm_target", slurm_loopback.alias, "--nnodes", "2",
                   "--slurm_setup", setup, "--parallelism", "fsdp", "--max_steps", "20",
                   "--checkpoint_uri", shared_root.uri,
                   "--config_overrides", f'{{{shared_root.model}, "checkpoint": {{"mode": "dcp"}}}}',
                   "--nproc_per_node", "1", cwd=shared_root.cwd,
                   **shared_root.env | {"AWS_SECRET_ACCESS_KEY": secret})
    return SlurmRun(run, new_jobs(slurm_loopback, before), secret)


def test_a_local_run_writes_the_shared_root_and_shows_its_outputs_in_a_few_lines(local_first):
    assert local_first.returncode == 0, output(local_first)[-3000:]
    # What a user sees at the end of a local run: the outputs in a few lines, and no warning of pyflyte's.
    assert "Warning" not in output(local_first), output(local_first)[-3000:]
    outputs = local_first.stdout[local_first.stdout.index("PipelineOutputs("):].strip().splitlines()
    assert len(outputs) <= 15 and any(line.split()[:2] == ["test", "accuracy"] for line in outputs), outputs


def test_two_slurm_nodes_resume_it_with_fsdp_and_write_their_shards_into_the_bucket(slurm_loopback,
                                                                                   shared_root, slurm_second):
    text, root = output(slurm_second.run), shared_root.store
    assert slurm_second.run.returncode == 0, text[-3000:]
    [job] = slurm_second.jobs
    assert secret_files(job, slurm_second.secret) == (1, []), \
        "the job's environment, and no file we wrote, holds it"
    # Each node's task asked for the train task's requests: 1 process x 2 CPUs and 6 GiB.
    shown = dict(field.split("=", 1) for field in slurm_loopback.ssh(
        "scontrol", "show", "job", "-o", str(job)).stdout.split() if "=" in field)
    assert (shown["MinCPUsNode"], shown["MinMemoryNode"], shown["NumCPUs"]) == (
        str(CPU_PER_PROCESS), f"{MEM_GIB_PER_PROCESS}G", str(2 * CPU_PER_PROCESS)), shown
    assert "on 2 node(s)" in text and "resumed from step 10" in text and "trained 20 steps" in text, text
    assert "on slurm, fsdp" in text, text
    assert re.search(r"test accuracy: 0\.\d+", text), text
    assert list(slurm_second.jobs.values()) == [("COMPLETED", 2)]
    assert complete_steps(root)[-1] == 20
    marker = read_marker(step_store(root, 20))  # each node's rank wrote its own shard into the bucket
    shards = {name: entry["rank"] for name, entry in marker["files"].items() if name.endswith(".distcp")}
    assert marker["mode"] == "dcp" and shards == {"__0_0.distcp": 0, "__1_0.distcp": 1}, marker
    _, saved = read_checkpoint(step_store(root, 20))
    assert saved["step"] == 20 and saved["meta"]["world_size"] == 2  # nodes x processes
    assert saved["meta"]["config"]["model"]["name"] == "teamnet.models:resnet_tiny"


def test_local_ddp_resumes_from_the_checkpoint_of_the_slurm_nodes(shared_root, slurm_second):
    assert slurm_second.run.returncode == 0, output(slurm_second.run)[-3000:]
    back = shared_root.local(max_steps=30)
    assert back.returncode == 0 and "resumed from step 20" in output(back), output(back)[-3000:]


def test_a_search_trial_trains_as_a_slurm_job_and_resumes_in_the_next_rungs_own(slurm_loopback, tmp_path):
    """tune_pipeline on the Slurm backend: its trial trains to the first rung as a Slurm job on a node of the
    cluster, then goes on, in a second job, from its own rung-0 checkpoint (the halving itself, over many
    trials, is tests/workflows/test_tuning.py's)."""
    before, root = slurm_loopback.finished(), tmp_path / "search"
    run = pipeline("--backend", "slurm", "--slurm_target", slurm_loopback.alias, "--slurm_setup",
                   f"source {sys.prefix}/bin/activate", "--nproc_per_node", "1", "--max_steps", "8",
                   "--trials", "1", "--parallel", "1", "--rungs", "2", "--checkpoint_uri", str(root),
                   "--search_space", json.dumps({"optim.lr": {"low": 5e-3, "high": 5e-2, "log": True},
                                                 "model.width": {"choices": [4, 8]}}),
                   "--config_overrides", '{"telemetry": {"tensorboard": false}}', cwd=tmp_path,
                   workflow="tuning.py:tune_pipeline")
    text = output(run)
    assert run.returncode == 0, text[-3000:]
    assert list(new_jobs(slurm_loopback, before).values()) == [("COMPLETED", 1)] * 2, text[-3000:]
    assert "trained 4 steps" in text and re.search(r"trained 8 steps in \S+ s, resumed from step 4", text), \
        text[-3000:]
    assert "steps spent: 8 of 8" in text and re.search(r"test accuracy: 0\.\d+", text), text[-3000:]
    assert complete_steps(root / "trial-000")[-1] == 8


def secret_files(job: int, secret: str) -> tuple[int, list[Path]]:
    """How many of Slurm's own records of the job's environment hold ``secret`` (its state directory keeps
    the job's environment while the job is remembered), and which files in the job's directory, its
    script and logs included, do."""
    state = Path(os.environ.get("SLURM_LOOPBACK_DIR", "/var/tmp/slurm-loopback")) / "spool" / "ctld"
    records = [path for path in state.glob(f"hash.*/job.{job}/environment") if secret.encode() in
               path.read_bytes()]
    [job_dir] = {path.parent for path in (Path.home() / ".flyte-torch-pipeline" / "slurm-jobs").glob(
        f"*/slurm-{job}.err")}
    return len(records), [path for path in job_dir.iterdir() if secret.encode() in path.read_bytes()]


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
    assert re.search(r"Slurm job \d+ FAILED, exit code 1\b", message), message
    assert "first failure: node slb-node1 failed" in message, message
    assert type(failure.value).__name__ == "FlyteUserException"  # a user error: no retry
    assert [state for state, _ in new_jobs(slurm_loopback, before).values()] == ["FAILED"]


def on_slurm(cluster_alias: str, job_name: str) -> tuple[str, ...]:
    """The pipeline's flags that run training as a Slurm job named ``job_name`` (the test's own)."""
    return ("--backend", "slurm", "--slurm_target", cluster_alias, "--slurm_sbatch_flags",
            f"--job-name={job_name}")


def start_long_run(cluster_alias: str, cwd: Path, job_name: str, *args: str) -> subprocess.Popen:
    """A pipeline run that trains until stopped, as a Slurm job named ``job_name`` (this test's own)."""
    return subprocess.Popen(
        [PYFLYTE, "run", str(ROOT / "workflows" / "pipeline.py"), "training_pipeline",
         *on_slurm(cluster_alias, job_name), "--max_steps", "100000", *(args or ("--nproc_per_node", "1"))],
        cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
        env={**os.environ, "FLYTE_LOCAL_CACHE_ENABLED": "false"})


def job_processes(job_id: int) -> dict[int, tuple[str, str]]:
    """{pid: (node, command line)} of the processes of Slurm job ``job_id`` (their environment says so)."""
    found = {}
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            items = (proc / "environ").read_text().split("\0")
            command = (proc / "cmdline").read_text().replace("\0", " ")
        except OSError:
            continue
        env = dict(item.split("=", 1) for item in items if "=" in item)
        if env.get("SLURM_JOB_ID") == str(job_id):
            found[int(proc.name)] = (env.get("SLURMD_NODENAME", ""), command)
    return found


def training_processes(job_id: int) -> dict[str, int]:
    """{node: pid} of the process that trains on each node: the spawned worker under the node's torch
    elastic agent, or pyflyte-execute itself where one process trains alone."""
    processes = job_processes(job_id)
    agents = {node: pid for pid, (node, command) in processes.items() if "pyflyte-execute" in command}
    workers = {node: pid for pid, (node, command) in processes.items() if "spawn_main" in command}
    return {**agents, **workers}


def running_job(cluster, job_name: str, nodes: int, process: subprocess.Popen, deadline_s: float = 180,
                workers: bool = False) -> int:
    """The id of this test's job (by its unique name) once it trains on all its nodes (with spawned
    workers when ``workers``)."""
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline and process.poll() is None:
        listed = cluster.ssh("squeue", "-h", "-n", job_name, "-t", "R", "-o", "%i", check=False).stdout
        if listed.split():
            job = int(listed.split()[0])
            processes = job_processes(job).values()
            if len(training_processes(job)) == nodes and (
                    not workers or sum("spawn_main" in command for _, command in processes) == nodes):
                return job
        time.sleep(1)
    raise AssertionError(f"job {job_name} did not start running:\n{finish(process, timeout=10)[-3000:]}")


def communicate(process: subprocess.Popen, timeout: float = 120) -> tuple[str, str]:
    """The run's stdout and stderr once it ends; past ``timeout`` its process group is killed."""
    try:
        return process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        raise


def finish(process: subprocess.Popen, timeout: float = 120) -> str:
    return output(communicate(process, timeout))


@contextmanager
def cancelled_on_failure(cluster, job_name: str) -> Iterator[None]:
    """Cancel this test's job (by its unique name) when the block fails: a job left training would hold
    both nodes from the tests after it."""
    try:
        yield
    except BaseException:
        cluster.ssh("scancel", "--name", job_name, check=False)
        raise


def wait_for_checkpoint(process: subprocess.Popen, root: Path, deadline_s: float = 120) -> None:
    """Poll until the run has committed a checkpoint under ``root``: every rank has trained steps."""
    deadline = time.monotonic() + deadline_s
    while not complete_steps(root) and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.5)
    assert complete_steps(root), f"no checkpoint in {root}:\n{finish(process, timeout=10)[-3000:]}"


def test_scancel_from_outside_aborts_the_task(slurm_loopback, tmp_path):
    name = f"test-scancel-{uuid.uuid4().hex[:8]}"
    process = start_long_run(slurm_loopback.alias, tmp_path, name)
    job = running_job(slurm_loopback, name, 1, process)
    slurm_loopback.ssh("scancel", str(job))
    text = finish(process)
    assert process.returncode != 0, text[-3000:]
    assert f"Slurm job {job} CANCELLED on {slurm_loopback.alias}" in text, text[-3000:]
    assert "exit code" not in text.split(f"Slurm job {job} CANCELLED")[1].splitlines()[0]
    assert slurm_loopback.finished()[job][0] == "CANCELLED"


def test_ctrl_c_cancels_the_job_and_says_so(slurm_loopback, tmp_path):
    """flytekit's own Ctrl-C handler for connector tasks never runs the delete; the task's does. The run
    ends once its cancel is sent; the job then leaves the queue as CANCELLED (on a loaded machine its
    processes may take a while to exit, so the state, not a stopwatch, is the check)."""
    name = f"test-ctrl-c-{uuid.uuid4().hex[:8]}"
    process = start_long_run(slurm_loopback.alias, tmp_path, name)
    with cancelled_on_failure(slurm_loopback, name):
        job = running_job(slurm_loopback, name, 1, process)
        process.send_signal(signal.SIGINT)
        text = finish(process, timeout=60)
        assert process.returncode == 130 and "Traceback" not in text, text[-3000:]
        assert f"cancelled Slurm job {job} on {slurm_loopback.alias}" in text, text[-3000:]
        assert slurm_loopback.wait_finished(job, timeout=90)[0] == "CANCELLED"


def test_a_worker_killed_in_a_two_node_job_is_named_with_its_rank_and_signal(slurm_loopback, tmp_path):
    """The worker on the second node is SIGKILLed (an OOM kill, say): its node's agent and the other node's
    worker both fail, and the error shows the kill, not the peer's broken collective; worker output is never
    read as markup."""
    name, root = f"test-kill-{uuid.uuid4().hex[:8]}", tmp_path / "checkpoints"
    process = start_long_run(slurm_loopback.alias, tmp_path, name, "--nnodes", "2", "--nproc_per_node", "1",
                             "--checkpoint_uri", str(root),
                             "--config_overrides", '{"checkpoint": {"every": 2}}')
    with cancelled_on_failure(slurm_loopback, name):
        job = running_job(slurm_loopback, name, 2, process, workers=True)
        wait_for_checkpoint(process, root)  # a few steps in: the other node's worker is in a collective
        os.kill(training_processes(job)["slb-node2"], signal.SIGKILL)
    text = finish(process, timeout=180)
    assert process.returncode != 0, text[-3000:]
    assert "MarkupError" not in text, text[-3000:]
    assert re.search(r"first failure: node slb-node2: rank \d was killed by SIGKILL", text), text[-5000:]
    unwrapped = re.sub(r"\s*\n\s*", "", text)  # pyflyte's rich console folds long lines, paths too
    assert re.search(r"last lines of\s*\S*/slurm-\d+-slb-node2\.err:", unwrapped), text[-5000:]
    assert "FlyteRecoverableException" in text, text[-5000:]  # a lost worker: Flyte's retries apply
    # A checkpoint was committed before the kill.
    assert "a retry resumes from it" in re.sub(r"\s+", " ", text), text[-5000:]


def test_submission_checks_the_cluster_and_names_the_input(slurm_loopback, synthetic_dir, tmp_path):
    """The plan contacts nothing; the connector refuses what the cluster cannot run, before any job."""
    dataset = StagedDataset.from_manifest(synthetic_dir, Manifest.load(synthetic_dir))
    inputs = dict(config=preset("debug"), dataset=dataset, checkpoint_root=str(tmp_path / "ckpt"))
    before = slurm_loopback.finished()
    with pytest.raises(Exception, match=r"input nnodes=3 exceeds the 2 node\(s\) of the default partition"):
        slurm_task(slurm_loopback.alias, nnodes=3)(**inputs)
    with pytest.raises(Exception, match=r"input slurm_partition='gpu': .*no partition 'gpu'"):
        slurm_task(slurm_loopback.alias, partition="gpu")(**inputs)
    # 8 processes ask each node for 16 CPUs and 48 GiB; the loopback nodes advertise 8 CPUs and 32 GiB.
    with pytest.raises(Exception, match=r"input nproc_per_node=8: each node's task asks for 16 CPUs and "
                                        r"49152 MB .* the largest, slb-node\d, has 8 CPUs and 32768 MB"):
        slurm_task(slurm_loopback.alias, nproc=8)(**inputs)
    started = time.monotonic()
    with pytest.raises(Exception, match=r"input slurm_target='127\.0\.0\.1'.*(refused|not known)"):
        slurm_task("127.0.0.1")(**inputs)  # no sshd on port 22 (or an unknown host key)
    assert time.monotonic() - started < 30
    assert new_jobs(slurm_loopback, before) == {}



@dataclass(frozen=True)
class StoppedRun:
    """A pipeline run that a time limit stopped: its command less ``--max_steps``, its checkpoint root,
    exit code and output, and the Slurm jobs that ended meanwhile (state, node count)."""

    command: tuple[str, ...]
    root: Path
    cwd: Path
    returncode: int
    out: str
    err: str
    jobs: list[tuple[str, int]]

    @property
    def text(self) -> str:
        return output((self.out, self.err))


SAVED = re.compile(r"^preempted at step (\d+) by SIGTERM: checkpoint step-\d+ saved in (\S+)$", re.MULTILINE)


@pytest.fixture(scope="module")
def time_limited_run(slurm_loopback, tmp_path_factory) -> StoppedRun:
    """Two nodes train under a 10-minute limit that is shortened once both have trained steps, so that
    Slurm's own time-limit check sends the warning signal (``--signal=TERM@lead``, the grace plus a margin)
    to every process of the job's steps."""
    cwd, name = tmp_path_factory.mktemp("time-limit"), f"test-time-limit-{uuid.uuid4().hex[:8]}"
    root = cwd / "checkpoints"
    # The default grace. A lead over one check period puts the check that ends the job with TIMEOUT at
    # least two periods (60 s) after the one that sends the warning; a shorter lead can leave the job 30 s
    # to stop, save and end, which two loaded cores do not always meet.
    grace_s = 20
    assert warning_lead_s(grace_s) > SLURM_TIME_CHECK_S
    settings = ("--nnodes", "2", "--nproc_per_node", "1", "--checkpoint_uri", str(root),
                "--slurm_time_limit", "10", "--config_overrides",
                f'{{"checkpoint": {{"every": 2, "preemption_grace_s": {grace_s}}}}}')
    before = slurm_loopback.finished()
    process = start_long_run(slurm_loopback.alias, cwd, name, *settings)
    with cancelled_on_failure(slurm_loopback, name):
        job = running_job(slurm_loopback, name, 2, process, workers=True)
        wait_for_checkpoint(process, root)
        # slurmctld checks time limits every 30 s and sends the warning at the first check within
        # lead + 30 s of the job's end: an end that far off gets it at the next check, still at least the
        # lead before the end. EndTime, unlike TimeLimit (minutes), is set to the second.
        slurm_loopback.ssh("scontrol", "update", f"JobId={job}",
                           f"EndTime=now+{warning_lead_s(grace_s) + SLURM_TIME_CHECK_S}seconds")
        out, err = communicate(process, timeout=120)
    return StoppedRun((*on_slurm(slurm_loopback.alias, name), *settings), root, cwd, process.returncode,
                      out, err, list(new_jobs(slurm_loopback, before).values()))


def test_a_time_limit_saves_the_step_and_ends_in_two_lines(time_limited_run):
    """Both nodes stop after the same step and save it; the local run prints what the local backend
    prints for a preemption and exits 75; the job ended itself before its limit."""
    run = time_limited_run
    assert run.returncode == PREEMPTED_EXIT_CODE and "Traceback" not in run.text, run.text[-5000:]
    saved = SAVED.search(run.err)
    assert saved and saved.group(2) == str(run.root), run.text[-5000:]
    step = int(saved.group(1))
    assert run.err.rstrip().splitlines()[-2:] == [
        saved.group(0), f"to resume, run the same pyflyte command with --checkpoint_uri {run.root}"
    ], run.text[-3000:]
    assert complete_steps(run.root)[-1] == step
    verify_checkpoint(step_dir(run.root, step))
    assert run.jobs == [("FAILED", 2)]  # ended itself, exit 75: not Slurm's TIMEOUT


def test_the_same_command_resumes_after_a_time_limit(time_limited_run):
    """The same command, with a few more steps, resumes from the step the time limit saved."""
    run = time_limited_run
    saved = SAVED.search(run.err)
    assert saved, run.text[-5000:]
    step = int(saved.group(1))
    resumed = pipeline(*run.command, "--max_steps", str(step + 10), cwd=run.cwd, timeout=300)
    assert resumed.returncode == 0, output(resumed)[-3000:]
    assert f"resumed from step {step}" in output(resumed), output(resumed)[-3000:]


def test_a_signal_while_the_job_starts_ends_the_attempt_recoverable(slurm_loopback, tmp_path):
    """The warning signal can come before any step (Slurm sends it up to 30 s before the lead, so a short
    limit sends it during the start-up): the attempt ends as a preempted one with nothing new to save, never
    as a user error that a retry would not run."""
    name = f"test-early-{uuid.uuid4().hex[:8]}"
    process = start_long_run(slurm_loopback.alias, tmp_path, name, "--nnodes", "2", "--nproc_per_node", "1")
    deadline, job = time.monotonic() + 180, None
    while time.monotonic() < deadline and process.poll() is None and job is None:
        listed = slurm_loopback.ssh("squeue", "-h", "-n", name, "-t", "R", "-o", "%i", check=False).stdout
        found = int(listed.split()[0]) if listed.split() else None
        processes = job_processes(found).values() if found else []
        # Both nodes' tasks started: pyflyte-execute runs (srun and the node shells name it too, later on
        # their command lines).
        if len({node for node, command in processes
                if any(word.endswith("/pyflyte-execute") for word in command.split()[:2])}) == 2:
            job = found
        time.sleep(0.1)
    if job is None:
        slurm_loopback.ssh("scancel", "--name", name, check=False)
        raise AssertionError(f"job {name} did not start: {finish(process, timeout=60)[-3000:]}")
    assert not any("spawn_main" in command for _, command in job_processes(job).values())  # no worker yet
    slurm_loopback.ssh("scancel", "--signal=TERM", str(job))
    text = finish(process, timeout=120)
    assert process.returncode == PREEMPTED_EXIT_CODE and "Traceback" not in text, text[-5000:]
    assert "stopped by SIGTERM" in text and "to resume, run the same pyflyte command" in text, text[-3000:]
    assert slurm_loopback.finished()[job][0] == "FAILED"  # its own end, exit 75: not Slurm's TIMEOUT
