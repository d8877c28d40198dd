"""Telemetry: what a run reports, and where.

    reporting  logging setup, the progress bar, and the per-interval Telemetry the Trainer feeds
    metrics    FLOPs per sample, device peak FLOP/s (MFU), memory, interval meters
    sinks      metric sinks on rank 0: JSONL always, TensorBoard and Weights & Biases as configured
    wandb_access  W&B online mode's key and server checks, apart from the sinks
    profiling  an optional torch.profiler window, one Chrome trace per rank
    startup    where start-up time goes: phase marks from process start to the first step
    summary    what a finished run reports (TrainSummary) and the line a user reads
    records    every attempt's records (metrics.jsonl, events, stderr tails) copied into the durable root
"""

from traincore.telemetry.metrics import peak_flops, state_bytes, training_flops_per_sample
from traincore.telemetry.profiling import ProfilerWindow
from traincore.telemetry.records import RecordsSync, attempt_records, continue_records, next_attempt
from traincore.telemetry.reporting import Telemetry, Workload, logging_setup
from traincore.telemetry.startup import StartupClock, process_start_time
from traincore.telemetry.summary import TrainSummary, format_summary
from traincore.telemetry.wandb_access import check_wandb_reachable, resolve_wandb_key

__all__ = [
    "attempt_records", "check_wandb_reachable", "continue_records", "format_summary", "logging_setup",
    "next_attempt", "peak_flops", "process_start_time", "ProfilerWindow", "RecordsSync",
    "resolve_wandb_key", "StartupClock", "state_bytes", "Telemetry", "training_flops_per_sample",
    "TrainSummary", "Workload",
]
