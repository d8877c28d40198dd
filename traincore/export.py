"""Export a checkpoint's model to one safetensors file and a JSON config beside it.

Works on every checkpoint mode in a single process with no process group: a ``sync`` checkpoint holds
the full weights; a DCP one is read with ``no_dist`` (DCP gathers every rank's part). The safetensors file
is written to a temporary name, loaded back into the model its config describes and run on a batch of
zeros; only then is it published, followed by the JSON (which records its sha256). Both renames are atomic.

    python -m traincore.export --checkpoint runs/train/checkpoints --output model.safetensors
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from traincore.checkpoint_files import (
    MARKER,
    CheckpointError,
    latest_complete,
    publish,
    read_marker,
    sha256_file,
    verify_checkpoint,
)
from traincore.checkpoint_format import read_checkpoint
from traincore.config import ModelConfig
from traincore.models import build_model, parameter_count

WEIGHTS_FILE = "model.safetensors"  # the name an export directory holds the weights under


class ExportError(ValueError):
    """An export cannot be written, or an exported model is missing or does not match its config; the
    message says what to do."""


@dataclass
class ExportResult:
    """Where the model went and what it is."""

    path: str
    config_path: str
    sha256: str
    num_bytes: int
    step: int
    num_parameters: int


def config_path_for(path: str | Path) -> Path:
    """The JSON config that sits beside an exported model: ``model.safetensors`` -> ``model.json``."""
    return Path(path).with_suffix(".json")


def resolve_checkpoint(checkpoint: str | Path) -> Path:
    """A step directory as given, or the latest complete one under a checkpoints root."""
    path = Path(checkpoint)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path} does not exist: pass a step directory (step-000123) or "
                              "the checkpoints root of a training run")
    if (path / MARKER).is_file():
        return path
    latest = latest_complete(path)
    if latest is None:
        raise CheckpointError(f"{path} holds no complete checkpoint (no step-* directory with a commit "
                              "marker): pass the checkpoints root of a run that saved at least once")
    return latest


def _check_output(output: str | Path, checkpoint_dir: Path) -> Path:
    """``output`` as a Path; ExportError if it is a directory, is its own config or lies in the checkpoint."""
    output = Path(output)
    if output.is_dir():
        raise ExportError(f"output {output} is a directory: pass a file path such as {output / WEIGHTS_FILE}")
    if config_path_for(output) == output:
        raise ExportError(f"output {output} is also where its JSON config goes: use a .safetensors name such "
                          f"as {output.with_suffix('.safetensors')}")
    if output.resolve().is_relative_to(checkpoint_dir.resolve()):
        raise ExportError(f"output {output} is inside the checkpoint {checkpoint_dir} being exported, which "
                          "must not change once committed: write the model outside the checkpoint directory")
    return output


def export(checkpoint: str | Path, output: str | Path) -> ExportResult:
    """Consolidate the model of ``checkpoint`` into ``output`` (safetensors) plus its JSON config."""
    directory = resolve_checkpoint(checkpoint)
    output = _check_output(output, directory)
    verify_checkpoint(directory)
    weights, extra = read_checkpoint(directory)
    meta = extra["meta"]
    missing = [key for key in ("config", "num_classes", "shape") if key not in meta]
    if missing:
        raise ExportError(f"checkpoint {directory} records no {', '.join(missing)} of its run, so the model "
                          "cannot be rebuilt: export a checkpoint written by traincore.train")
    config = {"model": meta["config"]["model"], "num_classes": meta["num_classes"],
              "shape": list(meta["shape"]), "classes": meta.get("classes"), "mean": meta.get("mean"),
              "std": meta.get("std"), "step": extra["step"], "checkpoint": str(directory),
              "checkpoint_mode": read_marker(directory)["mode"]}
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = output.with_name(f".{output.name}.tmp")
    try:
        save_file({name: tensor.contiguous() for name, tensor in weights.items()}, tmp)
        # The model is rebuilt from the written file, not from memory: what is published is what was proven.
        model = _load(tmp, config, f"checkpoint {directory}")
        _check_forward(model, config, f"checkpoint {directory}")
        config |= {"sha256": sha256_file(tmp), "num_parameters": parameter_count(model)}
        num_bytes = tmp.stat().st_size
        publish(tmp, output)
    finally:
        tmp.unlink(missing_ok=True)
    config_path = config_path_for(output)
    _publish_json(config, config_path)  # last: the config's sha256 declares the weights complete
    return ExportResult(str(output), str(config_path), config["sha256"], num_bytes, config["step"],
                        config["num_parameters"])


def _publish_json(data: dict, path: Path) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        tmp.write_text(json.dumps(data, indent=2))
        publish(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _load(path: Path, config: dict, source: str) -> nn.Module:
    """The model ``config`` describes, with the weights in ``path``, in eval mode."""
    model = build_model(ModelConfig(**config["model"]), config["num_classes"], tuple(config["shape"]))
    try:
        model.load_state_dict(load_file(path), strict=True)
    except RuntimeError as exc:
        raise ExportError(f"the weights of {source} do not fit the model its config describes ({exc}): "
                          "export again from a checkpoint written by this version of traincore") from exc
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


def load_exported(path: str | Path) -> tuple[nn.Module, dict]:
    """The exported model (eval mode) and its JSON config; ExportError if the file's sha256 differs."""
    path, config_path = Path(path), config_path_for(path)
    if not path.is_file() or not config_path.is_file():
        raise ExportError(f"exported model {path} or its config {config_path} is missing: run "
                          f"python -m traincore.export --checkpoint DIR --output {path}")
    config = json.loads(config_path.read_text())
    digest = sha256_file(path)
    if digest != config["sha256"]:
        raise ExportError(f"{path} has sha256 {digest[:16]}..., but {config_path} records "
                          f"{config['sha256'][:16]}...: the file is corrupt or was replaced; export it again")
    return _load(path, config, str(path)), config


def main(argv: list[str] | None = None) -> int:
    """CLI: export and print one summary line; exit code 2 for a missing or unusable checkpoint."""
    parser = argparse.ArgumentParser(prog="python -m traincore.export", description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", required=True, help="a step directory or a checkpoints root")
    parser.add_argument("--output", required=True, help="where to write model.safetensors")
    args = parser.parse_args(argv)
    try:
        result = export(args.checkpoint, args.output)
    except (CheckpointError, ExportError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"exported {result.path} ({result.num_bytes / 1e6:.2f} MB, sha256 {result.sha256[:12]}, "
          f"step {result.step}, {result.num_parameters:,} parameters)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
