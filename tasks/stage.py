"""Stage a dataset source once into the memory-mappable format; Flyte caches the result per DataConfig and
source fingerprint, so a grown or changed source is staged again and an unchanged one is not."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from pathlib import Path

import flytekit
from flytekit import Resources, task
from flytekit.core.context_manager import FlyteContextManager

from tasks.errors import UserFacingError
from tasks.storage import source_storage_options
from tasks.types import StagedDataset
from traincore.config import DataConfig
from traincore.data import FORMAT_VERSION, StagingError, directory_bytes, stage, staging_key, summary

log = logging.getLogger(__name__)

# The cache key is (task, this version, the DataConfig, the source fingerprint); a new staging format must
# never reuse old bytes.
STAGING_CACHE_VERSION = f"staging-format-{FORMAT_VERSION}"


def staging_directory(data: DataConfig, source_fingerprint: str) -> Path:
    """Where to stage: in a pod, the task's working directory (Flyte uploads it); locally, a directory per
    DataConfig and source fingerprint under the user cache directory.

    Locally, flytekit's cache (in ~/.flyte) records the output's path as it is; a staging under /tmp would
    vanish with a /tmp clean-up and leave every later cache hit pointing at nothing. The per-key directory
    also lets a cache miss reuse a complete earlier staging of the same config and source state.
    """
    if not FlyteContextManager.current_context().execution_state.is_local_execution():
        return Path(flytekit.current_context().working_directory) / "staged"
    identity = json.dumps([staging_key(data), source_fingerprint], sort_keys=True)
    key = hashlib.sha256(identity.encode()).hexdigest()[:16]
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "flyte-torch-pipeline" / "staged" / f"format{FORMAT_VERSION}-{key}"


class SourceStagingError(UserFacingError, StagingError):
    """The source could not be staged (an unreadable image, no space left, ...): traincore's StagingError,
    with its message, shown by ``pyflyte run`` without a traceback (tasks.errors)."""


@task(cache=True, cache_version=STAGING_CACHE_VERSION, retries=2, requests=Resources(cpu="2", mem="4Gi"))
def stage_dataset(data: DataConfig, source_fingerprint: str) -> StagedDataset:
    """Decode, resize and shard ``data.source`` into manifest.json + uint8 shards, cached per DataConfig and
    ``source_fingerprint`` (plan_run's fingerprint of the source as it was when the run started).

    A staging already in the directory is verified before it is reused; a damaged one (a shard failing its
    check, an unreadable manifest) is staged again and swapped into place, with a warning naming the file.
    An object-store source is read with the store settings flytekit has (FLYTE_AWS_* for s3://), as Flyte
    reads its own data. Staging lists the source again and stages exactly that listing; if the source
    changed since plan_run, the manifest and the output record what was staged (with a warning), and the
    next run, fingerprinting the new state, stages it under its own key.
    """
    output = staging_directory(data, source_fingerprint)
    start = time.perf_counter()
    try:
        manifest = stage(data, output, replace_unusable=True,  # the directory is this task's own
                         progress=lambda line: print(f"stage_dataset: {line}", flush=True),
                         storage_options=source_storage_options(data.source))
    except StagingError as exc:
        raise SourceStagingError(str(exc)) from None
    if manifest.source_fingerprint != source_fingerprint:
        log.warning("the source %s changed after plan_run fingerprinted it (%s); staged as it is now (%s)",
                    data.source, source_fingerprint, manifest.source_fingerprint)
    mib, seconds = directory_bytes(output) / 2**20, time.perf_counter() - start
    print(f"stage_dataset: {summary(manifest)} ({mib:.1f} MiB in {seconds:.1f} s)", flush=True)
    return StagedDataset.from_manifest(output, manifest)
