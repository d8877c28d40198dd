"""Export a checkpoint's model to one safetensors file and a JSON config beside it.

Works on every checkpoint mode in a single process with no process group: a ``sync`` checkpoint holds
the full weights; a DCP one is read with ``no_dist`` (DCP gathers every rank's part). The safetensors file
is written to a temporary name, loaded back into the model its config describes and run on a batch of
zeros; only then is it published, followed by ``lineage.json`` (traincore.artifacts.lineage) and, last, the
JSON
config (which records its sha256 and so declares the export complete). Every rename is atomic.

An export replaces only its own earlier version: the three files must be distinct (an output named
``lineage.*`` is refused), and an existing weights file, config or ``lineage.json`` at their paths must belong
to an earlier export to the same output, or the export is refused before anything is written (a
``lineage.json`` of another model in the directory, a staging's ``manifest.json``, any other file).

    python -m traincore.export --checkpoint runs/train/checkpoints --output model.safetensors
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import sys
import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from traincore.artifacts.guidance import WEIGHTS_FILE, directory_problem, inside_checkpoint, missing_problem
from traincore.artifacts.lineage import LINEAGE_FILE, Lineage, LineageError, with_run
from traincore.checkpoint import (
    MARKER,
    SELECTIONS,
    CheckpointError,
    read_checkpoint,
    read_marker,
    select_step,
    step_dir,
    verify_checkpoint,
)
from traincore.config import VALIDATION_METRICS, ModelConfig
from traincore.exitcodes import INTERRUPTED_EXIT_CODE
from traincore.files import give_default_mode, local_path_argument, publish, sha256_file, write_atomically
from traincore.model import ModelImportError, build_model, check_trusted, parameter_count


class ExportError(ValueError):
    """An export cannot be written, or an exported model is missing or does not match its config; the
    message says what to do."""


EXPORT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
"""What ``--dtype`` stores the floating-point weights as."""


@dataclass
class ExportResult:
    """Where the model went and what it is."""

    path: str
    config_path: str
    sha256: str
    num_bytes: int
    step: int
    num_parameters: int
    lineage: Lineage = field(default_factory=Lineage)  # as written to lineage.json beside the weights
    dtype: str = "float32"  # of the floating-point weights in the file
    selected: str = ""  # why this step: "the best val_accuracy (0.9620) of the checkpoints that record it"


def config_path_for(path: str | Path) -> Path:
    """The JSON config that sits beside an exported model: ``model.safetensors`` -> ``model.json``."""
    return Path(path).with_suffix(".json")


def resolve_checkpoint(checkpoint: str | Path, select: str = "best", metric: str = "val_accuracy"
                       ) -> tuple[Path, str]:
    """A step directory as given, or the one ``select`` names under a checkpoints root (``best``: by the
    validation ``metric`` its marker records, else the latest; ``latest``); and why, in words."""
    path = Path(checkpoint)
    if path.is_file():
        raise CheckpointError(f"checkpoint {path} is a file: pass a step directory (step-000123) or the "
                              "checkpoints root of a training run")
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path} does not exist: pass a step directory (step-000123) or "
                              "the checkpoints root of a training run")
    if (path / MARKER).is_file():
        return path, "the step directory given"
    step, why = select_step(path, select, metric)
    return step_dir(path, step), why


def _check_output(output: str | Path, checkpoint_dir: Path) -> Path:
    """``output`` as a Path whose directory exists and is writable; ExportError if it is a directory, is
    its own config, lies in a committed checkpoint (the one exported or any other) or would replace a file
    that is not its own earlier export (:func:`_check_targets`)."""
    if str(output).endswith(("/", os.sep)) or Path(output).is_dir():
        raise ExportError(f"output {output} is a directory: pass a file path such as "
                          f"{Path(output) / WEIGHTS_FILE}")
    output = Path(output)
    if config_path_for(output) == output:
        raise ExportError(f"output {output} is also where its JSON config goes: use a .safetensors name such "
                          f"as {output.with_suffix('.safetensors')}")
    inside = checkpoint_dir if output.resolve().is_relative_to(checkpoint_dir.resolve()) else None
    inside = inside or inside_checkpoint(output)
    if inside is not None:
        raise ExportError(f"output {output} is inside the checkpoint {inside}, which must not change once "
                          "committed (export never writes there): write the model outside the checkpoint "
                          "directory")
    _check_targets(output)
    _check_writable(output.parent, output)
    return output


def _check_targets(output: Path) -> None:
    """ExportError if the three files an export writes (the weights, their JSON config, ``lineage.json``)
    would be one file, or would replace files that are not this output's earlier export: an export
    replaces only its own earlier version, never another model's lineage or an unrelated file."""
    targets = {"model": output, "JSON config": config_path_for(output), "lineage": lineage_path_for(output)}
    resolved = {name: path.resolve() for name, path in targets.items()}
    for first, second in (("model", "lineage"), ("JSON config", "lineage"), ("model", "JSON config")):
        if resolved[first] == resolved[second]:
            raise ExportError(f"output {output}: its {first} file and its {second} file would both be "
                              f"{targets[second]}: use another name, such as "
                              f"{output.with_name(WEIGHTS_FILE)}")
    elsewhere = f"export into a directory of its own, e.g. --output {output.parent / 'export' / WEIGHTS_FILE}"
    earlier = _earlier_export(targets["JSON config"])
    for name in ("model", "JSON config"):
        path = targets[name]
        if (path.exists() or path.is_symlink()) and earlier is None:
            raise ExportError(f"output {output}: its {name} file {path} already exists and is not part of an "
                              f"earlier export to {output}, so exporting would replace it: {elsewhere}, or "
                              "move that file away")
    lineage = targets["lineage"]
    if (lineage.exists() or lineage.is_symlink()) and (earlier is None or _lineage_model(lineage) != earlier):
        raise ExportError(f"output {output}: {lineage} already exists and is not the lineage of an earlier "
                          f"export to {output} (another model exported into {output.parent}, or another "
                          f"file): {elsewhere}")


def _earlier_export(config_path: Path) -> str | None:
    """The weights' sha256 that an export config at ``config_path`` records; None if there is none."""
    try:
        config = json.loads(config_path.read_bytes())
    except (OSError, ValueError):  # missing, a directory, not JSON: no earlier export
        return None
    if not isinstance(config, dict) or not isinstance(config.get("model"), dict):
        return None
    digest = config.get("sha256")
    return digest if isinstance(digest, str) else None


def _lineage_model(path: Path) -> str | None:
    """The model sha256 a lineage.json records; None if it is not a readable lineage record."""
    try:
        return Lineage.load(path).model_sha256
    except (LineageError, OSError):
        return None


def _check_writable(directory: Path, output: Path) -> None:
    """Prove ``directory`` (or, while it does not exist, the nearest ancestor that does, where it would be
    created) writable with a probe file, before any work is done and without creating anything."""
    fix = "choose an --output in a directory you can write to"
    existing = directory
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise ExportError(f"cannot write {output}: {existing} is a file, not a directory: {fix}")
    try:
        handle, probe = tempfile.mkstemp(prefix=f".{output.name}.probe-", dir=existing)
        os.close(handle)
        os.unlink(probe)
    except OSError as exc:
        raise ExportError(f"cannot write {output}: {existing} is not writable ({exc.strerror or exc}): "
                          f"{fix}") from exc


def lineage_path_for(path: str | Path) -> Path:
    """The lineage record that sits beside an exported model: ``lineage.json`` in its directory."""
    return Path(path).with_name(LINEAGE_FILE)


def export(checkpoint: str | Path, output: str | Path, lineage: Lineage | None = None,
           trust_model: bool | str = False, dtype: str = "float32", select: str = "best",
           metric: str = "val_accuracy") -> ExportResult:
    """Consolidate the model of ``checkpoint`` into ``output`` (safetensors), its lineage and JSON config.

    ``checkpoint``: a step directory, or a checkpoints root, of which ``select`` takes the ``best`` step by
    the validation ``metric`` its commit marker records (the latest when none records it) or the
    ``latest`` (traincore.checkpoint.selection).

    ``dtype`` (:data:`EXPORT_DTYPES`): what the floating-point weights are stored as; integer tensors
    (BatchNorm's step counters) keep theirs. A model loaded from the file computes in float32 again.

    ``trust_model``: True, or the model's import path, allows rebuilding a model of an imported factory
    (``"<module>:<callable>"``), which runs its module's code (traincore.model.build.check_trusted).

    ``lineage`` holds what the checkpoint cannot know (source fingerprint, staging format, execution id,
    metric summary); the checkpoint's run record and the written weights complete it. Every input is checked
    before anything is written (the output's directory with a probe file); a failure leaves neither the
    model, nor its lineage, nor its config, nor a temporary file behind.
    """
    if dtype not in EXPORT_DTYPES:
        raise ExportError(f"dtype {dtype!r} (--dtype) is not one of {', '.join(EXPORT_DTYPES)}: choose one")
    directory, selected = resolve_checkpoint(checkpoint, select, metric)
    output = _check_output(output, directory)
    verify_checkpoint(directory)
    weights, config, meta = _read(directory)
    check_trusted(config["model"].get("name", ""), trust_model, f"checkpoint {directory}")
    tmp, config_path, lineage_path = (output.with_name(f".{output.name}.tmp"), config_path_for(output),
                                      lineage_path_for(output))
    try:
        output.parent.mkdir(parents=True, exist_ok=True)
        cast = EXPORT_DTYPES[dtype]
        save_file({name: (tensor.to(cast) if tensor.is_floating_point() else tensor).contiguous()
                   for name, tensor in weights.items()}, tmp)
        give_default_mode(tmp)  # readable as its model.json and lineage are
        config["dtype"] = dtype
        # The model is rebuilt from the written file, not from memory: what is published is what was proven.
        model = _load(tmp, config, f"checkpoint {directory}")
        _check_forward(model, config, f"checkpoint {directory}")
        config |= {"sha256": sha256_file(tmp), "num_parameters": parameter_count(model)}
        num_bytes = tmp.stat().st_size
        lineage = replace(with_run(lineage or Lineage(), meta, config["step"]), model_sha256=config["sha256"])
        publish(tmp, output)
        try:
            write_atomically(lineage_path, lineage.to_json())
            # Last: the config's sha256 declares the weights (and the lineage beside them) complete.
            write_atomically(config_path, json.dumps(config, indent=2))
        except BaseException:
            # Weights without their config must not look exported, nor a lineage without its model.
            output.unlink(missing_ok=True)
            lineage_path.unlink(missing_ok=True)
            raise
    except OSError as exc:
        where = f" ({exc.filename})" if exc.filename and str(exc.filename) != str(output) else ""
        raise ExportError(f"cannot write {output}: {exc.strerror or exc}{where}: free space or choose an "
                          "--output you can write to") from exc
    finally:
        tmp.unlink(missing_ok=True)
    return ExportResult(str(output), str(config_path), config["sha256"], num_bytes, config["step"],
                        config["num_parameters"], lineage, dtype, selected)


_UNREADABLE = (OSError, RuntimeError, ValueError, KeyError, TypeError, AttributeError, EOFError,
               pickle.UnpicklingError)
"""What reading a damaged or foreign checkpoint raises, besides the CheckpointErrors of its marker."""


def _read(directory: Path) -> tuple[dict[str, torch.Tensor], dict, dict]:
    """The checkpoint's weights, the exported model's config (without sha256 and parameter count) and the
    run record (traincore.train's ``meta``: resolved config, source, world size)."""
    redo = "export a checkpoint written by traincore.train"
    try:
        weights, extra = read_checkpoint(directory)
        meta, mode = extra["meta"], read_marker(directory)["mode"]
    except CheckpointError:
        raise
    except _UNREADABLE as exc:
        raise ExportError(f"checkpoint {directory} cannot be read ({type(exc).__name__}: {exc}): "
                          f"{redo}") from exc
    if not isinstance(meta, dict) or not isinstance(weights, dict):
        raise ExportError(f"checkpoint {directory} holds no model weights and run record: {redo}")
    missing = [key for key in ("config", "num_classes", "shape") if key not in meta]
    if missing:
        raise ExportError(f"checkpoint {directory} records no {', '.join(missing)} of its run, so the model "
                          f"cannot be rebuilt: {redo}")
    model = meta["config"].get("model") if isinstance(meta["config"], dict) else None
    if not isinstance(model, dict):
        raise ExportError(f"checkpoint {directory} records no model config of its run: {redo}")
    return weights, {"model": model, "num_classes": meta["num_classes"], "shape": list(meta["shape"]),
                     "classes": meta.get("classes"), "mean": meta.get("mean"), "std": meta.get("std"),
                     "step": extra["step"], "checkpoint": str(directory), "checkpoint_mode": mode}, meta


def _load(path: Path, config: dict, source: str) -> nn.Module:
    """The model ``config`` describes, with the weights in ``path``, in eval mode."""
    again = "export again from a checkpoint written by this version of traincore"
    try:
        model = build_model(ModelConfig(**config["model"]), config["num_classes"], tuple(config["shape"]))
    except (ValueError, TypeError, KeyError) as exc:  # ConfigError is a ValueError
        raise ExportError(f"the model config of {source} cannot be built ({exc}): {again}") from exc
    try:
        state = load_file(path)
    except SafetensorError as exc:
        raise ExportError(f"{path} is not a safetensors file ({exc}): pass a model.safetensors written by "
                          "python -m traincore.export") from exc
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as exc:
        raise ExportError(f"the weights of {source} do not fit the model its config describes ({exc}): "
                          f"{again}") from exc
    return model.eval()


def _check_forward(model: nn.Module, config: dict, source: str) -> None:
    """ExportError unless ``model`` maps 2 zero inputs of the config's shape to (2, num_classes) logits."""
    expected = (2, config["num_classes"])
    try:
        with torch.inference_mode():
            shape = tuple(model(torch.zeros(2, *config["shape"])).shape)
    except RuntimeError as exc:
        raise ExportError(f"the model of {source} fails on a batch of 2 inputs of shape "
                          f"{tuple(config['shape'])} ({exc}): its meta (config, shape) does not describe the "
                          "trained model") from exc
    if shape != expected:
        raise ExportError(f"the model of {source} maps a batch of 2 to logits of shape {shape}, expected "
                          f"{expected}: its meta (config, num_classes) does not describe the trained model")


def load_exported(path: str | Path, trust_model: bool | str = False) -> tuple[nn.Module, dict]:
    """The exported model (eval mode) and its JSON config; ExportError naming the file and the fix if either
    is missing, damaged or not what traincore.export writes, or if the file's sha256 differs.
    ``trust_model``: as for :func:`export`; refused before any of the model's code is imported."""
    path, config_path = Path(path), config_path_for(path)
    config = check_exported(path)
    check_trusted(config["model"].get("name", ""), trust_model, f"exported model {path}")
    digest = sha256_file(path)
    if digest != config["sha256"]:
        raise ExportError(f"{path} has sha256 {digest[:16]}..., but {config_path} records "
                          f"{config['sha256'][:16]}...: the file is corrupt or was replaced; export it again")
    return _load(path, config, str(path)), config


def check_exported(path: str | Path) -> dict:
    """The JSON config of the exported model at ``path``, read without its tensors or its code: ExportError
    naming the file and the fix unless both files are there, the config complete and the weights file starts
    as a safetensors file (a cheap check of a model given as an input, before anything trains)."""
    path, config_path = Path(path), config_path_for(path)
    again = f"export it again: python -m traincore.export --checkpoint DIR --output {path}"
    if path.is_dir():
        raise ExportError(directory_problem(path))
    if config_path == path:
        raise ExportError(f"model {path} is the JSON config of an export: pass the weights file beside it, "
                          f"e.g. {path.with_suffix('.safetensors')}")
    if not path.is_file() or not config_path.is_file():
        raise ExportError(missing_problem(path, config_path))
    config = _read_config(config_path, again)
    _check_safetensors(path)
    return config


def _read_config(config_path: Path, again: str) -> dict:
    """An export's JSON config, checked for the keys that rebuild and verify the model."""
    try:
        config = json.loads(config_path.read_bytes())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ExportError(f"model config {config_path} is not valid JSON ({exc}): it is truncated or was "
                          f"edited; {again}") from exc
    if not isinstance(config, dict):
        raise ExportError(f"model config {config_path} holds a JSON {type(config).__name__}, not an object: "
                          f"{again}")
    expected = {"sha256": (str, "a sha256 string"), "model": (dict, "an object"),
                "num_classes": (int, "an integer"), "shape": (list, "[C, H, W]")}
    for key, (kind, what) in expected.items():
        if not isinstance(config.get(key), kind) or isinstance(config.get(key), bool):
            raise ExportError(f"model config {config_path} has {key}={config.get(key)!r}, expected {what}: "
                              f"{again}")
    return config


def _check_safetensors(path: Path) -> None:
    """ExportError unless ``path`` starts like a safetensors file: an 8-byte header length, then a JSON object
    that fits in the file."""
    with open(path, "rb") as handle:
        head = handle.read(9)
    size = path.stat().st_size
    length = int.from_bytes(head[:8], "little") if len(head) == 9 else -1
    if not (0 < length <= size - 8 and head[8:9] == b"{"):
        raise ExportError(f"{path} is not a safetensors file (no safetensors header): pass the "
                          "model.safetensors written by python -m traincore.export")


def add_trust_flags(parser: argparse.ArgumentParser) -> None:
    """The flags that allow rebuilding a model of an imported factory
    (traincore.model.build.check_trusted)."""
    parser.add_argument("--trust-model-code", action="store_true",
                        help="allow rebuilding a model whose config names an imported factory "
                             "(\"<module>:<callable>\"): that module's code runs")
    parser.add_argument("--model-name", default=None,
                        help="allow it for this import path only: the model.name the run trained with")


def trust_from_args(args: argparse.Namespace) -> bool | str:
    """What :func:`add_trust_flags`' flags allow: True, an import path, or nothing (False)."""
    return True if args.trust_model_code else (args.model_name or False)


def main(argv: list[str] | None = None) -> int:
    """CLI: export and print one summary line; exit code 2 for a missing or unusable checkpoint, 130 and one
    line when interrupted."""
    parser = argparse.ArgumentParser(prog="python -m traincore.export", description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", required=True, type=local_path_argument,
                        help="a step directory or a checkpoints root")
    parser.add_argument("--output", required=True, type=local_path_argument,
                        help="where to write model.safetensors")
    parser.add_argument("--dtype", default="float32", choices=list(EXPORT_DTYPES),
                        help="what the floating-point weights are stored as (default float32)")
    parser.add_argument("--select", default="best", choices=list(SELECTIONS),
                        help="of a checkpoints root: the best step by --metric (default; the latest when no "
                             "step was validated) or the latest")
    parser.add_argument("--metric", default="val_accuracy", choices=list(VALIDATION_METRICS),
                        help="what --select best ranks by (default val_accuracy)")
    add_trust_flags(parser)
    args = parser.parse_args(argv)
    try:
        result = export(args.checkpoint, args.output, trust_model=trust_from_args(args), dtype=args.dtype,
                        select=args.select, metric=args.metric)
    # OSError: raised outside export's own checks
    except (CheckpointError, ExportError, ModelImportError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # export() removed what it had written
        print(f"interrupted: no model was exported to {args.output}", file=sys.stderr)
        return INTERRUPTED_EXIT_CODE
    print(f"exported {result.path} ({result.num_bytes / 1e6:.2f} MB, {result.dtype}, sha256 "
          f"{result.sha256[:12]}, step {result.step}, {result.num_parameters:,} parameters): step "
          f"{result.step} is {result.selected}")
    return 0

