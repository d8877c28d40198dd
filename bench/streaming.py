"""Streaming benchmark: a staged dataset larger than a node should copy, read from a remote-like store.

    python bench/streaming.py [--samples 200000] [--size 128] [--small-samples 2000] [--latency-ms 30]
                              [--connection-mb-s 100] [--cache-mb 1024] [--batches 100] [--dir DIR]
                              [--json PATH]

Two synthetic datasets of 3 x size x size uint8 samples are staged to local disk under ``--dir`` (kept
between runs: staging 10 GB takes minutes): the large one (200,000 samples at 128 px: 9.8 GB) and a small
one (2,000 samples: 98 MB). bench/slow_store.py serves that directory as an S3 bucket that answers each
request after ``--latency-ms`` and sends each connection at most ``--connection-mb-s``. Rows:

  loader, local disk   StagedLoader.host_batches() over the memory-mapped staging, batch 64, world size 1,
                       with loader.block_samples 1 (every sample on its own) and 16 (runs of neighbours)
  loader, streamed     the same loaders over the same dataset read from the store (data.stream: ranged GETs
                       of the batches' runs of samples, a few batches ahead, through a cache of
                       ``--cache-mb``, one per row)
  model consumption    samples/s of a training step (forward, backward, AdamW) of resnet18 at this size on
                       this machine's CPU: the rate the loader has to keep up with here
  time to first step   ``python -m traincore.train --data s3://... --max-steps 1`` on the small and the large
                       dataset, streamed: seconds from the command to its first step (its start-up record)
  evaluation           the large dataset's val split in order, in batches of 64, as a validation pass and
                       ``traincore.evaluate`` read it (data.eval_batches): from local disk, streamed (fetched
                       ahead as training's batches are), and streamed one batch at a time (each batch fetched
                       when asked for, as evaluation read a streamed split before it fetched ahead)

Every loader row starts with the large dataset's files out of the page cache (``posix_fadvise``
DONTNEED, which needs no privileges), as a dataset larger than a node's memory is: the local rows read the
disk, the store's server reads the same disk, and no row depends on what ran before it (right after
staging, this machine's 23 GiB held the whole 9.8 GB and the local per-sample row read 56x faster).

Ratios: streamed over local loader throughput for each block size (target >= 0.9), streamed throughput
over the model's consumption (>= 1: the stream is not what a step waits for), time to first step of the
large dataset over the small one's (target <= 1.2), the cache's peak disk use over its limit (target
<= 1.0), and what fetching ahead gains a streamed evaluation over reading one batch at a time (> 1). The
evaluation rows have no local target: a split read in order is one sequential read, which a local disk
serves with its read-ahead (0.5 GB/s here), and ranged requests to a store do not match.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from contextlib import closing
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from a source checkout

from bench.slow_store import BUCKET, SlowStore, slow_store  # noqa: E402
from bench.tables import markdown_table, write_results  # noqa: E402

START_TIMEOUT_S = 300  # for a streamed run to reach its first step
BLOCKS = (1, 16)  # loader.block_samples of the loader rows: the per-sample order, and runs of 16 neighbours
TARGETS = {"streamed over local loader samples/s, block_samples 1": ">= 0.9",
           "streamed over local loader samples/s, block_samples 16": ">= 0.9",
           "streamed loader over model samples/s": ">= 1",
           "time to first step, large over small": "<= 1.2", "cache peak disk over its limit": "<= 1.0",
           "streamed evaluation, fetched ahead over one batch at a time": "> 1"}
EVAL_BATCH = 64


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=200_000, help="samples of the large dataset")
    parser.add_argument("--small-samples", type=int, default=2_000, help="samples of the small dataset")
    parser.add_argument("--size", type=int, default=128, help="image side in pixels (3 channels)")
    parser.add_argument("--latency-ms", type=float, default=30.0, help="the store's latency per request")
    parser.add_argument("--connection-mb-s", type=float, default=100.0, help="the store's cap per connection")
    parser.add_argument("--cache-mb", type=int, default=1024, help="the streamed loader's cache limit")
    parser.add_argument("--batches", type=int, default=100, help="batches of 64 timed per loader row")
    parser.add_argument("--dir", type=Path, default=Path("runs/bench/streaming"),
                        help="where the datasets are staged (kept for the next run)")
    parser.add_argument("--json", help="also write the results as JSON to this file")
    return parser.parse_args(argv)


def staged(directory: Path, samples: int, size: int) -> tuple[Path, float | None]:
    """A synthetic staging of ``samples`` at ``size`` px under ``directory`` (reused when there), and the
    seconds its staging took (None when reused)."""
    from traincore.config.schema import DataConfig
    from traincore.data.partitions import PARTITION_BYTES
    from traincore.data.staging import stage

    output = directory / f"synthetic-{samples}-{size}px"
    if (output / "manifest.json").exists():
        return output, None
    start = time.perf_counter()
    # A partition per core for a large dataset; under one partition's worth, the partitions' spawned
    # interpreters (torch imported in each) would cost more than they save.
    partitions = (os.cpu_count() or 1) if samples * 3 * size * size > PARTITION_BYTES else 1
    stage(DataConfig(source="synthetic", image_size=size, channels=3, synthetic_samples=samples,
                     synthetic_classes=10), output, partitions=partitions, progress=lambda _: None)
    return output, time.perf_counter() - start


def evict(dataset: Path) -> None:
    """Drop the page cache's copy of every file of ``dataset`` (the next read goes to the disk)."""
    for path in dataset.iterdir():
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def loader_rate(split, batches: int, block: int = 1) -> float:
    """Samples/s of ``batches`` uint8 batches of 64 from ``split`` (after one untimed batch), the order
    permuting runs of ``block`` neighbouring samples (loader.block_samples)."""
    from traincore.config.schema import LoaderConfig
    from traincore.data.loader import StagedLoader

    stream = StagedLoader(split, LoaderConfig(batch_size=64, block_samples=block)).host_batches()
    next(stream)
    start = time.perf_counter()
    samples = sum(len(labels) for _, labels in itertools.islice(stream, batches))
    return samples / (time.perf_counter() - start)


def eval_rate(split, batches: int, ahead: bool = True) -> float:
    """Samples/s of the first ``batches`` evaluation batches of ``split`` in order (after one untimed batch):
    data.eval_batches, or with ``ahead`` off each batch read when asked for (``split.read``)."""
    import numpy as np

    from traincore.data.loader import eval_batches

    if ahead:
        reads = eval_batches(split, EVAL_BATCH)
    else:
        reads = (split.read(np.arange(start, start + EVAL_BATCH))
                 for start in range(0, len(split) - EVAL_BATCH + 1, EVAL_BATCH))
    with closing(reads):
        next(reads)
        start = time.perf_counter()
        samples = sum(len(labels) for _, labels in itertools.islice(reads, batches))
        return samples / (time.perf_counter() - start)


def model_rate(size: int, steps: int = 5) -> float:
    """Samples/s of resnet18's training steps on batches of 64 at ``size`` px, on this CPU."""
    import torch
    import torch.nn.functional as F

    from traincore.config.schema import ModelConfig
    from traincore.model.build import build_model

    model = build_model(ModelConfig(name="resnet18"), 10, (3, size, size), seed=0)
    optimizer = torch.optim.AdamW(model.parameters())
    images, labels = torch.randn(64, 3, size, size), torch.randint(0, 10, (64,))
    for step in range(steps + 1):
        if step == 1:  # after a warm-up step
            start = time.perf_counter()
        F.cross_entropy(model(images), labels).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return 64 * steps / (time.perf_counter() - start)


def time_to_first_step(store: SlowStore, dataset: Path, scratch: Path) -> float:
    """Seconds from ``python -m traincore.train`` on the streamed ``dataset`` to its first step (its start-up
    record); the run is stopped there, before its final evaluation streams the whole val split."""
    output = scratch / f"ttfs-{dataset.name}"
    config = {"model": {"name": "small_cnn"}, "telemetry": {"tensorboard": False}}
    cmd = [sys.executable, "-m", "traincore.train", "--data", f"s3://{BUCKET}/{dataset.name}", "--output",
           str(output), "--max-steps", "1000", "--config", json.dumps(config)]
    metrics = output / "metrics.jsonl"
    with subprocess.Popen(cmd, env={**os.environ, **store.aws_env}, stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True, start_new_session=True) as process:
        deadline = time.monotonic() + START_TIMEOUT_S
        while (startup := _startup_seconds(metrics)) is None:
            if process.poll() is not None or time.monotonic() > deadline:
                os.killpg(process.pid, signal.SIGKILL)
                raise SystemExit(f"the streamed run on {dataset.name} did not reach a step: "
                                 f"{process.communicate()[1][-2000:]}")
            time.sleep(0.2)
        os.killpg(process.pid, signal.SIGKILL)
    return startup


def _startup_seconds(metrics: Path) -> float | None:
    """The ``total_s`` of the start-up record in ``metrics`` once it is there."""
    if not metrics.exists():
        return None
    for line in metrics.read_text().splitlines():
        if line.endswith("}") and '"kind": "startup"' in line:
            return json.loads(line)["total_s"]
    return None


def main(argv: list[str] | None = None) -> int:
    from traincore.checkpoint import Store
    from traincore.data.loader import StagedSplit
    from traincore.data.stream import open_streamed

    args = parse_args(argv)
    args.dir.mkdir(parents=True, exist_ok=True)
    large, staging_s = staged(args.dir, args.samples, args.size)
    small, _ = staged(args.dir, args.small_samples, args.size)
    size_gb = sum(path.stat().st_size for path in large.iterdir()) / 1e9
    staging = f", staged in {staging_s:.0f} s" if staging_s else ""
    print(f"large dataset: {size_gb:.2f} GB{staging}", flush=True)
    local = {}
    for block in BLOCKS:
        evict(large)
        local[block] = loader_rate(StagedSplit(large, "train"), args.batches, block)
    print(f"loader, local disk: {local} samples/s by block_samples", flush=True)
    consumption = model_rate(args.size)
    print(f"model consumption (resnet18): {consumption:,.1f} samples/s", flush=True)
    cache_bytes = args.cache_mb << 20
    with slow_store(args.dir, args.latency_ms / 1000, args.connection_mb_s) as store, \
            tempfile.TemporaryDirectory(prefix="bench-streaming-") as scratch:
        streamed, peak_disk = {}, 0
        for block in BLOCKS:  # a cache of its own each: the second would find the first's samples
            evict(large)
            (split,) = open_streamed(Store(f"s3://{BUCKET}/{large.name}", store.storage_options),
                                     ("train",), cache_bytes, cache_dir=Path(scratch) / f"block-{block}")
            try:
                streamed[block] = loader_rate(split, args.batches, block)
                peak_disk = max(peak_disk, split.cache.disk_bytes())
            finally:
                split.close()
        print(f"loader, streamed: {streamed} samples/s by block_samples; cache disk {peak_disk / 2**20:.0f} "
              "MiB", flush=True)
        evict(large)
        evaluation = {"local disk": eval_rate(StagedSplit(large, "val"), args.batches)}
        for name, ahead in (("streamed", True), ("streamed, one batch at a time", False)):
            evict(large)
            (split,) = open_streamed(Store(f"s3://{BUCKET}/{large.name}", store.storage_options),
                                     ("val",), cache_bytes, cache_dir=Path(scratch) / f"eval-{ahead}")
            try:
                evaluation[name] = eval_rate(split, args.batches, ahead)
            finally:
                split.close()
        print(f"evaluation: {evaluation} samples/s", flush=True)
        ttfs = {name: time_to_first_step(store, dataset, Path(scratch))
                for name, dataset in (("small", small), ("large", large))}
    print(f"time to first step: small {ttfs['small']:.1f} s, large {ttfs['large']:.1f} s", flush=True)
    sample_mb = 3 * args.size * args.size / 1e6
    rows = [row for block in BLOCKS for row in (
        {"case": f"loader, local disk, block_samples {block}", "samples_per_s": local[block],
         "mb_per_s": local[block] * sample_mb},
        {"case": f"loader, streamed, block_samples {block}", "samples_per_s": streamed[block],
         "mb_per_s": streamed[block] * sample_mb, "disk_mib": peak_disk / 2**20,
         "limit_mib": cache_bytes / 2**20})]
    rows += [{"case": "model consumption (resnet18, CPU)", "samples_per_s": consumption},
            {"case": f"time to first step, {small.name} streamed", "seconds": ttfs["small"]},
            {"case": f"time to first step, {large.name} streamed ({size_gb:.1f} GB)",
             "seconds": ttfs["large"]}]
    rows += [{"case": f"evaluation, {name}", "samples_per_s": rate, "mb_per_s": rate * sample_mb}
             for name, rate in evaluation.items()]
    ratios = {**{f"streamed over local loader samples/s, block_samples {block}":
                 streamed[block] / local[block] for block in BLOCKS},
              "streamed loader over model samples/s": streamed[1] / consumption,
              "time to first step, large over small": ttfs["large"] / ttfs["small"],
              "cache peak disk over its limit": peak_disk / cache_bytes,
              "streamed evaluation, fetched ahead over one batch at a time":
                  evaluation["streamed"] / evaluation["streamed, one batch at a time"]}
    print(markdown_table(rows) + "\n")
    print(markdown_table([{"ratio": name, "value": value, "target": TARGETS[name]}
                          for name, value in ratios.items()]), flush=True)
    write_results(args.json, "streaming", rows, ratios, TARGETS)
    return 0


if __name__ == "__main__":
    sys.exit(main())
