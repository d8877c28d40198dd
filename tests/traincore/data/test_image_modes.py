"""ImageFolder images as they come from cameras, scanners and notebooks: every Pillow mode staged to the
right 8-bit values (or refused naming the file), 1-pixel images, and dot-files skipped."""

from __future__ import annotations

import io
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from traincore.config.schema import DataConfig
from traincore.data.fingerprint import source_fingerprint
from traincore.data.imagefolder import list_images
from traincore.data.loader import StagedSplit
from traincore.data.manifest import SPLITS, StagingError
from traincore.data.staging import stage

REFERENCE = (10, 200, 30)  # class_1's colour: far from every colour under test


def png16(pixels: np.ndarray, colour_type: int) -> bytes:
    """A 16-bit PNG (Pillow cannot write colour ones): ``pixels`` uint16 HxW[xC], colour type 0 grey,
    2 RGB, 4 grey+alpha, 6 RGBA."""
    height, width = pixels.shape[:2]
    rows = b"".join(b"\0" + pixels[y].astype(">u2").tobytes() for y in range(height))

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 16, colour_type, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(rows)) + \
        chunk(b"IEND", b"")


def saved(image: Image.Image, name: str, **options) -> tuple[str, bytes]:
    buffer = io.BytesIO()
    image.save(buffer, format=Image.registered_extensions()[Path(name).suffix], **options)
    return name, buffer.getvalue()


def uniform(mode: str, value, size=(6, 5)) -> Image.Image:
    return Image.new(mode, size, value)


def palette(rgb: tuple[int, int, int], size=(6, 5)) -> Image.Image:
    """A palette image whose every pixel is index 1, coloured ``rgb``."""
    image = Image.new("P", size, 1)
    image.putpalette([0, 0, 0, *rgb])
    return image


# (case, file name and bytes, expected RGB of every staged pixel)
MODES = [
    ("palette", lambda: saved(palette((200, 40, 90)), "p.png"), (200, 40, 90)),
    # Every pixel's palette entry is the transparent one: its colour is kept, the alpha dropped.
    ("palette-transparent", lambda: saved(palette((200, 40, 90)), "pt.png", transparency=1), (200, 40, 90)),
    ("palette-gif-1x1", lambda: saved(palette((200, 40, 90), (1, 1)), "one.gif"), (200, 40, 90)),
    ("cmyk-jpeg", lambda: saved(uniform("CMYK", (0, 255, 255, 0)), "c.jpg", quality=100), (255, 0, 0)),
    ("cmyk-tiff", lambda: saved(uniform("CMYK", (0, 0, 255, 55)), "c.tif"), (200, 200, 0)),
    ("grey-alpha", lambda: saved(uniform("LA", (120, 0)), "la.png"), (120, 120, 120)),
    ("rgba-transparent", lambda: saved(uniform("RGBA", (70, 80, 250, 0)), "rgba.png"), (70, 80, 250)),
    ("bilevel", lambda: saved(uniform("1", 1), "b.png"), (255, 255, 255)),
    ("grey-16-bit", lambda: saved(uniform("I;16", 128 * 257), "g16.png"), (128, 128, 128)),
    ("grey-16-bit-tiff-dark", lambda: saved(uniform("I;16", 40 * 257 + 100), "g16.tif"), (40, 40, 40)),
    ("rgb-16-bit", lambda: ("c16.png", png16(np.full((5, 6, 3), (0xC800, 0x2800, 0x5A00), np.uint16), 2)),
     (200, 40, 90)),
    ("rgba-16-bit", lambda: ("c16a.png", png16(np.full((5, 6, 4), (0xC800, 0x2800, 0x5A00, 0), np.uint16),
                                                6)), (200, 40, 90)),
    ("rgb-1x1", lambda: saved(uniform("RGB", (200, 40, 90), (1, 1)), "px.png"), (200, 40, 90)),
    ("rgb-1x40", lambda: saved(uniform("RGB", (200, 40, 90), (1, 40)), "strip.png"), (200, 40, 90)),
]


def folder(root: Path, name: str, content: bytes, copies: int = 3) -> Path:
    """class_0: ``copies`` of the image under test; class_1: reference images of another colour."""
    for label in ("class_0", "class_1"):
        (root / label).mkdir(parents=True)
    for index in range(copies):
        (root / "class_0" / f"{index}-{name}").write_bytes(content)
        uniform("RGB", REFERENCE).save(root / "class_1" / f"{index}.png")
    return root


def staged_colours(directory: Path) -> dict[int, set[tuple[int, ...]]]:
    """Each label's distinct staged pixel values (C values per pixel) over every split."""
    found: dict[int, set[tuple[int, ...]]] = {}
    for split in SPLITS:
        data = StagedSplit(directory, split)
        if len(data):
            images, labels = (t.numpy() for t in data.read(np.arange(len(data))))
            for image, label in zip(images, labels, strict=True):
                pixels = image.reshape(image.shape[0], -1).T
                found.setdefault(int(label), set()).update(map(tuple, pixels.tolist()))
    return found


@pytest.mark.parametrize(("case", "make", "rgb"), MODES, ids=[case for case, _, _ in MODES])
@pytest.mark.parametrize("channels", [3, 1])
def test_every_mode_is_staged_to_its_8_bit_values(case, make, rgb, channels, tmp_path):
    name, content = make()
    root = folder(tmp_path / "images", name, content)
    cfg = DataConfig(source=f"imagefolder:{root}", image_size=8, channels=channels, decode_workers=1)
    manifest = stage(cfg, tmp_path / "staged")
    assert manifest.shape == (channels, 8, 8)
    expected = rgb if channels == 3 else (round(np.dot(rgb, (0.299, 0.587, 0.114))),)
    reference = REFERENCE if channels == 3 else (round(np.dot(REFERENCE, (0.299, 0.587, 0.114))),)
    colours = staged_colours(tmp_path / "staged")
    assert colours[1] == {reference}
    [staged] = colours[0]  # one colour: a uniform image stays uniform through resize and crop
    np.testing.assert_allclose(staged, expected, atol=2, err_msg=case)


@pytest.mark.parametrize(("mode", "value", "words"), [
    ("F", 0.5, "32-bit float pixels (mode F)"),
    ("I", 70000, "32-bit integer pixels (mode I)"),
])
def test_images_of_unknown_value_range_are_refused_naming_the_file(mode, value, words, tmp_path):
    name, content = saved(uniform(mode, value), "scan.tif")
    root = folder(tmp_path / "images", name, content)
    with pytest.raises(StagingError) as info:
        stage(DataConfig(source=f"imagefolder:{root}", image_size=8, decode_workers=1), tmp_path / "out")
    message = str(info.value)
    assert f"{root}/class_0/" in message and "-scan.tif" in message and words in message
    assert "save it as an 8- or 16-bit PNG or TIFF" in message
    assert message.count("-scan.tif") == 1 and "cannot read image" not in message  # said once, not wrapped
    assert not (tmp_path / "out").exists()


def add_dot_files(root: Path) -> None:
    """What macOS, Jupyter and git leave in a dataset folder, images (by extension) among them."""
    junk = b"\0\5\26\7\0\2\0\0Mac OS X        "  # an AppleDouble header: not an image
    (root / ".DS_Store").write_bytes(b"\0\0\0\1Bud1" + bytes(64))
    (root / ".git" / "objects").mkdir(parents=True)
    uniform("RGB", (1, 2, 3)).save(root / ".git" / "objects" / "stray.png")
    (root / ".hidden_class").mkdir()
    uniform("RGB", (1, 2, 3)).save(root / ".hidden_class" / "0.png")
    for label in ("class_0", "class_1"):
        (root / label / ".DS_Store").write_bytes(b"\0\0\0\1Bud1" + bytes(64))
        (root / label / "._0.png").write_bytes(junk)
        (root / label / ".ipynb_checkpoints").mkdir()
        uniform("RGB", (1, 2, 3)).save(root / label / ".ipynb_checkpoints" / "0-checkpoint.png")
        (root / label / "nested" / ".cache").mkdir(parents=True)
        (root / label / "nested" / ".cache" / "x.jpg").write_bytes(junk)


def test_dot_files_and_directories_are_skipped(tmp_path):
    root = folder(tmp_path / "images", "0.png", saved(uniform("RGB", (200, 40, 90)), "0.png")[1])
    clean = list_images(str(root))
    fingerprint = source_fingerprint(DataConfig(source=f"imagefolder:{root}"))
    add_dot_files(root)
    listing = list_images(str(root))
    assert listing == clean and listing.classes == ["class_0", "class_1"]
    assert source_fingerprint(DataConfig(source=f"imagefolder:{root}")) == fingerprint
    manifest = stage(DataConfig(source=f"imagefolder:{root}", image_size=8, decode_workers=1),
                     tmp_path / "staged")
    assert manifest.classes == ["class_0", "class_1"] and sum(s.count for s in manifest.splits.values()) == 6
    assert (1, 2, 3) not in set().union(*staged_colours(tmp_path / "staged").values())
