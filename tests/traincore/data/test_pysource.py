"""The source ``python:<module>:<callable>``: a map-style dataset of the user's, staged like a folder."""

from __future__ import annotations

import textwrap

import numpy as np
import pytest

from traincore.config import DataConfig
from traincore.data.loader import StagedSplit
from traincore.data.manifest import StagingError
from traincore.data.pysource import open_dataset
from traincore.data.staging import stage

MODULE = '''
    import numpy as np
    from PIL import Image


    class Shades:
        """Grey squares: even items dark, odd ones light; PIL images and HxWxC / HxW arrays mixed."""

        def __init__(self, n=90, classes=("dark", "light")):
            self.n = n
            if classes is not None:
                self.classes = list(classes)

        def __len__(self):
            return self.n

        def __getitem__(self, i):
            value = 30 + 40 * (i % 3) if i % 2 == 0 else 200 + 20 * (i % 3)
            if i % 3 == 0:
                return Image.new("RGB", (12, 10), (value,) * 3), i % 2
            if i % 3 == 1:
                return np.full((10, 12, 3), value, dtype=np.uint8), np.int64(i % 2)
            return np.full((10, 12), value, dtype=np.uint8), i % 2


    def shades():
        return Shades()


    def unnamed():
        return Shades(classes=None)


    def grown():
        return Shades(n=120)


    class Broken(Shades):
        def __getitem__(self, i):
            return (np.zeros((4, 4), dtype=np.float32), 0) if i == 41 else super().__getitem__(i)


    def broken():
        return Broken()


    def listing():
        return [1, 2, 3].__iter__()


    def empty():
        return []
    '''


@pytest.fixture
def shades(tmp_path, monkeypatch):
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "shades.py").write_text(textwrap.dedent(MODULE))
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "site"))  # the decode workers import it too
    open_dataset.cache_clear()
    yield
    open_dataset.cache_clear()
    monkeypatch.delitem(__import__("sys").modules, "shades", raising=False)


@pytest.mark.parametrize("workers", [1, 2])
def test_a_dataset_factory_is_staged_with_its_classes_splits_and_fingerprint(shades, tmp_path, workers):
    cfg = DataConfig(source="python:shades:shades", image_size=8, channels=1, decode_workers=workers)
    manifest = stage(cfg, tmp_path / "staged")
    assert manifest.classes == ["dark", "light"] and manifest.shape == (1, 8, 8)
    counts = {split: info.count for split, info in manifest.splits.items()}
    assert counts == {"train": 72, "val": 9, "test": 9}  # fractions 0.1 / 0.1 of 90, by each index's hash
    assert manifest.source_fingerprint.startswith("python:sha256:")
    train = StagedSplit(tmp_path / "staged", "train")
    images, labels = train.read(np.arange(len(train)))
    assert images[labels == 0].max() <= 110 and images[labels == 1].min() >= 200  # pixels kept their label
    # Staged again, the same; the dataset grown at its end is a new fingerprint, its first items keep their
    # splits (the split of an item is the hash of its index).
    assert stage(cfg, tmp_path / "staged").source_fingerprint == manifest.source_fingerprint
    grown = stage(DataConfig(source="python:shades:grown", image_size=8, channels=1, decode_workers=workers),
                  tmp_path / "grown")
    assert grown.source_fingerprint != manifest.source_fingerprint
    assert grown.splits["train"].count > manifest.splits["train"].count


def test_without_a_classes_attribute_the_labels_name_the_classes(shades, tmp_path):
    manifest = stage(DataConfig(source="python:shades:unnamed", image_size=8, decode_workers=1),
                     tmp_path / "staged")
    assert manifest.classes == ["0", "1"] and manifest.shape == (3, 8, 8)


@pytest.mark.parametrize("factory, message", [
    ("broken", r"item 41 has an image array of dtype float32 and shape \(4, 4\): each item must be"),
    ("listing", "returned a list_iterator, which is not a map-style dataset"),
    ("empty", "returned an empty dataset"),
    ("absent", "module shades has no absent"),
])
def test_a_dataset_that_is_not_one_is_refused_by_name(shades, tmp_path, factory, message):
    with pytest.raises(StagingError, match=message):
        stage(DataConfig(source=f"python:shades:{factory}", image_size=8, decode_workers=1), tmp_path / "out")
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.staging-*"))
