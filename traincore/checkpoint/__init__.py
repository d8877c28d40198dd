"""Checkpoints of the run's state registry: save and resume, on a local disk or in an object store.

A save, followed through the code: :meth:`Checkpointer.save` (checkpointer) clears the step directory
(prune), writes each rank's files (writer for ``state.pt`` and ``extra.pt``, dcp for the tensors), then
rank 0 writes the commit marker (commit) and prunes older steps (prune). A resume: :func:`choose_step` and
:func:`check_fit` (resume) pick the step and refuse one that does not fit; format reads it.

    checkpointer  the Checkpointer: save every N steps or seconds in one of three modes (sync, dcp, async)
    resume        which step a resume loads (verify, fall back) and whether it fits the run
    commit        the commit marker, written last, and the per-file checksums it lists
    layout        step directories under a root: names, complete, torn and foreign ones
    prune         deleting step directories: old, torn, superseded; never another program's, nor the best
    selection     the best checkpoint by a validation metric its marker records (export's --select best)
    errors        what a checkpoint operation raises, each naming the file and the fix
    format        what a step directory holds, version by version, read into the registry's shape
    dcp           the torch.distributed.checkpoint side: torch's writer with named errors, our object-store
                  writer and reader, allow-listed reads
    writer        our checksummed, direct-I/O writer of state.pt and extra.pt
    snapshot      the in-memory copy an ``async`` save writes while training goes on
    store         where the files live: a local directory or an object-store prefix (fsspec), one interface
    upload        a stream that uploads its parts several at once into S3-compatible stores

Other packages import from here, never from the modules.
"""

from traincore.checkpoint.checkpointer import Checkpointer, SaveStats
from traincore.checkpoint.commit import FORMAT_VERSION, read_marker, verify_checkpoint
from traincore.checkpoint.errors import CheckpointError, CheckpointWriteError, CorruptCheckpointError
from traincore.checkpoint.format import open_saved, read_checkpoint
from traincore.checkpoint.layout import (
    MARKER,
    complete_steps,
    latest_complete,
    parse_step_name,
    step_dir,
    step_store,
)
from traincore.checkpoint.resume import RunFit, check_fit, choose_step
from traincore.checkpoint.selection import (
    HIGHER_IS_BETTER,
    SELECTIONS,
    best_step,
    improves,
    select_step,
    step_metrics,
)
from traincore.checkpoint.store import STORE_ACCESS_FIX, Store, as_store, error_reason, is_uri
from traincore.checkpoint.upload import MultipartUpload

__all__ = [
    "as_store", "best_step", "check_fit", "Checkpointer", "CheckpointError", "CheckpointWriteError",
    "error_reason", "HIGHER_IS_BETTER", "STORE_ACCESS_FIX",
    "choose_step", "complete_steps", "CorruptCheckpointError", "FORMAT_VERSION", "improves", "is_uri",
    "latest_complete", "MARKER", "MultipartUpload", "open_saved", "parse_step_name", "read_checkpoint",
    "read_marker",
    "RunFit", "SaveStats", "select_step", "SELECTIONS", "step_dir", "step_metrics", "step_store", "Store",
    "verify_checkpoint",
]
