"""The source ``python:<module>:<callable>``: a dataset of the user's own, staged like an ImageFolder tree.

The callable takes no arguments and returns a map-style dataset (``len()`` and ``dataset[i]``) whose items
are ``(image, label)``: ``image`` a PIL image or a uint8 array (HxW, or HxWxC with C of 1, 3 or 4), ``label``
an int. Class names come from the dataset's ``classes`` attribute when it has one, else they are the label
numbers. An item of any other shape stops staging with a StagingError naming its index.

Items are identified by their index: an item's split is the hash of its index and the seed, as an image's is
of its path (traincore.data.imagefolder), so the splits follow the fractions and stay put when the dataset
grows at its end. Decoding runs in ``data.decode_workers`` processes, each of which calls the factory once.

Its fingerprint (traincore.data.fingerprint) reads only three items: a change that leaves the first,
middle and last items and the length as they were goes unseen; stage with ``--overwrite`` then.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import Any

import numpy as np

from traincore.config import DataConfig
from traincore.data.imagefolder import CHUNK, convert, decoded_chunks, fit, split_indices
from traincore.data.manifest import StagingError
from traincore.data.sources import Chunk, Source, chunk_images
from traincore.imports import import_callable

ITEM = ("each item must be (image, label): image a PIL image or a uint8 array (HxW or HxWxC, C in 1, 3, "
        "4), label an int")


@functools.cache
def open_dataset(path: str) -> Any:
    """The dataset the factory at ``path`` returns (once per process), checked to be map-style and not
    empty."""
    setting = f"data.source='python:{path}'"
    factory = import_callable(path, setting, StagingError)
    try:
        dataset = factory()
    except Exception as exc:  # the factory is the user's code
        raise StagingError(f"{setting}: {path}() raised {type(exc).__name__}: {exc}: fix the dataset "
                           "factory") from exc
    if not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")):
        raise StagingError(f"{setting}: {path}() returned a {type(dataset).__name__}, which is not a "
                           "map-style dataset (len() and dataset[i]): return one, e.g. a "
                           "torch.utils.data.Dataset with __len__")
    if len(dataset) == 0:
        raise StagingError(f"{setting}: {path}() returned an empty dataset: nothing to stage")
    return dataset


def dataset_classes(path: str) -> list[str] | None:
    """The dataset's ``classes`` as strings, or None when it has none (the labels name the classes)."""
    classes = getattr(open_dataset(path), "classes", None)
    if classes is None:
        return None
    if not isinstance(classes, (list, tuple)) or not classes:
        raise StagingError(f"data.source='python:{path}': the dataset's classes attribute is "
                           f"{type(classes).__name__} {classes!r}: make it a non-empty list of names")
    return [str(name) for name in classes]


def load_item(path: str, index: int, size: int, channels: int) -> tuple[np.ndarray, int]:
    """Item ``index`` of the dataset, as staged: CHW uint8 pixels (:func:`traincore.data.imagefolder.fit`)
    and its label; StagingError naming the index for an item of another shape."""
    from PIL import Image

    item = open_dataset(path)[index]
    where = f"data.source='python:{path}': item {index}"
    if not (isinstance(item, (tuple, list)) and len(item) == 2):
        raise StagingError(f"{where} is a {type(item).__name__}, not a pair: {ITEM}")
    image, label = item
    if isinstance(label, np.integer) or (hasattr(label, "item") and getattr(label, "ndim", 1) == 0):
        label = label.item()
    if isinstance(label, bool) or not isinstance(label, int) or label < 0:
        raise StagingError(f"{where} has the label {label!r}: labels are ints >= 0; {ITEM}")
    if isinstance(image, np.ndarray):
        channels_last = image.shape[2] if image.ndim == 3 else 1
        if image.dtype != np.uint8 or image.ndim not in (2, 3) or channels_last not in (1, 3, 4):
            raise StagingError(f"{where} has an image array of dtype {image.dtype} and shape {image.shape}: "
                               f"{ITEM}")
        image = Image.fromarray(image[..., 0] if image.ndim == 3 and image.shape[2] == 1 else image)
    elif not isinstance(image, Image.Image):
        raise StagingError(f"{where} has an image of type {type(image).__name__}: {ITEM}")
    return fit(convert(image, "RGB" if channels == 3 else "L", where), size, channels), label


def _load_chunk(path: str, indices: list[int], size: int, channels: int) -> tuple[np.ndarray, np.ndarray]:
    items = [load_item(path, index, size, channels) for index in indices]
    return np.stack([pixels for pixels, _ in items]), np.array([label for _, label in items], dtype=np.int64)


def python_source(path: str, cfg: DataConfig) -> Source:
    """Class names, sample count and the (split, images, labels) chunk stream of the dataset at ``path``.

    Without a ``classes`` attribute the class names are the label numbers, known once every item is read:
    the list the Source holds is filled in when the stream ends (the stager reads it after the stream)."""
    count = len(open_dataset(path))
    named = dataset_classes(path)
    classes = list(named) if named is not None else []
    per_task = chunk_images(cfg.channels * cfg.image_size ** 2, CHUNK)
    jobs = [(split, (path, picked[lo:lo + per_task], cfg.image_size, cfg.channels))
            for split, picked in split_indices([str(i) for i in range(count)], cfg).items()
            for lo in range(0, len(picked), per_task)]

    def chunks() -> Iterator[Chunk]:
        highest = -1
        for split, images, labels in decoded_chunks(jobs, _load_chunk, cfg, per_task):
            highest = max(highest, int(labels.max()))
            if named is not None and highest >= len(named):
                raise StagingError(f"data.source='python:{path}': a label is {highest}, but the dataset's "
                                   f"classes name {len(named)}: labels index its classes attribute")
            yield split, images, labels
        if named is None:
            classes.extend(str(label) for label in range(highest + 1))

    return Source(classes, count, chunks())

