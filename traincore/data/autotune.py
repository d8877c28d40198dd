"""Opt-in loader autotune: a short probe that picks num_workers and prefetch_factor for this machine."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import time

from traincore.config import LoaderConfig
from traincore.data.loader import StagedLoader, StagedSplit

log = logging.getLogger(__name__)


def candidates(cpus: int) -> list[tuple[int, int]]:
    """(num_workers, prefetch_factor) pairs worth probing on a machine with ``cpus`` cores."""
    workers = sorted({0, 1, 2, min(4, cpus), min(8, cpus)} & set(range(cpus + 1)))
    return [(0, 2)] + [(w, p) for w, p in itertools.product(workers, (2, 4)) if w > 0]


def probe(split: StagedSplit, cfg: LoaderConfig, batches: int, **placement) -> float:
    """Host samples per second of ``cfg`` over ``batches`` batches, after two warm-up batches."""
    loader = StagedLoader(split, cfg, **placement)
    stream = itertools.chain.from_iterable(loader.host_batches() for _ in itertools.count())
    for _ in range(2):
        next(stream)
    start, samples = time.perf_counter(), 0
    for _ in range(batches):
        samples += len(next(stream)[1])
    return samples / (time.perf_counter() - start)


def autotune(split: StagedSplit, cfg: LoaderConfig, batches: int = 40, **placement) -> LoaderConfig:
    """Probe each candidate setting, log the measured rates, and return ``cfg`` with the fastest one.

    ``placement`` is passed to :class:`StagedLoader` (rank, world_size, seed, device).
    """
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    rates = {}
    for workers, prefetch in candidates(cpus):
        trial = dataclasses.replace(cfg, num_workers=workers, prefetch_factor=prefetch, autotune=False)
        rates[(workers, prefetch)] = probe(split, trial, batches, **placement)
    best = max(rates, key=rates.get)
    table = ", ".join(f"workers={w} prefetch={p}: {r:,.0f}/s" for (w, p), r in rates.items())
    log.info("loader autotune on %d cores: %s -> chose num_workers=%d prefetch_factor=%d", cpus, table, *best)
    return dataclasses.replace(cfg, num_workers=best[0], prefetch_factor=best[1], autotune=False)
