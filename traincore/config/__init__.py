"""Configuration: one tree of dataclasses validated on construction, the named presets, and the generated
reference page.

    schema   the config tree (Config and its sections), each field with a docstring; ConfigError
    presets  named starting points (debug, cnn, vit_tiny, imagenet_like, ...), plain functions
    doc      docs/config.md's table, rendered from the field docstrings (``python -m traincore.config.doc``)

Other packages import from here, never from the modules.
"""

from traincore.config.presets import PRESETS, build_config, preset
from traincore.config.schema import (
    OWN_MODELS,
    PARALLELISMS,
    VALIDATION_METRICS,
    CheckpointConfig,
    Config,
    ConfigError,
    DataConfig,
    DistConfig,
    LoaderConfig,
    ModelConfig,
    TelemetryConfig,
    is_imported_model,
    model_identity,
    optimizer_identity,
    parse_source,
)

__all__ = [
    "build_config", "CheckpointConfig", "Config", "ConfigError", "DataConfig", "DistConfig",
    "is_imported_model", "LoaderConfig", "model_identity", "ModelConfig", "optimizer_identity", "OWN_MODELS",
    "PARALLELISMS", "parse_source", "preset", "PRESETS", "TelemetryConfig", "VALIDATION_METRICS",
]
