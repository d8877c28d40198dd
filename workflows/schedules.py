"""Scheduled retraining: the training pipeline on a cron schedule, followed by the promotion gate."""

from __future__ import annotations

from flytekit import CronSchedule, LaunchPlan, workflow

from tasks.promote import promotion_gate
from tasks.types import Promotion
from workflows.pipeline import training_pipeline


@workflow
def retrain_and_promote(source: str = "digits", preset: str = "digits", config_overrides: str = "",
                        threshold: float = 0.95, baseline_accuracy: float = 0.0) -> Promotion:
    """Retrain, then promote the new model only if it is good enough and no worse than the baseline.

    Args:
        source: Dataset to retrain on (see training_pipeline).
        preset: Starting configuration (see training_pipeline).
        config_overrides: JSON applied on top of the preset.
        threshold: Minimum test accuracy for promotion.
        baseline_accuracy: Test accuracy of the model in service; the new one must not be worse.

    Returns:
        The gate's verdict, with the model it judged.
    """
    model, report = training_pipeline(source=source, preset=preset, config_overrides=config_overrides)
    return promotion_gate(report=report, model=model, threshold=threshold,
                          baseline_accuracy=baseline_accuracy)


# Every Monday at 03:00 UTC on the bundled digits; the baseline stays a default so operators can raise it
# as the model in service improves, without registering a new launch plan.
scheduled_retraining = LaunchPlan.get_or_create(
    retrain_and_promote,
    name="scheduled_retraining",
    schedule=CronSchedule(schedule="0 3 * * 1"),
    fixed_inputs={"source": "digits", "preset": "digits", "config_overrides": "", "threshold": 0.95},
    default_inputs={"baseline_accuracy": 0.0},
)
