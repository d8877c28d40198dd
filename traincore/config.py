"""One tree of config dataclasses, shared by the CLIs, the Flyte tasks and the tests.

Every dataclass validates itself in ``__post_init__`` and raises :class:`ConfigError` with a
message that names the field, the bad value and what is allowed. Presets are plain functions.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field and the fix."""


def _check(ok: bool, name: str, value: Any, allowed: str) -> None:
    if not ok:
        raise ConfigError(f"{name}={value!r} is invalid: {allowed}")


def _positive(name: str, value: Any) -> None:
    _check(isinstance(value, int) and not isinstance(value, bool) and value > 0, name, value,
           "must be an integer >= 1")


def _non_negative(name: str, value: Any) -> None:
    _check(isinstance(value, int) and not isinstance(value, bool) and value >= 0, name, value,
           "must be an integer >= 0")


def _one_of(name: str, value: Any, choices: tuple[str, ...]) -> None:
    _check(value in choices, name, value, f"must be one of {', '.join(choices)}")


SOURCE_KINDS = ("digits", "synthetic", "imagefolder")


def parse_source(source: str) -> tuple[str, str]:
    """Split ``"imagefolder:/path"`` into ``("imagefolder", "/path")``; other kinds have no argument."""
    kind, _, arg = source.partition(":")
    if kind not in SOURCE_KINDS:
        raise ConfigError(
            f"data.source={source!r} is unknown: use 'digits', 'synthetic' or 'imagefolder:<path-or-URI>'")
    if kind == "imagefolder" and not arg:
        raise ConfigError("data.source='imagefolder' needs a location: write 'imagefolder:<path-or-URI>'")
    if kind != "imagefolder" and arg:
        raise ConfigError(f"data.source={source!r}: only 'imagefolder' takes a ':<location>' part")
    return kind, arg


@dataclass
class DataConfig:
    """What to stage and how: source, image size, split fractions, synthetic parameters."""

    source: str = "digits"
    image_size: int = 32
    channels: int = 3
    seed: int = 0
    val_fraction: float = 0.1
    test_fraction: float = 0.1
    synthetic_samples: int = 2048
    synthetic_classes: int = 10
    samples_per_shard: int = 8192
    decode_workers: int = 0  # 0 = one per CPU core

    def __post_init__(self) -> None:
        parse_source(self.source)
        _positive("data.image_size", self.image_size)
        _check(self.image_size <= 4096, "data.image_size", self.image_size, "must be <= 4096")
        _check(self.channels in (1, 3), "data.channels", self.channels, "must be 1 or 3")
        _non_negative("data.seed", self.seed)
        for name in ("val_fraction", "test_fraction"):
            value = getattr(self, name)
            _check(isinstance(value, (int, float)) and 0.0 <= value < 1.0, f"data.{name}", value,
                   "must be a fraction in [0, 1)")
        _check(self.val_fraction + self.test_fraction < 1.0, "data.val_fraction + data.test_fraction",
               self.val_fraction + self.test_fraction, "must leave a training split (sum < 1)")
        _positive("data.synthetic_samples", self.synthetic_samples)
        _check(isinstance(self.synthetic_classes, int) and self.synthetic_classes >= 2,
               "data.synthetic_classes", self.synthetic_classes, "must be an integer >= 2")
        _positive("data.samples_per_shard", self.samples_per_shard)
        _non_negative("data.decode_workers", self.decode_workers)


@dataclass
class LoaderConfig:
    """Per-rank batch size and the DataLoader knobs; ``autotune`` probes the best worker settings."""

    batch_size: int = 64
    num_workers: int = 0  # batched memmap gathers are cheap: the main process usually keeps up
    prefetch_factor: int = 2
    persistent_workers: bool = True
    pin_memory: bool = True  # only takes effect on CUDA
    drop_last: bool = True
    shuffle: bool = True
    device_prefetch: bool = True  # CUDA side-stream prefetch
    autotune: bool = False
    eval_batch_size: int = 256

    def __post_init__(self) -> None:
        _positive("loader.batch_size", self.batch_size)
        _non_negative("loader.num_workers", self.num_workers)
        _positive("loader.prefetch_factor", self.prefetch_factor)
        _positive("loader.eval_batch_size", self.eval_batch_size)


MODEL_NAMES = ("small_cnn", "resnet18", "resnet34", "resnet50", "vit_b_16", "mlp")


@dataclass
class ModelConfig:
    """Architecture by name; input shape and class count come from the staged manifest."""

    name: str = "small_cnn"
    width: int = 32  # channels of the first conv layer / hidden size of the MLP
    dropout: float = 0.0
    compile: bool = False

    def __post_init__(self) -> None:
        _one_of("model.name", self.name, MODEL_NAMES)
        _positive("model.width", self.width)
        _check(isinstance(self.dropout, (int, float)) and 0.0 <= self.dropout < 1.0, "model.dropout",
               self.dropout, "must be in [0, 1)")


@dataclass
class OptimConfig:
    """AdamW with linear warmup then cosine decay to ``lr * min_lr_ratio``."""

    lr: float = 1e-3
    weight_decay: float = 0.01
    beta1: float = 0.9
    beta2: float = 0.999
    warmup_steps: int = 20
    min_lr_ratio: float = 0.1
    grad_clip: float = 1.0  # 0 disables clipping

    def __post_init__(self) -> None:
        _check(isinstance(self.lr, (int, float)) and 0 < self.lr < 10, "optim.lr", self.lr, "must be in (0, 10)")
        _check(self.weight_decay >= 0, "optim.weight_decay", self.weight_decay, "must be >= 0")
        for name in ("beta1", "beta2"):
            _check(0 <= getattr(self, name) < 1, f"optim.{name}", getattr(self, name), "must be in [0, 1)")
        _non_negative("optim.warmup_steps", self.warmup_steps)
        _check(0 <= self.min_lr_ratio <= 1, "optim.min_lr_ratio", self.min_lr_ratio, "must be in [0, 1]")
        _check(self.grad_clip >= 0, "optim.grad_clip", self.grad_clip, "must be >= 0 (0 disables clipping)")


@dataclass
class TrainConfig:
    """How long to train and the loop's housekeeping intervals. Give max_steps or epochs."""

    max_steps: int = 0  # 0 = derive from epochs
    epochs: int = 1
    seed: int = 0
    eval_every: int = 0  # 0 = only at the end
    gc_every: int = 50  # Python GC runs only every N steps inside the loop
    bf16: bool = True  # autocast on CUDA; ignored on CPU
    deterministic: bool = True
    profile_steps: str = ""  # "start:end" records a torch.profiler trace for that step window

    def __post_init__(self) -> None:
        _non_negative("train.max_steps", self.max_steps)
        _non_negative("train.epochs", self.epochs)
        _check(self.max_steps > 0 or self.epochs > 0, "train.max_steps/train.epochs",
               (self.max_steps, self.epochs), "set max_steps >= 1 or epochs >= 1")
        _non_negative("train.seed", self.seed)
        _non_negative("train.eval_every", self.eval_every)
        _positive("train.gc_every", self.gc_every)
        if self.profile_steps:
            parts = self.profile_steps.split(":")
            ok = len(parts) == 2 and all(p.isdigit() for p in parts) and int(parts[0]) < int(parts[1])
            _check(ok, "train.profile_steps", self.profile_steps, "must look like 'START:END' with START < END")

    def profile_window(self) -> tuple[int, int] | None:
        """The (start, end) steps to profile, or None."""
        if not self.profile_steps:
            return None
        start, end = self.profile_steps.split(":")
        return int(start), int(end)


CHECKPOINT_MODES = ("sync", "dcp", "async")


@dataclass
class CheckpointConfig:
    """Where and how often to save; ``resume`` is 'latest', 'none' or a step number."""

    mode: str = "sync"
    every: int = 0  # steps between saves; 0 = only at the end
    keep_last: int = 3
    resume: str = "latest"
    verify_on_load: bool = True

    def __post_init__(self) -> None:
        _one_of("checkpoint.mode", self.mode, CHECKPOINT_MODES)
        _non_negative("checkpoint.every", self.every)
        _positive("checkpoint.keep_last", self.keep_last)
        _check(self.resume in ("latest", "none") or str(self.resume).isdigit(), "checkpoint.resume",
               self.resume, "must be 'latest', 'none' or a step number")


WANDB_MODES = ("disabled", "offline", "online")


@dataclass
class TelemetryConfig:
    """Metric sinks (JSONL always; TensorBoard and W&B optional) and logging cadence."""

    log_every: int = 10
    tensorboard: bool = True
    tb_max_queue: int = 100
    tb_flush_secs: int = 30
    wandb_mode: str = "disabled"
    wandb_project: str = "flyte-torch-pipeline"
    progress: str = "auto"  # auto = a progress bar only when stdout is a terminal
    level: str = "INFO"

    def __post_init__(self) -> None:
        _positive("telemetry.log_every", self.log_every)
        _positive("telemetry.tb_max_queue", self.tb_max_queue)
        _positive("telemetry.tb_flush_secs", self.tb_flush_secs)
        _one_of("telemetry.wandb_mode", self.wandb_mode, WANDB_MODES)
        _one_of("telemetry.progress", self.progress, ("auto", "on", "off"))
        _one_of("telemetry.level", self.level, ("DEBUG", "INFO", "WARNING", "ERROR"))


@dataclass
class DistConfig:
    """Process-group backend and timeouts: generous for start-up, tighter once training runs."""

    backend: str = "auto"  # auto = "cpu:gloo,cuda:nccl" with CUDA, else "gloo"
    init_timeout_s: int = 900
    step_timeout_s: int = 300

    def __post_init__(self) -> None:
        _one_of("dist.backend", self.backend, ("auto", "gloo", "nccl", "cpu:gloo,cuda:nccl"))
        _positive("dist.init_timeout_s", self.init_timeout_s)
        _positive("dist.step_timeout_s", self.step_timeout_s)


_SECTIONS = {
    "data": DataConfig, "loader": LoaderConfig, "model": ModelConfig, "optim": OptimConfig,
    "train": TrainConfig, "checkpoint": CheckpointConfig, "telemetry": TelemetryConfig, "dist": DistConfig,
}


@dataclass
class Config:
    """The whole tree. ``Config.from_dict`` / ``with_overrides`` reject unknown keys by name."""

    data: DataConfig = field(default_factory=DataConfig)
    loader: LoaderConfig = field(default_factory=LoaderConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    telemetry: TelemetryConfig = field(default_factory=TelemetryConfig)
    dist: DistConfig = field(default_factory=DistConfig)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Config:
        return cls().with_overrides(data)

    def with_overrides(self, overrides: dict[str, Any] | str) -> Config:
        """A new Config with nested overrides applied, e.g. ``{"loader": {"batch_size": 32}}``.

        Also accepts a JSON string, and dotted keys (``{"loader.batch_size": 32}``).
        """
        if isinstance(overrides, str):
            try:
                overrides = json.loads(overrides) if overrides.strip() else {}
            except json.JSONDecodeError as exc:
                raise ConfigError(f"config overrides are not valid JSON ({exc}); pass e.g. "
                                  '\'{"loader": {"batch_size": 32}}\'') from exc
        if not isinstance(overrides, dict):
            raise ConfigError(f"config overrides must be a JSON object, got {type(overrides).__name__}")
        merged = self.to_dict()
        for key, value in _nest(overrides).items():
            if key not in _SECTIONS:
                raise ConfigError(f"unknown config section {key!r}; sections are {', '.join(_SECTIONS)}")
            if not isinstance(value, dict):
                raise ConfigError(f"config section {key!r} must be an object of fields, got {value!r}")
            known = {f.name for f in dataclasses.fields(_SECTIONS[key])}
            for name, item in value.items():
                if name not in known:
                    raise ConfigError(f"unknown config field {key}.{name}; fields are {', '.join(sorted(known))}")
                merged[key][name] = item
        return Config(**{name: _SECTIONS[name](**values) for name, values in merged.items()})


def _nest(overrides: dict[str, Any]) -> dict[str, Any]:
    nested: dict[str, Any] = {}
    for key, value in overrides.items():
        section, dot, name = key.partition(".")
        if dot:
            nested.setdefault(section, {})[name] = value
        elif isinstance(value, dict):
            nested.setdefault(section, {}).update(value)
        else:
            nested[key] = value
    return nested


# ---- presets -------------------------------------------------------------------------------------

def debug() -> Config:
    """Seconds-long run for tests: tiny synthetic data, a few steps."""
    return Config(
        data=DataConfig(source="synthetic", image_size=16, synthetic_samples=512, samples_per_shard=128),
        loader=LoaderConfig(batch_size=16),
        model=ModelConfig(name="small_cnn", width=8),
        optim=OptimConfig(warmup_steps=2),
        train=TrainConfig(max_steps=20, epochs=0, gc_every=10),
        telemetry=TelemetryConfig(log_every=5),
    )


def digits() -> Config:
    """scikit-learn digits at 32x32: reaches >= 0.95 test accuracy in a few CPU minutes."""
    return Config(
        data=DataConfig(source="digits", image_size=32, channels=1),
        loader=LoaderConfig(batch_size=32),
        model=ModelConfig(name="small_cnn", width=32),
        optim=OptimConfig(lr=2e-3, warmup_steps=20),
        train=TrainConfig(epochs=8, max_steps=0, eval_every=100),
        telemetry=TelemetryConfig(log_every=20),
    )


def imagenet_like() -> Config:
    """ResNet-50 at 224x224 on an ImageFolder: a GPU preset with async checkpoints and workers."""
    return Config(
        data=DataConfig(source="imagefolder:./data/imagenet", image_size=224, channels=3),
        loader=LoaderConfig(batch_size=128, num_workers=8, prefetch_factor=4),
        model=ModelConfig(name="resnet50", compile=True),
        optim=OptimConfig(lr=1e-3, weight_decay=0.05, warmup_steps=2000),
        train=TrainConfig(epochs=90, max_steps=0, eval_every=5000),
        checkpoint=CheckpointConfig(mode="async", every=2000),
        telemetry=TelemetryConfig(log_every=50),
    )


PRESETS = {"debug": debug, "digits": digits, "imagenet_like": imagenet_like}


def preset(name: str) -> Config:
    """The preset called ``name``; unknown names list the choices."""
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; presets are {', '.join(PRESETS)}")
    return PRESETS[name]()
