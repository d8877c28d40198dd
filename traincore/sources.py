"""Built-in dataset sources and the split arithmetic every source shares.

A source is ``(class names, chunks)``: the chunks are ``(split, images uint8 NCHW, labels int64)`` in split
order, each split's samples fixed by ``cfg.seed``. traincore.imagefolder adds the ImageFolder source;
traincore.stage picks one by ``cfg.source`` and writes its chunks.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from traincore.config import DataConfig
from traincore.data import StagingError

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
                # Each chunk has its own generator: its bytes do not depend on how many chunks came before.
                local = np.random.default_rng([cfg.seed, split_index, chunk_index])
                labels = local.integers(0, cfg.synthetic_classes, size=n, dtype=np.int64)
                gain = local.uniform(0.7, 1.3, size=(n, 1, 1, 1)).astype(np.float32)
                noise = local.normal(0, 40, size=(n, *templates.shape[1:])).astype(np.float32)
                images = np.clip(templates[labels] * gain + noise, 0, 255).astype(np.uint8)
                yield split, images, labels

    return [f"class_{k}" for k in range(cfg.synthetic_classes)], chunks()
