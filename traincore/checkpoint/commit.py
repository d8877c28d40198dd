"""The commit marker: a checkpoint counts only once rank 0 has written ``commit.json``, last.

It holds the format version, the world size and, for every other file in the step directory, its size
and CRC32. Rank 0 writes it once every rank's writes are done and lists the directory as it does: the
directory is the truth, and a file whose size differs from what its writer reported is not committed.
A step directory whose ``commit.json`` is not a traincore marker is refused by resume when it gets there
(:func:`read_marker`), and pruning keeps it.

Why CRC32 and not sha256: the marker guards against accidents (a torn or truncated write, bit flips on
disk or in a copy), not against an attacker. The size catches truncation; CRC32 catches every error burst
up to 32 bits and any other corruption with probability 1 - 2**-32. It is not a security hash: whoever can
write a file can forge its CRC. The exported model, which leaves the run, keeps sha256 (traincore.export).

Our own files (``state.pt``, ``extra.pt``) and every file written to an object store are checksummed on
their way out (traincore.checkpoint.writer, traincore.checkpoint.dcp); DCP's files on a local disk are read
back once written (:func:`checksum_share`).
"""

from __future__ import annotations

import json
import math
import re
import zlib
from pathlib import Path
from typing import Any

from traincore.checkpoint.errors import CheckpointError, CheckpointWriteError, CorruptCheckpointError, writing
from traincore.checkpoint.layout import EXTRA_FILE, MARKER, OWN_FILES, STATE_FILE, tmp_path
from traincore.checkpoint.store import Store, as_store
from traincore.config import VALIDATION_METRICS
from traincore.files import publish

FORMAT_VERSION = 3  # 3: the state registry's members (2: fixed model/optim/extra layout; 1: sha256)
READABLE_VERSIONS = (2, FORMAT_VERSION)  # traincore.checkpoint.format reads both
MODES = ("sync", "dcp", "async")
_BLOCK = 8 << 20  # read size when checksumming a file
_CRC32 = re.compile(r"^[0-9a-f]{8}$")
_MARKER_KEYS = {"format_version", "step", "mode", "world_size", "format", "checksum", "files"}
"""Every marker's keys; a validated step's also has ``metrics`` (traincore.checkpoint.selection)."""



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




def write_marker(directory: str | Path | Store, step: int, mode: str, world_size: int,
                 checksums: dict[str, dict], metrics: dict[str, float] | None = None) -> int:
    """Write the commit marker; returns the checkpoint's bytes. ``metrics``: the step's validation
    (``val_accuracy``, ``val_loss``), when it was validated.

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
    if metrics:
        marker["metrics"] = metrics
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
    if "metrics" in marker and (problem := _metrics_problem(marker["metrics"])):
        return problem
    needed = [STATE_FILE] if expected_format == "torch_save" else [EXTRA_FILE, ".metadata"]
    missing = [name for name in needed if name not in files]
    if missing:
        return f"it lists no {', '.join(missing)}, which a {marker['mode']} checkpoint holds"
    return None


def _metrics_problem(metrics: Any) -> str | None:
    """What is wrong with a marker's ``metrics`` (known metric names to finite numbers), or None."""
    if not isinstance(metrics, dict):
        return f"metrics is a {type(metrics).__name__}, not a mapping of metric names to numbers"
    for name, value in metrics.items():
        number = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        if name not in VALIDATION_METRICS or not number:
            return f"metrics has {name}={value!r}, not one of {', '.join(VALIDATION_METRICS)} with a number"
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

