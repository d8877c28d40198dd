"""ImageFolder source: ``<root>/<class>/<image>`` on a local path or any fsspec URI.

Files are listed once, assigned to splits by a seeded permutation, then decoded and resized in a process
pool (decoding is CPU-bound and releases no GIL) and streamed to the shard writer in split order.
"""

from __future__ import annotations

import io
import os
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor

import numpy as np

from traincore.config import DataConfig
from traincore.data import StagingError
from traincore.sources import Chunk, split_counts

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".gif", ".tif", ".tiff", ".webp", ".ppm", ".pgm")
CHUNK = 256  # images per decode task: large enough to amortise pickling, small enough to stream


def list_images(location: str) -> tuple[list[str], list[tuple[str, int]]]:
    """Class names (sorted sub-directories) and (path, label) pairs, with clear errors for bad layouts."""
    import fsspec

    fs, root = fsspec.core.url_to_fs(location)
    if not fs.exists(root):
        raise StagingError(f"imagefolder location {location!r} does not exist: check the path or URI")
    if not fs.isdir(root):
        raise StagingError(f"imagefolder location {location!r} is a file: point it at a directory with one "
                           "sub-directory per class")
    classes = sorted(os.path.basename(p.rstrip("/")) for p in fs.ls(root, detail=False) if fs.isdir(p))
    files: list[tuple[str, int]] = []
    for label, name in enumerate(classes):
        found = sorted(p for p in fs.find(f"{root.rstrip('/')}/{name}")
                       if p.lower().endswith(IMAGE_EXTENSIONS))
        files.extend((fs.unstrip_protocol(p), label) for p in found)
    if not files:
        raise StagingError(f"imagefolder location {location!r} holds no images: expected "
                           f"<root>/<class>/<image> with extensions {', '.join(IMAGE_EXTENSIONS)}")
    used = sorted({label for _, label in files})
    if len(used) < 2:
        raise StagingError(f"imagefolder location {location!r} has images for only one class "
                           f"({classes[used[0]]!r}): classification needs at least two class directories")
    return classes, files


def _decode(path: str, size: int, channels: int) -> np.ndarray:
    """Decode one image, resize its shorter side to ``size``, centre-crop to size x size; CHW uint8."""
    import fsspec
    from PIL import Image, UnidentifiedImageError

    try:
        with fsspec.open(path, "rb") as handle:
            image = Image.open(io.BytesIO(handle.read()))
            image = image.convert("RGB" if channels == 3 else "L")
    except (UnidentifiedImageError, OSError, ValueError) as exc:
        raise StagingError(f"cannot read image {path}: {exc}. Remove or replace the file and stage "
                           "again") from exc
    scale = size / min(image.size)
    width, height = max(size, round(image.width * scale)), max(size, round(image.height * scale))
    image = image.resize((width, height), Image.BILINEAR)
    left, top = (width - size) // 2, (height - size) // 2
    array = np.asarray(image.crop((left, top, left + size, top + size)), dtype=np.uint8)
    return array[None] if channels == 1 else array.transpose(2, 0, 1)


def _decode_chunk(paths: list[str], size: int, channels: int) -> np.ndarray:
    return np.stack([_decode(p, size, channels) for p in paths])


def imagefolder_source(location: str, cfg: DataConfig) -> tuple[list[str], Iterator[Chunk]]:
    """Class names and the (split, images, labels) chunk stream for an ImageFolder tree."""
    classes, files = list_images(location)
    order = np.random.default_rng(cfg.seed).permutation(len(files))
    counts = split_counts(len(files), cfg)
    workers = cfg.decode_workers or os.cpu_count() or 1

    def chunks() -> Iterator[Chunk]:
        start = 0
        jobs = []
        for split, count in counts.items():
            picked = [files[i] for i in order[start:start + count]]
            start += count
            for lo in range(0, len(picked), CHUNK):
                part = picked[lo:lo + CHUNK]
                jobs.append((split, [p for p, _ in part], np.array([lab for _, lab in part], dtype=np.int64)))
        if workers == 1:
            for split, paths, labels in jobs:
                yield split, _decode_chunk(paths, cfg.image_size, cfg.channels), labels
            return
        with ProcessPoolExecutor(max_workers=workers) as pool:
            # map keeps submission order, so the output is deterministic whatever the worker count.
            decoded = pool.map(_decode_chunk, [paths for _, paths, _ in jobs],
                               [cfg.image_size] * len(jobs), [cfg.channels] * len(jobs))
            for (split, _, labels), images in zip(jobs, decoded, strict=True):
                yield split, images, labels

    return classes, chunks()
