"""What to tell a user who hands an export command a checkpoint, or a model command something else.

A run's output, a checkpoints root, a step directory and an export directory all look alike on disk; these
functions say which one a path is and write the command that turns it into what the caller needed (kept
apart from the export itself, which only writes and verifies).
"""

from __future__ import annotations

import shlex
from pathlib import Path

from traincore.checkpoint import MARKER, latest_complete, parse_step_name

WEIGHTS_FILE = "model.safetensors"  # the name an export directory holds the weights under


def inside_checkpoint(path: Path) -> Path | None:
    """The complete step directory that ``path`` lies in (``path`` resolved), or None."""
    for parent in path.resolve().parents:
        if parse_step_name(parent.name) is not None and (parent / MARKER).is_file():
            return parent
    return None


def directory_problem(path: Path) -> str:
    """Why the directory ``path`` is not a model to load, and what to pass instead: for a training
    checkpoint (or a run's output holding one), the export command that makes a model of it."""
    checkpoint = checkpoint_at(path)
    if checkpoint is not None:
        where = ("is a training checkpoint" if checkpoint == path.resolve() else
                 f"lies in the training checkpoint {checkpoint}" if checkpoint in path.resolve().parents else
                 f"holds the training checkpoint {checkpoint}")
        return (f"model {path} {where}, not an exported model: export it with "
                f"`{export_command(checkpoint)}` and pass that --output as the model")
    exports = sorted(path.glob("*.safetensors"))
    if exports:
        return f"model {path} is a directory: pass the exported file inside it, e.g. {exports[0]}"
    return (f"model {path} is a directory and holds no exported model: pass the .safetensors file that "
            "python -m traincore.export --checkpoint DIR --output FILE wrote")


def missing_problem(path: Path, config_path: Path) -> str:
    """What to run when the export ``path`` (or its config) is missing: an export to ``path``, or, where
    ``path`` lies in a committed step directory (export refuses to write there), one to a place it accepts."""
    step = inside_checkpoint(path)
    if step is None:
        return (f"exported model {path} or its config {config_path} is missing: run "
                f"python -m traincore.export --checkpoint DIR --output {path}")
    return (f"exported model {path} is missing, and cannot be made there: it lies in the training checkpoint "
            f"{step}, which export never writes into. Export it with `{export_command(step)}` and pass that "
            "--output as the model")


def checkpoint_at(directory: Path) -> Path | None:
    """The training checkpoint ``directory`` is, lies in or holds: a complete step directory (itself or one
    above it), else a checkpoints root (itself, or its ``checkpoints`` sub-directory, as a run's output
    has); None for any other directory."""
    resolved = directory.resolve()
    step = inside_checkpoint(resolved / MARKER)  # the directory itself, or one above it
    if step is not None:
        return step
    for root in (resolved, resolved / "checkpoints"):
        if root.is_dir() and latest_complete(root) is not None:
            return root
    return None


def export_command(checkpoint: Path) -> str:
    """The command that exports ``checkpoint`` (a step directory or a checkpoints root) into ``export/``
    beside its checkpoints root: outside every checkpoint, where export writes."""
    root = checkpoint.parent if (checkpoint / MARKER).is_file() else checkpoint
    output = root.parent / "export" / WEIGHTS_FILE
    return shlex.join(["python", "-m", "traincore.export", "--checkpoint", str(checkpoint),
                       "--output", str(output)])
