"""The replayed workflow on a real S3 API (a local moto server): store, raw data and checkpoints on s3://.

A 2-pod PyTorchJob (backend=kubernetes, nnodes=2, parallelism=fsdp, async checkpoints, max_restarts=1):
the fast registration's code tarball, every node's inputs/outputs, the staged dataset, the checkpoints
(every rank writes its own shards straight into the store; rank 0 commits each step with its marker), the
exported model and the evaluation all go through s3:// URIs on the server; the pods reach it only through
the FLYTE_AWS_* settings a platform injects. Then the same checkpoint root resumes twice from a step
before the end: in Flyte's retry of the train node (attempt 1, new pods, same inputs.pb), and in a new
execution on one pod of two processes. The retry ends with bitwise the weights of the uninterrupted run (the
same world size and pods, deterministic CPU training of the example team package's model, examples/teamnet,
which fast registration ships with the code); the
one-pod execution, whose processes run one torch thread each, ends within float rounding of them.
"""

from __future__ import annotations

import json
import uuid

import pytest
import torch
from replay_helpers import run_replay  # noqa: I001  (a module beside this file)

from traincore.checkpoint import Store, complete_steps, read_marker, step_store
from traincore.checkpoint.format import read_checkpoint
from traincore.checkpoint.prune import remove_step

MAX_STEPS, EVERY = 60, 20
TRAIN_NODE = "n2-0-dn0"  # the train task inside the @dynamic train_on_backend node
# The example team package's model (examples/teamnet), which fast registration ships with the code.
MODEL = {"name": "examples.teamnet.models:resnet_tiny", "kwargs": {"width": 16, "depth": 1}}
CONFIG = json.dumps({"model": MODEL, "loader": {"batch_size": 8}, "optim": {"lr": 0.01},
                     "checkpoint": {"every": EVERY, "mode": "async"}, "telemetry": {"tensorboard": False}})
TWO_PODS = ("backend=kubernetes", "nnodes=2", "nproc_per_node=1", "max_restarts=1", "parallelism=fsdp")


def weights(root: Store, step: int) -> dict[str, torch.Tensor]:
    """The model tensors of checkpoint ``step``, read straight from the bucket."""
    tensors, info = read_checkpoint(step_store(root, step))
    assert info["step"] == step
    return tensors


def bitwise_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[name], b[name]) for name in a)


def drop_last_step(root: Store) -> int:
    """The last attempt "died" before its last checkpoint: remove it (marker first, as a prune does); the
    step a resume now starts from."""
    remove_step(step_store(root, complete_steps(root)[-1]))
    return complete_steps(root)[-1]


@pytest.mark.slow
def test_two_pods_checkpoint_into_s3_and_the_root_resumes_bitwise_on_two_pods_and_on_one(fast_package,
                                                                                        s3_server, tmp_path):
    s3, store = s3_server, f"s3://{s3_server.bucket}/store"
    ckpt = f"checkpoints/run-{uuid.uuid4().hex[:8]}"
    root = Store(f"s3://{s3.bucket}/{ckpt}", s3.storage_options)
    workdir = tmp_path / "run"
    code, output, summary = run_replay(
        fast_package, workdir, *TWO_PODS, f"max_steps={MAX_STEPS}", f"config_overrides={CONFIG}",
        f"checkpoint_uri={root}", options=("--store", store), env=s3.env)
    assert code == 0, output[-6000:]
    train = summary["node_outputs"][TRAIN_NODE]["o0"]
    assert (train["summary"]["steps"], train["summary"]["resumed_from"]) == (MAX_STEPS, None)
    assert train["summary"]["world_size"] == 2
    # Every artifact lives in the bucket and the outputs point there, not to a pod's disk.
    keys = s3.keys("store/")
    assert any(k.startswith("store/fast/replay/fast") and k.endswith(".tar.gz") for k in keys)
    for node in ("n0", "n1", "n2", TRAIN_NODE, "n3", "n4"):
        assert any(k.endswith(f"/{node}/data/0/outputs.pb") for k in keys), node
    assert any(k.startswith("store/raw/") and k.endswith("/manifest.json") for k in keys)  # staged data
    assert any(k.startswith("store/raw/") and k.endswith("/model.safetensors") for k in keys)  # export
    assert summary["outputs"]["model"]["directory"]["path"].startswith(f"s3://{s3.bucket}/store/raw/")
    assert train["checkpoints"]["path"].startswith(root.uri)
    assert summary["outputs"]["report"]["result"]["accuracy"] > 0.2
    steps = complete_steps(root)
    assert steps[-1] == MAX_STEPS and set(steps) <= set(range(EVERY, MAX_STEPS + 1, EVERY)), steps
    for step in steps:  # one shard file per rank, written by that rank, and a marker listing them
        files = read_marker(step_store(root, step))["files"]
        shards = {name: entry["rank"] for name, entry in files.items() if name.endswith(".distcp")}
        assert shards == {"__0_0.distcp": 0, "__1_0.distcp": 1}, files
        assert read_marker(step_store(root, step))["mode"] == "async"
    final = weights(root, MAX_STEPS)

    # Flyte's retry of the train node: attempt 1, new pods, the same root.
    latest = drop_last_step(root)
    code, output, retry = run_replay(
        fast_package, workdir, module="replay.retry", env=s3.env,
        options=("--store", store, "--execution", summary["execution"], "--node", TRAIN_NODE))
    assert code == 0, output[-6000:]
    result = retry["outputs"]["o0"]["summary"]
    assert (result["resumed_from"], result["steps"], result["world_size"]) == (latest, MAX_STEPS, 2)
    assert any(k.endswith(f"/{TRAIN_NODE}/data/1/outputs.pb") for k in s3.keys("store/"))
    pods = sorted(workdir.glob(f"pods/{summary['execution']}-{TRAIN_NODE}-1-worker-*"))
    started = json.loads((pods[0] / "pod.json").read_text())
    assert len(pods) == 2 and started["env"]["FLYTE_ATTEMPT_NUMBER"] == "1"
    logs = "".join((pod / "log.txt").read_text(errors="replace") for pod in pods)  # rank 0 says it
    assert f"resumed from step {latest}" in logs
    assert bitwise_equal(weights(root, MAX_STEPS), final)

    # A new execution on one pod of two processes resumes from the same root.
    latest = drop_last_step(root)
    start = weights(root, latest)
    code, output, again = run_replay(
        fast_package, tmp_path / "one-pod", "nnodes=1", "nproc_per_node=2", "parallelism=fsdp",
        f"max_steps={MAX_STEPS}", f"config_overrides={CONFIG}", f"checkpoint_uri={root}",
        options=("--store", f"{store}-one-pod"), env=s3.env)
    assert code == 0, output[-6000:]
    result = again["node_outputs"][TRAIN_NODE]["o0"]["summary"]
    assert (result["resumed_from"], result["steps"], result["world_size"]) == (latest, MAX_STEPS, 2)
    # The same world size, but two processes share one pod's cores (one torch thread each, where each pod
    # of the job ran two): CPU kernels round differently in the last bits, and twenty steps carry that on.
    # The run still took the uninterrupted one's path from step `latest`: where it ends is far closer to
    # where that run ended than either is to where both started.
    resumed = weights(root, MAX_STEPS)
    for name, tensor in final.items():
        if tensor.is_floating_point():
            moved = (tensor - start[name]).abs().sum()
            assert (resumed[name] - tensor).abs().sum() <= 0.02 * moved, name
    # The pods got the store's credentials from the environment only: no file the replays left holds them.
    secret = s3.env["FLYTE_AWS_SECRET_ACCESS_KEY"]
    holding = [path for path in tmp_path.rglob("*")
               if path.is_file() and secret.encode() in path.read_bytes()]
    assert not holding, holding
    assert "FLYTE_AWS_SECRET_ACCESS_KEY" in started["platform_env"]
    assert not [key for key in s3.keys(ckpt) if secret.encode() in s3.client().get_object(
        Bucket=s3.bucket, Key=key)["Body"].read()]
