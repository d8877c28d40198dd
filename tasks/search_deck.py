"""The search's Deck: the trials table (parameters, metric at each rung, steps spent, state), each trial's
metric against the steps it reached with the best one drawn over the rest, and Optuna's own plot of the
study (its intermediate values, the rungs)."""

from __future__ import annotations

import html
import json
import warnings

from tasks.decks import table
from tasks.report import figure_html, png_bytes
from tasks.types import EvalReport, Search, SearchOutcome
from traincore.tuning import StudyRecord


def _trial_rows(search: Search, outcome: SearchOutcome) -> list[list[object]]:
    reached: dict[int, dict[int, float]] = {}
    for rung in outcome.rungs:
        for trial, value in zip(rung.trials, rung.values, strict=True):
            reached.setdefault(trial, {})[rung.rung] = value
    last = len(search.budgets) - 1
    rows = []
    for trial, params in enumerate(search.params):
        values = reached.get(trial, {})
        final = max(values, default=-1)
        state = ("best" if trial == outcome.best_trial else "complete" if final == last
                 else f"stopped after rung {final + 1}" if final >= 0 else "not run")
        steps = search.budgets[final] if final >= 0 else 0
        rows.append([trial, params, *(f"{values[r]:.4f}" if r in values else "-" for r in range(last + 1)),
                     steps, state])
    return rows


def _curves_png(search: Search, outcome: SearchOutcome) -> bytes:
    from matplotlib.figure import Figure

    figure = Figure(figsize=(7, 3.6), layout="constrained")
    axis = figure.subplots()
    for trial in range(len(search.params)):
        points = [(search.budgets[r.rung], r.values[r.trials.index(trial)]) for r in outcome.rungs
                  if trial in r.trials]
        if not points:
            continue
        steps, values = zip(*points, strict=True)
        best = trial == outcome.best_trial
        axis.plot(steps, values, marker="o", linewidth=2.5 if best else 1, alpha=1 if best else 0.45,
                  color="tab:red" if best else "tab:gray", label=f"trial {trial} (best)" if best else None,
                  zorder=3 if best else 2)
    axis.set_xlabel("step (rung budget)")
    axis.set_ylabel(search.metric)
    axis.grid(alpha=0.3)
    axis.legend(loc="best")
    return png_bytes(figure)


def _optuna_png(record: StudyRecord) -> bytes | None:
    """Optuna's intermediate-values plot of the study (matplotlib backend); None when it cannot draw it."""
    import optuna
    from optuna.visualization.matplotlib import plot_intermediate_values

    study = record.optuna_study()
    if not study.trials:
        return None
    with warnings.catch_warnings():  # "experimental" since Optuna 2.2: a note for us, not for a user
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        axis = plot_intermediate_values(study)
    figure = axis.get_figure()
    figure.set_size_inches(7, 3.6)
    return png_bytes(figure)


def search_deck_html(search: Search, outcome: SearchOutcome, report: EvalReport, record: StudyRecord) -> str:
    """The whole Deck."""
    header = ["trial", "parameters", *(f"{search.metric} @ {budget}" for budget in search.budgets),
              "steps", "state"]
    best = json.loads(search.params[outcome.best_trial])
    parts = [f"<p>Best: trial {outcome.best_trial} {html.escape(json.dumps(best))}, test accuracy "
             f"{report.result.accuracy:.4f} on {report.result.count} samples. Search {search.key} in "
             f"{html.escape(search.root)}.</p>",
             table("search-trials", "Trials by rung", header, _trial_rows(search, outcome)),
             figure_html(f"{search.metric} at each rung", _curves_png(search, outcome))]
    optuna_png = _optuna_png(record)
    if optuna_png is not None:
        parts.append(figure_html("Optuna: intermediate values", optuna_png))
    return "\n".join(parts)
