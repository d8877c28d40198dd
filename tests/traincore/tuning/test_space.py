"""The search space: parsed against the config tree, sampled through Optuna's ask interface."""

from __future__ import annotations

import json

import optuna
import pytest

from traincore.config import preset
from traincore.tuning import SearchSpaceError, parse_space, trial_config
from traincore.tuning.space import suggest

BASE = preset("debug")


def test_choices_ranges_and_log_ranges_are_drawn_within_their_bounds_by_optuna():
    space = parse_space(json.dumps({"optim.lr": {"low": 1e-4, "high": 1e-2, "log": True},
                                    "model.width": {"low": 8, "high": 32},
                                    "optim.weight_decay": {"low": 0.0, "high": 0.1},
                                    "optim.schedule": {"choices": ["cosine", "onecycle"]}}), BASE)
    assert space["model.width"] == {"low": 8, "high": 32, "log": False, "int": True}
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    for _ in range(20):
        params = suggest(study.ask(), space)
        assert 1e-4 <= params["optim.lr"] <= 1e-2 and isinstance(params["model.width"], int)
        assert params["optim.schedule"] in ("cosine", "onecycle") and 0 <= params["optim.weight_decay"] <= 0.1
        config = trial_config(BASE, params, stop_after=5)
        assert config.optim.lr == params["optim.lr"] and config.train.stop_after == 5


@pytest.mark.parametrize(("space", "message"), [
    ("", "search_space must be a non-empty JSON object of config keys"),
    ("{oops", "search_space is not valid JSON"),
    ('{"lr": {"low": 0.1, "high": 1}}', "search_space key 'lr' is not a config key: write section.field"),
    ('{"nosuch.lr": {"low": 0.1, "high": 1}}', "search_space key 'nosuch.lr' is not a config key"),
    ('{"model.width": {"low": 8.5, "high": 32}}', "model.width is an integer field: give integer bounds"),
    ('{"optim.lr": {"low": 1, "high": "2"}}', "low and high must be numbers and log true or false"),
    ('{"optim.lr": [0.1, 0.2]}', 'expected {"choices": [...]}, {"low": a, "high": b} or'),
    ('{"model.width": {"choices": [8, 0]}}', "the value 0 is not valid: model.width=0 is invalid"),
    # One value for every trial: drawing it would rank trials that trained the same.
    ('{"data.image_size": {"choices": [16, 32]}}', "'data.image_size' cannot differ between trials: the "
                                                   "dataset is staged once"),
    ('{"train.max_steps": {"choices": [10, 20]}}', "'train.max_steps' cannot differ between trials: the "
                                                   "rungs' budgets"),
    ('{"checkpoint.resume": {"choices": ["latest", "none"]}}',
     "each trial resumes from its own previous rung"),
])
def test_a_bad_space_names_the_key_and_the_fix(space, message):
    with pytest.raises(SearchSpaceError) as caught:
        parse_space(space, BASE)
    assert message in str(caught.value), caught.value
