"""The hyperparameter search replayed from its registration, node by node as a Flyte cluster runs it: two
trials, two rungs of successive halving, each trial a training run on the chosen backend.

- On the Kubernetes backend (the fast registration `make register` writes), each trial a PyTorchJob of two
  pods that shard the model between them, the search's root (its record and the trials' checkpoints) and
  every node's data in an S3 bucket (a local server), reached only through the settings a platform injects.
  The module's first execution is aborted once its first rung is recorded (as a user aborts one on a
  cluster); the same launch again, as the docs tell a user to relaunch a search, trains no trial of that
  rung again and takes the survivor on from its own checkpoint in the bucket.
- On the local backend (the `pyflyte --pkgs workflows package` registration, code in the image), each trial
  a process of the train pod, the search's root under the execution's raw-output prefix, in one execution.

Either way the surviving trial goes on from its own rung-0 checkpoint, the best trial's model is exported
with the search in its lineage and evaluated, and the record in the root holds both trials. Each trial is
a train node of its rung's dynamic node: 13 nodes a search in one execution (on Kubernetes 16 pods; the
aborted execution here starts 9 and the relaunch 12, the first rung's trials not among them).
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from types import SimpleNamespace

import pytest
from replay_helpers import run_replay  # noqa: I001  (a module beside this file)

from traincore.checkpoint import Store, complete_steps
from traincore.tuning import StudyRecord
from traincore.tuning.study import RECORD_FILE

# `make test-long`: 77-119 s a test beside the suite's other worker on a fast day (2026-11-29), about twice
# that on the slower days, past a `make test` test's 120 s.
pytestmark = [pytest.mark.slow, pytest.mark.long]

SPACE = {"optim.lr": {"low": 5e-3, "high": 5e-2, "log": True}, "model.width": {"choices": [4, 8]}}
MAX_STEPS = 8  # rungs of 4 and 8 steps
OVERRIDES = {"loader": {"batch_size": 16}, "telemetry": {"tensorboard": False}}
SEARCH = (f"search_space={json.dumps(SPACE)}", "trials=2", "parallel=2", "rungs=2", f"max_steps={MAX_STEPS}",
          f"config_overrides={json.dumps(OVERRIDES)}")
PLAN = ("--launch-plan", "workflows.tuning.tune_pipeline")
KUBERNETES = ("backend=kubernetes", "nnodes=2", "nproc_per_node=1", "parallelism=fsdp")
FIRST_RUNG_RECORD = "n3-0-dn2"  # in run_rung's dynamic node: the two trials' train nodes, then rung_record


def check_search(summary: dict, workdir: Path, world_size: int, first_resumed: list[int]) -> dict:
    """What every replayed search shows: two trials at rung 0 (``first_resumed``: where they began, or
    the budget for a rung an earlier execution recorded), the better one resumed from its own step-4
    checkpoint to step 8 (its pod says so), the best exported with the search in its lineage and evaluated.
    Returns the search outcome."""
    outputs = summary["outputs"]
    search = outputs["search"]
    first, last = search["rungs"]
    assert (first["budget"], first["trials"], first["resumed_from"]) == (4, [0, 1], first_resumed), search
    assert (last["budget"], len(last["trials"]), last["resumed_from"]) == (8, 1, [4]), search
    better = max(zip(first["values"], [-t for t in first["trials"]], strict=True))
    assert last["trials"] == first["survivors"] == [-better[1]], search
    assert search["best_trial"] == last["trials"][0] and last["survivors"] == last["trials"], search
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


def trains(summary: dict) -> list[int]:
    """The pods of each train node the execution ran."""
    return [node["pods"] for node in summary["nodes"] if node["task"].startswith("tasks.train.train-")]


def kubernetes_search(run: SimpleNamespace, workdir: Path, *options: str) -> tuple[int, str, dict]:
    """The search on the Kubernetes backend into the module's root, its store in the bucket."""
    return run_replay(run.package, workdir, *SEARCH, *KUBERNETES, f"checkpoint_uri={run.root}",
                      options=(*PLAN, "--store", f"s3://{run.s3.bucket}/store", *options), env=run.s3.env)


def recorded(run: SimpleNamespace) -> StudyRecord:
    """The search's record as its root in the bucket holds it."""
    return StudyRecord(**json.loads(Store(run.root, run.s3.storage_options).read_bytes(RECORD_FILE)))


@pytest.fixture(scope="module")
def first_rung(fast_package, s3_server, tmp_path_factory) -> SimpleNamespace:
    """The Kubernetes search, aborted once its first rung is recorded: its root, output and summary."""
    run = SimpleNamespace(package=fast_package, s3=s3_server,
                          root=f"s3://{s3_server.bucket}/search-{uuid.uuid4().hex[:8]}",
                          workdir=tmp_path_factory.mktemp("search") / "first")
    run.code, run.output, run.summary = kubernetes_search(run, run.workdir,
                                                          "--abort-after", FIRST_RUNG_RECORD)
    return run


def test_a_search_of_two_pod_trials_on_kubernetes_aborted_after_its_first_rung_keeps_it_in_the_bucket(
        first_rung):
    assert first_rung.code == 3, first_rung.output[-6000:]
    assert f"replay: ABORTED: aborted after node {FIRST_RUNG_RECORD}" in first_rung.output
    assert trains(first_rung.summary) == [2, 2]  # both trials, each a PyTorchJob of 2 pods
    rung = first_rung.summary["node_outputs"][FIRST_RUNG_RECORD]["o0"]
    assert (rung["budget"], rung["trials"], rung["resumed_from"], len(rung["survivors"])) == (4, [0, 1],
                                                                                               [0, 0], 1)
    record = recorded(first_rung)
    assert len(record.params) == 2 and [set(values) for values in record.results] == [{"0", "1"}], record
    for trial in (0, 1):  # each trial's checkpoint of step 4, in its own root in the bucket
        root = Store(f"{first_rung.root}/trial-{trial:03d}", first_rung.s3.storage_options)
        assert complete_steps(root) == [4], trial


def test_the_same_search_launched_again_trains_only_the_survivor_on_from_its_checkpoint(first_rung, tmp_path):
    workdir = tmp_path / "again"
    code, output, summary = kubernetes_search(first_rung, workdir)
    assert code == 0, output[-6000:]
    assert trains(summary) == [2]  # the first rung's trials are in the record: only the survivor trains
    search = check_search(summary, workdir, world_size=2, first_resumed=[4, 4])
    record = recorded(first_rung)
    assert [set(values) for values in record.results] == [{"0", "1"}, {str(search["best_trial"])}], record


def test_a_search_replays_on_the_local_backend_from_the_package(non_fast_package, tmp_path):
    workdir = tmp_path / "run"
    code, output, summary = run_replay(non_fast_package, workdir, *SEARCH, "nproc_per_node=1",
                                       options=PLAN)
    assert code == 0, output[-6000:]
    assert trains(summary) == [1, 1, 1]
    check_search(summary, workdir, world_size=1, first_resumed=[0, 0])
