"""Starting weights: ``model.init_from`` loads a state-dict file into the fresh model before the first step.

The file is a safetensors file (ours, or anyone's) or a torch state-dict file (``.pt`` / ``.pth``, read with
``weights_only``), on a local path or at an object-store URI. Its tensors are matched to the model's own
``state_dict`` names: ``model.init_exclude`` (fnmatch patterns over those names) keeps the matching tensors
fresh, for a new head. Every name ends in one of five lists (:class:`InitReport`): loaded, excluded, missing
(the model has it, the file does not), unexpected (the file has it, the model does not) and mismatched
(both have it, in other shapes). Missing or mismatched names that are not excluded are an error naming
them, unless ``model.init_strict`` is false; unexpected ones are only reported.

torchvision's published state dicts use the module names of torchvision's models, which the built-in
``resnet*`` and ``vit_b_16`` are: they load without renaming (exclude the head, ``fc.*`` or ``heads.*``,
when the class count differs, and the stem, ``conv1.*`` or ``conv_proj.*``, when the channels do).

A run that resumes from a checkpoint ignores ``init_from`` (the checkpoint holds the weights since) and
says so; the sha256 of the file goes into the run record and from there into the model's lineage.
"""

from __future__ import annotations

import fnmatch
import hashlib
import io
import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

log = logging.getLogger(__name__)

SUFFIXES = (".safetensors", ".pt", ".pth")
_SHOWN = 6  # names listed per kind in a message; the rest are counted


class InitError(ValueError):
    """``model.init_from`` cannot be read or does not fit the model; the message names the file, the tensors
    and the fix."""


@dataclass
class InitReport:
    """Where each tensor of the model and of the file went."""

    source: str
    sha256: str
    loaded: list[str] = field(default_factory=list)
    excluded: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    mismatched: list[str] = field(default_factory=list)  # "name: [file shape] vs [model shape]"
    unused_patterns: list[str] = field(default_factory=list)  # init_exclude patterns that matched nothing

    def describe(self) -> str:
        """One line: the counts of each kind and the names of those that are not loaded."""
        parts = [f"{len(self.loaded)} tensors loaded"]
        for kind in ("excluded", "missing", "unexpected", "mismatched"):
            names = getattr(self, kind)
            if names:
                parts.append(f"{len(names)} {kind} ({_names(names)})")
        return f"model.init_from {self.source} (sha256 {self.sha256[:12]}): {', '.join(parts)}"


def _names(names: list[str]) -> str:
    shown = ", ".join(names[:_SHOWN])
    return shown + (f", and {len(names) - _SHOWN} more" if len(names) > _SHOWN else "")


def read_init_file(location: str) -> tuple[dict[str, torch.Tensor], str]:
    """The tensors of the state-dict file at ``location`` (a path or an object-store URI) and its sha256."""
    fix = "pass a safetensors file or a torch state-dict file (.pt / .pth) as model.init_from"
    suffix = Path(location.split("?", 1)[0]).suffix
    if suffix not in SUFFIXES:
        raise InitError(f"model.init_from={location!r}: a {suffix or 'suffix-less'} file is neither "
                        f"safetensors nor a torch state dict: {fix}")
    data = _read_bytes(location)
    digest = hashlib.sha256(data).hexdigest()
    try:
        if suffix == ".safetensors":
            from safetensors.torch import load

            tensors = load(data)
        else:
            tensors = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as exc:  # each reader reports a damaged file as whatever it hit
        raise InitError(f"model.init_from={location!r} cannot be read ({type(exc).__name__}: {exc}): it is "
                        f"damaged, or not what its suffix says: {fix}") from exc
    if isinstance(tensors, dict) and len(tensors) == 1 and next(iter(tensors)) in ("state_dict", "model"):
        tensors = next(iter(tensors.values()))  # a state dict wrapped the way training scripts save it
    if not isinstance(tensors, dict) or not all(isinstance(v, torch.Tensor) for v in tensors.values()):
        raise InitError(f"model.init_from={location!r} holds a {type(tensors).__name__} that is not a flat "
                        f"mapping of tensor names to tensors: {fix}")
    return tensors, digest


def _read_bytes(location: str) -> bytes:
    try:
        if "://" in location and not location.startswith("file://"):
            import fsspec

            with fsspec.open(location, "rb") as handle:
                return handle.read()
        return Path(location.removeprefix("file://")).read_bytes()
    except FileNotFoundError as exc:
        raise InitError(f"model.init_from={location!r} does not exist: pass the path or URI of the weights "
                        "to start from") from exc
    except OSError as exc:
        raise InitError(f"model.init_from={location!r} cannot be read ({exc.strerror or exc}): check the "
                        "path and its permissions (for a URI: the store's credentials)") from exc


def plan(model: dict[str, torch.Size | list[int]], saved: dict[str, torch.Tensor], exclude: list[str],
         source: str, sha256: str) -> InitReport:
    """Sort the model's names (with their shapes) and the file's tensors into an :class:`InitReport`."""
    report = InitReport(source, sha256)
    excluded = {name for name in model if any(fnmatch.fnmatchcase(name, p) for p in exclude)}
    report.unused_patterns = [p for p in exclude if not any(fnmatch.fnmatchcase(name, p) for name in model)]
    for name, shape in model.items():
        if name in excluded:
            report.excluded.append(name)
        elif name not in saved:
            report.missing.append(name)
        elif list(saved[name].shape) != list(shape):
            report.mismatched.append(f"{name}: {list(saved[name].shape)} in the file, {list(shape)} in the "
                                     "model")
        else:
            report.loaded.append(name)
    report.unexpected = [name for name in saved if name not in model]
    return report


def check(report: InitReport, strict: bool) -> None:
    """InitError naming the missing and mismatched tensors, unless ``strict`` is off; warns of exclude
    patterns that match nothing (a typo keeps a head the run meant to replace)."""
    for pattern in report.unused_patterns:
        log.warning("model.init_exclude pattern %r matches none of the model's tensors: check it against the "
                    "model's state_dict names", pattern)
    problems = [f"{len(names)} {kind}: {_names(names)}" for kind, names in
                (("missing from the file", report.missing), ("of another shape", report.mismatched)) if names]
    if problems and strict:
        raise InitError(f"model.init_from={report.source!r} does not fit the model: tensors "
                        f"{'; '.join(problems)}. Add their names (or fnmatch patterns) to model.init_exclude "
                        "to keep them freshly initialised, or set model.init_strict=false to load what fits")
    if not report.loaded:
        raise InitError(f"model.init_from={report.source!r} shares no tensor of the same name and shape with "
                        "the model: it holds the weights of another architecture")


def warm_start(model: nn.Module, location: str, exclude: list[str], strict: bool) -> InitReport:
    """Load the file at ``location`` into ``model`` as :func:`plan` sorts it; the report, logged."""
    tensors, digest = read_init_file(location)
    shapes = {name: value.shape for name, value in model.state_dict().items()}
    report = plan(shapes, tensors, exclude, location, digest)
    check(report, strict)
    with torch.no_grad():
        state = model.state_dict()
        for name in report.loaded:
            state[name].copy_(tensors[name])
    log.info("%s", report.describe())
    return report
