"""Memory-mapped reader and the resumable, world-size-independent training loader.

Order: every epoch has one global permutation, seeded by (seed, epoch). Step ``k`` of an epoch takes the
next ``batch_size * world_size`` positions of it and gives rank ``r`` the ``r``-th block of ``batch_size``.
The loader's whole state is therefore (seed, epoch, samples consumed globally): it does not depend on the
world size, so a run saved on 2 ranks resumes on 1 or 3 and still sees every remaining sample exactly once.

End of epoch: with ``drop_last`` (the default) the final partial optimizer step is skipped for that epoch
(it is a different set of samples each epoch): with ``accum`` batches accumulated per step, an epoch ends at
its last whole step, so a step's samples are the same whichever world size splits them into batches.
Without it, the final partial global batch is padded to a
multiple of the world size with samples from the start of the permutation (at most world_size - 1
repeats, as DistributedSampler does) and split evenly, so every rank takes the same number of steps.

Batches leave the host as uint8 (4x fewer bytes than float32); :class:`Normalizer` turns them into
normalised float32 on the training device. On CUDA a side-stream prefetcher overlaps the copy.
"""

from __future__ import annotations

import collections
import copy
import itertools
import logging
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import torch

from traincore.config import LoaderConfig
from traincore.data.augment import Augmenter
from traincore.data.manifest import RESTAGE, Manifest, StagingError, check_size, read_labels, verify_images
from traincore.data.stream import Batch, StreamedSplit

log = logging.getLogger(__name__)


class StagedSplit:
    """One split of a staged dataset, memory-mapped and checked on open (data.manifest: sizes and labels
    every time, image sha256 once per staging, recorded in ``verified.json``)."""

    remote = False  # data.stream.StreamedSplit reads one in an object store

    def __init__(self, directory: str | Path, split: str, verify_hashes: bool = False,
                 normalization: tuple[list[float], list[float]] | None = None):
        self.directory = Path(directory)
        self.manifest = Manifest.load(self.directory)
        # (mean, std) that batches are normalised with: the config's (data.mean, data.std), else the staging's
        self.mean, self.std = normalization or (self.manifest.mean, self.manifest.std)
        if split not in self.manifest.splits:
            raise StagingError(f"split {split!r} is not in {directory}; it has "
                               f"{', '.join(self.manifest.splits)}: {RESTAGE}")
        self.split = split
        info = self.manifest.splits[split]
        if info.count == 0:
            raise StagingError(f"split {split!r} of {directory} is empty: stage with a non-zero "
                               f"{split}_fraction")
        shape = self.manifest.shape
        self._images, self._labels = [], []
        for shard in info.shards:
            check_size(self.directory / shard.images, shard.count * self.manifest.sample_bytes)
            self._labels.append(read_labels(self.directory, self.manifest, shard))
        # Hashes the image shards only if no record vouches for them (or always, with verify_hashes).
        verify_images(self.directory, self.manifest, [split], force=verify_hashes)
        for shard in info.shards:
            # A plain ndarray view of the map: numpy's memmap subclass adds per-call overhead to every take.
            mapped = np.memmap(self.directory / shard.images, np.uint8, "r", shape=(shard.count, *shape))
            self._images.append(np.asarray(mapped))
        self._offsets = np.cumsum([0] + [s.count for s in info.shards])
        self.labels = np.concatenate(self._labels)

    def __len__(self) -> int:
        return int(self._offsets[-1])

    def first(self, count: int) -> StagedSplit:
        """Its first ``count`` samples as a split of their own (train.overfit), sharing the mapped shards."""
        subset = copy.copy(self)
        subset._offsets = np.minimum(self._offsets, count)
        subset.labels = self.labels[:count]
        return subset

    def read(self, indices: np.ndarray, pin_memory: bool = False) -> Batch:
        """Gather samples by global index (sorted for locality): uint8 NCHW images and int64 labels."""
        indices = np.sort(np.asarray(indices, dtype=np.int64))
        if len(indices) and (indices[0] < 0 or indices[-1] >= len(self)):
            raise IndexError(f"sample indices must be in [0, {len(self)}), got {indices[0]}..{indices[-1]}")
        images = torch.empty((len(indices), *self.manifest.shape), dtype=torch.uint8, pin_memory=pin_memory)
        out = images.numpy()
        # The indices are sorted, so each shard's samples form one slice of them.
        bounds = np.searchsorted(indices, self._offsets).tolist()
        for shard, (lo, hi) in enumerate(itertools.pairwise(bounds)):
            if hi > lo:
                # mode="clip" writes straight into ``out`` (the default "raise" buffers a second copy);
                # the bounds were checked above.
                self._images[shard].take(indices[lo:hi] - self._offsets[shard], axis=0, out=out[lo:hi],
                                         mode="clip")
        return images, torch.from_numpy(self.labels[indices])

    __getitems__ = read  # lets torch's DataLoader fetch a whole batch in one call

    def stream(self, batches: Iterator[np.ndarray], pin_memory: bool = False) -> Iterator[Batch]:
        """The batches of index arrays ``batches``, in order (what the loader reads without workers)."""
        return (self.read(indices, pin_memory) for indices in batches)


class Normalizer:
    """uint8 NCHW -> float32 ``(x / 255 - mean) / std``, applied on the device that trains."""

    def __init__(self, mean: list[float], std: list[float], device: torch.device | str = "cpu"):
        std_t = torch.tensor(std, dtype=torch.float32, device=device).view(1, -1, 1, 1)
        mean_t = torch.tensor(mean, dtype=torch.float32, device=device).view(1, -1, 1, 1)
        self.scale, self.shift = 1.0 / (255.0 * std_t), -mean_t / std_t

    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        return images.to(torch.float32).mul_(self.scale).add_(self.shift)


def global_order(num_samples: int, seed: int, epoch: int, shuffle: bool, block: int = 1) -> np.ndarray:
    """The epoch's global sample order, identical on every rank and every world size: a permutation of
    the samples, or with ``block`` > 1 of runs of ``block`` consecutive samples (the last one shorter)."""
    if not shuffle:
        return np.arange(num_samples, dtype=np.int64)
    rng = np.random.default_rng([seed, epoch])
    if block == 1:
        return rng.permutation(num_samples)
    starts = rng.permutation(-(-num_samples // block)) * block
    order = (starts[:, None] + np.arange(block)).ravel()
    return order[order < num_samples]


def rank_batches(order: np.ndarray, start: int, batch_size: int, rank: int, world_size: int,
                 drop_last: bool, accum: int = 1) -> Iterator[np.ndarray]:
    """This rank's index blocks from global position ``start`` to the end of the epoch (with ``drop_last``,
    of its last whole step of ``accum`` global batches)."""
    total, step = len(order), batch_size * world_size
    end = total - total % (step * accum) if drop_last else total
    for pos in range(start, end, step):
        if pos + step <= total:
            yield order[pos + rank * batch_size: pos + (rank + 1) * batch_size]
        else:
            tail = order[pos:]
            padded = np.concatenate([tail, order[: -len(tail) % world_size]])
            share = len(padded) // world_size
            yield padded[rank * share:(rank + 1) * share]


_MIX = (np.uint64(0x9E3779B97F4A7C15), np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB))
DIGEST_MODULUS = 2**62
"""Digests add up modulo this: an int64 all-reduce sums them exactly."""


def sample_digest(indices: np.ndarray) -> int:
    """An order-free digest of sample indices: the sum of a 40-bit hash (splitmix64's mix) of each. The
    digests of any split of a set of samples add up to the set's, so ranks' and steps' digests can be
    summed; a sample missing or taken twice changes the sum."""
    x = indices.astype(np.uint64) + _MIX[0]
    x = (x ^ (x >> np.uint64(30))) * _MIX[1]
    x = (x ^ (x >> np.uint64(27))) * _MIX[2]
    x ^= x >> np.uint64(31)
    return int((x >> np.uint64(24)).sum()) % DIGEST_MODULUS


def epoch_batches(num_samples: int, global_batch: int, drop_last: bool) -> int:
    """Global batches in one epoch of ``num_samples``: the final partial one counts unless ``drop_last``."""
    full, rest = divmod(num_samples, global_batch)
    return full if drop_last or rest == 0 else full + 1


class _EpochSampler:
    """Batch sampler handed to torch's DataLoader; reads the loader's position each time it is iterated.

    It holds the loader weakly: a loader <-> DataLoader cycle would leave persistent workers to the cyclic
    garbage collector, which closes their queues first and then waits seconds per worker to join them.
    """

    def __init__(self, loader: StagedLoader):
        self._loader = weakref.ref(loader)

    def __iter__(self) -> Iterator[np.ndarray]:
        return self._loader().index_batches()

    def __len__(self) -> int:
        return self._loader().steps_per_epoch


def _remembered(blocks: Iterator[np.ndarray], handed: collections.deque) -> Iterator[np.ndarray]:
    """``blocks``, each appended to ``handed`` as it goes to the reader: its batch comes back in the same
    order (DataLoader keeps it), and the loader digests the samples it holds. A function, not a method: a
    generator holding the loader would tie it to its DataLoader's sampler in a cycle (see _EpochSampler)."""
    for block in blocks:
        handed.append(block)
        yield block


def _as_batch(batch: Batch) -> Batch:
    return batch


class StagedLoader:
    """Training loader over one split: sharded, resumable, world-size independent.

    Iterating yields normalised batches on ``device`` for the rest of the current epoch, then advances
    the epoch. ``state_dict()`` records only batches that the caller has actually received.
    """

    def __init__(self, split: StagedSplit | StreamedSplit, cfg: LoaderConfig, *, rank: int = 0,
                 world_size: int = 1, seed: int = 0, device: torch.device | str = "cpu", accum: int = 1):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world size {world_size}")
        self.split, self.cfg = split, cfg
        self.rank, self.world_size, self.seed, self.accum = rank, world_size, seed, accum
        self.device = torch.device(device)
        self.epoch, self.consumed = 0, 0
        self.digest = 0  # of the samples this rank has received since take_digest() (sample_digest)
        self._handed: collections.deque[np.ndarray] = collections.deque()  # blocks given to the reader
        self.normalize = Normalizer(split.mean, split.std, self.device)
        self.augment = Augmenter(cfg) if cfg.random_resized_crop or cfg.horizontal_flip else None
        global_batch = cfg.batch_size * world_size
        if cfg.drop_last and len(split) < global_batch:
            raise ValueError(f"loader.batch_size={cfg.batch_size} x {world_size} ranks = {global_batch} "
                             f"exceeds the {len(split)} {split.split} samples: lower loader.batch_size "
                             "or set drop_last off")
        self._pin = cfg.pin_memory and self.device.type == "cuda"
        if split.remote:  # fetched by the split's own threads into its cache: no worker processes
            split.check_cache(cfg)
        self._dataloader = self._make_dataloader() if cfg.num_workers > 0 and not split.remote else None

    @property
    def global_batch_size(self) -> int:
        return self.cfg.batch_size * self.world_size

    @property
    def steps_per_epoch(self) -> int:
        """Batches per rank in one epoch (``accum`` of them to an optimizer step)."""
        if self.cfg.drop_last:
            return len(self.split) // (self.global_batch_size * self.accum) * self.accum
        return epoch_batches(len(self.split), self.global_batch_size, drop_last=False)

    def _make_dataloader(self) -> torch.utils.data.DataLoader:
        return torch.utils.data.DataLoader(
            self.split, batch_sampler=_EpochSampler(self), collate_fn=_as_batch,
            num_workers=self.cfg.num_workers, prefetch_factor=self.cfg.prefetch_factor,
            persistent_workers=self.cfg.persistent_workers, pin_memory=self._pin)

    def index_batches(self) -> Iterator[np.ndarray]:
        """This rank's index batches from the current position to the end of the epoch."""
        order = global_order(len(self.split), self.seed, self.epoch, self.cfg.shuffle, self.cfg.block_samples)
        blocks = rank_batches(order, self.consumed, self.cfg.batch_size, self.rank, self.world_size,
                              self.cfg.drop_last, self.accum)
        return _remembered(blocks, self._handed)

    def host_batches(self) -> Iterator[Batch]:
        """uint8 batches on the host for the rest of the epoch, advancing the position as each is taken."""
        return ((images, labels) for images, labels, _, _ in self._keyed_batches())

    def _keyed_batches(self) -> Iterator[tuple[torch.Tensor, torch.Tensor, tuple[int, ...], int]]:
        """:meth:`host_batches` with each batch's place in the run, (seed, rank, epoch, position): what
        seeds its augmentation; and the digest of its samples, added by :meth:`_taken` when the batch
        reaches the caller (a prefetcher holds one back)."""
        self._handed.clear()  # blocks read ahead for an iteration that was left
        source = (iter(self._dataloader) if self._dataloader is not None else
                  self.split.stream(self.index_batches(), self._pin))
        for images, labels in source:
            digest = sample_digest(self._handed.popleft())
            key = (self.seed, self.rank, self.epoch, self.consumed)
            self.consumed = min(self.consumed + self.global_batch_size, len(self.split))
            yield images, labels, key, digest
        self.epoch, self.consumed = self.epoch + 1, 0

    def _taken(self, digest: int) -> None:
        self.digest = (self.digest + digest) % DIGEST_MODULUS

    def prepare(self, images: torch.Tensor, key: tuple[int, ...]) -> torch.Tensor:
        """A uint8 batch already on the device, augmented (when configured) and normalised."""
        if self.augment is None:
            return self.normalize(images)
        return self.normalize(self.augment(images.to(torch.float32), key))

    def __iter__(self) -> Iterator[Batch]:
        if self.device.type == "cuda" and self.cfg.device_prefetch:
            return _CudaPrefetcher(self._keyed_batches(), self.device, self.prepare, self._taken)
        return self._device_batches()

    def _device_batches(self) -> Iterator[Batch]:
        for images, labels, key, digest in self._keyed_batches():
            self._taken(digest)
            yield self.prepare(images.to(self.device), key), labels.to(self.device)

    def __len__(self) -> int:
        return self.steps_per_epoch

    def take_digest(self) -> int:
        """The digest of the samples this rank received since the last call (:func:`sample_digest`)."""
        digest, self.digest = self.digest, 0
        return digest

    def state_dict(self) -> dict[str, int]:
        return {"seed": self.seed, "epoch": self.epoch, "consumed": self.consumed,
                "num_samples": len(self.split)}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue the saved global order; the world size may differ from the one that saved it. A saved
        position of a split of another size does not carry over: traincore.checkpoint.check_fit refuses
        such a checkpoint before any member is loaded."""
        if state["seed"] != self.seed:
            log.warning("loader seed %d from the checkpoint replaces the configured seed %d",
                        state["seed"], self.seed)
        self.seed, self.epoch, self.consumed = state["seed"], state["epoch"], state["consumed"]


class _CudaPrefetcher:
    """Copies batch k+1 host->device on a side stream and prepares it there (augmentation, normalisation)
    while batch k trains."""

    def __init__(self, batches: Iterator, device: torch.device, prepare: Callable,
                 taken: Callable[[int], None]):
        self.batches, self.device, self.prepare, self.taken = batches, device, prepare, taken
        self.stream = torch.cuda.Stream(device)
        self._next: Batch | None = None
        self._digest = 0
        self._preload()

    def _preload(self) -> None:
        try:
            images, labels, key, self._digest = next(self.batches)
        except StopIteration:
            self._next = None
            return
        with torch.cuda.stream(self.stream):
            images = images.to(self.device, non_blocking=True)
            self._next = (self.prepare(images, key), labels.to(self.device, non_blocking=True))

    def __iter__(self) -> _CudaPrefetcher:
        return self

    def __next__(self) -> Batch:
        current = torch.cuda.current_stream(self.device)
        current.wait_stream(self.stream)
        if self._next is None:
            raise StopIteration
        images, labels = self._next
        # The tensors were made on the side stream; tell the allocator the main stream uses them now.
        images.record_stream(current)
        labels.record_stream(current)
        self.taken(self._digest)  # its samples reach the caller now, not when they were read ahead
        self._preload()
        return images, labels


def eval_batches(split: StagedSplit | StreamedSplit, batch_size: int, *, rank: int = 0,
                 world_size: int = 1) -> Iterator[Batch]:
    """This rank's contiguous share of the split in order, without padding, as uint8 host batches (a
    streamed split fetches them ahead, as it does training's). Close it when leaving it unfinished."""
    per_rank = -(-len(split) // world_size)
    lo, hi = rank * per_rank, min((rank + 1) * per_rank, len(split))
    return split.stream(np.arange(start, min(start + batch_size, hi)) for start in range(lo, hi, batch_size))
