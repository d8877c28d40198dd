"""Staging in partitions: a source split into runs of whole shards, staged apart, joined by one manifest.

The shards of all splits, in split order (train, val, test), are cut into ``P`` runs as even as whole
shards allow; partition ``p`` stages the ``p``-th run, under the shards' own names: the partitions write
disjoint files, and since a range of a
source gives the same bytes whoever reads it (traincore.data.sources), their shards are byte for byte the
shards of a one-partition staging. Each partition returns a :class:`PartitionRecord` (its shards, the exact
integer pixel sums the normalisation statistics come from, the labels it saw); :func:`merge_records` joins
the records of all partitions into the manifest, after checking that they are all there, of one source
state, and cover every split exactly. The manifest is written last, by one step, as in a one-partition
staging: nothing is a staged dataset before it.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import numpy as np

from traincore.config import DataConfig
from traincore.data.manifest import SPLITS, Manifest, ShardInfo, SplitInfo, StagingError
from traincore.data.sources import Ranges

# What one partition stages when the count is chosen from the source's size (``partitions=0``): a few GB
# keeps a partition's pod at minutes of decoding, and its output within a default pod's ephemeral storage.
PARTITION_BYTES = 4 << 30
MAX_PARTITIONS = 64


@dataclass
class PartitionRecord:
    """What one partition staged: its shards per split and what the manifest needs of its samples."""

    index: int
    partitions: int
    source_fingerprint: str
    classes: list[str]
    splits: dict[str, SplitInfo]
    sums: list[int]  # per channel: exact sums of the train split's pixel values, and of their squares
    squares: list[int]
    pixels: int  # train pixels per channel
    first_item: dict[int, int] = field(default_factory=dict)  # label -> lowest item (sources that name none)

    def to_json(self) -> str:
        """The record as JSON (what a partition task returns)."""
        return json.dumps({**asdict(self), "first_item": {str(k): v for k, v in self.first_item.items()}})

    @classmethod
    def from_json(cls, text: str) -> PartitionRecord:
        """The inverse of :meth:`to_json`."""
        raw = json.loads(text)
        splits = {name: SplitInfo(info["count"], [ShardInfo(**shard) for shard in info["shards"]])
                  for name, info in raw["splits"].items()}
        first = {int(k): v for k, v in raw["first_item"].items()}
        return cls(**{**raw, "splits": splits, "first_item": first})


def choose_partitions(cfg: DataConfig, counts: dict[str, int], partitions: int = 0) -> int:
    """The partitions to stage ``counts`` samples per split in: ``partitions``, or when it is 0 one per
    PARTITION_BYTES of staged pixels (at most MAX_PARTITIONS); never more than the staging has shards (a
    partition beyond that would stage nothing)."""
    if not partitions:
        staged = sum(counts.values()) * cfg.channels * cfg.image_size ** 2
        partitions = min(MAX_PARTITIONS, -(-staged // PARTITION_BYTES))
    shards = sum(-(-count // cfg.samples_per_shard) for count in counts.values())
    return max(1, min(partitions, shards))


def check_partitions(partitions: int) -> None:
    """Refuse a partition count that is not a whole number of at least 0 (0 = chosen from the size)."""
    if isinstance(partitions, bool) or not isinstance(partitions, int) or partitions < 0:
        raise StagingError(f"partitions={partitions!r}: give a whole number >= 1 of partitions to stage in "
                           "parallel, or 0 to choose it from the source's size")


def partition_ranges(counts: dict[str, int], per_shard: int, partitions: int) -> list[Ranges]:
    """Each partition's sample range per split: the shards of all splits, in split order, cut into
    ``partitions`` runs as even as whole shards allow (so a partition may span the end of one split and the
    start of the next, and a staging with fewer shards than partitions leaves some partitions nothing)."""
    shards = [(split, index) for split, count in counts.items() for index in range(-(-count // per_shard))]
    plans: list[Ranges] = []
    for p in range(partitions):
        plan: Ranges = {}
        for split, index in shards[p * len(shards) // partitions:(p + 1) * len(shards) // partitions]:
            lo, hi = plan.get(split, (index * per_shard, index * per_shard))
            plan[split] = (lo, min(hi + per_shard, counts[split]))
        plans.append(plan)
    return plans


def merge_records(cfg: DataConfig, records: list[PartitionRecord],
                  name_classes: Callable[[dict[int, int]], list[str]] | None = None) -> Manifest:
    """The manifest of a staging from the records of all its partitions (any order), after checking they
    are complete and consistent; ``name_classes`` names the classes of a source whose labels name them."""
    records = sorted(records, key=lambda r: r.index)
    expected = records[0].partitions if records else 0
    if [r.index for r in records] != list(range(expected)) or {r.partitions for r in records} != {expected}:
        raise StagingError(f"the staging's partition records are {[r.index for r in records]}, not the "
                           f"{expected} partitions 0..{expected - 1}: stage every partition, then publish")
    if len({r.source_fingerprint for r in records}) != 1:
        raise StagingError("the source changed while its partitions were staged (their fingerprints differ: "
                           f"{sorted({r.source_fingerprint for r in records})}): stage it again")
    splits = {split: SplitInfo() for split in SPLITS}
    for record in records:
        for split, info in record.splits.items():
            splits[split].count += info.count
            splits[split].shards.extend(info.shards)
    first_item: dict[int, int] = {}
    for record in records:
        for label, index in record.first_item.items():
            first_item[label] = min(index, first_item.get(label, index))
    classes = name_classes(first_item) if name_classes is not None else records[0].classes
    mean, std = _normalisation(records, cfg.channels)
    return Manifest(source=cfg.source, source_fingerprint=records[0].source_fingerprint, classes=classes,
                    shape=(cfg.channels, cfg.image_size, cfg.image_size), mean=mean, std=std, seed=cfg.seed,
                    splits=splits, config=staging_key(cfg))


def _normalisation(records: list[PartitionRecord], channels: int) -> tuple[list[float], list[float]]:
    """Per-channel mean and std of the train pixels in [0, 1], from the records' exact integer sums."""
    sums = [sum(r.sums[c] for r in records) for c in range(channels)]
    squares = [sum(r.squares[c] for r in records) for c in range(channels)]
    pixels = sum(r.pixels for r in records)
    mean = np.array(sums, dtype=np.float64) / (255.0 * max(pixels, 1))
    second = np.array(squares, dtype=np.float64) / (255.0 ** 2 * max(pixels, 1))
    std = np.sqrt(np.maximum(second - mean ** 2, 1e-12))
    return [round(float(m), 6) for m in mean], [round(float(s), 6) for s in std]


def staging_key(cfg: DataConfig) -> dict:
    """The DataConfig fields that change the staged bytes (decode parallelism does not)."""
    key = asdict(cfg)
    key.pop("decode_workers")
    return key
