"""Checkpoints: save and resume a run's state registry in one of three modes.

The checkpointer is handed a :class:`~traincore.state.StateRegistry` and never looks inside its members:
it saves the registry's shared state and gathers every rank's per-rank state. ``sync`` writes one
``state.pt`` from rank 0; ``dcp`` and ``async`` write a torch.distributed.checkpoint directory, every rank
its own part. The layout, the commit marker and the checksums are :mod:`traincore.checkpoint_files`; what the
files hold is :mod:`traincore.checkpoint_format`. Every rank checksums the files it writes while writing
them; rank 0 gathers the checksums and writes the marker last, once every rank's writes are done.

Resume takes the latest complete checkpoint. If ``verify_on_load`` finds one of its files corrupt (checksum
mismatch or truncated, or a damaged commit marker), a warning names the file and loading FALLS BACK to the
previous complete checkpoint, so one bad write costs ``every`` steps rather than the run. A corrupt step
that was asked for by number is an error, and so is a commit.json of another program or format (refused,
never skipped) and a file that passes verification but cannot be read; each message names the file.

A save that fails (a full disk: "no space left on device while writing <path>") raises CheckpointWriteError,
a CheckpointError and an OSError; rank 0 deletes the torn directory, and the committed ones stay as they are.

``async`` copies the state into staging buffers (pinned memory on CUDA), returns, and writes from a
background thread over a gloo process group of its own. At most one save is in flight: the next ``save``,
``load``, ``wait`` and ``close`` first wait for the previous one, since overlapping DCP saves can hang.

Per-rank state (RNG streams) cannot be matched to ranks when the world size changed since the save; it is
then kept as it is (and logged). Shared state reshards (DCP) or is replicated (``sync``), so every mode
resumes on any world size.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

from traincore.checkpoint_files import (
    EXTRA_FILE,
    STATE_FILE,
    CheckpointError,
    CorruptCheckpointError,
    complete_steps,
    prune,
    read_marker,
    remove_step,
    step_dir,
    verify_checkpoint,
    write_marker,
)
from traincore.checkpoint_format import (
    flat_shapes,
    load_tensors,
    open_saved,
    single_process_quiet,
    split_tensors,
)
from traincore.checkpoint_writer import ChecksumFileSystemWriter, failing_save, save_file
from traincore.config import CheckpointConfig
from traincore.state import StateMismatchError, StateRegistry

DCP_WRITER_THREADS = 2  # two files per rank, written and checksummed in parallel (bench/checkpoint.py)
# Creating the checkpoint group: every rank left the process-group barrier and DDP's parameter broadcast
# moments before, and only telemetry set-up lies between (W&B's own init gives up after 90 s), so a rank
# missing for 2 minutes is hung or dead; the 30-minute allowance below would make that a 30-minute hang.
GROUP_START_TIMEOUT = timedelta(minutes=2)
# Every later checkpoint collective: the longest is a barrier while the slowest rank writes its part (sync:
# rank 0 writes everything; resume: rank 0 checksums it all). ~100 GB of training state at the slowest
# fsync'd rate measured on our machines (0.2 GB/s) is ~8 minutes; 30 leaves room for slower shared storage.
SAVE_TIMEOUT = timedelta(minutes=30)

log = logging.getLogger(__name__)


@dataclass
class SaveStats:
    """Cost of the last committed save: seconds training was blocked, seconds until committed, bytes."""

    step: int
    mode: str
    blocking_s: float
    total_s: float
    num_bytes: int  # counted by rank 0; 0 elsewhere


class Checkpointer:
    """Saves and restores a StateRegistry under ``root``; every rank constructs it and calls each method."""

    def __init__(self, root: str | Path, cfg: CheckpointConfig, registry: StateRegistry, rank: int = 0,
                 world_size: int = 1):
        self.root, self.cfg, self.registry = Path(root), cfg, registry
        self.rank, self.world_size = rank, world_size
        self.last_save: SaveStats | None = None
        self._group = self._new_group()
        self._pending: Future | None = None
        self._stager = self._executor = None
        if cfg.mode == "async":
            on_cuda = torch.cuda.is_available()
            # Blocking staging into buffers reused across saves: training must not change the state
            # while it is copied, and pinned buffers make the device-to-host copy fast.
            self._stager = DefaultStager(StagingOptions(use_pinned_memory=on_cuda, use_shared_memory=False,
                                                        use_async_staging=False,
                                                        use_non_blocking_copy=on_cuda))
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-commit")

    def _new_group(self) -> dist.ProcessGroup | None:
        if not dist.is_initialized():
            if self.world_size != 1:
                raise CheckpointError(f"world_size={self.world_size} needs an initialised process group: "
                                      "call torch.distributed.init_process_group first")
            return None
        if (dist.get_rank(), dist.get_world_size()) != (self.rank, self.world_size):
            raise CheckpointError(f"rank={self.rank}, world_size={self.world_size} disagree with the process "
                                  f"group ({dist.get_rank()}, {dist.get_world_size()}): pass the group's "
                                  "values")
        # A gloo group of our own: checkpoint collectives never queue behind the training backend's (nor
        # hit its lowered timeout during a long save), and async saves get the CPU backend they need.
        # Its creation waits for every rank: bounded by GROUP_START_TIMEOUT, not by the saves' allowance.
        group = dist.new_group(backend="gloo", timeout=GROUP_START_TIMEOUT)
        dist.set_timeout(SAVE_TIMEOUT, group=group)
        return group

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

    def maybe_save(self, step: int, last_step: bool) -> None:
        """Save at every ``cfg.every``-th step and at the last one: the one place this rule lives."""
        if (self.cfg.every and step % self.cfg.every == 0) or last_step:
            self.save(step)

    def save(self, step: int) -> None:
        """Write ``<root>/step-{step:06d}/``; returns once training may go on (async: after staging)."""
        start = time.perf_counter()
        self.wait()
        directory = step_dir(self.root, step)
        shared, per_rank = self.registry.shared_state(), self._gather(self.registry.rank_state())
        if self.rank == 0:
            remove_step(directory)  # a torn (or superseded) leftover of the same step
            directory.mkdir(parents=True)
        self._barrier()  # no rank writes before the leftover is gone
        with failing_save(directory, discard=self.rank == 0):  # e.g. a full disk: the error names the file
            upload, checksums = self._write(directory, step, shared, per_rank)
        blocking = time.perf_counter() - start
        log.info("checkpoint step=%d mode=%s blocking=%.3fs", step, self.cfg.mode, blocking)
        if upload is None:
            self._commit(directory, step, start, blocking, checksums)
            self._barrier()  # no rank goes on (or reads it) before the marker exists
        else:
            self._pending = self._executor.submit(self._commit, directory, step, start, blocking, checksums,
                                                  upload)

    def _write(self, directory: Path, step: int, shared: dict, per_rank: list | None
               ) -> tuple[Future | None, dict[str, dict]]:
        """Write this rank's part; returns the async upload (or None) and the checksums of this rank's files.

        DCP's writer threads add a file's checksum when they close it: the dict is complete once the
        upload is.
        """
        if self.cfg.mode == "sync":
            if self.rank != 0:
                return None, {}
            payload = {"step": step, "shared": shared, "per_rank": per_rank}
            return None, {STATE_FILE: save_file(payload, directory / STATE_FILE)}
        tensors, rest = split_tensors(shared)
        checksums = {}
        if self.rank == 0:
            payload = {"step": step, "shared": rest, "per_rank": per_rank}
            checksums[EXTRA_FILE] = save_file(payload, directory / EXTRA_FILE)
        writer = ChecksumFileSystemWriter(directory, DCP_WRITER_THREADS, checksums)
        kwargs = {"storage_writer": writer, "process_group": self._group, "no_dist": self._group is None}
        with single_process_quiet(self._group is None):
            if self.cfg.mode == "async":
                return dcp.async_save(tensors, async_stager=self._stager, **kwargs), checksums
            dcp.save(tensors, **kwargs)
        return None, checksums

    def _commit(self, directory: Path, step: int, start: float, blocking: float, checksums: dict[str, dict],
                upload: Future | None = None) -> None:
        """Every rank: finish writing and hand its checksums to rank 0, which writes the marker and prunes."""
        if upload is not None:
            with failing_save(directory, discard=self.rank == 0):
                upload.result()  # every rank's data and DCP's .metadata are written
        gathered = self._gather(checksums)
        num_bytes = 0
        if self.rank == 0:
            every_rank = {name: entry for part in gathered for name, entry in part.items()}
            with failing_save(directory, discard=True):  # no marker: a torn save, deleted
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

    def load(self, step: int | None = None) -> int | None:
        """Restore the registry from ``step`` (default: the latest complete one); None if none exists."""
        self.wait()
        chosen, error = self._broadcast(self._choose(step) if self.rank == 0 else None)
        if error:
            raise CheckpointError(error)
        if chosen is None:
            return None
        directory = step_dir(self.root, chosen)
        marker = read_marker(directory)
        saved = open_saved(directory, marker)
        # The run's own tensors, filled in place; members the checkpoint lacks keep theirs (registry.load).
        current = split_tensors(self.registry.shared_state())[0]
        template = {member: tensors for member, tensors in current.items() if member in saved.shared}
        self._check_shapes(directory, saved.shapes, flat_shapes(template), saved.shared)
        load_tensors(saved, directory, marker, template, self._group)
        rank_state = saved.per_rank[self.rank] if len(saved.per_rank) == self.world_size else None
        if rank_state is None:
            log.info("checkpoint was written by %d ranks, this run has %d: per-rank state (RNG) cannot be "
                     "matched to ranks, keeping the current one", len(saved.per_rank), self.world_size)
        try:
            self.registry.load(saved.shared, rank_state)
        except StateMismatchError as exc:
            raise CheckpointError(f"checkpoint {directory} does not fit this run: {exc}") from exc
        log.info("resumed from %s (step %d, mode %s)", directory, saved.step, marker["mode"])
        return saved.step

    def _check_shapes(self, directory: Path, saved: dict[str, list], current: dict[str, list],
                      saved_shared: dict) -> None:
        """Refuse a checkpoint whose tensors differ from the run's, naming the first one, before loading."""
        for name in [*current, *(n for n in saved if n not in current)]:
            saved_shape, current_shape = saved.get(name, "absent"), current.get(name, "absent")
            if saved_shape != current_shape:
                member, _, key = name.partition(".")
                kind = "parameter" if member == "model" else f"{member} state"
                raise CheckpointError(
                    f"checkpoint {directory} does not fit this run: {kind} {key!r} has shape {saved_shape} "
                    f"in the checkpoint and {current_shape} in the model. "
                    f"{self.registry.describe(saved_shared) or 'Its run config is unrecorded'}: build that "
                    "model, or train into a fresh checkpoint root")

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
            raise CheckpointError(f"every complete checkpoint under {self.root} is corrupt (steps "
                                  f"{complete}): restore them from a backup, or set checkpoint.resume='none'")
        return None

    def _verify(self, step: int) -> None:
        if self.cfg.verify_on_load:
            verify_checkpoint(step_dir(self.root, step))
        else:
            read_marker(step_dir(self.root, step))
