"""Checkpointing sharded (FSDP2) state: naive, distributed and asynchronous saves; and FSDP against DDP.

Two gloo ranks on the CPU (spawned processes, one torch thread each; ``--start-method fork`` forks them from
this process instead, sparing each rank its imports, which are most of a smoke run's time) train a stack of
wide nn.Linear blocks (``--params``, default 100M: 1.21 GB of fp32 parameters and AdamW moments) sharded by
our ``traincore.run.dist.parallelize`` with parallelism fsdp, one FSDP unit per block. After one optimizer
step (so the optimizer state exists), the run's Checkpointer saves the state registry (``training_registry``)
``--repeats`` times per mode:

  naive (sync)          the whole state gathered onto rank 0 (full_state_dict), which writes state.pt alone
  dcp                   every rank writes its own shards (torch's FileSystemWriter, then checksummed)
  async                 dcp.async_save with our SnapshotStager, the copy overlapping the next forward/backward
and, on the same state, two rows of torch's own pieces with nothing of ours (no checksums, no commit marker):
  dcp, torch writer     dcp.save with FileSystemWriter(thread_count=1, single_file_per_rank, sync_files)
  async, torch stager   dcp.async_save with DefaultStager (async staging; no pinned or shared memory, as on
                        a CPU) and the same FileSystemWriter
The async rows train between saves, enough steps to cover one write (``steps_between``), and wait for the
copy before each optimizer step as the trainer does; the blocking rows save back to back.

Columns (rank 0's; times are medians over the saves after the first, which is shown apart since it
allocates buffers): ``blocks_s`` seconds save() blocks training; ``snapshot_wait_s`` (async) seconds the next
step then waits for the snapshot copy before its optimizer step; ``next_step_s`` (async) seconds of that
whole step, which runs beside the copy (a plain step's time is printed below the table); ``committed_s``
seconds from save() to a complete checkpoint (our commit marker; torch's rows: DCP's ``.metadata``);
``rank*_rss_*`` resident memory sampled every 5 ms from before the mode's first save until its last is
committed (the async rows' window holds their training steps too), as the peak and the peak's increase
over the RSS before the first save, so buffers kept from save to save count (our writer's blocks, kept
for the process's life, in the first row that allocates them); ``rank*_written_mb`` the bytes
of the files each rank wrote (DCP's ``__<rank>_*.distcp`` to that rank; state.pt, extra.pt, .metadata and
commit.json to rank 0); ``gathered_to_rank0_mb`` what a naive save must move to rank 0: the full state minus
rank 0's own shards (torch's full_state_dict gathers with all-gathers, so the other rank receives as much
and drops it). The ``*_vs_naive`` columns are against the naive row of the same run; ``stall`` is
``blocks_s`` plus ``snapshot_wait_s``.

The second table trains the same model under ddp and under fsdp, in fresh processes each: the median step
(forward, backward, AdamW, gradients freed as the trainer frees them) over ``--steps`` steps after two
warm-up steps, the bytes of parameters and optimizer state each rank holds (DTensor.to_local() under fsdp),
and each process's peak RSS (ru_maxrss); the ``*_vs_ddp`` columns are against the ddp row.

The disk's fsync'd sequential write rate is measured with dd (through the page cache and with direct I/O)
before and after the saves, for the state's size.

    python bench/sharded.py [--params 100M] [--width 4096] [--repeats 3] [--steps 6] [--dir DIR]
                            [--start-method spawn] [--json PATH]

``--json`` writes {"benchmark": "sharded", "results": [one row per mode], "tables": {"fsdp vs ddp": [rows]},
"ratios": {...}, "notes": [...]} for bench/run.py.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from a source checkout

from bench.checkpoint import CountingLoader, parse_count  # noqa: E402
from bench.tables import markdown_table, scratch_directory  # noqa: E402
from traincore.checkpoint import Checkpointer  # noqa: E402
from traincore.checkpoint.dcp import WRITER_THREADS  # noqa: E402  (torch's rows write with as many threads)
from traincore.checkpoint.format import split_tensors  # noqa: E402
from traincore.config.schema import CheckpointConfig, DistConfig  # noqa: E402
from traincore.run.dist import DistContext, parallelize  # noqa: E402
from traincore.run.state import Progress, training_registry  # noqa: E402

WORLD = 2
BATCH = 8
WARMUP_STEPS = 2  # untimed steps before the step table's: the first allocates the optimizer state
MAX_STEPS_BETWEEN = 12  # async: at most this many training steps to cover one write
RSS_INTERVAL_S = 0.005
PAGE = os.sysconf("SC_PAGE_SIZE")
DISTCP = re.compile(r"^__(\d+)_\d+\.distcp$")  # DCP's data files: __<rank>_<n>.distcp
MB, GIB = 1e6, 2**30
# Row name -> how it saves; the first is the baseline of every ratio.
MODES = {"naive (sync)": "sync", "dcp": "dcp", "async": "async", "dcp, torch writer": "torch-dcp",
         "async, torch stager": "torch-async"}


# ---- the model and its training state --------------------------------------------------------------

class WideStack(nn.Module):
    """Square nn.Linear blocks with ReLU between them; ``units`` are the blocks FSDP shards one by one."""

    def __init__(self, width: int, blocks: int):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(width, width) for _ in range(blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.relu(block(x))
        return x

    def units(self) -> list[nn.Module]:
        return list(self.blocks)


def blocks_for(params: int, width: int) -> int:
    """Blocks of ``width`` that make at least ``params`` parameters (at least two, so there is a stack)."""
    return max(2, math.ceil(params / (width * width + width)))


class Run:
    """The model under ``parallelism`` with AdamW, registered in a StateRegistry as the trainer does."""

    def __init__(self, params: int, width: int, parallelism: str, rank: int, keep_grads: bool = False):
        torch.manual_seed(0)  # the same initial weights on every rank, as build_model's seeded init gives
        self.width, self.keep_grads = width, keep_grads
        ctx = DistContext(rank=rank, world_size=WORLD, local_rank=rank)
        stack = WideStack(width, blocks_for(params, width))
        self.model = parallelize(stack, stack.units(), DistConfig(parallelism=parallelism), ctx)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4, foreach=True)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda step: 1.0)
        self.loader, self.progress = CountingLoader(), Progress()
        self.registry = training_registry(self.model, self.optimizer, self.scheduler, self.loader,
                                          self.progress, meta={})
        torch.manual_seed(1 + rank)  # each rank its own batches, as a sampler gives

    def train(self, steps: int, before_update: Callable[[], Any] | None = None) -> float:
        """``steps`` training steps; ``before_update`` runs before each optimizer step, as the trainer's
        wait_for_snapshot does. Returns the seconds spent in it."""
        waited = 0.0
        for _ in range(steps):
            loss = self.model(torch.randn(BATCH, self.width)).square().mean()
            loss.backward()
            if before_update is not None:
                start = time.perf_counter()
                before_update()
                waited += time.perf_counter() - start
            self.optimizer.step()
            # keep_grads: gradients stay allocated, so a step does not page in fresh memory (slow on a VM
            # whose host backs it lazily) and the RSS between steps is the same before every save
            self.optimizer.zero_grad(set_to_none=not self.keep_grads)
            self.scheduler.step()
            self.loader.consumed += BATCH
            self.progress.step += 1
        return waited

    def state_tensors(self) -> list[torch.Tensor]:
        """Parameters and optimizer tensors as this rank holds them (DTensors under fsdp)."""
        tensors = [*self.model.parameters(),
                   *(t for s in self.optimizer.state.values() for t in s.values())]
        return [t for t in tensors if torch.is_tensor(t)]

    def state_bytes(self) -> tuple[int, int]:
        """(bytes this rank holds, bytes of the whole state) of parameters and optimizer state."""
        local = whole = 0
        for tensor in self.state_tensors():
            held = tensor.to_local() if hasattr(tensor, "to_local") else tensor
            local += held.numel() * held.element_size()
            whole += tensor.numel() * tensor.element_size()  # a DTensor's numel is the global one
        return local, whole


# ---- measuring -------------------------------------------------------------------------------------

def rss_bytes() -> int:
    """This process's resident memory now."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * PAGE


class RssPeak:
    """The peak resident memory of this process while the block runs, sampled by a thread."""

    def __enter__(self) -> RssPeak:
        self.before = self.peak = rss_bytes()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="rss-sampler", daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(RSS_INTERVAL_S):
            self.peak = max(self.peak, rss_bytes())

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_bytes())


def bytes_by_rank(directory: Path) -> list[int]:
    """Bytes of the files under ``directory`` by the rank that wrote them: DCP's data files name their
    rank; every other file (state.pt, extra.pt, .metadata, commit.json) is rank 0's."""
    written = [0] * WORLD
    for path in directory.rglob("*"):
        if path.is_file():
            match = DISTCP.match(path.name)
            written[int(match.group(1)) if match else 0] += path.stat().st_size
    return written


def agree_max(value: int) -> int:
    """The largest of every rank's ``value``: both ranks must take the same number of steps."""
    box = torch.tensor([value])
    dist.all_reduce(box, op=dist.ReduceOp.MAX)
    return int(box.item())


def torch_writer(path: Path) -> Any:
    """torch's own DCP writer with our writer's thread count, one file per rank per thread, fsync on."""
    from torch.distributed.checkpoint import FileSystemWriter

    return FileSystemWriter(path, thread_count=WRITER_THREADS, single_file_per_rank=True, sync_files=True)


def after_save(run: Run, steps: int, wait: Callable[[], Any] | None) -> tuple[float | None, float]:
    """Train ``steps`` steps after a save (async: they overlap its copy and write); (seconds of the first
    step, the copy's wait in it included, or None without steps; seconds waited for the copy)."""
    if steps == 0:
        # The blocking modes need no training between saves (nothing of theirs runs on afterwards): the next
        # save writes the same tensors as the next step, under a new step number.
        run.progress.step += 1
        return None, 0.0
    start = time.perf_counter()
    waited = run.train(1, wait)
    first = time.perf_counter() - start
    return first, waited + run.train(steps - 1, wait)


def save_ours(run: Run, mode: str, directory: Path, repeats: int, steps_between: int, rank: int) -> dict:
    """``repeats`` saves through our Checkpointer in ``mode``, training between them."""
    cfg = CheckpointConfig(mode=mode, keep_last=1)
    checkpointer = Checkpointer(directory, cfg, run.registry, rank, WORLD)
    blocks, next_steps, waits, committed = [], [], [], {}
    dist.barrier()
    with RssPeak() as rss:
        for _ in range(repeats):
            start = time.perf_counter()
            checkpointer.save(run.progress.step)  # async: commits the previous save first
            blocks.append(time.perf_counter() - start)
            if checkpointer.last_save is not None:
                committed[checkpointer.last_save.step] = checkpointer.last_save.total_s
            next_step, waited = after_save(run, steps_between, checkpointer.wait_for_snapshot)
            next_steps.append(next_step)
            waits.append(waited)
        checkpointer.close()
    committed[checkpointer.last_save.step] = checkpointer.last_save.total_s
    return {"blocks": blocks, "next_steps": next_steps, "waits": waits, "committed": list(committed.values()),
            "rss": rss}


def save_torch(run: Run, asynchronous: bool, directory: Path, repeats: int, steps_between: int,
               group: dist.ProcessGroup) -> dict:
    """``repeats`` saves of the same tensors with torch's FileSystemWriter (and DefaultStager), training
    between them; at most one async save in flight, as ours."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    stager = DefaultStager(StagingOptions(use_pinned_memory=False, use_shared_memory=False,
                                          use_async_staging=True, use_non_blocking_copy=False)) \
        if asynchronous else None
    blocks, next_steps, waits, committed, pending = [], [], [], [], None
    dist.barrier()
    with RssPeak() as rss:
        for index in range(repeats):
            start = time.perf_counter()
            if pending is not None:
                pending.result()
            tensors, _ = split_tensors(run.registry.shared_state())
            path = directory / f"save-{index}"
            if stager is None:
                dcp.save(tensors, storage_writer=torch_writer(path), process_group=group)
                committed.append(time.perf_counter() - start)
                snapshot = None
            else:
                response = dcp.async_save(tensors, storage_writer=torch_writer(path), process_group=group,
                                          async_stager=stager)
                pending, snapshot = response.upload_completion, response.staging_completion
                pending.add_done_callback(lambda _, t=start: committed.append(time.perf_counter() - t))
            blocks.append(time.perf_counter() - start)
            next_step, waited = after_save(run, steps_between, snapshot.result if snapshot else None)
            next_steps.append(next_step)
            waits.append(waited)
        if pending is not None:
            pending.result()
        if stager is not None:
            stager.close()
    return {"blocks": blocks, "next_steps": next_steps, "waits": waits, "committed": committed, "rss": rss}


def checkpoint_phase(rank: int, opts: dict) -> dict:
    """Every mode's saves of the fsdp state, on this rank."""
    run = Run(opts["params"], opts["width"], "fsdp", rank, keep_grads=True)
    run.train(1)  # allocates gradients and the optimizer state
    local, whole = run.state_bytes()
    start = time.perf_counter()
    with RssPeak() as training:  # the floor under the async rows' RSS: what a training step alone adds
        run.train(1)
    step_s = time.perf_counter() - start
    root = Path(opts["dir"])
    group = dist.new_group(backend="gloo")  # DCP's async save with FSDP2 needs a group of its own
    result = {"local_bytes": local, "whole_bytes": whole, "step_s": step_s,
              "training_rss_increase": training.peak - training.before, "modes": {}}
    for name, mode in MODES.items():
        steps_between = 0
        if mode in ("async", "torch-async"):
            # enough steps to hide one write, which runs slower while it shares the cores with training
            dcp_s = statistics.median(result["modes"]["dcp"]["committed"])
            steps_between = agree_max(min(MAX_STEPS_BETWEEN, max(1, math.ceil(1.5 * dcp_s / step_s))))
        directory = root / mode
        if mode.startswith("torch-"):
            measured = save_torch(run, mode == "torch-async", directory, opts["repeats"], steps_between,
                                  group)
        else:
            measured = save_ours(run, mode, directory, opts["repeats"], steps_between, rank)
        rss = measured.pop("rss")
        dist.barrier()  # every rank's files are closed
        written = None
        if rank == 0:
            # ours keep the last complete checkpoint; torch's rows one directory per save, all the same size
            last = sorted(p for p in directory.iterdir() if p.is_dir())[-1]
            written = bytes_by_rank(last)
            shutil.rmtree(directory)
        result["modes"][name] = {**measured, "steps_between": steps_between, "written": written,
                                 "rss_increase": rss.peak - rss.before, "rss_peak": rss.peak}
        dist.barrier()
    dist.destroy_process_group(group)
    return result


def steps_phase(rank: int, opts: dict) -> dict:
    """Step times, held state bytes and peak RSS of training under ``opts["parallelism"]``, on this rank."""
    run = Run(opts["params"], opts["width"], opts["parallelism"], rank)
    run.train(WARMUP_STEPS)
    seconds = []
    for _ in range(opts["steps"]):
        start = time.perf_counter()
        run.train(1)
        seconds.append(time.perf_counter() - start)
    local, whole = run.state_bytes()
    return {"step_s": statistics.median(seconds), "local_bytes": local, "whole_bytes": whole,
            "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}  # KiB on Linux


def _rank(rank: int, phase: Callable[[int, dict], dict], opts: dict, rendezvous: str, out: str) -> None:
    torch.set_num_threads(1)  # two ranks on two cores
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=WORLD,
                            timeout=timedelta(minutes=10))
    try:
        result = phase(rank, opts)
    finally:
        dist.destroy_process_group()
    Path(out, f"{phase.__name__}-{rank}.json").write_text(json.dumps(result))


def run_ranks(phase: Callable[[int, dict], dict], opts: dict, scratch: Path, timeout: float,
              start_method: str = "spawn") -> list[dict]:
    """Run ``phase(rank, opts)`` (a module-level function) on WORLD gloo processes, spawned or forked
    (``start_method``); every rank's result, in rank order.

    A fork is safe while the caller has run no torch op (neither this script nor bench/object_store.py
    does before): there is no intra-op thread pool to inherit, and each rank runs at one thread
    (traincore.run.launch.start_method's rule)."""
    name = phase.__name__
    rendezvous = scratch / f"rendezvous-{name}-{time.monotonic_ns()}"
    context = mp.start_processes(_rank, args=(phase, opts, str(rendezvous), str(scratch)), nprocs=WORLD,
                                 join=False, start_method=start_method)
    deadline = time.monotonic() + timeout
    while not context.join(timeout=1):  # raises when a rank failed
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            raise SystemExit(f"{WORLD} ranks of {name} did not finish within {timeout:.0f} s: "
                             "raise --timeout, or look for a hung collective")
    return [json.loads((scratch / f"{name}-{rank}.json").read_text()) for rank in range(WORLD)]


def dd_rate(directory: Path, num_bytes: int, direct: bool) -> float:
    """GB/s of an fsync'd sequential write of ``num_bytes`` (in 8 MiB blocks) by dd, timed here."""
    block = 8 << 20
    target = directory / "dd.bin"
    flags = ["oflag=direct"] if direct else []
    count = max(1, -(-num_bytes // block))
    start = time.perf_counter()
    subprocess.run(["dd", "if=/dev/zero", f"of={target}", f"bs={block}", f"count={count}", "conv=fsync",
                    "status=none", *flags], check=True)
    seconds = time.perf_counter() - start
    target.unlink()
    return count * block / seconds / 1e9


def disk_rates(directory: Path, num_bytes: int) -> dict[str, float]:
    return {"page cache": dd_rate(directory, num_bytes, direct=False),
            "direct": dd_rate(directory, num_bytes, direct=True)}


# ---- the tables ------------------------------------------------------------------------------------

def steady(values: list[float]) -> float:
    """Median without the first value (the first save allocates buffers), when there are others."""
    return statistics.median(values[1:] or values)


def checkpoint_rows(ranks: list[dict]) -> list[dict]:
    """One row per mode: rank 0's times and RSS, rank 1's RSS, bytes per rank, and ratios to naive."""
    gathered = ranks[0]["whole_bytes"] - ranks[0]["local_bytes"]
    rows = []
    for name, mode in MODES.items():
        zero, one = ranks[0]["modes"][name], ranks[1]["modes"][name]
        overlapped = zero["steps_between"] > 0
        rows.append({
            "mode": name, "saves": len(zero["blocks"]), "steps_between": zero["steps_between"],
            "first_blocks_s": zero["blocks"][0], "blocks_s": steady(zero["blocks"]),
            "snapshot_wait_s": steady(zero["waits"]) if overlapped else None,
            "next_step_s": steady(zero["next_steps"]) if overlapped else None,
            "committed_s": steady(zero["committed"]),
            "rank0_rss_increase_gib": zero["rss_increase"] / GIB,
            "rank0_rss_peak_gib": zero["rss_peak"] / GIB,
            "rank1_rss_increase_gib": one["rss_increase"] / GIB,
            "rank0_written_mb": zero["written"][0] / MB, "rank1_written_mb": zero["written"][1] / MB,
            "gathered_to_rank0_mb": gathered / MB if mode == "sync" else 0.0})
    naive = rows[0]
    for row in rows:
        stall, naive_stall = (r["blocks_s"] + (r["snapshot_wait_s"] or 0.0) for r in (row, naive))
        row["stall_vs_naive"] = stall / naive_stall
        row["committed_vs_naive"] = row["committed_s"] / naive["committed_s"]
        row["rss_increase_vs_naive"] = row["rank0_rss_increase_gib"] / naive["rank0_rss_increase_gib"]
    return rows


def step_rows(by_parallelism: dict[str, list[dict]]) -> list[dict]:
    """One row per parallelism: rank 0's median step, each rank's held state and peak RSS, ratios to ddp."""
    rows = [{"parallelism": name, "step_s": ranks[0]["step_s"],
             "rank0_state_mb": ranks[0]["local_bytes"] / MB, "rank1_state_mb": ranks[1]["local_bytes"] / MB,
             "rank0_peak_rss_gib": ranks[0]["peak_rss"] / GIB,
             "rank1_peak_rss_gib": ranks[1]["peak_rss"] / GIB}
            for name, ranks in by_parallelism.items()]
    ddp = rows[0]
    for row in rows:
        row["step_vs_ddp"] = row["step_s"] / ddp["step_s"]
        row["state_vs_ddp"] = row["rank0_state_mb"] / ddp["rank0_state_mb"]
        row["peak_rss_vs_ddp"] = row["rank0_peak_rss_gib"] / ddp["rank0_peak_rss_gib"]
    return rows


def ratios_of(saves: list[dict], steps: list[dict], ckpt: list[dict]) -> dict[str, float]:
    """The figures the tables argue from, each against its baseline measured in the same run."""
    by_mode = {row["mode"]: row for row in saves}
    fsdp = next(row for row in steps if row["parallelism"] == "fsdp")

    def stall(mode: str) -> float:
        return by_mode[mode]["blocks_s"] + (by_mode[mode]["snapshot_wait_s"] or 0.0)
    step_s = ckpt[0]["step_s"]
    return {"dcp/naive stall": by_mode["dcp"]["stall_vs_naive"],
            "async/naive stall": by_mode["async"]["stall_vs_naive"],
            "dcp/naive committed": by_mode["dcp"]["committed_vs_naive"],
            "async/naive committed": by_mode["async"]["committed_vs_naive"],
            "dcp/naive rank-0 RSS increase": by_mode["dcp"]["rss_increase_vs_naive"],
            "ours/torch dcp committed (checksums and marker / FileSystemWriter)":
                by_mode["dcp"]["committed_s"] / by_mode["dcp, torch writer"]["committed_s"],
            "ours/torch async stall (SnapshotStager / DefaultStager)":
                stall("async") / stall("async, torch stager"),
            "async: step beside the copy / a plain step": by_mode["async"]["next_step_s"] / step_s,
            "async, torch stager: step beside the copy / a plain step":
                by_mode["async, torch stager"]["next_step_s"] / step_s,
            "fsdp/ddp step": fsdp["step_vs_ddp"],
            "fsdp/ddp rank-0 state bytes": fsdp["state_vs_ddp"],
            "fsdp/ddp rank-0 peak RSS": fsdp["peak_rss_vs_ddp"]}


TARGETS = {"fsdp/ddp rank-0 state bytes": f"about 1/{WORLD} (1/N)"}


def measure(opts: dict, scratch: Path, timeout: float, start_method: str = "spawn") -> dict:
    """Disk, the checkpoint phase, disk again, then ddp and fsdp steps; prints and returns the results."""
    blocks = blocks_for(opts["params"], opts["width"])
    params = blocks * (opts["width"] ** 2 + opts["width"])
    nbytes = 3 * 4 * params  # fp32 parameters and AdamW's two moments
    print(f"{blocks} blocks of {opts['width']}x{opts['width']}: {params / 1e6:.1f}M parameters, "
          f"{nbytes / 1e9:.2f} GB of state; {WORLD} gloo ranks on the CPU, torch {torch.__version__}; "
          f"dir {scratch}", flush=True)
    start = time.perf_counter()
    disk = [disk_rates(scratch, nbytes)]
    ckpt = run_ranks(checkpoint_phase, {**opts, "dir": str(scratch)}, scratch, timeout, start_method)
    disk.append(disk_rates(scratch, nbytes))
    print(f"checkpoint phase and disk: {time.perf_counter() - start:.0f} s", flush=True)
    steps = {}
    for name in ("ddp", "fsdp"):
        start = time.perf_counter()
        steps[name] = run_ranks(steps_phase, {**opts, "parallelism": name}, scratch, timeout, start_method)
        print(f"{name} steps: {time.perf_counter() - start:.0f} s", flush=True)
    saves, step_table = checkpoint_rows(ckpt), step_rows(steps)
    ratios = ratios_of(saves, step_table, ckpt)
    notes = [f"State: {params / 1e6:.1f}M fp32 parameters + AdamW moments = "
             f"{ckpt[0]['whole_bytes'] / 1e9:.2f} GB, "
             f"{ckpt[0]['local_bytes'] / 1e9:.2f} GB of it on rank 0 under fsdp.",
             f"A training step alone (no save, gradients kept allocated) takes {ckpt[0]['step_s']:.2f} s and "
             f"raises rank 0's RSS by {ckpt[0]['training_rss_increase'] / GIB:.3f} GiB (part of the async "
             "rows' increase, whose window holds the steps beside the write).",
             *(f"Disk, dd of {nbytes / 1e9:.2f} GB, conv=fsync, {way}: "
               f"{disk[0][way]:.2f} GB/s before the saves, {disk[1][way]:.2f} GB/s after."
               for way in disk[0])]
    print("\n" + markdown_table(saves) + "\n")
    print(markdown_table(step_table) + "\n")
    print(markdown_table([{"ratio": name, "value": value, "target": TARGETS.get(name, "(none)")}
                          for name, value in ratios.items()]) + "\n")
    print("\n".join(notes), flush=True)
    return {"benchmark": "sharded", "state_bytes": ckpt[0]["whole_bytes"], "disk_gbps": disk,
            "results": saves, "tables": {"fsdp vs ddp": step_table}, "ratios": ratios, "targets": TARGETS,
            "notes": notes}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params", type=parse_count, default=100_000_000, help="model parameters, e.g. 100M")
    parser.add_argument("--width", type=int, default=4096, help="width of each square nn.Linear block")
    parser.add_argument("--repeats", type=int, default=3, help="saves per mode (the first one shown apart)")
    parser.add_argument("--steps", type=int, default=6, help="timed training steps per parallelism")
    parser.add_argument("--dir", type=Path, default=None, help="where to write (default: runs/ or /tmp)")
    parser.add_argument("--timeout", type=float, default=1200, help="seconds one phase of two ranks may take")
    parser.add_argument("--start-method", choices=("spawn", "fork"), default="spawn",
                        help="how each phase's ranks start: fresh interpreters (spawn, as measured) or "
                             "forked from this process (fork: less start-up per rank, for smoke runs)")
    parser.add_argument("--json", type=Path, default=None, help="also write the results to this JSON file")
    args = parser.parse_args(argv)
    for name in ("width", "repeats", "steps"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} {getattr(args, name)} is invalid: it must be at least 1")
    scratch = scratch_directory("bench-sharded-", args.dir)
    opts = {"params": args.params, "width": args.width, "repeats": args.repeats, "steps": args.steps}
    try:
        results = measure(opts, scratch, args.timeout, args.start_method)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
