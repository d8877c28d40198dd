"""Staging: decode a source once, write it as size-capped uint8 shards, publish it atomically.

Staging writes into a temporary sibling directory, writes the manifest last and renames the directory into
place, so a partial staging is never visible. Before writing, the estimated size is checked against the
free space at the output; a full disk or an unwritable output mid-way leaves nothing behind and raises a
StagingError naming the path. An existing staging of the same settings is verified (data.manifest) and
reused, or, when a shard fails verification, staged again and swapped into place.

The source is fingerprinted (data.fingerprint) from the very listing that is staged, and the manifest
records that fingerprint: an existing staging of the same settings whose fingerprint differs (the folder
grew or changed) is staged again in its place; one that matches is reused.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import functools
import hashlib
import logging
import multiprocessing
import os
import shutil
import sys
import uuid
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from typing import BinaryIO

import numpy as np

from traincore.config import DataConfig, parse_source
from traincore.data.fingerprint import listing_fingerprint, source_fingerprint
from traincore.data.imagefolder import imagefolder_source, list_images
from traincore.data.manifest import (
    MANIFEST,
    SPLITS,
    Manifest,
    ShardInfo,
    SplitInfo,
    StagingError,
    verify_staging,
)
from traincore.data.partitions import (
    PartitionRecord,
    check_partitions,
    choose_partitions,
    merge_records,
    partition_ranges,
    staging_key,
)
from traincore.data.progress import ProgressMeter
from traincore.data.pysource import label_classes, python_source
from traincore.data.sources import BAND, Source, digits_source, synthetic_source
from traincore.files import publish_directory, write_durably

log = logging.getLogger(__name__)


def open_source(cfg: DataConfig, progress: Callable[[str], None] = log.info,
                storage_options: dict | None = None) -> tuple[Source, str]:
    """The source of ``cfg.source`` (class names, sample count, chunk stream) and the fingerprint of exactly
    what it will stage: an imagefolder is listed once, and only the listed files are read, through fsspec
    with ``storage_options`` (credentials, endpoint; by default fsspec's own)."""
    kind, location = parse_source(cfg.source)
    if kind == "imagefolder":
        listing = list_images(location, progress=progress, storage_options=storage_options)
        return imagefolder_source(listing, cfg, storage_options), listing_fingerprint(listing)
    if kind == "python":
        return python_source(location, cfg), source_fingerprint(cfg)
    source = digits_source(cfg) if kind == "digits" else synthetic_source(cfg)
    return source, source_fingerprint(cfg)


def _image_digests(rows: np.ndarray) -> np.ndarray:
    """Each image's raw sha256 (32 bytes a row): what a streaming reader checks a fetched sample against."""
    return np.frombuffer(b"".join(hashlib.sha256(row).digest() for row in rows), np.uint8).reshape(-1, 32)


# ---- writer --------------------------------------------------------------------------------------

class _ShardWriter:
    """Appends chunks of one split to size-capped shards, hashing as it writes."""

    def __init__(self, directory: Path, split: str, per_shard: int, first_shard: int = 0):
        self.directory, self.split, self.per_shard = directory, split, per_shard
        self.first_shard = first_shard  # the staging-wide index of this writer's first shard (its name)
        self.info = SplitInfo()
        self._files: list[BinaryIO] = []  # the open shard's images and labels files; empty between shards
        self._hashes: list = []
        self._count = 0

    def write(self, images: np.ndarray, labels: np.ndarray) -> None:
        """Append one chunk, starting a new shard whenever the open one is full."""
        while len(labels):
            if not self._files:
                self._start()
            take = min(self.per_shard - self._count, len(labels))
            rows = np.ascontiguousarray(images[:take]).reshape(take, -1)
            parts = (rows, labels[:take], _image_digests(rows))
            for data, handle, digest in zip(parts, self._files, self._hashes, strict=True):
                buffer = np.ascontiguousarray(data).reshape(-1).view(np.uint8)  # no copy of the chunk
                handle.write(buffer)
                digest.update(buffer)
            self._count += take
            images, labels = images[take:], labels[take:]
            if self._count == self.per_shard:
                self._finish()

    def close(self) -> SplitInfo:
        """Finish the open shard, if any, and return the split's record."""
        if self._files:
            self._finish()
        return self.info

    def discard(self) -> None:
        """Close the open shard's files after a failure (the temporary directory is removed anyway)."""
        for handle in self._files:
            with contextlib.suppress(OSError):  # a full disk fails the final flush too
                handle.close()
        self._files = []

    def _names(self) -> tuple[str, str, str]:
        stem = f"{self.split}-{self.first_shard + len(self.info.shards):05d}"
        return f"{stem}.u8", f"{stem}.labels.i64", f"{stem}.sha256"

    def _start(self) -> None:
        self._files = [open(self.directory / name, "wb") for name in self._names()]
        self._hashes = [hashlib.sha256() for _ in self._files]
        self._count = 0

    def _finish(self) -> None:
        for handle in self._files:
            handle.flush()
            os.fsync(handle.fileno())  # on disk before the manifest that vouches for it is written
            handle.close()
        images, labels, digests = self._names()
        images_sha256, labels_sha256, digests_sha256 = (digest.hexdigest() for digest in self._hashes)
        self.info.shards.append(ShardInfo(images, labels, self._count, images_sha256, labels_sha256, digests,
                                          digests_sha256))
        self.info.count += self._count
        self._files = []


def _channel_moments(images: np.ndarray) -> tuple[list[int], list[int]]:
    """Exact per-channel sums of pixel values and of their squares, in bands of at most BAND values."""
    n, c = images.shape[:2]
    flat = images.reshape(n, c, -1)
    pixels = flat.shape[2]
    per_band = max(1, BAND // pixels)
    sums, squares = [0] * c, [0] * c
    for channel in range(c):
        for i in range(0, n, per_band):
            for a in range(0, pixels, BAND):
                values = flat[i:i + per_band, channel, a:a + BAND].astype(np.uint32)
                sums[channel] += int(values.sum(dtype=np.uint64))
                squares[channel] += int(np.square(values, out=values).sum(dtype=np.uint64))
    return sums, squares


def write_partition(directory: Path, cfg: DataConfig, source: Source, fingerprint: str, index: int = 0,
                    partitions: int = 1, progress: Callable[[str], None] = log.info) -> PartitionRecord:
    """Write partition ``index`` of ``partitions`` of ``source`` (traincore.data.partitions) into
    ``directory`` as shards named by their place in the whole staging; its record for the manifest."""
    ranges = partition_ranges(source.counts, cfg.samples_per_shard, partitions)[index]
    writers = {split: _ShardWriter(directory, split, cfg.samples_per_shard, lo // cfg.samples_per_shard)
               for split, (lo, _) in ranges.items()}
    sums, squares, pixels = [0] * cfg.channels, [0] * cfg.channels, 0
    meter = ProgressMeter(sum(hi - lo for lo, hi in ranges.values()), progress)
    try:
        for split, images, labels in source.read(ranges):
            if split == "train":
                chunk_sums, chunk_squares = _channel_moments(images)
                sums = [a + b for a, b in zip(sums, chunk_sums, strict=True)]
                squares = [a + b for a, b in zip(squares, chunk_squares, strict=True)]
                pixels += images.shape[0] * images.shape[2] * images.shape[3]
            writers[split].write(images, labels)
            meter.advance(len(labels))
        splits = {split: w.close() for split, w in writers.items()}
    finally:
        meter.close()
        for writer in writers.values():
            writer.discard()
    return PartitionRecord(index, partitions, fingerprint, list(source.classes), splits, sums, squares,
                           pixels, dict(source.first_item))


def stage_partition(cfg: DataConfig, directory: str | Path, index: int, partitions: int, fingerprint: str, *,
                    progress: Callable[[str], None] = log.info,
                    storage_options: dict | None = None) -> PartitionRecord:
    """Stage partition ``index`` of ``partitions`` into ``directory`` (which must exist), in its own task or
    process: the source is opened again and must still be the state ``fingerprint`` names, so partitions of
    one staging never mix two states of a source."""
    source, now = open_source(cfg, progress, storage_options)
    if now != fingerprint:
        raise StagingError(f"{cfg.source} changed while it was being staged (it was {fingerprint} when the "
                           f"staging began, it is {now} now): stage it again once it stops changing")
    return write_partition(Path(directory), cfg, source, fingerprint, index, partitions, progress)


def merge_partitions(cfg: DataConfig, records: list[PartitionRecord]) -> Manifest:
    """The manifest of a staging whose partitions were staged apart (:func:`stage_partition`), its classes
    named as one staging names them (a python: source's labels, by :func:`label_classes`)."""
    kind, location = parse_source(cfg.source)
    namer = functools.partial(label_classes, location) if kind == "python" else None
    return merge_records(cfg, records, namer)


def _partition_lines(prefix: str, line: str) -> None:
    """A partition process's progress line, on stderr as the parent's log lines are."""
    print(f"{prefix}: {line}", file=sys.stderr, flush=True)


def _write_partitions(tmp: Path, cfg: DataConfig, source: Source, fingerprint: str, partitions: int,
                      progress: Callable[[str], None], storage_options: dict | None) -> Manifest:
    """All partitions into ``tmp``: one in this process, several in their own processes (spawned: the
    parent may have run torch's thread pool, which a forked child cannot use), sharing the decode workers;
    then the manifest from their records."""
    if partitions == 1:
        return merge_records(cfg, [write_partition(tmp, cfg, source, fingerprint, progress=progress)],
                             source.name_classes)
    workers = min(partitions, os.cpu_count() or 1)
    each = dataclasses.replace(cfg, decode_workers=max(1, (cfg.decode_workers or os.cpu_count() or 1)
                                                       // workers))
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = [pool.submit(stage_partition, each, tmp, index, partitions, fingerprint,
                               progress=functools.partial(_partition_lines,
                                                          f"partition {index + 1}/{partitions}"),
                               storage_options=storage_options)
                   for index in range(partitions)]
        try:
            records = [future.result() for future in futures]
        except BrokenProcessPool as exc:
            raise StagingError(
                f"a process staging one of the {partitions} partitions died without an error (killed, out of "
                "memory, or it could not start: a script that calls stage() with partitions > 1 must do so "
                "under `if __name__ == \"__main__\":`, since the partitions run in spawned processes); "
                "nothing was published: stage with partitions=1 to see the failure in this process, or give "
                "it more memory") from exc
    return merge_records(cfg, records, source.name_classes)


def stage(cfg: DataConfig, output: str | Path, overwrite: bool = False, *, replace_unusable: bool = False,
          progress: Callable[[str], None] = log.info, storage_options: dict | None = None,
          partitions: int = 1) -> Manifest:
    """Stage ``cfg.source`` into ``output`` atomically and return its manifest.

    An existing complete staging of the same settings and source fingerprint is verified and reused; if
    one of its shards fails verification it is staged again and swapped into place (with a warning naming
    the file); one of an earlier state of the source (another fingerprint) is staged again in its place.
    Anything else already at ``output`` is an error unless ``overwrite`` is set, or ``replace_unusable``
    (for callers that own ``output``, such as the stage task's cache directory): then an unreadable or
    different staging there is replaced. ``progress`` gets the imagefolder listing's progress lines and,
    away from a terminal, the staging's (:class:`~traincore.data.progress.ProgressMeter`);
    ``storage_options`` are the fsspec options an imagefolder is read with (see :func:`open_source`).
    ``partitions`` > 1 stages that many partitions in parallel processes (traincore.data.partitions; the
    same bytes as one), 0 chooses the count from the source's size.
    """
    check_partitions(partitions)
    output = Path(output)
    if not replace_unusable:
        _check_replaceable(output)
    source, fingerprint = open_source(cfg, progress, storage_options)
    partitions = choose_partitions(cfg, source.counts, partitions)
    if output.exists() and not overwrite:
        existing = _reusable(output, cfg, fingerprint, replace_unusable)
        if existing is not None:
            log.info("already staged at %s (%s); reusing it", output, summary(existing))
            return existing
    tmp = output.parent / f".{output.name}.staging-{uuid.uuid4().hex[:8]}"
    try:
        output.parent.mkdir(parents=True, exist_ok=True)
        check_free_space(output, estimated_bytes(cfg, source.count))
        tmp.mkdir()
    except OSError as exc:
        raise _os_error(exc, output, tmp, setup=True) from exc
    try:
        manifest = _write_partitions(tmp, cfg, source, fingerprint, partitions, progress, storage_options)
        _publish(tmp, output, manifest)
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(exc, OSError) and exc.errno in _WRITE_ERRNOS:
            raise _os_error(exc, output, tmp) from exc
        raise
    log.info("staged %s", summary(manifest))
    return manifest


_NO_SPACE = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}
_WRITE_ERRNOS = _NO_SPACE | {errno.EROFS, errno.EACCES, errno.EPERM}


def _os_error(exc: OSError, output: Path, tmp: Path, setup: bool = False) -> Exception:
    """A failure to create or write the staging as a StagingError naming the path and the fix; other OS
    errors while writing (none expected) pass unchanged."""
    where = exc.filename or tmp
    if exc.errno in _NO_SPACE:
        return StagingError(f"no space left to stage into {output} (writing {where}: {exc.strerror}); "
                            "nothing was published and the partial staging was removed: free space on that "
                            "disk or choose another --output")
    if setup or exc.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
        return StagingError(f"cannot write the staging {output}: {exc.strerror} ({where}): choose a "
                            "writable --output or fix the directory's permissions")
    return exc


def estimated_bytes(cfg: DataConfig, count: int) -> int:
    """Bytes a staging of ``count`` samples writes: pixels and labels, plus a block per shard file."""
    shards = -(-count // cfg.samples_per_shard) + len(SPLITS)
    return count * (cfg.channels * cfg.image_size ** 2 + 8) + shards * 2 * 4096 + (64 << 10)


def check_free_space(output: Path, needed: int) -> None:
    """Refuse up front when the disk holding ``output`` has less free space than the staging needs."""
    free = shutil.disk_usage(output.parent).free
    if needed > free:
        raise StagingError(f"not enough space to stage into {output}: the staging needs about "
                           f"{needed / 2**20:,.1f} MiB but {output.parent} has {free / 2**20:,.1f} MiB free; "
                           "free space, choose another --output, or lower data.image_size or the sample "
                           "count")


def _publish(tmp: Path, output: Path, manifest: Manifest) -> None:
    """Write the manifest last, then rename the directory into place (atomic on one filesystem)."""
    write_durably(tmp / MANIFEST, manifest.to_json())
    if output.exists():
        old = output.parent / f".{output.name}.old-{uuid.uuid4().hex[:8]}"
        output.rename(old)
        publish_directory(tmp, output)
        if old.is_dir() and not old.is_symlink():
            shutil.rmtree(old, ignore_errors=True)
        else:  # a file or link the caller let this staging replace
            old.unlink()
    else:
        publish_directory(tmp, output)


def _check_replaceable(output: Path) -> None:
    """StagingError unless ``output`` is absent, an empty directory or a staging (it has a manifest): a
    staging in its place replaces the whole directory, so anything else there (a file, a folder of one's own
    files, the current directory) is refused, with --overwrite too."""
    if not output.exists():
        return
    if output.is_dir() and ((output / MANIFEST).is_file() or not any(output.iterdir())):
        return
    what = "a directory of other files" if output.is_dir() else "a file"
    raise StagingError(f"{output} is {what}, not a staging (no {MANIFEST}): staging there would replace it; "
                       "choose a new or empty --output (--overwrite replaces only an earlier staging)")


def _reusable(output: Path, cfg: DataConfig, fingerprint: str, replace_unusable: bool) -> Manifest | None:
    """The verified staging of ``cfg`` with this source ``fingerprint`` at ``output``, or None to stage
    again; raises when ``output`` holds something else that only ``overwrite`` (or ``replace_unusable``)
    may replace."""
    try:
        manifest = Manifest.load(output)
        problem = (None if manifest.config == staging_key(cfg) else
                   f"is not a staging of {cfg.source!r} with these settings")
    except StagingError as exc:
        manifest, problem = None, f"is not a usable staging ({exc})"
    if problem is not None:
        if not replace_unusable:
            raise StagingError(f"{output} already exists and {problem}: choose another --output or pass "
                               "--overwrite")
        log.warning("%s %s; staging it again in its place", output, problem)
        return None
    if manifest.source_fingerprint != fingerprint:
        log.info("%s holds %s as it was (%s); it is %s now: staging it again in its place", output,
                 cfg.source, manifest.source_fingerprint, fingerprint)
        return None
    try:
        verify_staging(output, manifest)
    except StagingError as exc:
        log.warning("the staging at %s fails verification, staging it again in its place: %s", output, exc)
        return None
    return manifest


def summary(manifest: Manifest) -> str:
    """One line: source, classes, shape, split sizes and the source fingerprint."""
    c, h, w = manifest.shape
    counts = ", ".join(f"{name} {info.count}" for name, info in manifest.splits.items())
    return (f"{manifest.source}: {manifest.num_classes} classes, {c}x{h}x{w} uint8, {counts} samples, "
            f"source {manifest.source_fingerprint}")


def directory_bytes(directory: str | Path) -> int:
    """Total size of the files in a staged directory (the verification record included)."""
    return sum(p.stat().st_size for p in Path(directory).iterdir() if p.is_file())
