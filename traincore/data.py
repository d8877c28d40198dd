"""Staged dataset format and staging.

A staged dataset is one directory::

    manifest.json                 format version, classes, C/H/W, normalisation stats, splits + shards
    train-00000.u8                uint8 images, NCHW contiguous (count * C * H * W bytes)
    train-00000.labels.i64        int64 labels (count * 8 bytes)
    val-00000.u8 ...

Images are decoded and resized exactly once, here; readers memory-map the shards. Staging writes into
a temporary sibling directory and renames it into place, so a partial staging is never visible.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import uuid
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from traincore.config import ConfigError, DataConfig, parse_source

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
SPLITS = ("train", "val", "test")
log = logging.getLogger(__name__)


class StagingError(ValueError):
    """The source cannot be staged; the message names the problem and the fix."""


@dataclass
class ShardInfo:
    images: str
    labels: str
    count: int
    images_sha256: str
    labels_sha256: str


@dataclass
class SplitInfo:
    count: int = 0
    shards: list[ShardInfo] = field(default_factory=list)


@dataclass
class Manifest:
    """Everything a reader needs to know about a staged dataset."""

    source: str
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
        return len(self.classes)

    @property
    def sample_bytes(self) -> int:
        c, h, w = self.shape
        return c * h * w

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    @classmethod
    def load(cls, directory: str | Path) -> Manifest:
        """Read ``manifest.json`` from a staged directory, with a clear error when it is not one."""
        path = Path(directory) / MANIFEST
        if not path.is_file():
            raise StagingError(f"{directory} is not a staged dataset (no {MANIFEST}); stage it first with "
                               "`python -m traincore.stage --source ... --output DIR`")
        raw = json.loads(path.read_text())
        if raw.get("format_version") != FORMAT_VERSION:
            raise StagingError(f"{directory} has staging format {raw.get('format_version')}, this version "
                               f"reads format {FORMAT_VERSION}: stage the data again")
        raw["shape"] = tuple(raw["shape"])
        raw["splits"] = {name: SplitInfo(s["count"], [ShardInfo(**sh) for sh in s["shards"]])
                         for name, s in raw["splits"].items()}
        return cls(**raw)


# ---- sources: each yields (split, images uint8 NCHW, labels int64) chunks ----------------------------

Chunk = tuple[str, np.ndarray, np.ndarray]


def split_counts(total: int, cfg: DataConfig) -> dict[str, int]:
    """Deterministic split sizes; every split with a non-zero fraction gets at least one sample."""
    n_test = max(1, round(total * cfg.test_fraction)) if cfg.test_fraction > 0 else 0
    n_val = max(1, round(total * cfg.val_fraction)) if cfg.val_fraction > 0 else 0
    n_train = total - n_val - n_test
    if n_train < 1:
        raise StagingError(f"{total} samples leave no training split with val_fraction={cfg.val_fraction} "
                           f"and test_fraction={cfg.test_fraction}: add data or lower the fractions")
    return {"train": n_train, "val": n_val, "test": n_test}


def _resize_batch(images: np.ndarray, size: int) -> np.ndarray:
    """Bilinear-resize a float NCHW batch to size x size and quantise to uint8."""
    import torch
    import torch.nn.functional as F

    tensor = torch.from_numpy(np.ascontiguousarray(images, dtype=np.float32))
    if tensor.shape[-1] != size or tensor.shape[-2] != size:
        tensor = F.interpolate(tensor, size=(size, size), mode="bilinear", align_corners=False)
    return tensor.round_().clamp_(0, 255).to(torch.uint8).numpy()


def digits_source(cfg: DataConfig) -> tuple[list[str], Iterator[Chunk]]:
    """scikit-learn's bundled 8x8 digits (1797 real images), upscaled to ``cfg.image_size``."""
    from sklearn.datasets import load_digits

    bunch = load_digits()
    images = bunch.images.astype(np.float32) * (255.0 / 16.0)  # pixel values are 0..16
    labels = bunch.target.astype(np.int64)
    order = np.random.default_rng(cfg.seed).permutation(len(labels))
    images = np.repeat(images[order][:, None], cfg.channels, axis=1)
    labels = labels[order]

    def chunks() -> Iterator[Chunk]:
        start = 0
        for split, count in split_counts(len(labels), cfg).items():
            for lo in range(start, start + count, 512):
                hi = min(lo + 512, start + count)
                yield split, _resize_batch(images[lo:hi], cfg.image_size), labels[lo:hi]
            start += count

    return [str(d) for d in range(10)], chunks()


def synthetic_source(cfg: DataConfig) -> tuple[list[str], Iterator[Chunk]]:
    """Learnable synthetic images: a smooth per-class template plus per-sample noise and brightness."""
    rng = np.random.default_rng(cfg.seed)
    coarse = rng.uniform(0, 255, size=(cfg.synthetic_classes, cfg.channels, 4, 4)).astype(np.float32)
    templates = _resize_batch(coarse, cfg.image_size).astype(np.float32)

    def chunks() -> Iterator[Chunk]:
        for split_index, (split, count) in enumerate(split_counts(cfg.synthetic_samples, cfg).items()):
            for chunk_index, lo in enumerate(range(0, count, 1024)):
                n = min(1024, count - lo)
                local = np.random.default_rng([cfg.seed, split_index, chunk_index])
                labels = local.integers(0, cfg.synthetic_classes, size=n, dtype=np.int64)
                gain = local.uniform(0.7, 1.3, size=(n, 1, 1, 1)).astype(np.float32)
                noise = local.normal(0, 40, size=(n, *templates.shape[1:])).astype(np.float32)
                images = np.clip(templates[labels] * gain + noise, 0, 255).astype(np.uint8)
                yield split, images, labels

    return [f"class_{k}" for k in range(cfg.synthetic_classes)], chunks()


def source_chunks(cfg: DataConfig) -> tuple[list[str], Iterator[Chunk]]:
    """Class names and the chunk stream for ``cfg.source``."""
    kind, location = parse_source(cfg.source)
    if kind == "digits":
        return digits_source(cfg)
    if kind == "synthetic":
        return synthetic_source(cfg)
    from traincore.imagefolder import imagefolder_source

    return imagefolder_source(location, cfg)


# ---- writer --------------------------------------------------------------------------------------

class _ShardWriter:
    """Appends chunks of one split to size-capped shards, hashing as it writes."""

    def __init__(self, directory: Path, split: str, per_shard: int):
        self.directory, self.split, self.per_shard = directory, split, per_shard
        self.info = SplitInfo()
        self._open: tuple | None = None

    def write(self, images: np.ndarray, labels: np.ndarray) -> None:
        while len(labels):
            if self._open is None:
                self._start()
            img_file, lab_file, img_hash, lab_hash, count = self._open
            take = min(self.per_shard - count, len(labels))
            for data, handle, digest in ((images[:take], img_file, img_hash), (labels[:take], lab_file, lab_hash)):
                buffer = np.ascontiguousarray(data).tobytes()
                handle.write(buffer)
                digest.update(buffer)
            self._open = (img_file, lab_file, img_hash, lab_hash, count + take)
            images, labels = images[take:], labels[take:]
            if count + take == self.per_shard:
                self._finish()

    def close(self) -> SplitInfo:
        if self._open is not None:
            self._finish()
        return self.info

    def _start(self) -> None:
        stem = f"{self.split}-{len(self.info.shards):05d}"
        self._stem = stem
        self._open = (open(self.directory / f"{stem}.u8", "wb"), open(self.directory / f"{stem}.labels.i64", "wb"),
                      hashlib.sha256(), hashlib.sha256(), 0)

    def _finish(self) -> None:
        img_file, lab_file, img_hash, lab_hash, count = self._open
        for handle in (img_file, lab_file):
            handle.flush()
            os.fsync(handle.fileno())
            handle.close()
        self.info.shards.append(ShardInfo(f"{self._stem}.u8", f"{self._stem}.labels.i64", count,
                                          img_hash.hexdigest(), lab_hash.hexdigest()))
        self.info.count += count
        self._open = None


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


__all__ = ["Manifest", "SplitInfo", "ShardInfo", "StagingError", "stage", "summary", "split_counts",
           "FORMAT_VERSION", "SPLITS", "ConfigError"]
