"""Checkpoint stall and write throughput of the sync, dcp and async modes, against the disk's own limit.

A stack of square nn.Linear layers (``--params``, default 100M) trained with AdamW gives a ~1.2 GB state.
Each mode saves ``--repeats`` times with training steps in between (for async, enough to cover one
write, so that it overlaps with compute). The state goes through the same StateRegistry the trainer builds,
and the training step calls ``wait_for_snapshot()`` before ``optimizer.step()`` as the trainer does.
Blocking seconds = training stalled inside save(); step wait = stalled in ``wait_for_snapshot()`` before
the next optimizer step (async: the copy still running); total seconds = from save() until the commit
marker exists. ``async-copy`` is async with ``checkpoint.overlap_copy=false``: the whole copy before save()
returns, as async saves did before the copy overlapped the next step.

Baselines measured in the same run: one in-memory copy of the state's tensors into buffers touched before
(what staging costs at best), and the disk limit: the faster of two fsync'd sequential writes of the same
byte count to the same directory, one through the page cache and one with direct I/O. Targets: async
blocking <= 10% of one in-memory copy (and <= 1/20 of sync); write throughput >= 50% of the disk limit. It
also prints what torch.save's own zip CRC32 costs: we keep it on, since turning it off
(torch.serialization.set_crc32_options) would change every torch.save in the process, a user's too.

Our writer against torch's: a sync checkpoint's ``state.pt`` (the full state, as rank 0 writes it) through
traincore.checkpoint.writer.save_file (CRC32 on the way to disk, direct I/O) and through what torch ships,
torch.save to the path, fsync and rename, then the CRC32 the commit marker needs read back; alternated,
three each, medians (ratio ``sync_writer_over_torch_save``).

    python bench/checkpoint.py [--params 100M] [--dir DIR] [--repeats 3] [--json PATH]

``--json`` writes {"benchmark": "checkpoint", "results": [one dict per mode], "ratios": {...}}.
"""

from __future__ import annotations

import argparse
import json
import math
import mmap
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from a source checkout

from bench.tables import scratch_directory  # noqa: E402
from traincore.checkpoint import Checkpointer  # noqa: E402
from traincore.checkpoint.commit import file_checksum  # noqa: E402
from traincore.checkpoint.layout import tmp_path  # noqa: E402
from traincore.checkpoint.writer import ChecksumWriter, save_file  # noqa: E402
from traincore.config.schema import CheckpointConfig  # noqa: E402
from traincore.files import publish  # noqa: E402
from traincore.run.state import Progress, training_registry  # noqa: E402

WIDTH = 4096
BATCH = 8
# What each row saves with; async-copy is the blocking copy async saves made before the copy overlapped.
VARIANTS = {"sync": {"mode": "sync"}, "dcp": {"mode": "dcp"},
            "async-copy": {"mode": "async", "overlap_copy": False}, "async": {"mode": "async"}}


class CountingLoader:
    """Stands in for the training loader: its state is the number of samples consumed."""

    def __init__(self) -> None:
        self.consumed = 0

    def state_dict(self) -> dict:
        return {"seed": 0, "epoch": 0, "consumed": self.consumed}

    def load_state_dict(self, state: dict) -> None:
        self.consumed = state["consumed"]


def parse_count(text: str) -> int:
    """'100M' -> 100_000_000; plain integers pass through."""
    scale = {"K": 10**3, "M": 10**6, "G": 10**9}.get(text[-1:].upper(), 1)
    try:
        return int(float(text[:-1] if scale > 1 else text) * scale)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--params {text!r} is not a count: write e.g. 100M or 50000000"
                                         ) from None


class TrainState:
    """A Linear stack with AdamW, registered in a StateRegistry as the trainer registers its parts."""

    def __init__(self, params: int):
        layers = max(1, math.ceil(params / (WIDTH * WIDTH + WIDTH)))
        self.model = nn.Sequential(*(nn.Linear(WIDTH, WIDTH) for _ in range(layers)))
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda step: 1.0)
        self.loader, self.progress = CountingLoader(), Progress()
        self.registry = training_registry(self.model, self.optimizer, self.scheduler, self.loader,
                                          self.progress, meta={})


def build_state(params: int) -> TrainState:
    """About ``params`` parameters, gradients and AdamW state already allocated."""
    state = TrainState(params)
    train(state, 2)  # the first steps allocate gradients and optimizer state
    return state


def train(state: TrainState, steps: int, checkpointer: Checkpointer | None = None) -> float:
    """``steps`` forward/backward/AdamW steps on random data; returns seconds spent waiting for a snapshot."""
    waited = 0.0
    for _ in range(steps):
        loss = state.model(torch.randn(BATCH, WIDTH)).square().mean()
        loss.backward()
        if checkpointer is not None:  # as the trainer's step does
            start = time.perf_counter()
            checkpointer.wait_for_snapshot()
            waited += time.perf_counter() - start
        state.optimizer.step()
        state.optimizer.zero_grad(set_to_none=False)  # keeps gradients allocated: no page faults per step
        state.scheduler.step()
        state.loader.consumed += BATCH
        state.progress.step += 1
    return waited


def state_tensors(state: TrainState) -> list[torch.Tensor]:
    """Model parameters and optimizer tensors: what a save copies."""
    tensors = [*state.model.parameters(), *(t for s in state.optimizer.state.values() for t in s.values())]
    return [t for t in tensors if torch.is_tensor(t)]


def copy_seconds(state: TrainState, repeats: int = 3) -> float:
    """Median seconds of one in-memory copy of the state's tensors into buffers touched before."""
    sources = state_tensors(state)
    buffers = [torch.empty_like(t) for t in sources]
    seconds = []
    for _ in range(repeats + 1):  # the first pass touches the buffers: a VM's fresh memory is slow once
        start = time.perf_counter()
        for buffer, source in zip(buffers, sources, strict=True):
            buffer.copy_(source)
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds[1:])


def state_bytes(state: TrainState) -> int:
    """Bytes of model parameters plus optimizer tensors."""
    return sum(t.numel() * t.element_size() for t in state_tensors(state))


def write_seconds(path: Path, block: mmap.mmap, num_bytes: int, direct: bool) -> float:
    """Seconds for an fsync'd sequential write of ``num_bytes`` (whole blocks for direct I/O)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if direct else 0)
    view = memoryview(block)
    start = time.perf_counter()
    fd = os.open(path, flags, 0o644)
    try:
        for offset in range(0, num_bytes, len(view)):
            size = min(len(view), num_bytes - offset)
            os.write(fd, view[: -(-size // 4096) * 4096 if direct else size])  # a view: no copy
        os.fsync(fd)
    finally:
        os.close(fd)
    seconds = time.perf_counter() - start
    path.unlink()
    return seconds


def disk_limit(directory: Path, num_bytes: int) -> dict[str, float]:
    """Seconds for an fsync'd write of ``num_bytes`` through the page cache and with direct I/O.

    Both count: on a VM the page cache may need fresh memory (slow to touch the first time), while
    direct I/O does not; the faster of the two is the disk's limit.
    """
    block = mmap.mmap(-1, 64 << 20)  # page-aligned, as direct I/O needs
    block[:] = np.random.default_rng(0).bytes(len(block))
    seconds = {"page cache": write_seconds(directory / "disk-limit.bin", block, num_bytes, direct=False)}
    if hasattr(os, "O_DIRECT"):
        seconds["direct"] = write_seconds(directory / "disk-limit.bin", block, num_bytes, direct=True)
    return seconds


def run_mode(state: TrainState, variant: str, directory: Path, repeats: int, steps_between: int) -> dict:
    """Save ``repeats`` times as ``variant``; per-save blocking, step-wait and total seconds, bytes.

    Blocking is timed around save() alone: an async save still in flight at the next save is waited
    for inside that save(), so a write slower than the training in between shows up as blocking.
    """
    cfg = CheckpointConfig(keep_last=1, **VARIANTS[variant])
    checkpointer = Checkpointer(directory / variant, cfg, state.registry)
    blocking, waits, committed = [], [], {}
    for _ in range(repeats):
        waits.append(train(state, steps_between, checkpointer))
        start = time.perf_counter()
        checkpointer.save(state.progress.step)
        blocking.append(time.perf_counter() - start)
        if checkpointer.last_save is not None:  # async: the previous save, committed inside this save()
            committed[checkpointer.last_save.step] = checkpointer.last_save
    waits.append(train(state, 1, checkpointer))  # the step after the last save waits for its copy too
    checkpointer.close()
    committed[checkpointer.last_save.step] = checkpointer.last_save
    shutil.rmtree(directory / variant)
    stats = list(committed.values())
    return {"blocking": blocking, "step_wait": waits[1:], "total": [s.total_s for s in stats],
            "bytes": stats[-1].num_bytes}


def median_total(result: dict) -> float:
    """Median seconds from save() to commit."""
    return statistics.median(result["total"])


def steady(values: list[float]) -> float:
    """Mean without the first value (the first save allocates staging buffers), when there are others."""
    return statistics.mean(values[1:] or values)


def rows(results: dict[str, dict], disk_gbps: float, copy_s: float) -> list[dict]:
    """One dict per variant: its figures and its ratios to the baselines."""
    sync_blocking = steady(results["sync"]["blocking"])
    table = []
    for variant, r in results.items():
        gbps = r["bytes"] / median_total(r) / 1e9
        table.append({"variant": variant, **VARIANTS[variant], "steps_between": r["steps"],
                      "blocking_first_s": r["blocking"][0], "blocking_steady_s": steady(r["blocking"]),
                      "step_wait_s": steady(r["step_wait"]), "total_s": median_total(r), "bytes": r["bytes"],
                      "write_gbps": gbps, "blocking_over_sync": steady(r["blocking"]) / sync_blocking,
                      "blocking_over_copy": steady(r["blocking"]) / copy_s,
                      "write_over_disk": gbps / disk_gbps})
    return table


def report(table: list[dict], copy_s: float) -> dict[str, float]:
    """Print the table and the target ratios; returns the ratios."""
    print(f"{'variant':<10} {'steps':>5} {'first blk s':>11} {'steady blk s':>12} {'step wait s':>11} "
          f"{'total s':>8} {'GB':>5} {'GB/s':>6} {'blk/sync':>9} {'blk/copy':>9} {'GB/s / disk':>12}")
    for row in table:
        print(f"{row['variant']:<10} {row['steps_between']:>5} {row['blocking_first_s']:>11.3f} "
              f"{row['blocking_steady_s']:>12.3f} {row['step_wait_s']:>11.3f} {row['total_s']:>8.2f} "
              f"{row['bytes'] / 1e9:>5.2f} {row['write_gbps']:>6.3f} {row['blocking_over_sync']:>9.3f} "
              f"{row['blocking_over_copy']:>9.3f} {row['write_over_disk']:>12.2f}")
    by_variant = {row["variant"]: row for row in table}
    ratios = {"async_blocking_over_copy": by_variant["async"]["blocking_over_copy"],
              "async_copy_blocking_over_copy": by_variant["async-copy"]["blocking_over_copy"],
              "async_blocking_over_sync": by_variant["async"]["blocking_over_sync"],
              "async_first_blocking_over_sync": by_variant["async"]["blocking_first_s"]
              / by_variant["sync"]["blocking_first_s"],
              **{f"{row['variant']}_write_over_disk": row["write_over_disk"] for row in table}}
    print(f"one in-memory copy of the state: {copy_s:.3f} s")
    for over, target in (("copy", 0.1), ("sync", 0.05)):
        ratio = ratios[f"async_blocking_over_{over}"]
        print(f"async blocking / {over}: {ratio:.3f} in steady state (target <= {target}: "
              f"{'met' if ratio <= target else 'MISSED'}); async-copy: "
              f"{by_variant['async-copy'][f'blocking_over_{over}']:.3f}")
    for row in table:
        share = row["write_over_disk"]
        print(f"{row['variant']} write throughput / disk limit: {share:.2f} (target >= 0.50: "
              f"{'met' if share >= 0.5 else 'MISSED'})")
    return ratios


def measure(directory: Path, params: int, repeats: int) -> dict:
    """Build the state, then alternate disk-limit measurements and variants; print and return the results."""
    state = build_state(params)
    nbytes = state_bytes(state)
    start = time.perf_counter()
    train(state, 2)
    step_s = (time.perf_counter() - start) / 2
    built = sum(p.numel() for p in state.model.parameters()) / 1e6
    print(f"{params / 1e6:.0f}M parameters requested, {built:.1f}M built, state {nbytes / 1e9:.2f} GB, "
          f"step {step_s:.2f} s; torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"dir {directory}")
    copy_s = copy_seconds(state)
    disk_limit(directory, nbytes)  # warm-up: a VM's first large write also pays for touching fresh memory
    # The disk's speed drifts (shared host, writeback): sample it next to every variant, use the median.
    disk, results = [], {}
    for variant, settings in VARIANTS.items():
        disk.append(disk_limit(directory, nbytes))
        # async needs training long enough to hide one write, which runs about 2x slower while it
        # shares the cores with training; the blocking modes need none.
        writes = [median_total(r) for r in results.values()] or [min(d.values()) for d in disk]
        steps = max(1, math.ceil(3 * max(writes) / step_s)) if settings["mode"] == "async" else 1
        results[variant] = {"steps": steps, **run_mode(state, variant, directory, repeats, steps)}
    disk.append(disk_limit(directory, nbytes))
    for way in disk[0]:
        print(f"disk, {way}: {nbytes / 1e9:.2f} GB fsync'd sequential write in "
              f"{', '.join(f'{d[way]:.2f}' for d in disk)} s")
    disk_gbps = nbytes / statistics.median(min(d.values()) for d in disk) / 1e9
    print(f"disk limit (median of the faster way per sample): {disk_gbps:.3f} GB/s")
    table = rows(results, disk_gbps, copy_s)
    ratios = report(table, copy_s)
    zip_crc_cost(state, directory, nbytes)
    ratios["sync_writer_over_torch_save"] = writer_against_torch_save(state, directory)
    return {"benchmark": "checkpoint", "state_bytes": nbytes, "copy_s": copy_s, "disk_gbps": disk_gbps,
            "results": table, "ratios": ratios}


def zip_crc_cost(state: TrainState, directory: Path, nbytes: int) -> None:
    """Seconds torch.save spends on its zip records' CRC32, measured by saving with it on and off.

    The switch is flipped here, in the benchmark's own process, only to measure it; the library keeps it on.
    """
    payload = state.registry.shared_state()  # what a sync save writes
    seconds = {}
    previous = torch.serialization.get_crc32_options()
    try:
        for crc in (True, False, True, False):
            torch.serialization.set_crc32_options(crc)
            start = time.perf_counter()
            with ChecksumWriter(directory / "zip-crc.pt") as writer:
                torch.save(payload, writer)
            seconds.setdefault(crc, []).append(time.perf_counter() - start)
    finally:
        torch.serialization.set_crc32_options(previous)
        (directory / "zip-crc.pt").unlink(missing_ok=True)
    on, off = min(seconds[True]), min(seconds[False])
    gb = nbytes / 1e9
    print(f"torch.save zip CRC32 (kept on): {on:.3f} s with it, {off:.3f} s without, for {gb:.2f} GB: "
          f"{(on - off) / gb:.3f} s per GB, {on / off - 1:+.0%} on a sync save")


def writer_against_torch_save(state: TrainState, directory: Path) -> float:
    """Seconds to a durable, checksummed ``state.pt`` through our writer and through torch.save; the ratio."""
    payload = {"step": 0, "shared": state.registry.shared_state(full=True), "per_rank": [{}]}
    seconds: dict[str, list[float]] = {"ours": [], "torch": []}
    path = directory / "state.pt"
    for _ in range(3):
        for way, times in seconds.items():
            start = time.perf_counter()
            if way == "ours":
                save_file(payload, path)
            else:
                torch.save(payload, tmp_path(path))
                publish(tmp_path(path), path)
                file_checksum(path)
            times.append(time.perf_counter() - start)
            path.unlink()
    ours, theirs = statistics.median(seconds["ours"]), statistics.median(seconds["torch"])
    print(f"state.pt, durable and checksummed: {ours:.2f} s through our writer, {theirs:.2f} s through "
          f"torch.save, fsync and a CRC32 read back (ours/torch {ours / theirs:.2f})")
    return ours / theirs


def main(argv: list[str] | None = None) -> None:
    """Parse arguments and run the measurement in a temporary directory."""
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params", type=parse_count, default=100_000_000, help="model parameters, e.g. 100M")
    parser.add_argument("--dir", type=Path, default=None, help="where to write (default: runs/ or /tmp)")
    parser.add_argument("--repeats", type=int, default=3, help="saves per mode")
    parser.add_argument("--json", type=Path, default=None, help="also write the results to this JSON file")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats {args.repeats} is invalid: save at least once (--repeats 1)")
    directory = scratch_directory("bench-checkpoint-", args.dir)
    try:
        results = measure(directory, args.params, args.repeats)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
