"""ImageFolder staging from local paths and file:// URIs, stable splits as a folder grows, and errors for
bad trees."""

from __future__ import annotations

import dataclasses
import hashlib
import shutil
import traceback

import numpy as np
import pytest

from traincore.config.schema import DataConfig
from traincore.data.imagefolder import ImageFile, assign_splits, list_images
from traincore.data.loader import StagedSplit
from traincore.data.manifest import SPLITS, Manifest, StagingError
from traincore.data.staging import stage


def folder_config(location, **overrides) -> DataConfig:
    """Stage ``location`` at 8x8 with one decode process unless overridden."""
    defaults = {"source": f"imagefolder:{location}", "image_size": 8, "decode_workers": 1}
    return DataConfig(**{**defaults, **overrides})


def staged_bytes(directory) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir()) if p.name != "manifest.json"}


def test_round_trip(image_folder, class_colours, tmp_path):
    colours = class_colours[:3]
    directory = tmp_path / "data"
    manifest = stage(folder_config(image_folder), directory)
    assert manifest.classes == ["class_0", "class_1", "class_2"]
    assert manifest.shape == (3, 8, 8)
    counts = {name: info.count for name, info in manifest.splits.items()}
    assert sum(counts.values()) == 30 and min(counts.values()) >= 1
    seen: set[bytes] = set()
    for split in SPLITS:
        data = StagedSplit(directory, split)
        images, labels = (t.numpy() for t in data.read(np.arange(len(data))))
        # Each class was drawn in its own colour: the staged pixels must match their label's colour.
        mean_colour = images.astype(np.float64).mean(axis=(2, 3))
        nearest = ((mean_colour[:, None, :] - colours[None]) ** 2).sum(-1).argmin(1)
        np.testing.assert_array_equal(nearest, labels)
        keys = {image.tobytes() for image in images}
        assert len(keys) == len(images) and not keys & seen, f"{split} repeats an image"
        seen |= keys
    mean = np.array(manifest.mean) * 255
    assert np.all(mean > colours.min(0) - 10) and np.all(mean < colours.max(0) + 10)


def test_file_uri_and_worker_count_give_identical_bytes(image_folder, tmp_path):
    plain = stage(folder_config(image_folder), tmp_path / "plain")
    uri = stage(folder_config(image_folder.as_uri(), decode_workers=2), tmp_path / "uri")
    assert image_folder.as_uri().startswith("file://")
    assert plain.splits == uri.splits
    assert staged_bytes(tmp_path / "plain") == staged_bytes(tmp_path / "uri")


def test_seed_changes_the_split(image_folder, tmp_path):
    first = stage(folder_config(image_folder), tmp_path / "a")
    again = stage(folder_config(image_folder), tmp_path / "b")
    other = stage(folder_config(image_folder, seed=1), tmp_path / "c")
    assert staged_bytes(tmp_path / "a") == staged_bytes(tmp_path / "b")
    assert first.splits == again.splits
    assert first.splits["test"].shards[0].images_sha256 != other.splits["test"].shards[0].images_sha256


def test_non_image_files_are_ignored(image_folder_factory):
    root = image_folder_factory(per_class=2, classes=2)
    (root / "class_0" / "README.txt").write_text("not an image")
    (root / "stray.jpg").write_bytes(b"")  # outside any class directory
    classes, files = list_images(str(root))
    assert classes == ["class_0", "class_1"]
    assert len(files) == 4 and all(image.path.endswith(".jpg") for image in files)


@pytest.mark.parametrize(("layout", "message"), [
    ("missing", "does not exist"),
    ("empty", "holds no images"),
    ("one_class", "only one class \\('class_0'\\)"),
    ("file", "is a file"),
])
def test_bad_trees(layout, message, image_folder_factory, tmp_path):
    location = {
        "missing": lambda: tmp_path / "nowhere",
        "empty": lambda: (tmp_path / "empty").mkdir() or tmp_path / "empty",
        "one_class": lambda: image_folder_factory(classes=1),
        "file": lambda: image_folder_factory(classes=2) / "class_0" / "img_000.jpg",
    }[layout]()
    with pytest.raises(StagingError, match=message) as info:
        stage(folder_config(location), tmp_path / "out")
    assert str(location) in str(info.value)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("workers", [1, 2])
def test_unreadable_image_names_its_path_and_leaves_nothing(workers, image_folder_factory, tmp_path):
    root = image_folder_factory(per_class=4, classes=2)
    broken = root / "class_1" / "img_002.jpg"
    broken.write_bytes(b"\xff\xd8 this is not a jpeg")
    cfg = dataclasses.replace(folder_config(root), decode_workers=workers)
    expected = (f"cannot read image .*{broken}: it is not an image in a format Pillow knows .* Remove or "
                "replace the file and stage again")
    with pytest.raises(StagingError, match=expected) as caught:
        stage(cfg, tmp_path / "staged" / "data")
    assert list((tmp_path / "staged").iterdir()) == []
    # Printed as pyflyte or Python print it (causes first): our frames and message only, no decode
    # worker's traceback (the pool's _RemoteTraceback) nor PIL's error before it.
    printed = "".join(traceback.format_exception(caught.value))
    assert printed.count("Traceback (most recent call last)") == 1, printed
    for elsewhere in ("_RemoteTraceback", "concurrent/futures/process.py", "PIL", "BytesIO"):
        assert elsewhere not in printed, printed


def test_grayscale_staging(image_folder, tmp_path):
    manifest = stage(folder_config(image_folder, channels=1), tmp_path / "gray")
    assert manifest.shape == (1, 8, 8) and len(manifest.mean) == 1
    assert Manifest.load(tmp_path / "gray").shape == (1, 8, 8)


# ---- stable splits -------------------------------------------------------------------------------

def split_images(directory) -> dict[str, set[bytes]]:
    """Each split's staged images as byte strings (every test image has its own noise: bytes identify it)."""
    out = {}
    for split in SPLITS:
        data = StagedSplit(directory, split)
        out[split] = {image.tobytes() for image in data.read(np.arange(len(data)))[0].numpy()}
    return out


def add_images(root, extra, prefix: str) -> int:
    """Copy every image of the folder ``extra`` into ``root`` under new names; returns how many."""
    added = 0
    for path in sorted(extra.glob("class_*/*.jpg")):
        target = root / path.parent.name / f"{prefix}_{path.name}"
        shutil.copyfile(path, target)
        added += 1
    return added


def test_a_growing_folder_keeps_every_image_in_its_split(image_folder_factory, tmp_path):
    root = image_folder_factory("images", per_class=8, classes=3)
    first = stage(folder_config(root), tmp_path / "first")
    before = split_images(tmp_path / "first")
    added = add_images(root, image_folder_factory("extra", per_class=12, classes=3, seed=1), "more")
    second = stage(folder_config(root), tmp_path / "second")
    after = split_images(tmp_path / "second")
    assert sum(i.count for i in second.splits.values()) == sum(i.count for i in first.splits.values()) + added
    for split in SPLITS:
        assert before[split] <= after[split], f"an image left {split} when the folder grew"
    assert second.source_fingerprint != first.source_fingerprint


def test_split_is_the_hash_of_seed_and_relative_path(image_folder, tmp_path):
    """The documented rule, computed here independently: u = sha256("<seed>/<class>/<file>")[:6] / 2**48."""
    cfg = folder_config(image_folder, seed=3, val_fraction=0.2, test_fraction=0.2)
    listing = list_images(str(image_folder))
    splits = assign_splits(listing.files, cfg)
    for image in listing.files:
        assert image.name == f"{image.path.split('/')[-2]}/{image.path.split('/')[-1]}"
        u = int.from_bytes(hashlib.sha256(f"3/{image.name}".encode()).digest()[:6], "big") / 2**48
        expected = "test" if u < 0.2 else "val" if u < 0.4 else "train"
        assert image in splits[expected], f"{image.name} (u={u:.3f}) is not in {expected}"
    # Stored in the order of u within each split: deterministic whatever the listing order.
    assert assign_splits(list(reversed(listing.files)), cfg) == splits


def names(count: int) -> list[ImageFile]:
    """``count`` listed images in three classes (only their names matter to the split)."""
    return [ImageFile(f"memory:///x/c{i % 3}/{i}.jpg", f"c{i % 3}/{i}.jpg", i % 3, 1, "")
            for i in range(count)]


def test_no_image_ever_moves_from_train_to_a_held_out_split_as_images_are_added():
    cfg = DataConfig(val_fraction=0.1, test_fraction=0.1)
    files = names(400)
    previous: dict[str, str] = {}
    for count in range(3, 400, 7):
        splits = assign_splits(files[:count], cfg)
        assert all(splits[split] for split in SPLITS), f"{count} images left a split empty"
        where = {image.name: split for split, images in splits.items() for image in images}
        moved = {name: (old, where[name]) for name, old in previous.items() if old != where[name]}
        # Only an image lent to an empty held-out split may move, and only back towards train.
        assert all(old != "train" for old, _ in moved.values()), moved
        previous = where
    held_out = {split: len(images) for split, images in assign_splits(files, cfg).items()}
    assert 20 <= held_out["test"] <= 60 and 20 <= held_out["val"] <= 60  # about 40 each


def test_a_folder_too_small_for_the_splits_is_named():
    with pytest.raises(StagingError, match="2 images leave no training split.*add images or lower"):
        assign_splits(names(2), DataConfig(val_fraction=0.1, test_fraction=0.1))
    assert [len(s) for s in assign_splits(names(2), DataConfig(val_fraction=0, test_fraction=0.1)).values()] \
        == [1, 0, 1]


def test_restaging_a_grown_folder_in_place_and_reusing_an_unchanged_one(image_folder_factory, tmp_path):
    root = image_folder_factory("images", per_class=4, classes=2)
    output = tmp_path / "staged"
    first = stage(folder_config(root), output)
    written = (output / "manifest.json").stat().st_mtime_ns
    assert stage(folder_config(root), output) == first  # unchanged: reused, not written again
    assert (output / "manifest.json").stat().st_mtime_ns == written
    add_images(root, image_folder_factory("extra", per_class=2, classes=2, seed=1), "more")
    grown = stage(folder_config(root), output)  # same settings, newer source: staged again in place
    assert sum(i.count for i in grown.splits.values()) == 12 and Manifest.load(output) == grown
    assert grown.source_fingerprint != first.source_fingerprint
    assert sorted(p.name for p in tmp_path.iterdir()) == ["extra", "images", "staged"]
