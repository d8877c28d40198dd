"""Checkpoints: save and resume the whole training state in one of three modes.

Layout: ``<root>/step-000123/``. ``sync`` writes one ``state.pt`` from rank 0 (torch.save of the full
state). ``dcp`` and ``async`` write a torch.distributed.checkpoint directory, every rank its own part, and
rank 0 adds ``extra.pt`` with everything that is not a tensor; only tensors go through DCP, so reading a
checkpoint never unpickles anything outside ``torch.load(weights_only=True)``.

A checkpoint counts only once complete: rank 0 writes ``commit.json`` last, after every rank's writes are
done. It holds the format version, the world size and the size and sha256 of every other file in the
directory. A directory without it is torn (a crash mid-save): resume skips it and pruning deletes it.

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

import hashlib
import json
import logging
import os
import random
import re
import shutil
import time
import warnings
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

from traincore.config import CheckpointConfig

FORMAT_VERSION = 1
MARKER = "commit.json"
STATE_FILE = "state.pt"  # sync: the whole state
EXTRA_FILE = "extra.pt"  # dcp / async: the non-tensor state
DCP_WRITER_THREADS = 2  # two files per rank, written and then hashed in parallel (bench/checkpoint.py)
_STEP_NAME = re.compile(r"^step-(\d+)$")

log = logging.getLogger(__name__)
# Single-process DCP calls pass no_dist=True on purpose; DCP still warns on each of them.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")


class CheckpointError(ValueError):
    """A checkpoint is missing, corrupt or does not fit this run; the message says which and what to do."""


class CorruptCheckpointError(CheckpointError):
    """A file of a complete checkpoint is missing, truncated or fails its checksum."""


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


def step_dir(root: str | Path, step: int) -> Path:
    """The directory of ``step`` under ``root``."""
    return Path(root) / f"step-{step:06d}"


def _step_dirs(root: str | Path) -> dict[int, Path]:
    root = Path(root)
    if not root.is_dir():
        return {}
    found = ((_STEP_NAME.match(p.name), p) for p in root.iterdir() if p.is_dir())
    return {int(m.group(1)): p for m, p in found if m and p == step_dir(root, int(m.group(1)))}


def complete_steps(root: str | Path) -> list[int]:
    """Steps under ``root`` that have a commit marker, oldest first; needs no process group."""
    return sorted(step for step, path in _step_dirs(root).items() if (path / MARKER).is_file())


def latest_complete(root: str | Path) -> Path | None:
    """The newest complete step directory under ``root``, or None."""
    steps = complete_steps(root)
    return step_dir(root, steps[-1]) if steps else None


def unwrap_model(model: nn.Module) -> nn.Module:
    """The module inside DistributedDataParallel / torch.compile wrappers: its parameter names are canonical."""
    while True:
        if isinstance(model, DistributedDataParallel):
            model = model.module
        elif isinstance(getattr(model, "_orig_mod", None), nn.Module):
            model = model._orig_mod
        else:
            return model


# ---- files: checksums, atomic publication, the commit marker ------------------------------------

def sha256_file(path: str | Path) -> str:
    """Hex sha256 of a file, read in 8 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(8 << 20):
            digest.update(block)
    return digest.hexdigest()


def publish(tmp: str | Path, path: str | Path) -> None:
    """Make ``tmp`` durable and rename it to ``path``: readers see the old file or the whole new one."""
    fd = os.open(tmp, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    dir_fd = os.open(Path(path).parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


class _HashingWriter:
    """A write-only file that sha256-hashes each block in a second thread while the block is written."""

    def __init__(self, file: Any, pool: ThreadPoolExecutor):
        self.digest = hashlib.sha256()
        self._file = file
        self._pool = pool

    def write(self, data: Any) -> int:
        if memoryview(data).nbytes < 1 << 20:  # headers and small tensors: a thread hop costs more
            self.digest.update(data)
            return self._file.write(data)
        hashed = self._pool.submit(self.digest.update, data)  # hashlib releases the GIL
        written = self._file.write(data)
        hashed.result()  # the caller may reuse ``data`` once write returns
        return written

    def flush(self) -> None:
        self._file.flush()


def _save_file(obj: Any, path: Path) -> str:
    """torch.save ``obj`` to ``path`` atomically; returns its sha256, so the commit need not read it back."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as file, ThreadPoolExecutor(max_workers=1) as pool:
        writer = _HashingWriter(file, pool)
        torch.save(obj, writer)
    publish(tmp, path)
    return writer.digest.hexdigest()


def _load_file(path: Path) -> Any:
    return torch.load(path, map_location="cpu", weights_only=True, mmap=True)


def _write_marker(directory: Path, step: int, mode: str, world_size: int, known: dict[str, str]) -> int:
    """Write the commit marker; ``known`` maps file names to sha256 digests computed while writing."""
    paths = {p.relative_to(directory).as_posix(): p for p in sorted(directory.rglob("*"))
             if p.is_file() and p.name != MARKER}
    unknown = [name for name in paths if name not in known]
    # hashlib releases the GIL: files (one per DCP writer thread and rank) hash in parallel.
    with ThreadPoolExecutor(max_workers=max(1, min(len(unknown), os.cpu_count() or 1))) as pool:
        digests = {**known, **dict(zip(unknown, pool.map(sha256_file, [paths[name] for name in unknown])))}
    files = {name: {"bytes": path.stat().st_size, "sha256": digests[name]} for name, path in paths.items()}
    marker = {"format_version": FORMAT_VERSION, "step": step, "mode": mode, "world_size": world_size,
              "format": "torch_save" if mode == "sync" else "dcp", "files": files}
    tmp = directory / f".{MARKER}.tmp"
    tmp.write_text(json.dumps(marker, indent=1))
    publish(tmp, directory / MARKER)
    return sum(entry["bytes"] for entry in files.values())


def read_marker(directory: str | Path) -> dict:
    """The commit marker of a step directory; CheckpointError when it is absent or unreadable."""
    path = Path(directory) / MARKER
    try:
        marker = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{directory} is not a complete checkpoint ({MARKER}: {exc}): "
                              "pass a step directory written by traincore.checkpoint") from exc
    if marker.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(
            f"{directory} has checkpoint format version {marker.get('format_version')!r}, this code reads "
            f"version {FORMAT_VERSION}: resume it with the code that wrote it, or use a fresh checkpoint root")
    return marker


def verify_checkpoint(directory: str | Path) -> None:
    """Raise CheckpointError naming the first file whose size or sha256 differs from the commit marker."""
    directory = Path(directory)
    for name, expected in read_marker(directory)["files"].items():
        path = directory / name
        size = path.stat().st_size if path.is_file() else None
        if size != expected["bytes"]:
            raise CorruptCheckpointError(f"checkpoint file {path} is missing or truncated: {size} bytes, the "
                                         f"commit marker records {expected['bytes']}")
        if sha256_file(path) != expected["sha256"]:
            raise CorruptCheckpointError(f"checkpoint file {path} is corrupt: its sha256 differs from the "
                                         "commit marker")


def _remove(directory: Path) -> None:
    # The marker goes first: a crash half-way leaves a torn directory, never a complete-looking one.
    (directory / MARKER).unlink(missing_ok=True)
    shutil.rmtree(directory, ignore_errors=True)


def _prune(root: Path, keep_last: int) -> None:
    complete = complete_steps(root)
    if not complete:
        return
    torn_older = [s for s, path in _step_dirs(root).items() if s < complete[-1] and s not in complete]
    for step in complete[:-keep_last] + torn_older:
        _remove(step_dir(root, step))


# ---- reading a step directory in either format ---------------------------------------------------

def _read_extra(directory: Path, marker: dict) -> dict:
    if marker["format"] == "torch_save":
        return _load_file(directory / STATE_FILE)["extra"]
    return _load_file(directory / EXTRA_FILE)


def _saved_model(directory: Path, marker: dict) -> dict[str, torch.Tensor]:
    """Model tensors of a sync checkpoint, or empty tensors of the saved shapes for a DCP one."""
    if marker["format"] == "torch_save":
        return _load_file(directory / STATE_FILE)["model"]
    metadata = dcp.FileSystemReader(directory).read_metadata().state_dict_metadata
    return {key.removeprefix("model."): torch.empty(md.size, dtype=md.properties.dtype)
            for key, md in metadata.items() if key.startswith("model.")}


def read_checkpoint(directory: str | Path) -> tuple[dict[str, torch.Tensor], dict]:
    """Model weights and non-tensor state (step, meta, ...) of one step directory, in this process alone."""
    directory = Path(directory)
    marker = read_marker(directory)
    model = _saved_model(directory, marker)
    if marker["format"] == "dcp":
        dcp.load({"model": model}, checkpoint_id=directory, no_dist=True)
    return model, _read_extra(directory, marker)


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
            _remove(directory)  # a torn (or superseded) leftover of the same step
            directory.mkdir(parents=True)
        self._barrier()  # no rank writes before the leftover is gone
        upload, known = self._write(directory, {"model": model_sd, "optim": optim_sd["state"]}, extra)
        blocking = time.perf_counter() - start
        log.info("checkpoint step=%d mode=%s blocking=%.3fs", state.step, self.cfg.mode, blocking)
        if upload is None:
            self._commit(directory, state.step, start, blocking, known)
            self._barrier()  # no rank goes on (or reads it) before the marker exists
        else:
            self._pending = self._executor.submit(self._commit, directory, state.step, start, blocking, known,
                                                  upload)

    def _write(self, directory: Path, tensors: dict, extra: dict) -> tuple[Future | None, dict[str, str]]:
        """Write this rank's part; returns the async upload (or None) and digests of the files rank 0 wrote."""
        if self.cfg.mode == "sync":
            if self.rank != 0:
                return None, {}
            return None, {STATE_FILE: _save_file({**tensors, "extra": extra}, directory / STATE_FILE)}
        known = {EXTRA_FILE: _save_file(extra, directory / EXTRA_FILE)} if self.rank == 0 else {}
        writer = dcp.FileSystemWriter(directory, thread_count=DCP_WRITER_THREADS)
        kwargs = {"storage_writer": writer, "process_group": self._group, "no_dist": self._group is None}
        if self.cfg.mode == "async":
            return dcp.async_save(tensors, async_stager=self._stager, **kwargs), known
        dcp.save(tensors, **kwargs)
        return None, known

    def _commit(self, directory: Path, step: int, start: float, blocking: float, known: dict[str, str],
                upload: Future | None = None) -> None:
        if upload is not None:
            upload.result()  # every rank's data and DCP's .metadata are written
        num_bytes = 0
        if self.rank == 0:
            num_bytes = _write_marker(directory, step, self.cfg.mode, self.world_size, known)
            _prune(self.root, self.cfg.keep_last)
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
        extra = _read_extra(directory, marker)
        model = unwrap_model(state.model)
        model_sd, optim_sd = get_state_dict(model, state.optimizer)
        _check_model(directory, _saved_model(directory, marker), model_sd, extra)
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
            saved = _load_file(directory / STATE_FILE)
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
