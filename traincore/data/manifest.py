"""The staged dataset format: the manifest, its records, and the integrity checks every reader runs.

A staged dataset is one directory::

    manifest.json                 format version, source fingerprint, classes, C/H/W, normalisation stats,
                                  splits + shards
    train-00000.u8                uint8 images, NCHW contiguous (count * C * H * W bytes)
    train-00000.labels.i64        int64 labels (count * 8 bytes)
    train-00000.sha256            each image's sha256, raw (count * 32 bytes): a streaming reader
                                  (data.stream) checks every sample it fetches against it
    val-00000.u8 ...
    verified.json                 written by readers: image shards whose sha256 has been checked

Images are decoded and resized exactly once, at staging; readers memory-map the shards.

Integrity, kept cheap for large datasets: every open checks each shard's size, and reads, range-checks and
hashes the (small) label arrays. Image shards are hashed once per staging: the first reader hashes them
against the manifest and records each verified shard's sha256, size, mtime and ctime in ``verified.json``
(written atomically); later opens only ``stat`` the files and hash again only a shard whose size or times
changed. A directory that cannot be written is verified anyway, then again by the next process (a warning
says so).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import re
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from traincore.files import sha256_file, write_atomically

log = logging.getLogger(__name__)

# 3: per-image digests (streaming reads check each sample); 2: stable imagefolder splits
# (traincore.data.imagefolder), the source fingerprint
FORMAT_VERSION = 3
MANIFEST = "manifest.json"
VERIFIED = "verified.json"
SPLITS = ("train", "val", "test")
RESTAGE = "stage it again (python -m traincore.stage --source ... --output DIR --overwrite)"
# Shard file names are plain names inside the staging directory: no separators, no leading dot.
_SHARD_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
_SHA256 = re.compile(r"[0-9a-f]{64}")


class StagingError(ValueError):
    """The source cannot be staged or read; the message names the problem and the fix."""


@dataclass
class ShardInfo:
    """One shard: its image, label and image-digest file names, sample count and the files' sha256."""

    images: str
    labels: str
    count: int
    images_sha256: str
    labels_sha256: str
    digests: str
    digests_sha256: str


@dataclass
class SplitInfo:
    """One split: its sample count and its shards in order."""

    count: int = 0
    shards: list[ShardInfo] = field(default_factory=list)


@dataclass
class Manifest:
    """Everything a reader needs to know about a staged dataset."""

    source: str
    source_fingerprint: str  # the source as staged (data.fingerprint): a changed source stages again
    classes: list[str]
    shape: tuple[int, int, int]  # C, H, W
    mean: list[float]
    std: list[float]
    seed: int
    splits: dict[str, SplitInfo]
    dtype: str = "uint8"
    format_version: int = FORMAT_VERSION
    config: dict = field(default_factory=dict)  # the DataConfig that produced it, for cache checks

    @property
    def num_classes(self) -> int:
        """How many classes the labels index."""
        return len(self.classes)

    @property
    def sample_bytes(self) -> int:
        """Bytes of one uint8 image (C * H * W)."""
        c, h, w = self.shape
        return c * h * w

    def to_json(self) -> str:
        """The manifest.json text."""
        return json.dumps(asdict(self), indent=2)

    @classmethod
    def load(cls, directory: str | Path) -> Manifest:
        """Read ``manifest.json`` from a staged directory; clear errors when it is not one or is damaged."""
        path = Path(directory) / MANIFEST
        if not path.is_file():
            raise StagingError(f"{directory} is not a staged dataset (no {MANIFEST}); stage it first with "
                               "`python -m traincore.stage --source ... --output DIR`")
        try:
            data = path.read_bytes()
        except OSError as exc:
            raise StagingError(f"cannot read {path}: {exc.strerror}: check the file's permissions") from exc
        return cls.from_bytes(data, path)

    @classmethod
    def from_bytes(cls, data: bytes, path: str | Path) -> Manifest:
        """Parse the text of the manifest ``path`` (a file, or an object in a store)."""
        try:
            raw = json.loads(data)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise _damaged(path, f"is not valid JSON ({exc})") from exc
        if not isinstance(raw, dict):
            raise _damaged(path, f"holds a JSON {type(raw).__name__}, not an object")
        if raw.get("format_version") != FORMAT_VERSION:
            raise StagingError(f"{str(path).removesuffix(MANIFEST).rstrip('/')} has staging format "
                               f"{raw.get('format_version')}, this version reads format {FORMAT_VERSION}: "
                               "stage the data again")
        return _parse_manifest(raw, path)


def _damaged(path: str | Path, problem: str) -> StagingError:
    return StagingError(f"{path} {problem}: the staged dataset is incomplete or damaged; {RESTAGE}")


# ---- manifest schema -----------------------------------------------------------------------------

def _is_int(value: Any, low: int = 0) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= low


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _parse_manifest(raw: dict, path: str | Path) -> Manifest:
    """Check every key's presence and type, then build the Manifest; errors name the key and the file."""

    def need(obj: dict, key: str, where: str, ok: Any, expected: str) -> Any:
        if not isinstance(obj, dict) or key not in obj:
            raise _damaged(path, f"has no {where}{key!r}")
        value = obj[key]
        if not ok(value):
            raise _damaged(path, f"has {where}{key}={_short(value)}, expected {expected}")
        return value

    known = {f for f in Manifest.__dataclass_fields__}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise _damaged(path, f"has unknown key(s) {', '.join(map(repr, unknown))}")
    source = need(raw, "source", "", lambda v: isinstance(v, str), "a string")
    fingerprint = need(raw, "source_fingerprint", "", lambda v: isinstance(v, str) and v != "",
                       "a non-empty string")
    classes = need(raw, "classes", "", lambda v: isinstance(v, list) and len(v) >= 1
                   and all(isinstance(c, str) for c in v), "a non-empty list of class names")
    shape = need(raw, "shape", "", lambda v: isinstance(v, list) and len(v) == 3
                 and all(_is_int(x, 1) for x in v), "[C, H, W] of positive integers")
    channels = shape[0]
    mean = need(raw, "mean", "", lambda v: isinstance(v, list) and len(v) == channels
                and all(_is_number(x) for x in v), f"{channels} numbers (one per channel)")
    std = need(raw, "std", "", lambda v: isinstance(v, list) and len(v) == channels
               and all(_is_number(x) and x > 0 for x in v), f"{channels} positive numbers")
    seed = need(raw, "seed", "", _is_int, "a non-negative integer")
    dtype = raw.get("dtype", "uint8")
    if dtype != "uint8":
        raise _damaged(path, f"has dtype={_short(dtype)}, expected 'uint8'")
    config = raw.get("config", {})
    if not isinstance(config, dict):
        raise _damaged(path, f"has config={_short(config)}, expected an object")
    splits_raw = need(raw, "splits", "", lambda v: isinstance(v, dict) and "train" in v
                      and set(v) <= set(SPLITS), f"an object with a 'train' split and only {SPLITS}")
    splits = {}
    for name, split in splits_raw.items():
        where = f"splits.{name}."
        count = need(split, "count", where, _is_int, "a non-negative integer")
        shard_list = need(split, "shards", where, lambda v: isinstance(v, list), "a list of shards")
        shards = []
        for index, shard in enumerate(shard_list):
            at = f"{where}shards[{index}]."
            if not isinstance(shard, dict):
                raise _damaged(path, f"has {at[:-1]}={_short(shard)}, expected an object")
            extra = sorted(set(shard) - set(ShardInfo.__dataclass_fields__))
            if extra:
                raise _damaged(path, f"has unknown key(s) {', '.join(map(repr, extra))} in {at[:-1]}")
            images, labels, digests = (
                need(shard, key, at, lambda v: isinstance(v, str) and _SHARD_NAME.fullmatch(v)
                     and v not in (MANIFEST, VERIFIED), "a plain file name inside the staging directory")
                for key in ("images", "labels", "digests"))
            hashes = {key: need(shard, key, at, lambda v: isinstance(v, str) and _SHA256.fullmatch(v),
                                "a sha256 hex digest")
                      for key in ("images_sha256", "labels_sha256", "digests_sha256")}
            shards.append(ShardInfo(images=images, labels=labels, digests=digests,
                                    count=need(shard, "count", at, _is_int, "a non-negative integer"),
                                    **hashes))
        if sum(s.count for s in shards) != count:
            raise _damaged(path, f"says split {name!r} has {count} samples but its shards hold "
                                 f"{sum(s.count for s in shards)}")
        splits[name] = SplitInfo(count, shards)
    return Manifest(source=source, source_fingerprint=fingerprint, classes=classes, shape=tuple(shape),
                    mean=mean, std=std, seed=seed, splits=splits, dtype=dtype, format_version=FORMAT_VERSION,
                    config=config)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


# ---- integrity checks ----------------------------------------------------------------------------

def check_size(path: Path, expected: int) -> None:
    """A shard file must exist with exactly the size the manifest implies."""
    try:
        actual = path.stat().st_size
    except FileNotFoundError:
        actual = -1
    if actual != expected:
        raise StagingError(f"shard {path} is {'missing' if actual < 0 else f'{actual} bytes'}, expected "
                           f"{expected} bytes: the staged dataset is truncated or damaged; {RESTAGE}")


def read_labels(directory: str | Path, manifest: Manifest, shard: ShardInfo) -> np.ndarray:
    """One shard's labels, checked on every open (they are small): size, range, then sha256."""
    path = Path(directory) / shard.labels
    check_size(path, shard.count * 8)
    return check_labels(path.read_bytes(), manifest, shard, path)


def check_labels(data: bytes, manifest: Manifest, shard: ShardInfo, path: str | Path) -> np.ndarray:
    """The labels file ``path`` of ``shard`` as read: its size, range, then sha256."""
    if len(data) != shard.count * 8:
        raise StagingError(f"shard {path} is {len(data)} bytes, expected {shard.count * 8} bytes: the staged "
                           f"dataset is truncated or damaged; {RESTAGE}")
    labels = np.frombuffer(data, dtype=np.int64)
    bad = np.flatnonzero((labels < 0) | (labels >= manifest.num_classes))
    if len(bad):
        raise StagingError(f"shard {path} holds label {int(labels[bad[0]])} at position {int(bad[0])} "
                           f"({len(bad)} bad in all), outside [0, {manifest.num_classes}) for the "
                           f"{manifest.num_classes} classes of its manifest: the staged dataset is "
                           f"corrupted; {RESTAGE}")
    if hashlib.sha256(data).hexdigest() != shard.labels_sha256:
        raise StagingError(f"shard {path} fails its sha256 check: the staged dataset is corrupted; {RESTAGE}")
    return labels.copy()  # writable and independent of the bytes object


def _stamp(path: Path) -> dict[str, int]:
    stat = path.stat()
    return {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "ctime_ns": stat.st_ctime_ns}


# Shards verified by this process in a directory whose record could not be written: (path, sha256, stamp).
_unrecorded: set[tuple[str, str, tuple[int, ...]]] = set()


def verify_images(directory: str | Path, manifest: Manifest, splits: Iterable[str] | None = None, *,
                  force: bool = False) -> list[str]:
    """Hash the image shards of ``splits`` (default: all) that no record vouches for; returns those hashed.

    A shard is skipped when ``verified.json`` records its manifest sha256 with its current size, mtime
    and ctime. ``force`` hashes every shard. Concurrent readers (one per rank) serialise on a lock, so one
    hashes and the others find the record.
    """
    directory = Path(directory)
    names = list(manifest.splits) if splits is None else [s for s in splits if s in manifest.splits]
    shards = [shard for name in names for shard in manifest.splits[name].shards]
    for shard in shards:
        check_size(directory / shard.images, shard.count * manifest.sample_bytes)
    hashed: list[str] = []
    with _locked(directory):
        record = read_record(directory)
        verified: list[tuple[str, str, tuple[int, ...]]] = []
        try:
            for shard in shards:
                path = directory / shard.images
                stamp = _stamp(path)
                key = (str(path.resolve()), shard.images_sha256, tuple(stamp.values()))
                if not force and (record.get(shard.images) == {"sha256": shard.images_sha256, **stamp}
                                  or key in _unrecorded):
                    continue
                hashed.append(shard.images)
                record.pop(shard.images, None)
                if sha256_file(path) != shard.images_sha256:
                    raise StagingError(f"shard {path} fails its sha256 check: the staged dataset is "
                                       f"corrupted; {RESTAGE}")
                # The stamp from before hashing: a file changed while being hashed is hashed again next time.
                record[shard.images] = {"sha256": shard.images_sha256, **stamp}
                verified.append(key)
        finally:
            if hashed and not _write_record(directory, record):
                _unrecorded.update(verified)
    return hashed


def verify_staging(directory: str | Path, manifest: Manifest | None = None,
                   splits: Iterable[str] | None = None) -> Manifest:
    """What a run relies on, cheaply: manifest, shard sizes, labels (every time), image hashes (once)."""
    manifest = manifest or Manifest.load(directory)
    names = list(manifest.splits) if splits is None else [s for s in splits if s in manifest.splits]
    for name in names:
        for shard in manifest.splits[name].shards:
            read_labels(directory, manifest, shard)
    verify_images(directory, manifest, names)
    return manifest


def read_record(directory: Path) -> dict[str, dict]:
    """The verification record (shard name -> sha256, size, mtime_ns, ctime_ns); empty when absent or bad."""
    path = directory / VERIFIED
    try:
        raw = json.loads(path.read_bytes())
        shards = raw["shards"] if raw.get("format_version") == FORMAT_VERSION else {}
        return {name: entry for name, entry in shards.items() if isinstance(entry, dict)}
    except FileNotFoundError:
        return {}
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as exc:
        log.warning("ignoring the unreadable verification record %s (%s): its shards are hashed again",
                    path, exc)
        return {}


def _write_record(directory: Path, record: dict[str, dict]) -> bool:
    """Write ``verified.json`` atomically (temporary file, fsync, rename); False when it cannot be written."""
    path = directory / VERIFIED
    try:
        write_atomically(path, json.dumps({"format_version": FORMAT_VERSION, "shards": record}, indent=1,
                                          sort_keys=True))
        return True
    except OSError as exc:
        log.warning("cannot record the verified shards in %s (%s): this process remembers them, but the "
                    "next one hashes them again; make the directory writable to hash them only once",
                    path, exc.strerror or exc)
        return False


@contextlib.contextmanager
def _locked(directory: Path) -> Iterator[None]:
    """An exclusive lock on the manifest (readable even in a read-only directory) while verifying."""
    try:
        handle = open(directory / MANIFEST, "rb")  # noqa: SIM115 - closed below
    except OSError:
        yield
        return
    with handle:
        with contextlib.suppress(OSError):  # a filesystem without flock: verify unlocked
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        yield
