"""The best checkpoint: a validated step's commit marker records its metrics (``val_accuracy``,
``val_loss``), and the best is the step whose metric no later one improved on.

Only the markers are read (a few hundred bytes a step, also in an object store), never the state. Pruning
keeps the best step past ``checkpoint.keep_last``, export takes it by default (``--select best``), and early
stopping (traincore.run.selection) judges improvement by the same rule.
"""

from __future__ import annotations

from traincore.checkpoint.commit import read_marker
from traincore.checkpoint.errors import CheckpointError
from traincore.checkpoint.layout import complete_steps, step_store
from traincore.checkpoint.store import Store, as_store
from traincore.config import VALIDATION_METRICS

HIGHER_IS_BETTER = {"val_accuracy": True, "val_loss": False}
assert set(HIGHER_IS_BETTER) == set(VALIDATION_METRICS)
"""The metrics a marker records, and which way each improves."""
SELECTIONS = ("best", "latest")


def improves(metric: str, value: float, best: float | None, min_delta: float = 0.0) -> bool:
    """Whether ``value`` of ``metric`` beats ``best`` (None: nothing yet) by more than ``min_delta``."""
    if best is None:
        return True
    return value > best + min_delta if HIGHER_IS_BETTER[metric] else value < best - min_delta


def step_metrics(root: str | Store) -> dict[int, dict[str, float]]:
    """The recorded metrics of every complete step under ``root`` that has them, by step."""
    root = as_store(root)
    found = {}
    for step in complete_steps(root):
        try:
            metrics = read_marker(step_store(root, step)).get("metrics")
        except CheckpointError:  # a damaged marker: resume and verification name it; it is no candidate
            continue
        if metrics:
            found[step] = metrics
    return found


def best_step(root: str | Store, metric: str = "val_accuracy") -> int | None:
    """The complete step with the best ``metric`` (the earliest of equals: a later step must improve on
    it); None when no step records it."""
    best = value = None
    for step, metrics in sorted(step_metrics(root).items()):
        if metric in metrics and improves(metric, metrics[metric], value):
            best, value = step, metrics[metric]
    return best


def select_step(root: str | Store, select: str, metric: str = "val_accuracy") -> tuple[int, str]:
    """The step ``select`` (``best`` or ``latest``) names under ``root``, and why, in words; ``best`` falls
    back to the latest when no step records ``metric``. CheckpointError when nothing is complete."""
    if select not in SELECTIONS:
        raise CheckpointError(f"select={select!r} is not one of {', '.join(SELECTIONS)}: choose one")
    complete = complete_steps(as_store(root))
    if not complete:
        raise CheckpointError(f"{root} holds no complete checkpoint (no step-* directory with a commit "
                              "marker): pass the checkpoints root of a run that saved at least once")
    best = best_step(root, metric) if select == "best" else None
    if best is None:
        why = ("the latest" if select == "latest"
               else f"the latest: no checkpoint records {metric} (validated steps do, train.eval_every)")
        return complete[-1], why
    value = read_marker(step_store(as_store(root), best))["metrics"][metric]
    return best, f"the best {metric} ({value:.4f}) of the checkpoints that record it"
