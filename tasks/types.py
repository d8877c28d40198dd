"""Typed values that cross task boundaries: plain dataclasses of primitives, FlyteFile and FlyteDirectory.

No live object (model, loader, process group) ever leaves a task; these records are what the Flyte UI
shows and what a later task or a promotion gate reads.
"""

from __future__ import annotations

from dataclasses import dataclass

from flytekit.types.directory import FlyteDirectory


@dataclass
class Topology:
    """Where and how wide training runs: chosen at launch time, never by editing code."""

    backend: str = "local"  # local | kubernetes (slurm is planned)
    nnodes: int = 1
    nproc_per_node: int = 2
    gpus_per_node: int = 0
    accelerator: str = ""  # e.g. nvidia-tesla-a100; empty = any GPU the cluster has
    max_restarts: int = 0  # torch-elastic restarts of the worker group inside one Flyte attempt
    rdzv_timeout_s: int = 900  # generous: pods may wait for a node scale-up or an image pull


@dataclass
class StagedDataset:
    """A staged dataset directory (manifest.json + uint8 shards) and what its manifest says."""

    directory: FlyteDirectory
    source: str
    classes: list[str]
    shape: list[int]  # C, H, W
    counts: dict[str, int]  # samples per split
    format_version: int


@dataclass
class TrainResult:
    """Rank 0's account of a training run: the checkpoint root, the logs and the final metrics."""

    checkpoints: FlyteDirectory  # step-000123/ directories; the latest complete one is the model
    logs: FlyteDirectory  # metrics.jsonl and tensorboard/
    steps: int
    samples_per_s: float
    data_wait_share: float
    final_loss: float
    val_accuracy: float | None
    resumed_from: int | None
    world_size: int
    wall_s: float


@dataclass
class ModelArtifact:
    """An exported model: one directory holding the safetensors weights and the model config JSON."""

    directory: FlyteDirectory
    weights_file: str  # file names inside ``directory``
    config_file: str
    sha256: str  # of the weights file
    num_bytes: int
    step: int
    num_parameters: int


@dataclass
class EvalReport:
    """Test-split metrics of one exported model."""

    split: str
    accuracy: float
    loss: float
    count: int
    classes: list[str]
    precision: list[float]  # per class, in ``classes`` order
    recall: list[float]
    confusion: list[list[int]]  # rows: true class, columns: predicted class
    model_sha256: str = ""


@dataclass
class Promotion:
    """The promotion gate's verdict on a freshly trained model."""

    promoted: bool
    reason: str
    accuracy: float
    threshold: float
    baseline_accuracy: float
    model: ModelArtifact
