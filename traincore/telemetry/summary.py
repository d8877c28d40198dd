"""What a finished run reports: the TrainSummary record and the line a user reads. No torch here: lineage and
the Flyte types describe a result without importing the training loop."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TrainSummary:
    """What a finished run reports; throughput and data-wait figures cover every attempt of the run."""

    steps: int
    samples_per_s: float
    data_wait_share: float
    final_loss: float
    val_accuracy: float | None
    resumed_from: int | None
    checkpoint_dir: str
    output_dir: str
    wall_s: float
    world_size: int = 1
    startup_s: dict[str, float] = field(default_factory=dict)
    """This attempt's start-up phases in seconds (imports, preflight, ..., first step), in order."""
    records: str = ""
    """Where this attempt's records (metrics.jsonl, TensorBoard events) are kept in the durable root; empty
    when they stay in the output directory only."""
    metric: str = "val_accuracy"
    """The validation metric that ranks the run's checkpoints (train.metric)."""
    best_step: int | None = None
    """The step of the best validation by ``metric``: the checkpoint export takes by default."""
    best_value: float | None = None
    """That validation's ``metric``."""
    stopped_early: bool = False
    """Whether early stopping (train.early_stopping) ended the run before its last step."""
    membership_changes: int = 0
    """World-size changes over the run: nodes of an elastic range lost or returned (docs/reliability.md)."""
    steps_redone: int = 0
    """Steps trained again after those changes (each resumed from its last committed checkpoint)."""
    seconds_lost: float = 0.0
    """Seconds from the last step before each change to the first after it, added up."""


def format_summary(summary: TrainSummary) -> str:
    """The one line a user reads at the end of training."""
    val = f"{summary.val_accuracy:.3f}" if summary.val_accuracy is not None else "n/a"
    if summary.resumed_from == summary.steps:
        return (f"nothing to train: step {summary.steps} was already reached (checkpoints in "
                f"{summary.checkpoint_dir}); val accuracy {val}. Raise --max-steps/--epochs to train on")
    resumed = f", resumed from step {summary.resumed_from}" if summary.resumed_from else ""
    stopped = " (stopped early)" if summary.stopped_early else ""
    best = (f" (best {summary.metric} {summary.best_value:.4f} at step {summary.best_step})"
            if summary.best_step is not None and summary.best_step != summary.steps else "")
    if summary.membership_changes:
        stopped += (f" across {summary.membership_changes} membership change(s) ({summary.steps_redone} "
                    f"step(s) trained again, {summary.seconds_lost:.1f} s lost)")
    return (f"trained {summary.steps} steps{stopped} in {summary.wall_s:.1f} s{resumed}: "
            f"{summary.samples_per_s:,.0f} samples/s, data-wait {100 * summary.data_wait_share:.1f}%, "
            f"final loss {summary.final_loss:.4f}, val accuracy {val}{best}; "
            f"checkpoints in {summary.checkpoint_dir}" + (f"; records in {summary.records}" if summary.records
                                                          else ""))
