"""Training augmentation on the device: random resized crop and horizontal flip of staged batches.

torchvision's classification reference augments each image on the host before batching; here the staged
uint8 batch is augmented where it is normalised, on the training device, so a GPU run adds no host work.
One ``roi_align`` crops and resizes every image of the batch at once, with one bilinear sample per output
pixel: a crop box is never larger than the output, so that is bilinear upsampling, as in torchvision's
RandomResizedCrop, and the whole-image box gives the image back exactly. A flip is an indexed copy. The
crop is taken from the staged image (already resized and centre-cropped to ``data.image_size``), not from
the original file as torchvision's is: stage at the size the model trains on.

The random draws come from a generator seeded with the batch's place in the run: (seed, rank, epoch,
position in the epoch). No state needs saving: a resumed run restores the loader's position and so draws,
for every later batch, what the uninterrupted run drew (bitwise resume holds).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from traincore.config import LoaderConfig

ATTEMPTS = 10  # crop boxes drawn per image before falling back to the centre (as torchvision does)
RATIO = (3 / 4, 4 / 3)  # aspect ratios of the crop box (torchvision's default)


class Augmenter:
    """Random resized crop (``loader.random_resized_crop``, area fraction in [``loader.crop_scale``, 1])
    and horizontal flip (``loader.horizontal_flip``, half the images) of a float batch of pixel values."""

    def __init__(self, cfg: LoaderConfig):
        self.crop, self.flip, self.scale = cfg.random_resized_crop, cfg.horizontal_flip, cfg.crop_scale

    def __call__(self, images: torch.Tensor, key: tuple[int, ...]) -> torch.Tensor:
        """``images`` (N, C, H, W) float, augmented with draws seeded by ``key`` (the loader's seed, rank,
        epoch and position of the batch): the same key, the same augmentation."""
        rng = np.random.default_rng(list(key))
        n, _, height, width = images.shape
        if self.crop:
            from torchvision.ops import roi_align

            boxes = torch.from_numpy(self._boxes(rng, n, height, width)).to(images.device, images.dtype)
            images = roi_align(images, boxes, output_size=(height, width), spatial_scale=1.0,
                               sampling_ratio=1, aligned=True)
        if self.flip:
            flipped = torch.from_numpy(rng.random(n) < 0.5).to(images.device)
            images = torch.where(flipped[:, None, None, None], images.flip(-1), images)
        return images

    def _boxes(self, rng: np.random.Generator, n: int, height: int, width: int) -> np.ndarray:
        """(N, 5) rows of (image index, x1, y1, x2, y2) in pixel coordinates: per image, the first of
        ATTEMPTS draws (area fraction, log-uniform aspect ratio) that fits, else the whole image."""
        area = height * width * rng.uniform(self.scale, 1.0, (n, ATTEMPTS))
        ratio = np.exp(rng.uniform(math.log(RATIO[0]), math.log(RATIO[1]), (n, ATTEMPTS)))
        w, h = np.sqrt(area * ratio), np.sqrt(area / ratio)
        fits = (w <= width) & (h <= height)
        first = fits.argmax(axis=1)
        rows = np.arange(n)
        w = np.where(fits.any(axis=1), w[rows, first], width)
        h = np.where(fits.any(axis=1), h[rows, first], height)
        x = rng.uniform(0, 1, n) * (width - w)
        y = rng.uniform(0, 1, n) * (height - h)
        return np.stack([rows, x, y, x + w, y + h], axis=1).astype(np.float32)
