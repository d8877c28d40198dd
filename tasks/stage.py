"""Stage a dataset source once into the memory-mappable format; Flyte caches the result."""

from __future__ import annotations

import time
from pathlib import Path

import flytekit
from flytekit import Resources, task
from flytekit.types.directory import FlyteDirectory

from tasks.types import StagedDataset
from traincore.config import DataConfig
from traincore.data import FORMAT_VERSION, directory_bytes, stage, summary

# The cache key is (task, this version, the DataConfig); a new staging format must never reuse old bytes.
STAGING_CACHE_VERSION = f"staging-format-{FORMAT_VERSION}"


@task(cache=True, cache_version=STAGING_CACHE_VERSION, retries=2, requests=Resources(cpu="2", mem="4Gi"))
def stage_dataset(data: DataConfig) -> StagedDataset:
    """Decode, resize and shard ``data.source`` into manifest.json + uint8 shards (cached per DataConfig)."""
    output = Path(flytekit.current_context().working_directory) / "staged"
    start = time.perf_counter()
    manifest = stage(data, output)
    mib = directory_bytes(output) / 2**20
    print(f"stage_dataset: {summary(manifest)} ({mib:.1f} MiB in {time.perf_counter() - start:.1f} s)", flush=True)
    return StagedDataset(directory=FlyteDirectory(str(output)), source=manifest.source, classes=manifest.classes,
                         shape=list(manifest.shape), counts={name: s.count for name, s in manifest.splits.items()},
                         format_version=manifest.format_version)
