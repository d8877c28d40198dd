"""Measure the exported model on the test split and draw the training curves and lineage into a Flyte Deck."""

from __future__ import annotations

from dataclasses import asdict

import flytekit
from flytekit import Resources, task
from flytekit.deck import DeckField

from tasks.report import evaluation_deck_html, read_metrics
from tasks.resources import CACHE_MARGIN, gib
from tasks.storage import dataset_location, local_directory
from tasks.types import EvalReport, ModelArtifact, StagedDataset, TrainResult
from traincore.artifacts import evaluate, format_result, with_test
from traincore.data import DEFAULT_CACHE_BYTES, NODE_CACHE_ENV

TEST_SPLIT = "test"


# Input and output only: the default Dependencies field runs `pip freeze` on every execution (seconds).
# Disk for the streamed test split's cache (the default node cache) and 2 GiB more, as a train node's.
@task(enable_deck=True, deck_fields=(DeckField.INPUT, DeckField.OUTPUT), retries=2,
      requests=Resources(cpu="2", mem="4Gi", ephemeral_storage=gib(DEFAULT_CACHE_BYTES + CACHE_MARGIN)),
      environment={NODE_CACHE_ENV: str(DEFAULT_CACHE_BYTES)})
def evaluate_model(model: ModelArtifact, dataset: StagedDataset, trained: TrainResult) -> EvalReport:
    """ModelArtifact + the test split -> EvalReport, with a Deck of training curves, confusion matrix and
    lineage."""
    weights = local_directory(model.directory) / model.weights_file
    # The model this workflow trained: its own config named the factory (traincore.model.build.check_trusted).
    result = evaluate(weights, dataset_location(dataset.directory), TEST_SPLIT, trust_model=True)
    metrics_file = local_directory(trained.logs) / "metrics.jsonl"
    metrics = read_metrics(metrics_file) if metrics_file.is_file() else []
    lineage = with_test(model.export.lineage, result.accuracy, result.count)
    deck = evaluation_deck_html(result, metrics, asdict(lineage), trained.summary.records)
    flytekit.Deck("Evaluation", deck)
    print(f"evaluate_model: {format_result(result)}", flush=True)
    return EvalReport(result=result, lineage=lineage)
