"""Export a checkpoint's model to one safetensors file and a JSON config beside it.

Works on every checkpoint mode in a single process with no process group: a ``sync`` checkpoint holds
the full weights; a DCP one is read with ``no_dist`` (DCP gathers every rank's part). The safetensors file
and then the JSON (which records the file's sha256) are published atomically, then loaded back with
:func:`load_exported` to prove they work.

    python -m traincore.export --checkpoint runs/train/checkpoints --output model.safetensors
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

from safetensors.torch import load_file, save_file
from torch import nn

from traincore.checkpoint_files import (
    MARKER,
    CheckpointError,
    latest_complete,
    publish,
    read_checkpoint,
    read_marker,
    sha256_file,
    verify_checkpoint,
)
from traincore.config import ModelConfig
from traincore.models import build_model, parameter_count


class ExportError(ValueError):
    """An exported model is missing or does not match its config; the message says what to do."""


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
        raise CheckpointError(f"{path} holds no complete checkpoint (no step-* directory with a commit marker): "
                              "pass the checkpoints root of a run that saved at least once")
    return latest


def export(checkpoint: str | Path, output: str | Path) -> ExportResult:
    """Consolidate the model of ``checkpoint`` into ``output`` (safetensors) plus its JSON config."""
    directory = resolve_checkpoint(checkpoint)
    verify_checkpoint(directory)
    weights, extra = read_checkpoint(directory)
    meta = extra["meta"]
    missing = [key for key in ("config", "num_classes", "shape") if key not in meta]
    if missing:
        raise ExportError(f"checkpoint {directory} has no {', '.join(missing)} in its meta, so the model cannot "
                          "be rebuilt: save TrainState.meta with config, num_classes and shape")
    model = _build(meta["config"]["model"], meta["num_classes"], meta["shape"])
    model.load_state_dict(weights, strict=True)  # fails here, before anything is published
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = output.with_name(f".{output.name}.tmp")
    save_file({name: tensor.contiguous() for name, tensor in weights.items()}, tmp)
    publish(tmp, output)
    config = {"model": meta["config"]["model"], "num_classes": meta["num_classes"], "shape": list(meta["shape"]),
              "classes": meta.get("classes"), "mean": meta.get("mean"), "std": meta.get("std"),
              "step": extra["step"], "sha256": sha256_file(output), "num_parameters": parameter_count(model),
              "checkpoint": str(directory), "checkpoint_mode": read_marker(directory)["mode"]}
    config_path = config_path_for(output)
    tmp = config_path.with_name(f".{config_path.name}.tmp")
    tmp.write_text(json.dumps(config, indent=2))
    publish(tmp, config_path)
    load_exported(output)
    return ExportResult(str(output), str(config_path), config["sha256"], output.stat().st_size, config["step"],
                        config["num_parameters"])


def _build(model_cfg: dict, num_classes: int, shape: list[int]) -> nn.Module:
    return build_model(ModelConfig(**model_cfg), num_classes, tuple(shape))


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
    model = _build(config["model"], config["num_classes"], config["shape"])
    model.load_state_dict(load_file(path), strict=True)
    return model.eval(), config


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
