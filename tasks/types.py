"""Typed values that cross task boundaries: plain dataclasses of primitives, FlyteFile and FlyteDirectory.

No live object (model, loader, process group) ever leaves a task. Where traincore already has a record for
a concept (TrainSummary, ExportResult, EvalResult), the Flyte value holds it as one field next to the Flyte
directories, so each concept has one record and one conversion.

The values a workflow returns (StagedDataset, ModelArtifact, EvalReport) print as a few lines each, which
is what ``pyflyte run`` shows at the end of a local run; their fields and Flyte types are the dataclasses'
own, and only the printed text differs from the generated repr (which would print the whole config twice).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from flyteidl.core import types_pb2
from flytekit.core.type_engine import DataclassTransformer, TypeEngine
from flytekit.models.types import LiteralType
from flytekit.types.directory import FlyteDirectory

from traincore.artifacts import LINEAGE_FILE, EvalResult, ExportResult, Lineage
from traincore.config import Config, DataConfig
from traincore.data import Manifest
from traincore.telemetry import TrainSummary


@dataclass
class SlurmSettings:
    """Where and how a Slurm job runs; only the ``slurm`` backend reads it."""

    target: str = ""  # ssh Host alias (or host name) of the cluster's login node
    partition: str = ""  # empty = the cluster's default partition
    account: str = ""  # empty = the user's default account
    time_limit: str = ""  # sbatch --time, e.g. "02:00:00"; empty = the partition's default
    sbatch_flags: str = ""  # extra sbatch flags, shell syntax, e.g. "--qos=high --exclusive"
    setup: str = ""  # shell lines the job runs first, e.g. "module load cuda; source ~/venv/bin/activate"


@dataclass
class NodeResources:
    """One task's requests per node, as Kubernetes quantities; "" = the task's default (tasks.resources)."""

    cpu: str = ""  # e.g. "8" or "500m"
    mem: str = ""  # e.g. "32Gi"
    ephemeral_storage: str = ""  # node-local disk, e.g. "200Gi": the stream cache, a partition's shards


@dataclass
class Topology:
    """Where and how wide training runs: chosen at launch time, never by editing code."""

    backend: str = "local"  # one of tasks.backends.BACKENDS
    nnodes: int = 1  # nodes; with min_nnodes, the most an elastic run may have
    min_nnodes: int = 0  # the fewest an elastic run goes on with (the range min_nnodes:nnodes); 0 = nnodes
    nproc_per_node: int = 2
    gpus_per_node: int = 0
    accelerator: str = ""  # e.g. nvidia-tesla-a100; empty = any GPU the cluster has
    max_restarts: int = 0  # torch-elastic restarts of the worker group inside one Flyte attempt
    rdzv_timeout_s: int = 900  # generous: pods may wait for a node scale-up or an image pull
    slurm: SlurmSettings = field(default_factory=SlurmSettings)
    store_secret: str = ""  # Flyte secret group with the object store's credentials, mounted as files
    resources: NodeResources = field(default_factory=NodeResources)  # each train node's, set at launch

    @property
    def elastic(self) -> bool:
        """Whether the node count is a range (torch elastic re-forms the run as nodes come and go)."""
        return 0 < self.min_nnodes < self.nnodes

    @property
    def nodes(self) -> str:
        """The node count as the nnodes input gives it: "N", or "MIN:MAX" for a range."""
        return f"{self.min_nnodes}:{self.nnodes}" if self.elastic else str(self.nnodes)

    @classmethod
    def from_dict(cls, data: dict) -> Topology:
        """The inverse of ``dataclasses.asdict`` (task keys carry topologies as JSON)."""
        return cls(**{**data, "slurm": SlurmSettings(**data.get("slurm", {})),
                      "resources": NodeResources(**data.get("resources", {}))})


@dataclass
class StagedDataset:
    """A staged dataset directory (manifest.json + uint8 shards) and what its manifest says."""

    directory: FlyteDirectory
    source: str
    source_fingerprint: str  # the source as staged (traincore.data.fingerprint)
    classes: list[str]
    shape: list[int]  # C, H, W
    counts: dict[str, int]  # samples per split
    format_version: int

    @classmethod
    def from_manifest(cls, directory: str | Path | FlyteDirectory, manifest: Manifest) -> StagedDataset:
        """The one conversion from a staged directory's manifest."""
        if not isinstance(directory, FlyteDirectory):
            directory = FlyteDirectory(str(directory))
        return cls(directory=directory, source=manifest.source,
                   source_fingerprint=manifest.source_fingerprint, classes=list(manifest.classes),
                   shape=list(manifest.shape), counts={name: s.count for name, s in manifest.splits.items()},
                   format_version=manifest.format_version)

    def __repr__(self) -> str:
        """Where it is and what it holds, in a few lines (not the class list)."""
        shape = "x".join(map(str, self.shape))
        counts = ", ".join(f"{split} {count}" for split, count in self.counts.items())
        data = f"{self.source}: {len(self.classes)} classes of {shape}; {counts} samples"
        return _lines("StagedDataset", {"directory": _location(self.directory), "data": data})


@dataclass
class TrainResult:
    """Rank 0's account of a training run: the checkpoint root, the logs and the run summary."""

    checkpoints: FlyteDirectory  # step-000123/ directories; the latest complete one is the model
    logs: FlyteDirectory  # metrics.jsonl and tensorboard/
    summary: TrainSummary


@dataclass
class Search:
    """A hyperparameter search as planned (traincore.tuning): its root (the study record and one checkpoint
    root per trial), every trial's parameters (JSON), each rung's step budget and size."""

    root: str
    key: str  # the search's spec digest: the same search, the same key
    metric: str
    budgets: list[int]
    sizes: list[int]
    params: list[str]
    parallel: int
    space: str
    recorded: list[dict[str, float]]  # each rung's results the record held when the search (re)started

    def known(self, rung: int) -> dict[int, float]:
        """The results of rung ``rung`` an earlier run of this search recorded, by trial; only for rungs
        before the last, whose trials' runs the search does not need again (the last one's best is
        exported, so its runs always take place, resuming where they are)."""
        if rung >= min(len(self.recorded), len(self.budgets) - 1):
            return {}
        return {int(trial): value for trial, value in self.recorded[rung].items()}

    def trial_root(self, trial: int) -> str:
        """The checkpoint root of trial ``trial``: each rung of it resumes from the one before."""
        return f"{self.root.rstrip('/')}/trial-{trial:03d}"


@dataclass
class RungResult:
    """One rung of a search: the trials it trained, each one's metric (its best validation up to the rung's
    budget), the step it resumed from (0: from the start), and the trials that go on to the next rung (the
    last rung: its best trial, the one exported)."""

    rung: int
    budget: int
    trials: list[int]
    values: list[float]
    resumed_from: list[int]
    survivors: list[int]


@dataclass
class SearchOutcome:
    """What the rungs found: the best trial of the last rung, and every rung."""

    best_trial: int
    rungs: list[RungResult]


class SearchFinish(NamedTuple):
    """The rungs' result: the outcome, the best trial's training run (exported next) and what its export's
    lineage records of the search. Outputs of their own, not one dataclass holding all: a node reads a
    whole output, never a field of one."""

    outcome: SearchOutcome
    best: TrainResult
    lineage: str  # what the best model's export records of the search (JSON: tasks.tuning.search_lineage)


def dataset_lineage(dataset: StagedDataset) -> Lineage:
    """What a staged dataset contributes to the lineage of the models trained on it."""
    return Lineage(source=dataset.source, source_fingerprint=dataset.source_fingerprint,
                   staging_format=dataset.format_version)


@dataclass
class ModelArtifact:
    """An exported model: one directory holding the safetensors weights, the model config JSON and
    lineage.json (``export.lineage``)."""

    directory: FlyteDirectory
    export: ExportResult  # paths in it are the exporting task's; file names are valid inside ``directory``

    @property
    def weights_file(self) -> str:
        """The safetensors file's name inside ``directory``."""
        return Path(self.export.path).name

    def __repr__(self) -> str:
        """The weights' path, sha256 and step, and where their config and lineage records are (not the
        lineage itself, whose config alone runs to thousands of characters)."""
        where = _location(self.directory)
        records = f"{Path(self.export.config_path).name} and {LINEAGE_FILE} in {where}"
        return _lines("ModelArtifact", {"path": f"{where}/{self.weights_file}", "sha256": self.export.sha256,
                                        "step": str(self.export.step), "records": records})


@dataclass
class EvalReport:
    """Test-split metrics of one exported model and its lineage (the model's, plus the test figures)."""

    result: EvalResult
    lineage: Lineage

    def __repr__(self) -> str:
        """The accuracy and the model it measured, in a few lines (not the per-class figures nor the
        confusion matrix, which the evaluation Deck draws)."""
        result, lineage = self.result, self.lineage
        accuracy = f"{result.accuracy:.4f} on {result.count} samples (loss {result.loss:.4f})"
        model = f"sha256 {lineage.model_sha256[:12]}, step {lineage.checkpoint_step}"
        return _lines("EvalReport", {f"{result.split} accuracy": accuracy, "model": model})


def _location(directory: FlyteDirectory) -> str:
    """Where a directory's files are: its object-store URI once uploaded, else its local path."""
    return str(directory.remote_source or directory.path)


def _lines(name: str, rows: dict[str, str]) -> str:
    """``name(``, one indented ``label  value`` line per row, then ``)``: a repr a person reads at a glance,
    laid out as torch prints a module."""
    width = max(map(len, rows))
    return "\n".join([f"{name}(", *(f"    {label:<{width}}  {value}" for label, value in rows.items()), ")"])


@dataclass
class Promotion:
    """The promotion gate's verdict: the new model (challenger) against the model in service (champion),
    both evaluated on the new test split by the same code."""

    promoted: bool
    reason: str  # names both accuracies, or why they could not be compared
    threshold: float
    tolerance: float
    model: ModelArtifact  # the challenger
    challenger: EvalReport
    champion: EvalReport | None  # None on the first promotion, or when the champion could not be compared
    champion_origin: str  # the champion input, or "<promoted_uri>/<version> (latest)"; "" when none
    promoted_uri: str
    version: str  # the registry version published; "" when not promoted


class RecordTransformer(DataclassTransformer):
    """flytekit's dataclass transformer for the records that cross our task boundaries, each record's
    literal type built once per process.

    flytekit 1.16 derives a dataclass's JSON schema afresh on every ``get_literal_type`` call, which every
    task definition, node and output asks for: 0.02 to 0.9 s a record (Config's 56 fields the most). With
    torch and flytekit loaded, importing the three workflow modules took 3.4-4.4 CPU s, and takes 1.4-1.5
    with each record's type built once (2-core machine); every ``pyflyte run`` pays it, and every pod for the
    tasks it defines. The literal types, values and conversions are exactly flytekit's: only the repeated
    schema builds go.
    """

    def __init__(self, records: tuple[type, ...]):
        super().__init__()
        self.records = frozenset(records)
        self._literal_types: dict[type, types_pb2.LiteralType] = {}

    def get_literal_type(self, t: type | None = None) -> LiteralType:
        """flytekit's literal type of ``t``, a new object each time: flytekit's union transformer sets the
        ``structure`` of the type it is given, which must not change the one kept here."""
        if t not in self.records:
            return super().get_literal_type(t)
        if t not in self._literal_types:
            self._literal_types[t] = super().get_literal_type(t).to_flyte_idl()
        return LiteralType.from_flyte_idl(self._literal_types[t])


RECORDS = (Config, DataConfig, SlurmSettings, NodeResources, Topology, StagedDataset, TrainResult, Search,
           RungResult, SearchOutcome, ModelArtifact, EvalReport, Promotion, TrainSummary, ExportResult,
           EvalResult, Lineage)
"""The dataclasses our tasks take and return, and the traincore records they hold."""


def _register(records: tuple[type, ...]) -> None:
    """One RecordTransformer for ``records``; every other dataclass (a team's own among them) keeps
    flytekit's default transformer."""
    transformer = RecordTransformer(records)
    for record in records:
        TypeEngine.register_additional_type(transformer, record)


_register(RECORDS)
