"""Named starting configs: ``preset(name)`` builds one; ``PRESETS`` maps every name to its function.

The CLIs and the Flyte tasks make a run's Config with :func:`build_config`: a preset, JSON overrides on
top (:meth:`traincore.config.schema.Config.with_overrides`), then the explicit flags or inputs.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from traincore.config.schema import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    CheckpointConfig,
    Config,
    ConfigError,
    DataConfig,
    LoaderConfig,
    ModelConfig,
    OptimConfig,
    TelemetryConfig,
    TrainConfig,
)


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
        # Validation once an epoch (44 steps of 32 of the 1,437 training images) on batches of 128, which
        # a CPU runs faster than 256: bench/validation.py measures what it costs.
        loader=LoaderConfig(batch_size=32, eval_batch_size=128),
        model=ModelConfig(name="small_cnn", width=32),
        optim=OptimConfig(lr=2e-3, warmup_steps=20),
        train=TrainConfig(epochs=8, max_steps=0, eval_every=44),
        telemetry=TelemetryConfig(log_every=20),
    )


def vit_tiny() -> Config:
    """The small ViT (``vit_tiny``) on 32x32 RGB images: 200 steps take a few minutes on 2 CPU cores.

    Synthetic images unless a source is given (e.g. ``imagefolder:<path>``); bench/end_to_end.py uses it.
    """
    return Config(
        data=DataConfig(source="synthetic", image_size=32, channels=3),
        loader=LoaderConfig(batch_size=32),
        model=ModelConfig(name="vit_tiny"),
        optim=OptimConfig(lr=1e-3, weight_decay=0.05, warmup_steps=20),
        train=TrainConfig(max_steps=200, epochs=0),
        telemetry=TelemetryConfig(log_every=20),
    )


def imagenet_like() -> Config:
    """ResNet-50 at 224x224 on an ImageFolder: a GPU preset with async checkpoints and workers, random
    resized crops, horizontal flips and label smoothing (torchvision's classification reference).

    ``deterministic=False``: deterministic algorithms force slow cuDNN convolutions, and bitwise resume
    is not worth that price on a GPU run of this size.
    """
    return Config(
        data=DataConfig(source="imagefolder:./data/imagenet", image_size=224, channels=3, mean=IMAGENET_MEAN,
                        std=IMAGENET_STD),
        loader=LoaderConfig(batch_size=128, num_workers=8, prefetch_factor=4, random_resized_crop=True,
                            horizontal_flip=True),
        model=ModelConfig(name="resnet50", compile=True),
        optim=OptimConfig(lr=1e-3, weight_decay=0.05, warmup_steps=2000),
        train=TrainConfig(epochs=90, max_steps=0, eval_every=5000, deterministic=False, label_smoothing=0.1),
        checkpoint=CheckpointConfig(mode="async", every=2000),
        telemetry=TelemetryConfig(log_every=50),
    )


PRESETS = {"debug": debug, "digits": digits, "vit_tiny": vit_tiny, "imagenet_like": imagenet_like}


def preset(name: str) -> Config:
    """The preset called ``name``; unknown names list the choices."""
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; presets are {', '.join(PRESETS)}")
    return PRESETS[name]()


def build_config(preset_name: str, overrides: str | dict[str, Any] = "",
                 settings: Mapping[str, Any] | None = None,
                 labels: Mapping[str, str] | None = None) -> Config:
    """A run's Config, the one way every entry point makes it: the preset, then the JSON ``overrides``,
    then the explicit ``settings`` (dotted field -> value, e.g. ``{"train.max_steps": 100}``).

    ``labels`` names what the user typed for ``"preset"``, ``"overrides"`` and each settings field (a CLI
    flag, a workflow input): a ConfigError starts with the label of the value at fault, so the message
    points at the flag or input to fix, not at an internal field name.
    """
    labels = labels or {}
    try:
        cfg = preset(preset_name)
    except ConfigError as exc:
        raise ConfigError(f"{labels.get('preset', 'preset')}: {exc}") from exc
    try:
        cfg = cfg.with_overrides(overrides)
    except ConfigError as exc:
        raise ConfigError(f"{labels.get('overrides', 'config overrides')}: {exc}") from exc
    try:
        return cfg.with_overrides(dict(settings or {}))
    except ConfigError as exc:
        label = next((label for field, label in labels.items() if str(exc).startswith(f"{field}=")), None)
        raise (ConfigError(f"{label}: {exc}") if label else exc) from exc
