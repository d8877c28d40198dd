"""Durable files: atomic publication (temporary sibling, fsync, rename, fsync of the directory) and sha256.

Every writer that publishes a file or a directory (checkpoints, sinks, the registry, staged data, exports)
goes through these, so "a reader sees the old version or the whole new one, never a torn one" holds in one
place.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import uuid
from pathlib import Path

_BLOCK = 8 << 20


def uri_problem(location: str) -> str | None:
    """What is wrong with the URI ``location`` before anything is contacted: it names no bucket (``s3://``
    would be read as the local directory ``s3:``), or its scheme is one fsspec does not know or cannot load;
    None for a usable URI or a plain path."""
    protocol, uri, rest = location.partition("://")
    if not uri or protocol == "file":
        return None
    if not rest.split("/", 1)[0]:
        return f"{location!r} names no bucket: write {protocol}://BUCKET/PATH"
    import fsspec  # only for a URI: most runs read local paths

    try:
        fsspec.get_filesystem_class(protocol)
    except ValueError:
        return (f"{location!r} has the unknown scheme {protocol}://: use a local path or an object-store URI "
                "such as s3://bucket/path or gs://bucket/path")
    except ImportError as exc:
        return (f"{location!r} needs a filesystem package that is not installed ({exc}): install it, or use "
                "s3:// or gs://")
    return None


def path_argument(text: str) -> str:
    """argparse's ``type`` for a path or URI flag: an empty value (an unset shell variable, most likely)
    would mean the current directory, which is never what was meant, so it is refused; so is a URI with a
    :func:`uri_problem`."""
    if not text.strip():
        raise argparse.ArgumentTypeError("is empty: give a path or URI (is a shell variable unset?)")
    problem = uri_problem(text)
    if problem:
        raise argparse.ArgumentTypeError(problem)
    return text


def local_path_argument(text: str) -> str:
    """argparse's ``type`` for a path flag that takes no object-store URI: :func:`path_argument`, and a URI
    (read as a local path, ``s3://b/m`` would become the directory ``s3:/b``) is refused with the fix."""
    text = path_argument(text)
    if "://" in text and not text.startswith("file://"):
        raise argparse.ArgumentTypeError(f"{text!r} is an object-store URI, and this flag takes a local "
                                         "path: copy it to this machine first (e.g. aws s3 cp --recursive "
                                         "URI DIR)")
    return text.removeprefix("file://")


def fsync_path(path: str | Path) -> None:
    """fsync a file or a directory by path (a directory's fsync makes a rename inside it durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def publish(tmp: str | Path, path: str | Path) -> None:
    """Make ``tmp`` durable and rename it to ``path``: readers see the old file or the whole new one."""
    fsync_path(tmp)
    os.replace(tmp, path)
    fsync_path(Path(path).parent)  # the rename itself


def publish_directory(partial: str | Path, target: str | Path) -> None:
    """Rename a fully written directory into place and make the rename durable.

    ``os.rename`` fails on an existing, non-empty ``target``: a published directory is never replaced by
    this call (callers that mean to replace one move the old one aside first)."""
    os.rename(partial, target)
    fsync_path(Path(target).parent)


def temporary_sibling(path: str | Path) -> Path:
    """A hidden, unique name beside ``path`` to write into before :func:`publish`."""
    path = Path(path)
    return path.with_name(f".{path.name}.{os.getpid()}-{uuid.uuid4().hex[:8]}.tmp")


def write_atomically(path: str | Path, data: str | bytes) -> None:
    """Write ``data`` to ``path`` through a temporary sibling; nothing half-written is ever visible there."""
    tmp = temporary_sibling(path)
    try:
        with open(tmp, "wb") as handle:
            handle.write(data.encode() if isinstance(data, str) else data)
        publish(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def give_default_mode(path: str | Path) -> None:
    """Give ``path`` the mode ``open()`` gives a new file (0666 less the umask): safetensors writes through a
    private temporary file and leaves its output 0600, readable by its owner only."""
    os.chmod(path, 0o666 & ~_umask())


def _umask() -> int:
    """The process's umask, read without changing it where Linux shows it (os.umask sets it to read it)."""
    try:
        for line in open("/proc/self/status"):
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def write_durably(path: str | Path, data: str | bytes) -> None:
    """Write ``data`` to ``path`` and fsync it (for a file inside a directory that is published later)."""
    with open(path, "wb") as handle:
        handle.write(data.encode() if isinstance(data, str) else data)
        handle.flush()
        os.fsync(handle.fileno())


def sha256_file(path: str | Path) -> str:
    """Hex sha256 of a file, read in 8 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(_BLOCK):
            digest.update(block)
    return digest.hexdigest()
