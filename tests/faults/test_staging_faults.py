"""Staging under hostile conditions: links out of the source tree, huge images, a full or read-only disk.

The disk cases mount real filesystems (a small tmpfs, a read-only tmpfs), which needs root: without it
the test is skipped with the reason, and in CI (``CI=true``) it fails instead.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from faultlib import child_env

import traincore.data.manifest
import traincore.data.staging
from traincore.config.schema import DataConfig
from traincore.data.imagefolder import list_images
from traincore.data.loader import StagedSplit
from traincore.data.manifest import MANIFEST, VERIFIED, StagingError
from traincore.data.sources import CHUNK_BYTES
from traincore.data.staging import stage

MiB = 1 << 20


@contextlib.contextmanager
def tmpfs(path: Path, size: str, read_only: bool = False) -> Iterator[Path]:
    """A tmpfs mounted at ``path`` for the duration; fail in CI, skip elsewhere, when it cannot mount."""
    path.mkdir(parents=True, exist_ok=True)
    options = f"size={size}" + (",ro" if read_only else "")
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        reason = (f"cannot mount a tmpfs at {path} ({mounted.stderr.strip() or mounted.returncode}): "
                  "the disk-fault tests need root (CAP_SYS_ADMIN)")
        if os.environ.get("CI") == "true":
            pytest.fail(reason)
        pytest.skip(reason)
    try:
        yield path
    finally:
        if subprocess.run(["umount", str(path)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(path)], check=True)  # still busy: detach it


def run_stage(*args: str) -> subprocess.CompletedProcess:
    """``python -m traincore.stage ARGS`` in a child process."""
    return subprocess.run([sys.executable, "-m", "traincore.stage", *args], capture_output=True, text=True,
                          timeout=300, env=child_env())


# Runs the staging CLI and reports the peak RSS of this process's own memory since exec (VmHWM). The
# rusage of a child (os.wait4, RUSAGE_CHILDREN) cannot be used: its ru_maxrss includes the parent's RSS
# at fork time (the test process, with torch loaded) and that of any process the child forks.
PEAK_RSS = """
import atexit, re, runpy, sys
atexit.register(lambda: print("peak-rss-kib", re.search(r"VmHWM:\\s+(\\d+)",
                                                        open("/proc/self/status").read()).group(1),
                              file=sys.stderr))
runpy.run_module("traincore.stage", run_name="__main__", alter_sys=True)
"""


def staging_peak_rss(*args: str) -> tuple[subprocess.CompletedProcess, int]:
    """Stage in a child; its result and the staging process's peak RSS in bytes."""
    result = subprocess.run([sys.executable, "-c", PEAK_RSS, *args], capture_output=True, text=True,
                            timeout=300, env=child_env())
    found = re.search(r"^peak-rss-kib (\d+)$", result.stderr, re.MULTILINE)
    assert found, result.stderr
    return result, int(found.group(1)) * 1024


# ---- symlinks out of the source tree -------------------------------------------------------------

@pytest.mark.parametrize("kind", ["class directory", "image file"])
def test_symlink_escaping_the_source_root_is_refused(kind, image_folder_factory, tmp_path):
    root = image_folder_factory("images", per_class=3, classes=2)
    elsewhere = image_folder_factory("private", per_class=2, classes=1) / "class_0"
    if kind == "class directory":
        link = root / "class_9"
        link.symlink_to(elsewhere, target_is_directory=True)
    else:
        link = root / "class_1" / "img_900.jpg"
        link.symlink_to(elsewhere / "img_000.jpg")
    cfg = DataConfig(source=f"imagefolder:{root}", image_size=8, decode_workers=1)
    with pytest.raises(StagingError, match="outside the source root") as info:
        stage(cfg, tmp_path / "out")
    message = str(info.value)
    assert str(link) in message and str(elsewhere.resolve()) in message
    assert not (tmp_path / "out").exists()
    # The same tree given as a file:// URI is checked the same way.
    with pytest.raises(StagingError, match="outside the source root"):
        list_images(root.as_uri())


def test_symlink_inside_the_source_root_is_followed(image_folder_factory, tmp_path):
    root = image_folder_factory("images", per_class=4, classes=2)
    (root / "class_1" / "alias.jpg").symlink_to(root / "class_1" / "img_000.jpg")
    (root / "class_2").symlink_to(root / "class_0", target_is_directory=True)
    classes, files = list_images(str(root))
    assert classes == ["class_0", "class_1", "class_2"] and len(files) == 4 + 5 + 4
    manifest = stage(DataConfig(source=f"imagefolder:{root}", image_size=8, decode_workers=1), tmp_path / "d")
    assert sum(info.count for info in manifest.splits.values()) == 13


# ---- huge images in bounded memory ---------------------------------------------------------------

def test_4096_pixel_staging_runs_in_bounded_memory(tmp_path):
    """Chunks are sized in bytes: memory does not grow with the image size or the sample count.

    Before, a chunk was 1024 images whatever their size: these 3 synthetic images at 4096 peaked at
    2.3 GB of RSS (8 at 7.2 GB), dominated by float copies of the whole chunk.
    """
    images, side = 3, 4096
    sample = 3 * side * side  # 48 MiB per image
    common = ["--source", "synthetic", "--samples", str(images), "--classes", "2"]
    baseline, baseline_rss = staging_peak_rss(*common, "--image-size", "8", "--output", str(tmp_path / "s"))
    assert baseline.returncode == 0, baseline.stderr
    result, peak_rss = staging_peak_rss(*common, "--image-size", str(side), "--output", str(tmp_path / "h"))
    assert result.returncode == 0, result.stderr
    assert f"3x{side}x{side} uint8, train 1, val 1, test 1 samples" in result.stdout
    staged = sum(p.stat().st_size for p in (tmp_path / "h").glob("*.u8"))
    assert staged == images * sample
    # Above the interpreter and torch (the 8-pixel run), staging holds one chunk, one class template and
    # one float32 plane being resized: a few chunks, not a float copy of all the images (the old code's
    # float32 chunk alone was 576 MiB here, its float64 noise twice that).
    growth = peak_rss - baseline_rss
    print(f"peak RSS {peak_rss / MiB:.0f} MiB at {side} px, {baseline_rss / MiB:.0f} MiB at 8 px: "
          f"+{growth / MiB:.0f} MiB for {staged / MiB:.0f} MiB staged")
    assert growth < 4 * CHUNK_BYTES
    assert growth < images * sample * 4 / 2


def test_staging_larger_than_the_free_space_is_refused_up_front(tmp_path):
    with tmpfs(tmp_path / "small-disk", "4m") as disk:
        result = run_stage("--source", "synthetic", "--samples", "2000", "--image-size", "32",
                              "--output", str(disk / "data"))
        assert result.returncode == 2, result.stderr
        expected = (f"error: not enough space to stage into {re.escape(str(disk / 'data'))}: the staging "
                    f"needs about 6.0 MiB but {re.escape(str(disk))} has [34].\\d MiB free")
        assert re.match(expected, result.stderr), result.stderr
        assert "Traceback" not in result.stderr and "choose another --output" in result.stderr
        assert list(disk.iterdir()) == []


def fill(directory: Path) -> Path:
    """Write a file until the filesystem holding ``directory`` is full; returns the file."""
    filler = directory / "filler.bin"
    block = b"\0" * (64 << 10)
    with open(filler, "wb", buffering=0) as handle:
        try:
            while True:
                handle.write(block)
        except OSError as exc:
            assert exc.errno == errno.ENOSPC, exc
    return filler


def test_disk_filling_up_while_staging_leaves_no_staging(tmp_path, monkeypatch):
    """The space check passes, then another writer takes the space: the write fails midway."""
    real_check = traincore.data.staging.check_free_space
    filled: list[Path] = []

    def check_then_fill(output: Path, needed: int) -> None:
        real_check(output, needed)
        filled.append(fill(output.parent))

    monkeypatch.setattr(traincore.data.staging, "check_free_space", check_then_fill)
    with tmpfs(tmp_path / "disk", "4m") as disk:
        output = disk / "data"
        cfg = DataConfig(source="synthetic", image_size=32, synthetic_samples=600, samples_per_shard=100)
        with pytest.raises(StagingError, match="no space left to stage into") as info:
            stage(cfg, output)
        assert str(output) in str(info.value) and "choose another --output" in str(info.value)
        assert isinstance(info.value.__cause__, OSError) and info.value.__cause__.errno == errno.ENOSPC
        assert filled and not output.exists()
        assert sorted(p.name for p in disk.iterdir()) == ["filler.bin"]  # the temporary directory is gone
        assert not list(disk.rglob(MANIFEST))
        # With the space back, the same call stages completely.
        filled[0].unlink()
        monkeypatch.setattr(traincore.data.staging, "check_free_space", real_check)
        assert stage(cfg, output).splits["train"].count == 480
        StagedSplit(output, "train")


# ---- read-only output and read-only staging ------------------------------------------------------

@contextlib.contextmanager
def read_only_directory(path: Path) -> Iterator[Path]:
    """A directory this process cannot write: a read-only mount as root (root ignores modes), else 0555."""
    if os.geteuid() == 0:
        with tmpfs(path, "1m", read_only=True) as mounted:
            yield mounted
        return
    path.mkdir(parents=True)
    path.chmod(0o555)
    try:
        yield path
    finally:
        path.chmod(0o755)


def test_read_only_output_exits_2_with_a_message(tmp_path):
    with read_only_directory(tmp_path / "ro") as directory:
        output = directory / "data"
        result = run_stage("--source", "synthetic", "--samples", "40", "--image-size", "8",
                              "--output", str(output))
        assert result.returncode == 2, result.stderr
        assert result.stderr.startswith(f"error: cannot write the staging {output}: "), result.stderr
        assert "choose a writable --output" in result.stderr and "Traceback" not in result.stderr
        # A missing parent that cannot be created is named the same way.
        nested = directory / "sub" / "data"
        with pytest.raises(StagingError, match=f"cannot write the staging {re.escape(str(nested))}: .*"
                                               f"\\({re.escape(str(nested.parent))}\\)"):
            stage(DataConfig(source="synthetic", synthetic_samples=40, image_size=8), nested)
        assert list(directory.iterdir()) == []


@contextlib.contextmanager
def read_only_copy(source: Path, path: Path) -> Iterator[Path]:
    """A copy of ``source`` this process cannot write to: a tmpfs remounted read-only as root, else 0555."""
    if os.geteuid() != 0:
        shutil.copytree(source, path, ignore=shutil.ignore_patterns(VERIFIED))
        path.chmod(0o555)
        try:
            yield path
        finally:
            path.chmod(0o755)
        return
    with tmpfs(path, "8m") as disk:
        for item in source.iterdir():
            if item.name != VERIFIED:
                shutil.copy(item, disk / item.name)
        subprocess.run(["mount", "-o", "remount,ro", str(disk)], check=True)
        yield disk


def test_read_only_staging_is_verified_without_a_record(synthetic_dir, tmp_path, monkeypatch, caplog):
    """A staging that cannot be written to is verified anyway; the process remembers it and warns."""
    calls: list[str] = []
    real = traincore.data.manifest.sha256_file
    monkeypatch.setattr(traincore.data.manifest, "sha256_file",
                        lambda p: calls.append(Path(p).name) or real(p))
    caplog.set_level(logging.WARNING, logger="traincore.data.manifest")
    with read_only_copy(synthetic_dir, tmp_path / "ro-staging") as staging:
        assert not (staging / VERIFIED).exists()
        StagedSplit(staging, "train")
        assert calls == ["train-00000.u8", "train-00001.u8", "train-00002.u8"]
        assert f"cannot record the verified shards in {staging / VERIFIED}" in caplog.text
        assert "make the directory writable" in caplog.text and not (staging / VERIFIED).exists()
        StagedSplit(staging, "train")
        assert len(calls) == 3  # remembered by this process
