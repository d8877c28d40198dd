"""The torch.distributed.checkpoint side of checkpoints: torch's writer with named errors, allow-listed reads.

Only ``dcp`` and ``async`` saves and the loading of their checkpoints need it, so the other checkpoint modules
import this one (and with it torch.distributed.checkpoint, about 0.8 s) when they first get there: a ``sync``
run, its resume and the export of a ``sync`` checkpoint never load DCP.
"""

from __future__ import annotations

import pickle
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse

from traincore.checkpoint.layout import CorruptCheckpointError, tmp_path, write_error

METADATA = ".metadata"  # DCP's index of a directory's tensors
# One thread, so no error is dropped (CheckedFileSystemWriter). Measured: 600 MB per rank, 2 processes at
# once on this 2-core VM, torch's FileSystemWriter took 1.0-1.5 s with one thread, 0.6-1.25 s with two.
WRITER_THREADS = 1


@contextmanager
def single_process_quiet(no_dist: bool) -> Iterator[None]:
    """Silence DCP's warning that a deliberate single-process call runs without a process group."""
    with warnings.catch_warnings():
        if no_dist:
            warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninit")
        yield


# ---- writing -------------------------------------------------------------------------------------

class CheckedFileSystemWriter(dcp.FileSystemWriter):
    """torch's FileSystemWriter, fsync on, whose write errors name the file (a full disk: "no space left on
    device while writing <path>") as a CheckpointWriteError, which every rank's save then raises.

    One writer thread (WRITER_THREADS): DCP's extra writer threads drop their errors (the thread dies, its
    file's results go missing and the save would commit without them); in the calling thread every error
    reaches the save. Checksums are computed from the files once written (:func:`checksum_share`).
    """

    def __init__(self, directory: Path, rank: int):
        super().__init__(directory, thread_count=WRITER_THREADS, single_file_per_rank=True, sync_files=True)
        self.directory, self.writer_rank = directory, rank

    def write_data(self, plan: Any, planner: Any) -> Any:
        """DCP's write of this rank's file; an OSError becomes a CheckpointWriteError naming the file."""
        try:
            return super().write_data(plan, planner)
        except (OSError, RuntimeError) as exc:
            raise self._named(exc, None) from exc

    def finish(self, metadata: Any, results: Any) -> None:
        """DCP's write of ``.metadata`` (rank 0); an OSError becomes a CheckpointWriteError naming it."""
        try:
            super().finish(metadata, results)
        except (OSError, RuntimeError) as exc:
            raise self._named(exc, tmp_path(self.directory / METADATA)) from exc

    def _named(self, exc: BaseException, path: Path | None) -> BaseException:
        """The CheckpointWriteError for the OSError behind ``exc``: torch.save's zip writer reports a failed
        write (a full disk) as a RuntimeError whose context is the OSError. Any other error as it is."""
        cause = exc
        while cause is not None and not isinstance(cause, OSError):
            cause = cause.__context__
        if cause is None:
            return exc
        return write_error(cause, cause.filename or path or self._file_in_progress())

    def _file_in_progress(self) -> Path:
        """This rank's newest DCP file (named ``__<rank>_<n>.distcp`` by DCP), else the directory."""
        files = sorted(self.directory.glob(f"__{self.writer_rank}_*.distcp"), key=lambda p: p.stat().st_mtime)
        return files[-1] if files else self.directory


def save_tensors(tensors: dict[str, Any], directory: Path, rank: int, group: dist.ProcessGroup | None,
                 stager: AsyncStager | None = None) -> AsyncSaveResponse | None:
    """Write this rank's part of ``tensors`` under ``directory``.

    With a ``stager`` (whose ``stage`` returns a Future): an async save, returning the futures of the copy
    and of the write as soon as the stager has started the copy.
    """
    kwargs = {"storage_writer": CheckedFileSystemWriter(directory, rank), "process_group": group,
              "no_dist": group is None}
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
