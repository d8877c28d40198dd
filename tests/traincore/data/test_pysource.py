"""The source ``python:<module>:<callable>``: a map-style dataset of the user's, staged like a folder."""

from __future__ import annotations

import numpy as np
import pytest

from traincore.config.schema import DataConfig
from traincore.data.loader import StagedSplit
from traincore.data.manifest import StagingError
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


    class Odd(Shades):
        """Shades with some labels or items replaced, some items raising, a len() of its own, and a
        classes attribute as given (None: none)."""

        def __init__(self, classes=None, labels=(), items=(), raises=(), length=None):
            super().__init__(classes=None)
            if classes is not None:
                self.classes = classes
            self.labels, self.items, self.raises = dict(labels), dict(items), dict(raises)
            self.length = length

        def __len__(self):
            return self.n if self.length is None else self.length

        def __getitem__(self, i):
            if i in self.raises:
                raise self.raises[i]
            if i in self.items:
                return self.items[i]
            image, label = super().__getitem__(i)
            return image, self.labels.get(i, label)


    def stray():
        return Odd(labels={7: 100000})


    def sparse():
        return Odd(labels={30: 50, 12: 50, 61: 70})


    def gap():
        return Odd(labels={i: 2 for i in range(1, 90, 2)})


    def beyond():
        return Odd(classes=["dark", "light"], labels={13: 2})


    def one_label():
        return Odd(labels={i: 0 for i in range(90)})


    def flag_label():
        return Odd(labels={5: True})


    def raising():
        return Odd(raises={33: KeyError("scan-33.png")})


    def short():
        return Odd(raises={i: IndexError("list index out of range") for i in range(80, 90)})


    def ends_in_none():
        return Odd(items={i: None for i in range(80, 90)})


    def stops():
        return Odd(raises={33: StopIteration()})


    def fractional_len():
        return Odd(length=2.5)


    def negative_len():
        return Odd(length=-1)


    def string_classes():
        return Odd(classes="dark light")


    def numbered_classes():
        return Odd(classes=[0, 1])


    def twice_named():
        return Odd(classes=["dark", "dark"])


    def one_class():
        return Odd(classes=["dark"])


    def array_classes():
        return Odd(classes=np.array(["dark", "light"]))


    def empty_image():
        return Odd(items={20: (np.zeros((0, 5), dtype=np.uint8), 0)})


    def channels_first():
        return Odd(items={20: (np.zeros((3, 10, 12), dtype=np.uint8), 0)})


    def unconvertible():
        return Odd(items={20: (Image.new("La", (4, 4)), 0)})


    def resized():
        return Odd(items={i: (Image.new("L", (5 + i % 7, 3 + i % 11), 30), 0) for i in range(0, 90, 2)})


    def listing():
        return [1, 2, 3].__iter__()


    def empty():
        return []
    '''


@pytest.fixture
def shades(user_module):
    user_module("shades", MODULE)


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


CLASSES_FIX = "give the dataset a classes attribute naming its classes .labels index it., or fix the label"


@pytest.mark.parametrize("factory, message", [
    ("broken", r"item 41 has an image array of dtype float32 and shape \(4, 4\): each item must be"),
    ("listing", "returned a list_iterator, which is not a map-style dataset"),
    ("empty", "returned an empty dataset"),
    ("absent", "module shades has no absent"),
    # Labels: a class index, not a stray number that would stage 100,001 classes.
    ("stray", "item 7 has the label 100000, but the dataset has 90 items and no classes attribute: its "
              "classes would be the label numbers 0..100000, most of them without a single item; "
              + CLASSES_FIX),
    ("sparse", "item 12 has the label 50, and only 4 of the labels 0..70 occur: without a classes attribute "
               "the labels name the classes and must be 0..K-1 for K >= 2 classes; " + CLASSES_FIX),
    ("one_label", "item 0 has the label 0, and every item has it"),
    ("beyond", r"item 13 has the label 2, but the dataset's classes attribute names 2 classes: labels index "
               r"it \(0..1\); fix the label, or add its class to classes"),
    ("flag_label", "item 5 has the label True: labels are ints >= 0"),
    # Items that raise, and a dataset shorter than its len(): one error naming the item.
    ("raising", "item 33 raised KeyError: 'scan-33.png': fix the dataset's __getitem__ for that index, or "
                "leave the item out of the dataset"),
    ("short", r"item 89 raised IndexError: list index out of range: the dataset gives fewer items than its "
              r"len\(\) of 90 promises: make __len__ return the number of items"),
    ("ends_in_none", r"item 89 is None, not \(image, label\); if the dataset ends early, the dataset gives "
                     r"fewer items than its len\(\) of 90 promises"),
    ("stops", r"item 33 raised StopIteration: the dataset gives fewer items than its len\(\)"),
    ("fractional_len", r"len\(\) of the dataset failed \(TypeError: 'float' object cannot be interpreted "
                       r"as an integer\): make __len__ return the number of items, an int"),
    ("negative_len", r"len\(\) of the dataset failed \(ValueError: __len__\(\) should return >= 0\)"),
    # The classes attribute: distinct names, at least two.
    ("string_classes", "the dataset's classes attribute is a str .'dark light'.: make it a list of the class "
                       "names"),
    ("numbered_classes", "the dataset's classes attribute holds 0 at position 0, not a class name"),
    ("twice_named", "the dataset's classes attribute names 'dark' twice: class names must be distinct"),
    ("one_class", "the dataset's classes attribute names 1 class.es. .'dark'.: classification needs at least "
                  "two"),
    # Images that cannot be staged.
    ("empty_image", r"item 20 has an empty image \(5x0 pixels\)"),
    ("channels_first", r"item 20 has an image array of dtype uint8 and shape \(3, 10, 12\) \(channels "
                       r"first\? transpose it to HxWxC\)"),
    ("unconvertible", r"item 20 has a PIL image \(mode La\) that cannot be converted to RGB \(ValueError: "),
])
def test_a_dataset_that_is_not_one_is_refused_by_name(shades, tmp_path, factory, message):
    with pytest.raises(StagingError, match=message) as info:
        stage(DataConfig(source=f"python:shades:{factory}", image_size=8, decode_workers=1), tmp_path / "out")
    assert "\n" not in str(info.value)  # one line, whatever the user's exception held
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.staging-*"))


def test_an_item_that_raises_in_a_decode_process_is_named_without_the_worker_traceback(shades, tmp_path):
    # Item 33 is read only by the decode processes (the fingerprint reads items 0, 45 and 89).
    with pytest.raises(StagingError, match="item 33 raised KeyError: 'scan-33.png': fix the dataset") as info:
        stage(DataConfig(source="python:shades:raising", image_size=8, decode_workers=2), tmp_path / "out")
    assert info.value.__cause__ is None and info.value.__suppress_context__
    assert not (tmp_path / "out").exists()


def test_labels_with_a_gap_stage_with_a_warning_and_images_of_any_size_are_resized(shades, tmp_path, caplog):
    manifest = stage(DataConfig(source="python:shades:gap", image_size=8, decode_workers=1), tmp_path / "gap")
    assert manifest.classes == ["0", "1", "2"]  # label 1 has no item: at most half missing is accepted
    assert "no item has the label(s) 1 of its 3 classes" in caplog.text
    named = stage(DataConfig(source="python:shades:array_classes", image_size=8, decode_workers=1),
                  tmp_path / "named")
    assert named.classes == ["dark", "light"]
    resized = stage(DataConfig(source="python:shades:resized", image_size=8, channels=1, decode_workers=1),
                    tmp_path / "resized")
    assert sum(info.count for info in resized.splits.values()) == 90 and resized.shape == (1, 8, 8)
