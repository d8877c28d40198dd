"""Stage a dataset source once into the memory-mappable format, in parallel partitions on a cluster; Flyte
caches the result per DataConfig and source fingerprint, so a grown or changed source is staged again and an
unchanged one is not."""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import time
from pathlib import Path

import flytekit
from flytekit import Cache, Resources, dynamic, map_task, task
from flytekit.core.context_manager import FlyteContextManager
from flytekit.types.directory import FlyteDirectory

from tasks.errors import UserFacingError
from tasks.resources import gib
from tasks.storage import source_storage_options
from tasks.types import NodeResources, StagedDataset
from traincore.config import DataConfig
from traincore.data import (
    FORMAT_VERSION,
    MANIFEST,
    PartitionRecord,
    StagingError,
    check_partitions,
    choose_partitions,
    directory_bytes,
    estimated_bytes,
    merge_partitions,
    open_source,
    stage,
    stage_partition,
    staging_key,
    summary,
)

log = logging.getLogger(__name__)

# The cache key is (task, this version, the DataConfig, the source fingerprint); a new staging format must
# never reuse old bytes.
STAGING_CACHE_VERSION = f"staging-format-{FORMAT_VERSION}"

IN_POD_STAGING_BYTES = 256 << 20
"""A staging of one partition at most this size is staged by stage_dataset's own pod on a cluster, not by a
map task's pod and publish_staging's: two pods fewer, each a scheduling and an interpreter's start (8 s of a
replayed pipeline's wall time on 2 cores, measured) for a dataset staged in seconds. The bound keeps that
pod, which asks for no disk, within what any node's disk gives a pod unasked."""


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


@dynamic(cache=Cache(version=STAGING_CACHE_VERSION, ignored_inputs=("partitions", "resources")), retries=2,
         requests=Resources(cpu="1", mem="2Gi"))
def stage_dataset(data: DataConfig, source_fingerprint: str, partitions: int = 0,
                  resources: NodeResources | None = None) -> StagedDataset:
    """Decode, resize and shard ``data.source`` into manifest.json + uint8 shards, cached per DataConfig and
    ``source_fingerprint`` (plan_run's fingerprint of the source as it was when the run started).

    ``partitions`` > 1 stages that many runs of whole shards in parallel (0: one per 4 GiB of staged pixels):
    on a cluster a map task of :func:`stage_partition_task` pods, each uploading its shards to one location in
    the store, then :func:`publish_staging` writes the manifest (one partition of at most
    ``IN_POD_STAGING_BYTES`` is staged and published by this pod itself); in a local run, processes on this
    machine.
    The bytes are the same whatever the count, so it is not part of the cache key, nor are ``resources`` (the
    partition pods' requests: the workflow input ``resources``' "stage" section). A staging already in the
    local directory is verified before it is reused; a damaged one (a shard failing its check, an unreadable
    manifest) is staged again and swapped into place, with a warning naming the file. An object-store source
    is read with the store settings flytekit has (FLYTE_AWS_* for s3://), as Flyte reads its own data. Staging
    lists the source again and stages exactly that listing; if the source changed since plan_run, the manifest
    and the output record what was staged (with a warning), and the next run, fingerprinting the new state,
    stages it under its own key.
    """
    try:
        check_partitions(partitions)
        if FlyteContextManager.current_context().execution_state.is_local_execution():
            return _stage_here(data, source_fingerprint, partitions)
        source, now = open_source(data, _progress, source_storage_options(data.source))
        partitions = choose_partitions(data, source.counts, partitions)
    except StagingError as exc:
        raise SourceStagingError(str(exc)) from None
    _warn_if_changed(data, source_fingerprint, now)
    location = FlyteContextManager.current_context().file_access.get_random_remote_directory()
    print(f"stage_dataset: {partitions} partition(s) into {location}", flush=True)
    if partitions == 1 and estimated_bytes(data, source.count) <= IN_POD_STAGING_BYTES:
        print("stage_dataset: small enough to stage in this pod", flush=True)
        return _publish(data, location, [_stage_and_upload(data, now, location, partitions, 0)])
    # The partitions stage the source as listed here, and refuse to if it changes before they list it.
    stage_one = functools.partial(stage_partition_task, data=data, source_fingerprint=now, location=location,
                                  partitions=partitions)
    requests = partition_requests(data, source.count, partitions, resources or NodeResources())
    # Limits as requested for memory and disk (a pod past them is stopped, not its node starved); CPU not.
    limits = Resources(mem=requests.mem, ephemeral_storage=requests.ephemeral_storage)
    records = map_task(stage_one)(index=list(range(partitions))).with_overrides(requests=requests,
                                                                               limits=limits)
    return publish_staging(data=data, location=location, records=records)


def partition_requests(data: DataConfig, count: int, partitions: int, given: NodeResources) -> Resources:
    """A partition pod's requests: what the launch gave, else 2 CPUs, 4 GiB and room on the node's disk
    for its share of the staging (which it holds until uploaded) plus a quarter."""
    share = estimated_bytes(data, count) / partitions
    return Resources(cpu=given.cpu or "2", mem=given.mem or "4Gi",
                     ephemeral_storage=given.ephemeral_storage or gib(1.25 * share + (1 << 30)))


def _progress(line: str) -> None:
    print(f"stage_dataset: {line}", flush=True)


def _stage_here(data: DataConfig, source_fingerprint: str, partitions: int) -> StagedDataset:
    """A local run's staging: partitions in processes of this machine, into the per-key cache directory."""
    output = staging_directory(data, source_fingerprint)
    start = time.perf_counter()
    manifest = stage(data, output, replace_unusable=True,  # the directory is this task's own
                     progress=_progress, storage_options=source_storage_options(data.source),
                     partitions=partitions)
    _warn_if_changed(data, source_fingerprint, manifest.source_fingerprint)
    mib, seconds = directory_bytes(output) / 2**20, time.perf_counter() - start
    print(f"stage_dataset: {summary(manifest)} ({mib:.1f} MiB in {seconds:.1f} s)", flush=True)
    return StagedDataset.from_manifest(output, manifest)


def _warn_if_changed(data: DataConfig, planned: str, staged: str) -> None:
    """The source changed between plan_run's fingerprint and the staging: say so (what was staged wins)."""
    if staged != planned:
        log.warning("the source %s changed after plan_run fingerprinted it (%s); staged as it is now (%s)",
                    data.source, planned, staged)


@task(retries=2, requests=Resources(cpu="2", mem="4Gi"))
def stage_partition_task(data: DataConfig, source_fingerprint: str, location: str, partitions: int,
                         index: int) -> str:
    """One partition of a staging on a cluster: its shards, staged in this pod's working directory, then
    uploaded under ``location``; its record (traincore.data.PartitionRecord) as JSON. A retried pod
    uploads the same files under the same names."""
    return _stage_and_upload(data, source_fingerprint, location, partitions, index)


def _stage_and_upload(data: DataConfig, source_fingerprint: str, location: str, partitions: int,
                      index: int) -> str:
    """Partition ``index`` staged in this pod's working directory and uploaded under ``location``; its
    record as JSON."""
    work = Path(flytekit.current_context().working_directory) / f"partition-{index}"
    work.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    try:
        record = stage_partition(data, work, index, partitions, source_fingerprint,
                                 progress=functools.partial(_partition_line, index, partitions),
                                 storage_options=source_storage_options(data.source))
    except StagingError as exc:
        raise SourceStagingError(str(exc)) from None
    file_access = FlyteContextManager.current_context().file_access
    for path in sorted(work.iterdir()):
        file_access.put_data(str(path), f"{location.rstrip('/')}/{path.name}")
    mib, seconds = directory_bytes(work) / 2**20, time.perf_counter() - start
    samples = sum(info.count for info in record.splits.values())
    print(f"stage_dataset: partition {index + 1}/{partitions}: {samples} samples ({mib:.1f} MiB in "
          f"{seconds:.1f} s) -> {location}", flush=True)
    return record.to_json()


def _partition_line(index: int, partitions: int, line: str) -> None:
    print(f"stage_dataset: partition {index + 1}/{partitions}: {line}", flush=True)


@task(retries=2, requests=Resources(cpu="1", mem="1Gi"))
def publish_staging(data: DataConfig, location: str, records: list[str]) -> StagedDataset:
    """The staging's manifest from every partition's record, written last under ``location``: before it,
    nothing there is a staged dataset."""
    return _publish(data, location, records)


def _publish(data: DataConfig, location: str, records: list[str]) -> StagedDataset:
    """The manifest merged from the partitions' records, uploaded last under ``location``."""
    try:
        manifest = merge_partitions(data, [PartitionRecord.from_json(record) for record in records])
    except StagingError as exc:
        raise SourceStagingError(str(exc)) from None
    local = Path(flytekit.current_context().working_directory) / MANIFEST
    local.write_text(manifest.to_json())
    target = f"{location.rstrip('/')}/{MANIFEST}"
    FlyteContextManager.current_context().file_access.put_data(str(local), target)
    print(f"stage_dataset: {summary(manifest)} -> {location}", flush=True)
    return StagedDataset.from_manifest(FlyteDirectory(location), manifest)
