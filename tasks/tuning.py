"""The tasks of a hyperparameter search (traincore.tuning): plan it, record each rung, pick who goes on,
name the best, and report: ``steps spent: N of M``, the best model's ``test accuracy``, and a Deck.

Every check of the search's inputs runs in :func:`plan_search`, before any trial starts.
"""

from __future__ import annotations

import json
from pathlib import Path

import flytekit
from flytekit import task
from flytekit.core.context_manager import FlyteContextManager
from flytekit.deck import DeckField

from tasks.plan import LaunchInputError, check_protocol
from tasks.search_deck import search_deck_html
from tasks.storage import checkpoint_store, is_uri
from tasks.types import EvalReport, RungResult, Search, SearchFinish, SearchOutcome, TrainResult
from traincore.config import VALIDATION_METRICS, Config
from traincore.tuning import (
    RECORD_FILE,
    SearchSpaceError,
    StudyRecord,
    load_or_create,
    parse_space,
    rung_budgets,
    rung_sizes,
    spec_key,
    steps_spent,
    survivors,
)

LOCAL_SEARCHES = Path("~/.cache/flyte-torch-pipeline/searches")
"""Where a local search without checkpoint_uri keeps its root, by its spec: the same command finds it."""


# Each trial of the first rung is a training run (a node of the search's sub-workflow), and Optuna draws the
# whole first rung up front: a million trials would take the planner minutes just to draw.
MAX_TRIALS = 1000


def check_search_inputs(config: Config, trials: int, parallel: int, rungs: int, reduction: int,
                        metric: str) -> tuple[list[int], list[int]]:
    """The rung budgets and sizes; LaunchInputError naming the input and the fix for anything a search
    cannot run with."""
    if metric not in VALIDATION_METRICS:
        raise LaunchInputError(f"input metric={metric!r} is not one of {', '.join(VALIDATION_METRICS)}")
    if trials < 1:
        raise LaunchInputError(f"input trials={trials}: a search needs at least one trial")
    if trials > MAX_TRIALS:
        raise LaunchInputError(f"input trials={trials}: at most {MAX_TRIALS} trials, each a training run of "
                               "its own in the first rung: narrow the search space, or search in stages")
    if not 1 <= parallel <= trials:
        raise LaunchInputError(f"input parallel={parallel}: at most that many trials train at a time, so it "
                               f"must be between 1 and trials={trials}")
    if config.train.max_steps < 1:
        raise LaunchInputError("a search needs the length of its last rung in steps: give the input "
                               "max_steps (or train.max_steps in config_overrides), e.g. --max_steps 400")
    try:
        budgets = rung_budgets(config.train.max_steps, rungs, reduction)
    except ValueError as exc:
        raise LaunchInputError(f"inputs rungs, reduction and max_steps: {exc}") from exc
    return budgets, rung_sizes(trials, rungs, reduction)


def _search_root(checkpoint_uri: str, key: str) -> str:
    local = FlyteContextManager.current_context().execution_state.is_local_execution()
    if checkpoint_uri:
        if is_uri(checkpoint_uri):
            check_protocol(checkpoint_uri, f"input checkpoint_uri={checkpoint_uri!r}", writable=True)
        return checkpoint_uri.rstrip("/")
    if local:
        return str(LOCAL_SEARCHES.expanduser() / key)
    return f"{flytekit.current_context().raw_output_prefix.rstrip('/')}/searches/{key}"


@task
def plan_search(config: Config, search_space: str, trials: int, parallel: int, rungs: int, reduction: int,
                metric: str, checkpoint_uri: str) -> Search:
    """Check the search's inputs, then find its record (a rerun of the same search) or draw its trials."""
    budgets, sizes = check_search_inputs(config, trials, parallel, rungs, reduction, metric)
    base = config.with_overrides({"train.metric": metric})
    try:
        space = parse_space(search_space, base)
    except SearchSpaceError as exc:
        raise LaunchInputError(f"input {exc}") from exc
    spec = {"config": base.to_dict(), "space": space, "trials": trials, "rungs": rungs,
            "reduction": reduction, "metric": metric, "budgets": budgets}
    root = _search_root(checkpoint_uri, spec_key(spec))
    record = load_or_create(checkpoint_store(root), spec, space, trials, seed=base.train.seed)
    print(f"plan_search: {trials} trials over {', '.join(space)}; rungs to steps {budgets} for "
          f"{' -> '.join(map(str, sizes))} trials ({steps_spent(budgets, sizes)} of "
          f"{trials * budgets[-1]} steps); record and trial roots in {root}", flush=True)
    return Search(root=root, key=record.key, metric=metric, budgets=budgets, sizes=sizes,
                  params=[json.dumps(params) for params in record.params], parallel=parallel,
                  space=json.dumps(space), recorded=record.results)


def _record(search: Search) -> StudyRecord:
    """The study record as the search's root holds it now (read, as it is written, with the credentials
    Flyte's tasks have for the store: a root in the execution's store, or one they may write)."""
    return StudyRecord(**json.loads(checkpoint_store(search.root).read_bytes(RECORD_FILE)))


def _record_rung(search: Search, rung: int, trials: list[int], results: list[TrainResult],
                 keep: int) -> RungResult:
    """Each trial's metric at this rung (its best validation up to the budget), told to the study record,
    with the ``keep`` best as the rung's survivors: from ``results`` (those of the trials that trained, in
    order), or for the rest, as an earlier run of the search recorded it (:meth:`Search.known`)."""
    known, budget = search.known(rung), search.budgets[rung]
    trained = dict(zip([trial for trial in trials if trial not in known], results, strict=True))
    if any(result.summary.best_value is None for result in trained.values()):
        raise ValueError(f"rung {rung}: a trial reports no {search.metric}: every trial validates at its "
                         "rung's last step, so its summary must have one")
    values = {t: known[t] if t in known else trained[t].summary.best_value for t in trials}
    resumed = [budget if t in known else trained[t].summary.resumed_from or 0 for t in trials]
    record = _record(search)
    record.tell(rung, values)
    record.save(checkpoint_store(search.root))
    for trial, start in zip(trials, resumed, strict=True):
        began = (f"recorded by an earlier run at step {budget}" if trial in known
                 else f"resumed from step {start} to step {budget}" if start else f"from step 0 to {budget}")
        print(f"rung {rung + 1}/{len(search.budgets)}: trial {trial} {began}: {search.metric} "
              f"{values[trial]:.4f}  {search.params[trial]}", flush=True)
    return RungResult(rung=rung, budget=budget, trials=trials, values=list(values.values()),
                      resumed_from=resumed, survivors=survivors(values, keep, search.metric))


@task
def rung_record(search: Search, rung: int, trials: list[int], results: list[TrainResult]) -> RungResult:
    """Record a rung before the last (:func:`_record_rung`), its survivors the trials that go on to the
    next one: the best 1/reduction of this one's."""
    result = _record_rung(search, rung, trials, results, keep=search.sizes[rung + 1])
    stopped = sorted(set(result.trials) - set(result.survivors))
    print(f"rung {rung + 1}: trials {', '.join(map(str, result.survivors))} go on to step "
          f"{search.budgets[rung + 1]}; {', '.join(map(str, stopped)) or 'none'} stop", flush=True)
    return result


@task
def finish_search(search: Search, rung: int, trials: list[int], results: list[TrainResult],
                  done: list[RungResult]) -> SearchFinish:
    """Record the last rung (:func:`_record_rung`) and name its best trial: the outcome, the best trial's run
    (exported next) and what the export's lineage records of the search (:func:`search_lineage`)."""
    last = _record_rung(search, rung, trials, results, keep=1)
    outcome = SearchOutcome(best_trial=last.survivors[0], rungs=[*done, last])
    return SearchFinish(outcome=outcome, best=results[last.trials.index(outcome.best_trial)],
                        lineage=search_lineage(search, outcome))


def search_lineage(search: Search, outcome: SearchOutcome) -> str:
    """What the exported model's lineage records of the search that chose it (JSON, as the export task
    takes it): its key and root, the space, the trial, its parameters and its rung."""
    best = outcome.best_trial
    return json.dumps({"key": search.key, "root": search.root, "space": json.loads(search.space),
                       "trial": best, "parameters": json.loads(search.params[best]),
                       "rung": len(outcome.rungs) - 1, "metric": search.metric})


# Input and output only: the default Dependencies field runs `pip freeze` on every execution (seconds).
@task(enable_deck=True, deck_fields=(DeckField.INPUT, DeckField.OUTPUT))
def search_report(search: Search, outcome: SearchOutcome, report: EvalReport) -> str:
    """The search's last words (steps spent, the best model's test accuracy) and its Deck."""
    spent = steps_spent(search.budgets, search.sizes)
    total = search.sizes[0] * search.budgets[-1]
    params = search.params[outcome.best_trial]
    lines = (f"steps spent: {spent} of {total} ({spent / total:.0%} of training every trial to the end)\n"
             f"best trial: {outcome.best_trial} {params}\ntest accuracy: {report.result.accuracy:.3f}")
    print(lines, flush=True)
    flytekit.Deck("Search", search_deck_html(search, outcome, report, _record(search)))
    return lines
