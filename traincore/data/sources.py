"""Built-in dataset sources and the split arithmetic every source shares.

A source is ``Source(class names, samples per split, read)``: ``read(ranges)`` gives the chunks ``(split,
images uint8 NCHW, labels int64)`` of the asked sample ranges of each split, in split order, each split's
samples fixed by ``cfg.seed``, each chunk at most CHUNK_BYTES of pixels (at least one image), so staging
memory does not grow with the image size or the sample count. A range's bytes never depend on the ranges
around it: partitions of a source (traincore.data.partitions) staged apart give the bytes of one staging.
traincore.data.imagefolder adds the ImageFolder source; traincore.stage picks one by ``cfg.source`` and writes
its chunks.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np

from traincore.config import DataConfig
from traincore.data.digits import read_digits
from traincore.data.manifest import StagingError

Chunk = tuple[str, np.ndarray, np.ndarray]
Ranges = dict[str, tuple[int, int]]  # split -> [lo, hi) of its samples, in the split's staged order
Block = tuple[int, np.ndarray, np.ndarray]  # (offset in the block, images, labels)
CHUNK_BYTES = 64 << 20  # pixels per chunk (and per float32 resize group): memory is bounded by this, not N
BAND = 1 << 20  # float values per arithmetic band of the synthetic source (8 MiB of float64 noise)
BLOCK = 1024  # synthetic samples per generator: a range of the source starts at most this many samples late


@dataclass
class Source:
    """What a source gives the stager: class names, the samples of each split and a reader of ranges."""

    classes: list[str]  # empty: the labels name the classes, known once every item is read (name_classes)
    counts: dict[str, int]  # samples per split, in SPLITS order
    read: Callable[[Ranges], Iterator[Chunk]]
    # Sources that learn about their labels as they are read (python:): label -> lowest item identity with
    # it, filled by ``read`` (merged across partitions by their minimum), and what turns the merged map into
    # the class names, with a warning for classes no item has, or an error for labels that name no class.
    first_item: dict[int, int] = field(default_factory=dict)
    name_classes: Callable[[dict[int, int]], list[str]] | None = None

    @property
    def count(self) -> int:
        """All samples, every split."""
        return sum(self.counts.values())

    def chunks(self) -> Iterator[Chunk]:
        """Every sample of every split."""
        return self.read({split: (0, count) for split, count in self.counts.items()})


def split_counts(total: int, cfg: DataConfig) -> dict[str, int]:
    """Deterministic split sizes; every split with a non-zero fraction gets at least one sample."""
    n_test = max(1, round(total * cfg.test_fraction)) if cfg.test_fraction > 0 else 0
    n_val = max(1, round(total * cfg.val_fraction)) if cfg.val_fraction > 0 else 0
    n_train = total - n_val - n_test
    if n_train < 1:
        raise StagingError(f"{total} samples leave no training split with val_fraction={cfg.val_fraction} "
                           f"and test_fraction={cfg.test_fraction}: add data or lower the fractions")
    return {"train": n_train, "val": n_val, "test": n_test}


def check_synthetic(cfg: DataConfig) -> None:
    """Refuse synthetic settings with fewer samples than classes: some classes would have no image at all."""
    if cfg.synthetic_samples < cfg.synthetic_classes:
        raise StagingError(f"data.synthetic_samples={cfg.synthetic_samples} (--samples) is fewer than "
                           f"data.synthetic_classes={cfg.synthetic_classes} (--classes): some classes would "
                           "have no sample; raise --samples to at least the class count (several times it, "
                           "for a model to learn anything) or lower --classes")


def chunk_images(sample_bytes: int, cap: int) -> int:
    """Images per chunk: at most ``cap`` and at most CHUNK_BYTES of uint8 pixels, but at least one."""
    return max(1, min(cap, CHUNK_BYTES // max(sample_bytes, 1)))


def _resize_batch(images: np.ndarray, size: int) -> np.ndarray:
    """Bilinear-resize an NCHW batch to size x size and quantise to uint8.

    Resized plane by plane in groups of at most CHUNK_BYTES of float32, so memory stays bounded however
    large ``size`` is (channels and images are resized independently: the bytes do not depend on grouping).
    """
    import torch
    import torch.nn.functional as F

    n, c, h, w = images.shape
    planes = np.asarray(images, dtype=np.float32).reshape(n * c, 1, h, w)
    out = np.empty((n * c, size, size), dtype=np.uint8)
    step = max(1, CHUNK_BYTES // (4 * size * size))
    for lo in range(0, n * c, step):
        tensor = torch.from_numpy(np.ascontiguousarray(planes[lo:lo + step]))
        if h != size or w != size:
            tensor = F.interpolate(tensor, size=(size, size), mode="bilinear", align_corners=False)
            tensor.round_()
        else:
            tensor = tensor.round()  # never round the caller's array in place
        out[lo:lo + step] = tensor.clamp_(0, 255).to(torch.uint8).numpy()[:, 0]
    return out.reshape(n, c, size, size)


def digits_source(cfg: DataConfig) -> Source:
    """scikit-learn's bundled 8x8 digits (1797 real images), upscaled to ``cfg.image_size``."""
    bunch = read_digits()
    images = bunch.images.astype(np.float32) * (255.0 / 16.0)  # pixel values are 0..16
    labels = bunch.target.astype(np.int64)
    order = np.random.default_rng(cfg.seed).permutation(len(labels))
    images = np.repeat(images[order][:, None], cfg.channels, axis=1)
    labels = labels[order]
    per_chunk = chunk_images(cfg.channels * cfg.image_size ** 2, 512)
    counts = split_counts(len(labels), cfg)
    starts = dict(zip(counts, np.cumsum([0, *counts.values()]).tolist(), strict=False))

    def read(ranges: Ranges) -> Iterator[Chunk]:
        for split, (first, last) in ranges.items():
            for lo in range(starts[split] + first, starts[split] + last, per_chunk):
                hi = min(lo + per_chunk, starts[split] + last)
                yield split, _resize_batch(images[lo:hi], cfg.image_size), labels[lo:hi]

    return Source([str(d) for d in range(10)], counts, read)


class _Templates:
    """The synthetic source's per-class uint8 templates: all of them when they fit in CHUNK_BYTES, else
    made on demand and cached up to that many bytes (a 4096 x 4096 RGB template alone is 48 MiB)."""

    def __init__(self, coarse: np.ndarray, size: int):
        self.coarse, self.size = coarse, size
        sample = coarse.shape[1] * size * size
        self.capacity = max(1, CHUNK_BYTES // sample)
        self.all: np.ndarray | None = None  # made on first use: a failing staging never resizes anything
        self.cache: dict[int, np.ndarray] = {}

    def rows(self, labels: np.ndarray, lo: int, hi: int) -> np.ndarray:
        """float32 pixels ``lo:hi`` (flattened CHW) of each label's template."""
        if len(self.coarse) <= self.capacity:
            if self.all is None:
                self.all = _resize_batch(self.coarse, self.size).reshape(len(self.coarse), -1)
            return self.all[labels, lo:hi].astype(np.float32)
        return np.stack([self._one(int(label))[lo:hi] for label in labels]).astype(np.float32)

    def _one(self, label: int) -> np.ndarray:
        if label not in self.cache:
            if len(self.cache) >= self.capacity:
                self.cache.pop(next(iter(self.cache)))
            self.cache[label] = _resize_batch(self.coarse[label:label + 1], self.size).reshape(-1)
        return self.cache[label]


def synthetic_source(cfg: DataConfig) -> Source:
    """Learnable synthetic images: a smooth per-class template plus per-sample noise and brightness.

    Memory is bounded whatever the image size: chunks hold at most CHUNK_BYTES of pixels and the float
    arithmetic runs in bands of BAND values, drawing the noise in the same order as one draw per chunk.
    """
    check_synthetic(cfg)
    rng = np.random.default_rng(cfg.seed)
    coarse = rng.uniform(0, 255, size=(cfg.synthetic_classes, cfg.channels, 4, 4)).astype(np.float32)
    templates = _Templates(coarse, cfg.image_size)
    sample = cfg.channels * cfg.image_size ** 2
    per_chunk = chunk_images(sample, BLOCK)
    per_band = max(1, BAND // sample)  # whole images per band; one image is split into bands if larger
    shape = (cfg.channels, cfg.image_size, cfg.image_size)
    counts = split_counts(cfg.synthetic_samples, cfg)

    def block(split_index: int, index: int, n: int, stop: int) -> Iterator[Block]:
        """(offset, images, labels) of the block's first ``stop`` of ``n`` samples. Each block has its own
        generator: its bytes do not depend on the blocks before it, only on its own earlier samples."""
        local = np.random.default_rng([cfg.seed, split_index, index])
        labels = local.integers(0, cfg.synthetic_classes, size=n, dtype=np.int64)
        gain = local.uniform(0.7, 1.3, size=(n, 1, 1, 1)).astype(np.float32).reshape(n, 1)
        for first in range(0, stop, per_chunk):
            last = min(first + per_chunk, n)
            images = np.empty((last - first, sample), dtype=np.uint8)
            for i in range(first, last, per_band):
                j = min(i + per_band, last)
                for a in range(0, sample, BAND):
                    b = min(a + BAND, sample)
                    noise = local.normal(0, 40, size=(j - i, b - a)).astype(np.float32)
                    values = templates.rows(labels[i:j], a, b) * gain[i:j] + noise
                    images[i - first:j - first, a:b] = np.clip(values, 0, 255, out=values)
            yield first, images.reshape(last - first, *shape), labels[first:last]

    def read(ranges: Ranges) -> Iterator[Chunk]:
        for split, (lo, hi) in ranges.items():
            split_index, count = list(counts).index(split), counts[split]
            for start in range(lo - lo % BLOCK, hi, BLOCK):
                n = min(BLOCK, count - start)
                # A range that starts inside a block draws (and drops) the block's samples before it.
                for offset, images, labels in block(split_index, start // BLOCK, n, min(n, hi - start)):
                    a, b = max(lo - start - offset, 0), min(hi - start - offset, len(labels))
                    if a < b:
                        yield split, images[a:b], labels[a:b]

    return Source([f"class_{k}" for k in range(cfg.synthetic_classes)], counts, read)
