"""Named starting configs: ``preset(name)`` builds one; ``PRESETS`` maps every name to its function.

The CLIs and the Flyte tasks start from a preset and apply overrides on top
(:meth:`traincore.config.Config.with_overrides`).
"""

from __future__ import annotations

from traincore.config import (
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
        loader=LoaderConfig(batch_size=32),
        model=ModelConfig(name="small_cnn", width=32),
        optim=OptimConfig(lr=2e-3, warmup_steps=20),
        train=TrainConfig(epochs=8, max_steps=0, eval_every=20),
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
    """ResNet-50 at 224x224 on an ImageFolder: a GPU preset with async checkpoints and workers.

    ``deterministic=False``: deterministic algorithms force slow cuDNN convolutions, and bitwise resume
    is not worth that price on a GPU run of this size.
    """
    return Config(
        data=DataConfig(source="imagefolder:./data/imagenet", image_size=224, channels=3),
        loader=LoaderConfig(batch_size=128, num_workers=8, prefetch_factor=4),
        model=ModelConfig(name="resnet50", compile=True),
        optim=OptimConfig(lr=1e-3, weight_decay=0.05, warmup_steps=2000),
        train=TrainConfig(epochs=90, max_steps=0, eval_every=5000, deterministic=False),
        checkpoint=CheckpointConfig(mode="async", every=2000),
        telemetry=TelemetryConfig(log_every=50),
    )


PRESETS = {"debug": debug, "digits": digits, "vit_tiny": vit_tiny, "imagenet_like": imagenet_like}


def preset(name: str) -> Config:
    """The preset called ``name``; unknown names list the choices."""
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; presets are {', '.join(PRESETS)}")
    return PRESETS[name]()
