"""The promotion gate, both ways and at its boundaries, as a function and as a locally executed task."""

from __future__ import annotations

import pytest
from flytekit.types.directory import FlyteDirectory

from tasks.promote import decide, promotion_gate
from tasks.types import EvalReport, ModelArtifact
from traincore.evaluate import EvalResult
from traincore.export import ExportResult


@pytest.mark.parametrize("accuracy, threshold, baseline, promoted, why", [
    (0.97, 0.95, 0.96, True, "reaches"),
    (0.95, 0.95, 0.95, True, "reaches"),  # equal to both is not worse
    (0.94, 0.95, 0.00, False, "below the threshold"),
    (0.96, 0.95, 0.97, False, "worse than the baseline"),
])
def test_decide(accuracy, threshold, baseline, promoted, why):
    verdict, reason = decide(accuracy, threshold, baseline)
    assert verdict is promoted and why in reason


@pytest.mark.parametrize("threshold, baseline, name", [(95.0, 0.0, "threshold"),
                                                       (0.9, -0.1, "baseline_accuracy")])
def test_decide_rejects_values_that_are_not_accuracies(threshold, baseline, name):
    with pytest.raises(ValueError, match=f"input {name}="):
        decide(0.9, threshold, baseline)


def _report(accuracy: float) -> EvalReport:
    result = EvalResult(split="test", accuracy=accuracy, loss=0.1, count=100, classes=["a", "b"],
                        precision=[1.0, 1.0], recall=[1.0, 1.0], confusion=[[50, 0], [0, 50]])
    return EvalReport(result=result, model_sha256="ab" * 32)


@pytest.mark.parametrize("accuracy, promoted", [(0.98, True), (0.90, False)])
def test_gate_task_marks_the_model(tmp_path, accuracy, promoted):
    (tmp_path / "model.safetensors").write_bytes(b"weights")
    export = ExportResult(path=str(tmp_path / "model.safetensors"), config_path=str(tmp_path / "model.json"),
                          sha256="ab" * 32, num_bytes=7, step=10, num_parameters=3)
    model = ModelArtifact(directory=FlyteDirectory(str(tmp_path)), export=export)
    verdict = promotion_gate(report=_report(accuracy), model=model, threshold=0.95, baseline_accuracy=0.93)
    assert verdict.promoted is promoted
    assert verdict.accuracy == accuracy and verdict.model.export.sha256 == model.export.sha256
    assert verdict.model.weights_file == "model.safetensors"
