"""Which checkpoint a run resumes from, and whether it fits the run: one answer for preflight and load.

Preflight (before any worker starts) and :meth:`~traincore.checkpoint.checkpointer.Checkpointer.load`
(rank 0, in a worker, at every start and in-place restart) both call :func:`choose_step` and
:func:`check_fit`, so a run refused by the one is refused by the other, with the same message, and both
look at the same step: the newest complete one that passes verification, falling back past a corrupt one.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from traincore.checkpoint.commit import read_marker, verify_checkpoint
from traincore.checkpoint.errors import CheckpointError, CorruptCheckpointError
from traincore.checkpoint.format import SavedState
from traincore.checkpoint.layout import MARKER, complete_steps, foreign_entries, step_store, torn_steps
from traincore.checkpoint.store import Store
from traincore.config import model_identity, optimizer_identity

FRESH = "or start fresh with --resume none / checkpoint.resume='none' or another checkpoint directory"

log = logging.getLogger(__name__)


def choose_step(root: Store, step: int | None, verify: bool, at_most: int | None = None) -> int | None:
    """The step a resume loads from ``root``: ``step`` if given, else the newest complete one, of those up
    to ``at_most`` when given (a run that stops there: train.stop_after) (None: there is none). ``verify``:
    check every file's size and CRC32 against the marker first; a corrupt newest step is named in a warning
    and the previous complete one is tried, while a corrupt ``step`` asked for by number is an error.
    CheckpointError names what is wrong and the fix.

    Warns, without failing, about entries of the root that are not ours and about saves newer than the
    chosen step that never committed."""
    for entry in foreign_entries(root):
        log.warning("ignoring %s: it is not a checkpoint of traincore (another program's file or directory; "
                    "never deleted): move it out of %s to silence this warning", entry, root)
    complete = [s for s in complete_steps(root) if at_most is None or s <= at_most]
    if step is not None:
        then = f"resuming from step {step}, as asked"
    elif complete:
        then = "resuming from the latest committed step instead"
    else:
        then = "no step is committed, so the run starts from the beginning"
    for torn in torn_steps(root, complete):
        if not complete or torn > complete[-1]:
            log.warning("skipping %s: its save never committed (no %s; the process was stopped while "
                        "writing it); %s", step_store(root, torn), MARKER, then)
    if step is not None:
        if step not in complete:
            raise CheckpointError(f"checkpoint.resume={step} (--resume): {root} holds no complete checkpoint "
                                  f"for step {step} (complete steps: {complete or 'none'}): resume from one "
                                  f"of those or 'latest', {FRESH}")
        _check(step_store(root, step), verify)
        return step
    for candidate in reversed(complete):
        try:
            _check(step_store(root, candidate), verify)
            return candidate
        except CorruptCheckpointError as exc:
            log.warning("%s; falling back to the previous complete checkpoint", exc)
    if complete:
        raise CheckpointError(f"every complete checkpoint under {root} is corrupt (steps {complete}): "
                              "restore them from a backup, or set checkpoint.resume='none'")
    return None


def _check(directory: Store, verify: bool) -> None:
    if verify:
        verify_checkpoint(directory)
    else:
        read_marker(directory)


@dataclass(frozen=True)
class RunFit:
    """What a checkpoint must share with the run that loads it: the model and the data. None: unrecorded
    (a checkpoint of an older version), which fits anything."""

    model: dict[str, Any] | None
    """The model config fields that decide its tensors (:func:`traincore.config.schema.model_identity`)."""
    classes: list[str] | None
    """The staged data's class names, in label order."""
    shape: list[int] | None
    """The staged samples' shape (C, H, W)."""
    train_samples: int | None
    """Samples in the training split: the loader's place in the epoch carries over only between equals."""
    optimizer: dict[str, Any] | None = None
    """The optim config fields that decide its state (:func:`traincore.config.schema.optimizer_identity`);
    None for a checkpoint whose config recorded no optimizer (version 2 recorded only some fields)."""

    @classmethod
    def of_state(cls, shared: dict[str, Any]) -> RunFit:
        """Of a run's shared state, saved or live: its ``run`` record and its loader's position."""
        run = shared.get("run", {})
        model, optim = run.get("config", {}).get("model"), run.get("config", {}).get("optim")
        classes, shape = run.get("classes"), run.get("shape")
        return cls(model_identity(model) if model else None, list(classes) if classes is not None else None,
                   list(shape) if shape is not None else None, shared.get("loader", {}).get("num_samples"),
                   optimizer_identity(optim) if optim and "name" in optim else None)


def check_fit(directory: Store, saved: SavedState, run: RunFit, data: str = "this run's data",
              shapes: dict[str, list[int]] | None = None) -> None:
    """CheckpointError, naming the difference and the fix, unless the checkpoint at ``directory`` fits
    ``run``: the same model, data of the same classes and sample shape, as many training samples and, when
    ``shapes`` (this run's tensors by flattened name) is given, tensors of the same shapes. ``data`` names
    the run's data in the message."""
    theirs = RunFit.of_state(saved.shared)
    problem = f"checkpoint {directory} does not fit this run"
    tensor = _first_difference(saved.shapes, shapes) if shapes is not None else None
    if theirs.model is not None and run.model is not None and theirs.model != run.model:
        raise CheckpointError(f"{problem}: it was written by a run of model {theirs.model}, this run builds "
                              f"{run.model}{f' ({tensor})' if tensor else ''}: use that run's model config, "
                              f"{FRESH}")
    if _differs(theirs.classes, run.classes) or _differs(theirs.shape, run.shape):
        raise CheckpointError(
            f"{problem}: it was trained on data of {_classes(theirs.classes or [])} and shape "
            f"{tuple(theirs.shape or ())}, but {data} holds {_classes(run.classes or [])} of shape "
            f"{tuple(run.shape or ())}: train on data staged as that run's was, {FRESH}")
    if _differs(theirs.optimizer, run.optimizer):  # its state would not load: another set of tensors
        raise CheckpointError(f"{problem}: its optimizer state was written by optimizer {theirs.optimizer}, "
                              f"this run's is {run.optimizer} (optim.name, and the patterns of frozen "
                              f"optim.param_groups): resume with that run's, {FRESH}")
    if _differs(theirs.train_samples, run.train_samples):
        raise CheckpointError(f"{problem}: it was saved by a run over {theirs.train_samples} training "
                              f"samples, but {data} has {run.train_samples} (its place in the epoch would "
                              f"not carry over): train on the dataset that run used, {FRESH}")
    if tensor is not None:
        written_for = saved.shared.get("run", {}).get("config", {}).get("model")
        raise CheckpointError(f"{problem}: {tensor}. The checkpoint was written for model config "
                              f"{written_for or '(unrecorded)'}: build that model, or train into a fresh "
                              "checkpoint root")


RESUMED_SETTINGS = ("optim.*", "loader.batch_size", "loader.shuffle", "train.seed", "train.grad_accum_steps",
                    "train.global_batch", "train.bf16")
"""The settings a resume may change but that change what the following steps do: a resume names them
(a longer train.max_steps, the usual reason to resume, is not among them)."""


def changed_settings(saved: dict[str, Any], run: dict[str, Any]) -> list[str]:
    """``field old -> new`` for each of :data:`RESUMED_SETTINGS` in which the ``run`` records (shared
    state: its ``run`` member's config) of a checkpoint and of the run that resumes it differ."""
    theirs, ours = saved.get("run", {}).get("config", {}), run.get("run", {}).get("config", {})
    changes = []
    for setting in RESUMED_SETTINGS:
        section, _, name = setting.partition(".")
        before, after = theirs.get(section, {}), ours.get(section, {})
        names = sorted(set(before) | set(after)) if name == "*" else [name]
        changes += [f"{section}.{key} {before[key]!r} -> {after[key]!r}" for key in names
                    if key in before and key in after and before[key] != after[key]]
    return changes


def _differs(saved: Any, current: Any) -> bool:
    return saved is not None and current is not None and saved != current


def _classes(classes: list[str]) -> str:
    shown = ", ".join(map(str, classes[:5])) + (", ..." if len(classes) > 5 else "")
    return f"{len(classes)} classes ({shown})"


def _first_difference(saved: dict[str, list[int]], current: dict[str, list[int]]) -> str | None:
    """The first tensor whose shape differs between the checkpoint and the run, in words; None if none."""
    for name in [*current, *(n for n in saved if n not in current)]:
        saved_shape, current_shape = saved.get(name, "absent"), current.get(name, "absent")
        if saved_shape != current_shape:
            member, _, key = name.partition(".")
            kind = "parameter" if member == "model" else f"{member} state"
            return (f"{kind} {key!r} has shape {saved_shape} in the checkpoint and {current_shape} in the "
                    "model")
    return None
