"""The training pipeline: plan -> stage_dataset -> train (on the chosen backend) -> export_model -> evaluate.

    pyflyte run workflows/pipeline.py training_pipeline            # digits, 2 local processes
    pyflyte run workflows/pipeline.py training_pipeline --help     # every input, documented
"""

from __future__ import annotations

from typing import NamedTuple

from flytekit import dynamic, workflow

from tasks.evaluate import evaluate_model
from tasks.export import export_model
from tasks.launch import train_task_for
from tasks.plan import plan_run
from tasks.stage import stage_dataset
from tasks.storage import default_checkpoint_root
from tasks.types import EvalReport, ModelArtifact, StagedDataset, Topology, TrainResult
from traincore.config import Config


def train_node(config: Config, dataset: StagedDataset, topology: Topology, checkpoint_root: str,
               capacity: str) -> TrainResult:
    """The train task the topology asks for, as a node of the calling dynamic workflow (train_on_backend,
    or a search's rung, whose trials so need no dynamic node, and no pod, of their own).

    ``capacity='preemptible'`` marks the node interruptible, so Flyte may schedule its pods on spot /
    preemptible nodes: an eviction saves the step reached (checkpoint.preemption_grace_s) and the task's
    retries resume from it. (A string, not a bool input: pyflyte run declares every bool input's flag twice
    and warns on each run; and not ``interruptible``, which pyflyte run has as an option of its own.)
    """
    train = train_task_for(topology, config)(config=config, dataset=dataset, checkpoint_root=checkpoint_root)
    return train.with_overrides(interruptible=True) if capacity == "preemptible" else train


@dynamic
def train_on_backend(config: Config, dataset: StagedDataset, topology: Topology, checkpoint_uri: str,
                     capacity: str) -> TrainResult:
    """Launch the train task the topology asks for (:func:`train_node`); the checkpoint root is fixed here,
    so retries share it."""
    return train_node(config, dataset, topology, checkpoint_uri or default_checkpoint_root(), capacity)


class PipelineOutputs(NamedTuple):
    model: ModelArtifact
    report: EvalReport
    dataset: StagedDataset


@workflow
def training_pipeline(
    source: str = "",
    preset: str = "digits",
    config_overrides: str = "",
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
) -> PipelineOutputs:
    """Train an image classifier with PyTorch (DDP or FSDP): stage the data, train, export and evaluate it.

    Args:
        source: Dataset: 'digits' (bundled with scikit-learn), 'synthetic', 'imagefolder:<path-or-URI>' or
            'python:<module>:<callable>' (a factory of yours returning a map-style dataset of (image, label)
            items). Replaces the preset's own source when given; '' (the default) keeps the preset's
            (digits for 'digits', synthetic for 'debug' and 'vit_tiny', a folder to point at for
            'imagenet_like'). The plan line says which source the run used and where it came from.
        preset: Starting configuration: 'digits', 'debug', 'vit_tiny' (the small ViT) or 'imagenet_like'.
        config_overrides: JSON applied on top of the preset, e.g. '{"loader": {"batch_size": 64}}' or
            '{"model": {"name": "vit_tiny"}}' (models: small_cnn, mlp, resnet18, resnet34, resnet50,
            vit_b_16, vit_tiny).
        epochs: Train for this many epochs (0 keeps the preset's length).
        max_steps: Train for exactly this many optimizer steps instead of epochs (0 = use epochs).
        backend: Where to train: 'local' (this machine), 'kubernetes' (a PyTorchJob) or 'slurm' (a batch job
            submitted over SSH to slurm_target).
        nnodes: Number of nodes (pods or Slurm nodes), "N", or "MIN:MAX" for an elastic range on Kubernetes
            (the run goes on at >= MIN nodes when one is lost, and takes one back; needs max_restarts >= 1;
            docs/reliability.md). More than 1 needs backend 'kubernetes' or 'slurm'.
        nproc_per_node: Training processes per node (one per GPU on GPU nodes).
        gpus_per_node: GPUs requested per node (0 = CPU training).
        accelerator: GPU type to run on, e.g. 'nvidia-tesla-a100' (empty = any); needs gpus_per_node >= 1.
        max_restarts: torch-elastic restarts of the worker group before the attempt fails.
        parallelism: 'ddp' (every process holds the whole model) or 'fsdp' (parameters, gradients and
            optimizer state sharded across the processes: for models that do not fit one device).
        checkpoint_uri: Durable checkpoint root (path or s3://, gs://...); empty = keyed by execution id under
            the raw output prefix. A retry or relaunch with the same root resumes from its latest checkpoint.
        capacity: 'on-demand', or 'preemptible' (backend 'kubernetes'): run the train pods on spot /
            preemptible nodes. An eviction (SIGTERM) saves the step reached within
            checkpoint.preemption_grace_s, and Flyte's retries resume from it with no step lost. On Slurm,
            pick a preemptible partition or QOS instead.
        slurm_target: backend 'slurm': ssh Host alias (~/.ssh/config) or hostname of the login node.
        slurm_partition: backend 'slurm': partition (empty = the cluster's default).
        slurm_account: backend 'slurm': account to charge (empty = your default).
        slurm_time_limit: backend 'slurm': sbatch --time, e.g. '02:00:00' (empty = the partition's).
        slurm_sbatch_flags: backend 'slurm': extra sbatch flags, e.g. '--qos=high --exclusive'.
        slurm_setup: backend 'slurm': shell lines the job runs first, e.g. 'module load cuda; source
            ~/venv/bin/activate' (empty in a local run = activate this run's virtualenv).
        store_secret: Flyte secret (a Kubernetes secret in the execution's namespace) holding the s3://
            store's credentials, keys aws_access_key_id and aws_secret_access_key: mounted into the train
            pods as files for their checkpoints and records (empty = the pods' FLYTE_AWS_* settings).
        stage_partitions: Stage the dataset in this many partitions side by side (a map task on a cluster,
            processes in a local run), each a run of whole shards; the staged bytes are the same whatever
            the count. 0 (the default) = one partition per 4 GiB of staged pixels.
        resources: Requests per node, set at launch, as JSON with sections 'train' (each train node; CPU and
            memory also become Slurm's --cpus-per-task and --mem) and 'stage' (each staging partition pod),
            keys 'cpu', 'mem' and 'ephemeral_storage', e.g. '{"train": {"cpu": "16", "mem": "120Gi",
            "ephemeral_storage": "200Gi"}}'. Empty = 2 CPUs and 6 GiB per process and the stream cache
            plus 2 GiB of node disk (which sizes the cache) per train node; 2 CPUs, 4 GiB and the
            partition's bytes plus a quarter per partition pod.

    Returns:
        model: The exported model (model.safetensors, its config JSON with its sha256, lineage.json).
        report: Test accuracy, loss, per-class precision and recall, the confusion matrix and the lineage.
        dataset: The staged dataset the model was trained and tested on.
    """
    plan = plan_run(source=source, preset=preset, config_overrides=config_overrides, epochs=epochs,
                    max_steps=max_steps, backend=backend, nnodes=nnodes, nproc_per_node=nproc_per_node,
                    gpus_per_node=gpus_per_node, accelerator=accelerator, max_restarts=max_restarts,
                    parallelism=parallelism, checkpoint_uri=checkpoint_uri, slurm_target=slurm_target,
                    slurm_partition=slurm_partition, slurm_account=slurm_account,
                    slurm_time_limit=slurm_time_limit, slurm_sbatch_flags=slurm_sbatch_flags,
                    slurm_setup=slurm_setup, store_secret=store_secret, capacity=capacity,
                    stage_partitions=stage_partitions, resources=resources)
    dataset = stage_dataset(data=plan.data, source_fingerprint=plan.source_fingerprint,
                            partitions=stage_partitions, resources=plan.stage_resources)
    trained = train_on_backend(config=plan.config, dataset=dataset, topology=plan.topology,
                               checkpoint_uri=checkpoint_uri, capacity=capacity)
    model = export_model(trained=trained, dataset=dataset)
    report = evaluate_model(model=model, dataset=dataset, trained=trained)
    return PipelineOutputs(model=model, report=report, dataset=dataset)
