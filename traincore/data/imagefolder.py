"""ImageFolder source: ``<root>/<class>/<image>`` on a local path or any fsspec URI.

Files are listed once (names, sizes and ETags or modification times, from fsspec's detail listings; no image
is opened), assigned to splits, then decoded and resized in a process pool (decoding is CPU-bound and
releases no GIL) and streamed to the shard writer in split order. Decode tasks hold at most CHUNK_BYTES of
pixels and at most IN_FLIGHT_BYTES of results wait for the writer, so memory stays bounded whatever the
image size and the worker count.

Stable splits: an image's split is a function of its identity, its path relative to the source root, and the
seed: the first 6 bytes of sha256("<seed>/<class>/<file>") over 2**48, u in [0, 1), put it in test when u <
test_fraction, in val when u < test_fraction + val_fraction, else in train. Images added later never move an
existing image out of train (nor, once every split has images of its own, anywhere), so a model trained on one
staging is never scored on its own training images after the folder grows. Split sizes follow the fractions
statistically, not exactly. A split with a non-zero fraction that no image hashes into takes the train image
nearest to it (the smallest u in train); as the folder grows that image can only go back to train, never the
other way. Each split is stored in order of u: a fixed, class-mixed order. (Staging format 1 drew a seeded
permutation of the listing instead, which reshuffled every split whenever one image was added.)

Listing is bounded: past MAX_LISTED_FILES files under the class directories (every file counts, images or
not) it stops with a StagingError, so a too-wide prefix fails fast instead of listing a whole bucket; a
progress line is reported every PROGRESS_EVERY files.

Dot-files and dot-directories (.DS_Store, ._<name>, .ipynb_checkpoints/, .git/) are skipped everywhere: not
listed, not classes, not in the fingerprint. Every image is converted to 8-bit RGB or greyscale
(:func:`convert`: palette, CMYK, alpha and 16-bit images included); 32-bit images are refused, naming the
file.
An object store that finds no credentials fails the listing with a StagingError naming the location and the
settings to make (CREDENTIALS_FIX).

Symlinks (local paths and file:// URIs): a class directory or image may be a link to elsewhere inside the
source root; an entry whose resolved path leaves the root is refused (StagingError naming the entry and
its target), never skipped silently, so a tree staged here is exactly the tree that was asked for. A linked
image is listed with its target's size and modification time.
"""

from __future__ import annotations

import hashlib
import io
import logging
import os
import time
from collections.abc import Callable, Iterator
from typing import NamedTuple

import numpy as np

from traincore.config import DataConfig
from traincore.data.decode import CHUNK, convert, decoded_chunks, fit
from traincore.data.manifest import SPLITS, StagingError
from traincore.data.sources import Chunk, Ranges, Source, chunk_images

log = logging.getLogger(__name__)

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".gif", ".tif", ".tiff", ".webp", ".ppm", ".pgm")
# Listing held in memory: about 540 bytes per file at its peak (measured with short local paths), so
# about 1.1 GB here; ImageNet-1k's train split (1.28 M images) fits.
MAX_LISTED_FILES = 2_000_000
PROGRESS_EVERY = 10_000  # files listed between progress lines
# What to set when an object store finds no credentials (the message names the location as well).
CREDENTIALS_FIX = ("for s3://, set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (with AWS_ENDPOINT_URL for an "
                   "S3-compatible store such as MinIO), or AWS_PROFILE with ~/.aws/credentials; the "
                   "Flyte tasks (plan_run, stage_dataset) also take the store settings Flyte gives them, "
                   "FLYTE_AWS_ACCESS_KEY_ID, FLYTE_AWS_SECRET_ACCESS_KEY and FLYTE_AWS_ENDPOINT")
# Listing fields that change when a file's bytes do, most specific first: object stores' ETags and
# checksums (s3fs, gcsfs, http), then modification times (local, s3fs, gcsfs), then the memory filesystem's
# creation time (a rewrite there makes a new file).
VERSION_FIELDS = ("ETag", "etag", "md5Hash", "generation", "mtime", "LastModified", "last_modified",
                  "updated", "created")


class ImageFile(NamedTuple):
    """One listed image: where staging reads it, its identity, its label and what says it changed."""

    path: str  # full URI for fsspec.open
    name: str  # path relative to the source root, "/"-separated: the image's identity
    label: int
    size: int
    version: str  # "<field>=<value>" of the first VERSION_FIELDS entry the filesystem reports, else ""


class ImageListing(NamedTuple):
    """Class names (sorted sub-directories) and their images, sorted by name."""

    classes: list[str]
    files: list[ImageFile]


def list_images(location: str, *, max_files: int = MAX_LISTED_FILES,
                progress: Callable[[str], None] = log.info,
                storage_options: dict | None = None) -> ImageListing:
    """List an ImageFolder tree from fsspec detail listings (no image is opened), with clear errors for
    bad layouts, missing object-store credentials and a StagingError past ``max_files`` files; ``progress``
    gets a line every PROGRESS_EVERY. ``storage_options`` go to the fsspec filesystem (credentials,
    endpoint); by default fsspec's own (for S3: the AWS_* variables, ~/.aws)."""
    try:
        return _list_images(location, max_files, progress, storage_options or {})
    except _missing_credentials() as exc:
        raise StagingError(f"cannot read imagefolder location {location!r}: no credentials for it were found "
                           f"({type(exc).__name__}: {exc}): {CREDENTIALS_FIX}") from None


def _missing_credentials() -> tuple[type[BaseException], ...]:
    """The errors an object-store client raises when it finds no credentials at all (botocore, for S3)."""
    try:
        from botocore.exceptions import NoCredentialsError, PartialCredentialsError
    except ImportError:
        return ()
    return NoCredentialsError, PartialCredentialsError


def _list_images(location: str, max_files: int, progress: Callable[[str], None],
                 storage_options: dict) -> ImageListing:
    import fsspec

    fs, root = fsspec.core.url_to_fs(location, **storage_options)
    if not fs.exists(root):
        raise StagingError(f"imagefolder location {location!r} does not exist: check the path or URI")
    if not fs.isdir(root):
        raise StagingError(f"imagefolder location {location!r} is a file: point it at a directory with one "
                           "sub-directory per class")
    root = root.rstrip("/")
    contained = _containment(fs, root, location)
    classes = sorted(name for name in (os.path.basename(p.rstrip("/")) for p in fs.ls(root, detail=False)
                                       if fs.isdir(p)) if not hidden(name))
    base = fs.unstrip_protocol(root)
    files: list[ImageFile] = []
    try:
        for label, path, info in _walk_classes(fs, root, classes, contained, location, max_files, progress):
            if not path.lower().endswith(IMAGE_EXTENSIONS):
                continue
            # fsspec walks into real directories only, so only a link can lead out of its checked class
            # directory; resolving every path would cost more than the listing itself.
            if info.get("islink"):
                contained(path)
                info = fs.info(path)  # the target's size and times, not the link's
            name = path[len(root) + 1:]
            files.append(ImageFile(f"{base}/{name}", name, label, int(info.get("size") or 0), _version(info)))
    except OSError as exc:
        raise StagingError(f"cannot list imagefolder location {location!r}: {exc}: check that it is "
                           "readable (permissions, credentials) and not changing while listed") from exc
    files.sort(key=lambda f: f.name)
    if not files:
        raise StagingError(f"imagefolder location {location!r} holds no images: expected "
                           f"<root>/<class>/<image> with extensions {', '.join(IMAGE_EXTENSIONS)}")
    used = sorted({f.label for f in files})
    if len(used) < 2:
        raise StagingError(f"imagefolder location {location!r} has images for only one class "
                           f"({classes[used[0]]!r}): classification needs at least two class directories")
    return ImageListing(classes, files)


def _walk_classes(fs, root: str, classes: list[str], contained: Callable[[str], None], location: str,
                  max_files: int, progress: Callable[[str], None]) -> Iterator[tuple[int, str, dict]]:
    """(label, path, listing info) of every file under the class directories, directory by directory."""
    count, start = 0, time.monotonic()
    for label, name in enumerate(classes):
        directory = f"{root}/{name}"
        contained(directory)
        for _, directories, entries in fs.walk(directory, detail=True, on_error="raise"):
            for name in [name for name in directories if hidden(name)]:
                del directories[name]  # fsspec's walk then skips it (.ipynb_checkpoints/, .git/)
            entries = {name: info for name, info in entries.items() if not hidden(name)}
            before, count = count, count + len(entries)
            if count > max_files:
                raise StagingError(f"imagefolder location {location!r} holds more than {max_files:,} files "
                                   f"(listing stopped in {directory}): point data.source at a narrower "
                                   "prefix, or split the dataset")
            if count // PROGRESS_EVERY > before // PROGRESS_EVERY:
                progress(f"listing {location}: {count:,} files in {time.monotonic() - start:.0f} s "
                         f"(class {label + 1} of {len(classes)})")
            for info in entries.values():
                yield label, info["name"].rstrip("/"), info


def hidden(name: str) -> bool:
    """Dot-files and dot-directories (.DS_Store, macOS's ._<name> AppleDouble files, .ipynb_checkpoints/,
    .git/) are skipped: they are never images of the dataset, nor classes."""
    return name.startswith(".")


def _version(info: dict) -> str:
    for field in VERSION_FIELDS:
        if info.get(field) is not None:
            return f"{field}={info[field]}"
    return ""


def assign_splits(files: list[ImageFile], cfg: DataConfig) -> dict[str, list[ImageFile]]:
    """Each image's split from the hash of its name and the seed (see the module docstring), in order of
    that hash; a held-out split nothing hashes into takes the train image nearest to it."""
    indices = split_indices([f.name for f in files], cfg)
    return {split: [files[i] for i in picked] for split, picked in indices.items()}


def split_indices(names: list[str], cfg: DataConfig) -> dict[str, list[int]]:
    """:func:`assign_splits` over items known by ``names`` (their identities): the indices of each split's
    items, in order of their hash."""
    ranked = sorted((_position(name, cfg.seed), index) for index, name in enumerate(names))
    test, held_out = cfg.test_fraction, cfg.test_fraction + cfg.val_fraction
    splits: dict[str, list[int]] = {split: [] for split in SPLITS}
    for u, index in ranked:
        splits["test" if u < test else "val" if u < held_out else "train"].append(index)
    for split, fraction in (("test", cfg.test_fraction), ("val", cfg.val_fraction)):
        if fraction > 0 and not splits[split]:
            if len(splits["train"]) < 2:
                raise StagingError(f"{len(names)} images leave no training split with val_fraction="
                                   f"{cfg.val_fraction} and test_fraction={cfg.test_fraction}: add images "
                                   "or lower the fractions")
            splits[split].append(splits["train"].pop(0))
    return splits


def _position(name: str, seed: int) -> float:
    """The image's place in [0, 1): the first 6 bytes of sha256("<seed>/<name>") over 2**48 (exact in a
    float, so never rounded up to 1)."""
    digest = hashlib.sha256(f"{seed}/{name}".encode("utf-8", "surrogateescape")).digest()
    return int.from_bytes(digest[:6], "big") / 2 ** 48


def _containment(fs, root: str, location: str):
    """A check that a listed entry resolves inside the source root (local filesystems; others have no
    symlinks), refusing one that escapes it with the entry, its target and the fix."""
    from fsspec.implementations.local import LocalFileSystem

    if not isinstance(fs, LocalFileSystem):
        return lambda path: None
    real_root = os.path.realpath(root)

    def check(path: str) -> None:
        real = os.path.realpath(path)
        if os.path.commonpath([real_root, real]) != real_root:
            raise StagingError(f"imagefolder location {location!r}: {path} resolves to {real}, outside the "
                               f"source root {real_root}: staging follows no link out of the tree; copy "
                               "the files into it or point data.source at the real directory")

    return check


def _decode(path: str, size: int, channels: int, storage_options: dict) -> np.ndarray:
    """Decode one image (:func:`convert`), resize its shorter side to ``size``, centre-crop to size x size;
    CHW uint8."""
    import fsspec
    from PIL import Image, UnidentifiedImageError

    try:
        with fsspec.open(path, "rb", **storage_options) as handle:
            image = Image.open(io.BytesIO(handle.read()))
            image = convert(image, "RGB" if channels == 3 else "L", path)
    except UnidentifiedImageError:  # its own text names only the in-memory buffer, not the file
        raise StagingError(f"cannot read image {path}: it is not an image in a format Pillow knows (another "
                           "kind of file, or a damaged one). Remove or replace the file and stage "
                           "again") from None
    except StagingError:  # convert's own refusal already names the file and the fix
        raise
    except (OSError, ValueError) as exc:
        # The message is the whole story: a chained traceback of PIL's internals would only bury it.
        raise StagingError(f"cannot read image {path}: {exc}. Remove or replace the file and stage "
                           "again") from None
    return fit(image, size, channels)


def _decode_chunk(paths: list[str], labels: np.ndarray, size: int, channels: int,
                  storage_options: dict) -> tuple[np.ndarray, np.ndarray]:
    return np.stack([_decode(p, size, channels, storage_options) for p in paths]), labels


def imagefolder_source(listing: ImageListing, cfg: DataConfig, storage_options: dict | None = None) -> Source:
    """Class names, samples per split and the reader of (split, images, labels) chunks for a listed
    ImageFolder tree; only the listed files are read, through fsspec with ``storage_options`` (as listed)."""
    options = storage_options or {}
    per_task = chunk_images(cfg.channels * cfg.image_size ** 2, CHUNK)
    splits = assign_splits(listing.files, cfg)

    def read(ranges: Ranges) -> Iterator[Chunk]:
        jobs = []
        for split, (first, last) in ranges.items():
            for lo in range(first, last, per_task):
                part = splits[split][lo:min(lo + per_task, last)]
                labels = np.array([f.label for f in part], dtype=np.int64)
                jobs.append((split, ([f.path for f in part], labels, cfg.image_size, cfg.channels, options)))
        return decoded_chunks(jobs, _decode_chunk, cfg, per_task)

    return Source(listing.classes, {split: len(files) for split, files in splits.items()}, read)
