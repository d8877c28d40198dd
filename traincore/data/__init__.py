"""Data: from a source to batches on the device.

    sources      built-in sources (digits, synthetic) and the split arithmetic every source shares
    digits       scikit-learn's bundled digits, read without importing scikit-learn
    imagefolder  ``<root>/<class>/<image>`` on a local path or any fsspec URI
    fingerprint  the fingerprint of a source as it is now (part of the staging cache key)
    pysource     ``python:<module>:<callable>``: a user's dataset of (image, label) items
    decode       image conversion to the staged shape, and the process pool that decodes a source's chunks
    staging      decode a source once into size-capped uint8 shards, published atomically
    partitions   a staging split into runs of whole shards staged apart, joined by one manifest
    progress     staging's progress lines (items, bytes, rate) for every source
    manifest     the staged format: manifest.json, its records, and the integrity checks every reader runs
    stream       a staged dataset in an object store, read sample by sample into a bounded node-local cache
    ranges       the stream's ranged reads: presigned URLs over plain HTTP on S3, the store's own elsewhere
    loader       memory-mapped reader and the resumable, world-size-independent training loader
    augment      augmentation on the device (random resized crop, flip), seeded by each batch's place
    autotune     an opt-in probe that picks num_workers and prefetch_factor for this machine
    cli          the staging command (``python -m traincore.stage``): one summary line, or one error line
"""

from traincore.data.autotune import autotune
from traincore.data.fingerprint import source_fingerprint
from traincore.data.loader import (
    DIGEST_MODULUS,
    Normalizer,
    StagedLoader,
    StagedSplit,
    epoch_batches,
    eval_batches,
    sample_digest,
)
from traincore.data.manifest import FORMAT_VERSION, MANIFEST, Manifest, StagingError, verify_staging
from traincore.data.partitions import PartitionRecord, check_partitions, choose_partitions, staging_key
from traincore.data.staging import (
    directory_bytes,
    estimated_bytes,
    merge_partitions,
    open_source,
    stage,
    stage_partition,
    summary,
)
from traincore.data.stream import (
    DEFAULT_CACHE_BYTES,
    NODE_CACHE_ENV,
    Batch,
    StreamedSplit,
    StreamError,
    cache_limit,
    dataset_manifest,
    open_streamed,
    verify_streamed,
)

__all__ = [
    "autotune", "Batch", "DEFAULT_CACHE_BYTES", "NODE_CACHE_ENV", "cache_limit", "check_partitions",
    "DIGEST_MODULUS", "choose_partitions", "dataset_manifest", "directory_bytes", "estimated_bytes",
    "epoch_batches", "eval_batches", "FORMAT_VERSION", "MANIFEST", "Manifest", "merge_partitions",
    "Normalizer", "open_source", "open_streamed", "PartitionRecord", "sample_digest", "source_fingerprint",
    "stage", "stage_partition", "StagedLoader", "StagedSplit", "staging_key", "StagingError",
    "StreamedSplit", "StreamError", "summary", "verify_staging", "verify_streamed",
]
