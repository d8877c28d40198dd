"""Measure the exported model on the test split and draw the training curves into a Flyte Deck."""

from __future__ import annotations

import flytekit
from flytekit import Resources, task
from flytekit.deck import DeckField

from tasks.report import confusion_png, curves_png, figure_html, read_metrics
from tasks.storage import local_directory
from tasks.types import EvalReport, ModelArtifact, StagedDataset, TrainResult
from traincore.evaluate import EvalResult, evaluate, format_result

TEST_SPLIT = "test"


def deck_html(result: EvalResult, metrics: list[dict]) -> str:
    """The Deck page: the headline numbers, the training curves and the confusion matrix."""
    parts = [f"<p><b>{format_result(result)}</b></p>"]
    curves = curves_png(metrics)
    if curves is not None:
        parts.append(figure_html("Training curves (metrics.jsonl)", curves))
    parts.append(figure_html(f"Confusion matrix ({result.split} split)", confusion_png(result.confusion,
                                                                                        result.classes)))
    return "\n".join(parts)


# Input and output only: the default Dependencies field runs `pip freeze` on every execution (seconds).
@task(enable_deck=True, deck_fields=(DeckField.INPUT, DeckField.OUTPUT), retries=2,
      requests=Resources(cpu="2", mem="4Gi"))
def evaluate_model(model: ModelArtifact, dataset: StagedDataset, trained: TrainResult) -> EvalReport:
    """ModelArtifact + the test split -> EvalReport, with a Deck of training curves and confusion matrix."""
    weights = local_directory(model.directory) / model.weights_file
    result = evaluate(weights, local_directory(dataset.directory), TEST_SPLIT)
    metrics_file = local_directory(trained.logs) / "metrics.jsonl"
    metrics = read_metrics(metrics_file) if metrics_file.is_file() else []
    flytekit.Deck("Evaluation", deck_html(result, metrics))
    print(f"evaluate_model: {format_result(result)}", flush=True)
    return EvalReport(result=result, model_sha256=model.export.sha256)
