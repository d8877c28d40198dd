"""Starting weights: ``model.init_from`` loads a state-dict file into the fresh model before the first step.

The file is a safetensors file (ours, or anyone's) or a torch state-dict file (``.pt`` / ``.pth``, read with
``weights_only``), on a local path or at an object-store URI, maybe a training script's checkpoint with the
state dict inside (traincore.model.initfile reads it). Its tensors are matched to the model's own
``state_dict`` names; a prefix that every name in the file carries and the model's lack (DDP's
``module.``, torch.compile's ``_orig_mod.``, a Lightning module's attribute) is dropped first.
``model.init_exclude`` (fnmatch patterns over the model's names) keeps the matching tensors fresh, for a
new head. Every name ends in one of five lists (:class:`InitReport`): loaded, excluded, missing (the model
has it, the file does not), unexpected (the file has it, the model does not) and mismatched (both have it,
in another shape, or integers where the model has floats or the reverse; float precisions convert).
Missing or mismatched names that are not excluded are an error naming them, unless ``model.init_strict``
is false; unexpected ones are only reported.

torchvision's published state dicts use the module names of torchvision's models, which the built-in
``resnet*`` and ``vit_b_16`` are: they load without renaming (exclude the head, ``fc.*`` or ``heads.*``,
when the class count differs, and the stem, ``conv1.*`` or ``conv_proj.*``, when the channels do).

A run that resumes from a checkpoint ignores ``init_from`` (the checkpoint holds the weights since) and
says so; the sha256 of the file goes into the run record and from there into the model's lineage.
"""

from __future__ import annotations

import fnmatch
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from traincore.model.initfile import InitError, read_init_file

log = logging.getLogger(__name__)

_SHOWN = 6  # names listed per kind in a message; the rest are counted
WRAPPER_PREFIXES = ("module.", "_orig_mod.")
"""Name prefixes of DistributedDataParallel and torch.compile, which a state dict saved from the wrapper
carries."""


@dataclass
class InitReport:
    """Where each tensor of the model and of the file went."""

    source: str
    sha256: str = ""
    layout: str = ""  # where in the file the state dict was (traincore.model.initfile.InitFile.layout)
    prefix: str = ""  # what every name in the file carries before the model's name for it
    loaded: list[str] = field(default_factory=list)
    excluded: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    mismatched: list[str] = field(default_factory=list)  # "name: [file shape] in the file, ... in the model"
    unused_patterns: list[str] = field(default_factory=list)  # init_exclude patterns that matched nothing

    def describe(self) -> str:
        """One line: where the state dict was, the counts of each kind and the names of those not loaded."""
        parts = [f"{len(self.loaded)} tensors loaded"]
        for kind in ("excluded", "missing", "unexpected", "mismatched"):
            names = getattr(self, kind)
            if names:
                parts.append(f"{len(names)} {kind} ({_names(names)})")
        found = [f"sha256 {self.sha256[:12]}"] if self.sha256 else []
        found += [self.layout] if self.layout else []
        found += [f"names without their prefix {self.prefix!r}"] if self.prefix else []
        return f"model.init_from {self.source} ({'; '.join(found)}): {', '.join(parts)}"


def _names(names: list[str]) -> str:
    shown = ", ".join(names[:_SHOWN])
    return shown + (f", and {len(names) - _SHOWN} more" if len(names) > _SHOWN else "")


def plan(model: Mapping[str, Any], saved: Mapping[str, Any], exclude: list[str], source: str,
         sha256: str = "", layout: str = "") -> InitReport:
    """Sort the model's tensors and the file's (by name; anything with ``shape`` and ``dtype``: tensors,
    meta or sharded ones, or a header's specs) into an :class:`InitReport`."""
    prefix = common_prefix(model, saved)
    saved = {name[len(prefix):]: value for name, value in saved.items()}
    report = InitReport(source, sha256, layout, prefix)
    excluded = {name for name in model if any(fnmatch.fnmatchcase(name, p) for p in exclude)}
    report.unused_patterns = [p for p in exclude if not any(fnmatch.fnmatchcase(name, p) for name in model)]
    for name, tensor in model.items():
        if name in excluded:
            report.excluded.append(name)
        elif name not in saved:
            report.missing.append(name)
        elif (misfit := _misfit(saved[name], tensor)) is not None:
            report.mismatched.append(f"{name}: {misfit}")
        else:
            report.loaded.append(name)
    report.unexpected = [name for name in saved if name not in model]
    return report


def common_prefix(model: Mapping[str, Any], saved: Mapping[str, Any]) -> str:
    """The prefix every name in ``saved`` carries where no name matches the model's as it is: a wrapper's
    (:data:`WRAPPER_PREFIXES`), or any one leading component once dropping it makes names match; repeated
    (``module._orig_mod.``). Empty when the names match, or nothing can be dropped."""
    prefix = ""
    names = list(saved)
    while names and not any(name in model for name in names):
        heads = {name.partition(".")[0] for name in names}
        if len(heads) != 1 or not all("." in name for name in names):
            break
        head = f"{heads.pop()}."
        stripped = [name[len(head):] for name in names]
        if head not in WRAPPER_PREFIXES and not any(name in model for name in stripped):
            break
        prefix, names = prefix + head, stripped
    return prefix


def _misfit(saved: Any, model: Any) -> str | None:
    """How the file's tensor differs from the model's, in words; None when it loads (float precisions
    convert, as load_state_dict converts them)."""
    if list(saved.shape) != list(model.shape):
        return f"{list(saved.shape)} in the file, {list(model.shape)} in the model"
    if _floating(saved.dtype) != _floating(model.dtype):
        return f"{_dtype(saved.dtype)} in the file, {_dtype(model.dtype)} in the model"
    return None


def _floating(dtype: torch.dtype | str) -> bool:
    return isinstance(dtype, torch.dtype) and dtype.is_floating_point


def _dtype(dtype: torch.dtype | str) -> str:
    return str(dtype).removeprefix("torch.")


def check(report: InitReport, strict: bool) -> None:
    """InitError naming the missing and mismatched tensors, unless ``strict`` is off, or when nothing would
    load; warns of exclude patterns that match nothing (a typo keeps a head the run meant to replace)."""
    for pattern in report.unused_patterns:
        log.warning("model.init_exclude pattern %r matches none of the model's tensors: check it against the "
                    "model's state_dict names", pattern)
    problems = [f"{len(names)} {kind}: {_names(names)}" for kind, names in
                (("missing from the file", report.missing), ("of another shape or dtype", report.mismatched))
                if names]
    if problems and strict:
        raise InitError(f"model.init_from={report.source!r} does not fit the model: tensors "
                        f"{'; '.join(problems)}. Add their names (or fnmatch patterns) to model.init_exclude "
                        "to keep them freshly initialised, or set model.init_strict=false to load what fits")
    if report.loaded:
        return
    if report.excluded and not report.missing and not report.mismatched:
        raise InitError(f"model.init_exclude excluded every tensor of the model ({len(report.excluded)}), "
                        f"so nothing of model.init_from={report.source!r} would load: exclude only the "
                        "layers to start fresh (e.g. [\"fc.*\"] for a head), or leave model.init_from empty")
    theirs = report.unexpected or [name.partition(":")[0] for name in report.mismatched]
    ours = report.missing or [name.partition(":")[0] for name in report.mismatched]
    raise InitError(f"model.init_from={report.source!r} shares no tensor of the same name and shape with "
                    f"the model: its names are like {_names(theirs[:3])}, the model's like "
                    f"{_names(ours[:3])}. It holds the weights of another architecture: build that one "
                    "(model.name, model.kwargs), or start from a file made for this model")


def init_tensors(model: Mapping[str, Any], location: str, exclude: list[str], strict: bool,
                 options: dict | None = None) -> tuple[InitReport, dict[str, torch.Tensor]]:
    """The tensors of the file at ``location`` that a model with the state dict ``model`` (names, shapes and
    dtypes; any wrapping or sharding) loads, under its names and in its dtypes, checked as :func:`check`
    does; the report, logged. ``options``: the store's, for a URI (traincore.model.initfile)."""
    found = read_init_file(location, options)
    report = plan(model, found.tensors, exclude, location, found.sha256, found.layout)
    check(report, strict)
    log.info("%s", report.describe())
    return report, {name: found.tensors[report.prefix + name].to(model[name].dtype) for name in report.loaded}


def warm_start(model: nn.Module, location: str, exclude: list[str], strict: bool,
               options: dict | None = None) -> InitReport:
    """Load the file at ``location`` into the plain (unwrapped, unsharded) ``model`` as :func:`plan` sorts
    it; the report."""
    state = model.state_dict()
    report, tensors = init_tensors(state, location, exclude, strict, options)
    with torch.no_grad():
        for name, tensor in tensors.items():
            state[name].copy_(tensor)
    return report
