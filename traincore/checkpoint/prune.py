"""Deleting step directories: the older complete ones past ``keep_last``, torn saves, and whatever a save
of a step finds in its way, but never an entry that is not ours."""

from __future__ import annotations

import logging
from pathlib import Path

from traincore.checkpoint.commit import read_marker
from traincore.checkpoint.errors import CheckpointError, CorruptCheckpointError
from traincore.checkpoint.layout import MARKER, is_torn, parse_step_name, step_dirs
from traincore.checkpoint.selection import best_step
from traincore.checkpoint.store import Store, as_store

log = logging.getLogger(__name__)


def clear_step(directory: str | Path | Store) -> None:
    """Delete what a save of this step finds at ``directory``: a torn save or a checkpoint of ours (it is
    saved again); CheckpointError, deleting nothing, for anything else."""
    store = as_store(directory)
    if not store.exists():
        return
    if not (is_torn(store) or _marker_is_ours(store)):
        parent = store.uri.rsplit("/", 1)[0]
        raise CheckpointError(f"cannot save step {parse_step_name(store.name)}: {store} exists and "
                              "is not a checkpoint of traincore (another program's file or directory), and "
                              f"it is never deleted: move it out of {parent}, or choose another "
                              "checkpoint root")
    remove_step(store)


def _marker_is_ours(directory: Store) -> bool:
    """Whether ``directory`` is a step directory whose commit marker traincore wrote (intact or damaged)."""
    if (directory.local and directory.path.is_symlink()) or not directory.is_file(MARKER):
        return False
    try:
        read_marker(directory)
    except CorruptCheckpointError:
        return True
    except CheckpointError:
        return False
    return True



def remove_step(directory: str | Path | Store) -> None:
    """Delete a step directory, complete or torn."""
    # The marker goes first, and (locally) its removal reaches the disk before any other file goes: a crash
    # (or power cut) half-way leaves a torn directory, never a complete-looking one with files missing.
    store = as_store(directory)
    store.remove_file(MARKER)
    store.remove_tree()


def prune(root: str | Path | Store, keep_last: int, keep_best: str | None = None) -> None:
    """Keep the newest ``keep_last`` complete steps, and the best by the metric ``keep_best``
    (traincore.checkpoint.selection); delete older ones and torn ones older than the newest (never an entry
    that is not ours)."""
    steps = step_dirs(root)
    complete = sorted(step for step, location in steps.items() if location.is_file(MARKER))
    if not complete:
        return
    best = best_step(root, keep_best) if keep_best and len(complete) > keep_last else None
    old = [steps[s] for s in complete[:-keep_last] if s != best and _marker_is_ours(steps[s])]
    torn_older = [location for s, location in steps.items() if s < complete[-1] and is_torn(location)]
    for location in torn_older:
        log.info("deleting %s: a save that never committed", location)
    for location in old + torn_older:
        remove_step(location)
    # Uploads of a save killed before any of its files completed: no listing shows their step.
    def older(name: str) -> bool:
        step = parse_step_name(name.split("/")[0])
        return step is not None and step < complete[-1]
    as_store(root).abort_uploads(older)
