"""Source fingerprints: stable for an unchanged source, different for a changed one, from listings alone."""

from __future__ import annotations

import dataclasses
import os
import uuid

import fsspec
import pytest

import traincore.data.imagefolder
from traincore.config.schema import DataConfig
from traincore.data.fingerprint import digits_fingerprint, source_fingerprint
from traincore.data.imagefolder import list_images
from traincore.data.manifest import StagingError
from traincore.data.staging import stage


def folder(root) -> DataConfig:
    return DataConfig(source=f"imagefolder:{root}", image_size=8, decode_workers=1)


def test_digits_is_stable_and_ignores_the_staging_settings():
    first = source_fingerprint(DataConfig(source="digits"))
    digits_fingerprint.cache_clear()  # computed again from the bundled data, not remembered
    assert source_fingerprint(DataConfig(source="digits", image_size=16, seed=4)) == first
    assert first.startswith("digits:sha256:") and len(first.split(":")[-1]) == 32


def test_synthetic_follows_the_generator_inputs_only():
    base = DataConfig(source="synthetic", synthetic_samples=64)
    fingerprint = source_fingerprint(base)
    assert fingerprint.startswith("synthetic:sha256:")
    assert source_fingerprint(dataclasses.replace(base, decode_workers=3, samples_per_shard=7)) == fingerprint
    for change in (dict(seed=1), dict(synthetic_samples=65), dict(synthetic_classes=3), dict(image_size=16)):
        assert source_fingerprint(dataclasses.replace(base, **change)) != fingerprint, change


def test_imagefolder_changes_with_its_images_and_only_with_them(image_folder_factory, tmp_path):
    root = image_folder_factory(per_class=3, classes=2)
    seen = {source_fingerprint(folder(root))}
    assert next(iter(seen)).startswith("imagefolder:sha256:")
    assert source_fingerprint(folder(root)) in seen  # an untouched re-listing
    assert source_fingerprint(folder(root.as_uri())) in seen  # the same tree through file://
    (root / "class_0" / "notes.txt").write_text("not an image: not listed, not fingerprinted")
    assert source_fingerprint(folder(root)) in seen

    def changed() -> str:
        fingerprint = source_fingerprint(folder(root))
        assert fingerprint not in seen
        seen.add(fingerprint)
        return fingerprint

    (root / "class_1" / "new.jpg").write_bytes((root / "class_1" / "img_000.jpg").read_bytes())
    changed()  # added
    image = root / "class_0" / "img_001.jpg"
    stat = image.stat()
    image.write_bytes(image.read_bytes()[::-1])  # same size, new bytes: the modification time tells
    os.utime(image, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    changed()  # modified
    (root / "class_0" / "img_002.jpg").unlink()
    changed()  # removed
    (root / "class_1" / "new.jpg").rename(root / "class_1" / "renamed.jpg")
    changed()  # renamed
    (root / "class_9").mkdir()
    changed()  # a new, empty class: the labels change


def test_a_linked_image_is_fingerprinted_by_its_target(image_folder_factory):
    root = image_folder_factory(per_class=2, classes=2)
    target = root / "class_0" / "img_000.jpg"
    (root / "class_1" / "alias.jpg").symlink_to(target)
    before = source_fingerprint(folder(root))
    stat = target.stat()
    os.utime(target, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    listing = list_images(str(root))
    alias = next(f for f in listing.files if f.name == "class_1/alias.jpg")
    assert alias.version == f"mtime={target.stat().st_mtime}"
    assert source_fingerprint(folder(root)) != before


@pytest.fixture
def memory_tree(monkeypatch):
    """An ImageFolder on fsspec's memory filesystem whose files cannot be opened: proof that listing and
    fingerprinting never read an image. Yields (URI, filesystem)."""
    fs = fsspec.filesystem("memory")
    root = f"/fingerprint-{uuid.uuid4().hex}"
    for label in range(2):
        for index in range(3):
            fs.pipe(f"{root}/class_{label}/img_{index}.png", b"not a png at all" * (index + 1))
    opened = []
    write = fs._open

    def refuse(path, mode="rb", *args, **kwargs):
        if "r" not in mode:
            return write(path, mode, *args, **kwargs)
        opened.append(path)
        raise AssertionError(f"{path} was opened for reading")

    assert fsspec.core.url_to_fs(f"memory://{root}")[0] is fs
    monkeypatch.setattr(fs, "_open", refuse)
    monkeypatch.setattr(fs, "cat_file", refuse)
    yield f"memory://{root}", fs
    monkeypatch.undo()
    fs.rm(root, recursive=True)
    assert opened == []


def test_remote_listing_never_opens_an_image(memory_tree):
    uri, fs = memory_tree
    first = source_fingerprint(folder(uri))
    assert source_fingerprint(folder(uri)) == first
    fs.pipe(f"{uri[len('memory://'):]}/class_1/img_9.png", b"x")
    assert source_fingerprint(folder(uri)) != first


def test_listing_is_bounded_and_reports_progress(image_folder_factory, monkeypatch):
    root = image_folder_factory(per_class=5, classes=3)
    (root / "class_2" / "notes.txt").write_text("every listed file counts towards the bound")
    monkeypatch.setattr(traincore.data.imagefolder, "PROGRESS_EVERY", 4)
    lines: list[str] = []
    assert len(list_images(str(root), max_files=16, progress=lines.append).files) == 15
    # Listings arrive a directory at a time: a line after each directory that crossed a multiple of 4.
    assert [line.split(": ")[1].split(" files")[0] for line in lines] == ["5", "10", "16"]
    assert lines[-1].startswith(f"listing {root}: 16 files in ") and lines[-1].endswith("(class 3 of 3)")
    with pytest.raises(StagingError, match=r"holds more than 15 files .*class_2.*narrower prefix"):
        list_images(str(root), max_files=15)


@pytest.mark.parametrize("source", ["digits", "synthetic", "imagefolder"])
def test_staging_records_the_fingerprint_of_what_it_staged(source, image_folder_factory, tmp_path):
    cfg = folder(image_folder_factory()) if source == "imagefolder" else DataConfig(
        source=source, image_size=8, synthetic_samples=40)
    manifest = stage(cfg, tmp_path / "staged")
    assert manifest.source_fingerprint == source_fingerprint(cfg)
