"""Ranged reads of shards: over presigned plain HTTP on an S3 store (a local S3 server), the same bytes as a
local directory gives, and a failed read named by the shard's URI, never by its signed URL."""

from __future__ import annotations

import os
import uuid

import pytest

from traincore.checkpoint import Store
from traincore.data.ranges import RangeReader

RANGES = [("shard.u8", 0, 10), ("shard.u8", 70_000, 4_096), ("other.u8", 123, 1)]


@pytest.fixture
def stores(tmp_path, s3_server) -> tuple[Store, Store]:
    """The same two files in a local directory and under a prefix of the bucket."""
    local = Store(tmp_path)
    remote = Store(f"s3://{s3_server.bucket}/ranges-{uuid.uuid4().hex[:8]}", s3_server.storage_options)
    for name, size in (("shard.u8", 100_000), ("other.u8", 200)):
        data = os.urandom(size)
        (tmp_path / name).write_bytes(data)
        remote.write_bytes(name, data)
    return local, remote


def test_presigned_ranges_from_the_store_are_the_bytes_a_local_directory_gives(stores):
    local, remote = stores
    reader = RangeReader(remote)
    assert reader.read(RANGES) == RangeReader(local).read(RANGES) == local.read_ranges(RANGES)
    assert reader.read([]) == []
    reader.close()


def test_a_missing_shard_is_named_by_its_uri_and_the_signed_url_never_shows(stores):
    _, remote = stores
    with pytest.raises(FileNotFoundError) as caught:
        RangeReader(remote).read([("shard.u8", 0, 10), ("gone.u8", 0, 10)])
    text = str(caught.value)
    assert remote.uri_of("gone.u8") in text
    assert "Signature" not in text and "Credential" not in text and "?" not in text
    assert caught.value.__cause__ is None and caught.value.__context__ is None
