"""Loader autotune: a tiny probe returns a valid LoaderConfig and logs what it measured and chose."""

from __future__ import annotations

import logging
import os
import re

import pytest

from traincore.config.schema import LoaderConfig
from traincore.data.autotune import autotune, candidates, probe
from traincore.data.loader import StagedSplit


@pytest.mark.parametrize(("cpus", "workers"), [(1, {0, 1}), (2, {0, 1, 2}), (16, {0, 1, 2, 4, 8})])
def test_candidates_respect_the_core_count(cpus, workers):
    pairs = candidates(cpus)
    assert {w for w, _ in pairs} == workers
    assert pairs[0] == (0, 2) and len(pairs) == len(set(pairs))
    assert all(p in (2, 4) for _, p in pairs)


def test_probe_measures_a_positive_rate(synthetic_dir):
    split = StagedSplit(synthetic_dir, "train")
    assert probe(split, LoaderConfig(batch_size=8), batches=12) > 0  # 12 batches span more than one epoch


def test_autotune_returns_a_valid_config_and_logs_the_choice(synthetic_dir, caplog):
    split = StagedSplit(synthetic_dir, "train")
    base = LoaderConfig(batch_size=8, autotune=True, eval_batch_size=32)
    with caplog.at_level(logging.INFO, logger="traincore.data.autotune"):
        tuned = autotune(split, base, batches=3, rank=1, world_size=2)
    assert isinstance(tuned, LoaderConfig)
    assert (tuned.num_workers, tuned.prefetch_factor) in candidates(len(os.sched_getaffinity(0)))
    assert (tuned.batch_size, tuned.eval_batch_size, tuned.autotune) == (8, 32, False)
    chosen = re.search(r"chose num_workers=(\d+) prefetch_factor=(\d+)", caplog.text)
    assert chosen and (int(chosen[1]), int(chosen[2])) == (tuned.num_workers, tuned.prefetch_factor)
    assert "workers=0 prefetch=2:" in caplog.text
