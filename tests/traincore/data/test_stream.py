"""Streaming a staged dataset from an object store (a local S3 server): the same batches as from local disk,
in a cache that never outgrows its limit, and corruption or loss in the store named, never trained on."""

from __future__ import annotations

import dataclasses
import logging
import shutil
import threading
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch
from trainruns import CHECKPOINTED, final_weights

from traincore.checkpoint import Store
from traincore.config import DataConfig, LoaderConfig
from traincore.data import StagedLoader, StagedSplit, StreamedSplit, StreamError, eval_batches, stage
from traincore.data.stream import (
    MAX_WINDOW,
    NODE_CACHE_ENV,
    WINDOW,
    cache_limit,
    open_streamed,
    verify_streamed,
)

DATA = DataConfig(source="synthetic", image_size=16, synthetic_samples=640, synthetic_classes=4,
                  samples_per_shard=64)
LOADER = LoaderConfig(batch_size=8, eval_batch_size=8)


@pytest.fixture(scope="module")
def staged(tmp_path_factory) -> Path:
    output = tmp_path_factory.mktemp("stream") / "staged"
    stage(DATA, output)
    return output


@pytest.fixture
def remote(staged, s3_server) -> Store:
    """The staging uploaded to its own prefix in the bucket, as a stage task on a cluster leaves it."""
    store = Store(f"s3://{s3_server.bucket}/staged-{uuid.uuid4().hex[:8]}", s3_server.storage_options)
    store.fs.put(f"{staged}/", store.uri + "/", recursive=True)
    return store


def batches(loader: StagedLoader, count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [batch for batch, _ in zip(loader.host_batches(), range(count), strict=False)]


def streamed(remote: Store, tmp_path: Path, cache_bytes: int = 1 << 20) -> StreamedSplit:
    """The train split in ``remote``, its cache in ``tmp_path``."""
    (split,) = open_streamed(remote, ("train",), cache_bytes, cache_dir=tmp_path / "cache")
    return split


@pytest.mark.parametrize("block", [1, 4])
def test_streamed_batches_are_the_local_ones_across_epochs_and_a_resume_on_another_world_size(
        staged, remote, tmp_path, block):
    local, stream = StagedSplit(staged, "train"), streamed(remote, tmp_path)
    loader_cfg = dataclasses.replace(LOADER, block_samples=block)
    assert len(stream) == len(local) and np.array_equal(stream.labels, local.labels)
    steps = StagedLoader(local, loader_cfg, rank=1, world_size=2).steps_per_epoch
    on_disk = [StagedLoader(local, loader_cfg, rank=r, world_size=2) for r in range(2)]
    from_store = [StagedLoader(stream, loader_cfg, rank=r, world_size=2) for r in range(2)]
    for disk, store in zip(on_disk, from_store, strict=True):  # an epoch and a half
        for count in (steps, steps // 2):
            for (x, y), (sx, sy) in zip(batches(disk, count), batches(store, count), strict=True):
                assert torch.equal(x, sx) and torch.equal(y, sy)
    state = from_store[0].state_dict()
    assert state == on_disk[0].state_dict() and state["epoch"] == 1
    # Resumed on three ranks: the rest of the epoch, the same samples from the store as from disk.
    for rank in range(3):
        disk, store = (StagedLoader(split, loader_cfg, rank=rank, world_size=3) for split in (local, stream))
        disk.load_state_dict(state)
        store.load_state_dict(state)
        for (x, y), (sx, sy) in zip(disk.host_batches(), store.host_batches(), strict=True):
            assert torch.equal(x, sx) and torch.equal(y, sy)
    stream.close()


def test_a_block_order_streams_each_run_of_neighbours_in_one_request(remote, tmp_path):
    requests = {}
    for block in (1, 4):
        stream = streamed(remote, tmp_path / f"block-{block}")
        read, requests[block] = stream._reader.read, []
        # an instance attribute of our own reader: counts the ranged GETs of each fetch
        stream._reader.read = lambda ranges, read=read, sent=requests[block]: (sent.append(len(ranges))
                                                                               or read(ranges))
        loader = StagedLoader(stream, dataclasses.replace(LOADER, block_samples=block))
        assert sum(len(labels) for _, labels in loader.host_batches()) == len(stream) // 8 * 8
        stream.close()
    # Per sample, a random order rarely has neighbours in a batch; runs of 4 come as 2 or 3 GETs a batch of 8.
    assert sum(requests[4]) <= 0.45 * sum(requests[1]), requests


def slow_reads(stream: StreamedSplit, delay_s: float = 0.02) -> dict[str, int]:
    """Make each of ``stream``'s fetches take ``delay_s`` more (a store farther away); returns a record of
    the most fetches in flight at once."""
    read, lock, seen = stream._reader.read, threading.Lock(), {"now": 0, "most": 0}

    def slow_read(ranges):  # an instance attribute of our own reader, as test_a_block_order... does
        with lock:
            seen["now"] += 1
            seen["most"] = max(seen["most"], seen["now"])
        try:
            time.sleep(delay_s)
            return read(ranges)
        finally:
            with lock:
                seen["now"] -= 1

    stream._reader.read = slow_read
    return seen


def test_a_stream_that_training_waits_on_fetches_further_ahead_and_no_further(staged, remote, tmp_path):
    stream = streamed(remote, tmp_path)  # 1 MiB: room for far more than MAX_WINDOW batches of 8
    in_flight = slow_reads(stream)
    loader, local = StagedLoader(stream, LOADER), StagedLoader(StagedSplit(staged, "train"), LOADER)
    assert (stream.ahead, stream.most_ahead) == (WINDOW, MAX_WINDOW)
    for _ in range(8):  # epochs, until waiting on the store has widened the window to its most
        for (x, y), (lx, ly) in zip(loader.host_batches(), local.host_batches(), strict=True):
            assert torch.equal(x, lx) and torch.equal(y, ly)  # the same batches, however far ahead
        if stream.ahead == MAX_WINDOW:
            break
    assert stream.ahead == MAX_WINDOW and WINDOW + 1 < in_flight["most"] <= MAX_WINDOW + 1, in_flight
    stream.close()


def test_the_cache_stays_within_its_limit_with_a_dataset_ten_times_larger(remote, tmp_path, caplog):
    sample = 3 * 16 * 16
    limit = ((WINDOW + 1) * LOADER.batch_size + LOADER.eval_batch_size) * sample  # what may be pinned at once
    stream = streamed(remote, tmp_path, cache_bytes=limit)
    dataset = len(stream) * sample
    assert dataset >= 10 * limit, (dataset, limit)
    slow_reads(stream)  # training waits on every wave of fetches: the window stays what the cache holds
    loader, peak = StagedLoader(stream, LOADER), 0
    with caplog.at_level(logging.INFO, logger="traincore.data.stream"):
        for _ in range(2):  # two epochs: every slot reused many times
            for _ in loader.host_batches():
                peak = max(peak, stream.cache.disk_bytes())
    assert 0 < peak <= -(-limit // 4096) * 4096, (peak, limit)  # the file's blocks, never more
    assert not [path for path in (tmp_path / "cache").rglob("*") if path.is_file()]  # unlinked at once
    assert stream.ahead == stream.most_ahead == WINDOW
    said = [r.getMessage() for r in caplog.records if "a larger loader.cache_bytes" in r.getMessage()]
    assert said == [f"the train stream waits on the store with {WINDOW} batches ahead, all its cache holds "
                    f"beside an evaluation batch: a larger loader.cache_bytes lets it fetch up to "
                    f"{MAX_WINDOW} ahead"], said  # once
    stream.close()


def test_an_evaluation_in_the_middle_of_an_epoch_fetches_ahead_within_the_cache_training_leaves(
        staged, remote, tmp_path):
    local = [StagedSplit(staged, split) for split in ("train", "val")]
    expected = [(x.clone(), y.clone()) for x, y in eval_batches(local[1], LOADER.eval_batch_size)]
    for cache_bytes in (1 << 20, ((WINDOW + 1) * LOADER.batch_size + LOADER.eval_batch_size) * 768):
        train, val = open_streamed(remote, ("train", "val"), cache_bytes,
                                   cache_dir=tmp_path / str(cache_bytes))
        in_flight = slow_reads(val)
        loader, on_disk = StagedLoader(train, LOADER), StagedLoader(local[0], LOADER)
        epoch, disk_epoch = loader.host_batches(), on_disk.host_batches()
        for _ in range(3):  # training's window is in flight, its samples pinned, while the evaluation runs
            assert all(torch.equal(a, b) for a, b in zip(next(epoch), next(disk_epoch), strict=True))
        evaluated = list(eval_batches(val, LOADER.eval_batch_size))
        assert len(evaluated) == len(expected)
        for (x, y), (ex, ey) in zip(evaluated, expected, strict=True):
            assert torch.equal(x, ex) and torch.equal(y, ey)
        # The evaluation fetched ahead as far as the cache left room: one batch beside training's at least.
        most = WINDOW + 1 if cache_bytes == 1 << 20 else 1
        assert in_flight["most"] == most, (cache_bytes, in_flight)
        for (x, y), (lx, ly) in zip(epoch, disk_epoch, strict=True):  # and training goes on where it was
            assert torch.equal(x, lx) and torch.equal(y, ly)
        train.close()


def test_a_cache_smaller_than_the_batches_in_flight_is_refused_before_a_read(remote, tmp_path):
    stream = streamed(remote, tmp_path, cache_bytes=5 * LOADER.batch_size * 768)
    with pytest.raises(StreamError, match=r"loader.cache_bytes=30720 cannot hold the 5 batches of 8 samples "
                                          r"a streamed rank keeps in flight and an evaluation batch of 8 "
                                          r"\(36864 bytes of 768-byte samples\): raise it to at least 36864"):
        StagedLoader(stream, LOADER)
    assert stream.cache.disk_bytes() == 0  # nothing was fetched


def test_a_corrupted_sample_in_the_store_is_named_and_never_returned(remote, tmp_path):
    stream = streamed(remote, tmp_path)
    shard = stream.shards[1]
    data = bytearray(remote.read_bytes(shard.images))
    data[5 * 768 + 100] ^= 0xFF  # one byte of the shard's sample 5
    remote.write_bytes(shard.images, bytes(data))
    with pytest.raises(StreamError, match=rf"sample 5 of {remote.uri}/{shard.images} fails its sha256 check: "
                                          r"the staged dataset in the store is corrupted; stage it again"):
        stream.read(np.arange(60, 80))
    assert np.array_equal(stream.read(np.arange(0, 64))[1].numpy(), stream.labels[:64])  # the rest reads
    stream.close()


def test_a_shard_removed_mid_run_is_named_with_the_fix(remote, tmp_path):
    stream = streamed(remote, tmp_path)
    loader = StagedLoader(stream, LOADER)
    batches_ = loader.host_batches()
    next(batches_)
    remote.remove_file(stream.shards[3].images)
    with pytest.raises(StreamError, match=r"disappeared while the run read it .* stage it again"):
        for _ in batches_:
            pass
    stream.close()


def test_damaged_labels_digests_or_a_missing_manifest_fail_on_open(remote, tmp_path):
    shard = streamed(remote, tmp_path).shards[0]
    remote.write_bytes(shard.digests, remote.read_bytes(shard.digests)[:-32])
    with pytest.raises(StreamError, match=rf"{shard.digests} fails its check against the manifest"):
        streamed(remote, tmp_path)
    empty = Store(f"{remote.uri}-nothing", remote.options)
    with pytest.raises(StreamError, match=r"has no manifest.json: it is not a staged dataset"):
        streamed(empty, tmp_path)


def test_the_default_cache_is_shared_by_the_nodes_processes(tmp_path, monkeypatch):
    assert cache_limit(12345, tmp_path) == 12345
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert 0 < cache_limit(0, tmp_path) <= (8 << 30) // 4
    # A node whose launcher sized its disk (the train task, from its ephemeral-storage request).
    monkeypatch.setenv(NODE_CACHE_ENV, str(200 << 30))
    assert cache_limit(0, tmp_path) == (50 << 30) and cache_limit(12345, tmp_path) == 12345


def test_a_run_streamed_and_resumed_on_three_ranks_ends_bitwise_as_the_same_run_from_disk(
        data_dir, saved, forked_train, s3_server, tmp_path, monkeypatch):
    """Through the train CLI, on real gloo ranks: 10 steps on 2 ranks and a resume on 3 to step 20 (the epoch
    ends at step 19 on 3 ranks), the data streamed from the bucket both times, against the same from local
    disk."""
    for name, value in s3_server.aws_env.items():  # the store's credentials, as a user of traincore sets them
        monkeypatch.setenv(name, value)
    remote = Store(f"s3://{s3_server.bucket}/train-data-{uuid.uuid4().hex[:8]}", s3_server.storage_options)
    remote.fs.put(f"{data_dir}/", remote.uri + "/", recursive=True)
    streamed_run, disk_run = tmp_path / "streamed", tmp_path / "disk"
    forked_train(remote.uri, streamed_run, 2, "--max-steps", "10", "--checkpoint-mode", "dcp",
                 config=CHECKPOINTED)
    shutil.copytree(saved("ddp-dcp-2").parent, disk_run)  # the same 10 steps, from disk
    for run, data in ((streamed_run, remote.uri), (disk_run, data_dir)):
        printed = forked_train(data, run, 3, "--max-steps", "20", "--checkpoint-mode", "dcp",
                               config=CHECKPOINTED)
        assert "resumed from step 10" in printed, printed[-3000:]
    expected, actual = final_weights(disk_run), final_weights(streamed_run)
    assert expected.keys() == actual.keys()
    assert all(torch.equal(expected[name], actual[name]) for name in expected)


def test_an_unreachable_store_fails_before_any_worker_with_the_fix(tmp_path):
    closed = Store("s3://bucket/staged", {"key": "k", "secret": "s", "client_kwargs": {
        "endpoint_url": "http://127.0.0.1:9"}, "config_kwargs": {"retries": {"max_attempts": 1}}})
    with pytest.raises(StreamError, match=r"the staged dataset s3://bucket/staged cannot be read \(.*\): "
                                          r"check that the object exists and that this machine reaches"):
        verify_streamed(closed, LOADER)
