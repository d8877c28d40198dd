"""Staging in partitions: the same shards and manifest as one staging, whatever the partition count."""

from __future__ import annotations

import dataclasses
import shutil

import pytest

from traincore.config.schema import DataConfig
from traincore.data.manifest import StagingError
from traincore.data.partitions import (
    PARTITION_BYTES,
    PartitionRecord,
    choose_partitions,
    merge_records,
    partition_ranges,
)
from traincore.data.staging import open_source, stage, stage_partition, write_partition


def staged_files(directory) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def assert_same_staging(one, many) -> None:
    """Byte-identical shards and manifests (the directories hold nothing else)."""
    a, b = staged_files(one), staged_files(many)
    assert a.keys() == b.keys()
    assert [name for name in a if a[name] != b[name]] == []


@pytest.mark.parametrize("counts, per_shard, partitions", [
    ({"train": 1000, "val": 130, "test": 7}, 100, 3),
    ({"train": 95, "val": 5, "test": 0}, 10, 4),
    ({"train": 10, "val": 1, "test": 1}, 100, 5),
])
def test_partitions_cover_every_shard_once_in_even_runs_of_whole_shards(counts, per_shard, partitions):
    plans = partition_ranges(counts, per_shard, partitions)
    assert len(plans) == partitions
    shards = [[(split, lo // per_shard + k) for split, (lo, hi) in plan.items()
               for k in range(-(-(hi - lo) // per_shard))] for plan in plans]
    every = [(split, i) for split, count in counts.items() for i in range(-(-count // per_shard))]
    assert [shard for run in shards for shard in run] == every  # each once, in order
    assert max(map(len, shards)) - min(map(len, shards)) <= 1
    for plan in plans:
        assert all(lo % per_shard == 0 and hi <= counts[split] for split, (lo, hi) in plan.items())


def test_synthetic_in_three_partitions_is_the_staging_in_one(tmp_path):
    # 2,500 samples in shards of 300: partition boundaries fall inside the source's 1,024-sample blocks.
    cfg = DataConfig(source="synthetic", image_size=10, synthetic_samples=2500, synthetic_classes=5,
                     samples_per_shard=300)
    one = stage(cfg, tmp_path / "one")
    many = stage(cfg, tmp_path / "three", partitions=3)
    assert many == one
    assert_same_staging(tmp_path / "one", tmp_path / "three")
    assert len(one.splits["train"].shards) > 3


def test_digits_in_two_partitions_is_the_staging_in_one(tmp_path):
    cfg = DataConfig(source="digits", image_size=8, samples_per_shard=256)
    stage(cfg, tmp_path / "one")
    stage(cfg, tmp_path / "two", partitions=2)
    assert_same_staging(tmp_path / "one", tmp_path / "two")


def test_an_imagefolder_in_partitions_is_the_staging_in_one(image_folder, tmp_path):
    cfg = DataConfig(source=f"imagefolder:{image_folder}", image_size=8, samples_per_shard=4,
                     decode_workers=1)
    stage(cfg, tmp_path / "one")
    stage(cfg, tmp_path / "four", partitions=4)
    assert_same_staging(tmp_path / "one", tmp_path / "four")


UNNAMED = '''
    import numpy as np


    class Unnamed:
        """Labels 0..2 without a classes attribute; label 2 only from item 50 on."""

        def __len__(self):
            return 80

        def __getitem__(self, i):
            return np.full((6, 6), 10 * i % 256, dtype=np.uint8), (2 if i >= 50 else i % 2)


    def unnamed():
        return Unnamed()


    def stray():
        data = Unnamed()
        data.__class__ = type("Stray", (Unnamed,), {"__getitem__": lambda self, i: (
            np.zeros((6, 6), dtype=np.uint8), 100000 if i == 77 else i % 2)})
        return data


    def dies():
        """Item 77 ends the process that reads it, without an error, when that is a partition's process."""
        import multiprocessing
        import os

        data = Unnamed()
        read = data.__getitem__
        data.__class__ = type("Dies", (Unnamed,), {"__getitem__": lambda self, i: (
            os._exit(3) if i == 77 and multiprocessing.parent_process() is not None else read(i))})
        return data
'''


@pytest.fixture
def unnamed(user_module):
    user_module("unnamed", UNNAMED)


def test_labels_that_name_the_classes_are_merged_across_partitions(unnamed, tmp_path):
    cfg = DataConfig(source="python:unnamed:unnamed", image_size=6, channels=1, samples_per_shard=8,
                     decode_workers=1)
    one = stage(cfg, tmp_path / "one")
    many = stage(cfg, tmp_path / "three", partitions=3)
    assert one.classes == many.classes == ["0", "1", "2"]
    assert_same_staging(tmp_path / "one", tmp_path / "three")


def test_a_stray_label_in_any_partition_is_refused_and_nothing_is_published(unnamed, tmp_path):
    cfg = DataConfig(source="python:unnamed:stray", image_size=6, channels=1, samples_per_shard=8,
                     decode_workers=1)
    with pytest.raises(StagingError, match="item 77 has the label 100000"):
        stage(cfg, tmp_path / "out" / "data", partitions=3)
    assert list((tmp_path / "out").iterdir()) == []


def test_a_partition_process_that_dies_is_named_and_nothing_is_published(unnamed, tmp_path):
    cfg = DataConfig(source="python:unnamed:dies", image_size=6, channels=1, samples_per_shard=8,
                     decode_workers=1)
    with pytest.raises(StagingError, match="died without an error .* nothing was published: stage with "
                                           "partitions=1 to see the failure"):
        stage(cfg, tmp_path / "out" / "data", partitions=3)
    assert list((tmp_path / "out").iterdir()) == []


def records_of(cfg: DataConfig, directory, partitions: int) -> list[PartitionRecord]:
    source, fingerprint = open_source(cfg)
    directory.mkdir()
    return [write_partition(directory, cfg, source, fingerprint, index, partitions)
            for index in range(partitions)]


def test_records_round_trip_and_a_missing_or_foreign_partition_is_refused(tmp_path):
    cfg = DataConfig(source="synthetic", image_size=6, synthetic_samples=300, synthetic_classes=3,
                     samples_per_shard=50)
    records = [PartitionRecord.from_json(r.to_json()) for r in records_of(cfg, tmp_path / "parts", 3)]
    manifest = merge_records(cfg, list(reversed(records)))
    assert manifest == stage(cfg, tmp_path / "one")
    with pytest.raises(StagingError, match=r"partition records are \[0, 2\], not the 3 partitions"):
        merge_records(cfg, [records[0], records[2]])
    foreign = dataclasses.replace(records[1], source_fingerprint="synthetic:other")
    with pytest.raises(StagingError, match="source changed while its partitions were staged"):
        merge_records(cfg, [records[0], foreign, records[2]])


def test_a_partition_of_a_source_that_changed_since_the_plan_is_refused(image_folder_factory, tmp_path):
    folder = image_folder_factory(per_class=4)
    cfg = DataConfig(source=f"imagefolder:{folder}", image_size=8, decode_workers=1)
    _, planned = open_source(cfg)
    shutil.copy(folder / "class_0" / "img_000.jpg", folder / "class_0" / "img_new.jpg")  # it grows meanwhile
    (tmp_path / "parts").mkdir()
    with pytest.raises(StagingError, match="changed while it was being staged.*stage it again"):
        stage_partition(cfg, tmp_path / "parts", 0, 2, planned)


def test_the_partition_count_is_chosen_from_the_size_and_checked():
    cfg = DataConfig(image_size=224, channels=3, samples_per_shard=1024)
    assert choose_partitions(cfg, {"train": 1797}) == 1
    imagenet = choose_partitions(cfg, {"train": 1_231_167, "val": 50_000})  # 193 GB of 224 px uint8
    assert imagenet == -(-1_281_167 * 3 * 224 * 224 // PARTITION_BYTES) and 40 < imagenet <= 64
    assert choose_partitions(cfg, {"train": 100_000_000}) == 64
    assert choose_partitions(cfg, {"train": 5000, "val": 100}, partitions=16) == 6  # one per shard at most
    with pytest.raises(StagingError, match="partitions=-1: give a whole number >= 1"):
        stage(DataConfig(), "unused", partitions=-1)

