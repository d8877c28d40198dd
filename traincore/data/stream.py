"""Streaming reads of a staged dataset on an object store: each rank fetches only the samples it will read,
a few batches ahead of training, into a node-local cache of bounded size.

The order is the loader's (data.loader): one global permutation per epoch, the same on every world size,
so a streamed run resumes and reshards exactly as a run from local disk does and trains on the same
batches. Samples are fixed-size uint8 records, so a batch is a set of byte ranges: its samples are sorted
by place, neighbours merge into one ranged GET, and all of a batch's ranges go out together
(data.ranges: concurrent requests on fsspec's event loop, presigned plain HTTP on S3). Batches are in
flight while one trains, which hides the store's per-request latency: ``WINDOW`` of them to begin with,
twice as many each time training has to wait for a fetch, up to what the cache and AHEAD_BYTES allow.

The cache is one file of ``cache_bytes // sample_bytes`` sample slots, unlinked as soon as it is opened:
its disk use can never exceed the limit, and it is freed when the process ends, even by SIGKILL. A sample
stays in its slot, least recently used first out, and samples of batches in flight are pinned: eviction
never takes what a prefetched batch still needs. A limit too small for one window is refused up front.

Integrity: labels and per-image digests (manifest format 3) are fetched whole and checked on open, as
readers of a local staging check labels; each fetched image is checked against its sha256 before it enters
the cache, so corruption in the store is named with its shard and sample, never trained on.

Why our own and not streaming-community or litdata: both shuffle by shard or block (their order depends on
shard layout and, for exact resume, on their own state), read whole shards into their cache (a 4x larger
unit of transfer and cache than a batch needs), and have no per-sample integrity check; the loader's
world-size-independent order and resume depend on sample-level random access, which ranged reads give.
"""

from __future__ import annotations

import copy
import hashlib
import logging
import mmap
import os
import shutil
import tempfile
import threading
from collections import OrderedDict
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from pathlib import Path

import numpy as np
import torch

from traincore.checkpoint import STORE_ACCESS_FIX, Store, error_reason
from traincore.config import LoaderConfig
from traincore.data.manifest import MANIFEST, RESTAGE, SPLITS, Manifest, ShardInfo, StagingError, check_labels
from traincore.data.ranges import RangeReader

log = logging.getLogger(__name__)

Batch = tuple[torch.Tensor, torch.Tensor]  # images and labels, as every split and loader yields them
WINDOW = 4  # batches fetched ahead of the one training to begin with, and what the cache must hold
# The most batches fetched ahead, doubling from WINDOW while training waits on the store. Measured on a store
# 30 ms away (bench/slow_store.py, 100 MB/s a connection), one process, batches of 64 at 128 px in runs of
# 16 neighbours: 4 ahead 4,243 samples/s, 8 ahead 5,881, 16 ahead 6,497 (per-sample runs: about 1,200
# however many, bound by the CPU each request costs).
MAX_WINDOW = 16
AHEAD_BYTES = 256 << 20  # and at most this many bytes of batches ahead: their fetched bytes are in memory
DEFAULT_CACHE_BYTES = 8 << 30  # a node's cache with loader.cache_bytes=0, shared by its processes
# A node's cache in bytes, set by whoever sized the node's disk (the train task: its ephemeral-storage
# request, less a margin); it replaces DEFAULT_CACHE_BYTES.
NODE_CACHE_ENV = "TRAINCORE_NODE_CACHE_BYTES"
DIGEST_BYTES = 32


class StreamError(StagingError):
    """A streamed dataset cannot be read: the message names the object and the fix."""


class SampleCache:
    """``slots`` fixed-size sample slots in one unlinked file; an LRU map from sample to slot with pins."""

    def __init__(self, directory: Path, slots: int, sample_bytes: int):
        directory.mkdir(parents=True, exist_ok=True)
        self.sample_bytes, self.slots = sample_bytes, slots
        fd, path = tempfile.mkstemp(prefix="stream-cache-", dir=directory)
        os.unlink(path)  # nothing is left on the node when the process ends, however it ends
        os.ftruncate(fd, slots * sample_bytes)  # sparse: only written slots take disk
        self._fd = fd
        self._map = mmap.mmap(fd, slots * sample_bytes)
        self.data = np.frombuffer(self._map, np.uint8).reshape(slots, sample_bytes)
        self._where: OrderedDict[int, int] = OrderedDict()  # sample -> slot, least recently used first
        self._pins: dict[int, int] = {}
        self._free = list(range(slots - 1, -1, -1))
        self._lock = threading.Lock()

    def claim(self, samples: np.ndarray) -> tuple[np.ndarray, list[int]]:
        """Pin ``samples``; returns each one's slot and those not cached yet (their slots are reserved)."""
        slots, missing = np.empty(len(samples), np.int64), []
        with self._lock:
            for i, sample in enumerate(samples.tolist()):
                self._pins[sample] = self._pins.get(sample, 0) + 1
                if sample in self._where:
                    self._where.move_to_end(sample)
                else:
                    self._where[sample] = self._take_slot()
                    missing.append(i)
                slots[i] = self._where[sample]
        return slots, missing

    def _take_slot(self) -> int:
        if self._free:
            return self._free.pop()
        for sample in self._where:  # least recently used first; pinned ones are in a batch in flight
            if sample not in self._pins:
                return self._where.pop(sample)
        raise StreamError("the stream cache is full of samples of batches in flight: raise "
                          "loader.cache_bytes")

    def forget(self, samples: list[int]) -> None:
        """Drop ``samples`` whose fetch failed: their slots hold nothing valid."""
        with self._lock:
            for sample in samples:
                self._free.append(self._where.pop(sample))

    def release(self, samples: np.ndarray) -> None:
        """Unpin ``samples`` (their batch was handed to training)."""
        with self._lock:
            for sample in samples.tolist():
                left = self._pins[sample] - 1
                if left:
                    self._pins[sample] = left
                else:
                    del self._pins[sample]

    def room(self) -> int:
        """Slots that no batch in flight pins: what one more batch may claim."""
        with self._lock:
            return self.slots - len(self._pins)

    def write(self, slot: int, data: bytes | memoryview) -> None:
        os.pwrite(self._fd, data, slot * self.sample_bytes)

    def disk_bytes(self) -> int:
        """What the cache file takes on disk now (at most slots x sample bytes)."""
        return os.fstat(self._fd).st_blocks * 512

    def close(self) -> None:
        """Free the cache's disk (closing its only handle); a second close does nothing."""
        if self.data is None:
            return
        self.data = None
        self._map.close()
        os.close(self._fd)


def check_digests(data: bytes, shard: ShardInfo, where: str) -> np.ndarray:
    """One shard's image digests as fetched: their size, then their sha256 against the manifest."""
    if len(data) != shard.count * DIGEST_BYTES or hashlib.sha256(data).hexdigest() != shard.digests_sha256:
        raise StreamError(f"{where} fails its check against the manifest: the staged dataset in the store is "
                          f"damaged; {RESTAGE}")
    return np.frombuffer(data, np.uint8).reshape(shard.count, DIGEST_BYTES)


def fetch_files(store: Store, names: list[str]) -> list[bytes]:
    """Whole small files of a staged dataset in ``store`` (manifest, labels, digests), many at a time."""
    try:
        with ThreadPoolExecutor(max_workers=32) as pool:
            return list(pool.map(store.read_bytes, names))
    except FileNotFoundError as exc:
        raise StreamError(f"{store} has no {Path(exc.filename or names[0]).name}: it is not a staged "
                          f"dataset, or it was removed; {RESTAGE}") from exc
    except Exception as exc:  # the store's own errors for credentials and network
        raise StreamError(f"the staged dataset {store} cannot be read ({error_reason(exc)}): "
                          f"{STORE_ACCESS_FIX}") from exc


def dataset_manifest(data: Store) -> Manifest:
    """The manifest of the staged dataset at ``data``: a directory's, or one in an object store."""
    if data.local:
        return Manifest.load(data.path)
    return Manifest.from_bytes(fetch_files(data, [MANIFEST])[0], data.uri_of(MANIFEST))


def open_streamed(store: Store, splits: tuple[str, ...], cache_bytes: int,
                  cache_dir: str | Path | None = None,
                  normalization: tuple[list[float], list[float]] | None = None) -> list[StreamedSplit]:
    """The ``splits`` of the staged dataset in ``store``, sharing one cache of ``cache_bytes``."""
    manifest = dataset_manifest(store)
    directory = Path(cache_dir or tempfile.gettempdir()) / "traincore-stream"
    cache = SampleCache(directory, cache_bytes // manifest.sample_bytes, manifest.sample_bytes)
    staged = sum(info.count for info in manifest.splits.values()) * manifest.sample_bytes
    log.info("streaming %s (%.1f MiB staged) through a node-local cache of %.1f MiB (%d samples) in %s",
             store, staged / 2**20, cache.slots * manifest.sample_bytes / 2**20, cache.slots, directory)
    return [StreamedSplit(store, manifest, split, cache, normalization) for split in splits]


class StreamedSplit:
    """One split of a staged dataset in an object store, read as :class:`~traincore.data.loader.StagedSplit`
    is (``read``, ``labels``, ``len``), fetched sample by sample through a :class:`SampleCache` that the
    dataset's splits share (:func:`open_streamed`)."""

    remote = True

    def __init__(self, store: Store, manifest: Manifest, split: str, cache: SampleCache,
                 normalization: tuple[list[float], list[float]] | None = None, window: int = WINDOW):
        self.store, self.manifest, self.split, self.cache, self.window = store, manifest, split, cache, window
        # Batches fetched ahead now, and the most allowed (check_cache raises it to what the cache holds).
        self.ahead = self.most_ahead = self._most_uncached = window
        self.mean, self.std = normalization or (manifest.mean, manifest.std)
        if split not in manifest.splits or manifest.splits[split].count == 0:
            raise StagingError(f"split {split!r} of {store} is missing or empty; it has "
                               f"{', '.join(manifest.splits)}: stage with a non-zero {split}_fraction")
        self.shards = manifest.splits[split].shards
        names = [name for shard in self.shards for name in (shard.labels, shard.digests)]
        blobs = dict(zip(names, fetch_files(store, names), strict=True))
        self.labels = np.concatenate([check_labels(blobs[s.labels], manifest, s, store.uri_of(s.labels))
                                      for s in self.shards])
        self._digests = np.concatenate([check_digests(blobs[s.digests], s, store.uri_of(s.digests))
                                        for s in self.shards])
        self._offsets = np.cumsum([0] + [s.count for s in self.shards])
        self._key = SPLITS.index(split) << 40  # the splits share the cache: their samples' keys stay apart
        self._pool = ThreadPoolExecutor(max_workers=max(window, MAX_WINDOW), thread_name_prefix="stream")
        self._reader = RangeReader(store)

    def __len__(self) -> int:
        return int(self._offsets[-1])

    def first(self, count: int) -> StreamedSplit:
        """Its first ``count`` samples as a split of their own (train.overfit), sharing the cache."""
        subset = copy.copy(self)
        subset._offsets, subset.labels = np.minimum(self._offsets, count), self.labels[:count]
        return subset

    def check_cache(self, cfg: LoaderConfig) -> None:
        """Refuse a cache that cannot hold what may be pinned at once: the training batches in flight
        (``window`` + the one training) and an evaluation batch. Then allow as many batches ahead as the
        cache holds beside an evaluation batch, up to MAX_WINDOW and AHEAD_BYTES."""
        samples = (self.window + 1) * cfg.batch_size + cfg.eval_batch_size
        need, have = samples * self.manifest.sample_bytes, self.cache.slots * self.manifest.sample_bytes
        if have < need:
            raise StreamError(f"loader.cache_bytes={have} cannot hold the {self.window + 1} batches of "
                              f"{cfg.batch_size} samples a streamed rank keeps in flight and an evaluation "
                              f"batch of {cfg.eval_batch_size} ({need} bytes of {self.manifest.sample_bytes}-"
                              f"byte samples): raise it to at least {need}")
        held = (self.cache.slots - cfg.eval_batch_size) // cfg.batch_size - 1
        by_bytes = AHEAD_BYTES // (cfg.batch_size * self.manifest.sample_bytes)
        self._most_uncached = min(MAX_WINDOW, by_bytes)  # what a larger cache would allow
        self.most_ahead = max(self.window, min(self._most_uncached, held))

    def read(self, indices: np.ndarray, pin_memory: bool = False) -> Batch:
        """Gather samples by global index, fetching those not cached: uint8 NCHW images, int64 labels."""
        claimed = self._claim(indices)
        try:
            self._fetch(*claimed)
            return self._gather(*claimed[:2], pin_memory)
        finally:
            self.cache.release(claimed[0] + self._key)

    __getitems__ = read

    def stream(self, batches: Iterator[np.ndarray], pin_memory: bool = False) -> Iterator[Batch]:
        """The batches of index arrays ``batches``, in order, each fetched ``ahead`` batches ahead; training
        that has to wait for a batch doubles ``ahead``, up to ``most_ahead``. A batch is fetched ahead only
        while the cache has room for it beside what other streams pin: an evaluation streams its split in
        the middle of training's epoch, whose batches in flight stay pinned meanwhile."""
        pending: list[tuple[tuple[np.ndarray, np.ndarray, list[int]], Future]] = []
        batches, started = iter(batches), False
        upcoming = next(batches, None)
        try:
            while True:
                while upcoming is not None and len(pending) <= self.ahead and (
                        not pending or self.cache.room() >= len(upcoming)):
                    claimed = self._claim(upcoming)
                    pending.append((claimed, self._pool.submit(self._fetch, *claimed)))
                    upcoming = next(batches, None)
                if not pending:
                    return
                claimed, future = pending.pop(0)
                if not future.done() and started:  # the first batch of a call has nothing ahead of it
                    self._waited()
                started = True
                try:
                    future.result()
                    yield self._gather(*claimed[:2], pin_memory)
                finally:
                    self.cache.release(claimed[0] + self._key)
        finally:  # an epoch cut short or failed: end the fetches in flight, unpin their samples
            for (indices, _, missing), future in pending:
                if future.cancel():
                    self.cache.forget((indices[missing] + self._key).tolist())
                else:
                    wait([future])  # a failed fetch forgot its own samples
                self.cache.release(indices + self._key)

    def _waited(self) -> None:
        """Training waits on a fetch: fetch twice as far ahead, or say once what would let it."""
        if self.ahead < self.most_ahead:
            self.ahead = min(2 * self.ahead, self.most_ahead)
            log.debug("the %s stream waited on the store: now %d batches ahead", self.split, self.ahead)
        elif self.ahead < self._most_uncached:
            log.info("the %s stream waits on the store with %d batches ahead, all its cache holds beside an "
                     "evaluation batch: a larger loader.cache_bytes lets it fetch up to %d ahead", self.split,
                     self.ahead, self._most_uncached)
            self._most_uncached = self.ahead  # said once

    def _gather(self, indices: np.ndarray, slots: np.ndarray, pin_memory: bool) -> Batch:
        images = torch.empty((len(indices), *self.manifest.shape), dtype=torch.uint8, pin_memory=pin_memory)
        self.cache.data.take(slots, axis=0, out=images.numpy().reshape(len(indices), -1))
        return images, torch.from_numpy(self.labels[indices])

    def _claim(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray, list[int]]:
        """Sort ``indices`` and pin them in the cache: (indices, their slots, positions of those to fetch)."""
        indices = np.sort(np.asarray(indices, dtype=np.int64))
        if len(indices) and (indices[0] < 0 or indices[-1] >= len(self)):
            raise IndexError(f"sample indices must be in [0, {len(self)}), got {indices[0]}..{indices[-1]}")
        return (indices, *self.cache.claim(indices + self._key))

    def _fetch(self, indices: np.ndarray, slots: np.ndarray, missing: list[int]) -> None:
        """Fetch the samples at positions ``missing`` of ``indices`` into their slots, each checked against
        its digest; on failure they leave the cache (their slots hold nothing valid)."""
        try:
            runs = self._runs(indices[missing])
            blobs = self._reader.read([(shard.images, start * self.manifest.sample_bytes,
                                             len(run) * self.manifest.sample_bytes)
                                            for shard, start, run in runs])
            where = dict(zip(indices.tolist(), slots.tolist(), strict=True))
            for (shard, _, run), blob in zip(runs, blobs, strict=True):
                self._store_run(shard, run, blob, where)
        except BaseException as exc:
            self.cache.forget((indices[missing] + self._key).tolist())
            if isinstance(exc, FileNotFoundError):
                raise StreamError(f"a shard of {self.store} disappeared while the run read it "
                                  f"({exc.filename or exc}): the staged dataset was removed or replaced "
                                  f"under the run; {RESTAGE}, and resume") from exc
            raise

    def _runs(self, samples: np.ndarray) -> list[tuple[ShardInfo, int, np.ndarray]]:
        """Sorted ``samples`` as runs of consecutive samples within one shard: (shard, first local index,
        the run's global indices); one ranged GET each."""
        runs = []
        shard_of = np.searchsorted(self._offsets, samples, side="right") - 1
        cuts = np.flatnonzero((np.diff(samples) != 1) | (np.diff(shard_of) != 0)) + 1
        for run in np.split(samples, cuts) if len(samples) else []:
            shard = int(shard_of[np.searchsorted(samples, run[0])])
            runs.append((self.shards[shard], int(run[0] - self._offsets[shard]), run))
        return runs

    def _store_run(self, shard: ShardInfo, run: np.ndarray, blob: bytes, where: dict[int, int]) -> None:
        """Check each sample of one fetched run against its digest, then write it into its slot."""
        size, uri = self.manifest.sample_bytes, self.store.uri_of(shard.images)
        if len(blob) != len(run) * size:
            raise StreamError(f"{uri} ended after {len(blob)} of the {len(run) * size} bytes asked for: the "
                              f"shard in the store is truncated; {RESTAGE}")
        view = memoryview(blob)
        for k, sample in enumerate(run.tolist()):
            data = view[k * size:(k + 1) * size]
            if hashlib.sha256(data).digest() != self._digests[sample].tobytes():
                local = sample - int(self._offsets[self.shards.index(shard)])
                raise StreamError(f"sample {local} of {uri} fails its sha256 check: the staged dataset in "
                                  f"the store is corrupted; {RESTAGE}")
            self.cache.write(where[sample], data)

    def close(self) -> None:
        """Stop the fetch threads and free the cache's disk (shared: the other splits stop reading too)."""
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._reader.close()
        self.cache.close()


def cache_limit(cache_bytes: int, directory: str | Path | None = None) -> int:
    """This process's cache size: ``cache_bytes`` as given, or for 0 the node's (NODE_CACHE_ENV when set,
    else DEFAULT_CACHE_BYTES at most half the free space where the cache goes) shared by the node's
    processes (LOCAL_WORLD_SIZE)."""
    if cache_bytes:
        return cache_bytes
    sized = os.environ.get(NODE_CACHE_ENV, "")
    if sized.isdigit():
        node = int(sized)
    else:
        where = Path(directory or tempfile.gettempdir())
        free = shutil.disk_usage(where if where.exists() else where.parent).free
        node = min(DEFAULT_CACHE_BYTES, free // 2)
    return node // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


def verify_streamed(store: Store, cfg: LoaderConfig, splits: tuple[str, ...] = ("train", "val")) -> Manifest:
    """What a streamed run relies on, checked before any worker starts: the store is reachable with these
    credentials, the manifest, labels and digests of ``splits`` are whole, and this process's cache holds
    the batches in flight. Returns the manifest."""
    opened = open_streamed(store, splits, cache_limit(cfg.cache_bytes))
    try:
        opened[0].check_cache(cfg)
        return opened[0].manifest
    finally:
        for split in opened:
            split.close()
