"""Where a checkpoint's files are: step directories under a root, and which of them count.

Layout: ``<root>/step-000123/``. A ``sync`` checkpoint is one ``state.pt`` (torch.save of the full state).
A ``dcp`` or ``async`` one is a torch.distributed.checkpoint directory (every rank its own ``.distcp``
files, plus DCP's ``.metadata``) and ``extra.pt`` with everything that is not a tensor. What those files
hold, version by version, is :mod:`traincore.checkpoint.format`; the commit marker that makes a step
directory count is :mod:`traincore.checkpoint.commit`.

A step directory without a marker that holds only files a save writes is torn (a crash mid-save): resume
skips it and pruning deletes it (:mod:`traincore.checkpoint.prune`). Entries of a root named ``step-*``
that are not ours are never deleted: a file, a name step_name() does not write (``step-5``, ``step-abc``),
or a step directory without a marker that holds files no save writes. Resume ignores them, with a warning
naming each (:func:`foreign_entries`).
"""

from __future__ import annotations

import re
from pathlib import Path

from traincore.checkpoint.store import Store, as_store

MARKER = "commit.json"
STATE_FILE = "state.pt"  # sync: the whole state
EXTRA_FILE = "extra.pt"  # dcp / async: the non-tensor state
OWN_FILES = (MARKER, STATE_FILE, EXTRA_FILE)  # written by the checkpointer, checksummed while written
_STEP_NAME = re.compile(r"^step-(\d+)$")
# Every file a save writes into a step directory: ours, DCP's, and the temporary names of both.
_SAVED_FILE = re.compile(r"^\.?(state\.pt|extra\.pt|commit\.json|\.metadata|__\d+_\d+\.distcp)(\.tmp)?$")



def step_name(step: int) -> str:
    """The name of ``step``'s directory (``step-000123``)."""
    return f"step-{step:06d}"


def step_dir(root: str | Path, step: int) -> Path:
    """The directory of ``step`` under the local ``root``."""
    return Path(root) / step_name(step)


def step_store(root: str | Path | Store, step: int) -> Store:
    """The location of ``step`` under ``root``, local or in an object store."""
    return as_store(root).child(step_name(step))


def parse_step_name(name: str) -> int | None:
    """The step of a step directory's name (``step-000123`` -> 123), or None for any other name."""
    match = _STEP_NAME.match(name)
    # Only the name step_name() writes counts: "step-123" or "step-0000123" is not a checkpoint.
    if match is None or name != step_name(int(match.group(1))):
        return None
    return int(match.group(1))


def step_dirs(root: str | Path | Store) -> dict[int, Store]:
    """The step directories under ``root`` (complete, torn or foreign), by step."""
    store = as_store(root)
    found = ((parse_step_name(name), name) for name, kind in store.entries().items() if kind == "dir")
    return {step: store.child(name) for step, name in found if step is not None}


def complete_steps(root: str | Path | Store) -> list[int]:
    """Steps under ``root`` that have a commit marker, oldest first; needs no process group."""
    return sorted(step for step, location in step_dirs(root).items() if location.is_file(MARKER))


def latest_complete(root: str | Path) -> Path | None:
    """The newest complete step directory under the local ``root``, or None."""
    steps = complete_steps(root)
    return step_dir(root, steps[-1]) if steps else None


def tmp_path(path: Path) -> Path:
    """The temporary name ``path`` is written under before it is published."""
    return path.with_name(f".{path.name}.tmp")


def is_torn(directory: str | Path | Store) -> bool:
    """A step directory without a marker that holds only files a save writes (or none): a save that did
    not finish, which may be deleted."""
    store = as_store(directory)
    if store.local and (not store.path.is_dir() or store.path.is_symlink()):
        return False
    entries = store.entries()
    if not store.local and not entries:
        return False  # an object store has no empty directories: nothing is there
    return MARKER not in entries and all(kind == "file" and _SAVED_FILE.match(name)
                                         for name, kind in entries.items())


def torn_steps(root: str | Path | Store, complete: list[int]) -> list[int]:
    """Steps under ``root`` whose save began but never committed: no marker, only files a save writes, or
    (in an object store) only uploads that never completed. ``complete``: :func:`complete_steps` of the
    root, which the caller has (in an object store, each listing is a round trip)."""
    store = as_store(root)
    torn = {step for step, location in step_dirs(store).items()
            if step not in complete and is_torn(location)}
    uploading = {parse_step_name(name.split("/")[0]) for name in store.unfinished_uploads()}
    return sorted(torn | {step for step in uploading if step is not None and step not in complete})


def foreign_entries(root: str | Path | Store) -> list[str]:
    """Entries of ``root`` named ``step-*`` that are neither a checkpoint nor a torn save of ours."""
    store = as_store(root)
    found = []
    for name, kind in sorted(store.entries().items()):
        if not name.startswith("step-"):
            continue
        child = store.child(name)
        if parse_step_name(name) is None or kind != "dir" or not (child.is_file(MARKER) or is_torn(child)):
            found.append(store.uri_of(name))
    return found

