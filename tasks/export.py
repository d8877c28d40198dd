"""Export the latest complete checkpoint to a single safetensors file (traincore.export proves it loads)."""

from __future__ import annotations

from pathlib import Path

import flytekit
from flytekit import Resources, task
from flytekit.types.directory import FlyteDirectory

from tasks.storage import local_directory
from tasks.types import ModelArtifact, TrainResult
from traincore.export import WEIGHTS_FILE, export


@task(retries=2, requests=Resources(cpu="1", mem="4Gi"))
def export_model(trained: TrainResult) -> ModelArtifact:
    """Latest complete checkpoint -> model.safetensors + config JSON + sha256, verified before publishing."""
    output = Path(flytekit.current_context().working_directory) / "model"
    result = export(local_directory(trained.checkpoints), output / WEIGHTS_FILE)
    weights, config = Path(result.path), Path(result.config_path)
    print(f"export_model: {weights.name} ({result.num_bytes / 2**20:.2f} MiB, {result.num_parameters:,} "
          f"parameters, step {result.step}, sha256 {result.sha256[:12]}) + {config.name}", flush=True)
    return ModelArtifact(directory=FlyteDirectory(str(output)), export=result)
