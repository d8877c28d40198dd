"""ImageFolder source: ``<root>/<class>/<image>`` on a local path or any fsspec URI.

Files are listed once, assigned to splits by a seeded permutation, then decoded and resized in a process
pool (decoding is CPU-bound and releases no GIL) and streamed to the shard writer in split order. Decode
tasks hold at most CHUNK_BYTES of pixels and at most IN_FLIGHT_BYTES of results wait for the writer, so
memory stays bounded whatever the image size and the worker count.

Symlinks (local paths and file:// URIs): a class directory or image may be a link to elsewhere inside the
source root; an entry whose resolved path leaves the root is refused (StagingError naming the entry and
its target), never skipped silently, so a tree staged here is exactly the tree that was asked for.
"""

from __future__ import annotations

import io
import os
from collections import deque
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

import numpy as np

from traincore.config import DataConfig
from traincore.data import StagingError
from traincore.sources import CHUNK_BYTES, Chunk, Source, chunk_images, split_counts

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".gif", ".tif", ".tiff", ".webp", ".ppm", ".pgm")
CHUNK = 256  # images per decode task at most: large enough to amortise pickling, small enough to stream
IN_FLIGHT_BYTES = 4 * CHUNK_BYTES  # decoded pixels submitted ahead of the writer, across all workers


def list_images(location: str) -> tuple[list[str], list[tuple[str, int]]]:
    """Class names (sorted sub-directories) and (path, label) pairs, with clear errors for bad layouts."""
    import fsspec

    fs, root = fsspec.core.url_to_fs(location)
    if not fs.exists(root):
        raise StagingError(f"imagefolder location {location!r} does not exist: check the path or URI")
    if not fs.isdir(root):
        raise StagingError(f"imagefolder location {location!r} is a file: point it at a directory with one "
                           "sub-directory per class")
    contained = _containment(fs, root, location)
    classes = sorted(os.path.basename(p.rstrip("/")) for p in fs.ls(root, detail=False) if fs.isdir(p))
    files: list[tuple[str, int]] = []
    for label, name in enumerate(classes):
        directory = f"{root.rstrip('/')}/{name}"
        contained(directory)
        found = sorted(p for p in fs.find(directory) if p.lower().endswith(IMAGE_EXTENSIONS))
        for path in found:
            contained(path)
        files.extend((fs.unstrip_protocol(p), label) for p in found)
    if not files:
        raise StagingError(f"imagefolder location {location!r} holds no images: expected "
                           f"<root>/<class>/<image> with extensions {', '.join(IMAGE_EXTENSIONS)}")
    used = sorted({label for _, label in files})
    if len(used) < 2:
        raise StagingError(f"imagefolder location {location!r} has images for only one class "
                           f"({classes[used[0]]!r}): classification needs at least two class directories")
    return classes, files


def _containment(fs, root: str, location: str):
    """A check that a listed entry resolves inside the source root (local filesystems; others have no
    symlinks), refusing one that escapes it with the entry, its target and the fix."""
    from fsspec.implementations.local import LocalFileSystem

    if not isinstance(fs, LocalFileSystem):
        return lambda path: None
    real_root = os.path.realpath(root)

    def check(path: str) -> None:
        real = os.path.realpath(path)
        if os.path.commonpath([real_root, real]) != real_root:
            raise StagingError(f"imagefolder location {location!r}: {path} resolves to {real}, outside the "
                               f"source root {real_root}: staging follows no link out of the tree; copy "
                               "the files into it or point data.source at the real directory")

    return check


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


def imagefolder_source(location: str, cfg: DataConfig) -> Source:
    """Class names, image count and the (split, images, labels) chunk stream for an ImageFolder tree."""
    classes, files = list_images(location)
    order = np.random.default_rng(cfg.seed).permutation(len(files))
    counts = split_counts(len(files), cfg)
    workers = cfg.decode_workers or os.cpu_count() or 1
    per_task = chunk_images(cfg.channels * cfg.image_size ** 2, CHUNK)
    ahead = max(2, min(2 * workers, IN_FLIGHT_BYTES // (per_task * cfg.channels * cfg.image_size ** 2)))

    def chunks() -> Iterator[Chunk]:
        start = 0
        jobs = []
        for split, count in counts.items():
            picked = [files[i] for i in order[start:start + count]]
            start += count
            for lo in range(0, len(picked), per_task):
                part = picked[lo:lo + per_task]
                jobs.append((split, [p for p, _ in part], np.array([lab for _, lab in part], dtype=np.int64)))
        if workers == 1:
            for split, paths, labels in jobs:
                yield split, _decode_chunk(paths, cfg.image_size, cfg.channels), labels
            return
        with ProcessPoolExecutor(max_workers=min(workers, ahead)) as pool:
            # A bounded window of tasks, taken in submission order: the output is deterministic whatever
            # the worker count, and at most ``ahead`` decoded chunks wait for the writer.
            pending: deque = deque()
            queue = iter(jobs)
            try:
                for split, paths, labels in queue:
                    pending.append((split, labels, pool.submit(_decode_chunk, paths, cfg.image_size,
                                                               cfg.channels)))
                    if len(pending) >= ahead:
                        break
                while pending:
                    split, labels, future = pending.popleft()
                    images = future.result()
                    job = next(queue, None)
                    if job is not None:
                        pending.append((job[0], job[2], pool.submit(_decode_chunk, job[1], cfg.image_size,
                                                                    cfg.channels)))
                    yield split, images, labels
            except BrokenProcessPool as exc:
                raise StagingError(f"a decode process died while staging {location!r} (killed, most likely "
                                   "out of memory): lower data.decode_workers or data.image_size, or give "
                                   "the stage more memory") from exc
            finally:
                for _, _, future in pending:
                    future.cancel()

    return Source(classes, len(files), chunks())
