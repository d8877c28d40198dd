"""The torch.distributed.checkpoint side of checkpoints: checksummed writes, allow-listed reads.

Only ``dcp`` and ``async`` saves and the loading of their checkpoints need it, so the other checkpoint modules
import this one (and with it torch.distributed.checkpoint, about 0.8 s) when they first get there: a ``sync``
run, its resume and the export of a ``sync`` checkpoint never load DCP.
"""

from __future__ import annotations

import os
import pickle
import threading
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse

from traincore.checkpoint.layout import CheckpointError, CorruptCheckpointError
from traincore.checkpoint.writer import ChecksumWriter

METADATA = ".metadata"  # DCP's index of a directory's tensors
WRITER_THREADS = 2  # two files per rank, written and checksummed in parallel (bench/checkpoint.py)


@contextmanager
def single_process_quiet(no_dist: bool) -> Iterator[None]:
    """Silence DCP's warning that a deliberate single-process call runs without a process group."""
    with warnings.catch_warnings():
        if no_dist:
            warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninit")
        yield


# ---- writing -------------------------------------------------------------------------------------

class _ChecksumFileSystem(FileSystem):
    """DCP's local filesystem, adding each written file's checksum to ``into`` once the file is closed.

    It also keeps the errors of the files it writes: DCP's extra writer threads drop theirs (the thread
    dies, its file's results go missing, and the save would commit without them).
    """

    def __init__(self, into: dict[str, dict]):
        super().__init__()
        self._into = into
        self.errors: list[BaseException] = []
        self._state = threading.Condition()
        self._open = 0  # streams being written
        self._stopped = False

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str):
        assert mode == "wb", f"DCP's writer only creates files, got mode {mode!r}"
        with self._state:
            if self._stopped or self.errors:
                raise CheckpointError(f"not writing {path}: an earlier write of this checkpoint failed")
            self._open += 1
        try:
            with ChecksumWriter(path) as stream:
                yield stream
            self._into[Path(path).name] = stream.checksum()  # DCP writes flat: names are relative to the step
        except BaseException as exc:
            with self._state:
                self.errors.append(exc)
            raise
        finally:
            with self._state:
                self._open -= 1
                self._state.notify_all()

    def stop(self) -> None:
        """Refuse new files and wait until the ones being written are closed."""
        with self._state:
            self._stopped = True
            self._state.wait_for(lambda: self._open == 0)


class ChecksumFileSystemWriter(dcp.FileSystemWriter):
    """A DCP FileSystemWriter whose files are checksummed on their way to disk, into ``checksums``.

    It swaps in its filesystem the way torch's own FsspecWriter subclass does (``self.fs`` set after the
    base initialiser); every other writer in the process is untouched.
    """

    def __init__(self, directory: Path, thread_count: int, checksums: dict[str, dict]):
        # sync_files off: DCP would fsync before ChecksumWriter.close() writes the last block; close() fsyncs.
        super().__init__(directory, thread_count=thread_count, sync_files=False)
        self.fs = _ChecksumFileSystem(checksums)

    def write_data(self, plan: Any, planner: Any) -> Any:
        """DCP's write of this rank's files; raises the first file's error, whichever thread wrote it."""
        try:
            result = super().write_data(plan, planner)
        except BaseException as exc:
            self.fs.stop()  # the calling thread failed: its sibling threads write no more
            first = self.fs.errors[0] if self.fs.errors else exc
            if first is exc:
                raise
            raise first from None  # a sibling failed first; this thread then refused its next file
        if self.fs.errors:  # every thread is joined: a sibling's error, which DCP dropped
            raise self.fs.errors[0]
        return result


def save_tensors(tensors: dict[str, Any], directory: Path, checksums: dict[str, dict],
                 group: dist.ProcessGroup | None, stager: AsyncStager | None = None
                 ) -> AsyncSaveResponse | None:
    """Write this rank's part of ``tensors`` under ``directory``, its files' checksums into ``checksums``.

    With a ``stager`` (whose ``stage`` returns a Future): an async save, returning the futures of the copy
    and of the write as soon as the stager has started the copy.
    """
    writer = ChecksumFileSystemWriter(directory, WRITER_THREADS, checksums)
    kwargs = {"storage_writer": writer, "process_group": group, "no_dist": group is None}
    with single_process_quiet(group is None):
        if stager is None:
            dcp.save(tensors, **kwargs)
            return None
        return dcp.async_save(tensors, async_stager=stager, **kwargs)


# ---- reading -------------------------------------------------------------------------------------

class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's ``.metadata`` index and nothing else: torch's reader uses plain ``pickle.load``, so a
    forged ``.metadata`` could otherwise run code on resume or export."""

    _MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem")
    _NAMES = {("torch", "Size"), ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"),
              ("pathlib", "PurePosixPath"), ("collections", "OrderedDict")}

    def find_class(self, module: str, name: str) -> Any:
        dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        if module in self._MODULES or (module, name) in self._NAMES or dtype:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of DCP metadata: refused")


class SafeFileSystemReader(dcp.FileSystemReader):
    """DCP's filesystem reader with ``.metadata`` read through an allow-list unpickler."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        with open(Path(self.path) / METADATA, "rb") as handle:
            metadata = _MetadataUnpickler(handle).load()
        if getattr(metadata, "storage_meta", None) is not None:
            metadata.storage_meta.load_id = self.load_id
        return metadata


def tensor_index(directory: Path) -> dict:
    """DCP's index of the tensors under ``directory``: flattened name -> metadata (size, dtype)."""
    path = directory / METADATA
    try:
        metadata = SafeFileSystemReader(directory).read_metadata().state_dict_metadata
        if not isinstance(metadata, dict):
            raise TypeError(f"it holds a {type(metadata).__name__}, not DCP's index")
        return metadata
    except FileNotFoundError as exc:
        raise CorruptCheckpointError(f"checkpoint file {path} is missing: resume from another step, or "
                                     f"delete {directory}") from exc
    except Exception as exc:  # unpickling reports a damaged file as whatever it hit
        raise CorruptCheckpointError(f"checkpoint file {path} cannot be read as DCP metadata "
                                     f"({type(exc).__name__}, chained): it is damaged or was not written by "
                                     f"traincore: resume from another step, or delete "
                                     f"{directory}") from exc


def load_into(state: dict[str, Any], directory: Path, group: dist.ProcessGroup | None) -> None:
    """Fill ``state``'s tensors in place from the DCP files under ``directory``, resharded by DCP."""
    try:
        with single_process_quiet(group is None):
            dcp.load(state, storage_reader=SafeFileSystemReader(directory), process_group=group,
                     no_dist=group is None)
    except CheckpointException as exc:  # every rank gets it: DCP gathers the read results
        raise _read_error(directory, exc) from exc


def _read_error(directory: Path, exc: CheckpointException) -> CorruptCheckpointError:
    """A DCP read failure as one line naming the directory and its DCP files (DCP's error names none)."""
    failures = ", ".join(f"{type(error).__name__} on rank {rank}" for rank, (error, _) in
                         sorted(exc.failures.items()))
    files = ", ".join(sorted(p.name for p in directory.glob("*.distcp"))) or "no .distcp file"
    return CorruptCheckpointError(f"reading the DCP files of checkpoint {directory} ({files}, {METADATA}) "
                                  f"failed ({failures}, chained): one is damaged or was not written by "
                                  "traincore.checkpoint.checkpointer: resume from another step, or delete "
                                  f"{directory}")
