"""Damaged staged data is refused before any worker starts, with an error naming the file and the fix.

Every case damages a private copy of ``fault_data`` the way storage and copies do (truncation, a flipped
bit, a bad label, a torn or hand-edited manifest) and checks ``traincore.run.preflight.preflight``, the path
every
run takes before its process group starts; two cases run the train CLI to show exit code 2 and no
traceback. Image shards are hashed once per staging: the record and a hash counter show that a second
open hashes nothing, and that a shard changed after verification is hashed again and refused.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from faultlib import TINY, child_env, run, train_args

import tasks.stage
import traincore.data.cli
import traincore.data.manifest
import traincore.data.staging
from tasks.stage import stage_dataset
from traincore.config.presets import preset
from traincore.config.schema import DataConfig
from traincore.data.fingerprint import source_fingerprint
from traincore.data.loader import StagedSplit
from traincore.data.manifest import MANIFEST, VERIFIED, Manifest, StagingError, read_record
from traincore.run.preflight import preflight

CONFIG = preset("debug").with_overrides(TINY)
HUGE_LABEL = 4611686018427387910  # the value a corrupted label showed mid-run before this check existed


def flip_byte(path: Path, offset: int = 100) -> None:
    """Invert one byte in place: same size, new content (and a new mtime)."""
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def set_label(path: Path, index: int, value: int) -> None:
    labels = np.fromfile(path, dtype=np.int64)
    labels[index] = value
    labels.tofile(path)


def image_shards(directory: Path, splits: tuple[str, ...] = ("train", "val")) -> list[str]:
    manifest = Manifest.load(directory)
    return [shard.images for name in splits for shard in manifest.splits[name].shards]


@pytest.fixture
def hash_calls(monkeypatch) -> list[str]:
    """Names of the image files hashed in this process (a counting wrapper around the real hash)."""
    calls: list[str] = []
    real = traincore.data.manifest.sha256_file

    def counting(path: Path) -> str:
        calls.append(Path(path).name)
        return real(path)

    monkeypatch.setattr(traincore.data.manifest, "sha256_file", counting)
    return calls


# ---- every kind of damage, found by preflight ---------------------------------------------------

def truncate(path: Path, by: int = 5) -> None:
    os.truncate(path, path.stat().st_size - by)


DAMAGE = {
    # name: (damage(directory), expected message, file the message must name)
    "image shard truncated": (lambda d: truncate(d / "train-00001.u8"),
                              r"is \d+ bytes, expected \d+ bytes.*truncated", "train-00001.u8"),
    "image shard bit-flipped": (lambda d: flip_byte(d / "train-00003.u8"),
                                "fails its sha256 check.*stage it again", "train-00003.u8"),
    "image shard missing": (lambda d: (d / "val-00000.u8").unlink(), "is missing", "val-00000.u8"),
    "label out of range": (lambda d: set_label(d / "train-00002.labels.i64", 17, HUGE_LABEL),
                           f"holds label {HUGE_LABEL} at position 17.*outside \\[0, 4\\).*stage it again",
                           "train-00002.labels.i64"),
    "label negative": (lambda d: set_label(d / "val-00000.labels.i64", 3, -1),
                       "holds label -1 at position 3", "val-00000.labels.i64"),
    "label bit-flipped in range": (lambda d: set_label(d / "train-00000.labels.i64", 0,
                                                       (np.fromfile(d / "train-00000.labels.i64",
                                                                    dtype=np.int64)[0] + 1) % 4),
                                   "fails its sha256 check", "train-00000.labels.i64"),
    "labels truncated": (lambda d: truncate(d / "train-00003.labels.i64", 8),
                         "is 664 bytes, expected 672 bytes", "train-00003.labels.i64"),
    "manifest truncated": (lambda d: truncate(d / MANIFEST, 200), "is not valid JSON.*stage it again",
                           MANIFEST),
    "manifest junk": (lambda d: (d / MANIFEST).write_bytes(os.urandom(64)), "is not valid JSON", MANIFEST),
    "manifest empty": (lambda d: (d / MANIFEST).write_text(""), "is not valid JSON", MANIFEST),
    "manifest not an object": (lambda d: (d / MANIFEST).write_text("[1, 2]"), "holds a JSON list", MANIFEST),
}


def edit_manifest(directory: Path, edit) -> None:
    raw = json.loads((directory / MANIFEST).read_text())
    edit(raw)
    (directory / MANIFEST).write_text(json.dumps(raw))


MANIFEST_EDITS = {
    "missing splits": (lambda m: m.pop("splits"), "has no 'splits'"),
    "missing classes": (lambda m: m.pop("classes"), "has no 'classes'"),
    "missing shard hash": (lambda m: m["splits"]["train"]["shards"][1].pop("images_sha256"),
                           "has no splits.train.shards\\[1\\].'images_sha256'"),
    "shape wrong type": (lambda m: m.update(shape="12x12"), "has shape='12x12', expected \\[C, H, W\\]"),
    "count wrong type": (lambda m: m["splits"]["val"].update(count="48"), "has splits.val.count='48'"),
    "counts disagree": (lambda m: m["splits"]["train"].update(count=999), "says split 'train' has 999"),
    "shard escapes directory": (
        lambda m: m["splits"]["train"]["shards"][0].update(images="../../etc/passwd"),
        "splits.train.shards\\[0\\].images='../../etc/passwd', expected a plain file"),
    "unknown key": (lambda m: m.update(extra=1), "has unknown key\\(s\\) 'extra'"),
}


@pytest.mark.parametrize("case", sorted(DAMAGE))
def test_damage_is_refused_before_training(case, damaged_copy):
    damage, message, name = DAMAGE[case]
    damage(damaged_copy)
    with pytest.raises(StagingError, match=message) as info:
        preflight(CONFIG, damaged_copy)
    assert str(damaged_copy / name) in str(info.value)


@pytest.mark.parametrize("case", sorted(MANIFEST_EDITS))
def test_bad_manifest_names_the_file_and_the_key(case, damaged_copy):
    edit, message = MANIFEST_EDITS[case]
    edit_manifest(damaged_copy, edit)
    with pytest.raises(StagingError, match=message) as info:
        preflight(CONFIG, damaged_copy)
    assert str(damaged_copy / MANIFEST) in str(info.value) and "stage it again" in str(info.value)


def test_train_cli_exits_2_without_a_traceback(damaged_copy, tmp_path):
    """The defect as found: a bit-flipped image shard used to train to exit 0."""
    damage, _, name = DAMAGE["image shard bit-flipped"]
    damage(damaged_copy)
    output = tmp_path / "run"
    result = run([sys.executable, "-m", "traincore.train", *train_args(damaged_copy, output)], timeout=120)
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith("error: shard "), result.stderr
    assert str(damaged_copy / name) in result.stderr and "Traceback" not in result.stderr
    assert not output.exists()  # refused before the run directory, process group or any step


def test_damaged_test_split_is_refused_when_evaluation_opens_it(damaged_copy):
    flip_byte(damaged_copy / "test-00000.u8")
    preflight(CONFIG, damaged_copy)  # training reads train and val only
    with pytest.raises(StagingError, match="test-00000.u8 fails its sha256 check"):
        StagedSplit(damaged_copy, "test")


# ---- hashed once per staging ---------------------------------------------------------------------

def test_image_shards_are_hashed_once_and_recorded(damaged_copy, hash_calls):
    (damaged_copy / VERIFIED).unlink(missing_ok=True)
    shards = image_shards(damaged_copy)
    assert len(shards) == 5  # 4 train shards of <= 100 samples, 1 val shard

    preflight(CONFIG, damaged_copy)
    assert sorted(hash_calls) == sorted(shards)
    record = read_record(damaged_copy)
    manifest = Manifest.load(damaged_copy)
    for shard in (s for name in ("train", "val") for s in manifest.splits[name].shards):
        stat = (damaged_copy / shard.images).stat()
        assert record[shard.images] == {"sha256": shard.images_sha256, "size": stat.st_size,
                                        "mtime_ns": stat.st_mtime_ns, "ctime_ns": stat.st_ctime_ns}

    # Every later open (the trainer opens train and val after preflight) only stats the files.
    preflight(CONFIG, damaged_copy)
    StagedSplit(damaged_copy, "train")
    StagedSplit(damaged_copy, "val")
    assert len(hash_calls) == 5

    # A new process reads the record from disk, not this process's memory: it hashes nothing either.
    script = ("import sys, traincore.data.manifest as d; calls = []; real = d.sha256_file\n"
              "d.sha256_file = lambda p: calls.append(p) or real(p)\n"
              "d.verify_staging(sys.argv[1], splits=('train', 'val')); print(len(calls))")
    child = subprocess.run([sys.executable, "-c", script, str(damaged_copy)], capture_output=True, text=True,
                           timeout=60, env=child_env())
    assert child.stdout.strip() == "0", child.stderr

    # The test split was not read by training, so it is hashed on its first open, then recorded too.
    StagedSplit(damaged_copy, "test")
    assert hash_calls[5:] == ["test-00000.u8"]
    StagedSplit(damaged_copy, "test")
    assert len(hash_calls) == 6


def test_shard_changed_after_verification_is_hashed_again_and_refused(damaged_copy, hash_calls):
    preflight(CONFIG, damaged_copy)
    hash_calls.clear()

    # Touched but intact: hashed again once, accepted, recorded with its new mtime.
    path = damaged_copy / "train-00001.u8"
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 10**9))
    preflight(CONFIG, damaged_copy)
    assert hash_calls == ["train-00001.u8"]
    assert read_record(damaged_copy)["train-00001.u8"]["mtime_ns"] == path.stat().st_mtime_ns
    preflight(CONFIG, damaged_copy)
    assert hash_calls == ["train-00001.u8"]

    # Corrupted in place with its mtime put back: the ctime still gives it away.
    path = damaged_copy / "train-00002.u8"
    before = path.stat()
    flip_byte(path, offset=1234)
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert path.stat().st_size == before.st_size and path.stat().st_mtime_ns == before.st_mtime_ns
    with pytest.raises(StagingError, match=f"shard {path} fails its sha256 check"):
        preflight(CONFIG, damaged_copy)
    assert hash_calls == ["train-00001.u8", "train-00002.u8"]
    assert "train-00002.u8" not in read_record(damaged_copy)  # never vouched for again
    with pytest.raises(StagingError, match="train-00002.u8 fails its sha256 check"):
        StagedSplit(damaged_copy, "train")

    # Truncated after verification: the size check refuses it without hashing.
    truncate(damaged_copy / "val-00000.u8", 432)
    with pytest.raises(StagingError, match="val-00000.u8 is .* bytes, expected"):
        StagedSplit(damaged_copy, "val")


# ---- the stage task replaces a damaged staging --------------------------------------------------

TASK_DATA = DataConfig(source="synthetic", image_size=8, synthetic_samples=90, synthetic_classes=3,
                       samples_per_shard=30, seed=7)


def staged_by_task() -> Path:
    """Run the stage task on TASK_DATA as the pipeline does; returns its staged directory."""
    staged = stage_dataset(data=TASK_DATA, source_fingerprint=source_fingerprint(TASK_DATA))
    return Path(staged.directory.path)


def test_stage_task_restages_a_corrupt_staging_in_place(monkeypatch, caplog):
    first = staged_by_task()
    intact = {p.name: p.read_bytes() for p in first.iterdir() if p.name != VERIFIED}
    flip_byte(first / "train-00001.u8", offset=7)
    # The task body must run again (Flyte's own cache would answer without it): a new cache version.
    monkeypatch.setattr(stage_dataset.metadata, "cache_version", "restage-after-corruption")
    calls = []
    monkeypatch.setattr(tasks.stage, "stage",
                        lambda *a, **k: calls.append(k) or traincore.data.staging.stage(*a, **k))
    caplog.set_level(logging.WARNING, logger="traincore.stage")

    again = staged_by_task()
    assert again == first and len(calls) == 1
    assert f"{first / 'train-00001.u8'} fails its sha256 check" in caplog.text
    assert {p.name: p.read_bytes() for p in first.iterdir() if p.name != VERIFIED} == intact
    preflight(CONFIG, first)  # verifies cleanly now
    assert sorted(p.name for p in first.parent.iterdir() if p.name.startswith(".")) == []  # no leftovers

    # A torn manifest in the task's own directory is replaced as well.
    (first / MANIFEST).write_text('{"format_version": 1, "sou')
    monkeypatch.setattr(stage_dataset.metadata, "cache_version", "restage-after-torn-manifest")
    caplog.clear()
    assert staged_by_task() == first
    assert f"{first / MANIFEST} is not valid JSON" in caplog.text
    assert Manifest.load(first).config["seed"] == 7


def test_stage_cli_restages_a_corrupt_staging_of_the_same_settings(damaged_copy, capsys, caplog):
    key = Manifest.load(damaged_copy).config  # the settings fault_data was staged with
    flip_byte(damaged_copy / "val-00000.u8")
    args = ["--source", key["source"], "--image-size", str(key["image_size"]), "--seed", str(key["seed"]),
            "--samples", str(key["synthetic_samples"]), "--classes", str(key["synthetic_classes"]),
            "--samples-per-shard", str(key["samples_per_shard"]), "--output", str(damaged_copy)]
    caplog.set_level(logging.WARNING, logger="traincore.stage")
    assert traincore.data.cli.main(args) == 0
    assert f"{damaged_copy / 'val-00000.u8'} fails its sha256 check" in caplog.text
    assert "staged synthetic" in capsys.readouterr().out
    StagedSplit(damaged_copy, "val", verify_hashes=True)
