"""Checkpoints of the run's state registry: save and resume, on a local disk or in an object store.

    checkpointer  the Checkpointer: save every N steps in one of three modes (sync, dcp, async), resume
    layout        step directories, per-file checksums, the commit marker (written last), pruning
    format        what a step directory holds, version by version, read into the registry's shape
    dcp           the torch.distributed.checkpoint side: torch's writer with named errors, our object-store
                  writer and reader, allow-listed reads
    writer        our checksummed, direct-I/O writer of state.pt and extra.pt
    snapshot      the in-memory copy an ``async`` save writes while training goes on
    store         where the files live: a local directory or an object-store prefix (fsspec), one interface
"""
