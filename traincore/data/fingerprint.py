"""The fingerprint of a dataset source as it is now: part of the staging cache key, recorded in the manifest.

A fingerprint reads ``<kind>:sha256:<32 hex digits>``; equal fingerprints mean the same source content:

- digits: the arrays scikit-learn's bundled copy loads (hashed once per process);
- synthetic: the generator's inputs in the DataConfig (the images are a pure function of them);
- python:<module>:<callable>: the import path, the dataset's length and class names, and the first,
  middle and last items as staged (pixels and labels). Reading every item would cost a staging; a change
  that leaves those three items and the length as they were goes unseen (stage with ``--overwrite``);
- imagefolder: the listing (traincore.data.imagefolder.list_images): class names, then each image's path
  relative to the root, size, and ETag or modification time. No image is opened: on an object store the
  cost is one request per listing page, not one per image. The listing is bounded (MAX_LISTED_FILES) and
  reports progress every PROGRESS_EVERY files.

A file rewritten with the same size and within the filesystem's modification-time resolution, on a store
that reports no ETag, looks unchanged: the listing is what is compared, never the bytes.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
from collections.abc import Callable

from traincore.config import DataConfig, parse_source
from traincore.data.digits import read_digits
from traincore.data.imagefolder import ImageListing, list_images
from traincore.data.pysource import load_item, open_dataset
from traincore.data.sources import check_synthetic

log = logging.getLogger(__name__)

DIGEST_CHARS = 32  # 128 bits of sha256: short enough to read, far beyond any accidental collision
# The DataConfig fields the synthetic generator reads: its images and labels are a function of these.
SYNTHETIC_INPUTS = ("seed", "synthetic_samples", "synthetic_classes", "channels", "image_size",
                    "val_fraction", "test_fraction")


def source_fingerprint(cfg: DataConfig, *, progress: Callable[[str], None] = log.info,
                       storage_options: dict | None = None) -> str:
    """The fingerprint of ``cfg.source`` as it is now; ``progress`` gets the imagefolder listing's lines,
    ``storage_options`` go to its fsspec filesystem (credentials, endpoint; by default fsspec's own)."""
    kind, location = parse_source(cfg.source)
    if kind == "digits":
        return digits_fingerprint()
    if kind == "synthetic":
        return synthetic_fingerprint(cfg)
    if kind == "python":
        return python_fingerprint(location, cfg)
    return listing_fingerprint(list_images(location, progress=progress, storage_options=storage_options))


@functools.cache
def digits_fingerprint() -> str:
    """The bundled digits' identity: a hash of the arrays staging reads."""
    bunch = read_digits()
    layout = (bunch.images.shape, bunch.images.dtype.str, bunch.target.dtype.str)
    hasher = hashlib.sha256(repr(layout).encode())
    hasher.update(bunch.images.tobytes())
    hasher.update(bunch.target.tobytes())
    return _format("digits", hasher)


def synthetic_fingerprint(cfg: DataConfig) -> str:
    """The synthetic source's identity: its generator inputs (refused here already when they cannot make
    an image of every class, so a launch plan fails before anything stages)."""
    check_synthetic(cfg)
    inputs = {name: getattr(cfg, name) for name in SYNTHETIC_INPUTS}
    return _format("synthetic", hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()))


def listing_fingerprint(listing: ImageListing) -> str:
    """An ImageFolder listing's identity: class names and each image's (name, size, version), in order."""
    hasher = hashlib.sha256(json.dumps(listing.classes).encode())
    for image in listing.files:  # one JSON array per line: no name can run into the next field
        hasher.update(json.dumps([image.name, image.size, image.version]).encode() + b"\n")
    return _format("imagefolder", hasher)


def python_fingerprint(path: str, cfg: DataConfig) -> str:
    """A dataset factory's identity: its import path, length and class names, and three of its items as
    staged (see the module docstring for what that cannot see)."""
    dataset = open_dataset(path)
    count = dataset.count
    hasher = hashlib.sha256(json.dumps([path, count, dataset.classes]).encode())
    for index in sorted({0, count // 2, count - 1}):
        pixels, label = load_item(path, index, cfg.image_size, cfg.channels)
        hasher.update(pixels.tobytes() + label.to_bytes(8, "little"))
    return _format("python", hasher)


def _format(kind: str, hasher) -> str:
    return f"{kind}:sha256:{hasher.hexdigest()[:DIGEST_CHARS]}"
