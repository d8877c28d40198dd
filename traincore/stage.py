"""Staging: decode a source once, write it as size-capped uint8 shards, publish it atomically.

Staging writes into a temporary sibling directory, writes the manifest last and renames the directory into
place, so a partial staging is never visible. An existing staging of the same settings is reused.

    python -m traincore.stage --source digits --output DIR [--image-size N] [--seed S]
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import os
import shutil
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import BinaryIO

import numpy as np

from traincore.config import ConfigError, DataConfig, parse_source
from traincore.data import MANIFEST, SPLITS, Manifest, ShardInfo, SplitInfo, StagingError
from traincore.imagefolder import imagefolder_source
from traincore.sources import Chunk, digits_source, synthetic_source

log = logging.getLogger(__name__)


def source_chunks(cfg: DataConfig) -> tuple[list[str], Iterator[Chunk]]:
    """Class names and the chunk stream for ``cfg.source``."""
    kind, location = parse_source(cfg.source)
    if kind == "digits":
        return digits_source(cfg)
    if kind == "synthetic":
        return synthetic_source(cfg)
    return imagefolder_source(location, cfg)


# ---- writer --------------------------------------------------------------------------------------

class _ShardWriter:
    """Appends chunks of one split to size-capped shards, hashing as it writes."""

    def __init__(self, directory: Path, split: str, per_shard: int):
        self.directory, self.split, self.per_shard = directory, split, per_shard
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
            parts = (images[:take], labels[:take])
            for data, handle, digest in zip(parts, self._files, self._hashes, strict=True):
                buffer = np.ascontiguousarray(data).tobytes()
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

    def _names(self) -> tuple[str, str]:
        stem = f"{self.split}-{len(self.info.shards):05d}"
        return f"{stem}.u8", f"{stem}.labels.i64"

    def _start(self) -> None:
        self._files = [open(self.directory / name, "wb") for name in self._names()]
        self._hashes = [hashlib.sha256(), hashlib.sha256()]
        self._count = 0

    def _finish(self) -> None:
        for handle in self._files:
            handle.flush()
            os.fsync(handle.fileno())  # on disk before the manifest that vouches for it is written
            handle.close()
        images, labels = self._names()
        images_sha256, labels_sha256 = (digest.hexdigest() for digest in self._hashes)
        self.info.shards.append(ShardInfo(images, labels, self._count, images_sha256, labels_sha256))
        self.info.count += self._count
        self._files = []


def _write_all(tmp: Path, cfg: DataConfig, classes: list[str], chunks: Iterator[Chunk]) -> Manifest:
    writers = {split: _ShardWriter(tmp, split, cfg.samples_per_shard) for split in SPLITS}
    sums = np.zeros(cfg.channels, dtype=np.float64)
    squares = np.zeros(cfg.channels, dtype=np.float64)
    pixels = 0
    for split, images, labels in chunks:
        if split == "train":
            scaled = images.astype(np.float64) / 255.0
            sums += scaled.sum(axis=(0, 2, 3))
            squares += (scaled ** 2).sum(axis=(0, 2, 3))
            pixels += scaled.shape[0] * scaled.shape[2] * scaled.shape[3]
        writers[split].write(images, labels)
    mean = sums / max(pixels, 1)
    std = np.sqrt(np.maximum(squares / max(pixels, 1) - mean ** 2, 1e-12))
    return Manifest(source=cfg.source, classes=classes, shape=(cfg.channels, cfg.image_size, cfg.image_size),
                    mean=[round(float(m), 6) for m in mean], std=[round(float(s), 6) for s in std],
                    seed=cfg.seed, splits={split: w.close() for split, w in writers.items()},
                    config=staging_key(cfg))


def stage(cfg: DataConfig, output: str | Path, overwrite: bool = False) -> Manifest:
    """Stage ``cfg.source`` into ``output`` atomically and return its manifest.

    An existing complete staging of the same source, size and seed is reused; anything else already at
    ``output`` is an error unless ``overwrite`` is set.
    """
    output = Path(output)
    if output.exists() and not overwrite:
        existing = _reusable(output, cfg)
        if existing is not None:
            log.info("already staged at %s (%s); reusing it", output, summary(existing))
            return existing
        raise StagingError(f"{output} already exists and is not a staging of {cfg.source!r} with "
                           "these settings: choose another --output or pass --overwrite")
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = output.parent / f".{output.name}.staging-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        classes, chunks = source_chunks(cfg)
        manifest = _write_all(tmp, cfg, classes, chunks)
        _publish(tmp, output, manifest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info("staged %s", summary(manifest))
    return manifest


def _publish(tmp: Path, output: Path, manifest: Manifest) -> None:
    """Write the manifest last, then rename the directory into place (atomic on one filesystem)."""
    (tmp / MANIFEST).write_text(manifest.to_json())
    if output.exists():
        old = output.parent / f".{output.name}.old-{uuid.uuid4().hex[:8]}"
        output.rename(old)
        tmp.rename(output)
        shutil.rmtree(old, ignore_errors=True)
    else:
        tmp.rename(output)


def _reusable(output: Path, cfg: DataConfig) -> Manifest | None:
    try:
        manifest = Manifest.load(output)
    except (StagingError, ValueError, KeyError, TypeError):
        return None
    return manifest if manifest.config == staging_key(cfg) else None


def staging_key(cfg: DataConfig) -> dict:
    """The DataConfig fields that change the staged bytes (decode parallelism does not)."""
    key = asdict(cfg)
    key.pop("decode_workers")
    return key


def summary(manifest: Manifest) -> str:
    """One line: source, classes, shape and split sizes."""
    c, h, w = manifest.shape
    counts = ", ".join(f"{name} {info.count}" for name, info in manifest.splits.items())
    return (f"{manifest.source}: {manifest.num_classes} classes, {c}x{h}x{w} uint8, {counts} samples")


def directory_bytes(directory: str | Path) -> int:
    """Total size of the files in a staged directory."""
    return sum(p.stat().st_size for p in Path(directory).iterdir() if p.is_file())


# ---- CLI ------------------------------------------------------------------------------------------

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The CLI flags; every DataConfig field that changes the staged bytes has one."""
    parser = argparse.ArgumentParser(prog="python -m traincore.stage", description=__doc__.splitlines()[0])
    defaults = DataConfig()
    parser.add_argument("--source", required=True,
                        help="digits | synthetic | imagefolder:<path-or-URI> (file://, s3://, gs://...)")
    parser.add_argument("--output", required=True, help="directory to create (published atomically)")
    parser.add_argument("--image-size", type=int, default=defaults.image_size, help="square side in pixels")
    parser.add_argument("--channels", type=int, default=defaults.channels, choices=(1, 3))
    parser.add_argument("--seed", type=int, default=defaults.seed, help="split and synthetic-data seed")
    parser.add_argument("--val-fraction", type=float, default=defaults.val_fraction)
    parser.add_argument("--test-fraction", type=float, default=defaults.test_fraction)
    parser.add_argument("--samples", type=int, default=defaults.synthetic_samples,
                        help="synthetic: sample count")
    parser.add_argument("--classes", type=int, default=defaults.synthetic_classes,
                        help="synthetic: class count")
    parser.add_argument("--samples-per-shard", type=int, default=defaults.samples_per_shard)
    parser.add_argument("--decode-workers", type=int, default=0,
                        help="imagefolder decode processes (0 = cores)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing, different staging")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """CLI: stage and print one summary line; exit code 2 for a bad source or settings."""
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        cfg = DataConfig(source=args.source, image_size=args.image_size, channels=args.channels,
                         seed=args.seed, val_fraction=args.val_fraction, test_fraction=args.test_fraction,
                         synthetic_samples=args.samples, synthetic_classes=args.classes,
                         samples_per_shard=args.samples_per_shard, decode_workers=args.decode_workers)
        start = time.perf_counter()
        manifest = stage(cfg, args.output, overwrite=args.overwrite)
    except (ConfigError, StagingError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    size, seconds = directory_bytes(args.output) / 2**20, time.perf_counter() - start
    print(f"staged {summary(manifest)} -> {args.output} ({size:.1f} MiB, {seconds:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
