"""ImageFolder staging from local paths and file:// URIs, and its errors for bad trees."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from traincore.config import DataConfig
from traincore.data import SPLITS, Manifest, StagingError
from traincore.imagefolder import list_images
from traincore.loader import StagedSplit
from traincore.stage import stage


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
    assert {name: info.count for name, info in manifest.splits.items()} == {"train": 24, "val": 3, "test": 3}
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
    assert len(files) == 4 and all(path.endswith(".jpg") for path, _ in files)


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
    with pytest.raises(StagingError, match=f"cannot read image .*{broken}"):
        stage(cfg, tmp_path / "staged" / "data")
    assert list((tmp_path / "staged").iterdir()) == []


def test_grayscale_staging(image_folder, tmp_path):
    manifest = stage(folder_config(image_folder, channels=1), tmp_path / "gray")
    assert manifest.shape == (1, 8, 8) and len(manifest.mean) == 1
    assert Manifest.load(tmp_path / "gray").shape == (1, 8, 8)
