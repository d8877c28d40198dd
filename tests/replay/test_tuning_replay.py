"""The hyperparameter search replayed from its registration, node by node as a Flyte cluster runs it: two
trials, two rungs of successive halving, each trial a training run on the chosen backend.

- On the Kubernetes backend (the fast registration `make register` writes), each trial a PyTorchJob of two
  pods that shard the model between them, the search's root (its record and the trials' checkpoints) and
  every node's data in an S3 bucket (a local server), reached only through the settings a platform injects.
  The module's first execution is aborted once the search is planned and its data staged, as a user
  aborts one on a cluster, and recovered (Flyte's recover: what succeeded is reused) one trial at a time
  until its first rung is recorded. The same launch again, as the docs tell a user to relaunch a search,
  trains no trial of that rung again (that execution is aborted once the rung is recorded anew) and,
  recovered, takes the survivor on from its own checkpoint in the bucket, then, recovered again, to the
  export and evaluation of the best trial.
- On the local backend (the `pyflyte --pkgs workflows package` registration, code in the image), each trial
  a process of the train pod, the search's root under the execution's raw-output prefix: aborted once its
  first rung is recorded, and recovered, which finds that root again through the recovered plan.

Either way the surviving trial goes on from its own rung-0 checkpoint, the best trial's model is exported
with the search in its lineage and evaluated, and the record in the root holds both trials. Each trial is
a train node of its rung's dynamic node: 13 nodes a search in one execution (on Kubernetes 16 pods). Each
test runs one execution of 3-6 pods: what an execution before it left is recovered, not run again.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from types import SimpleNamespace

import pytest
from replay_helpers import recovered_nodes, run_recovery, run_replay  # noqa: I001  (a module beside this file)

from traincore.checkpoint import Store, complete_steps
from traincore.tuning import StudyRecord
from traincore.tuning.study import RECORD_FILE

pytestmark = pytest.mark.slow

SPACE = {"optim.lr": {"low": 5e-3, "high": 5e-2, "log": True}, "model.width": {"choices": [4, 8]}}
MAX_STEPS = 8  # rungs of 4 and 8 steps
OVERRIDES = {"loader": {"batch_size": 16}, "telemetry": {"tensorboard": False}}
SEARCH = (f"search_space={json.dumps(SPACE)}", "trials=2", "parallel=2", "rungs=2", f"max_steps={MAX_STEPS}",
          f"config_overrides={json.dumps(OVERRIDES)}")
PLAN = ("--launch-plan", "workflows.tuning.tune_pipeline")
KUBERNETES = ("backend=kubernetes", "nnodes=2", "nproc_per_node=1", "parallelism=fsdp")
STAGED = "n2"  # plan_run, plan_search, stage_dataset
FIRST_TRIAL = "n3-0-dn0"  # in run_rung's dynamic node: the two trials' train nodes, then rung_record
FIRST_RUNG_RECORD = "n3-0-dn2"
RECORDED_AGAIN = "n3-0-dn0"  # relaunched, the first rung is recorded: no train node, then rung_record
SURVIVOR = "n3-0-dn1-0-dn0"  # then the next rung's dynamic node: the survivor's train node, finish_search


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
    """The pods of each train node the execution ran (not those it recovered)."""
    return [node["pods"] for node in summary["nodes"]
            if node["task"].startswith("tasks.train.train-") and not node["recovered_from"]]


def kubernetes_search(run: SimpleNamespace, workdir: Path, *options: str) -> tuple[int, str, dict]:
    """The search on the Kubernetes backend into the module's root, its store in the bucket."""
    return run_replay(run.package, workdir, *SEARCH, *KUBERNETES, f"checkpoint_uri={run.root}",
                      options=(*PLAN, "--store", f"s3://{run.s3.bucket}/store", *options), env=run.s3.env)


def recorded(run: SimpleNamespace) -> StudyRecord:
    """The search's record as its root in the bucket holds it."""
    return StudyRecord(**json.loads(Store(run.root, run.s3.storage_options).read_bytes(RECORD_FILE)))


def recovered(run: SimpleNamespace, workdir: Path, execution: str, *options: str) -> tuple[int, str, dict]:
    """The recovery of ``execution`` of the module's store in the bucket."""
    return run_recovery(run.package, workdir, execution, run.store, *options, env=run.s3.env)


def assert_recovered(summary: dict, nodes: list[str]) -> None:
    """The execution's first nodes were recovered (no pod), in order: ``nodes``."""
    assert recovered_nodes(summary) == nodes, summary
    assert all(node["pods"] == 0 for node in summary["nodes"][:len(nodes)]), summary


@pytest.fixture(scope="module")
def staged(fast_package, s3_server, tmp_path_factory) -> SimpleNamespace:
    """The Kubernetes search, aborted once it is planned and its data staged: its root, output and
    summary."""
    run = SimpleNamespace(package=fast_package, s3=s3_server, store=f"s3://{s3_server.bucket}/store",
                          root=f"s3://{s3_server.bucket}/search-{uuid.uuid4().hex[:8]}",
                          base=tmp_path_factory.mktemp("search"))
    run.code, run.output, run.summary = kubernetes_search(run, run.base / "staged", "--abort-after", STAGED)
    return run


@pytest.fixture(scope="module")
def first_trial(staged) -> SimpleNamespace:
    """The staged search recovered, and aborted again once its first trial trained."""
    code, output, summary = recovered(staged, staged.base / "trial", staged.summary["execution"],
                                      "--abort-after", FIRST_TRIAL)
    return SimpleNamespace(**{**vars(staged), "code": code, "output": output, "summary": summary})


@pytest.fixture(scope="module")
def first_rung(first_trial) -> SimpleNamespace:
    """That execution recovered in turn, and aborted once its first rung is recorded."""
    code, output, summary = recovered(first_trial, first_trial.base / "first",
                                      first_trial.summary["execution"], "--abort-after", FIRST_RUNG_RECORD)
    return SimpleNamespace(**{**vars(first_trial), "code": code, "output": output, "summary": summary})


def test_a_search_on_kubernetes_aborted_once_staged_has_drawn_its_trials_into_the_bucket(staged):
    assert staged.code == 3, staged.output[-6000:]
    assert [node["task"].rsplit(".", 1)[1] for node in staged.summary["nodes"]] == [
        "plan_run", "plan_search", "stage_dataset"]
    record = recorded(staged)  # the trials as drawn, no result yet
    assert len(record.params) == 2 and record.results == [], record
    assert complete_steps(Store(f"{staged.root}/trial-000", staged.s3.storage_options)) == []


def test_the_search_recovered_trains_its_first_trial_as_a_two_pod_job_into_its_own_root(first_trial):
    assert first_trial.code == 3, first_trial.output[-6000:]
    assert_recovered(first_trial.summary, ["n0", "n1", STAGED])
    assert trains(first_trial.summary) == [2]  # a PyTorchJob of 2 pods
    assert complete_steps(Store(f"{first_trial.root}/trial-000", first_trial.s3.storage_options)) == [4]
    assert complete_steps(Store(f"{first_trial.root}/trial-001", first_trial.s3.storage_options)) == []
    assert recorded(first_trial).results == []  # no rung recorded yet


def test_a_search_of_two_pod_trials_recovered_and_aborted_after_its_first_rung_keeps_it_in_the_bucket(
        first_rung):
    assert first_rung.code == 3, first_rung.output[-6000:]
    assert f"replay: ABORTED: aborted after node {FIRST_RUNG_RECORD}" in first_rung.output
    # The first trial is not trained again: its train node is recovered inside the rung's dynamic node.
    assert_recovered(first_rung.summary, ["n0", "n1", STAGED, "n3", FIRST_TRIAL])
    assert trains(first_rung.summary) == [2]  # the second trial, a PyTorchJob of 2 pods
    rung = first_rung.summary["node_outputs"][FIRST_RUNG_RECORD]["o0"]
    assert (rung["budget"], rung["trials"], rung["resumed_from"], len(rung["survivors"])) == (4, [0, 1],
                                                                                               [0, 0], 1)
    record = recorded(first_rung)
    assert len(record.params) == 2 and [set(values) for values in record.results] == [{"0", "1"}], record
    for trial in (0, 1):  # each trial's checkpoint of step 4, in its own root in the bucket
        root = Store(f"{first_rung.root}/trial-{trial:03d}", first_rung.s3.storage_options)
        assert complete_steps(root) == [4], trial


@pytest.fixture(scope="module")
def launched_again(first_rung) -> SimpleNamespace:
    """The same launch again, a new execution, aborted once its first rung is recorded."""
    workdir = first_rung.base / "again"
    code, output, summary = kubernetes_search(first_rung, workdir, "--abort-after", RECORDED_AGAIN)
    return SimpleNamespace(**{**vars(first_rung), "code": code, "output": output, "summary": summary,
                              "workdir": workdir})


def test_the_same_search_launched_again_trains_no_trial_of_the_rung_it_recorded(launched_again):
    assert launched_again.code == 3, launched_again.output[-6000:]
    assert trains(launched_again.summary) == []  # the first rung's trials are in the record
    rung = launched_again.summary["node_outputs"][RECORDED_AGAIN]["o0"]
    assert (rung["trials"], rung["resumed_from"]) == ([0, 1], [4, 4]), rung  # recorded at step 4
    assert "recorded by an earlier run at step 4" in launched_again.output + "".join(
        path.read_text(errors="replace") for path in launched_again.workdir.rglob("log.txt"))


@pytest.fixture(scope="module")
def survivor(launched_again) -> SimpleNamespace:
    """The relaunched search recovered, and aborted once the survivor trained in the last rung."""
    workdir = launched_again.base / "survivor"
    code, output, summary = recovered(launched_again, workdir, launched_again.summary["execution"],
                                      "--abort-after", SURVIVOR)
    return SimpleNamespace(**{**vars(launched_again), "code": code, "output": output, "summary": summary,
                              "workdir": workdir})


def test_the_relaunched_search_recovered_trains_only_the_survivor_on_from_its_checkpoint(survivor):
    assert survivor.code == 3, survivor.output[-6000:]
    assert_recovered(survivor.summary, ["n0", "n1", "n2", "n3", RECORDED_AGAIN])
    assert trains(survivor.summary) == [2]  # the survivor, a PyTorchJob of 2 pods
    train = survivor.summary["node_outputs"][SURVIVOR]["o0"]["summary"]
    assert (train["resumed_from"], train["steps"], train["world_size"]) == (4, MAX_STEPS, 2), train


def test_the_relaunched_search_recovered_to_its_end_exports_and_records_the_best(survivor, tmp_path):
    code, output, summary = recovered(survivor, tmp_path / "end", survivor.summary["execution"])
    assert code == 0, output[-6000:]
    assert trains(summary) == []  # the survivor's train node is recovered too
    search = check_search(summary, survivor.workdir, world_size=2, first_resumed=[4, 4])
    record = recorded(survivor)
    assert [set(values) for values in record.results] == [{"0", "1"}, {str(search["best_trial"])}], record


@pytest.fixture(scope="module")
def local_first_rung(non_fast_package, tmp_path_factory) -> SimpleNamespace:
    """The search on the local backend, aborted once its first rung is recorded; its store the replay's
    default, a directory in its workdir."""
    workdir = tmp_path_factory.mktemp("local-search") / "first"
    code, output, summary = run_replay(non_fast_package, workdir, *SEARCH, "nproc_per_node=1",
                                       options=(*PLAN, "--abort-after", FIRST_RUNG_RECORD))
    return SimpleNamespace(package=non_fast_package, workdir=workdir, code=code, output=output,
                           summary=summary)


def test_a_search_on_the_local_backend_from_the_package_aborted_after_its_first_rung(local_first_rung):
    assert local_first_rung.code == 3, local_first_rung.output[-6000:]
    assert trains(local_first_rung.summary) == [1, 1]  # each trial a process of its own train pod
    rung = local_first_rung.summary["node_outputs"][FIRST_RUNG_RECORD]["o0"]
    assert (rung["trials"], rung["resumed_from"], len(rung["survivors"])) == ([0, 1], [0, 0], 1), rung


def test_the_local_search_recovered_finds_its_root_and_resumes_the_survivor(local_first_rung, tmp_path):
    """The search's root (no checkpoint_uri: under the first execution's raw-output prefix) is an output of
    plan_search, which is recovered: the survivor resumes from its rung-0 checkpoint there."""
    workdir, first = tmp_path / "recovered", local_first_rung
    code, output, summary = run_recovery(first.package, workdir, first.summary["execution"],
                                         first.workdir / "store")
    assert code == 0, output[-6000:]
    assert_recovered(summary, ["n0", "n1", "n2", "n3", "n3-0-dn0", "n3-0-dn1", FIRST_RUNG_RECORD])
    assert trains(summary) == [1]
    check_search(summary, workdir, world_size=1, first_resumed=[0, 0])
