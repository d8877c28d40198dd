"""The promotion gate: a new model is promoted only if it is good enough and no worse than the baseline."""

from __future__ import annotations

from flytekit import task

from tasks.types import EvalReport, ModelArtifact, Promotion


def decide(accuracy: float, threshold: float, baseline_accuracy: float) -> tuple[bool, str]:
    """(promoted, reason): accuracy must reach ``threshold`` and must not fall below ``baseline_accuracy``."""
    for name, value in (("threshold", threshold), ("baseline_accuracy", baseline_accuracy)):
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"input {name}={value} is invalid: it is an accuracy, so it must be in [0, 1]")
    if accuracy < threshold:
        return False, f"test accuracy {accuracy:.4f} is below the threshold {threshold:.4f}"
    if accuracy < baseline_accuracy:
        return False, f"test accuracy {accuracy:.4f} is worse than the baseline {baseline_accuracy:.4f}"
    return True, (f"test accuracy {accuracy:.4f} reaches the threshold {threshold:.4f} and the baseline "
                  f"{baseline_accuracy:.4f}")


@task
def promotion_gate(report: EvalReport, model: ModelArtifact, threshold: float,
                   baseline_accuracy: float) -> Promotion:
    """Mark ``model`` promoted when its test accuracy is >= threshold and >= the baseline's."""
    accuracy = report.result.accuracy
    promoted, reason = decide(accuracy, threshold, baseline_accuracy)
    print(f"promotion_gate: {'PROMOTED' if promoted else 'not promoted'}: {reason}", flush=True)
    return Promotion(promoted=promoted, reason=reason, accuracy=accuracy, threshold=threshold,
                     baseline_accuracy=baseline_accuracy, model=model)
