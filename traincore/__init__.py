"""traincore: the training core every Flyte task wraps, usable on its own with ``torchrun``. No flytekit here.

Command lines (each ``python -m traincore.<name> --help``):
    stage      decode a source once into the staged format      (stage.py -> data/)
    train      the Trainer over a staged dataset, 1..N ranks    (train.py -> run/)
    export     a checkpoint -> one safetensors file + config    (export.py -> artifacts/)
    evaluate   an exported model on one split                   (evaluate.py -> artifacts/)
    registry   promoted versions of a model                     (registry.py -> artifacts/)

Modules here:
    files      atomic publish (temp file, fsync, rename) and file checksums, for every writer
    imports    importing a user's code by path, with one error line for what it raises or exits with
    exitcodes  the exit codes launchers and schedulers act on (no torch: Slurm's job reads it on every node)

Subpackages, by concern (each ``__init__`` lists its modules; other packages import from there):
    config/      the one tree of config dataclasses, the presets, the generated reference page
    data/        sources, staging, the staged format (manifest), the loader, autotune, fingerprints
    model/       built-in models by name, a team's factory, warm starts from a weights file
    run/         the Trainer, its steps, the state registry, process groups, launch, preflight, preemption
    checkpoint/  the checkpointer over the state registry, its layout, formats, writers, stores
    telemetry/   logging and per-interval metrics, sinks (JSONL, TensorBoard, W&B), profiling, start-up phases
    artifacts/   export, evaluation, lineage and the registry of promoted versions
"""
