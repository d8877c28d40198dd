"""The model: built-in models by name, a user's factory by import path, and a warm start from a weights file.

    build      build_model: mlp, small_cnn, resnet18, vit_tiny, or ``"<module>:<callable>"``; FSDP units
    warmstart  model.init_from / init_exclude / init_strict: read a weights file and load what matches

Other packages import from here, never from the modules.
"""

from traincore.model.build import (
    ModelImportError,
    SmallCNN,
    build_model,
    check_trusted,
    parameter_count,
    shard_units,
)
from traincore.model.warmstart import check, plan, read_init_file, warm_start

__all__ = [
    "build_model", "check", "check_trusted", "ModelImportError", "parameter_count", "plan",
    "read_init_file", "shard_units", "SmallCNN", "warm_start",
]
