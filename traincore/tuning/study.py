"""The study's record: its spec, every trial's parameters and every rung's results, in ``study.json`` at
the search's root (a directory or an object-store prefix), written after every change.

A rerun of the same search (the same spec: base config, space, trials, rungs, reduction, metric) finds
the record and its trials as they were drawn; trials that finished a rung resume from their own
checkpoints at its step, so nothing is trained twice. A root that holds another search's record is refused.

The parameters are drawn once, all of them before the first rung (successive halving needs the whole first
rung at once), through Optuna's ask interface with its quasi-Monte Carlo sampler (scrambled Sobol points,
seeded by train.seed): asked in a batch, TPE would draw its first ten trials at random anyway (its
n_startup_trials) and learn nothing before the batch is out, while Sobol points cover the space more evenly
than random ones. Results are told back to an in-memory Optuna study rebuilt from the record
(:meth:`StudyRecord.optuna_study`), whose plots the Deck shows.
"""

from __future__ import annotations

import hashlib
import json
import logging
import warnings
from dataclasses import asdict, dataclass, field
from typing import Any

from traincore.checkpoint import HIGHER_IS_BETTER, Store, as_store
from traincore.tuning.space import suggest

RECORD_FILE = "study.json"

log = logging.getLogger(__name__)


class StudyError(ValueError):
    """The search's root holds a record this search cannot continue; the message says what to do."""


@dataclass
class StudyRecord:
    """A search and its results; ``results[rung][trial]`` is the trial's metric at that rung's budget."""

    spec: dict[str, Any]
    params: list[dict[str, Any]]
    results: list[dict[str, float]] = field(default_factory=list)

    @property
    def key(self) -> str:
        """A short digest of the spec: the same search, the same key."""
        return spec_key(self.spec)

    def tell(self, rung: int, values: dict[int, float]) -> None:
        """Record rung ``rung``'s results (a rerun's replace the earlier ones of that rung)."""
        while len(self.results) <= rung:
            self.results.append({})
        self.results[rung] = {str(trial): value for trial, value in values.items()}

    def rung_values(self, rung: int) -> dict[int, float]:
        return {int(trial): value for trial, value in self.results[rung].items()} if rung < len(
            self.results) else {}

    def save(self, root: str | Store) -> None:
        as_store(root).write_bytes(RECORD_FILE, json.dumps(asdict(self), indent=1, sort_keys=True).encode())

    def optuna_study(self) -> Any:
        """An in-memory Optuna study of the record: every trial with its value at each rung's budget (as
        intermediate values), complete if it reached the last rung, pruned where it stopped."""
        import optuna

        from traincore.tuning.space import distributions

        metric, budgets = self.spec["metric"], self.spec["budgets"]
        direction = "maximize" if HIGHER_IS_BETTER[metric] else "minimize"
        study = optuna.create_study(direction=direction, study_name=f"search-{self.key}")
        dists = distributions(self.spec["space"])
        last = len(budgets) - 1
        for trial, params in enumerate(self.params):
            reached = {rung: self.rung_values(rung)[trial] for rung in range(len(self.results))
                       if trial in self.rung_values(rung)}
            if not reached:
                continue
            final = max(reached)
            state = (optuna.trial.TrialState.COMPLETE if final == last
                     else optuna.trial.TrialState.PRUNED)
            study.add_trial(optuna.trial.create_trial(
                params=params, distributions=dists, state=state,
                value=reached[final] if state == optuna.trial.TrialState.COMPLETE else None,
                intermediate_values={budgets[rung]: value for rung, value in reached.items()},
                user_attrs={"trial": trial, "rung": final}))
        return study


def spec_key(spec: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:12]


def load_or_create(root: str | Store, spec: dict[str, Any], space: dict[str, dict[str, Any]], trials: int,
                   seed: int) -> StudyRecord:
    """The record at ``root`` if it is this search's (its trials as first drawn), else a new one with
    ``trials`` parameter sets drawn through Optuna, written there. StudyError when ``root`` holds another
    search's record."""
    store = as_store(root)
    try:
        found = json.loads(store.read_bytes(RECORD_FILE))
    except FileNotFoundError:
        found = None
    if found is not None:
        record = StudyRecord(**found)
        if record.spec != spec:
            raise StudyError(f"{store.uri_of(RECORD_FILE)} records another search (spec {record.key}, this "
                             f"one {spec_key(spec)}): give this search its own root (checkpoint_uri), or "
                             "remove that one to start over")
        log.info("continuing the search recorded in %s: %d trials, %d rungs done", store.uri_of(RECORD_FILE),
                 len(record.params), len(record.results))
        return record
    import optuna

    with warnings.catch_warnings():  # "experimental" since Optuna 3.0: a note for us, not for a user
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        sampler = optuna.samplers.QMCSampler(seed=seed, warn_independent_sampling=False,
                                             warn_asynchronous_seeding=False)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(sampler=sampler, direction="maximize")
    params = [suggest(study.ask(), space) for _ in range(trials)]
    record = StudyRecord(spec=spec, params=params)
    record.save(store)
    return record
