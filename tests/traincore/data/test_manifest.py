"""Staging: round trips, determinism, disjoint splits, reuse, atomic publication and corruption checks."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from traincore.config.schema import DataConfig
from traincore.data.loader import StagedSplit
from traincore.data.manifest import FORMAT_VERSION, SPLITS, VERIFIED, Manifest, StagingError, verify_images
from traincore.data.sources import Source, split_counts
from traincore.data.staging import stage


def read_split(directory: Path, split: str) -> tuple[np.ndarray, np.ndarray]:
    """All images and labels of one staged split, in stored order."""
    data = StagedSplit(directory, split)
    images, labels = data.read(np.arange(len(data)))
    return images.numpy(), labels.numpy()


def shard_hashes(manifest: Manifest) -> list[str]:
    return [h for info in manifest.splits.values() for s in info.shards
            for h in (s.images_sha256, s.labels_sha256)]


def image_keys(images: np.ndarray) -> set[bytes]:
    return {image.tobytes() for image in images}


def test_synthetic_round_trip(synthetic_dir):
    manifest = Manifest.load(synthetic_dir)
    assert manifest.shape == (3, 8, 8)
    assert manifest.classes == [f"class_{k}" for k in range(4)]
    counts = {name: info.count for name, info in manifest.splits.items()}
    assert counts == {"train": 80, "val": 10, "test": 10}
    assert [s.count for s in manifest.splits["train"].shards] == [32, 32, 16]
    images, labels = read_split(synthetic_dir, "train")
    assert images.shape == (80, 3, 8, 8) and images.dtype == np.uint8
    assert set(labels.tolist()) <= set(range(4))
    # The stored statistics are the train split's per-channel pixel mean and std.
    scaled = images.astype(np.float64) / 255.0
    np.testing.assert_allclose(manifest.mean, scaled.mean(axis=(0, 2, 3)), atol=1e-5)
    np.testing.assert_allclose(manifest.std, scaled.std(axis=(0, 2, 3)), atol=1e-5)


def test_digits_round_trip(digits_dir):
    from sklearn.datasets import load_digits

    manifest = Manifest.load(digits_dir)
    assert manifest.shape == (1, 16, 16) and manifest.classes == [str(d) for d in range(10)]
    assert sum(info.count for info in manifest.splits.values()) == 1797
    assert {name: info.count for name, info in manifest.splits.items()} == split_counts(1797, DataConfig())
    assert 0.1 < manifest.mean[0] < 0.6 and 0.1 < manifest.std[0] < 0.5
    # Labels follow their images: each staged image, shrunk back to 8x8, is nearest to a source digit
    # of the same class.
    source = load_digits()
    reference = source.images.reshape(len(source.images), -1) * (255.0 / 16.0)
    images, labels = read_split(digits_dir, "test")
    small = images.reshape(-1, 8, 2, 8, 2).mean(axis=(2, 4)).reshape(len(images), -1)
    nearest = ((small[:, None, :] - reference[None]) ** 2).sum(-1).argmin(1)
    assert (source.target[nearest] == labels).mean() > 0.97


@pytest.mark.parametrize("fixture", ["synthetic_dir", "digits_dir"])
def test_splits_are_disjoint(fixture, request):
    directory = request.getfixturevalue(fixture)
    seen: set[bytes] = set()
    total = 0
    for split in SPLITS:
        keys = image_keys(read_split(directory, split)[0])
        total += len(keys)
        assert not keys & seen, f"{split} shares images with an earlier split"
        seen |= keys
    assert total == sum(info.count for info in Manifest.load(directory).splits.values())


@pytest.mark.parametrize("source", ["synthetic", "digits"])
def test_same_seed_same_bytes_other_seed_differs(source, synthetic_config, tmp_path):
    base = dataclasses.replace(synthetic_config, source=source)
    first = stage(base, tmp_path / "a")
    again = stage(base, tmp_path / "b")
    other = stage(dataclasses.replace(base, seed=1), tmp_path / "c")
    assert shard_hashes(first) == shard_hashes(again)
    for name in os.listdir(tmp_path / "a"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    assert set(shard_hashes(first)).isdisjoint(shard_hashes(other))


@pytest.mark.parametrize("source", ["synthetic", "digits"])
def test_byte_sized_chunks_do_not_change_the_staged_bytes(source, synthetic_config, tmp_path, monkeypatch):
    """Chunks, resize groups and arithmetic bands are sized in bytes; their size must not show in the data."""
    import traincore.data.sources
    import traincore.data.staging

    cfg = dataclasses.replace(synthetic_config, source=source)
    reference = stage(cfg, tmp_path / "default")
    assert traincore.data.sources.chunk_images(cfg.channels * cfg.image_size ** 2, 1024) > 100  # one chunk
    # Tiny budgets so every bounded-memory path runs: synthetic, 2 images per chunk and templates made on
    # demand; digits, 32 images per chunk resized in groups of 24 planes; bands of 50 values (less than one
    # 3x8x8 image).
    monkeypatch.setattr(traincore.data.sources, "CHUNK_BYTES", (2 if source == "synthetic" else 32) * 192)
    monkeypatch.setattr(traincore.data.sources, "BAND", 50)
    monkeypatch.setattr(traincore.data.staging, "BAND", 50)
    small = stage(cfg, tmp_path / "small")
    assert shard_hashes(small) == shard_hashes(reference)
    assert (small.mean, small.std) == (reference.mean, reference.std)


def test_second_stage_reuses(synthetic_dir, synthetic_config):
    def staged_files() -> dict[str, int]:  # the verification record may be written by the reuse's check
        return {p.name: p.stat().st_mtime_ns for p in synthetic_dir.iterdir() if p.name != VERIFIED}

    before = staged_files()
    manifest = stage(dataclasses.replace(synthetic_config, decode_workers=3), synthetic_dir)
    assert manifest == Manifest.load(synthetic_dir)
    assert staged_files() == before


def test_different_config_at_same_output_needs_overwrite(synthetic_config, tmp_path):
    output = tmp_path / "data"
    stage(synthetic_config, output)
    changed = dataclasses.replace(synthetic_config, seed=5)
    with pytest.raises(StagingError, match="already exists.*--overwrite"):
        stage(changed, output)
    assert Manifest.load(output).seed == 0
    assert stage(changed, output, overwrite=True).seed == 5
    assert Manifest.load(output).seed == 5
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data"]  # no old or temporary directory left


def test_non_staged_directory_at_output_is_refused(synthetic_config, tmp_path):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "notes.txt").write_text("mine")
    for overwrite in (False, True):  # overwrite replaces a staging, never a folder of one's own files
        with pytest.raises(StagingError, match="is a directory of other files, not a staging"):
            stage(synthetic_config, tmp_path / "data", overwrite=overwrite)
    assert (tmp_path / "data" / "notes.txt").read_text() == "mine"


def test_failing_source_leaves_nothing(synthetic_config, tmp_path, monkeypatch):
    import traincore.data.staging

    def failing(cfg):
        def read(ranges):
            yield "train", np.zeros((4, 3, 8, 8), np.uint8), np.zeros(4, np.int64)
            raise OSError("source went away")
        return Source(["a", "b"], {"train": 100, "val": 0, "test": 0}, read)

    monkeypatch.setattr(traincore.data.staging, "synthetic_source", failing)
    with pytest.raises(OSError, match="source went away"):
        stage(synthetic_config, tmp_path / "out" / "data")
    assert list((tmp_path / "out").iterdir()) == []


def test_too_few_samples_for_the_splits():
    with pytest.raises(StagingError, match="no training split"):
        split_counts(2, DataConfig(val_fraction=0.5, test_fraction=0.4))


def test_missing_manifest_says_how_to_stage(tmp_path):
    with pytest.raises(StagingError, match="not a staged dataset.*traincore.stage"):
        Manifest.load(tmp_path)


# ---- corruption ----------------------------------------------------------------------------------

@pytest.fixture
def damaged_copy(synthetic_dir, tmp_path) -> Path:
    """A private copy of the synthetic staging that a test may damage."""
    return Path(shutil.copytree(synthetic_dir, tmp_path / "copy"))


@pytest.mark.parametrize("shard", ["train-00001.u8", "train-00002.labels.i64"])
def test_truncated_shard_fails_on_open(damaged_copy, shard):
    path = damaged_copy / shard
    os.truncate(path, path.stat().st_size - 5)
    with pytest.raises(StagingError, match=f"{shard} is .* bytes, expected .*truncated"):
        StagedSplit(damaged_copy, "train")


def test_missing_shard_fails_on_open(damaged_copy):
    (damaged_copy / "val-00000.u8").unlink()
    with pytest.raises(StagingError, match="val-00000.u8 is missing"):
        StagedSplit(damaged_copy, "val")


def test_flipped_byte_fails_hash_check(damaged_copy):
    split = StagedSplit(damaged_copy, "train")  # verified and recorded while intact
    path = damaged_copy / "train-00002.u8"
    data = bytearray(path.read_bytes())
    data[100] ^= 0xFF
    path.write_bytes(bytes(data))  # same size: only the hash can tell
    with pytest.raises(StagingError, match="train-00002.u8 fails its sha256 check"):
        verify_images(damaged_copy, split.manifest, ["train"], force=True)
    with pytest.raises(StagingError, match="train-00002.u8 fails its sha256 check.*stage it again"):
        StagedSplit(damaged_copy, "train")  # the file changed since it was recorded: hashed again on open
    with pytest.raises(StagingError, match="sha256"):
        StagedSplit(damaged_copy, "train", verify_hashes=True)
    StagedSplit(damaged_copy, "val", verify_hashes=True)  # the untouched split still verifies


def test_unknown_split_and_format_version(damaged_copy):
    with pytest.raises(StagingError, match="split 'holdout' is not in"):
        StagedSplit(damaged_copy, "holdout")
    manifest = (damaged_copy / "manifest.json")
    text = manifest.read_text()
    assert f'"format_version": {FORMAT_VERSION}' in text
    manifest.write_text(text.replace(f'"format_version": {FORMAT_VERSION}', '"format_version": 99'))
    with pytest.raises(StagingError, match="format 99.*stage the data again"):
        Manifest.load(damaged_copy)


@pytest.mark.parametrize(("damage", "message"), [
    (lambda m: m.pop("source_fingerprint"), "has no 'source_fingerprint'"),
    (lambda m: m.update(source_fingerprint=""), "has source_fingerprint='', expected a non-empty string"),
    (lambda m: m.update(source_fingerprint=7), "has source_fingerprint=7, expected a non-empty string"),
])
def test_manifest_must_record_the_source_fingerprint(damaged_copy, damage, message):
    path = damaged_copy / "manifest.json"
    raw = json.loads(path.read_text())
    assert Manifest.load(damaged_copy).source_fingerprint == raw["source_fingerprint"] != ""
    damage(raw)
    path.write_text(json.dumps(raw))
    with pytest.raises(StagingError, match=f"{message}.*stage it again"):
        Manifest.load(damaged_copy)
