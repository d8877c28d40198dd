"""Preemption: what watching for signals costs per step, and how long a signalled run takes to save and exit.

    python bench/preemption.py [--steps 300] [--rounds 5] [--json PATH]

1. Per step: two gloo ranks on the CPU (spawned, one torch thread each) train the digits CNN under DDP on
   random 32x32 batches of 64, ``--steps`` steps per run, alternating runs without and with a
   :class:`~traincore.run.preemption.PreemptionWatch` whose ``agree()`` runs after every step, as the
   Trainer calls it (its agreement is an all-reduce on a gloo group of its own, started after one step and
   read after the next). The ratio is the median over ``--rounds`` of each round's watched/bare step time;
   the order of the two runs alternates from round to round.
2. Signal to exit: ``python -m traincore.train --nproc-per-node 2`` on synthetic data (the digits CNN), sent
   SIGTERM once it has logged steps; the seconds from the signal until the launcher and its workers have
   exited, with the step they saved, against the default ``checkpoint.preemption_grace_s``. Then the same
   under FSDP with dcp checkpoints into an S3 bucket (a local moto server): also the seconds until the
   agreed step's commit marker is in the store (the run checkpoints only on the signal, so the first
   marker is the agreed step's).

``--json`` writes {"benchmark": "preemption", "results": [rows], "ratios": {...}} for bench/run.py.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from a source checkout

from bench.s3_server import S3Server, local_s3  # noqa: E402
from traincore.checkpoint import Store, complete_steps  # noqa: E402
from traincore.config.schema import CheckpointConfig, DataConfig, ModelConfig  # noqa: E402
from traincore.data.staging import stage  # noqa: E402
from traincore.model.build import build_model  # noqa: E402
from traincore.run.preemption import PreemptionWatch  # noqa: E402


def _timed_steps(watched: bool, steps: int) -> float:
    """Seconds per step of DDP training on this rank, with or without the watch's per-step agreement."""
    model = torch.nn.parallel.DistributedDataParallel(build_model(ModelConfig(name="small_cnn"), 10,
                                                                  (1, 32, 32), seed=0))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = torch.randn(64, 1, 32, 32), torch.randint(0, 10, (64,))
    watch = PreemptionWatch(grace_s=20.0, world_size=2, main=dist.get_rank() == 0) if watched else None
    try:
        for step in range(steps + 10):
            if step == 10:  # after warm-up
                dist.barrier()
                start = time.perf_counter()
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if watch is not None and watch.agree().stop:
                raise RuntimeError("no signal was sent, yet the ranks agreed to stop")
        if watch is not None:
            watch.finish()
        dist.barrier()
        return (time.perf_counter() - start) / steps
    finally:
        if watch is not None:
            watch.close()


def _rank(rank: int, port: int, steps: int, rounds: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    rows = []
    for index in range(rounds):  # the order alternates, so neither kind always runs on a warmer process
        order = (False, True) if index % 2 == 0 else (True, False)
        timed = {watched: _timed_steps(watched, steps) for watched in order}
        rows.append({"bare_s": timed[False], "watched_s": timed[True]})
    dist.destroy_process_group()
    if rank == 0:
        Path(out).write_text(json.dumps(rows))


def per_step(steps: int, rounds: int, scratch: Path) -> dict:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    out = scratch / "per-step.json"
    mp.spawn(_rank, args=(port, steps, rounds, str(out)), nprocs=2, join=True)
    rows = json.loads(out.read_text())
    return {"case": "DDP step, 2 gloo ranks (digits CNN, batch 64)",
            "bare_ms": round(1000 * statistics.median(r["bare_s"] for r in rows), 3),
            "watched_ms": round(1000 * statistics.median(r["watched_s"] for r in rows), 3),
            "ratio": round(statistics.median(r["watched_s"] / r["bare_s"] for r in rows), 4)}


# ViT-B/16 on 32x32 images: 86 M parameters, so its state with AdamW's two moments is about 1.03 GB
LARGE_MODEL = "vit_b_16"


def signal_to_exit(scratch: Path, s3: S3Server | None = None, model: str = "small_cnn") -> dict:
    """SIGTERM to ``--nproc-per-node 2`` once it has logged steps: seconds until its processes have exited,
    the agreed step saved (``s3``: dcp shards of both ranks committed in a bucket of that server, and the
    seconds until the marker of the agreed step is in the store, read back from it)."""
    data, output = scratch / "data", scratch / f"run-{model}{'-s3' if s3 else ''}"
    if not (data / "manifest.json").exists():
        stage(DataConfig(source="synthetic", image_size=32, synthetic_samples=2000, synthetic_classes=10,
                         channels=1), data)
    config = {"model": {"name": model}, "telemetry": {"log_every": 10, "tensorboard": False}}
    lines = 3  # of metrics.jsonl before the signal: steps logged
    if model != "small_cnn":  # batches of 2 keep its steps (so the agreement on one) short: 2.7 s here,
        # once the first few (twice as slow while memory is first touched) are past
        config.update(loader={"batch_size": 2}, telemetry={"log_every": 1, "tensorboard": False})
        lines = 6
    cmd = [sys.executable, "-m", "traincore.train", "--data", str(data), "--output", str(output), "--preset",
           "digits", "--max-steps", "100000", "--nproc-per-node", "2", "--config", json.dumps(config)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    root = None
    if s3 is not None:
        root = Store(f"s3://{s3.bucket}/preemption-{uuid.uuid4().hex[:8]}", s3.storage_options)
        cmd += ["--checkpoint-dir", root.uri, "--checkpoint-mode", "dcp", "--parallelism", "fsdp"]
        env.update(s3.aws_env)
    log_path = scratch / f"{output.name}.log"
    with open(log_path, "w") as log:
        process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
    metrics = output / "metrics.jsonl"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and process.poll() is None and (
            not metrics.exists() or len(metrics.read_text().splitlines()) < lines):
        time.sleep(0.1)
    sent = time.monotonic()
    process.send_signal(signal.SIGTERM)
    committed_s = None
    while root is not None and process.poll() is None and not complete_steps(root):
        time.sleep(0.01)
    if root is not None and complete_steps(root):
        committed_s = time.monotonic() - sent
    code = process.wait(timeout=120)
    took = time.monotonic() - sent
    text = log_path.read_text()
    line = next((line for line in text.splitlines() if line.startswith("preempted at step")), text[-300:])
    line = line.replace(str(scratch), "<scratch>")  # a temporary directory of this machine
    grace = CheckpointConfig().preemption_grace_s
    what = "digits CNN" if model == "small_cnn" else f"{model} ({_state_gb(metrics)} GB of state)"
    case = (f"SIGTERM to --nproc-per-node 2, {what}, fsdp, dcp into S3 (local moto server)" if s3 else
            f"SIGTERM to --nproc-per-node 2, {what}, sync checkpoint")
    return {"case": case, "exit_code": code, "signal_to_committed_s": round(committed_s, 2) if committed_s
            else None, "signal_to_exit_s": round(took, 2), "grace_s": grace,
            "share_of_grace": round(took / grace, 3), "message": line}


def _state_gb(metrics: Path) -> str:
    """The run's model and optimizer state over all ranks, in GB, from its memory record."""
    for line in metrics.read_text().splitlines():
        record = json.loads(line)
        if record.get("kind") == "memory":
            return f"{(record['param_bytes_total'] + record['optimizer_bytes_total']) / 1e9:.2f}"
    return "?"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300, help="timed steps per run")
    parser.add_argument("--rounds", type=int, default=5, help="bare/watched pairs")
    parser.add_argument("--json", type=Path, default=None, help="also write the results to this JSON file")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-preemption-") as scratch:
        step = per_step(args.steps, args.rounds, Path(scratch))
        stop = signal_to_exit(Path(scratch))
        with local_s3(Path(scratch)) as s3:
            stop_s3 = signal_to_exit(Path(scratch), s3)
            stop_large = signal_to_exit(Path(scratch), s3, LARGE_MODEL)
    print(json.dumps(step), json.dumps(stop), json.dumps(stop_s3), json.dumps(stop_large), sep="\n")
    if args.json:
        args.json.write_text(json.dumps({
            "benchmark": "preemption", "results": [step, stop, stop_s3, stop_large],
            "ratios": {"watched/bare step": step["ratio"], "signal to exit / grace": stop["share_of_grace"],
                       "signal to exit / grace, S3 root": stop_s3["share_of_grace"],
                       "signal to exit / grace, S3 root, 1 GB state": stop_large["share_of_grace"]},
            "targets": {"watched/bare step": "<= 1.02", "signal to exit / grace": "< 1",
                        "signal to exit / grace, S3 root": "< 1",
                        "signal to exit / grace, S3 root, 1 GB state": "< 1"}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
