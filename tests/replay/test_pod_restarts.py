"""Restarts of a 2-pod PyTorchJob as a cluster does them, replayed from the registered workflow.

A reference replay of the non-fast registration (code baked into the image; backend=kubernetes, nnodes=2,
nproc_per_node=1, max_restarts=1, parallelism=fsdp, the digits preset's config with dcp checkpoints in an
object store, a local S3 server, as on a cluster: every rank writes its own shards straight into the
store; deterministic CPU/gloo training) runs the whole workflow once, uninterrupted, as three
executions that each take up where the one before was aborted (``replay --abort-after`` once the dataset
is staged, then once the train node succeeded; ``replay --recover``, Flyte's recover, reuses what
succeeded): no node runs twice. It is also the replay of that registration end to end: what is
registered is what runs (the pods ran the PyTorchJob manifest's args, one world across both pods, only
global rank 0's pod kept its outputs), the model was sharded across the pods, and the pipeline reaches
the digits preset's accuracy. Its train pods' pod.json
files are what the training operator created. Then the train node runs again from the same inputs.pb and
an emptied checkpoint root, twice, its pods started from those pod.json files (replay.retry.start_pod)
with only a new rendezvous port, as a new job's Service would have:

- operator restart: worker-1's pod is SIGKILLed (its whole process group, as a lost node) after the first
  checkpoint is committed, and a new process starts from the same pod.json (command, args, env), as the
  operator recreates a failed worker; worker-0's torch-elastic agent (max_restarts>0) restarts its workers
  in the same process (that process must exit 0) and the group re-forms with the new pod. This needs
  TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, which the train task sets for such jobs (see that test's docstring).
- eviction and Flyte retry: both pods get SIGTERM after the first checkpoint, as the kubelet evicts them;
  they save the step they reached and attempt 0 fails as RECOVERABLE, and propeller's retry runs the node
  again as attempt 1 (replay.retry: FLYTE_ATTEMPT_NUMBER=1, a new job, new pods).

Either way the job resumes from the durable root and ends at the same step with bitwise the same final
weights as the uninterrupted run: a rank's computation depends only on its rank, the checkpointed state
(model, optimizer, schedule, loader position, RNG) and the fixed config, not on which process holds it,
and a 2-rank allreduce sums a + b, which IEEE addition gives bitwise whichever order the ranks land in.

The runs are cut at node boundaries so that each test stays well within the suite's 120 s a test: each
launch's staging is a test of its own, the reference run's train node the first test of the job, the
non-fast test pays for its recovery to the end (export and evaluation), the eviction and its Flyte retry
are two tests, and the node-range job's export and evaluation are its execution's recovery, in a test of
their own.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
import uuid
from pathlib import Path
from types import SimpleNamespace

import pytest
from flyteidl.core import errors_pb2, literals_pb2
from replay_helpers import recovered_nodes, run_recovery, run_replay  # noqa: I001  (a module beside this file)
from s3_server import tensorboard_steps

from replay import literals
from replay.retry import kill_pod, start_pod
from traincore.checkpoint import Store, complete_steps, read_marker, step_store
from traincore.checkpoint.format import read_checkpoint
from traincore.telemetry.records import attempt_records

# The digits preset (the workflow's default) passes 0.8 test accuracy in 80 steps, 10-30 s of training on
# 2 cores; the faults come after the first checkpoint.
MAX_STEPS, EVERY = 80, 20
TRAIN_NODE = "n2-0-dn0"
LOG_EVERY = 10
CONFIG = json.dumps({"telemetry": {"log_every": LOG_EVERY, "records_every_s": 2},
                     "checkpoint": {"every": EVERY, "mode": "dcp"}})
INPUTS = ("backend=kubernetes", "nnodes=2", "nproc_per_node=1", "max_restarts=1", "parallelism=fsdp",
          f"max_steps={MAX_STEPS}", f"config_overrides={CONFIG}")
TIMEOUT_S = 300
ELASTIC_STEPS = 160
ELASTIC_CONFIG = json.dumps({"telemetry": {"log_every": 1, "records_every_s": 2},
                             "checkpoint": {"every": EVERY, "mode": "dcp"}})
ELASTIC_INPUTS = ("backend=kubernetes", "nnodes=1:2", "nproc_per_node=1", "max_restarts=2",
                  f"max_steps={ELASTIC_STEPS}", f"config_overrides={ELASTIC_CONFIG}")
# The module's two launches: their inputs and what plan_run plans (min_nnodes, nnodes, max_restarts; a
# min_nnodes of 0: a count, not a range).
LAUNCHES = {"reference": (INPUTS, (0, 2, 1)), "node-range": (ELASTIC_INPUTS, (1, 2, 2))}
DEFAULT_GRACE_S = 30  # Kubernetes' default termination grace: SIGKILL after it


def final_weights(root: Store) -> dict[str, bytes]:
    """The model tensors of the run's last checkpoint, read from the store, as raw bytes (bitwise)."""
    weights, info = read_checkpoint(step_store(root, MAX_STEPS))
    assert info["step"] == MAX_STEPS
    return {name: tensor.contiguous().numpy().tobytes() for name, tensor in weights.items()}


def assert_reference_weights(job) -> None:
    """The run's last checkpoint holds the uninterrupted run's tensors, bitwise; a failure names the tensors
    that differ (pytest's own diff of two dicts of raw bytes would take minutes to print)."""
    final = final_weights(job.root)
    differing = sorted(name for name in final.keys() | job.reference.keys()
                       if final.get(name) != job.reference.get(name))
    assert not differing, f"final weights differ from the uninterrupted run's in {differing}"


def assert_shards_per_rank(root: Store) -> None:
    """Every committed step holds one data file per rank, written by that rank, and DCP's index."""
    for step in complete_steps(root):
        files = read_marker(step_store(root, step))["files"]
        shards = {name: entry["rank"] for name, entry in files.items() if name.endswith(".distcp")}
        assert shards == {"__0_0.distcp": 0, "__1_0.distcp": 1} and ".metadata" in files, (step, files)


@pytest.fixture(scope="module")
def staged_launch(non_fast_package, tmp_path_factory, s3_server):
    """A launch of LAUNCHES by name, aborted once its dataset is staged (plan_run, stage_dataset), run when
    first asked for: the replay's output and summary, its store (under ``base``/staged) and its checkpoint
    root."""
    runs: dict[str, SimpleNamespace] = {}

    def launch(name: str) -> SimpleNamespace:
        if name not in runs:
            base = tmp_path_factory.mktemp(name)
            root = f"s3://{s3_server.bucket}/{name}-{uuid.uuid4().hex[:8]}"
            code, output, summary = run_replay(non_fast_package, base / "staged", *LAUNCHES[name][0],
                                               f"checkpoint_uri={root}", options=("--abort-after", "n1"),
                                               env=s3_server.env)
            assert code == 3, output[-6000:]
            runs[name] = SimpleNamespace(package=non_fast_package, base=base, store=base / "staged" / "store",
                                         root=root, s3=s3_server, output=output, summary=summary)
        return runs[name]

    return launch


@pytest.mark.parametrize("name", LAUNCHES)
def test_a_launch_plans_its_job_and_stages_its_data(staged_launch, name):
    topology = staged_launch(name).summary["node_outputs"]["n0"]["topology"]
    planned = (topology["min_nnodes"], topology["nnodes"], topology["max_restarts"])
    assert planned == LAUNCHES[name][1], topology
    assert staged_launch(name).summary["node_outputs"]["n1"]["o0"]["counts"]["train"] > 0


@pytest.fixture(scope="module")
def job(staged_launch):
    """The uninterrupted reference replay: the staged execution recovered, and aborted once the train node
    succeeded. Its pods, store, checkpoint root, final weights, rank 0's metrics.jsonl (text) and the job's
    manifest (parsed). The store's settings are in this process's environment for the module, as a
    platform injects them into every pod (the pods started here from pod.json read them from there)."""
    staged = staged_launch("reference")
    workdir = staged.base / "run"
    store, root = staged.store, Store(staged.root, staged.s3.storage_options)
    with pytest.MonkeyPatch.context() as patch:
        for name, value in staged.s3.env.items():
            patch.setenv(name, value)
        code, output, summary = run_recovery(staged.package, workdir, staged.summary["execution"], store,
                                             "--abort-after", TRAIN_NODE)
        assert code == 3, output[-6000:]
        assert recovered_nodes(summary) == ["n0", "n1"]
        train = summary["node_outputs"][TRAIN_NODE]["o0"]["summary"]
        assert (train["steps"], train["world_size"], train["resumed_from"]) == (MAX_STEPS, 2, None)
        pods = sorted(workdir.glob(f"pods/{summary['execution']}-{TRAIN_NODE}-0-worker-*"))
        assert len(pods) == 2
        assert_shards_per_rank(root)
        reference = final_weights(root)
        (outputs_pb,) = (store / "metadata" / "propeller").glob(
            f"*{summary['execution']}/{TRAIN_NODE}/data/0/outputs.pb")
        # What this run alone left: the pods restarted below add run directories and the retry a manifest.
        (metrics,) = workdir.glob("**/run/metrics.jsonl")
        (manifest,) = (workdir / "jobs").glob("*.json")
        yield SimpleNamespace(package=staged.package, workdir=workdir, store=store, root=root, pods=pods,
                              summary=summary, reference=reference, outputs_pb=outputs_pb, base=staged.base,
                              s3=staged.s3, metrics=metrics.read_text(),
                              manifest=json.loads(manifest.read_text()))


def test_the_uninterrupted_two_pod_job_is_the_reference(job):
    """The module's reference run (the fixture: two pods, dcp shards per rank into the bucket) finished
    every step; the fault tests below compare their weights with its. Its own test, so that its cost is
    not added to the first fault test's."""
    assert complete_steps(job.root)[-1] == MAX_STEPS
    assert set(job.reference) and len(job.pods) == 2


def test_non_fast_registration_two_pod_pytorch_job(job, tmp_path):
    """The reference run is the non-fast registration replayed whole (recovered to its end: the export and
    the evaluation): its train node is a PyTorchJob of two worker pods that form one world, shard the model
    between them (FSDP) and train the pipeline to the digits preset's accuracy."""
    code, output, finished = run_recovery(job.package, tmp_path / "finished", job.summary["execution"],
                                          job.store)
    assert code == 0, output[-6000:]
    assert [node["node_id"] for node in finished["nodes"] if node["pods"]] == ["n3", "n4"]
    assert finished["outputs"]["report"]["result"]["accuracy"] >= 0.8, finished["outputs"]["report"]
    (node,) = [n for n in job.summary["nodes"] if n["node_id"] == TRAIN_NODE]
    assert node["task"].endswith("2x1-restarts1") and node["pods"] == 2  # a PyTorchJob of two worker pods
    world = job.summary["node_outputs"][TRAIN_NODE]["o0"]["summary"]["world_size"]
    assert world == 2 * 1  # one world across both pods, not two worlds of one
    # The model was sharded across the pods: each held half of its parameters (the telemetry record).
    memory = next(json.loads(line) for line in job.metrics.splitlines() if '"memory"' in line)
    assert memory["param_bytes_per_rank"] < 0.6 * memory["param_bytes_total"], memory
    assert [p.name.rsplit("-", 2)[1:] for p in job.pods] == [["worker", "0"], ["worker", "1"]]
    # Only the pod holding global rank 0 (the one that printed rank 0's summary) kept its outputs.
    logs = {p.name: (p / "log.txt").read_text() for p in job.pods}
    (rank0,) = [name for name, log in logs.items() if "\ntrain: trained" in log or log.startswith("train:")]
    assert node["writer"] == rank0
    assert all("IgnoreOutputs received" in log for name, log in logs.items() if name != rank0)
    # The pods ran with exactly the manifest's args; only the rendezvous host and port were swapped.
    container = job.manifest["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]
    for pod in job.pods:
        started = json.loads((pod / "pod.json").read_text())
        assert started["args"] == container["args"] and started["args"][0] == "pyflyte-execute"
        env = started["env"]
        assert env["PET_NNODES"] == "2:2" and env["PET_RDZV_ENDPOINT"].startswith("127.0.0.1:")


def fresh_run(job) -> dict[str, str]:
    """Empty the durable root and the node's outputs, and give the job a new rendezvous port: the env
    overrides for its pods."""
    job.root.remove_tree()
    job.outputs_pb.unlink(missing_ok=True)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return {"PET_RDZV_ENDPOINT": f"127.0.0.1:{probe.getsockname()[1]}"}


def wait_for(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.1)


def start_job(job, env: dict[str, str], log: str) -> list:
    """Worker-0 first, and worker-1 once worker-0's agent serves the rendezvous store: the store lives in
    worker-0's pod, as on a cluster (where the endpoint is worker-0's Service)."""
    host, port = env["PET_RDZV_ENDPOINT"].split(":")
    first = start_pod(job.pods[0], log, env)

    def serving() -> bool:
        assert first.poll() is None, (job.pods[0] / log).read_text(errors="replace")[-3000:]
        with socket.socket() as probe:
            return probe.connect_ex((host, int(port))) == 0

    wait_for(serving, 120, "worker-0's rendezvous store")
    return [first, start_pod(job.pods[1], log, env)]


def wait_pods(processes: list, timeout: float = TIMEOUT_S) -> list[int]:
    try:
        wait_for(lambda: all(p.poll() is not None for p in processes), timeout, "the pods to finish")
    finally:
        codes = [kill_pod(p) if p.poll() is None else p.returncode for p in processes]
    return codes


def first_checkpoint(job, processes: list) -> int:
    """Wait until a checkpoint is committed in the durable root while every pod still runs."""
    wait_for(lambda: complete_steps(job.root) or any(p.poll() is not None for p in processes), 240,
             "the first checkpoint")
    assert all(p.poll() is None for p in processes), "a pod ended before the first checkpoint"
    return complete_steps(job.root)[-1]


def train_summary(outputs_pb: Path) -> dict:
    outputs = literals_pb2.LiteralMap.FromString(outputs_pb.read_bytes())
    return literals.to_python(outputs.literals["o0"])["summary"]


def test_operator_restart_of_a_killed_pod_resumes_bitwise(job):
    """The pods run with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 from the task template (tasks/train.py).

    With torch 2.14.1's default (the agent's TCPStore shared with the workers), a replacement pod cannot
    rejoin: the surviving agent caches its bootstrap store info from its first rendezvous and never writes
    MASTER_ADDR/MASTER_PORT for a later round (dynamic_rendezvous.py, next_rendezvous: ``if
    self._bootstrap_store_info is None or (rank == 0 and ...)``), while the new agent, a newcomer at rank
    1, waits in RendezvousStoreInfo.build for those keys under the new round's prefix: forever (up to the
    900 s timeouts). Seen here: worker-0's agent in _assign_worker_ranks, the new worker-1 in
    RendezvousStoreInfo.build, no worker started, for minutes. Opting out of sharing makes rank 0 publish
    the keys in every round, so the group re-forms.
    """
    for pod in job.pods:  # from the template, through the PyTorchJob manifest, into each pod
        assert json.loads((pod / "pod.json").read_text())["env"]["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"
    env, log = fresh_run(job), "log-operator.txt"
    processes = start_job(job, env, log)
    try:
        checkpoint = first_checkpoint(job, processes)
        assert kill_pod(processes[1]) == -9  # the pod's node is lost
        assert checkpoint < MAX_STEPS and processes[0].poll() is None
        processes[1] = start_pod(job.pods[1], "log-operator-restarted.txt", env)  # the operator's new pod
    finally:
        codes = wait_pods(processes)
    logs = "".join((pod / name).read_text(errors="replace") for pod in job.pods
                   for name in (log, "log-operator-restarted.txt") if (pod / name).is_file())
    assert codes == [0, 0], logs[-6000:]
    summary = train_summary(job.outputs_pb)  # written by whichever pod held global rank 0 at the end
    assert (summary["steps"], summary["world_size"]) == (MAX_STEPS, 2)
    assert summary["resumed_from"] is not None and summary["resumed_from"] >= checkpoint, summary
    assert f"resumed from step {summary['resumed_from']}" in logs
    assert complete_steps(job.root)[-1] == MAX_STEPS
    assert_shards_per_rank(job.root)
    assert_reference_weights(job)


@pytest.fixture(scope="module")
def evicted(job) -> SimpleNamespace:
    """Both pods evicted (SIGTERM to each pod's first process, as the kubelet sends it, e.g. on a spot
    reclaim) after the first checkpoint: their exit codes, logs and how long they took to go."""
    env = fresh_run(job)
    processes = start_job(job, env, "log-attempt-0.txt")
    try:
        first_checkpoint(job, processes)
        evicted = time.monotonic()
        for process in processes:
            process.send_signal(signal.SIGTERM)
        codes = wait_pods(processes, timeout=DEFAULT_GRACE_S)
        took = time.monotonic() - evicted
    finally:
        for process in processes:
            kill_pod(process)
    logs = "".join((pod / "log-attempt-0.txt").read_text(errors="replace") for pod in job.pods)
    return SimpleNamespace(codes=codes, logs=logs, took=took)


def test_evicted_pods_agree_on_a_step_save_it_and_fail_as_recoverable(job, evicted):
    """The workers agree on a step and save it, and the attempt fails as RECOVERABLE naming it; its records
    reach the store."""
    assert evicted.codes == [0, 0], evicted.logs[-6000:]  # flytekit reports the task's error in error.pb
    error = errors_pb2.ErrorDocument.FromString((job.outputs_pb.parent / "error.pb").read_bytes()).error
    latest = complete_steps(job.root)[-1]
    assert errors_pb2.ContainerError.Kind.Name(error.kind) == "RECOVERABLE", error.message
    assert f"preempted at step {latest} by SIGTERM: checkpoint step-{latest} saved" in error.message
    assert EVERY <= latest < MAX_STEPS and evicted.took < DEFAULT_GRACE_S
    print(f"evicted pods saved step {latest} and exited in {evicted.took:.1f} s")
    # The evicted attempt's records are in the store: metrics to the step it saved, TensorBoard events that
    # TensorBoard's own reader reads there, and the end of each rank's stderr.
    records = attempt_records(job.root, 0)
    rows = [json.loads(line) for line in records.read_bytes("metrics.jsonl").splitlines()]
    assert max(row["step"] for row in rows if row.get("kind") == "train") >= latest - 10
    (events,) = {name.rsplit("/", 1)[0] for name in records.files() if name.startswith("tensorboard/")}
    assert tensorboard_steps(job.s3, records.uri_of(events), "train/loss")[-1] >= latest - 10
    assert {"stderr/rank-0.log", "stderr/rank-1.log"} <= set(records.files())


def test_the_flyte_retry_of_the_evicted_attempt_resumes_from_its_step_bitwise(job, evicted):
    """Flyte's retry (attempt 1, a new job with new pods) resumes from exactly the step the evicted pods
    saved, and ends with the uninterrupted run's weights."""
    latest = complete_steps(job.root)[-1]
    (job.outputs_pb.parent / "error.pb").unlink()
    code, output, retry = run_replay(job.package, job.workdir, module="replay.retry", options=(
        "--store", str(job.store), "--execution", job.summary["execution"], "--node", TRAIN_NODE))
    assert code == 0, output[-6000:]
    summary = retry["outputs"]["o0"]["summary"]
    assert (summary["resumed_from"], summary["steps"], summary["world_size"]) == (latest, MAX_STEPS, 2)
    assert_reference_weights(job)
    # The retry logs from the step after the saved one on, every LOG_EVERY steps: none trained twice or lost.
    records = attempt_records(job.root, 1)
    rows = [json.loads(line) for line in records.read_bytes("metrics.jsonl").splitlines()]
    logged = [row["step"] for row in rows if row.get("kind") == "train"]
    assert logged == [step for step in range(latest + 1, MAX_STEPS + 1) if step % LOG_EVERY == 0], logged
    # A new job with new pods, as propeller's retry creates: attempt 1 in its name, its env and its paths.
    (node,) = retry["nodes"]
    assert node["pods"] == 2 and node["writer"]
    pods = sorted(job.workdir.glob(f"pods/{job.summary['execution']}-{TRAIN_NODE}-1-worker-*"))
    assert len(pods) == 2
    for pod in pods:
        started = json.loads((pod / "pod.json").read_text())
        assert started["env"]["FLYTE_ATTEMPT_NUMBER"] == "1" and started["env"]["PET_NNODES"] == "2:2"
        assert f"/{TRAIN_NODE}/data/1" in " ".join(started["args"])



def _pod_session(pod_dir: Path) -> int | None:
    """The pid of the pod's first process (a session leader, as replay.pod starts each pod), if it runs."""
    work = str(pod_dir / "work")
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if os.readlink(proc / "cwd") == work and os.getsid(int(proc.name)) == int(proc.name):
                return int(proc.name)
        except OSError:
            continue
    return None


@pytest.fixture(scope="module")
def node_range(staged_launch) -> SimpleNamespace:
    """The staged node-range job recovered, and aborted once its train node succeeded: worker-1's pod is
    SIGKILLed after the first checkpoint (its node lost), and the operator's new worker-1 (restart policy
    OnFailure) starts 25 s later, as if waiting to be scheduled. The steps at which it was lost, and the
    replay's output and summary."""
    staged = staged_launch("node-range")
    workdir = staged.base / "run"
    store = Store(staged.root, staged.s3.storage_options)
    killed: list[int] = []

    def lose_worker_1() -> None:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and not killed:
            pods = sorted(workdir.glob(f"pods/*-{TRAIN_NODE}-0-worker-1"))
            pid = _pod_session(pods[0]) if pods else None
            if pid and complete_steps(store):
                os.killpg(pid, signal.SIGKILL)
                killed.append(complete_steps(store)[-1])
            time.sleep(0.2)

    killer = threading.Thread(target=lose_worker_1, daemon=True)
    with pytest.MonkeyPatch.context() as patch:
        for name, value in staged.s3.env.items():
            patch.setenv(name, value)
        killer.start()
        code, output, summary = run_recovery(staged.package, workdir, staged.summary["execution"],
                                             staged.store, "--reschedule-after", "25",
                                             "--abort-after", TRAIN_NODE)
        killer.join()
    return SimpleNamespace(**{**vars(staged), "workdir": workdir, "code": code, "output": output,
                              "summary": summary, "killed": killed})


def test_a_node_range_job_goes_on_without_a_lost_pod_and_takes_its_new_one_back(node_range):
    """Worker-0 trains on alone after worker-1's pod is lost, and the new worker-1 joins at the next restart
    of the workers; the train node ends without a Flyte retry, its summary counting two membership
    changes."""
    workdir, summary = node_range.workdir, node_range.summary
    assert node_range.code == 3 and node_range.killed, node_range.output[-6000:]
    (node,) = [n for n in summary["nodes"] if n["node_id"] == TRAIN_NODE]
    assert node["task"].endswith("1to2x1-restarts2") and node["pods"] == 2  # attempt 0: no Flyte retry
    manifest = json.loads(next((workdir / "jobs").glob("*.json")).read_text())
    assert manifest["spec"]["elasticPolicy"]["minReplicas"] == 1
    assert manifest["spec"]["pytorchReplicaSpecs"]["Worker"]["restartPolicy"] == "OnFailure"
    train = summary["node_outputs"][TRAIN_NODE]["o0"]["summary"]
    assert (train["steps"], train["world_size"], train["membership_changes"]) == (ELASTIC_STEPS, 2, 2), train
    assert 0 < train["seconds_lost"] < 120 and train["steps_redone"] >= 0
    assert sorted(workdir.glob(f"pods/*-{TRAIN_NODE}-0-worker-1/log-lost-0.txt"))  # the lost pod's log


def test_the_node_range_job_recovered_to_its_end_reaches_the_presets_accuracy(node_range, tmp_path):
    """The model that the job of changing membership trained, exported and evaluated by the execution's
    recovery (Flyte's recover: its nodes that succeeded are not run again)."""
    code, output, finished = run_recovery(node_range.package, tmp_path / "finished",
                                          node_range.summary["execution"], node_range.store)
    assert code == 0, output[-6000:]
    assert [node["node_id"] for node in finished["nodes"] if node["pods"]] == ["n3", "n4"]
    assert finished["outputs"]["report"]["result"]["accuracy"] >= 0.8
