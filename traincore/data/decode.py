"""Decoding images for staging, shared by the sources that read encoded images (imagefolder, python:).

``convert`` and ``fit`` turn one PIL image into the staged CHW uint8 array; ``decoded_chunks`` runs a
source's decode jobs in a process pool with a bounded window in flight, in job order.
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

import numpy as np

from traincore.config import DataConfig
from traincore.data.manifest import StagingError
from traincore.data.sources import CHUNK_BYTES, Chunk

CHUNK = 256  # images per decode task at most: large enough to amortise pickling, small enough to stream
IN_FLIGHT_BYTES = 4 * CHUNK_BYTES  # decoded pixels submitted ahead of the writer, across all workers


def fit(image, size: int, channels: int) -> np.ndarray:
    """A PIL image already in its staging mode, its shorter side resized to ``size`` (bilinear) and
    centre-cropped to size x size; CHW uint8."""
    from PIL import Image

    scale = size / min(image.size)
    width, height = max(size, round(image.width * scale)), max(size, round(image.height * scale))
    image = image.resize((width, height), Image.BILINEAR)
    left, top = (width - size) // 2, (height - size) // 2
    array = np.asarray(image.crop((left, top, left + size, top + size)), dtype=np.uint8)
    return array[None] if channels == 1 else array.transpose(2, 0, 1)


def convert(image, mode: str, path: str):
    """``image`` in ``mode`` ("RGB" or "L") with 8-bit channels.

    16-bit greyscale (Pillow's I;16 modes) is scaled to 8 bits (Pillow's own conversion would clip every
    value above 255 to white); 16-bit colour PNGs Pillow already reads as 8-bit RGB(A). Alpha is dropped,
    keeping the stored colours (as torchvision's loader does); a palette image with a transparent colour goes
    through RGBA, as Pillow advises. CMYK uses Pillow's conversion (no ICC colour management); a
    multi-frame image (GIF, TIFF) gives its first frame. 32-bit integer and float images (modes I and F)
    have no known value range and are refused.
    """
    from PIL import Image

    if image.mode.startswith("I;16"):
        grey = np.asarray(image).astype(np.uint32)
        image = Image.fromarray(((grey + 128) // 257).astype(np.uint8))  # 0..65535 -> 0..255, rounded
    elif image.mode in ("I", "F"):
        raise StagingError(f"image {path} has 32-bit {'integer' if image.mode == 'I' else 'float'} pixels "
                           f"(mode {image.mode}), whose value range staging cannot know: save it as an 8- or "
                           "16-bit PNG or TIFF, or remove it, and stage again")
    elif image.mode == "P" and "transparency" in image.info:
        image = image.convert("RGBA")
    return image.convert(mode)


def decoded_chunks(jobs: list[tuple[str, tuple]], decode: Callable[..., tuple[np.ndarray, np.ndarray]],
                   cfg: DataConfig, per_task: int) -> Iterator[Chunk]:
    """The (split, images, labels) of ``decode(*args)`` for each ``(split, args)`` job, in job order, run in
    ``cfg.decode_workers`` processes (a module-level ``decode`` and picklable args) with a bounded window of
    tasks in flight: deterministic whatever the worker count, and at most IN_FLIGHT_BYTES of decoded pixels
    wait for the writer."""
    workers = cfg.decode_workers or os.cpu_count() or 1
    ahead = max(2, min(2 * workers, IN_FLIGHT_BYTES // (per_task * cfg.channels * cfg.image_size ** 2)))
    if workers == 1:
        for split, args in jobs:
            yield split, *decode(*args)
        return
    with ProcessPoolExecutor(max_workers=min(workers, ahead)) as pool:
        pending: deque = deque()
        queue = iter(jobs)
        try:
            for split, args in queue:
                pending.append((split, pool.submit(decode, *args)))
                if len(pending) >= ahead:
                    break
            while pending:
                split, future = pending.popleft()
                images, labels = _result(future)
                job = next(queue, None)
                if job is not None:
                    pending.append((job[0], pool.submit(decode, *job[1])))
                yield split, images, labels
        except BrokenProcessPool as exc:
            raise StagingError(f"a decode process died while staging {cfg.source!r} (killed, most likely "
                               "out of memory): lower data.decode_workers or data.image_size, or give the "
                               "stage more memory") from exc
        finally:
            for _, future in pending:
                future.cancel()


def _result(future: Future) -> tuple[np.ndarray, np.ndarray]:
    """A decode task's result. Its StagingError is raised anew here, without the cause the pool gives it
    (the worker's whole traceback, as text), which a printer (pyflyte's, Python's) would show before the
    message: the message already names the item, the problem and the fix. Other errors keep it: bugs."""
    try:
        return future.result()
    except StagingError as exc:
        raise StagingError(str(exc)) from None
