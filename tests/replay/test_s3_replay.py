"""The replayed workflow on a real S3 API (a local moto server): store, raw data and checkpoints on s3://.

The fast registration's code tarball, every node's inputs/outputs, the staged dataset, the checkpoints
(published by the train pod's mirror, tasks/mirror.py over traincore/checkpoint/mirror.py), the exported
model and the evaluation all go through s3:// URIs on the server; the pods reach it only through the
FLYTE_AWS_* settings a platform injects. Then Flyte's retry of the train node (attempt 1, same inputs.pb,
a fresh pod whose node-local cache is empty) must restore from the s3 checkpoint root and resume.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from replay_helpers import run_replay  # noqa: I001  (a module beside this file)

from traincore.checkpoint.format import read_checkpoint
from traincore.checkpoint.layout import MARKER

MAX_STEPS, EVERY = 60, 20
TRAIN_NODE = "n2-0-dn0"  # the train task inside the @dynamic train_on_backend node
CONFIG = json.dumps({"checkpoint": {"every": EVERY}, "telemetry": {"tensorboard": False}})


def checkpoint_steps(s3, prefix: str) -> list[int]:
    """Complete checkpoints (commit marker present) under ``prefix`` in the bucket."""
    return sorted(int(key.split("/")[-2].removeprefix("step-")) for key in s3.keys(prefix)
                  if key.endswith(f"/{MARKER}"))


def download_weights(s3, prefix: str, step: int, into: Path) -> dict[str, bytes]:
    """The model tensors of checkpoint ``step``, fetched from the bucket, as raw bytes."""
    client, directory = s3.client(), f"{prefix}/step-{step:06d}/"
    for key in s3.keys(directory):
        target = into / key.removeprefix(directory)
        target.parent.mkdir(parents=True, exist_ok=True)
        client.download_file(s3.bucket, key, str(target))
    weights, info = read_checkpoint(into)
    assert info["step"] == step
    return {name: tensor.contiguous().numpy().tobytes() for name, tensor in weights.items()}


@pytest.mark.slow
def test_workflow_on_s3_and_train_retry_resumes_from_the_s3_checkpoint_root(fast_package, s3_server,
                                                                              tmp_path):
    s3, store, ckpt = s3_server, f"s3://{s3_server.bucket}/store", "checkpoints/run-1"
    workdir = tmp_path / "run"
    code, output, summary = run_replay(
        fast_package, workdir, f"max_steps={MAX_STEPS}", "nproc_per_node=1", f"config_overrides={CONFIG}",
        f"checkpoint_uri=s3://{s3.bucket}/{ckpt}", options=("--store", store), env=s3.env)
    assert code == 0, output[-6000:]
    train = summary["node_outputs"][TRAIN_NODE]["o0"]
    assert (train["summary"]["steps"], train["summary"]["resumed_from"]) == (MAX_STEPS, None)
    # Every artifact lives in the bucket and the outputs point there, not to a pod's disk.
    keys = s3.keys("store/")
    assert any(k.startswith("store/fast/replay/fast") and k.endswith(".tar.gz") for k in keys)
    for node in ("n0", "n1", "n2", TRAIN_NODE, "n3", "n4"):
        assert any(k.endswith(f"/{node}/data/0/outputs.pb") for k in keys), node
    assert any(k.startswith("store/raw/") and k.endswith("/manifest.json") for k in keys)  # staged data
    assert any(k.startswith("store/raw/") and k.endswith("/model.safetensors") for k in keys)  # export
    # The exported model's directory is in the bucket (its export record keeps the exporting pod's paths).
    assert summary["outputs"]["model"]["directory"]["path"].startswith(f"s3://{s3.bucket}/store/raw/")
    assert train["checkpoints"]["path"].startswith(f"s3://{s3.bucket}/{ckpt}")
    assert summary["outputs"]["report"]["result"]["accuracy"] > 0.3
    steps = checkpoint_steps(s3, ckpt)
    assert steps[-1] == MAX_STEPS and set(steps) <= set(range(EVERY, MAX_STEPS + 1, EVERY)), steps
    final = download_weights(s3, ckpt, MAX_STEPS, tmp_path / "attempt-0")

    # Attempt 0 "died" before its last checkpoint: drop it from the bucket (marker first, as a prune does).
    client = s3.client()
    client.delete_object(Bucket=s3.bucket, Key=f"{ckpt}/step-{MAX_STEPS:06d}/{MARKER}")
    for key in s3.keys(f"{ckpt}/step-{MAX_STEPS:06d}/"):
        client.delete_object(Bucket=s3.bucket, Key=key)
    latest = checkpoint_steps(s3, ckpt)[-1]
    assert latest == MAX_STEPS - EVERY

    code, output, retry = run_replay(
        fast_package, workdir, module="replay.retry", env=s3.env,
        options=("--store", store, "--execution", summary["execution"], "--node", TRAIN_NODE))
    assert code == 0, output[-6000:]
    result = retry["outputs"]["o0"]["summary"]
    assert (result["resumed_from"], result["steps"]) == (latest, MAX_STEPS)
    assert checkpoint_steps(s3, ckpt)[-1] == MAX_STEPS  # republished by attempt 1's mirror
    assert any(k.endswith(f"/{TRAIN_NODE}/data/1/outputs.pb") for k in s3.keys("store/"))
    (pod,) = workdir.glob(f"pods/{summary['execution']}-{TRAIN_NODE}-1")
    started = json.loads((pod / "pod.json").read_text())
    assert started["env"]["FLYTE_ATTEMPT_NUMBER"] == "1"
    previous = started["args"][started["args"].index("--prev-checkpoint") + 1]
    assert previous.startswith(f"{store}/raw/") and previous.endswith(f"-{TRAIN_NODE}-0/_flytecheckpoints")
    log = (pod / "log.txt").read_text(errors="replace")
    assert f"restored checkpoint step {latest}" in log or f"resumed from step {latest}" in log, log[-3000:]
    # Deterministic training: the resumed attempt ends with bitwise the weights attempt 0 had.
    assert download_weights(s3, ckpt, MAX_STEPS, tmp_path / "attempt-1") == final
    # The pods got the store's credentials from the environment only: no file the replay left holds them.
    secret = s3.env["FLYTE_AWS_SECRET_ACCESS_KEY"]
    holding = [path for path in workdir.rglob("*") if path.is_file() and secret.encode() in path.read_bytes()]
    assert not holding, holding
    assert "FLYTE_AWS_SECRET_ACCESS_KEY" in started["platform_env"]
