"""The hyperparameter search end to end, locally: 8 trials over two parameters, 3 rungs of successive
halving on digits; a search that dies after its second rung, run again, trains none of its finished trials
again."""

from __future__ import annotations

import json

import pytest

import tasks.stage
import tasks.train as train_module
import tasks.tuning
from traincore.checkpoint import Store
from traincore.tuning import StudyRecord, survivors
from traincore.tuning.study import RECORD_FILE
from workflows.tuning import tune_pipeline

SPACE = {"optim.lr": {"low": 1e-3, "high": 2e-2, "log": True}, "model.width": {"choices": [8, 16]}}
SEARCH = dict(search_space=json.dumps(SPACE), trials=8, parallel=3, rungs=3, preset="digits", max_steps=16,
              nproc_per_node=1, config_overrides=json.dumps({"telemetry": {"tensorboard": False}}))


def counting(trainer: type, runs: list[int]) -> type:
    """The Trainer, counting the runs the train tasks make (each one's train.stop_after)."""

    class Counted(trainer):
        def __init__(self, cfg, *args, **kwargs):
            runs.append(cfg.train.stop_after)
            super().__init__(cfg, *args, **kwargs)

    return Counted


def test_a_search_spends_half_the_steps_resumes_its_promoted_trials_and_exports_the_best(tmp_path,
                                                                                         monkeypatch):
    root = tmp_path / "search"
    calls = []

    def dies_after_the_second_rung(values, keep, metric):
        calls.append(keep)
        if len(calls) == 2:
            raise RuntimeError("the search's pod was lost")
        return survivors(values, keep, metric)

    monkeypatch.setattr(tasks.tuning, "survivors", dies_after_the_second_rung)
    with pytest.raises(Exception, match="the search's pod was lost"):
        tune_pipeline(**SEARCH, checkpoint_uri=str(root))

    # The same command again: the record's trials as first drawn and the results it holds of the first two
    # rungs, so no trial of theirs trains again (not one train node runs for them); the last trains from
    # the step its trials reached.
    trains = []
    monkeypatch.setattr(tasks.tuning, "survivors", survivors)
    monkeypatch.setattr(train_module, "Trainer", counting(train_module.Trainer, trains))
    out = tune_pipeline(**SEARCH, checkpoint_uri=str(root))
    rungs = out.search.rungs
    assert [(r.budget, len(r.trials)) for r in rungs] == [(4, 8), (8, 4), (16, 2)]
    assert rungs[0].resumed_from == [4] * 8 and rungs[1].resumed_from == [8] * 4
    assert trains == [16, 16]  # the two trials of the last rung, and nothing else
    assert rungs[2].resumed_from == [8] * 2  # promoted: continued from its own checkpoint, not step 0
    for rung, following in zip(rungs, rungs[1:], strict=False):  # the best half went on
        values = dict(zip(rung.trials, rung.values, strict=True))
        assert following.trials == rung.survivors == survivors(values, len(following.trials), "val_accuracy")
    last = dict(zip(rungs[2].trials, rungs[2].values, strict=True))
    assert out.search.best_trial == max(last, key=lambda trial: (last[trial], -trial))
    assert rungs[2].survivors == [out.search.best_trial]
    # 8 x 4 + 4 x 4 + 2 x 8 steps: half of 8 trials x 16
    assert out.summary.startswith("steps spent: 64 of 128 (50% of training every trial to the end)")
    assert out.summary.endswith(f"test accuracy: {out.report.result.accuracy:.3f}")
    record = StudyRecord(**json.loads(Store(str(root)).read_bytes(RECORD_FILE)))
    params = record.params[out.search.best_trial]
    assert set(params) == set(SPACE) and params["model.width"] in (8, 16)
    assert len({json.dumps(p, sort_keys=True) for p in record.params}) == 8  # eight configurations
    lineage = out.model.export.lineage.search
    assert (lineage["trial"], lineage["parameters"], lineage["rung"]) == (out.search.best_trial, params, 2)
    assert lineage["space"]["optim.lr"] == {"low": 1e-3, "high": 2e-2, "log": True, "int": False}
    trained = out.best.summary
    assert out.model.export.step == trained.best_step and trained.metric == "val_accuracy"


@pytest.mark.parametrize(("change", "message"), [
    ({"search_space": '{"optim.learning_rate": {"low": 0.1, "high": 1}}'},
     "search_space key 'optim.learning_rate': the optim section has no field 'learning_rate'"),
    ({"search_space": '{"optim.lr": {"low": 0.01, "high": 0.01}}'}, "the range [0.01, 0.01] is empty"),
    ({"search_space": '{"optim.lr": {"low": 0, "high": 0.1, "log": true}}'}, "a log range needs low > 0"),
    ({"search_space": '{"model.width": {"choices": []}}'}, "choices must be a non-empty list"),
    ({"search_space": '{"optim.lr": {"choices": [0.1, 20]}}'}, "the value 20 is not valid: optim.lr=20"),
    ({"search_space": '{"data.image_size": {"choices": [16, 32]}}'},
     "search_space key 'data.image_size' cannot differ between trials"),
    ({"trials": 1_000_000, "parallel": 1}, "input trials=1000000: at most 1000 trials"),
    ({"parallel": 9}, "input parallel=9: at most that many trials train at a time, so it must be between 1 "
                      "and trials=8"),
    ({"rungs": 6}, "give the first rung max_steps / 32 = 0.5 steps: lower rungs, or raise max_steps to at "
                   "least 32"),
    ({"max_steps": 0}, "a search needs the length of its last rung in steps: give the input max_steps"),
    ({"metric": "accuracy"}, "input metric='accuracy' is not one of val_accuracy, val_loss"),
    ({"config_overrides": '{"optim": {"param_groups": [{"pattern": "backbone.*", "freeze": true}]}}'},
     "optim.param_groups[0] pattern 'backbone.*' matches no parameter of the model"),
])
def test_bad_search_inputs_fail_before_anything_stages_or_trains(tmp_path, monkeypatch, change, message):
    def staging_started(*args, **kwargs):
        raise AssertionError("the dataset was staged")

    monkeypatch.setattr(tasks.stage, "stage", staging_started)
    with pytest.raises(Exception) as caught:
        tune_pipeline(**{**SEARCH, **change}, checkpoint_uri=str(tmp_path / "search"))
    assert message in str(caught.value), caught.value
    assert not any((tmp_path / "search").rglob("*"))  # no record, no trial (plan_run proved it writable)


def test_a_search_takes_every_input_of_the_pipeline_with_the_same_name_type_and_default():
    """A trial trains as training_pipeline's train node does: the same inputs, so that a command that trains
    one run becomes a search by adding the search's inputs."""
    from workflows.pipeline import training_pipeline

    pipeline, search = training_pipeline.python_interface, tune_pipeline.python_interface
    assert {name: search.inputs[name] for name in pipeline.inputs} == pipeline.inputs
    assert {name: search.default_inputs_as_kwargs.get(name) for name in pipeline.inputs} == {
        name: pipeline.default_inputs_as_kwargs.get(name) for name in pipeline.inputs}
    assert set(search.inputs) - set(pipeline.inputs) == {"search_space", "trials", "parallel", "rungs",
                                                          "metric", "reduction"}
