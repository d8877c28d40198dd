"""The training run: one Trainer per worker, the loop's steps, what a resume restores, and how workers start.

    trainer     the Trainer: model, optimizer, schedule, loader, checkpointer and telemetry of one run
    steps       one training step, one validation pass, seeding
    schedule    the LR schedule: warmup, then cosine, linear, step, constant or one cycle
    param_groups  parameters by name pattern: a learning-rate multiplier, or frozen
    ema         an exponential moving average of the weights, validated and exported when on
    state       the state registry: Stateful views of every part a resume restores
    dist        process groups from the torchrun / torch elastic environment; collective timeouts; FSDP2/DDP
    launch      local workers started from one process (``--nproc-per-node``)
    membership  node ranges (MIN:MAX) and the world-size changes of an elastic run, reported once each
    preflight   the checks a run passes before any process group or worker starts
    early_stopping  the best validation so far; stop after `patience` validations without improvement
    preemption  SIGTERM / SIGINT / Slurm's warning: agree on a step, save it within the grace, exit 75
    cli         ``python -m traincore.train``: flags, presets, one ``error:`` line for bad input

Other packages import from here, never from the modules.
"""

from traincore.run.dist import DistContext, parallelize
from traincore.run.launch import (
    WORKER_NAME,
    open_start_gate,
    settle_worker,
    shutdown_timeout_s,
    start_method,
    worker_threads,
)
from traincore.run.membership import check_node_range, elastic_config, node_range
from traincore.run.param_groups import check_param_groups
from traincore.run.preemption import Preempted, PreemptionWatch, read_record
from traincore.run.preflight import OutputError, check_model_input, ensure_writable_dir, preflight
from traincore.run.schedule import lr_factor
from traincore.run.state import Progress, StateRegistry, training_registry
from traincore.run.steps import endless, seed_everything
from traincore.run.trainer import Trainer

__all__ = [
    "check_model_input", "check_node_range", "check_param_groups", "DistContext", "elastic_config", "endless",
    "ensure_writable_dir", "lr_factor", "open_start_gate", "OutputError", "node_range", "parallelize",
    "Preempted", "PreemptionWatch", "preflight", "Progress", "read_record", "seed_everything",
    "settle_worker", "shutdown_timeout_s", "start_method", "StateRegistry", "Trainer", "training_registry",
    "worker_threads", "WORKER_NAME",
]
