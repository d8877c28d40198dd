"""The staged dataset format: the manifest and its records (traincore.stage writes it).

A staged dataset is one directory::

    manifest.json                 format version, classes, C/H/W, normalisation stats, splits + shards
    train-00000.u8                uint8 images, NCHW contiguous (count * C * H * W bytes)
    train-00000.labels.i64        int64 labels (count * 8 bytes)
    val-00000.u8 ...

Images are decoded and resized exactly once, at staging; readers memory-map the shards.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
SPLITS = ("train", "val", "test")


class StagingError(ValueError):
    """The source cannot be staged or read; the message names the problem and the fix."""


@dataclass
class ShardInfo:
    """One shard: its image and label file names, sample count and the files' sha256."""

    images: str
    labels: str
    count: int
    images_sha256: str
    labels_sha256: str


@dataclass
class SplitInfo:
    """One split: its sample count and its shards in order."""

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
        """How many classes the labels index."""
        return len(self.classes)

    @property
    def sample_bytes(self) -> int:
        """Bytes of one uint8 image (C * H * W)."""
        c, h, w = self.shape
        return c * h * w

    def to_json(self) -> str:
        """The manifest.json text."""
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
