"""The search space: a JSON object from dotted config keys to a choice list, a range, or a log range::

    {"optim.lr": {"low": 1e-4, "high": 1e-2, "log": true},
     "optim.weight_decay": {"low": 0.0, "high": 0.1},
     "model.width": {"choices": [16, 32, 64]}}

Every key must name a field of the config tree that trials can differ in (not the staged data, nor what
the search's own inputs set: ``FIXED``), every range must be non-empty (low < high) and a log
range positive; each choice and both bounds must make a valid config (the field's own check runs), so a
bad space fails before any trial starts. A range over an integer field with integer bounds draws
integers. Sampling goes through Optuna's ask interface (``trial.suggest_*``), so the study's sampler
decides.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

from traincore.config import Config, ConfigError


class SearchSpaceError(ValueError):
    """The search space is not one this search can sample; the message names the key and the fix."""


SHAPES = '{"choices": [...]}, {"low": a, "high": b} or {"low": a, "high": b, "log": true}'
EXAMPLE = '{"optim.lr": {"low": 1e-4, "high": 1e-2, "log": true}, "model.width": {"choices": [16, 32]}}'


def parse_space(text: str, base: Config) -> dict[str, dict[str, Any]]:
    """The checked search space of the JSON ``text`` over ``base``'s fields: key -> its dimension."""
    try:
        space = json.loads(text) if text.strip() else None
    except json.JSONDecodeError as exc:
        raise SearchSpaceError(f"search_space is not valid JSON ({exc}): write e.g. {EXAMPLE}") from exc
    if not isinstance(space, dict) or not space:
        raise SearchSpaceError(f"search_space must be a non-empty JSON object of config keys, e.g. {EXAMPLE}")
    return {key: _dimension(key, spec, base) for key, spec in space.items()}


# Keys that are one value for the whole search, whatever a trial's config says: a search drawing them would
# train every trial the same and still name a "best" value.
FIXED = {
    "data": "the dataset is staged once, before any trial, for every trial: set it in config_overrides",
    "train.max_steps": "the rungs' budgets end every trial's schedule there: set the input max_steps",
    "train.epochs": "a search trains by steps, to max_steps: set the input max_steps",
    "train.stop_after": "each rung sets where its trials stop: set the inputs rungs and reduction",
    "train.metric": "every trial is ranked by one metric: set the input metric",
    "checkpoint.resume": "each trial resumes from its own previous rung: leave it out",
}


def _field_kind(key: str, base: Config) -> str:
    section, _, name = key.partition(".")
    sections = {f.name: f for f in dataclasses.fields(base)}
    if section not in sections or not name:
        raise SearchSpaceError(f"search_space key {key!r} is not a config key: write section.field, sections "
                               f"are {', '.join(sections)}")
    fields = {f.name: f for f in dataclasses.fields(getattr(base, section))}
    if name not in fields:
        raise SearchSpaceError(f"search_space key {key!r}: the {section} section has no field {name!r}; its "
                               f"fields are {', '.join(fields)}")
    fixed = FIXED.get(key) or FIXED.get(section)
    if fixed:
        raise SearchSpaceError(f"search_space key {key!r} cannot differ between trials: {fixed}")
    kind = fields[name].type
    return kind if isinstance(kind, str) else kind.__name__


def _dimension(key: str, spec: Any, base: Config) -> dict[str, Any]:
    kind = _field_kind(key, base)
    if isinstance(spec, dict) and set(spec) == {"choices"}:
        choices = spec["choices"]
        if not isinstance(choices, list) or not choices:
            raise SearchSpaceError(f"search_space {key}: choices must be a non-empty list, e.g. [16, 32]")
        values = choices
        dimension = {"choices": choices}
    elif isinstance(spec, dict) and {"low", "high"} <= set(spec) <= {"low", "high", "log"}:
        low, high, log = spec["low"], spec["high"], spec.get("log", False)
        numbers = all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
                      for v in (low, high))
        if not numbers or not isinstance(log, bool):
            raise SearchSpaceError(f"search_space {key}: low and high must be numbers and log true or false")
        if not low < high:
            raise SearchSpaceError(f"search_space {key}: the range [{low}, {high}] is empty: low must be "
                                   "below high (for one value, leave the key out and set it in "
                                   "config_overrides)")
        if log and low <= 0:
            raise SearchSpaceError(f"search_space {key}: a log range needs low > 0, got {low}: use a linear "
                                   "range, or a positive lower bound")
        integer = kind == "int" and isinstance(low, int) and isinstance(high, int)
        if kind == "int" and not integer:
            raise SearchSpaceError(f"search_space {key} is an integer field: give integer bounds")
        values = [low, high]
        dimension = {"low": low, "high": high, "log": log, "int": integer}
    else:
        raise SearchSpaceError(f"search_space {key}: expected {SHAPES}, got {json.dumps(spec)}")
    for value in values:  # the field's own check, on every choice and both bounds
        try:
            base.with_overrides({key: value})
        except ConfigError as exc:
            raise SearchSpaceError(f"search_space {key}: the value {value!r} is not valid: {exc}") from exc
    return dimension


def suggest(trial: Any, space: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """One configuration of ``space``, drawn through an Optuna trial's ask interface."""
    params = {}
    for key, dimension in space.items():
        if "choices" in dimension:
            params[key] = trial.suggest_categorical(key, dimension["choices"])
        elif dimension["int"]:
            params[key] = trial.suggest_int(key, dimension["low"], dimension["high"], log=dimension["log"])
        else:
            params[key] = trial.suggest_float(key, dimension["low"], dimension["high"], log=dimension["log"])
    return params


def trial_config(base: Config, params: dict[str, Any], stop_after: int) -> Config:
    """The config of one trial at one rung: ``base`` with the trial's parameters, trained to ``stop_after``
    with the schedule of the whole run (train.max_steps), validated at that step."""
    return base.with_overrides({**params, "train.stop_after": stop_after})


def distributions(space: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Optuna's distribution of each dimension of ``space`` (to rebuild a study from its record)."""
    import optuna

    found = {}
    for key, dimension in space.items():
        if "choices" in dimension:
            found[key] = optuna.distributions.CategoricalDistribution(dimension["choices"])
        elif dimension["int"]:
            found[key] = optuna.distributions.IntDistribution(dimension["low"], dimension["high"],
                                                              log=dimension["log"])
        else:
            found[key] = optuna.distributions.FloatDistribution(dimension["low"], dimension["high"],
                                                                log=dimension["log"])
    return found
