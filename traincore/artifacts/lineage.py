"""Where a model comes from: one ``Lineage`` record, grown along the pipeline and kept beside the weights.

Staging knows the source, its fingerprint and the staging format; export adds what the checkpoint records
(the resolved config and its hash, the step, the world size), the code version and the run (execution id,
metric summary); evaluation adds the test accuracy and the size of the test split. ``lineage.json`` sits
next to ``model.safetensors`` in every export and every registry version.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
from dataclasses import asdict, dataclass, field, fields, replace
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from traincore.telemetry import TrainSummary

LINEAGE_FILE = "lineage.json"  # beside model.safetensors in an export directory and a registry version
PACKAGE = "flyte-torch-pipeline"
UNKNOWN = "unknown"
GIT_TIMEOUT_S = 5.0  # a hung git (a network filesystem, a lock) must not hold up an export


class LineageError(ValueError):
    """A lineage file is missing, damaged or not what traincore writes; the message says what to do."""


@dataclass
class Lineage:
    """The provenance of a dataset, model or evaluation; empty fields are not known at that stage."""

    source: str = ""  # the dataset source as given (digits, synthetic, imagefolder:<path-or-URI>)
    source_fingerprint: str = ""  # the source's content when it was staged (listing with sizes/mtimes/ETags)
    staging_format: int = 0  # traincore.data.manifest.FORMAT_VERSION of the staged data
    data_config_hash: str = ""  # config_hash of the resolved config's data section
    config_hash: str = ""  # config_hash of the whole resolved config
    config: dict = field(default_factory=dict)  # the resolved config the model was trained with
    code_version: str = ""  # code_version() where the model was exported
    execution_id: str = ""  # the Flyte execution (project/domain/name) that trained and exported it
    checkpoint_step: int = 0  # the optimizer step of the exported checkpoint
    world_size: int = 0  # training processes
    metrics: dict[str, float] = field(default_factory=dict)  # summary of the run's metric history
    model_sha256: str = ""  # of model.safetensors
    init_sha256: str = ""  # of the model.init_from file the weights started from; empty: random init
    test_accuracy: float | None = None  # on the test split of the data above, when the model was evaluated
    test_count: int = 0  # samples in that test split
    search: dict = field(default_factory=dict)  # the search that chose it: space, trial, parameters, rung

    def to_json(self) -> str:
        """The lineage.json text (keys sorted, so equal records give equal files)."""
        return json.dumps(asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes, where: str = "lineage") -> Lineage:
        """The record a lineage.json holds; LineageError naming ``where`` if it is not one."""
        try:
            data = json.loads(text)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise LineageError(f"{where} is not valid JSON ({exc}): it is truncated or was edited; export "
                               "the model again to rewrite it") from exc
        if not isinstance(data, dict):
            raise LineageError(f"{where} holds a JSON {type(data).__name__}, not an object: export the model "
                               "again to rewrite it")
        known = {spec.name for spec in fields(cls)}
        # Unknown keys come from a newer version of this code: kept readable, ignored.
        return cls(**{key: value for key, value in data.items() if key in known})

    def write(self, path: str | Path) -> None:
        """Write the record to ``path`` (callers publish it atomically, see traincore.export)."""
        Path(path).write_text(self.to_json(), encoding="utf-8")

    @classmethod
    def load(cls, path: str | Path) -> Lineage:
        """The record in the file ``path``."""
        path = Path(path)
        if not path.is_file():
            raise LineageError(f"{path} does not exist: export the model with python -m traincore.export, "
                               "which writes it beside model.safetensors")
        return cls.from_json(path.read_bytes(), str(path))


def config_hash(config: dict) -> str:
    """sha256 of the canonical JSON of ``config`` (sorted keys, no spaces): equal configs, equal hashes."""
    canonical = json.dumps(config, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(canonical.encode("ascii")).hexdigest()


def code_version() -> str:
    """``flyte-torch-pipeline 0.1.0 (git 1a2b3c4d5e6f)``, ``-dirty`` for uncommitted changes; parts that
    cannot be found read ``unknown`` (an image without the git checkout, a source tree not installed)."""
    try:
        version = metadata.version(PACKAGE)
    except metadata.PackageNotFoundError:
        version = UNKNOWN
    return f"{PACKAGE} {version} (git {_git_revision()})"


def _git_revision() -> str:
    """The checkout's revision when this file lies in one with git installed; ``unknown`` otherwise."""
    checkout = Path(__file__).resolve().parents[2]  # traincore/artifacts/lineage.py
    if not (checkout / ".git").exists():
        return UNKNOWN
    try:
        done = subprocess.run(["git", "-C", str(checkout), "describe", "--always", "--dirty", "--abbrev=12"],
                              capture_output=True, text=True, timeout=GIT_TIMEOUT_S, check=False)
    except (OSError, subprocess.SubprocessError):
        return UNKNOWN
    return done.stdout.strip() if done.returncode == 0 and done.stdout.strip() else UNKNOWN


def with_run(base: Lineage, meta: dict, step: int) -> Lineage:
    """``base`` plus what a checkpoint's run record (traincore.train's ``meta``) says about the model: the
    resolved config and its hashes, the source, the world size, the step and the sha256 of the file its
    weights started from, with this code's version."""
    config = meta.get("config") or {}
    return replace(base, source=str(meta.get("source") or base.source),
                   data_config_hash=config_hash(config.get("data", {})), config_hash=config_hash(config),
                   config=config, code_version=code_version(), checkpoint_step=int(step),
                   world_size=int(meta.get("world_size") or base.world_size),
                   init_sha256=str((meta.get("init") or {}).get("sha256", "")))


SUMMARY_METRICS = ("steps", "final_loss", "val_accuracy", "samples_per_s", "data_wait_share", "wall_s")


def metric_summary(summary: TrainSummary) -> dict[str, float]:
    """The figures of a run's metric history kept with its model: those of the TrainSummary it measured."""
    values = {name: getattr(summary, name) for name in SUMMARY_METRICS}
    return {name: float(value) for name, value in values.items() if value is not None}


def with_test(base: Lineage, accuracy: float, count: int) -> Lineage:
    """``base`` plus the model's figures on the test split of the data it names."""
    return replace(base, test_accuracy=float(accuracy), test_count=int(count))
