"""Export the latest complete checkpoint to a single safetensors file and prove that it loads."""

from __future__ import annotations

from pathlib import Path

import flytekit
import torch
from flytekit import Resources, task
from flytekit.types.directory import FlyteDirectory

from tasks.storage import local_directory
from tasks.types import ModelArtifact, TrainResult
from traincore.export import ExportResult, export, load_exported

WEIGHTS_FILE = "model.safetensors"


def verify_export(result: ExportResult) -> None:
    """Load the file back (its sha256 is checked) and run one batch: an unservable model is never published."""
    model, meta = load_exported(result.path)
    with torch.inference_mode():
        logits = model(torch.zeros(2, *meta["shape"]))
    if tuple(logits.shape) != (2, len(meta["classes"])):
        raise RuntimeError(f"{result.path} maps a batch of 2 to logits of shape {tuple(logits.shape)}, expected "
                           f"(2, {len(meta['classes'])})")


@task(retries=2, requests=Resources(cpu="1", mem="4Gi"))
def export_model(trained: TrainResult) -> ModelArtifact:
    """Latest complete checkpoint -> model.safetensors + model config JSON + sha256, verified by reloading."""
    output = Path(flytekit.current_context().working_directory) / "model"
    result = export(local_directory(trained.checkpoints), output / WEIGHTS_FILE)
    verify_export(result)
    weights, config = Path(result.path), Path(result.config_path)
    assert weights.parent == config.parent == output, "export must write both files into the model directory"
    print(f"export_model: {weights.name} ({result.num_bytes / 2**20:.2f} MiB, {result.num_parameters:,} "
          f"parameters, step {result.step}, sha256 {result.sha256[:12]}) + {config.name}", flush=True)
    return ModelArtifact(directory=FlyteDirectory(str(output)), weights_file=weights.name, config_file=config.name,
                         sha256=result.sha256, num_bytes=result.num_bytes, step=result.step,
                         num_parameters=result.num_parameters)
