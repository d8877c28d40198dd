"""Data: from a source to batches on the device.

    sources      built-in sources (digits, synthetic) and the split arithmetic every source shares
    imagefolder  ``<root>/<class>/<image>`` on a local path or any fsspec URI
    fingerprint  the fingerprint of a source as it is now (part of the staging cache key)
    staging      decode a source once into size-capped uint8 shards, published atomically
    manifest     the staged format: manifest.json, its records, and the integrity checks every reader runs
    loader       memory-mapped reader and the resumable, world-size-independent training loader
    autotune     an opt-in probe that picks num_workers and prefetch_factor for this machine
"""
