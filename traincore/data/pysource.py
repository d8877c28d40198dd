"""The source ``python:<module>:<callable>``: a dataset of the user's own, staged like an ImageFolder tree.

The callable takes no arguments and returns a map-style dataset (``len()`` and ``dataset[i]``) whose items
are ``(image, label)``: ``image`` a PIL image or a uint8 array (HxW, or HxWxC with C of 1, 3 or 4), of any
size, ``label`` an int. Class names come from the dataset's ``classes`` attribute (distinct strings) when it
has one, and labels index it; else the labels name the classes, 0..K-1, and must not be sparse (see
:func:`label_classes`). Anything else stops staging with one StagingError naming the first bad item's index,
the problem and the fix: an item that is not such a pair, an exception from ``__getitem__`` (its type and
message), a dataset shorter than its ``len()``.

Items are identified by their index: an item's split is the hash of its index and the seed, as an image's is
of its path (traincore.data.imagefolder), so the splits follow the fractions and stay put when the dataset
grows at its end. Decoding runs in ``data.decode_workers`` processes, each of which calls the factory once.

Its fingerprint (traincore.data.fingerprint) reads only three items: a change that leaves the first,
middle and last items and the length as they were goes unseen; stage with ``--overwrite`` then.
"""

from __future__ import annotations

import functools
import logging
from collections import Counter
from collections.abc import Iterator
from typing import Any, NamedTuple

import numpy as np

from traincore.config import DataConfig
from traincore.data.decode import CHUNK, convert, decoded_chunks, fit
from traincore.data.imagefolder import split_indices
from traincore.data.manifest import StagingError
from traincore.data.sources import Chunk, Ranges, Source, chunk_images
from traincore.imports import import_callable

log = logging.getLogger(__name__)

ITEM = ("each item must be (image, label): image a PIL image or a uint8 array (HxW or HxWxC, C in 1, 3, "
        "4), label an int")
CLASSES_FIX = "give the dataset a classes attribute naming its classes (labels index it), or fix the label"


class UserDataset(NamedTuple):
    """The dataset a factory returned, with its checked length and class names (None: the labels name
    the classes)."""

    items: Any
    count: int
    classes: list[str] | None


def _reason(exc: BaseException) -> str:
    """``Type: first line of its message``: what the user's code raised, on one line."""
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__


@functools.cache
def open_dataset(path: str) -> UserDataset:
    """The dataset the factory at ``path`` returns (once per process), checked to be map-style, with a
    length >= 1 and, if it has them, valid class names."""
    setting = f"data.source='python:{path}'"
    factory = import_callable(path, setting, StagingError)
    try:
        dataset = factory()
    except StagingError:  # a sys.exit() in the factory, named by traincore.imports.no_exit
        raise
    except Exception as exc:  # the factory is the user's code
        raise StagingError(f"{setting}: {path}() raised {_reason(exc)}: fix the dataset factory") from exc
    if not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")):
        raise StagingError(f"{setting}: {path}() returned a {type(dataset).__name__}, which is not a "
                           "map-style dataset (len() and dataset[i]): return one, e.g. a "
                           "torch.utils.data.Dataset with __len__")
    try:
        count = len(dataset)  # an int >= 0, or TypeError / ValueError from len() itself
    except Exception as exc:
        raise StagingError(f"{setting}: len() of the dataset failed ({_reason(exc)}): make __len__ return "
                           "the number of items, an int") from exc
    if count == 0:
        raise StagingError(f"{setting}: {path}() returned an empty dataset: nothing to stage")
    return UserDataset(dataset, count, _named_classes(getattr(dataset, "classes", None), setting))


def _named_classes(classes: Any, setting: str) -> list[str] | None:
    """The dataset's ``classes`` attribute as a list of names: a list, tuple or 1-D array of at least two
    distinct strings; None when it has none."""
    if classes is None:
        return None
    if isinstance(classes, np.ndarray) and classes.ndim == 1:
        classes = classes.tolist()
    where = f"{setting}: the dataset's classes attribute"
    fix = ("make it a list of the class names, e.g. ['cat', 'dog'], or remove it (the labels then name the "
           "classes)")
    if not isinstance(classes, (list, tuple)):
        raise StagingError(f"{where} is a {type(classes).__name__} ({classes!r:.80}): {fix}")
    for position, name in enumerate(classes):
        if not isinstance(name, str) or not name:
            raise StagingError(f"{where} holds {name!r} at position {position}, not a class name: {fix}")
    duplicate = next((name for name, times in Counter(classes).items() if times > 1), None)
    if duplicate is not None:
        raise StagingError(f"{where} names {duplicate!r} twice: class names must be distinct; {fix}")
    if len(classes) < 2:
        raise StagingError(f"{where} names {len(classes)} class(es) {list(classes)!r}: classification "
                           "needs at least two")
    return [str(name) for name in classes]


def load_item(path: str, index: int, size: int, channels: int) -> tuple[np.ndarray, int]:
    """Item ``index`` of the dataset, as staged: CHW uint8 pixels (:func:`traincore.data.decode.fit`)
    and its label; StagingError naming the index for an item that cannot be read or staged."""
    dataset = open_dataset(path)
    where = f"data.source='python:{path}': item {index}"
    item = _fetch(dataset, index, where)
    if not (isinstance(item, (tuple, list)) and len(item) == 2):
        raise StagingError(f"{where} is a {type(item).__name__}, not a pair: {ITEM}")
    image, label = item
    return _pixels(image, where, size, channels), _label(label, where, dataset)


def _fetch(dataset: UserDataset, index: int, where: str) -> Any:
    """``dataset[index]``; whatever the user's ``__getitem__`` raises, or a None it returns, as one
    StagingError naming the item. A dataset shorter than its len() raises IndexError (or StopIteration)
    or returns None past its end: that is named as such."""
    short = (f"the dataset gives fewer items than its len() of {dataset.count} promises: make __len__ return "
             "the number of items, and __getitem__ serve every index below it")
    try:
        item = dataset.items[index]
    except (IndexError, StopIteration) as exc:
        raise StagingError(f"{where} raised {_reason(exc)}: {short}") from exc
    except Exception as exc:  # the user's code: one line naming the item, not a traceback
        raise StagingError(f"{where} raised {_reason(exc)}: fix the dataset's __getitem__ for that index, "
                           "or leave the item out of the dataset") from exc
    if item is None:
        raise StagingError(f"{where} is None, not (image, label); if the dataset ends early, {short}")
    return item


def _pixels(image: Any, where: str, size: int, channels: int) -> np.ndarray:
    """The item's image as staged (CHW uint8 of ``size`` x ``size``), or a StagingError naming it."""
    from PIL import Image

    if isinstance(image, np.ndarray):
        channels_last = image.shape[2] if image.ndim == 3 else 1
        if image.dtype != np.uint8 or image.ndim not in (2, 3) or channels_last not in (1, 3, 4):
            chw = image.ndim == 3 and image.shape[0] in (1, 3, 4)
            hint = " (channels first? transpose it to HxWxC)" if chw else ""
            raise StagingError(f"{where} has an image array of dtype {image.dtype} and shape {image.shape}"
                               f"{hint}: {ITEM}")
        image = Image.fromarray(image[..., 0] if image.ndim == 3 and image.shape[2] == 1 else image)
    elif not isinstance(image, Image.Image):
        raise StagingError(f"{where} has an image of type {type(image).__name__}: {ITEM}")
    if 0 in image.size:
        raise StagingError(f"{where} has an empty image ({image.width}x{image.height} pixels): {ITEM}, with "
                           "at least one pixel")
    mode = "RGB" if channels == 3 else "L"
    try:
        converted = convert(image, mode, where)
    except StagingError:
        raise
    except (OSError, ValueError) as exc:  # a mode Pillow cannot convert, a lazily opened file that fails
        raise StagingError(f"{where} has a PIL image (mode {image.mode}) that cannot be converted to {mode} "
                           f"({_reason(exc)}): return it as RGB or L") from exc
    return fit(converted, size, channels)


def _label(label: Any, where: str, dataset: UserDataset) -> int:
    """The item's label as an int, refused unless it is a class index: below the number of names in
    ``classes``, or, without them, below the item count (a larger one leaves classes without any item)."""
    if isinstance(label, np.integer) or (hasattr(label, "item") and getattr(label, "ndim", 1) == 0):
        label = label.item()
    if isinstance(label, bool) or not isinstance(label, int) or label < 0:
        raise StagingError(f"{where} has the label {label!r}: labels are ints >= 0; {ITEM}")
    if dataset.classes is not None and label >= len(dataset.classes):
        named = len(dataset.classes)
        raise StagingError(f"{where} has the label {label}, but the dataset's classes attribute names "
                           f"{named} classes: labels index it (0..{named - 1}); fix the label, or add its "
                           "class to classes")
    if dataset.classes is None and label >= dataset.count:
        raise StagingError(f"{where} has the label {label}, but the dataset has {dataset.count} items and no "
                           f"classes attribute: its classes would be the label numbers 0..{label}, most of "
                           f"them without a single item; {CLASSES_FIX}")
    return label


def label_classes(path: str, first_item: dict[int, int]) -> list[str]:
    """The class names of the dataset at ``path`` once every item is read (``first_item``: each label that
    occurs -> the lowest index of an item with it): its ``classes``, else the label numbers 0..K-1.

    Without ``classes`` the labels must be dense: at least two of them, and at least half of 0..max present
    (a stray label would otherwise add classes that no item has, and a head of that size to the model).
    Classes that no item has are logged as a warning."""
    dataset = open_dataset(path)
    count = len(dataset.classes) if dataset.classes is not None else max(first_item) + 1
    missing = [label for label in range(count) if label not in first_item]
    if dataset.classes is None and len(first_item) < 2:
        raise _sparse(path, first_item, "every item has it")
    if dataset.classes is None and 2 * len(first_item) < count:
        strays = {label: index for label, index in first_item.items() if label > missing[0]}
        raise _sparse(path, strays, f"only {len(first_item)} of the labels 0..{count - 1} occur")
    if missing:
        log.warning("data.source='python:%s': no item has the label(s) %s%s of its %d classes: the model "
                    "gets outputs for classes it never sees", path, ", ".join(map(str, missing[:5])),
                    ", ..." if len(missing) > 5 else "", count)
    return dataset.classes if dataset.classes is not None else [str(label) for label in range(count)]


def _sparse(path: str, strays: dict[int, int], why: str) -> StagingError:
    """The error for labels that cannot name the classes, naming the first item (by index) of ``strays``
    (label -> lowest item index)."""
    index, label = min((index, label) for label, index in strays.items())
    return StagingError(f"data.source='python:{path}': item {index} has the label {label}, and {why}: "
                        "without a classes attribute the labels name the classes and must be 0..K-1 for "
                        f"K >= 2 classes; {CLASSES_FIX}")


def _load_chunk(path: str, indices: list[int], size: int, channels: int) -> tuple[np.ndarray, np.ndarray]:
    items = [load_item(path, index, size, channels) for index in indices]
    return np.stack([pixels for pixels, _ in items]), np.array([label for _, label in items], dtype=np.int64)


def python_source(path: str, cfg: DataConfig) -> Source:
    """Class names, samples per split and the reader of (split, images, labels) chunks of the dataset at
    ``path``.

    Without a ``classes`` attribute the class names are the label numbers, known once every item is read:
    the reader records each label's first item in ``Source.first_item`` and the stager names the classes
    with :func:`label_classes` when every range is read, which refuses labels that are not a class index."""
    dataset = open_dataset(path)
    per_task = chunk_images(cfg.channels * cfg.image_size ** 2, CHUNK)
    splits = split_indices([str(i) for i in range(dataset.count)], cfg)
    first_item: dict[int, int] = {}

    def read(ranges: Ranges) -> Iterator[Chunk]:
        jobs = [(split, (path, splits[split][lo:min(lo + per_task, last)], cfg.image_size, cfg.channels))
                for split, (first, last) in ranges.items() for lo in range(first, last, per_task)]
        # decoded_chunks yields one chunk per job, in job order: each job's indices name its items.
        for (split, images, labels), (_, (_, indices, _, _)) in zip(
                decoded_chunks(jobs, _load_chunk, cfg, per_task), jobs, strict=True):
            for label, index in zip(labels.tolist(), indices, strict=True):
                if index < first_item.setdefault(label, index):
                    first_item[label] = index
            yield split, images, labels

    classes = list(dataset.classes) if dataset.classes is not None else []
    return Source(classes, {split: len(picked) for split, picked in splits.items()}, read, first_item,
                  lambda merged: label_classes(path, merged))
