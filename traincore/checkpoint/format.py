"""What a step directory holds, version by version, read into one shape: the registry's state.

Version 3 (written): the state registry's shared members and every rank's per-rank members.
    sync         ``state.pt``  = {"step", "shared", "per_rank"} (torch.save, rank 0)
    dcp / async  DCP files     = the shared state's tensors that sit in nested dicts (DCP names them by path,
                                 joined with "."), written by every rank for its part
                 ``extra.pt``  = {"step", "shared" without those tensors, "per_rank"}
Version 2 (read): ``model`` / ``optim`` tensors plus an ``extra`` dict of step, meta, loader, scheduler,
param groups and per-rank RNG; :func:`_from_v2` maps it onto version 3's member names.

Only tensors go through DCP, so reading never unpickles anything outside ``torch.load(weights_only=True)``
(and DCP's ``.metadata``, through an allow-list). DCP itself (:mod:`traincore.checkpoint.dcp`) is imported
only where a DCP directory is read: a ``sync`` checkpoint is read without it.
A file that cannot be read, or holds something else than its version's layout, raises CorruptCheckpointError
naming the file.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from traincore.checkpoint.commit import read_marker
from traincore.checkpoint.errors import CorruptCheckpointError
from traincore.checkpoint.layout import EXTRA_FILE, STATE_FILE
from traincore.checkpoint.store import Store, as_store, read_stream

# Where version 2 kept the tensors that version 3 keeps under these member paths.
_V2_TENSORS = {"model": ("model",), "optim": ("optimizer", "state")}


def split_tensors(tree: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(tensors, rest): tensors found through nested dicts, and the tree without them."""
    tensors: dict[str, Any] = {}
    rest: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, torch.Tensor):
            tensors[key] = value
        elif isinstance(value, dict):
            inner, rest[key] = split_tensors(value)
            if inner:
                tensors[key] = inner
        else:
            rest[key] = value
    return tensors, rest


def merge(rest: dict[str, Any], tensors: dict[str, Any]) -> dict[str, Any]:
    """The inverse of :func:`split_tensors`."""
    merged = dict(rest)
    for key, value in tensors.items():
        merged[key] = merge(merged.get(key, {}), value) if isinstance(value, dict) else value
    return merged


def flat_shapes(tensors: dict[str, Any], prefix: str = "") -> dict[str, list[int]]:
    """Shapes of a nested tensor dict under DCP's flattened names (``model.net.1.weight``)."""
    shapes: dict[str, list[int]] = {}
    for key, value in tensors.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            shapes.update(flat_shapes(value, f"{name}."))
        else:
            shapes[name] = list(value.shape)
    return shapes


def load_file(directory: str | Path | Store, name: str) -> Any:
    """A torch.save file of a step directory (local: memory-mapped), restricted to weights_only;
    CorruptCheckpointError naming the file when it is missing or torch.load cannot read it."""
    store = as_store(directory)
    path = store.uri_of(name)
    try:
        if store.local:
            return torch.load(store.path / name, map_location="cpu", weights_only=True, mmap=True)
        return torch.load(read_stream(store, name), map_location="cpu", weights_only=True)
    except FileNotFoundError as exc:
        raise CorruptCheckpointError(f"checkpoint file {path} is missing: resume from another step, or "
                                     f"delete {store}") from exc
    except Exception as exc:  # torch.load's reader reports a damaged or foreign file as whatever it hit
        raise CorruptCheckpointError(
            f"checkpoint file {path} cannot be read by torch.load ({type(exc).__name__}, chained): it is "
            f"damaged or was not written by traincore: resume from another step, or delete "
            f"{store}") from exc


@dataclass
class SavedState:
    """A step directory's content in version-3 terms; DCP tensors arrive with :func:`load_tensors`."""

    step: int
    shared: dict[str, Any]
    per_rank: list[dict[str, Any]]
    shapes: dict[str, list[int]]  # every saved tensor of the shared state, by flattened name


def open_saved(directory: str | Path | Store, marker: dict) -> SavedState:
    """Read everything but the DCP tensors (a sync checkpoint is read whole; locally memory-mapped)."""
    directory = as_store(directory)
    if marker["format"] == "torch_save":
        path = directory.uri_of(STATE_FILE)
        saved = load_file(directory, STATE_FILE)
        if marker["format_version"] == 2:
            _check_layout(saved, path, {"extra": dict, "model": dict, "optim": dict})
            saved = _v2_or_corrupt(path, saved["extra"], saved["model"], saved["optim"])
        _check_layout(saved, path, {"step": int, "shared": dict, "per_rank": list})
        shapes = flat_shapes(split_tensors(saved["shared"])[0])
        return SavedState(saved["step"], saved["shared"], saved["per_rank"], shapes)
    from traincore.checkpoint.dcp import tensor_index

    path = directory.uri_of(EXTRA_FILE)
    extra = load_file(directory, EXTRA_FILE)
    shapes = {key: list(md.size) for key, md in tensor_index(directory).items()}
    if marker["format_version"] == 2:
        _check_layout(extra, path, {})
        extra = _v2_or_corrupt(path, extra, {}, {})
        shapes = {_v3_name(key): shape for key, shape in shapes.items()}
    _check_layout(extra, path, {"step": int, "shared": dict, "per_rank": list})
    return SavedState(extra["step"], extra["shared"], extra["per_rank"], shapes)


def _check_layout(saved: Any, path: str, fields: dict[str, type]) -> None:
    """CorruptCheckpointError unless ``saved`` is a dict with ``fields`` of those types."""
    if not isinstance(saved, dict):
        wrong = [f"it holds a {type(saved).__name__}, not a dict"]
    else:
        wrong = [f"{key} is {type(saved[key]).__name__ if key in saved else 'absent'}"
                 for key, kind in fields.items() if not isinstance(saved.get(key), kind)]
    if wrong:
        expected = ", ".join(f"{key}: {kind.__name__}" for key, kind in fields.items()) or "a dict"
        raise CorruptCheckpointError(f"checkpoint file {path} does not hold a traincore checkpoint's layout "
                                     f"({expected}); wrong: {', '.join(wrong)}: it was not written by "
                                     f"traincore: resume from another step, or delete "
                                     f"{path.rsplit('/', 1)[0]}")


def _v2_or_corrupt(path: str, extra: dict, model: dict, optim: dict) -> dict[str, Any]:
    try:
        return _from_v2(extra, model, optim)
    except (KeyError, TypeError) as exc:
        raise CorruptCheckpointError(f"checkpoint file {path} lacks {exc} of a version-2 checkpoint: resume "
                                     f"from another step, or delete {path.rsplit('/', 1)[0]}") from exc


def load_tensors(saved: SavedState, directory: Store, marker: dict, template: dict[str, Any],
                 process_group: Any = None) -> None:
    """Fill ``template`` (the run's own tensors, resharded by DCP) and merge it into ``saved.shared``."""
    if marker["format"] == "torch_save":
        return
    state = template
    if marker["format_version"] == 2:
        state = {old: _get_path(template, path) for old, path in _V2_TENSORS.items()}
    from traincore.checkpoint.dcp import load_into

    load_into(state, directory, process_group)
    saved.shared = merge(saved.shared, template)


def read_checkpoint(directory: str | Path | Store) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Model weights and ``{"step", "meta"}`` of one step directory (local or in an object store), in this
    process alone (export). The weights are the run's average (``ema``, optim.ema_decay) when it kept one,
    else the live ``model``'s."""
    directory = as_store(directory)
    marker = read_marker(directory)
    saved = open_saved(directory, marker)
    member = "ema" if "ema" in saved.shared else "model"
    if marker["format"] == "dcp":
        template = {member: {key.removeprefix(f"{member}."): torch.empty(shape, dtype=dtype)
                             for key, (shape, dtype) in _dcp_entries(directory, member).items()}}
        load_tensors(saved, directory, marker, template)
    return saved.shared[member], {"step": saved.step, "meta": saved.shared.get("run", {})}


def _dcp_entries(directory: Store, member: str) -> dict[str, tuple[list[int], torch.dtype]]:
    from traincore.checkpoint.dcp import tensor_index

    return {key: (list(md.size), md.properties.dtype) for key, md in tensor_index(directory).items()
            if key.startswith(f"{member}.")}


def _get_path(tree: dict[str, Any], path: tuple[str, ...]) -> Any:
    for key in path:
        tree = tree.get(key, {})
    return tree


def _v3_name(v2_name: str) -> str:
    head, _, tail = v2_name.partition(".")
    return ".".join((*_V2_TENSORS.get(head, (head,)), tail))


def _from_v2(extra: dict[str, Any], model: dict[str, Any], optim: dict[str, Any]) -> dict[str, Any]:
    """A version-2 checkpoint's content under version 3's member names."""
    shared = {"run": extra["meta"], "progress": {"step": extra["step"]}, "model": model,
              "optimizer": {"state": optim, "param_groups": extra["param_groups"]},
              "scheduler": extra["scheduler"], "loader": extra["loader"]}
    return {"step": extra["step"], "shared": shared, "per_rank": [{"rng": rng} for rng in extra["rng"]]}
