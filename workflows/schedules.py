"""Scheduled retraining: the training pipeline on a cron schedule, then champion against challenger.

    pyflyte run workflows/schedules.py retrain_and_promote --source imagefolder:/data/images \\
        --promoted_uri ~/models/images          # a local cycle: run it again as the images grow
"""

from __future__ import annotations

from flytekit import CronSchedule, LaunchPlan, workflow

from tasks.promote import check_promotion, promotion_gate, warm_start_overrides
from tasks.types import Promotion
from workflows.pipeline import training_pipeline

# Where a local run keeps its registry (the task expands ~); a cluster needs an object-store prefix.
LOCAL_REGISTRY = "~/.local/share/flyte-torch-pipeline/registry"
# The scheduled launch plan's registry: the sandbox's bucket (flyte.config); put your cluster's prefix here.
SCHEDULED_REGISTRY = "s3://my-s3-bucket/flyte-torch-pipeline/registry/digits"


@workflow
def retrain_and_promote(
    source: str = "",
    preset: str = "digits",
    config_overrides: str = "",
    threshold: float = 0.95,
    tolerance: float = 0.01,
    champion: str | None = None,
    promoted_uri: str = LOCAL_REGISTRY,
    warm_start: bool = False,
    epochs: int = 0,
    max_steps: int = 0,
    backend: str = "local",
    nnodes: str = "1",
    nproc_per_node: int = 2,
    gpus_per_node: int = 0,
    accelerator: str = "",
    max_restarts: int = 0,
    parallelism: str = "ddp",
    checkpoint_uri: str = "",
    capacity: str = "on-demand",
    slurm_target: str = "",
    slurm_partition: str = "",
    slurm_account: str = "",
    slurm_time_limit: str = "",
    slurm_sbatch_flags: str = "",
    slurm_setup: str = "",
    store_secret: str = "",
    stage_partitions: int = 0,
    resources: str = "",
) -> Promotion:
    """Retrain, evaluate the new model and the one in service on the same new test split, and publish the
    new one to the registry only if it is good enough and not worse than the one in service.

    The training inputs after ``warm_start`` are training_pipeline's, with the same meaning: a scheduled
    retraining trains on the cluster's GPUs (backend 'kubernetes', gpus_per_node) or a Slurm partition, with
    a durable checkpoint_uri and the store's secret.

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
        warm_start: Start from the model in service (the champion, else the registry's latest) as
            model.init_from, every tensor, the head included, instead of from random weights; the first
            run, with nothing in the registry, trains from scratch.
        epochs: See training_pipeline.
        max_steps: See training_pipeline.
        backend: 'local', 'kubernetes' (a PyTorchJob) or 'slurm' (see training_pipeline).
        nnodes: See training_pipeline.
        nproc_per_node: Training processes (on this machine, or per node).
        gpus_per_node: See training_pipeline.
        accelerator: See training_pipeline.
        max_restarts: See training_pipeline.
        parallelism: See training_pipeline.
        checkpoint_uri: See training_pipeline.
        capacity: See training_pipeline.
        slurm_target: See training_pipeline.
        slurm_partition: See training_pipeline.
        slurm_account: See training_pipeline.
        slurm_time_limit: See training_pipeline.
        slurm_sbatch_flags: See training_pipeline.
        slurm_setup: See training_pipeline.
        store_secret: See training_pipeline.
        stage_partitions: See training_pipeline.
        resources: See training_pipeline.

    Returns:
        The verdict with both models' figures on the new test split and the version published.
    """
    checked = check_promotion(threshold=threshold, tolerance=tolerance, champion=champion,
                              promoted_uri=promoted_uri)
    overrides = warm_start_overrides(config_overrides=config_overrides, warm_start=warm_start,
                                     champion=champion, promoted_uri=promoted_uri)
    checked >> overrides  # bad promotion inputs fail before anything stages or trains
    model, report, dataset = training_pipeline(
        source=source, preset=preset, config_overrides=overrides, epochs=epochs, max_steps=max_steps,
        backend=backend, nnodes=nnodes, nproc_per_node=nproc_per_node, gpus_per_node=gpus_per_node,
        accelerator=accelerator, max_restarts=max_restarts, parallelism=parallelism,
        checkpoint_uri=checkpoint_uri, capacity=capacity, slurm_target=slurm_target,
        slurm_partition=slurm_partition, slurm_account=slurm_account, slurm_time_limit=slurm_time_limit,
        slurm_sbatch_flags=slurm_sbatch_flags, slurm_setup=slurm_setup, store_secret=store_secret,
        stage_partitions=stage_partitions, resources=resources)
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


# The same cycle on the cluster's GPUs, for a team's own images: two 8-GPU nodes of a PyTorchJob, warm-started
# from the model in service. Checkpoints and records go under the execution's own raw-output prefix (a fixed
# checkpoint_uri would make every night resume the night before's finished run), read and written with the
# store's credentials from the Flyte secret `store-credentials`. Inactive until activated
# (docs/retraining.md); point the source and the registry at your own.
scheduled_gpu_retraining = LaunchPlan.get_or_create(
    retrain_and_promote,
    name="scheduled_gpu_retraining",
    schedule=CronSchedule(schedule="0 2 * * *"),
    fixed_inputs={"preset": "imagenet_like", "backend": "kubernetes", "nnodes": "2", "nproc_per_node": 8,
                  "gpus_per_node": 8, "parallelism": "fsdp"},
    default_inputs={"source": "imagefolder:s3://my-s3-bucket/images", "config_overrides": "",
                    "threshold": 0.7, "tolerance": 0.005, "champion": None, "warm_start": True,
                    "promoted_uri": "s3://my-s3-bucket/flyte-torch-pipeline/registry/images",
                    "store_secret": "store-credentials", "accelerator": "", "capacity": "on-demand",
                    "max_steps": 0},
)
