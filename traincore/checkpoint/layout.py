"""The checkpoint layout: step directories, per-file checksums, the commit marker, pruning.

Layout: ``<root>/step-000123/``. A ``sync`` checkpoint is one ``state.pt`` (torch.save of the full state).
A ``dcp`` or ``async`` one is a torch.distributed.checkpoint directory (every rank its own ``.distcp``
files, plus DCP's ``.metadata``) and ``extra.pt`` with everything that is not a tensor. What those files
hold, version by version, is :mod:`traincore.checkpoint.format`.

A checkpoint counts only once complete: rank 0 writes ``commit.json`` last, after every rank's writes are
done. It holds the format version, the world size and, for every other file in the directory, its size
and CRC32. A directory without it is torn (a crash mid-save): resume skips it and pruning deletes it.

Entries of a root named ``step-*`` that are not ours are never deleted: a file, a name step_dir() does not
write (``step-5``, ``step-abc``), or a step directory without a marker that holds files no save writes.
Resume ignores them, with a warning naming each (:func:`foreign_entries`); a save of a step whose
directory is such an entry is refused (:func:`clear_step`). A step directory whose ``commit.json`` is not
a traincore marker is refused by resume when it gets there (:func:`read_marker`), and pruning keeps it.

Why CRC32 and not sha256: the marker guards against accidents (a torn or truncated write, bit flips on
disk or in a copy), not against an attacker. The size catches truncation; CRC32 catches every error burst
up to 32 bits and any other corruption with probability 1 - 2**-32. It is not a security hash: whoever can
write a file can forge its CRC. The exported model, which leaves the run, keeps sha256 (traincore.export).

Our own files (``state.pt``, ``extra.pt``) are checksummed on their way to disk
(traincore.checkpoint.writer); DCP's files are read back once written (:func:`checksum_share`). A write
that fails (a full disk, an I/O error) raises :class:`CheckpointWriteError`, which names the file.
"""

from __future__ import annotations

import errno
import json
import logging
import re
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from traincore.checkpoint.store import Store, as_store, read_stream
from traincore.files import publish

FORMAT_VERSION = 3  # 3: the state registry's members (2: fixed model/optim/extra layout; 1: sha256)
READABLE_VERSIONS = (2, FORMAT_VERSION)  # traincore.checkpoint.format reads both
MARKER = "commit.json"
STATE_FILE = "state.pt"  # sync: the whole state
EXTRA_FILE = "extra.pt"  # dcp / async: the non-tensor state
OWN_FILES = (MARKER, STATE_FILE, EXTRA_FILE)  # written by the checkpointer, checksummed while written
_STEP_NAME = re.compile(r"^step-(\d+)$")
# Every file a save writes into a step directory: ours, DCP's, and the temporary names of both.
_SAVED_FILE = re.compile(r"^\.?(state\.pt|extra\.pt|commit\.json|\.metadata|__\d+_\d+\.distcp)(\.tmp)?$")
_BLOCK = 8 << 20  # read size when checksumming a file
MODES = ("sync", "dcp", "async")
_CRC32 = re.compile(r"^[0-9a-f]{8}$")
_MARKER_KEYS = {"format_version", "step", "mode", "world_size", "format", "checksum", "files"}

log = logging.getLogger(__name__)


class CheckpointError(ValueError):
    """A checkpoint is missing, corrupt or does not fit this run; the message says which and what to do."""


class CorruptCheckpointError(CheckpointError):
    """A file of a complete checkpoint (its marker included) is missing, truncated, fails its checksum or
    cannot be parsed."""


class CheckpointWriteError(CheckpointError, OSError):
    """Writing a checkpoint file failed (no space left, an I/O error); an OSError too, with its errno.

    Picklable, so a failure on one rank reaches rank 0 through DCP's gather intact.
    """

    def __init__(self, message: str, error: int | None = None, filename: str | None = None):
        super().__init__(message)
        self.errno, self.strerror, self.filename = error, message, filename

    def __str__(self) -> str:
        return self.args[0]

    def __reduce__(self) -> tuple:
        return type(self), (self.args[0], self.errno, self.filename)


def write_error(exc: OSError, path: str | Path) -> CheckpointWriteError:
    """The CheckpointWriteError for ``exc``, raised while writing ``path``."""
    if isinstance(exc, CheckpointWriteError):
        return exc
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        message = (f"no space left on device while writing {path}: free space or choose another checkpoint "
                   "root")
    else:
        message = (f"writing checkpoint file {path} failed: {exc.strerror or exc}: check that disk and its "
                   "permissions, or choose another checkpoint root")
    return CheckpointWriteError(message, exc.errno, str(path))


@contextmanager
def writing(path: str | Path) -> Iterator[None]:
    """Turn an OSError raised inside into a CheckpointWriteError naming ``path``."""
    try:
        yield
    except OSError as exc:
        raise write_error(exc, path) from exc


# ---- step directories ----------------------------------------------------------------------------

def step_name(step: int) -> str:
    """The name of ``step``'s directory (``step-000123``)."""
    return f"step-{step:06d}"


def step_dir(root: str | Path, step: int) -> Path:
    """The directory of ``step`` under the local ``root``."""
    return Path(root) / step_name(step)


def step_store(root: str | Path | Store, step: int) -> Store:
    """The location of ``step`` under ``root``, local or in an object store."""
    return as_store(root).child(step_name(step))


def parse_step_name(name: str) -> int | None:
    """The step of a step directory's name (``step-000123`` -> 123), or None for any other name."""
    match = _STEP_NAME.match(name)
    # Only the name step_name() writes counts: "step-123" or "step-0000123" is not a checkpoint.
    if match is None or name != step_name(int(match.group(1))):
        return None
    return int(match.group(1))


def step_dirs(root: str | Path | Store) -> dict[int, Store]:
    """The step directories under ``root`` (complete, torn or foreign), by step."""
    store = as_store(root)
    found = ((parse_step_name(name), name) for name, kind in store.entries().items() if kind == "dir")
    return {step: store.child(name) for step, name in found if step is not None}


def complete_steps(root: str | Path | Store) -> list[int]:
    """Steps under ``root`` that have a commit marker, oldest first; needs no process group."""
    return sorted(step for step, location in step_dirs(root).items() if location.is_file(MARKER))


def latest_complete(root: str | Path) -> Path | None:
    """The newest complete step directory under the local ``root``, or None."""
    steps = complete_steps(root)
    return step_dir(root, steps[-1]) if steps else None


def tmp_path(path: Path) -> Path:
    """The temporary name ``path`` is written under before it is published."""
    return path.with_name(f".{path.name}.tmp")


def is_torn(directory: str | Path | Store) -> bool:
    """A step directory without a marker that holds only files a save writes (or none): a save that did
    not finish, which may be deleted."""
    store = as_store(directory)
    if store.local and (not store.path.is_dir() or store.path.is_symlink()):
        return False
    entries = store.entries()
    if not store.local and not entries:
        return False  # an object store has no empty directories: nothing is there
    return MARKER not in entries and all(kind == "file" and _SAVED_FILE.match(name)
                                         for name, kind in entries.items())


def torn_steps(root: str | Path | Store, complete: list[int]) -> list[int]:
    """Steps under ``root`` whose save began but never committed: no marker, only files a save writes, or
    (in an object store) only uploads that never completed. ``complete``: :func:`complete_steps` of the
    root, which the caller has (in an object store, each listing is a round trip)."""
    store = as_store(root)
    torn = {step for step, location in step_dirs(store).items()
            if step not in complete and is_torn(location)}
    uploading = {parse_step_name(name.split("/")[0]) for name in store.unfinished_uploads()}
    return sorted(torn | {step for step in uploading if step is not None and step not in complete})


def foreign_entries(root: str | Path | Store) -> list[str]:
    """Entries of ``root`` named ``step-*`` that are neither a checkpoint nor a torn save of ours."""
    store = as_store(root)
    found = []
    for name, kind in sorted(store.entries().items()):
        if not name.startswith("step-"):
            continue
        child = store.child(name)
        if parse_step_name(name) is None or kind != "dir" or not (child.is_file(MARKER) or is_torn(child)):
            found.append(store.uri_of(name))
    return found


def clear_step(directory: str | Path | Store) -> None:
    """Delete what a save of this step finds at ``directory``: a torn save or a checkpoint of ours (it is
    saved again); CheckpointError, deleting nothing, for anything else."""
    store = as_store(directory)
    if not store.exists():
        return
    if not (is_torn(store) or _marker_is_ours(store)):
        parent = store.uri.rsplit("/", 1)[0]
        raise CheckpointError(f"cannot save step {parse_step_name(store.name)}: {store} exists and "
                              "is not a checkpoint of traincore (another program's file or directory), and "
                              f"it is never deleted: move it out of {parent}, or choose another "
                              "checkpoint root")
    remove_step(store)


def _marker_is_ours(directory: Store) -> bool:
    """Whether ``directory`` is a step directory whose commit marker traincore wrote (intact or damaged)."""
    if (directory.local and directory.path.is_symlink()) or not directory.is_file(MARKER):
        return False
    try:
        read_marker(directory)
    except CorruptCheckpointError:
        return True
    except CheckpointError:
        return False
    return True


# ---- checksums ------------------------------------------------------------

def checksum_entry(crc: int, num_bytes: int) -> dict:
    """A file's line in the commit marker."""
    return {"bytes": num_bytes, "crc32": f"{crc:08x}"}


def stream_checksum(stream: Any) -> dict:
    """Size and CRC32 of what ``stream`` holds from its position on, read in 8 MiB blocks."""
    crc, num_bytes, block = 0, 0, bytearray(_BLOCK)
    while n := stream.readinto(block):
        crc = zlib.crc32(memoryview(block)[:n], crc)
        num_bytes += n
    return checksum_entry(crc, num_bytes)


def file_checksum(path: str | Path) -> dict:
    """Size and CRC32 of a local file as the commit marker records them."""
    with open(path, "rb", buffering=0) as f:
        return stream_checksum(f)


def store_checksum(store: Store, name: str) -> dict:
    """Size and CRC32 of the file ``name`` in ``store``, read back from it."""
    if store.local:
        return file_checksum(store.path / name)
    with store.open(name) as f:
        return stream_checksum(f)


def checksum_share(directory: str | Path | Store, rank: int, world_size: int) -> dict[str, dict]:
    """Checksums of this rank's share of the DCP files under ``directory``, read back once written: every
    file but ours (:data:`OWN_FILES`), by name, dealt out round-robin so each is read once."""
    store = as_store(directory)
    own = {*OWN_FILES, *(tmp_path(Path(name)).name for name in OWN_FILES)}
    names = sorted(name for name, kind in store.entries().items() if kind == "file" and name not in own)
    return {name: store_checksum(store, name) for name in names[rank::world_size]}


def load_file(directory: str | Path | Store, name: str) -> Any:
    """A torch.save file of a step directory (local: memory-mapped), restricted to weights_only;
    CorruptCheckpointError naming the file when it is missing or torch.load cannot read it."""
    store = as_store(directory)
    path = store.uri_of(name)
    try:
        if store.local:
            return torch.load(store.path / name, map_location="cpu", weights_only=True, mmap=True)
        return torch.load(read_stream(store, name), map_location="cpu", weights_only=True)
    except FileNotFoundError as exc:
        raise CorruptCheckpointError(f"checkpoint file {path} is missing: resume from another step, or "
                                     f"delete {store}") from exc
    except Exception as exc:  # torch.load's reader reports a damaged or foreign file as whatever it hit
        raise CorruptCheckpointError(
            f"checkpoint file {path} cannot be read by torch.load ({type(exc).__name__}, chained): it is "
            f"damaged or was not written by traincore: resume from another step, or delete "
            f"{store}") from exc


# ---- the commit marker ---------------------------------------------------------------------------

def write_marker(directory: str | Path | Store, step: int, mode: str, world_size: int,
                 checksums: dict[str, dict]) -> int:
    """Write the commit marker; returns the checkpoint's bytes.

    ``checksums`` holds the entries the ranks computed; a file without one is read here. The directory is
    the truth: every file in it is listed (in an object store: every object the listing shows, which holds
    every object whose upload returned), entries of files it does not hold are left out, and a file whose
    size differs from its entry is an error: a rank's upload is not what it reported.
    """
    store = as_store(directory)
    present = {name: size for name, size in store.files().items()
               if name != MARKER and name != tmp_path(Path(MARKER)).name}
    files = {}
    for name, size in present.items():
        entry = checksums[name] if name in checksums else store_checksum(store, name)
        if entry["bytes"] != size:
            raise CheckpointWriteError(f"checkpoint file {store.uri_of(name)} holds {size} bytes, its "
                                       f"writer reported {entry['bytes']}: not committing this save")
        files[name] = entry
    marker = {"format_version": FORMAT_VERSION, "step": step, "mode": mode, "world_size": world_size,
              "format": "torch_save" if mode == "sync" else "dcp", "checksum": "crc32", "files": files}
    text = json.dumps(marker, indent=1).encode()
    if store.local:
        tmp = tmp_path(store.path / MARKER)
        with writing(tmp):
            tmp.write_bytes(text)
            publish(tmp, store.path / MARKER)
    else:
        with writing(store.uri_of(MARKER)):
            store.write_bytes(MARKER, text)
    return sum(entry["bytes"] for entry in files.values())


def read_marker(directory: str | Path | Store) -> dict:
    """The commit marker of a step directory, checked field by field.

    CheckpointError when it is absent, unreadable, another program's or of a format version this code does
    not read; CorruptCheckpointError (which resume answers by falling back) when it is damaged: not UTF-8,
    not JSON, or a field of the wrong type.
    """
    directory = as_store(directory)
    path = directory.uri_of(MARKER)
    try:
        text = directory.read_bytes(MARKER).decode("utf-8")
    except FileNotFoundError as exc:
        raise CheckpointError(f"{directory} has no {MARKER}, so it is not a complete checkpoint (a save that "
                              "did not finish, or a directory another program wrote): pass a step directory "
                              "written by traincore.checkpoint.checkpointer") from exc
    except OSError as exc:
        raise CheckpointError(f"cannot read the commit marker {path} ({exc.strerror or exc}): check its "
                              "permissions and the disk it is on") from exc
    except UnicodeDecodeError as exc:
        raise CorruptCheckpointError(f"commit marker {path} is corrupt: it is not text (byte {exc.start} is "
                                     "not UTF-8): resume from another step, or delete "
                                     f"{directory}") from exc
    try:
        marker = json.loads(text)
    except json.JSONDecodeError as exc:
        where = f"not valid JSON at line {exc.lineno} column {exc.colno}" if text.strip() else "it is empty"
        raise CorruptCheckpointError(f"commit marker {path} is corrupt or truncated ({where}): resume from "
                                     f"another step, or delete {directory}") from exc
    if not isinstance(marker, dict) or len(_MARKER_KEYS & marker.keys()) < 3:
        raise CheckpointError(f"{path} is not a traincore commit marker (a JSON {type(marker).__name__} "
                              f"without the fields {', '.join(sorted(_MARKER_KEYS))}): another program wrote "
                              "it: pass a step directory written by traincore, or use a fresh "
                              "checkpoint root")
    if "format_version" not in marker:  # most fields there: ours, damaged
        raise CorruptCheckpointError(f"commit marker {path} is corrupt: it has no format_version: resume "
                                     f"from another step, or delete {directory}")
    version = marker["format_version"]
    if version not in READABLE_VERSIONS:
        raise CheckpointError(
            f"{directory} has checkpoint format version {version!r}, this code reads version {FORMAT_VERSION}"
            f" and the earlier {', '.join(map(str, READABLE_VERSIONS[:-1]))}: resume it "
            "with the code that wrote it, or use a fresh checkpoint root")
    problem = _marker_problem(marker)
    if problem:
        raise CorruptCheckpointError(f"commit marker {path} is corrupt: {problem}: resume from another step, "
                                     f"or delete {directory}")
    return marker


def _is_int(value: Any, least: int = 0) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


def _marker_problem(marker: dict) -> str | None:
    """What is wrong with a marker of a readable version, or None."""
    if not _is_int(marker.get("step")):
        return f"step is {marker.get('step')!r}, not a step number"
    if marker.get("mode") not in MODES:
        return f"mode is {marker.get('mode')!r}, not one of {', '.join(MODES)}"
    if not _is_int(marker.get("world_size"), 1):
        return f"world_size is {marker.get('world_size')!r}, not a positive integer"
    expected_format = "torch_save" if marker["mode"] == "sync" else "dcp"
    if marker.get("format") != expected_format:
        return f"format is {marker.get('format')!r}, mode {marker['mode']} writes {expected_format!r}"
    files = marker.get("files")
    if not isinstance(files, dict):
        return f"files is a {type(files).__name__}, not a mapping of file names"
    for name, entry in files.items():
        parts = Path(name).parts
        if not name or Path(name).is_absolute() or ".." in parts or name == MARKER:
            return f"it lists the file {name!r}, which is no file of a step directory"
        if not (isinstance(entry, dict) and _is_int(entry.get("bytes"))
                and isinstance(entry.get("crc32"), str) and _CRC32.match(entry["crc32"])):
            return f"the entry of {name} is {entry!r}, not {{'bytes': <size>, 'crc32': <8 hex digits>}}"
    needed = [STATE_FILE] if expected_format == "torch_save" else [EXTRA_FILE, ".metadata"]
    missing = [name for name in needed if name not in files]
    if missing:
        return f"it lists no {', '.join(missing)}, which a {marker['mode']} checkpoint holds"
    return None


def verify_checkpoint(directory: str | Path | Store) -> None:
    """Raise CorruptCheckpointError naming the first file whose size or CRC32 differs from the marker."""
    store = as_store(directory)
    for name, expected in read_marker(store)["files"].items():
        size = store.size(name)
        if size != expected["bytes"]:
            raise CorruptCheckpointError(f"checkpoint file {store.uri_of(name)} is missing or truncated: "
                                         f"{size} bytes, the commit marker records {expected['bytes']}: "
                                         f"resume from another step, or delete {store}")
        if store_checksum(store, name)["crc32"] != expected["crc32"]:
            raise CorruptCheckpointError(f"checkpoint file {store.uri_of(name)} is corrupt: its CRC32 "
                                         "differs from the commit marker: resume from another step, or "
                                         f"delete {store}")


# ---- pruning -------------------------------------------------------------------------------------

def remove_step(directory: str | Path | Store) -> None:
    """Delete a step directory, complete or torn."""
    # The marker goes first, and (locally) its removal reaches the disk before any other file goes: a crash
    # (or power cut) half-way leaves a torn directory, never a complete-looking one with files missing.
    store = as_store(directory)
    store.remove_file(MARKER)
    store.remove_tree()


def prune(root: str | Path | Store, keep_last: int) -> None:
    """Keep the newest ``keep_last`` complete steps; delete older ones and torn ones older than the newest
    (never an entry that is not ours)."""
    steps = step_dirs(root)
    complete = sorted(step for step, location in steps.items() if location.is_file(MARKER))
    if not complete:
        return
    old = [steps[s] for s in complete[:-keep_last] if _marker_is_ours(steps[s])]
    torn_older = [location for s, location in steps.items() if s < complete[-1] and is_torn(location)]
    for location in torn_older:
        log.info("deleting %s: a save that never committed", location)
    for location in old + torn_older:
        remove_step(location)
    # Uploads of a save killed before any of its files completed: no listing shows their step.
    def older(name: str) -> bool:
        step = parse_step_name(name.split("/")[0])
        return step is not None and step < complete[-1]
    as_store(root).abort_uploads(older)
