"""The torch.distributed.checkpoint side of checkpoints: torch's writer with named errors, allow-listed reads.

Only ``dcp`` and ``async`` saves and the loading of their checkpoints need it, so the other checkpoint modules
import this one (and with it torch.distributed.checkpoint, about 0.8 s) when they first get there: a ``sync``
run, its resume and the export of a ``sync`` checkpoint never load DCP.
"""

from __future__ import annotations

import dataclasses
import io
import pickle
import uuid
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

# torch's record of where an item sits in a file (relative path, offset, length): ObjectStoreWriter
# writes it into .metadata as FileSystemWriter does, so torch's own readers read our checkpoints.
from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION, _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, SavePlan, WriteItemType
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from traincore.checkpoint.errors import CorruptCheckpointError, write_error, writing
from traincore.checkpoint.layout import tmp_path
from traincore.checkpoint.store import Store, is_uri
from traincore.checkpoint.writer import ChecksumStream

METADATA = ".metadata"  # DCP's index of a directory's tensors
# One thread, so no error is dropped (CheckedFileSystemWriter). Measured: 600 MB per rank, 2 processes at
# once on this 2-core VM, torch's FileSystemWriter took 1.0-1.5 s with one thread, 0.6-1.25 s with two.
WRITER_THREADS = 1
# An object-store load fetches this many bytes of items at once (concurrent ranged GETs), then copies them
# into the run's tensors: a bounded transient, not a second copy of the rank's whole state.
READ_BATCH_BYTES = 256 << 20


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


class ObjectStoreWriter(StorageWriter):
    """DCP's storage writer for an object store: each rank streams its one file straight into the store.

    The file is torch's layout (``__<rank>_0.distcp``, each tensor torch.save'd at an offset recorded in
    DCP's ``.metadata`` index with torch's own storage record), so a checkpoint copied out of the store is a
    plain DCP directory that torch's FileSystemReader and ``format_utils`` read. torch's FileSystemWriter
    cannot write there (its file layer is local paths; the fsspec one is not public API). Bytes pass a
    CRC32 on their way up (:class:`~traincore.checkpoint.writer.ChecksumStream`), so the commit marker gets
    each file's checksum without reading it back from the store; an upload is committed only when its
    stream closes cleanly, so a failed rank leaves no partial file.
    """

    def __init__(self, store: Store, rank: int):
        super().__init__()
        self.store, self.writer_rank = store, rank
        self.checksums: dict[str, dict] = {}  # of the files this rank wrote, by name
        self.save_id = uuid.uuid4().hex

    def reset(self, checkpoint_id: Any = None) -> None:
        """Nothing to reset: one writer per save."""

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        """Nothing to set up: the store is reached on the first write."""

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """Give each rank's plan its file name prefix, as torch's writer does (``__<rank>_``)."""
        return [dataclasses.replace(plan, storage_data=f"__{i}_") for i, plan in enumerate(plans)]

    def write_data(self, plan: SavePlan, planner: Any) -> Future:
        """Stream this rank's items into its file; their offsets and lengths go to DCP's index."""
        name = f"{plan.storage_data}0.distcp"
        results = []
        with writing(self.store.uri_of(name)), ChecksumStream(self.store.open(name, "wb")) as stream:
            for item in plan.items:
                data = planner.resolve_data(item)
                offset = stream.tell()
                if item.type == WriteItemType.BYTE_IO:
                    stream.write(data.getbuffer())
                else:
                    torch.save(_compact_cpu(data), stream)
                length = stream.tell() - offset
                results.append(WriteResult(index=item.index, size_in_bytes=length,
                                           storage_data=_StorageInfo(name, offset, length)))
        # "rank": the writer, which the marker keeps: each data file is shown written by its own rank.
        self.checksums[name] = {**stream.checksum(), "rank": self.writer_rank}
        future: Future = Future()
        future.set_result(results)
        return future

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Rank 0: DCP's ``.metadata`` index of every rank's items, written once their files are."""
        metadata.version = CURRENT_DCP_VERSION
        metadata.storage_data = {result.index: result.storage_data for part in results for result in part}
        metadata.storage_meta = self.storage_meta()
        with writing(self.store.uri_of(METADATA)):
            self.checksums[METADATA] = {**self.store.write_bytes(METADATA, pickle.dumps(metadata)),
                                        "rank": self.writer_rank}

    def storage_meta(self) -> StorageMeta:
        return StorageMeta(checkpoint_id=self.store.uri, save_id=self.save_id)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return is_uri(str(checkpoint_id))


def _compact_cpu(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` on the CPU with a storage of its own size: torch.save writes a view's whole storage."""
    tensor = tensor.detach().cpu()
    return tensor.clone() if tensor.untyped_storage().nbytes() != tensor.nbytes else tensor


def save_tensors(tensors: dict[str, Any], directory: Store, rank: int, group: dist.ProcessGroup | None,
                 stager: AsyncStager | None = None
                 ) -> tuple[AsyncSaveResponse | None, ObjectStoreWriter | None]:
    """Write this rank's part of ``tensors`` under ``directory``; returns the async response (None for a
    blocking save) and, in an object store, the writer, which holds the checksums of what it wrote.

    With a ``stager`` (whose ``stage`` returns a Future): an async save, returning the futures of the copy
    and of the write as soon as the stager has started the copy.
    """
    writer = (CheckedFileSystemWriter(directory.path, rank) if directory.local
              else ObjectStoreWriter(directory, rank))
    kwargs = {"storage_writer": writer, "process_group": group, "no_dist": group is None}
    with single_process_quiet(group is None):
        if stager is None:
            dcp.save(tensors, **kwargs)
            response = None
        else:
            response = dcp.async_save(tensors, async_stager=stager, **kwargs)
    return response, None if directory.local else writer


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
            return _loaded_metadata(handle, self.load_id)


def _loaded_metadata(handle: Any, load_id: str) -> Any:
    metadata = _MetadataUnpickler(handle).load()
    if getattr(metadata, "storage_meta", None) is not None:
        metadata.storage_meta.load_id = load_id
    return metadata


class ObjectStoreReader(StorageReader):
    """DCP's storage reader for a checkpoint in an object store, read in place: each rank fetches the byte
    ranges of the items it needs (DCP has resharded the plan), concurrently, and nothing else. ``.metadata``
    goes through the same allow-list unpickler as a local one."""

    def __init__(self, store: Store):
        super().__init__()
        self.store = store
        self.storage_data: dict = {}
        self.load_id = uuid.uuid4().hex

    def reset(self, checkpoint_id: Any = None) -> None:
        self.storage_data = {}

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        return _loaded_metadata(io.BytesIO(self.store.read_bytes(METADATA)), self.load_id)

    def set_up_storage_reader(self, metadata: Any, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.storage_data = metadata.storage_data

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: Any) -> Future:
        """Fetch the items' byte ranges concurrently, READ_BATCH_BYTES at a time (so a rank holds at most
        that much fetched beside its own state), and hand each to the planner."""
        batch, size = [], 0
        for item in plan.items:
            info = self.storage_data[item.storage_index]
            if batch and size + info.length > READ_BATCH_BYTES:
                self._load(batch, planner)
                batch, size = [], 0
            batch.append((item, info))
            size += info.length
        self._load(batch, planner)
        future: Future = Future()
        future.set_result(None)
        return future

    def _load(self, batch: list[tuple[Any, Any]], planner: Any) -> None:
        blobs = self.store.read_ranges([(info.relative_path, info.offset, info.length) for _, info in batch])
        for (item, info), blob in zip(batch, blobs, strict=True):
            if item.type == LoadItemType.BYTE_IO:
                planner.load_bytes(item, io.BytesIO(blob))
                continue
            tensor = torch.load(io.BytesIO(blob), map_location="cpu", weights_only=True)
            for dim, (offset, length) in enumerate(zip(item.storage_offsets, item.lengths, strict=True)):
                if length < tensor.size(dim):
                    tensor = tensor.narrow(dim, offset, length)
            target = planner.resolve_tensor(item).detach()
            if target.size() != tensor.size():
                raise CorruptCheckpointError(
                    f"{self.store.uri_of(info.relative_path)}: item {item.storage_index.fqn} has shape "
                    f"{tuple(tensor.size())}, DCP's plan expects {tuple(target.size())}")
            target.copy_(tensor)
            planner.commit_tensor(item, target)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return is_uri(str(checkpoint_id))


def _reader(directory: Store) -> StorageReader:
    return SafeFileSystemReader(directory.path) if directory.local else ObjectStoreReader(directory)


def tensor_index(directory: Store) -> dict:
    """DCP's index of the tensors under ``directory``: flattened name -> metadata (size, dtype)."""
    path = directory.uri_of(METADATA)
    try:
        metadata = _reader(directory).read_metadata().state_dict_metadata
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


def load_into(state: dict[str, Any], directory: Store, group: dist.ProcessGroup | None) -> None:
    """Fill ``state``'s tensors in place from the DCP files under ``directory``, resharded by DCP."""
    try:
        with single_process_quiet(group is None):
            dcp.load(state, storage_reader=_reader(directory), process_group=group, no_dist=group is None)
    except CheckpointException as exc:  # every rank gets it: DCP gathers the read results
        raise _read_error(directory, exc) from exc


def _read_error(directory: Store, exc: CheckpointException) -> CorruptCheckpointError:
    """A DCP read failure as one line naming the directory and its DCP files (DCP's error names none)."""
    failures = ", ".join(f"{type(error).__name__} on rank {rank}" for rank, (error, _) in
                         sorted(exc.failures.items()))
    files = ", ".join(sorted(name for name in directory.entries() if name.endswith(".distcp")))
    return CorruptCheckpointError(f"reading the DCP files of checkpoint {directory} "
                                  f"({files or 'no .distcp file'}, {METADATA}) "
                                  f"failed ({failures}, chained): one is damaged or was not written by "
                                  "traincore.checkpoint.checkpointer: resume from another step, or delete "
                                  f"{directory}")
