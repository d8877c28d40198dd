"""Concurrent multipart uploads into S3-compatible stores: a stream whose parts go up several at once.

Why ours: an s3fs file opened for writing (``fs.open(path, "wb")``, what checkpoints used) uploads its parts
one after another, and ``pipe_file`` needs the whole file in memory first. Measured on the local S3 stand-in,
one process writing 300 MB: 3.2-3.6 s through this stream, 7.1-7.5 s through s3fs's file, 2.6-3.2 s through
boto3's ``upload_file``; two ranks' dcp save of 604 MB, 0.86 of boto3's upload of the same bytes
(bench/object_store.py, docs/performance.md). boto3 itself is not used:
a store's credentials and endpoint come through fsspec's options (Flyte's FLYTE_AWS_* settings), and its
transfer manager takes files or whole buffers, not a stream that torch.save fills.

The stream copies what is written into part buffers of ``PART_BYTES``, and while it fills the next one the
filled ones upload on ``CONCURRENCY`` threads (each a blocking ``call_s3`` on s3fs's own event loop, so the
store's client, retries and credentials are s3fs's). At most ``CONCURRENCY`` parts are in flight, so a
rank's transient memory is bounded (about 9 x 8 MiB); buffers are reused, which matters on VMs whose host
backs fresh memory lazily (traincore/checkpoint/writer.py). A file smaller than one part is one PUT. The
object appears only when ``close()`` completes the upload; ``discard()`` (or a failed part) aborts it, so a
failed save leaves no object and no parts billed.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

# boto3's TransferConfig defaults: 8 MiB parts, 10 threads. S3 wants parts of at least 5 MiB (but the last)
# and at most 10,000 parts a file: every GROW_EVERY parts the part size doubles, so a rank's file may reach
# terabytes without knowing its size in advance.
PART_BYTES = 8 << 20
CONCURRENCY = 8
GROW_EVERY = 1000
# Declared when the upload starts, as boto3's transfer manager does: the store then checks each part's CRC32
# (botocore sends it by default) and combines them at completion. Without it, a store that defaults to a
# full-object CRC64NVME computes one over the whole object when it completes: moto does, in Python, and a
# 600 MB two-rank dcp save took 10.7 s against boto3's 5.5 s; with it, 6.6 s (bench/object_store.py).
CHECKSUM = "CRC32"

# Part buffers by size, kept for the life of the process and shared by every upload: touched once, reused.
_free_buffers: dict[int, list[bytearray]] = {}
_free_lock = threading.Lock()


def _take_buffer(size: int) -> bytearray:
    with _free_lock:
        free = _free_buffers.get(size)
        return free.pop() if free else bytearray(size)


def _give_buffer(buffer: bytearray) -> None:
    with _free_lock:
        _free_buffers.setdefault(len(buffer), []).append(buffer)


class MultipartUpload:
    """A write-only binary stream that becomes the object ``path`` (``bucket/key``) of the s3fs filesystem
    ``fs`` when closed; parts upload concurrently while it is written."""

    def __init__(self, fs: Any, path: str, part_bytes: int = PART_BYTES, concurrency: int = CONCURRENCY):
        self.fs, self.path = fs, path
        self.bucket, _, self.key = path.partition("/")
        self.part_bytes, self.closed = part_bytes, False
        self._pool = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="store-upload")
        self._slots = threading.BoundedSemaphore(concurrency)
        self._parts: list[Future] = []
        self._buffer, self._fill = _take_buffer(self._part_size()), 0
        self._upload_id: str | None = None
        self._bytes = 0

    def _part_size(self) -> int:
        return self.part_bytes << (len(self._parts) // GROW_EVERY)

    def write(self, data: Any) -> int:
        """Copy ``data`` (any contiguous buffer) into the part being filled; a full part starts uploading."""
        view = memoryview(data).cast("B")
        done = 0
        while done < len(view):
            size = min(len(view) - done, len(self._buffer) - self._fill)
            self._buffer[self._fill:self._fill + size] = view[done:done + size]
            self._fill += size
            done += size
            if self._fill == len(self._buffer):
                self._send_part()
        self._bytes += len(view)
        return len(view)

    def tell(self) -> int:
        """Bytes written so far."""
        return self._bytes

    def flush(self) -> None:
        """Nothing to do: full parts are uploading already, and close() sends the rest."""

    def _send_part(self) -> None:
        """Upload the filled buffer as the next part (waiting for a free slot first) and take a new buffer."""
        if self._upload_id is None:
            self._upload_id = self.fs.call_s3("create_multipart_upload", Bucket=self.bucket, Key=self.key,
                                              ChecksumAlgorithm=CHECKSUM)["UploadId"]
        self._slots.acquire()
        self._raise_failed()
        number, buffer, fill = len(self._parts) + 1, self._buffer, self._fill
        self._parts.append(self._pool.submit(self._upload_part, number, buffer, fill))
        self._buffer, self._fill = _take_buffer(self._part_size()), 0

    def _upload_part(self, number: int, buffer: bytearray, fill: int) -> dict:
        try:
            body = buffer if fill == len(buffer) else bytes(memoryview(buffer)[:fill])
            reply = self.fs.call_s3("upload_part", Bucket=self.bucket, Key=self.key, PartNumber=number,
                                    UploadId=self._upload_id, Body=body)
            part = {"PartNumber": number, "ETag": reply["ETag"]}
            if "ChecksumCRC32" in reply:  # a store that checks parts wants each one's back at completion
                part["ChecksumCRC32"] = reply["ChecksumCRC32"]
            return part
        finally:
            _give_buffer(buffer)
            self._slots.release()

    def _raise_failed(self) -> None:
        """Raise the error of a part that failed already, so a broken upload stops the writer early."""
        for part in self._parts:
            if part.done() and part.exception() is not None:
                raise part.exception()

    def close(self) -> None:
        """Send what is left and complete the upload (the object appears now); on an error the upload is
        aborted and the error raised. Safe to call twice."""
        if self.closed:
            return
        try:
            if self._upload_id is None:  # smaller than a part: one PUT
                self.fs.call_s3("put_object", Bucket=self.bucket, Key=self.key,
                                Body=bytes(memoryview(self._buffer)[:self._fill]))
            else:
                if self._fill:
                    self._send_part()
                parts = [part.result() for part in self._parts]
                self.fs.call_s3("complete_multipart_upload", Bucket=self.bucket, Key=self.key,
                                UploadId=self._upload_id, MultipartUpload={"Parts": parts})
        except BaseException:
            self.discard()
            raise
        self._finish()

    def discard(self) -> None:
        """Abandon the upload: nothing is published, and the parts sent are aborted (not left billed)."""
        if self.closed:
            return
        for part in self._parts:
            part.cancel()
        self._pool.shutdown(wait=True)
        if self._upload_id is not None:
            self.fs.call_s3("abort_multipart_upload", Bucket=self.bucket, Key=self.key,
                            UploadId=self._upload_id)
        self._finish()

    def _finish(self) -> None:
        self._pool.shutdown(wait=True)
        self.fs.invalidate_cache(self.path)
        if self._buffer:
            _give_buffer(self._buffer)
        self._buffer, self.closed = bytearray(), True

    def __enter__(self) -> MultipartUpload:
        return self

    def __exit__(self, *exc: object) -> None:
        if exc[0] is None:
            self.close()
        else:
            self.discard()
