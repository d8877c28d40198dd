"""traincore: the training core every Flyte task wraps, usable on its own with ``torchrun``. No flytekit here.

Command lines (each ``python -m traincore.<name> --help``):
    stage      decode a source once into the staged format      (traincore.data.staging)
    train      the Trainer over a staged dataset, 1..N ranks    (train.py)
    export     a checkpoint -> one safetensors file + config    (export.py)
    evaluate   an exported model on one split                   (evaluate.py)

Modules here:
    config      the one tree of config dataclasses, validated on construction; presets: named starts
    config_doc  the config reference page (docs/config.md), generated from the field docstrings
    train       Trainer (one run in one worker: model, optimizer, loader, checkpointer, telemetry) and its CLI
    steps       one training step, one validation pass, the LR schedule, seeding
    state       the state registry (Stateful views of every part a resume restores)
    models      models by name (mlp, cnn, resnet18, vit_tiny)
    dist        process groups from the torchrun / torch elastic environment; collective timeouts
    launch      local workers forked from one process (``--nproc-per-node``)
    preflight   the checks a run passes before any process group or worker starts
    files       atomic publish (temp file, fsync, rename) and file checksums, for every writer
    export, evaluate, lineage, registry   what follows training: artifacts, their lineage, promoted versions

Subpackages, by concern:
    data/        sources, staging, the staged format (manifest), the loader, autotune, fingerprints
    checkpoint/  the checkpointer over the state registry, its layout, formats, writers, stores
    telemetry/   logging and per-interval metrics, sinks (JSONL, TensorBoard, W&B), profiling, start-up phases
"""
