"""Telemetry: what a run reports, and where.

    reporting  logging setup, the progress bar, and the per-interval Telemetry the Trainer feeds
    metrics    FLOPs per sample, device peak FLOP/s (MFU), memory, interval meters
    sinks      metric sinks on rank 0: JSONL always, TensorBoard and Weights & Biases as configured
    profiling  an optional torch.profiler window, one Chrome trace per rank
    startup    where start-up time goes: phase marks from process start to the first step
    summary    what a finished run reports (TrainSummary) and the line a user reads
    records    every attempt's records (metrics.jsonl, events, stderr tails) copied into the durable root
"""
