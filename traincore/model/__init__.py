"""The model: built-in models by name, a user's factory by import path, and a warm start from a weights file.

    build      build_model: mlp, small_cnn, resnet18, vit_tiny, or ``"<module>:<callable>"``; FSDP units
    factory    a user's factory: imported, called with the arguments it takes, fitted to the data
    warmstart  model.init_from / init_exclude / init_strict: sort the file's tensors against the model's
    initfile   reading model.init_from (through the checkpoint store layer), or only its header

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
from traincore.model.initfile import InitError, read_init_file, read_init_header, store_options
from traincore.model.warmstart import check, init_tensors, plan, warm_start

__all__ = [
    "build_model", "check", "check_trusted", "init_tensors", "InitError", "ModelImportError",
    "parameter_count", "plan", "read_init_file", "read_init_header", "shard_units", "SmallCNN",
    "store_options", "warm_start",
]
