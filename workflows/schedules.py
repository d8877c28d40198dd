"""Scheduled retraining: the training pipeline on a cron schedule, then champion against challenger.

    pyflyte run workflows/schedules.py retrain_and_promote --source imagefolder:/data/images \\
        --promoted_uri ~/models/images          # a local cycle: run it again as the images grow
"""

from __future__ import annotations

from flytekit import CronSchedule, LaunchPlan, workflow

from tasks.promote import check_promotion, promotion_gate
from tasks.types import Promotion
from workflows.pipeline import training_pipeline

# Where a local run keeps its registry (the task expands ~); a cluster needs an object-store prefix.
LOCAL_REGISTRY = "~/.local/share/flyte-torch-pipeline/registry"
# The scheduled launch plan's registry: the sandbox's bucket (flyte.config); put your cluster's prefix here.
SCHEDULED_REGISTRY = "s3://my-s3-bucket/flyte-torch-pipeline/registry/digits"


@workflow
def retrain_and_promote(source: str = "", preset: str = "digits", config_overrides: str = "",
                        threshold: float = 0.95, tolerance: float = 0.01,
                        champion: str | None = None,
                        promoted_uri: str = LOCAL_REGISTRY, nproc_per_node: int = 2) -> Promotion:
    """Retrain, evaluate the new model and the one in service on the same new test split, and publish the
    new one to the registry only if it is good enough and not worse than the one in service.

    Args:
        source: Dataset to retrain on (see training_pipeline; '' keeps the preset's); the staging cache
            notices when it grows.
        preset: Starting configuration (see training_pipeline).
        config_overrides: JSON applied on top of the preset.
        threshold: Minimum test accuracy of the new model, in [0, 1].
        tolerance: How far below the champion's test accuracy the new model may be, in [0, 1].
        champion: The model in service: an export directory or registry version (path or URI); empty =
            the registry's latest version (none on the first run).
        promoted_uri: The registry: a directory or object-store prefix; a promotion adds a version there
            and points its `latest` at it.
        nproc_per_node: Training processes (on this machine, or per node).

    Returns:
        The verdict with both models' figures on the new test split and the version published.
    """
    checked = check_promotion(threshold=threshold, tolerance=tolerance, champion=champion,
                              promoted_uri=promoted_uri)
    model, report, dataset = training_pipeline(
        source=source, preset=preset, config_overrides=config_overrides, nproc_per_node=nproc_per_node)
    checked >> model  # bad promotion inputs fail before anything stages or trains
    return promotion_gate(model=model, report=report, dataset=dataset, champion=champion,
                          promoted_uri=promoted_uri, threshold=threshold, tolerance=tolerance)


# Every Monday at 03:00 UTC, by default on the bundled digits (the preset's source). The champion is the
# registry's latest, so nobody types a figure; the source, the tolerance and the registry stay defaults an
# operator can change at launch without a new launch plan.
scheduled_retraining = LaunchPlan.get_or_create(
    retrain_and_promote,
    name="scheduled_retraining",
    schedule=CronSchedule(schedule="0 3 * * 1"),
    fixed_inputs={"preset": "digits", "config_overrides": "", "threshold": 0.95},
    default_inputs={"source": "", "tolerance": 0.01, "champion": None, "promoted_uri": SCHEDULED_REGISTRY,
                    "nproc_per_node": 2},
)
