"""Reading ``model.init_from``: where the file is, what it holds, and (for preflight) only its header.

The file is read through the checkpoint store layer (:class:`traincore.checkpoint.Store`): a path, or an
object-store URI read with the options of the run's checkpoint root when both are in the same kind of
store (the credentials and endpoint a task configured), else with the store's own defaults (for s3://: the
``AWS_*`` environment, ``~/.aws``, an instance role). Missing credentials, an unreachable endpoint, a
missing object and a directory in place of a file are each one InitError naming the location and the fix.

What it holds: a state dict (tensor names to tensors) at the top level, or, in a training script's
checkpoint, under exactly one of :data:`STATE_KEYS` (torchvision's reference scripts save
``{"model": ..., "optimizer": ..., "epoch": ...}``, Lightning ``{"state_dict": ..., "epoch": ...}``). Any
other layout is refused with its top-level keys listed.

Preflight reads only the header (:func:`read_init_header`): a safetensors file's JSON header (two ranged
reads, local or remote), a local torch file memory-mapped (its pickle read, no tensor data). A torch file in
an object store has no header to read apart from its data: preflight checks that it is there, and each
worker checks its tensors as it loads them.
"""

from __future__ import annotations

import hashlib
import io
import json
import pickle
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

import torch

from traincore.checkpoint import MARKER, STORE_ACCESS_FIX, Store, error_reason, is_uri, parse_step_name

SUFFIXES = (".safetensors", ".pt", ".pth")
STATE_KEYS = ("model", "state_dict", "model_state_dict", "module", "ema", "model_ema", "state_dict_ema")
"""Where training scripts keep the model's state dict inside their checkpoints."""
FORMATS = "a safetensors file or a torch state-dict file (.pt / .pth)"
_HEADER_LIMIT = 100 * 2**20  # safetensors refuses JSON headers larger than this
_SAFETENSORS_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
                       "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8",
                       "U16": "uint16", "U32": "uint32", "U64": "uint64", "BOOL": "bool",
                       "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}


class InitError(ValueError):
    """``model.init_from`` cannot be read or does not fit the model; the message names the file, the tensors
    and the fix."""


@dataclass(frozen=True)
class TensorSpec:
    """A tensor as a file's header describes it (``dtype`` a string where torch has no such dtype)."""

    shape: tuple[int, ...]
    dtype: torch.dtype | str


@dataclass
class InitFile:
    """What ``model.init_from`` holds: tensors by name (or their :class:`TensorSpec`, read from the header),
    its sha256 (empty when only the header was read) and where in the file the state dict was found."""

    tensors: dict[str, Any]
    sha256: str = ""
    layout: str = ""


def store_options(location: str, root: Store | None) -> dict:
    """The fsspec options to read ``location`` with: those of the run's checkpoint ``root`` when both are in
    the same kind of object store, else none (the store's own defaults apply)."""
    if root is None or root.local or not is_uri(location):
        return {}
    return dict(root.options) if location.split("://", 1)[0] == root.uri.split("://", 1)[0] else {}


def read_init_file(location: str, options: dict | None = None) -> InitFile:
    """The state dict in the file at ``location`` (a path or an object-store URI, read with ``options``),
    its sha256 and where in the file it was."""
    store, name, suffix = _locate(location, options)
    with _reading(location):
        try:
            data = store.read_bytes(name)
        except (FileNotFoundError, IsADirectoryError):
            raise _absent(location, store, name) from None
    with _reading(location), _parsing(location):
        if suffix == ".safetensors":
            from safetensors.torch import load

            loaded = load(data)
        else:
            loaded = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    tensors, layout = _state_of(location, loaded)
    return InitFile(tensors, hashlib.sha256(data).hexdigest(), layout)


def read_init_header(location: str, options: dict | None = None) -> InitFile | None:
    """The names, shapes and dtypes of the file at ``location`` without reading its tensors; None for a
    torch file in an object store (whose names come only with its data), after checking it is there."""
    store, name, suffix = _locate(location, options)
    with _reading(location):
        size = store.size(name)
        if size is None:
            raise _absent(location, store, name)
        if suffix == ".safetensors":
            return InitFile(_safetensors_header(location, store, name, size))
    if not store.local:
        return None
    path = store.path / name
    with _reading(location), _parsing(location):  # the legacy (pre-zip) format cannot be memory-mapped
        loaded = torch.load(path, map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(path))
    tensors, layout = _state_of(location, loaded)
    return InitFile({key: TensorSpec(tuple(value.shape), value.dtype) for key, value in tensors.items()},
                    layout=layout)


def _state_of(location: str, loaded: Any) -> tuple[dict[str, Any], str]:
    """The state dict in what the file at ``location`` holds, and where it was (empty: the top level)."""
    if _is_state(loaded):
        return dict(loaded), ""
    if not isinstance(loaded, dict):
        raise InitError(f"model.init_from={location!r} holds a {type(loaded).__name__}, not a state dict (a "
                        "mapping of tensor names to tensors): save model.state_dict() in "
                        f"{FORMATS} and pass that")
    found = [key for key in STATE_KEYS if _is_state(loaded.get(key))]
    if len(found) == 1:
        others = [str(key) for key in loaded if key != found[0]]
        return dict(loaded[found[0]]), (f"the state dict under {found[0]!r}"
                                         + (f", beside {', '.join(others)}" if others else ""))
    contents = ", ".join(f"{key!r} ({_kind(value)})" for key, value in list(loaded.items())[:8])
    contents += f", and {len(loaded) - 8} more" if len(loaded) > 8 else ""
    if found:
        raise InitError(f"model.init_from={location!r} holds several state dicts, under "
                        f"{' and '.join(map(repr, found))} (its top-level keys: {contents}): save the one to "
                        "start from alone, e.g. "
                        f"torch.save(torch.load(FILE, weights_only=True)[{found[0]!r}], 'weights.pt'), and "
                        "pass that file")
    raise InitError(f"model.init_from={location!r} holds no state dict: its top-level keys are "
                    f"{contents or '(none)'}, and none of {', '.join(STATE_KEYS)} holds a mapping of tensor "
                    "names to tensors: save the model's state dict alone, "
                    "torch.save(model.state_dict(), 'weights.pt'), and pass that file")


def _is_state(value: Any) -> bool:
    return (isinstance(value, dict) and bool(value)
            and all(isinstance(key, str) and isinstance(item, torch.Tensor) for key, item in value.items()))


def _kind(value: Any) -> str:
    if _is_state(value):
        return f"{len(value)} tensors"
    if isinstance(value, dict):
        return f"a dict of {len(value)}"
    return type(value).__name__


def _locate(location: str, options: dict | None) -> tuple[Store, str, str]:
    """The store holding the file at ``location``, the file's name there and its suffix; InitError for a
    directory or a file of another kind."""
    with _reading(location):
        if is_uri(location):
            parent, _, name = location.rstrip("/").rpartition("/")
            store = Store(parent, options)
        else:
            path = Path(location.removeprefix("file://"))
            store, name = Store(path.parent), path.name
            if path.is_dir():
                raise _absent(location, store, name)
    suffix = PurePosixPath(name).suffix
    if suffix not in SUFFIXES:
        with _reading(location):
            problem = _directory_problem(location, store.child(name))
        raise InitError(problem or f"model.init_from={location!r}: a {suffix or 'suffix-less'} file is "
                                   f"neither safetensors nor a torch state dict: pass {FORMATS}")
    return store, name, suffix


def _absent(location: str, store: Store, name: str) -> InitError:
    """The error for a ``location`` where no file is: a directory's problem, or that nothing is there."""
    return InitError(_directory_problem(location, store.child(name)) or _missing(location))


def _missing(location: str) -> str:
    return f"model.init_from={location!r} does not exist: pass the path or URI of the weights to start from"


def _directory_problem(location: str, directory: Store) -> str | None:
    """What to pass instead when ``location`` is a directory (a training checkpoint, an export), or None."""
    entries = directory.entries()
    if not entries and not (directory.local and directory.path.is_dir()):
        return None
    if MARKER in entries or any(parse_step_name(name) is not None for name in entries):
        return (f"model.init_from={location!r} is a training checkpoint, not a weights file: export it with "
                f"`python -m traincore.export --checkpoint {location} --output model.safetensors` and pass "
                "that file (a run that continues it resumes from its checkpoint root instead)")
    weights = sorted(name for name, kind in entries.items()
                     if kind == "file" and Path(name).suffix in SUFFIXES)
    if weights:
        return (f"model.init_from={location!r} is a directory: pass the weights file in it, e.g. "
                f"{directory.uri_of(weights[0])}")
    return f"model.init_from={location!r} is a directory and holds no weights file: pass {FORMATS}"


def _safetensors_header(location: str, store: Store, name: str, size: int) -> dict[str, TensorSpec]:
    """The tensors a safetensors file's JSON header describes; InitError when the header is damaged or the
    file is shorter or longer than the header says (an interrupted download)."""
    damaged = InitError(f"model.init_from={location!r} is not a readable safetensors file (its header is "
                        f"damaged): fetch or export it again, or pass {FORMATS}")
    (head,) = store.read_ranges([(name, 0, 8)])
    length = int.from_bytes(head, "little") if len(head) == 8 else 0
    if not 0 < length <= min(size - 8, _HEADER_LIMIT):
        raise damaged
    (raw,) = store.read_ranges([(name, 8, length)])
    try:
        header = json.loads(raw)
        header.pop("__metadata__", None)
        specs = {key: TensorSpec(tuple(int(d) for d in entry["shape"]),
                                 getattr(torch, _SAFETENSORS_DTYPES.get(entry["dtype"], ""), None)
                                 or str(entry["dtype"])) for key, entry in header.items()}
        end = max((int(entry["data_offsets"][1]) for entry in header.values()), default=0)
    except (ValueError, TypeError, KeyError, IndexError, AttributeError) as exc:
        raise damaged from exc
    if 8 + length + end != size:
        raise InitError(f"model.init_from={location!r} holds {size} bytes, but its header describes "
                        f"{8 + length + end}: the file is truncated or damaged (an interrupted copy?): fetch "
                        "or export it again")
    return specs


@contextmanager
def _reading(location: str) -> Iterator[None]:
    """Errors of the store or filesystem while reading ``location`` as one InitError naming it and the fix."""
    try:
        yield
    except InitError:
        raise
    except FileNotFoundError as exc:
        raise InitError(_missing(location)) from exc
    except Exception as exc:  # botocore, gcsfs and adlfs raise their own classes for credentials and network
        fix = "check the path and its permissions" if not is_uri(location) else STORE_ACCESS_FIX
        raise InitError(f"model.init_from={location!r} cannot be read ({error_reason(exc)}): {fix}") from exc


@contextmanager
def _parsing(location: str) -> Iterator[None]:
    """A reader's failure on the file's bytes as one InitError: pickled objects that weights_only refuses
    (a whole model saved with ``torch.save(model)``), or a damaged file."""
    try:
        yield
    except OSError:  # the file could not be read at all: _reading says so
        raise
    except Exception as exc:  # each reader reports a damaged file as whatever it hit
        if isinstance(exc, pickle.UnpicklingError) and "Weights only load failed" in str(exc):
            detail = next((line.strip() for line in str(exc).splitlines() if "Unsupported global" in line),
                          error_reason(exc))
            raise InitError(f"model.init_from={location!r} holds pickled objects other than tensors, which "
                            f"loading with weights_only refuses ({detail}): a whole model saved with "
                            "torch.save(model), or a checkpoint with classes of its own; save the model's "
                            "state dict alone, torch.save(model.state_dict(), 'weights.pt'), and pass that "
                            "file") from exc
        raise InitError(f"model.init_from={location!r} cannot be read ({error_reason(exc)}): it is damaged, "
                        f"or not what its suffix says: pass {FORMATS}") from exc


