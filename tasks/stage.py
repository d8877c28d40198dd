"""Stage a dataset source once into the memory-mappable format; Flyte caches the result."""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

import flytekit
from flytekit import Resources, task
from flytekit.core.context_manager import FlyteContextManager

from tasks.types import StagedDataset
from traincore.config import DataConfig
from traincore.data import FORMAT_VERSION
from traincore.stage import directory_bytes, stage, staging_key, summary

# The cache key is (task, this version, the DataConfig); a new staging format must never reuse old bytes.
STAGING_CACHE_VERSION = f"staging-format-{FORMAT_VERSION}"


def staging_directory(data: DataConfig) -> Path:
    """Where to stage: in a pod, the task's working directory (Flyte uploads it); locally, a directory per
    DataConfig under the user cache directory.

    Locally, flytekit's cache (in ~/.flyte) records the output's path as it is; a staging under /tmp would
    vanish with a /tmp clean-up and leave every later cache hit pointing at nothing. The per-config
    directory also lets a cache miss reuse a complete earlier staging of the same config.
    """
    if not FlyteContextManager.current_context().execution_state.is_local_execution():
        return Path(flytekit.current_context().working_directory) / "staged"
    key = hashlib.sha256(json.dumps(staging_key(data), sort_keys=True).encode()).hexdigest()[:16]
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "flyte-torch-pipeline" / "staged" / f"format{FORMAT_VERSION}-{key}"


@task(cache=True, cache_version=STAGING_CACHE_VERSION, retries=2, requests=Resources(cpu="2", mem="4Gi"))
def stage_dataset(data: DataConfig) -> StagedDataset:
    """Decode, resize and shard ``data.source`` into manifest.json + uint8 shards (cached per DataConfig).

    A staging already in the directory is verified before it is reused; a damaged one (a shard failing its
    check, an unreadable manifest) is staged again and swapped into place, with a warning naming the file.
    """
    output = staging_directory(data)
    start = time.perf_counter()
    manifest = stage(data, output, replace_unusable=True)  # the directory is this task's own
    mib, seconds = directory_bytes(output) / 2**20, time.perf_counter() - start
    print(f"stage_dataset: {summary(manifest)} ({mib:.1f} MiB in {seconds:.1f} s)", flush=True)
    return StagedDataset.from_manifest(output, manifest)
