"""Training loader: rank coverage, resumable state across world sizes, normalisation, eval sharding.

The synthetic fixture's train split has 80 samples with unique image bytes, so every batch can be mapped
back to the sample indices it really delivered (not just the indices the sampler planned).
"""

from __future__ import annotations

import collections
import dataclasses
import gc
import pickle
import weakref

import numpy as np
import pytest
import torch
import torch.distributed as dist
from ranks import start_ranks

from traincore.config.schema import LoaderConfig
from traincore.data.loader import (
    Normalizer,
    StagedLoader,
    StagedSplit,
    eval_batches,
    global_order,
    rank_batches,
    sample_digest,
)

CFG = LoaderConfig(batch_size=8)


@pytest.fixture(scope="module")
def train(synthetic_dir) -> StagedSplit:
    return StagedSplit(synthetic_dir, "train")


@pytest.mark.parametrize("workers", [0, 2])
def test_the_digest_counts_the_batches_handed_out_not_those_read_ahead(train, workers):
    """DataLoader workers read batches ahead; the digest covers only the three the caller took."""
    loader = StagedLoader(train, LoaderConfig(batch_size=8, num_workers=workers), rank=1, world_size=2,
                          seed=5)
    batches = iter(loader)
    for _ in range(3):
        next(batches)
    blocks = list(rank_batches(global_order(len(train), 5, 0, True), 0, 8, 1, 2, drop_last=True))[:3]
    assert loader.take_digest() == sum(map(sample_digest, blocks)) % 2**62
    assert loader.take_digest() == 0  # taken: the next interval starts from nothing


def index_of(split: StagedSplit) -> dict[bytes, int]:
    """Image bytes -> sample index for a split whose images are all distinct."""
    images = split.read(np.arange(len(split)))[0].numpy()
    lookup = {image.tobytes(): index for index, image in enumerate(images)}
    assert len(lookup) == len(split), "fixture images must be unique"
    return lookup


def delivered(batches, lookup: dict[bytes, int]) -> list[list[int]]:
    """The sample indices carried by each uint8 host batch."""
    return [[lookup[image.numpy().tobytes()] for image in images] for images, _ in batches]


def take(iterator, count: int) -> list:
    return [next(iterator) for _ in range(count)]


def flat(batches: list[list[int]]) -> list[int]:
    return [index for batch in batches for index in batch]


# ---- coverage across ranks -----------------------------------------------------------------------

def _coverage_worker(rank: int, world_size: int, directory: str, init_file: str, result_file: str) -> None:
    """One real gloo rank: iterate an epoch of host batches and gather every rank's indices on rank 0."""
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        split = StagedSplit(directory, "train")
        loader = StagedLoader(split, CFG, rank=rank, world_size=world_size, seed=7)
        mine = delivered(loader.host_batches(), index_of(split))
        gathered = [None] * world_size
        dist.all_gather_object(gathered, mine)
        if rank == 0:
            with open(result_file, "wb") as handle:
                pickle.dump(gathered, handle)
    finally:
        dist.destroy_process_group()


def test_two_gloo_ranks_cover_the_epoch_exactly_once(synthetic_dir, tmp_path):
    result = tmp_path / "result.pkl"
    start_ranks(_coverage_worker, (2, str(synthetic_dir), str(tmp_path / "init"), str(result)), nprocs=2)
    per_rank = pickle.loads(result.read_bytes())
    assert [len(batches) for batches in per_rank] == [5, 5]  # 80 samples / (8 x 2 ranks)
    everything = flat(per_rank[0]) + flat(per_rank[1])
    assert sorted(everything) == list(range(80))


def test_padded_last_batch_repeats_at_most_world_size_minus_one(train):
    cfg = dataclasses.replace(CFG, drop_last=False)
    lookup = index_of(train)
    per_rank = [delivered(StagedLoader(train, cfg, rank=r, world_size=3).host_batches(), lookup)
                for r in range(3)]
    assert {len(batches) for batches in per_rank} == {4}  # 80 = 3 full global batches of 24 + 8 padded to 9
    assert {len(batches[-1]) for batches in per_rank} == {3}
    counts = collections.Counter(index for batches in per_rank for index in flat(batches))
    assert set(counts) == set(range(80))
    assert 0 < sum(c - 1 for c in counts.values()) <= 2


def test_drop_last_skips_the_partial_batch_without_repeats(train):
    lookup = index_of(train)
    seen = [flat(delivered(StagedLoader(train, CFG, rank=r, world_size=3).host_batches(), lookup))
            for r in range(3)]
    everything = [index for part in seen for index in part]
    assert len(everything) == len(set(everything)) == 72  # three global batches of 24; 8 dropped


def test_rank_batches_blocks_follow_the_global_order():
    order = np.arange(100, 140)
    blocks = [list(rank_batches(order, 0, 4, rank, 2, drop_last=True)) for rank in range(2)]
    np.testing.assert_array_equal(blocks[0][0], [100, 101, 102, 103])
    np.testing.assert_array_equal(blocks[1][0], [104, 105, 106, 107])
    first = list(rank_batches(order, 32, 4, 1, 2, drop_last=True))[0]
    np.testing.assert_array_equal(first, [136, 137, 138, 139])


def test_loader_with_workers_is_freed_without_the_cycle_collector(train):
    # A reference cycle would leave the persistent workers to gc, which stalls seconds shutting them down.
    gc.disable()
    try:
        loader = StagedLoader(train, dataclasses.replace(CFG, num_workers=2))
        batches = loader.host_batches()
        next(batches)
        alive = weakref.ref(loader)
        del batches, loader
        assert alive() is None
    finally:
        gc.enable()


# ---- resumable state -----------------------------------------------------------------------------

@pytest.mark.parametrize("workers", [0, 2])
def test_mid_epoch_state_continues_with_identical_batches(train, workers):
    cfg = dataclasses.replace(CFG, num_workers=workers)
    reference = StagedLoader(train, cfg, seed=3)
    expected = list(reference.host_batches()) + list(reference.host_batches())  # epochs 0 and 1

    first = StagedLoader(train, cfg, seed=3)
    take(iter(first), 3)  # the normalising iterator, as training uses it
    state = first.state_dict()
    assert state == {"seed": 3, "epoch": 0, "consumed": 24, "num_samples": 80}  # prefetched batches excluded

    resumed = StagedLoader(train, cfg, seed=99)
    resumed.load_state_dict(state)
    got = list(resumed.host_batches()) + list(resumed.host_batches())
    assert len(got) == len(expected) - 3
    for (images, labels), (want_images, want_labels) in zip(got, expected[3:], strict=True):
        assert torch.equal(images, want_images) and torch.equal(labels, want_labels)


@pytest.mark.parametrize("block", [4, 7])
def test_a_block_order_permutes_runs_of_neighbours_and_blocks_of_one_are_the_sample_order(block):
    order = global_order(50, 2, 1, shuffle=True, block=block)
    assert sorted(order.tolist()) == list(range(50)) and order.tolist() != list(range(50))
    position = 0
    while position < 50:  # runs of `block` neighbours from a multiple of it (the last run shorter)
        start = int(order[position])
        length = min(block, 50 - start)
        run = order[position:position + length].tolist()
        assert start % block == 0 and run == list(range(start, start + length))
        position += length
    np.testing.assert_array_equal(global_order(50, 2, 1, shuffle=True, block=1),
                                  np.random.default_rng([2, 1]).permutation(50))


@pytest.mark.parametrize(("new_world", "block"), [(3, 1), (1, 1), (3, 4)])
def test_resume_on_another_world_size_sees_the_rest_once(train, new_world, block):
    lookup = index_of(train)
    cfg = dataclasses.replace(CFG, block_samples=block)
    old = [StagedLoader(train, cfg, rank=r, world_size=2, seed=5) for r in range(2)]
    streams = [o.host_batches() for o in old]
    before = [flat(delivered(take(stream, 2), lookup)) for stream in streams]
    assert old[0].state_dict() == old[1].state_dict()

    after = []
    for rank in range(new_world):
        loader = StagedLoader(train, cfg, rank=rank, world_size=new_world)
        loader.load_state_dict(old[0].state_dict())
        after += flat(delivered(loader.host_batches(), lookup))
    seen = before[0] + before[1]
    assert len(after) == len(set(after)) == 48  # 80 - 32 consumed, a multiple of 8 x new_world
    assert sorted(seen + after) == list(range(80))


def test_epoch_advance_changes_the_order(train):
    loader = StagedLoader(train, CFG, seed=1)
    lookup = index_of(train)
    first = flat(delivered(loader.host_batches(), lookup))
    assert loader.state_dict()["epoch"] == 1 and loader.state_dict()["consumed"] == 0
    second = flat(delivered(loader.host_batches(), lookup))
    assert sorted(first) == sorted(second) == list(range(80))
    assert first != second
    np.testing.assert_array_equal(global_order(80, 1, 0, shuffle=True), global_order(80, 1, 0, shuffle=True))


def test_unshuffled_order_is_sequential(train):
    loader = StagedLoader(train, dataclasses.replace(CFG, shuffle=False))
    assert flat(delivered(loader.host_batches(), index_of(train))) == list(range(80))


def test_bad_placement_and_oversized_batch(train):
    with pytest.raises(ValueError, match="rank 2 is outside world size 2"):
        StagedLoader(train, CFG, rank=2, world_size=2)
    with pytest.raises(ValueError, match="loader.batch_size=48 x 2 ranks = 96 exceeds the 80 train samples"):
        StagedLoader(train, dataclasses.replace(CFG, batch_size=48), world_size=2)


def test_read_gathers_across_shards_and_checks_bounds(train, synthetic_dir):
    indices = np.array([79, 0, 40, 31, 32])  # shards hold 0-31, 32-63 and 64-79
    images, labels = train.read(indices)
    order = np.sort(indices)
    shards = [np.fromfile(synthetic_dir / f"train-0000{k}.u8", np.uint8).reshape(-1, 3, 8, 8)
              for k in range(3)]
    whole = np.concatenate(shards)
    np.testing.assert_array_equal(images.numpy(), whole[order])
    np.testing.assert_array_equal(labels.numpy(), train.labels[order])
    for bad in ([80], [-1, 3]):
        with pytest.raises(IndexError, match=r"must be in \[0, 80\)"):
            train.read(np.array(bad))


# ---- normalisation and evaluation ----------------------------------------------------------------

def test_normalizer_matches_the_formula():
    images = torch.randint(0, 256, (4, 3, 5, 5), dtype=torch.uint8)
    mean, std = [0.2, 0.5, 0.7], [0.1, 0.3, 0.25]
    expected = (images.double() / 255 - torch.tensor(mean).double().view(1, 3, 1, 1)) / torch.tensor(
        std).double().view(1, 3, 1, 1)
    out = Normalizer(mean, std)(images)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)


def test_iterating_yields_normalised_float_batches(train):
    manifest = train.manifest
    host = next(StagedLoader(train, CFG, seed=2).host_batches())
    images, labels = next(iter(StagedLoader(train, CFG, seed=2)))
    assert images.dtype == torch.float32 and images.shape == (8, 3, 8, 8)
    torch.testing.assert_close(images, Normalizer(manifest.mean, manifest.std)(host[0]))
    assert torch.equal(labels, host[1])


def test_eval_batches_cover_the_split_once_across_ranks(synthetic_dir):
    val = StagedSplit(synthetic_dir, "val")
    per_rank = [list(eval_batches(val, 3, rank=r, world_size=3)) for r in range(3)]
    assert all(len(labels) <= 3 for batches in per_rank for _, labels in batches)
    images = torch.cat([x for batches in per_rank for x, _ in batches])
    labels = torch.cat([y for batches in per_rank for _, y in batches])
    whole_images, whole_labels = val.read(np.arange(len(val)))
    assert torch.equal(images, whole_images) and torch.equal(labels, whole_labels)


@pytest.mark.gpu
def test_cuda_prefetch_matches_cpu(train):
    manifest = train.manifest
    cpu = [(x, y) for x, y in StagedLoader(train, CFG, seed=4).host_batches()]
    cuda = list(StagedLoader(train, CFG, seed=4, device="cuda"))
    assert len(cuda) == len(cpu)
    normalize = Normalizer(manifest.mean, manifest.std)
    for (images, labels), (host_images, host_labels) in zip(cuda, cpu, strict=True):
        assert images.is_cuda and labels.is_cuda
        torch.testing.assert_close(images.cpu(), normalize(host_images))
        assert torch.equal(labels.cpu(), host_labels)
