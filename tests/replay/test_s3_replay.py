"""The replayed workflow on a real S3 API (a local moto server): store, raw data and checkpoints on s3://.

A 2-pod PyTorchJob (backend=kubernetes, nnodes=2, parallelism=fsdp, async checkpoints, max_restarts=1),
run once for the module, in three executions that each take up where the one before was aborted: staged
(``staged``), recovered and aborted once the train node succeeded (``two_pods``), recovered to its end
(``finished``; ``replay --recover`` is Flyte's recover: what succeeded is not run again). The fast
registration's code tarball, every node's inputs/outputs, the staged dataset, the checkpoints (every rank
writes its own shards straight into the store; rank 0 commits each step with its marker), the exported
model and the evaluation all go through s3:// URIs on the server; the pods reach it only through the
FLYTE_AWS_* settings a platform injects. ``two_pods`` keeps an untouched copy of its checkpoint root in
the bucket. Then each test resumes a root of that
run from a step before the end (its last step dropped, as if the attempt died before committing it):

- Flyte's retry of the train node (attempt 1, new pods, same inputs.pb, so the run's own root, first put
  back as the run left it): bitwise the weights of the uninterrupted run (the same world size and pods,
  deterministic CPU training of the example team package's model, examples/teamnet, which fast
  registration ships with the code);
- a new execution on one pod of two processes, from its own copy of the root, its store the replay's
  default, a local directory (its checkpoints still in the bucket): the fast registration replayed end to
  end (every node; the train pod fetched the code tarball into its own directory and ran from there); its
  processes run one torch thread each, and it ends within float rounding of the uninterrupted run;
- a new execution on one pod of one process with a restart budget (max_restarts=1), from its own copy, its
  store a local directory too (what it tests is the pod, not the store): the pod's environment has no
  OMP_NUM_THREADS, so its one elastic worker runs at torch's default thread count
  (every core), the worker that once hung when it was forked from the task's process; it trains to the end
  on a world of one, from the checkpoint two ranks wrote (the execution is aborted after its train node:
  `replay --abort-after`, no export or evaluation);
- the scheduled retraining (retrain_and_promote) on the same two pods, its checkpoint root in the bucket,
  warm-started from the registry's latest version, which is the run's exported model, published to a
  registry in the bucket as an operator does by hand; the model it trains is published after it.

Each of those executions, and the retraining's two (its train node, then its recovery to the promotion),
is paid for by the first test that asks for it, so that no test comes near the suite's 120 s a test.

The tests share only those executions; each leaves the others' roots and work directories alone, so any
one of them runs alone (the first one to run pays for the executions it needs). Under pytest-xdist the
file is one scope, run whole by one worker (tests/scopes.py), so the 2-pod run happens once.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import uuid
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from replay_helpers import ROOT, recovered_nodes, run_recovery, run_replay  # noqa: I001  (a module beside this file)

from traincore.artifacts.lineage import Lineage
from traincore.checkpoint import Store, complete_steps, read_marker, step_store
from traincore.checkpoint.format import read_checkpoint
from traincore.checkpoint.prune import remove_step
from traincore.data import MANIFEST, Manifest

pytestmark = pytest.mark.slow

MAX_STEPS, EVERY = 20, 10
TRAIN_NODE = "n2-0-dn0"  # the train task inside the @dynamic train_on_backend node
# The example team package's model (examples/teamnet), which fast registration ships with the code.
MODEL = {"name": "examples.teamnet.models:resnet_tiny", "kwargs": {"width": 16, "depth": 1}}
# Shards of 512 digits: the train split's three shards are staged by two partitions (a map task of two pods).
# A stream cache of 400 KB per process: the 1.8 MB staged is 4.6x what a pod may keep on its disk.
CACHE_BYTES = 400_000
CONFIG = json.dumps({"model": MODEL, "data": {"samples_per_shard": 512},
                     "loader": {"batch_size": 8, "cache_bytes": CACHE_BYTES},
                     "optim": {"lr": 0.01},
                     "checkpoint": {"every": EVERY, "mode": "async"}, "telemetry": {"tensorboard": False}})
TWO_PODS = ("backend=kubernetes", "nnodes=2", "nproc_per_node=1", "max_restarts=1", "parallelism=fsdp")
SECRET_NAME = "FLYTE_AWS_SECRET_ACCESS_KEY"


def weights(root: Store, step: int) -> dict[str, torch.Tensor]:
    """The model tensors of checkpoint ``step``, read straight from the bucket."""
    tensors, info = read_checkpoint(step_store(root, step))
    assert info["step"] == step
    return tensors


def bitwise_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[name], b[name]) for name in a)


def resumed(train: dict) -> tuple[int | None, int, int]:
    """(resumed_from, steps, world_size) of a train node's summary."""
    return train["resumed_from"], train["steps"], train["world_size"]


def drop_last_step(root: Store) -> int:
    """The last attempt "died" before its last checkpoint: remove it (marker first, as a prune does); the
    step a resume now starts from."""
    remove_step(step_store(root, complete_steps(root)[-1]))
    return complete_steps(root)[-1]


def copy_objects(s3, source: str, target: str) -> None:
    """Every object under the key prefix ``source`` to the same key under ``target`` (the bucket's own
    copies: no byte passes through this process)."""
    client = s3.client()
    for key in s3.keys(f"{source}/"):
        client.copy_object(Bucket=s3.bucket, Key=f"{target}{key[len(source):]}",
                           CopySource={"Bucket": s3.bucket, "Key": key})


def bucket_store(s3, prefix: str) -> Store:
    """The objects under the key prefix ``prefix`` as a checkpoint root."""
    return Store(f"s3://{s3.bucket}/{prefix}", s3.storage_options)


def root_copy(run: SimpleNamespace) -> tuple[str, Store]:
    """A fresh copy of the run's checkpoint root as the run left it: its key prefix and its Store."""
    prefix = f"checkpoints/copy-{uuid.uuid4().hex[:8]}"
    copy_objects(run.s3, run.pristine, prefix)
    return prefix, bucket_store(run.s3, prefix)


def assert_no_secret(s3, workdir: Path, prefix: str) -> None:
    """The pods got the store's credentials from the environment only: no file a replay left in
    ``workdir`` holds them, and no object of the checkpoint root under ``prefix``."""
    secret = s3.env[SECRET_NAME].encode()
    holding = [path for path in workdir.rglob("*") if path.is_file() and secret in path.read_bytes()]
    assert not holding, holding
    client = s3.client()
    assert not [key for key in s3.keys(f"{prefix}/")
                if secret in client.get_object(Bucket=s3.bucket, Key=key)["Body"].read()]


def resumed_execution(run: SimpleNamespace, workdir: Path, *topology: str, s3_store: bool = True,
                      through_training: bool = False) -> SimpleNamespace:
    """A new execution on ``topology`` from a copy of the run's root, its last step dropped; its own store,
    in the bucket, or with ``s3_store=False`` the replay's default (a directory in ``workdir``); with
    ``through_training``, aborted once the train node succeeded (no export or evaluation): the step it
    resumes from (``latest``), the copy (``root``), the replay's output and summary and the train node's
    summary (``train``)."""
    prefix, root = root_copy(run)
    latest = drop_last_step(root)
    options = ("--store", f"s3://{run.s3.bucket}/store-{workdir.name}") if s3_store else ()
    options += ("--abort-after", TRAIN_NODE) if through_training else ()
    code, output, summary = run_replay(
        run.package, workdir, *topology, "parallelism=fsdp", f"max_steps={MAX_STEPS}",
        f"config_overrides={CONFIG}", f"checkpoint_uri={root}", options=options, env=run.s3.env)
    assert code == (3 if through_training else 0), output[-6000:]
    assert_no_secret(run.s3, workdir, prefix)
    return SimpleNamespace(latest=latest, root=root, output=output, summary=summary,
                           train=summary["node_outputs"][TRAIN_NODE]["o0"]["summary"])


def recovery(run: SimpleNamespace, workdir: Path, execution: str, *options: str) -> tuple[int, str, dict]:
    """The recovery of ``execution`` of the run's store; exit 3 when ``options`` abort it after a node, else
    0."""
    code, output, summary = run_recovery(run.package, workdir, execution, run.store, *options, env=run.s3.env)
    assert code == (3 if "--abort-after" in options else 0), output[-6000:]
    return code, output, summary


@pytest.fixture(scope="module")
def staged(fast_package, s3_server, tmp_path_factory) -> SimpleNamespace:
    """The 2-pod run into the bucket, aborted once its dataset is staged (the stage node's map task)."""
    s3, workdir = s3_server, tmp_path_factory.mktemp("s3-replay") / "staged"
    ckpt = f"checkpoints/run-{uuid.uuid4().hex[:8]}"
    root, store = bucket_store(s3, ckpt), f"s3://{s3.bucket}/store"
    code, output, summary = run_replay(
        fast_package, workdir, *TWO_PODS, f"max_steps={MAX_STEPS}", f"config_overrides={CONFIG}",
        f"checkpoint_uri={root}", "stage_partitions=2", options=("--store", store, "--abort-after", "n1"),
        env=s3.env)
    assert code == 3, output[-6000:]
    return SimpleNamespace(package=fast_package, s3=s3, store=store, workdir=workdir, summary=summary,
                           ckpt=ckpt, root=root)


@pytest.fixture(scope="module")
def two_pods(staged) -> SimpleNamespace:
    """The staged run recovered, and aborted once its 2-pod train node succeeded, uninterrupted; an
    untouched copy of its checkpoint root (key prefix ``pristine``): the tests resume copies of it, the
    retry the root itself."""
    workdir = staged.workdir.parent / "trained"
    _, _, summary = recovery(staged, workdir, staged.summary["execution"], "--abort-after", TRAIN_NODE)
    pristine = f"checkpoints/pristine-{uuid.uuid4().hex[:8]}"
    copy_objects(staged.s3, staged.ckpt, pristine)
    return SimpleNamespace(**{**vars(staged), "workdir": workdir, "summary": summary, "pristine": pristine,
                              "final": weights(bucket_store(staged.s3, pristine), MAX_STEPS)})


@pytest.fixture(scope="module")
def finished(two_pods) -> SimpleNamespace:
    """The trained run recovered to its end: the export and the evaluation."""
    workdir = two_pods.workdir.parent / "finished"
    _, output, summary = recovery(two_pods, workdir, two_pods.summary["execution"])
    return SimpleNamespace(**{**vars(two_pods), "workdir": workdir, "summary": summary, "output": output})


def test_the_fast_registration_ships_the_code_the_pods_run(fast_package):
    """The package `make register` writes (built once per session) holds the workflow's serialised entities
    and one code tarball with the tasks and the example team package the 2-pod run trains. Its own test:
    the module's 2-pod run is the cost of the test that first asks for it, and the build is not part of it."""
    import tarfile

    with tarfile.open(fast_package) as package:
        (code,) = [member for member in package.getmembers() if member.name.endswith(".tar.gz")]
        assert any(name.endswith("workflows.pipeline.training_pipeline_2.pb") for name in package.getnames())
        with tarfile.open(fileobj=package.extractfile(code)) as tarball:
            files = set(tarball.getnames())
    assert {"tasks/train.py", "examples/teamnet/models.py"} <= files, sorted(files)[:20]


def test_the_dataset_is_staged_by_a_map_task_of_two_pods_into_the_bucket(staged):
    """stage_partitions=2: the stage node's map task runs one pod per partition, each uploading its shards
    to one location in the bucket, and the manifest written after them lists every shard in order; the
    train pods read the data from there (an s3:// dataset is streamed, never copied whole)."""
    mapped = [node for node in staged.summary["nodes"] if "map_stage_partition_task" in node["task"]]
    assert [(node["node_id"], node["pods"]) for node in mapped] == [("n1-0-dn0", 2)]
    location = staged.summary["node_outputs"]["n1"]["o0"]["directory"]["path"]
    assert location.startswith(f"s3://{staged.s3.bucket}/")
    staged = Store(location, staged.s3.storage_options)
    manifest = Manifest.from_bytes(staged.read_bytes(MANIFEST), location)
    train = manifest.splits["train"]
    assert [shard.images for shard in train.shards] == [f"train-0000{i}.u8" for i in range(3)]
    assert sum(info.count for info in manifest.splits.values()) == 1797
    assert all(staged.is_file(shard.images) for info in manifest.splits.values() for shard in info.shards)


def test_two_pods_checkpoint_into_s3_every_rank_its_own_shards(two_pods):
    s3, summary = two_pods.s3, two_pods.summary
    # The staging (its map task and the manifest's publication), recovered from the staged execution.
    assert recovered_nodes(summary) == ["n0", "n1", "n1-0-dn0", "n1-0-dn1"]
    train = summary["node_outputs"][TRAIN_NODE]["o0"]
    assert resumed(train["summary"]) == (None, MAX_STEPS, 2)
    assert train["checkpoints"]["path"].startswith(two_pods.root.uri)
    # The root as the run left it (the retry test resumes in the root itself).
    root = bucket_store(s3, two_pods.pristine)
    steps = complete_steps(root)
    assert steps[-1] == MAX_STEPS and set(steps) <= set(range(EVERY, MAX_STEPS + 1, EVERY)), steps
    for step in steps:  # one shard file per rank, written by that rank, and a marker listing them
        files = read_marker(step_store(root, step))["files"]
        shards = {name: entry["rank"] for name, entry in files.items() if name.endswith(".distcp")}
        assert shards == {"__0_0.distcp": 0, "__1_0.distcp": 1}, files
        assert read_marker(step_store(root, step))["mode"] == "async"
    pods = sorted(two_pods.workdir.glob(f"pods/{summary['execution']}-{TRAIN_NODE}-0-worker-*"))
    assert len(pods) == 2 and SECRET_NAME in json.loads((pods[0] / "pod.json").read_text())["platform_env"]
    assert_no_secret(s3, two_pods.workdir, two_pods.pristine)


def test_every_artifact_of_the_run_recovered_to_its_end_lives_in_the_bucket(finished):
    s3, summary = finished.s3, finished.summary
    assert recovered_nodes(summary) == ["n0", "n1", "n1-0-dn0", "n1-0-dn1", "n2", TRAIN_NODE]
    assert [node["node_id"] for node in summary["nodes"] if node["pods"]] == ["n3", "n4"]
    # Every artifact lives in the bucket and the outputs point there, not to a pod's disk; the recovered
    # nodes' outputs are this execution's too.
    keys = s3.keys("store/")
    assert any(k.startswith("store/fast/replay/fast") and k.endswith(".tar.gz") for k in keys)
    for node in ("n0", "n1", "n2", TRAIN_NODE, "n3", "n4"):
        assert any(k.endswith(f"{summary['execution']}/{node}/data/0/outputs.pb") for k in keys), node
    assert any(k.startswith("store/raw/") and k.endswith("/manifest.json") for k in keys)  # staged data
    assert any(k.startswith("store/raw/") and k.endswith("/model.safetensors") for k in keys)  # export
    assert summary["outputs"]["model"]["directory"]["path"].startswith(f"s3://{s3.bucket}/store/raw/")
    # Evaluated from the bucket on the whole test split (20 steps teach this model little: what it learns is
    # test_pod_restarts.py's reference run's, which reaches the digits preset's accuracy).
    result = summary["outputs"]["report"]["result"]
    [manifest] = [k for k in keys if k.startswith("store/raw/") and k.endswith("/manifest.json")]
    staged = json.loads(s3.client().get_object(Bucket=s3.bucket, Key=manifest)["Body"].read())
    assert result["count"] == staged["splits"]["test"]["count"] > 0 and 0 <= result["accuracy"] <= 1
    assert_no_secret(s3, finished.workdir, finished.pristine)


def test_streamed_through_a_cache_a_quarter_of_the_dataset_it_trains_as_from_local_disk(two_pods, tmp_path):
    """The same 2-pod fsdp run from the replay's local store (the dataset memory-mapped from disk) ends with
    bitwise the weights of the run that streamed it from the bucket, whose pods each kept at most
    CACHE_BYTES of it (the cache is one file of that many bytes' slots: tests/traincore/data/
    test_stream.py), while the staged dataset is over 4x that."""
    logs = [path.read_text(errors="replace") for path in (two_pods.workdir / "pods").glob("*/log*")
            if "streaming s3://" in path.read_text(errors="replace")]
    assert logs, "no pod said it streamed the dataset"
    line = next(line for line in logs[0].splitlines() if "streaming s3://" in line)
    staged = float(re.search(r"\(([0-9.]+) MiB staged\)", line).group(1)) * 2**20
    cached = int(re.search(r"\((\d+) samples\)", line).group(1)) * 32 * 32  # digits: 1x32x32 uint8
    assert cached <= CACHE_BYTES and staged >= 4 * cached, line
    root = tmp_path / "checkpoints"  # what is compared is the training: the execution stops after it
    code, output, _ = run_replay(two_pods.package, tmp_path / "run", *TWO_PODS, f"max_steps={MAX_STEPS}",
                                 f"config_overrides={CONFIG}", f"checkpoint_uri={root}", env=two_pods.s3.env,
                                 options=("--abort-after", TRAIN_NODE))
    assert code == 3, output[-6000:]
    assert "streaming s3://" not in "".join(p.read_text(errors="replace")
                                            for p in (tmp_path / "run" / "pods").glob("*/log*"))
    assert bitwise_equal(weights(Store(root), MAX_STEPS), two_pods.final)


def test_flyte_retry_of_the_train_node_resumes_the_root_bitwise(two_pods, tmp_path):
    s3, root, execution = two_pods.s3, two_pods.root, two_pods.summary["execution"]
    # The retry's inputs.pb names the run's own root: put it back as the run left it first.
    client = s3.client()
    for key in s3.keys(f"{two_pods.ckpt}/"):
        client.delete_object(Bucket=s3.bucket, Key=key)
    copy_objects(s3, two_pods.pristine, two_pods.ckpt)
    latest = drop_last_step(root)
    workdir = tmp_path / "retry"
    code, output, retry = run_replay(
        two_pods.package, workdir, module="replay.retry", env=s3.env,
        options=("--store", two_pods.store, "--execution", execution, "--node", TRAIN_NODE))
    assert code == 0, output[-6000:]
    assert resumed(retry["outputs"]["o0"]["summary"]) == (latest, MAX_STEPS, 2)
    assert any(k.endswith(f"/{TRAIN_NODE}/data/1/outputs.pb") for k in s3.keys("store/"))
    pods = sorted(workdir.glob(f"pods/{execution}-{TRAIN_NODE}-1-worker-*"))
    started = json.loads((pods[0] / "pod.json").read_text())
    assert len(pods) == 2 and started["env"]["FLYTE_ATTEMPT_NUMBER"] == "1"
    logs = "".join((pod / "log.txt").read_text(errors="replace") for pod in pods)  # rank 0 says it
    assert f"resumed from step {latest}" in logs
    assert bitwise_equal(weights(root, MAX_STEPS), two_pods.final)
    assert SECRET_NAME in started["platform_env"]
    assert_no_secret(s3, workdir, two_pods.ckpt)


def test_one_pod_of_two_processes_resumes_a_copy_of_the_root(two_pods, tmp_path):
    workdir = tmp_path / "one-pod"
    run = resumed_execution(two_pods, workdir, "nnodes=1", "nproc_per_node=2", s3_store=False)
    assert resumed(run.train) == (run.latest, MAX_STEPS, 2)
    # Fast registration end to end with the replay's default store, a local directory: every node ran, the
    # train node as the task for 1 node x 2 processes in one pod, which fetched the code tarball into its
    # own directory and ran from there, not from the checkout; the first attempt has no previous checkpoint.
    # The digits (1.8 MB) are staged in the stage node's own pod, with no map task or publish step (those of
    # the module's run come from its two partitions); the train task runs inside n2.
    assert [n["node_id"] for n in run.summary["nodes"]] == ["n0", "n1", "n2", TRAIN_NODE, "n3", "n4"]
    stage_log = workdir / "pods" / f"{run.summary['execution']}-n1-0" / "log.txt"
    assert "stage_dataset: small enough to stage in this pod" in stage_log.read_text(errors="replace")
    (node,) = [node for node in run.summary["nodes"] if node["node_id"] == TRAIN_NODE]
    assert node["task"].endswith("1x2") and node["pods"] == 1
    (pod,) = workdir.glob(f"pods/{run.summary['execution']}-{TRAIN_NODE}-0*")
    args = json.loads((pod / "pod.json").read_text())["args"]
    assert args[0] == "pyflyte-fast-execute" and (pod / "code" / "tasks" / "train.py").is_file()
    assert "--prev-checkpoint" in args and args[args.index("--prev-checkpoint") + 1] == '""'
    assert "replay: output report: accuracy" in run.output and "tasks.evaluate.evaluate_model" in run.output
    # The same world size, but two processes share one pod's cores (one torch thread each, where each pod
    # of the job ran two): CPU kernels round differently in the last bits, and twenty steps carry that on.
    # The run still took the uninterrupted one's path from step `latest`: where it ends is far closer to
    # where that run ended than either is to where both started.
    start, end, final = weights(run.root, run.latest), weights(run.root, MAX_STEPS), two_pods.final
    for name, tensor in final.items():
        if tensor.is_floating_point():
            moved = (tensor - start[name]).abs().sum()
            assert (end[name] - tensor).abs().sum() <= 0.02 * moved, name


def test_one_pod_of_one_multithreaded_process_with_restarts_resumes_a_copy_of_the_root(two_pods, tmp_path):
    workdir = tmp_path / "one-process"
    run = resumed_execution(two_pods, workdir, "nnodes=1", "nproc_per_node=1", "max_restarts=1",
                            s3_store=False, through_training=True)
    assert resumed(run.train) == (run.latest, MAX_STEPS, 1)
    # A restart budget makes the task launch an elastic worker (one process without one trains in the
    # task's own process), and nothing sets that worker's threads: it runs at torch's default in the pod,
    # every core, the case that hung when such a worker was forked from the task's process.
    (node,) = [node for node in run.summary["nodes"] if node["node_id"] == TRAIN_NODE]
    assert node["task"] == "tasks.train.train-local-1x1-restarts1"
    (pod,) = workdir.glob(f"pods/{run.summary['execution']}-{TRAIN_NODE}-0*")
    assert "OMP_NUM_THREADS" not in json.loads((pod / "pod.json").read_text())["env"]
    # The two ranks' shards load on a world of one, and the run's last checkpoint holds the same tensors.
    assert weights(run.root, MAX_STEPS).keys() == two_pods.final.keys()


def published(s3, registry: str, model_dir: str, workdir: Path) -> str:
    """Publish the exported model at the URI ``model_dir`` to ``registry`` with `python -m traincore.registry
    publish`, as an operator does by hand (the store through the standard AWS variables); its version."""
    local = workdir / "model"
    Store(model_dir, s3.storage_options).fs.get(model_dir.rstrip("/") + "/", str(local), recursive=True)
    run = subprocess.run([sys.executable, "-m", "traincore.registry", "publish", registry, str(local),
                          "--trust-model-code"], capture_output=True, text=True, cwd=ROOT, timeout=120,
                         env={**os.environ, **s3.aws_env, "PYTHONPATH": str(ROOT)})
    assert run.returncode == 0, run.stdout + run.stderr
    return run.stdout.split(": published ")[1].split()[0]


RETRAIN_STAGED = "n2-0-n1"  # the staging inside training_pipeline (the sub-workflow n2)
RETRAIN_TRAIN_NODE = "n2-0-n2-0-dn0"  # its train task


@pytest.fixture(scope="module")
def retraining(finished, tmp_path_factory) -> SimpleNamespace:
    """The scheduled retraining on the same two pods, warm-started from the registry's latest version (the
    finished run's model, published as an operator does by hand), aborted once its dataset is staged."""
    s3, base = finished.s3, tmp_path_factory.mktemp("retrain")
    registry = f"s3://{s3.bucket}/registry-{uuid.uuid4().hex[:8]}"
    served = published(s3, registry, finished.summary["outputs"]["model"]["directory"]["path"], base)
    root = bucket_store(s3, f"checkpoints/retrain-{uuid.uuid4().hex[:8]}")
    code, output, summary = run_replay(
        finished.package, base / "staged", *TWO_PODS, "source=digits", f"max_steps={EVERY}",
        f"config_overrides={CONFIG}", f"checkpoint_uri={root}", "warm_start=true", f"promoted_uri={registry}",
        "threshold=0", "tolerance=1", env=s3.env,
        options=("--launch-plan", "workflows.schedules.retrain_and_promote", "--store", finished.store,
                 "--abort-after", RETRAIN_STAGED))
    assert code == 3, output[-6000:]
    return SimpleNamespace(**{**vars(finished), "registry": registry, "served": served, "summary": summary,
                              "workdir": base / "staged", "root": root, "base": base})


def test_retraining_starts_from_the_registrys_latest_version(retraining):
    weights = f"{retraining.registry}/{retraining.served}/model.safetensors"
    assert weights in retraining.summary["node_outputs"]["n1"]["o0"]  # the config the training is given
    warm = f"warm_start: model.init_from={weights}"
    assert any(warm in path.read_text() for path in retraining.workdir.rglob("log.txt")), \
        "no pod says where it started"


@pytest.fixture(scope="module")
def retrained(retraining) -> SimpleNamespace:
    """The staged retraining recovered, and aborted once its train node succeeded."""
    workdir = retraining.base / "trained"
    _, _, summary = recovery(retraining, workdir, retraining.summary["execution"],
                             "--abort-after", RETRAIN_TRAIN_NODE)
    return SimpleNamespace(**{**vars(retraining), "summary": summary, "workdir": workdir})


def test_retraining_trains_on_two_pods_into_its_root_in_the_bucket(retrained):
    trains = [node for node in retrained.summary["nodes"] if node["task"].startswith("tasks.train.train-")]
    assert [(node["task"].split("-", 2)[1], node["pods"]) for node in trains] == [("kubernetes", 2)]
    assert complete_steps(retrained.root) == [EVERY]  # its checkpoints in the bucket, at the root given


def test_retraining_recovered_promotes_the_model_it_trained_over_the_one_in_service(retrained, tmp_path):
    s3, registry, served = retrained.s3, retrained.registry, retrained.served
    _, _, summary = recovery(retrained, tmp_path / "promote", retrained.summary["execution"])
    assert RETRAIN_TRAIN_NODE in recovered_nodes(summary)
    promotion = summary["outputs"]["o0"]
    assert promotion["promoted"], promotion
    assert promotion["champion_origin"] == f"{registry}/{served} (latest)", promotion
    # The served model, evaluated anew on the same new test split as the new one.
    assert promotion["champion"]["result"]["count"] == promotion["challenger"]["result"]["count"] > 0
    store = Store(registry, s3.storage_options)
    assert store.read_bytes("latest").decode().strip() == promotion["version"] != served
    lineage = Lineage.from_json(store.read_bytes(f"{promotion['version']}/lineage.json"))
    first = Lineage.from_json(store.read_bytes(f"{served}/lineage.json"))
    assert lineage.init_sha256 == first.model_sha256 and lineage.world_size == 2, lineage
    assert lineage.config["model"]["init_from"] == f"{registry}/{served}/model.safetensors"
