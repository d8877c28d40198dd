"""The study's record: drawn once, found again by the same search, refused to another."""

from __future__ import annotations

import pytest

from traincore.config import preset
from traincore.tuning import load_or_create, parse_space
from traincore.tuning.study import StudyError

SPACE = parse_space('{"optim.lr": {"low": 1e-4, "high": 1e-2, "log": true}, '
                    '"model.width": {"choices": [8, 16]}}', preset("debug"))
SPEC = {"space": SPACE, "trials": 4, "rungs": 2, "metric": "val_accuracy", "budgets": [5, 10]}


def test_the_same_search_finds_its_trials_and_results_and_another_is_refused(tmp_path):
    first = load_or_create(tmp_path, SPEC, SPACE, trials=4, seed=0)
    assert len(first.params) == 4 and len({str(p) for p in first.params}) == 4
    first.tell(0, {0: 0.5, 1: 0.75, 2: 0.25, 3: 1.0})
    first.save(tmp_path)
    again = load_or_create(tmp_path, SPEC, SPACE, trials=4, seed=0)
    assert again.params == first.params and again.rung_values(0) == {0: 0.5, 1: 0.75, 2: 0.25, 3: 1.0}
    # The same seed draws the same trials in a fresh root: a search is reproducible.
    assert load_or_create(tmp_path / "elsewhere", SPEC, SPACE, trials=4, seed=0).params == first.params
    study = again.optuna_study()  # Optuna's view: the rung's values as intermediate values, pruned so far
    assert [t.intermediate_values for t in study.trials] == [{5: 0.5}, {5: 0.75}, {5: 0.25}, {5: 1.0}]
    with pytest.raises(StudyError, match="records another search .*: give this search its own root"):
        load_or_create(tmp_path, {**SPEC, "trials": 5}, SPACE, trials=5, seed=0)
