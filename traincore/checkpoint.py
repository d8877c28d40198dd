"""Checkpoints: save and resume the whole training state in one of three modes.

``sync`` writes one ``state.pt`` from rank 0 (torch.save of the full state); ``dcp`` and ``async`` write a
torch.distributed.checkpoint directory, every rank its own part. The layout, the commit marker and the
checksums are in :mod:`traincore.checkpoint_files`. Every rank checksums the files it writes while writing
them; rank 0 gathers the checksums and writes the marker last, once every rank's writes are done.

Resume takes the latest complete checkpoint. If ``verify_on_load`` finds one of its files corrupt (checksum
mismatch or truncated), a warning names the file and loading FALLS BACK to the previous complete
checkpoint, so one bad write costs ``every`` steps rather than the run. A corrupt step that was asked for
by number is an error.

``async`` copies the state into staging buffers (pinned memory on CUDA), returns, and writes from a
background thread over a gloo process group of its own. At most one save is in flight: the next ``save``,
``load``, ``wait`` and ``close`` first wait for the previous one, since overlapping DCP saves can hang.

RNG states are saved per rank. When the world size changed since the save they cannot be matched to
ranks, so the current RNG is kept (and logged). Model and optimizer state reshard (DCP) or are
replicated (``sync``), so every mode resumes on any world size.
"""

from __future__ import annotations

import logging
import random
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.nn.parallel import DistributedDataParallel

from traincore.checkpoint_files import (
    EXTRA_FILE,
    FORMAT_VERSION,
    STATE_FILE,
    CheckpointError,
    CorruptCheckpointError,
    complete_steps,
    load_file,
    prune,
    read_extra,
    read_marker,
    remove_step,
    saved_model,
    step_dir,
    verify_checkpoint,
    write_marker,
)
from traincore.checkpoint_writer import dcp_writer, save_file, without_zip_crc
from traincore.config import CheckpointConfig

DCP_WRITER_THREADS = 2  # two files per rank, written and checksummed in parallel (bench/checkpoint.py)

log = logging.getLogger(__name__)


@dataclass
class TrainState:
    """Everything a resumed run needs; ``model`` may be wrapped in DDP and/or torch.compile."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    loader: Any  # state_dict() -> plain dict (seed, epoch, samples consumed globally)
    step: int = 0
    meta: dict = field(default_factory=dict)  # JSON-compatible: config, classes, shape, mean, std, ...


@dataclass
class SaveStats:
    """Cost of the last committed save: seconds training was blocked, seconds until committed, bytes."""

    step: int
    mode: str
    blocking_s: float
    total_s: float
    num_bytes: int  # counted by rank 0; 0 elsewhere


def unwrap_model(model: nn.Module) -> nn.Module:
    """The module inside DistributedDataParallel / torch.compile wrappers: its parameter names are canonical."""
    while True:
        if isinstance(model, DistributedDataParallel):
            model = model.module
        elif isinstance(getattr(model, "_orig_mod", None), nn.Module):
            model = model._orig_mod
        else:
            return model


def _check_model(directory: Path, saved: dict[str, torch.Tensor], current: dict[str, Any], extra: dict):
    for name in [*current, *(n for n in saved if n not in current)]:
        saved_shape = list(saved[name].shape) if name in saved else "absent"
        current_shape = list(current[name].shape) if name in current else "absent"
        if saved_shape != current_shape:
            written_for = extra.get("meta", {}).get("config", {}).get("model", "an unrecorded model config")
            raise CheckpointError(
                f"checkpoint {directory} does not fit this model: parameter {name!r} has shape {saved_shape} "
                f"in the checkpoint and {current_shape} in the model. The checkpoint was written for model "
                f"config {written_for}: build that model, or train into a fresh checkpoint root")


# ---- RNG -----------------------------------------------------------------------------------------

def _rng_state() -> dict:
    kind, keys, *rest = np.random.get_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    return {"python": random.getstate(), "numpy": [kind, keys.tolist(), *rest], "torch": torch.get_rng_state(),
            "cuda": cuda}


def _set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    kind, keys, *rest = state["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), *rest))
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(state["cuda"])


# ---- the checkpointer ----------------------------------------------------------------------------

class Checkpointer:
    """Saves and restores a TrainState under ``root``; every rank constructs it and calls each method."""

    def __init__(self, root: str | Path, cfg: CheckpointConfig, rank: int = 0, world_size: int = 1):
        self.root = Path(root)
        self.cfg = cfg
        self.rank = rank
        self.world_size = world_size
        self.last_save: SaveStats | None = None
        self._group = self._new_group()
        self._pending: Future | None = None
        self._stager = self._executor = None
        if cfg.mode == "async":
            on_cuda = torch.cuda.is_available()
            # Blocking staging into buffers reused across saves: training must not change the state
            # while it is copied, and pinned buffers make the device-to-host copy fast.
            self._stager = DefaultStager(StagingOptions(use_pinned_memory=on_cuda, use_shared_memory=False,
                                                        use_async_staging=False, use_non_blocking_copy=on_cuda))
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-commit")

    def _new_group(self) -> dist.ProcessGroup | None:
        if not dist.is_initialized():
            if self.world_size != 1:
                raise CheckpointError(f"world_size={self.world_size} needs an initialised process group: "
                                      "call torch.distributed.init_process_group first")
            return None
        if (dist.get_rank(), dist.get_world_size()) != (self.rank, self.world_size):
            raise CheckpointError(f"rank={self.rank}, world_size={self.world_size} disagree with the process "
                                  f"group ({dist.get_rank()}, {dist.get_world_size()}): pass the group's values")
        # A gloo group of our own: checkpoint collectives never queue behind the training backend's (nor
        # hit its lowered timeout during a long save), and async saves get the CPU backend they need.
        return dist.new_group(backend="gloo", timeout=timedelta(minutes=30))

    def _barrier(self) -> None:
        if self._group is not None:
            dist.barrier(group=self._group)

    def _broadcast(self, obj: Any) -> Any:
        if self._group is None:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self._group)
        return box[0]

    def _gather(self, obj: Any) -> list | None:
        if self._group is None:
            return [obj]
        out = [None] * self.world_size if self.rank == 0 else None
        dist.gather_object(obj, out, dst=0, group=self._group)
        return out

    def save(self, state: TrainState) -> None:
        """Write ``<root>/step-{step:06d}/``; returns once training may go on (async: after staging)."""
        start = time.perf_counter()
        self.wait()
        directory = step_dir(self.root, state.step)
        model_sd, optim_sd = get_state_dict(unwrap_model(state.model), state.optimizer)
        extra = {"format_version": FORMAT_VERSION, "step": state.step, "meta": state.meta,
                 "loader": state.loader.state_dict(), "scheduler": state.scheduler.state_dict(),
                 "param_groups": optim_sd["param_groups"], "rng": self._gather(_rng_state())}
        if self.rank == 0:
            remove_step(directory)  # a torn (or superseded) leftover of the same step
            directory.mkdir(parents=True)
        self._barrier()  # no rank writes before the leftover is gone
        upload, checksums = self._write(directory, {"model": model_sd, "optim": optim_sd["state"]}, extra)
        blocking = time.perf_counter() - start
        log.info("checkpoint step=%d mode=%s blocking=%.3fs", state.step, self.cfg.mode, blocking)
        if upload is None:
            self._commit(directory, state.step, start, blocking, checksums)
            self._barrier()  # no rank goes on (or reads it) before the marker exists
        else:
            self._pending = self._executor.submit(self._commit, directory, state.step, start, blocking, checksums,
                                                  upload)

    def _write(self, directory: Path, tensors: dict, extra: dict) -> tuple[Future | None, dict[str, dict]]:
        """Write this rank's part; returns the async upload (or None) and the checksums of this rank's files.

        DCP's writer threads add a file's checksum when they close it: the dict is complete once the
        upload is.
        """
        if self.cfg.mode == "sync":
            if self.rank != 0:
                return None, {}
            return None, {STATE_FILE: save_file({**tensors, "extra": extra}, directory / STATE_FILE)}
        checksums = {EXTRA_FILE: save_file(extra, directory / EXTRA_FILE)} if self.rank == 0 else {}
        writer = dcp_writer(directory, DCP_WRITER_THREADS, checksums)
        kwargs = {"storage_writer": writer, "process_group": self._group, "no_dist": self._group is None}
        if self.cfg.mode == "async":
            return dcp.async_save(tensors, async_stager=self._stager, **kwargs), checksums
        with without_zip_crc():
            dcp.save(tensors, **kwargs)
        return None, checksums

    def _commit(self, directory: Path, step: int, start: float, blocking: float, checksums: dict[str, dict],
                upload: Future | None = None) -> None:
        """Every rank: finish writing and hand its checksums to rank 0, which writes the marker and prunes."""
        if upload is not None:
            upload.result()  # every rank's data and DCP's .metadata are written
        gathered = self._gather(checksums)
        num_bytes = 0
        if self.rank == 0:
            every_rank = {name: entry for part in gathered for name, entry in part.items()}
            num_bytes = write_marker(directory, step, self.cfg.mode, self.world_size, every_rank)
            prune(self.root, self.cfg.keep_last)
        self.last_save = SaveStats(step, self.cfg.mode, blocking, time.perf_counter() - start, num_bytes)
        if self.rank == 0:
            log.info("checkpoint step=%d committed: %.3f GB in %.2fs", step, num_bytes / 1e9,
                     self.last_save.total_s)

    def wait(self) -> None:
        """Block until an in-flight async save is complete and committed."""
        if self._pending is None:
            return
        pending, self._pending = self._pending, None
        pending.result()
        self._barrier()  # rank 0's marker exists before any rank goes on

    def close(self) -> None:
        """Wait for an in-flight save, then release the stager, the commit thread and the process group."""
        try:
            self.wait()
        finally:
            if self._executor is not None:
                self._executor.shutdown()
                self._stager.close()
                self._executor = self._stager = None
            if self._group is not None:
                dist.destroy_process_group(self._group)
                self._group = None

    def load(self, state: TrainState, step: int | None = None) -> int | None:
        """Restore ``state`` in place from ``step`` (default: the latest complete one); None if none exists."""
        self.wait()
        chosen, error = self._broadcast(self._choose(step) if self.rank == 0 else None)
        if error:
            raise CheckpointError(error)
        if chosen is None:
            return None
        directory = step_dir(self.root, chosen)
        marker = read_marker(directory)
        extra = read_extra(directory, marker)
        model = unwrap_model(state.model)
        model_sd, optim_sd = get_state_dict(model, state.optimizer)
        _check_model(directory, saved_model(directory, marker), model_sd, extra)
        tensors = self._read_tensors(directory, marker, {"model": model_sd, "optim": optim_sd["state"]})
        set_state_dict(model, state.optimizer, model_state_dict=tensors["model"],
                       optim_state_dict={"state": tensors["optim"], "param_groups": extra["param_groups"]})
        state.scheduler.load_state_dict(extra["scheduler"])
        state.loader.load_state_dict(extra["loader"])
        state.step = extra["step"]
        if len(extra["rng"]) == self.world_size:
            _set_rng_state(extra["rng"][self.rank])
        else:
            log.info("checkpoint was written by %d ranks, this run has %d: per-rank RNG states cannot be "
                     "matched to ranks, keeping the current RNG", len(extra["rng"]), self.world_size)
        log.info("resumed from %s (step %d, mode %s)", directory, state.step, marker["mode"])
        return state.step

    def _read_tensors(self, directory: Path, marker: dict, template: dict) -> dict:
        if marker["format"] == "torch_save":
            saved = load_file(directory / STATE_FILE)
            return {"model": saved["model"], "optim": saved["optim"]}
        dcp.load(template, checkpoint_id=directory, process_group=self._group, no_dist=self._group is None)
        return template

    def _choose(self, step: int | None) -> tuple[int | None, str | None]:
        """Rank 0: the step to load (None: nothing to resume), or the error every rank raises."""
        try:
            return self._pick(step), None
        except (CheckpointError, OSError) as exc:  # raised on every rank, so no rank waits forever
            return None, str(exc)

    def _pick(self, step: int | None) -> int | None:
        complete = complete_steps(self.root)
        if step is not None:
            if step not in complete:
                raise CheckpointError(f"no complete checkpoint for step {step} under {self.root}; complete "
                                      f"steps: {complete or 'none'}")
            self._verify(step)
            return step
        for candidate in reversed(complete):
            try:
                self._verify(candidate)
                return candidate
            except CorruptCheckpointError as exc:
                log.warning("%s; falling back to the previous complete checkpoint", exc)
        if complete:
            raise CheckpointError(f"every complete checkpoint under {self.root} is corrupt (steps {complete}): "
                                  "restore them from a backup, or set checkpoint.resume='none'")
        return None

    def _verify(self, step: int) -> None:
        if self.cfg.verify_on_load:
            verify_checkpoint(step_dir(self.root, step))
        else:
            read_marker(step_dir(self.root, step))
