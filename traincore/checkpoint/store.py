"""Where checkpoint files live: a local directory, or a prefix in an object store (s3://, gs://, ...).

A :class:`Store` is one location: the checkpoint root, or one step directory under it (:meth:`Store.child`).
Local locations use the OS directly: files are published with a temporary name, fsync and rename, and
deletion makes the marker's removal durable first. Object stores have no rename and no fsync, and need none:
a PUT (a multipart upload included) becomes visible whole or not at all, and S3 lists and reads an object
as soon as its PUT returned (strong read-after-write consistency). There every rank reads and writes its
own files straight in the store through fsspec (s3fs, gcsfs, adlfs): no node-local copy, no mirror.

Credentials: ``storage_options`` go to fsspec as they are (a task passes the ones Flyte is configured with);
without them the store's own defaults apply (for s3: the ``AWS_*`` environment, ``~/.aws``, an instance
role). They are never logged and never written into a checkpoint.
"""

from __future__ import annotations

import io
import shutil
import zlib
from collections.abc import Callable
from pathlib import Path, PurePosixPath
from typing import IO

import fsspec
import fsspec.core

from traincore.checkpoint.upload import PART_BYTES, MultipartUpload
from traincore.files import fsync_path, write_atomically

# Listings must see what other ranks and nodes wrote a moment ago: fsspec's directory cache would not.
_FRESH = {"refresh": True}
# A large remote file is read in ranges of this size, concurrently (fsspec's cat_ranges).
READ_PART_BYTES = PART_BYTES


STORE_ACCESS_FIX = ("check that the object exists and that this machine reaches the store with credentials "
                    "that may read it (for s3://: AWS_* or FLYTE_AWS_* settings or the store_secret input, "
                    "and AWS_ENDPOINT_URL / FLYTE_AWS_ENDPOINT for a store other than AWS)")
"""The fix for a store that cannot be read: botocore, gcsfs and adlfs raise their own errors for missing
credentials and an unreachable endpoint, so every reader names the location and this."""


def error_reason(exc: BaseException) -> str:
    """``Type: first line`` of an error, for a message that names its cause in one line."""
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__


def is_uri(location: str | Path) -> bool:
    """True for object-store URIs (s3://, gs://, ...); plain paths and file:// URIs are local."""
    text = str(location)
    return "://" in text and not text.startswith("file://")


class Store:
    """One location for checkpoint files, local or in an object store, addressed by names below it."""

    def __init__(self, location: str | Path, storage_options: dict | None = None):
        self.options = dict(storage_options or {})
        text = str(location)
        self.local = not is_uri(text)
        if self.local:
            self.path = Path(text.removeprefix("file://"))
            self.uri = str(self.path)
            self.fs = None
            return
        self.uri = text.rstrip("/")
        self.fs, self._base = fsspec.core.url_to_fs(self.uri, **self.options)

    def __str__(self) -> str:
        return self.uri

    def __repr__(self) -> str:
        return f"Store({self.uri!r})"

    @property
    def name(self) -> str:
        """The last component of the location (``step-000123`` for a step directory)."""
        return self.path.name if self.local else PurePosixPath(self._base).name

    def child(self, name: str) -> Store:
        """The location ``name`` below this one, on the same filesystem with the same options."""
        return Store(self.path / name if self.local else f"{self.uri}/{name}", self.options)

    def uri_of(self, name: str) -> str:
        """How messages spell the file ``name`` below this location."""
        return str(self.path / name) if self.local else f"{self.uri}/{name}"

    def _key(self, name: str) -> str:
        return f"{self._base}/{name}" if name else self._base

    # ---- listing -----------------------------------------------------------------------------------

    def entries(self) -> dict[str, str]:
        """Direct children by name: ``"dir"``, ``"file"`` or (local only) ``"other"`` (a symlink, a device);
        empty when the location does not exist."""
        if self.local:
            if not self.path.is_dir():
                return {}
            return {p.name: _local_kind(p) for p in self.path.iterdir()}
        try:
            listing = self.fs.ls(self._base, detail=True, **_FRESH)
        except FileNotFoundError:
            return {}
        found = {}
        for info in listing:
            name = PurePosixPath(info["name"]).name
            if name and info["name"].rstrip("/") != self._base:
                found[name] = "dir" if info["type"] == "directory" else "file"
        return found

    def files(self) -> dict[str, int]:
        """Every file below this location (names relative to it, ``/``-separated) and its size."""
        if self.local:
            if not self.path.is_dir():
                return {}
            return {p.relative_to(self.path).as_posix(): p.stat().st_size
                    for p in sorted(self.path.rglob("*")) if p.is_file()}
        try:
            found = self.fs.find(self._base, detail=True, **_FRESH)
        except FileNotFoundError:
            return {}
        prefix = f"{self._base}/"
        return {name.removeprefix(prefix): int(info.get("size") or 0) for name, info in sorted(found.items())
                if info.get("type") != "directory" and name.startswith(prefix)}

    def exists(self) -> bool:
        """Whether anything is at this location (a directory, or any object below the prefix)."""
        if self.local:
            return self.path.exists() or self.path.is_symlink()
        return bool(self.entries())

    def is_file(self, name: str) -> bool:
        """Whether the file ``name`` exists below this location."""
        if self.local:
            return (self.path / name).is_file()
        return self.fs.isfile(self._key(name))

    def size(self, name: str) -> int | None:
        """The size of the file ``name``, or None when it does not exist."""
        if self.local:
            path = self.path / name
            return path.stat().st_size if path.is_file() else None
        try:
            self.fs.invalidate_cache(self._key(name))
            return int(self.fs.size(self._key(name)))
        except FileNotFoundError:
            return None

    # ---- reading and writing -----------------------------------------------------------------------

    def open(self, name: str, mode: str = "rb") -> IO[bytes]:
        """The file ``name`` opened in binary ``mode`` (FileNotFoundError when it is absent for reading);
        a remote file opened for writing is uploaded as it fills (on S3 several parts at once,
        traincore.checkpoint.upload) and committed on close."""
        if self.local:
            return open(self.path / name, mode)
        if mode == "wb" and hasattr(self.fs, "call_s3"):
            return MultipartUpload(self.fs, self._key(name))
        return self.fs.open(self._key(name), mode)

    def read_bytes(self, name: str) -> bytes:
        """The whole file ``name``; a remote one larger than a few parts in concurrent ranged GETs (a
        single GET streams at one connection's speed)."""
        if self.local:
            return (self.path / name).read_bytes()
        size = self.size(name)
        if size is None or size <= 2 * READ_PART_BYTES:
            return self.fs.cat_file(self._key(name))
        parts = [(name, start, min(READ_PART_BYTES, size - start))
                 for start in range(0, size, READ_PART_BYTES)]
        return b"".join(self.read_ranges(parts))

    def read_ranges(self, ranges: list[tuple[str, int, int]]) -> list[bytes]:
        """The byte ranges ``(name, offset, length)``; remote ones fetched concurrently (fsspec's
        ``cat_ranges``: one ranged GET each, run together on its event loop)."""
        if self.local:
            blobs = []
            for name, offset, length in ranges:
                with open(self.path / name, "rb") as handle:
                    handle.seek(offset)
                    blobs.append(handle.read(length))
            return blobs
        if not ranges:
            return []
        names, starts, lengths = zip(*ranges, strict=True)
        return self.fs.cat_ranges([self._key(name) for name in names], list(starts),
                                  [start + length for start, length in zip(starts, lengths, strict=True)],
                                  on_error="raise")

    def write_bytes(self, name: str, data: bytes | memoryview) -> dict:
        """Publish ``data`` as the file ``name`` whole or not at all; returns its size and CRC32."""
        if self.local:
            (self.path / name).parent.mkdir(parents=True, exist_ok=True)
            write_atomically(self.path / name, bytes(data))
        elif hasattr(self.fs, "call_s3"):
            with MultipartUpload(self.fs, self._key(name)) as upload:
                upload.write(data)
        else:
            self.fs.pipe_file(self._key(name), bytes(data))
        return {"bytes": len(data), "crc32": f"{zlib.crc32(data):08x}"}

    def make_dir(self) -> None:
        """Create the location as a directory (local); an object store has no directories to create."""
        if self.local:
            self.path.mkdir(parents=True, exist_ok=False)

    def remove_file(self, name: str) -> None:
        """Delete the file ``name`` if it exists; locally the removal is made durable before returning."""
        if self.local:
            path = self.path / name
            if path.exists():
                path.unlink(missing_ok=True)
                fsync_path(self.path)
            return
        try:
            self.fs.rm_file(self._key(name))
        except FileNotFoundError:
            pass

    def remove_tree(self) -> None:
        """Delete the location and everything below it."""
        if self.local:
            if self.path.is_symlink() or self.path.is_file():
                self.path.unlink(missing_ok=True)
            else:
                shutil.rmtree(self.path, ignore_errors=True)
            return
        names = sorted(self.files())
        if names:
            self.fs.rm([self._key(name) for name in names])
        self.abort_uploads()
        self.fs.invalidate_cache(self._base)

    def unfinished_uploads(self) -> dict[str, str]:
        """Multipart uploads below this location that were begun and neither completed nor aborted (a rank
        killed mid-upload leaves one, invisible to listings): name -> upload id. s3fs only; none elsewhere."""
        if self.local or not hasattr(self.fs, "call_s3"):
            return {}
        bucket, _, prefix = self._base.partition("/")
        found, page = {}, {}
        while True:  # S3 lists 1000 a page: follow the markers (a shared bucket may hold many)
            try:
                reply = self.fs.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=f"{prefix}/", **page)
            except FileNotFoundError:  # no bucket, so no uploads either
                return {}
            found.update({upload["Key"].removeprefix(f"{prefix}/"): upload["UploadId"]
                          for upload in reply.get("Uploads", [])})
            if not reply.get("IsTruncated"):
                return found
            page = {"KeyMarker": reply["NextKeyMarker"], "UploadIdMarker": reply["NextUploadIdMarker"]}

    def abort_uploads(self, select: Callable[[str], bool] = lambda name: True) -> list[str]:
        """Abort the unfinished uploads below this location whose names ``select`` picks (their parts are
        kept, and billed, by the store until then); the names."""
        uploads = self.unfinished_uploads()
        if not uploads:
            return []
        bucket = self._base.partition("/")[0]
        aborted = []
        for name, upload_id in uploads.items():
            if select(name):
                self.fs.abort_mpu(bucket, self._key(name), upload_id)
                aborted.append(name)
        return aborted


def _local_kind(path: Path) -> str:
    if path.is_symlink():
        return "other"
    return "dir" if path.is_dir() else "file" if path.is_file() else "other"


def as_store(location: str | Path | Store) -> Store:
    """``location`` as a Store (itself when it is one; a path or URI with the store's default options)."""
    return location if isinstance(location, Store) else Store(location)


def read_stream(store: Store, name: str) -> IO[bytes]:
    """``name`` opened for reading, as a seekable stream torch.load can read (remote: fetched whole)."""
    if store.local:
        return store.open(name)
    return io.BytesIO(store.read_bytes(name))
