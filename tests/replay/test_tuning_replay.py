"""The hyperparameter search replayed from its registration, node by node as a Flyte cluster runs it: two
trials, two rungs of successive halving, each trial a training run on the chosen backend.

- On the Kubernetes backend (the fast registration `make register` writes), each trial a PyTorchJob of two
  pods that shard the model between them, the search's root (its record and the trials' checkpoints) and
  every node's data in an S3 bucket (a local server), reached only through the settings a platform injects.
- On the local backend (the `pyflyte --pkgs workflows package` registration, code in the image), each trial
  a process of the train pod, the search's root under the execution's raw-output prefix.

Either way the surviving trial goes on from its own rung-0 checkpoint, the best trial's model is exported
with the search in its lineage and evaluated, and the record in the root holds both trials.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest
from replay_helpers import run_replay  # noqa: I001  (a module beside this file)

from traincore.checkpoint import Store
from traincore.tuning import StudyRecord
from traincore.tuning.study import RECORD_FILE

pytestmark = [pytest.mark.slow, pytest.mark.long]  # `make test-long`: a node is a pod, 17 nodes

SPACE = {"optim.lr": {"low": 5e-3, "high": 5e-2, "log": True}, "model.width": {"choices": [4, 8]}}
MAX_STEPS = 8  # rungs of 4 and 8 steps
OVERRIDES = {"loader": {"batch_size": 16}, "telemetry": {"tensorboard": False}}
SEARCH = (f"search_space={json.dumps(SPACE)}", "trials=2", "parallel=2", "rungs=2", f"max_steps={MAX_STEPS}",
          f"config_overrides={json.dumps(OVERRIDES)}")
PLAN = ("--launch-plan", "workflows.tuning.tune_pipeline")


def check_search(summary: dict, workdir: Path, world_size: int) -> dict:
    """What every replayed search shows: two trials at rung 0, the better one resumed from its own step-4
    checkpoint to step 8 (its pod says so), the best exported with the search in its lineage and evaluated.
    Returns the search outcome."""
    outputs = summary["outputs"]
    search = outputs["search"]
    first, last = search["rungs"]
    assert (first["budget"], first["trials"], first["resumed_from"]) == (4, [0, 1], [0, 0]), search
    assert (last["budget"], len(last["trials"]), last["resumed_from"]) == (8, 1, [4]), search
    better = max(zip(first["values"], [-t for t in first["trials"]], strict=True))
    assert last["trials"] == [-better[1]] and search["best_trial"] == last["trials"][0], search
    # 2 trials x 4 steps, then 1 x 4 more: 12 of the 16 that training both to the end takes
    assert outputs["summary"].startswith("steps spent: 12 of 16"), outputs["summary"]
    assert f"test accuracy: {outputs['report']['result']['accuracy']:.3f}" in outputs["summary"]
    best = outputs["best"]["summary"]
    assert (best["resumed_from"], best["steps"], best["world_size"]) == (4, MAX_STEPS, world_size), best
    lineage = outputs["model"]["export"]["lineage"]["search"]
    assert (lineage["trial"], lineage["rung"]) == (search["best_trial"], 1), lineage
    assert set(lineage["parameters"]) == set(SPACE)
    logs = [path.read_text(errors="replace") for path in workdir.rglob("log.txt")]
    assert any("resumed from step 4" in log for log in logs), "no pod log says the trial resumed"
    return search


def test_a_search_of_two_pod_trials_replays_on_kubernetes_with_its_root_in_s3(fast_package, s3_server,
                                                                                tmp_path):
    s3, workdir = s3_server, tmp_path / "run"
    root = f"s3://{s3.bucket}/search-{uuid.uuid4().hex[:8]}"
    code, output, summary = run_replay(
        fast_package, workdir, *SEARCH, "backend=kubernetes", "nnodes=2", "nproc_per_node=1",
        "parallelism=fsdp", f"checkpoint_uri={root}", options=(*PLAN, "--store", f"s3://{s3.bucket}/store"),
        env=s3.env)
    assert code == 0, output[-6000:]
    trains = [node for node in summary["nodes"] if node["task"].startswith("tasks.train.train-")]
    assert [node["pods"] for node in trains] == [2, 2, 2], summary["nodes"]  # 2 trials, then the survivor
    search = check_search(summary, workdir, world_size=2)
    record = StudyRecord(**json.loads(Store(root, s3.storage_options).read_bytes(RECORD_FILE)))
    assert len(record.params) == 2, record
    assert [set(values) for values in record.results] == [{"0", "1"}, {str(search["best_trial"])}], record


def test_a_search_replays_on_the_local_backend_from_the_package(non_fast_package, tmp_path):
    workdir = tmp_path / "run"
    code, output, summary = run_replay(non_fast_package, workdir, *SEARCH, "nproc_per_node=1",
                                       options=PLAN)
    assert code == 0, output[-6000:]
    check_search(summary, workdir, world_size=1)
