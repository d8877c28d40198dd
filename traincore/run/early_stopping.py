"""The run's best validation so far, and early stopping on it (``train.early_stopping``).

Patience counts validations, as Keras' and Lightning's callbacks do: a run validated every
``train.eval_every`` steps stops after ``patience`` validations in a row that did not improve on the best by
more than ``min_delta``. Improvement is judged as checkpoint selection judges it
(:func:`traincore.checkpoint.improves`), so the best step named here is the step export takes by default.
The state is part of every checkpoint: a resumed run counts on from where it stopped.
"""

from __future__ import annotations

from typing import Any

from traincore.checkpoint import improves


class EarlyStopping:
    """The best ``metric`` seen and where; with ``patience`` (None: never stop), whether to stop."""

    def __init__(self, metric: str, patience: int | None = None, min_delta: float = 0.0):
        self.metric, self.patience, self.min_delta = metric, patience, min_delta
        self.best: float | None = None
        self.best_step: int | None = None
        self.stale = 0  # validations since the best, none of them better by more than min_delta

    def observe(self, step: int, metrics: dict[str, float]) -> bool:
        """Take the validation of ``step``; True when the run should stop here."""
        value = metrics[self.metric]
        if improves(self.metric, value, self.best, self.min_delta):
            self.best, self.best_step, self.stale = value, step, 0
        else:
            self.stale += 1
        return self.patience is not None and self.stale >= self.patience

    def reason(self, step: int) -> str:
        """Why the run stopped at ``step``, in one line."""
        return (f"early stopping at step {step}: {self.metric} has not improved by more than "
                f"{self.min_delta:g} for {self.stale} validations (train.early_stopping patience "
                f"{self.patience}); the best, {self.best:.4f}, was at step {self.best_step}")

    def state_dict(self) -> dict[str, Any]:
        return {"metric": self.metric, "best": self.best, "best_step": self.best_step, "stale": self.stale}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # A checkpoint ranked by another metric says nothing about this one: start counting afresh.
        if state.get("metric") == self.metric:
            self.best, self.best_step, self.stale = state["best"], state["best_step"], state["stale"]
