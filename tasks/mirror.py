"""The Flyte side of checkpoint mirroring: the node-local root and the object store's filesystem.

traincore.checkpoint.mirror does the mirroring; this module picks the local directory for a checkpoint
root and hands the mirror the filesystem flytekit configured for the root (with the store's credentials).
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator
from pathlib import Path

from flytekit.core.context_manager import FlyteContextManager

from tasks.storage import NODE_CACHE, is_uri, local_path
from traincore.checkpoint.mirror import CheckpointMirror


def local_checkpoint_root(root: str) -> Path:
    """The directory the workers checkpoint into: ``root`` itself, or a node-local stand-in for a URI."""
    if not is_uri(root):
        return local_path(root)
    return NODE_CACHE / "checkpoints" / hashlib.sha256(root.encode()).hexdigest()[:20]


@contextlib.contextmanager
def synced_checkpoints(root: str) -> Iterator[Path]:
    """The local checkpoint root for ``root``; for a URI it is restored first and published throughout."""
    local = local_checkpoint_root(root)
    if not is_uri(root):
        yield local
        return
    file_access = FlyteContextManager.current_context().file_access  # configured with the store's credentials
    mirror = CheckpointMirror(root, local, file_access.get_filesystem_for_path(root))
    mirror.restore()
    with mirror:
        yield local
