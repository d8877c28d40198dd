"""Concurrent multipart uploads into a local S3 server (moto): parts go up several at once, the object
appears whole on close, and a failed or abandoned upload leaves neither an object nor parts."""

from __future__ import annotations

import os
import threading
import uuid

import pytest

from traincore.checkpoint import MultipartUpload, Store

PART = 5 << 20  # S3's smallest part (but the last)


@pytest.fixture
def store(s3_server) -> Store:
    return Store(f"s3://{s3_server.bucket}/upload-{uuid.uuid4().hex[:8]}", s3_server.storage_options)


class CountingFS:
    """The store's s3fs filesystem, counting the parts uploading at the same moment (a wrapper through
    which the upload calls it; s3fs itself is untouched)."""

    def __init__(self, fs, fail_part: int | None = None):
        self.fs, self.fail_part = fs, fail_part
        self.active = self.most = 0
        self.lock = threading.Lock()

    def call_s3(self, method: str, **kwargs):
        if method != "upload_part":
            return self.fs.call_s3(method, **kwargs)
        with self.lock:
            self.active += 1
            self.most = max(self.most, self.active)
        try:
            if kwargs["PartNumber"] == self.fail_part:
                raise ConnectionError("the store went away")
            return self.fs.call_s3(method, **kwargs)
        finally:
            with self.lock:
                self.active -= 1

    def invalidate_cache(self, path: str) -> None:
        self.fs.invalidate_cache(path)


def test_parts_upload_concurrently_and_the_object_is_the_bytes_written(store, s3_server):
    data = os.urandom(4 * PART + 12345)
    fs = CountingFS(store.fs)
    with MultipartUpload(fs, store._key("big.bin"), part_bytes=PART, concurrency=3) as upload:
        for start in range(0, len(data), 3 << 20):  # writes that straddle the parts' edges
            upload.write(memoryview(data)[start:start + (3 << 20)])
        assert upload.tell() == len(data)
    assert fs.most >= 2, "the parts went up one at a time"
    assert store.read_bytes("big.bin") == data  # read back in concurrent ranges too (it is > 2 parts)
    head = s3_server.client().head_object(Bucket=s3_server.bucket, Key=store._key("big.bin").split("/", 1)[1],
                                          ChecksumMode="ENABLED")
    assert head["ETag"].strip('"').endswith("-5")  # 4 whole parts and the rest
    # Declared CRC32 at the start, as boto3 does: the store checked each part's and combined them.
    assert "ChecksumCRC32" in head and "ChecksumCRC64NVME" not in head
    assert store.unfinished_uploads() == {}


def test_a_file_smaller_than_a_part_is_one_put_and_write_bytes_uses_the_same_path(store, s3_server):
    assert store.write_bytes("small.json", b"{}")["bytes"] == 2
    assert store.read_bytes("small.json") == b"{}"
    head = s3_server.client().head_object(Bucket=s3_server.bucket,
                                          Key=store._key("small.json").split("/", 1)[1])
    assert "-" not in head["ETag"]


def test_a_failed_part_aborts_the_upload_and_publishes_nothing(store):
    fs = CountingFS(store.fs, fail_part=2)
    upload = MultipartUpload(fs, store._key("torn.bin"), part_bytes=PART, concurrency=2)
    with pytest.raises(ConnectionError, match="the store went away"):
        with upload:
            upload.write(os.urandom(3 * PART + 1))
    assert not store.is_file("torn.bin")
    assert store.unfinished_uploads() == {}, "the parts sent were left billed in the store"


def test_a_stream_abandoned_mid_write_publishes_nothing(store):
    with store.open("half.bin", "wb") as upload:
        upload.write(os.urandom(2 * (8 << 20) + 1))
        upload.discard()
    assert not store.is_file("half.bin") and store.unfinished_uploads() == {}
