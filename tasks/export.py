"""Export the best checkpoint (by the run's validation metric; the latest when none was validated) to a
single safetensors file (traincore.export proves it loads), with lineage.json beside it."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import flytekit
from flytekit import Resources, task
from flytekit.types.directory import FlyteDirectory

from tasks.storage import local_directory
from tasks.types import ModelArtifact, StagedDataset, TrainResult, dataset_lineage
from traincore.artifacts import WEIGHTS_FILE, export, metric_summary


def execution_id() -> str:
    """``project/domain/name`` of the running execution (``local/local/local`` outside a cluster)."""
    execution = flytekit.current_context().execution_id
    return f"{execution.project}/{execution.domain}/{execution.name}"


@task(retries=2, requests=Resources(cpu="1", mem="4Gi", ephemeral_storage="4Gi"))  # the exported weights
def export_model(trained: TrainResult, dataset: StagedDataset, search: str = "") -> ModelArtifact:
    """Best checkpoint (train.metric; else the latest) -> model.safetensors + config JSON + lineage.json,
    verified before publishing; the lineage records the dataset, the run's metric summary, this execution
    and, for a model a search chose, the search (``search``: JSON of its space, trial, parameters, rung)."""
    output = Path(flytekit.current_context().working_directory) / "model"
    lineage = replace(dataset_lineage(dataset), execution_id=execution_id(),
                      metrics=metric_summary(trained.summary), search=json.loads(search) if search else {})
    # The checkpoint this workflow trained: its own config named the model's factory, if it has one.
    result = export(local_directory(trained.checkpoints), output / WEIGHTS_FILE, lineage, trust_model=True,
                    metric=trained.summary.metric)
    weights, config = Path(result.path), Path(result.config_path)
    print(f"export_model: {weights.name} ({result.num_bytes / 2**20:.2f} MiB, {result.num_parameters:,} "
          f"parameters, step {result.step}, sha256 {result.sha256[:12]}) + {config.name} + lineage.json "
          f"(config {result.lineage.config_hash[:12]}, {result.lineage.code_version}); step {result.step} is "
          f"{result.selected}", flush=True)
    return ModelArtifact(directory=FlyteDirectory(str(output)), export=result)
