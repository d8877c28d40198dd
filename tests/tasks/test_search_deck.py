"""The search's Deck from a hand-made search of 4 trials over 3 rungs: its trials table read back from the
HTML, the best trial named and drawn over the rest, and Optuna's plot of the study."""

from __future__ import annotations

import base64
import html
import json

import numpy as np
from test_report import Tables, decode  # a module beside this one

from tasks.search_deck import search_deck_html
from tasks.types import EvalReport, RungResult, Search, SearchOutcome
from traincore.artifacts import EvalResult, Lineage
from traincore.config import preset
from traincore.tuning import StudyRecord, parse_space

SPACE = '{"optim.lr": {"low": 1e-4, "high": 1e-2, "log": true}, "model.width": {"choices": [8, 16]}}'
PARAMS = [{"optim.lr": 0.0002, "model.width": 8}, {"optim.lr": 0.0091, "model.width": 16},
          {"optim.lr": 0.0035, "model.width": 8}, {"optim.lr": 0.0012, "model.width": 16}]
BUDGETS = [10, 30, 90]
# Trial 0 stops after the first rung, trial 1 after the second, 2 and 3 reach the last, where 3 is best.
RUNGS = [{0: 0.41, 1: 0.55, 2: 0.62, 3: 0.60}, {2: 0.71, 3: 0.74, 1: 0.58}, {2: 0.80, 3: 0.86}]
RED = np.array([0xD6, 0x27, 0x28]) / 255  # matplotlib's tab:red, the best trial's curve


def deck() -> str:
    space = parse_space(SPACE, preset("debug"))
    record = StudyRecord(spec={"metric": "val_accuracy", "budgets": BUDGETS, "space": space}, params=PARAMS)
    for rung, values in enumerate(RUNGS):
        record.tell(rung, values)
    search = Search(root="/searches/s1", key=record.key, metric="val_accuracy", budgets=BUDGETS,
                    sizes=[4, 3, 2], params=[json.dumps(p) for p in PARAMS], parallel=2, space=SPACE,
                    recorded=[])
    rungs = [RungResult(rung=rung, budget=BUDGETS[rung], trials=list(values), values=list(values.values()),
                        resumed_from=[BUDGETS[rung - 1] if rung else 0] * len(values),
                        survivors=list(RUNGS[rung + 1]) if rung + 1 < len(RUNGS) else [3])
             for rung, values in enumerate(RUNGS)]
    result = EvalResult(split="test", accuracy=0.85, loss=0.4, count=180, classes=["a", "b"],
                        precision=[0.85, 0.85], recall=[0.85, 0.85], confusion=[[77, 13], [14, 76]])
    return search_deck_html(search, SearchOutcome(best_trial=3, rungs=rungs),
                            EvalReport(result=result, lineage=Lineage()), record)


def test_the_search_deck_tables_every_trial_and_draws_the_best_over_the_rest():
    page = deck()
    tables = Tables(page)
    assert tables.texts("search-trials") == [
        ["0", json.dumps(PARAMS[0]), "0.4100", "-", "-", "10", "stopped after rung 1"],
        ["1", json.dumps(PARAMS[1]), "0.5500", "0.5800", "-", "30", "stopped after rung 2"],
        ["2", json.dumps(PARAMS[2]), "0.6200", "0.7100", "0.8000", "90", "complete"],
        ["3", json.dumps(PARAMS[3]), "0.6000", "0.7400", "0.8600", "90", "best"]]
    assert "<th>val_accuracy @ 10</th><th>val_accuracy @ 30</th><th>val_accuracy @ 90</th>" in page
    best = f"Best: trial 3 {json.dumps(PARAMS[3])}, test accuracy 0.8500 on 180 samples"
    assert best in html.unescape(page)
    assert 'alt="val_accuracy at each rung"' in page and 'alt="Optuna: intermediate values"' in page
    curves, optuna = (decode(base64.b64decode(src.split(",", 1)[1])) for src in tables.images)
    assert optuna.shape[:2] == (360, 700)  # drawn, at the 7 x 3.6 inches the Deck sets
    assert np.isclose(curves[..., :3], RED, atol=0.02).all(axis=-1).sum() > 200  # the best curve, in red
