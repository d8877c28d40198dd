"""Checkpoint stall and write throughput of the sync, dcp and async modes, against the disk's own limit.

A stack of square nn.Linear layers (``--params``, default 100M) trained with AdamW gives a ~1.2 GB state.
Each mode saves ``--repeats`` times with training steps in between (for async, enough to cover one
write, so that it overlaps with compute). The state goes through the same StateRegistry the trainer builds.
Blocking seconds = training stalled inside save(); total
seconds = from save() until the commit marker exists. The disk limit is measured in the same run: the
faster of two fsync'd sequential writes of the same byte count to the same directory, one through the
page cache and one with direct I/O. Targets: async blocking <= 1/20 of sync; write throughput >= 50% of
the disk limit. It also prints what torch.save's own zip CRC32 costs: we keep it on, since turning it off
(torch.serialization.set_crc32_options) would change every torch.save in the process, a user's too.

    python bench/checkpoint.py [--params 100M] [--dir DIR] [--repeats 3]
"""

from __future__ import annotations

import argparse
import math
import mmap
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn

from traincore.checkpoint import Checkpointer
from traincore.checkpoint_writer import ChecksumWriter
from traincore.config import CHECKPOINT_MODES, CheckpointConfig
from traincore.state import Progress, training_registry

WIDTH = 4096
BATCH = 8


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


def train(state: TrainState, steps: int) -> None:
    """``steps`` forward/backward/AdamW steps on random data."""
    for _ in range(steps):
        loss = state.model(torch.randn(BATCH, WIDTH)).square().mean()
        loss.backward()
        state.optimizer.step()
        state.optimizer.zero_grad(set_to_none=False)  # keeps gradients allocated: no page faults per step
        state.scheduler.step()
        state.loader.consumed += BATCH
        state.progress.step += 1


def state_bytes(state: TrainState) -> int:
    """Bytes of model parameters plus optimizer tensors."""
    tensors = [*state.model.parameters(), *(t for s in state.optimizer.state.values() for t in s.values())]
    return sum(t.numel() * t.element_size() for t in tensors if torch.is_tensor(t))


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


def run_mode(state: TrainState, mode: str, directory: Path, repeats: int, steps_between: int) -> dict:
    """Save ``repeats`` times in ``mode``; per-save blocking and total seconds, bytes per checkpoint.

    Blocking is timed around save() alone: an async save still in flight at the next save is waited
    for inside that save(), so a write slower than the training in between shows up as blocking.
    """
    checkpointer = Checkpointer(directory / mode, CheckpointConfig(mode=mode, keep_last=1), state.registry)
    blocking, committed = [], {}
    for _ in range(repeats):
        train(state, steps_between)
        start = time.perf_counter()
        checkpointer.save(state.progress.step)
        blocking.append(time.perf_counter() - start)
        if checkpointer.last_save is not None:  # async: the previous save, committed inside this save()
            committed[checkpointer.last_save.step] = checkpointer.last_save
    checkpointer.close()
    committed[checkpointer.last_save.step] = checkpointer.last_save
    shutil.rmtree(directory / mode)
    stats = list(committed.values())
    return {"blocking": blocking, "total": [s.total_s for s in stats], "bytes": stats[-1].num_bytes}


def median_total(result: dict) -> float:
    """Median seconds from save() to commit."""
    return statistics.median(result["total"])


def steady(values: list[float]) -> float:
    """Mean without the first value (the first save allocates staging buffers), when there are others."""
    return statistics.mean(values[1:] or values)


def report(results: dict[str, dict], disk_gbps: float) -> None:
    """Print the table and the two target ratios."""
    sync_blocking = steady(results["sync"]["blocking"])
    print(f"{'mode':<6} {'steps':>5} {'first blk s':>11} {'steady blk s':>12} {'total s':>8} {'GB':>5} "
          f"{'GB/s':>6} {'blk/sync':>9} {'GB/s / disk':>12}")
    for mode, r in results.items():
        r["gbps"] = r["bytes"] / median_total(r) / 1e9
        print(f"{mode:<6} {r['steps']:>5} {r['blocking'][0]:>11.3f} {steady(r['blocking']):>12.3f} "
              f"{median_total(r):>8.2f} {r['bytes'] / 1e9:>5.2f} {r['gbps']:>6.3f} "
              f"{steady(r['blocking']) / sync_blocking:>9.3f} {r['gbps'] / disk_gbps:>12.2f}")
    ratio = steady(results["async"]["blocking"]) / sync_blocking
    first = results["async"]["blocking"][0] / results["sync"]["blocking"][0]
    print(f"async / sync blocking: steady {ratio:.3f}, first save {first:.3f} "
          f"(target <= 0.050: {'met' if ratio <= 0.05 else 'MISSED'} in steady state)")
    for mode, r in results.items():
        share = r["gbps"] / disk_gbps
        print(f"{mode} write throughput / disk limit: {share:.2f} (target >= 0.50: "
              f"{'met' if share >= 0.5 else 'MISSED'})")


def measure(directory: Path, params: int, repeats: int) -> None:
    """Build the state, then alternate disk-limit measurements and modes; print the results."""
    state = build_state(params)
    nbytes = state_bytes(state)
    start = time.perf_counter()
    train(state, 2)
    step_s = (time.perf_counter() - start) / 2
    built = sum(p.numel() for p in state.model.parameters()) / 1e6
    print(f"{params / 1e6:.0f}M parameters requested, {built:.1f}M built, state {nbytes / 1e9:.2f} GB, "
          f"step {step_s:.2f} s; torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"dir {directory}")
    disk_limit(directory, nbytes)  # warm-up: a VM's first large write also pays for touching fresh memory
    # The disk's speed drifts (shared host, writeback): sample it next to every mode, use the median.
    disk, results = [], {}
    for mode in CHECKPOINT_MODES:
        disk.append(disk_limit(directory, nbytes))
        # async needs training long enough to hide one write, which runs about 2x slower while it
        # shares the cores with training; the blocking modes need none.
        writes = [median_total(r) for r in results.values()] or [min(d.values()) for d in disk]
        steps = max(1, math.ceil(3 * max(writes) / step_s)) if mode == "async" else 1
        results[mode] = {"steps": steps, **run_mode(state, mode, directory, repeats, steps)}
    disk.append(disk_limit(directory, nbytes))
    for way in disk[0]:
        print(f"disk, {way}: {nbytes / 1e9:.2f} GB fsync'd sequential write in "
              f"{', '.join(f'{d[way]:.2f}' for d in disk)} s")
    disk_gbps = nbytes / statistics.median(min(d.values()) for d in disk) / 1e9
    print(f"disk limit (median of the faster way per sample): {disk_gbps:.3f} GB/s")
    report(results, disk_gbps)
    zip_crc_cost(state, directory, nbytes)


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


def main(argv: list[str] | None = None) -> None:
    """Parse arguments and run the measurement in a temporary directory."""
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params", type=parse_count, default=100_000_000, help="model parameters, e.g. 100M")
    parser.add_argument("--dir", type=Path, default=None, help="where to write (default: runs/ or /tmp)")
    parser.add_argument("--repeats", type=int, default=3, help="saves per mode")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats {args.repeats} is invalid: save at least once (--repeats 1)")
    runs = Path(__file__).resolve().parents[1] / "runs"
    parent = args.dir or (runs if runs.is_dir() else None)
    if parent is not None:
        parent.mkdir(parents=True, exist_ok=True)
    directory = Path(tempfile.mkdtemp(prefix="bench-checkpoint-", dir=parent))
    try:
        measure(directory, args.params, args.repeats)
    finally:
        shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    main()
