"""The promotion gate: the rule at its boundaries, and the task on real models, champion and challenger
evaluated on the same test split, with the registry it publishes to."""

from __future__ import annotations

from pathlib import Path

import pytest
from flytekit.types.directory import FlyteDirectory

from tasks.plan import LaunchInputError
from tasks.promote import check_promoted_uri, decide, promotion_gate
from tasks.types import EvalReport, ModelArtifact, StagedDataset, dataset_lineage
from traincore.artifacts.evaluate import evaluate
from traincore.artifacts.export import WEIGHTS_FILE, export
from traincore.artifacts.lineage import LINEAGE_FILE, Lineage, with_test
from traincore.artifacts.registry import Registry
from traincore.config.presets import preset
from traincore.data.manifest import Manifest
from traincore.run.trainer import Trainer


@pytest.mark.parametrize("challenger, threshold, champion, tolerance, promoted, why", [
    (0.97, 0.95, 0.96, 0.0, True, "reaches the threshold 0.9500 and is not worse"),
    (0.95, 0.95, 0.95, 0.0, True, "reaches"),  # equal to both is not worse
    (0.95, 0.95, 0.97, 0.02, True, "reaches"),  # worse by exactly the tolerance
    (0.95, 0.95, 0.98, 0.02, False, "worse than the champion by 0.0300, more than the tolerance"),
    (0.94, 0.95, None, 0.0, False, "below the threshold 0.9500"),
    (0.96, 0.95, None, 0.0, True, "no champion in service: the challenger reaches"),
])
def test_decide(challenger, threshold, champion, tolerance, promoted, why):
    verdict, reason = decide(challenger, threshold, champion, tolerance)
    assert verdict is promoted and why in reason
    assert f"challenger test accuracy {challenger:.4f}" in reason
    if champion is not None:
        assert f"vs champion {champion:.4f} on the same test split (tolerance {tolerance:.4f})" in reason


@pytest.mark.parametrize("threshold, tolerance, name", [(95.0, 0.0, "threshold"), (0.9, -0.1, "tolerance")])
def test_decide_rejects_values_that_are_not_fractions(threshold, tolerance, name):
    with pytest.raises(LaunchInputError, match=rf"input {name}=.* must be in \[0, 1\]"):
        decide(0.9, threshold, 0.5, tolerance)


def test_a_local_registry_is_refused_where_it_would_not_last():
    check_promoted_uri("/srv/models", local_run=True)
    with pytest.raises(LaunchInputError, match="is a local path, which a pod loses .* give an object-store"):
        check_promoted_uri("/srv/models", local_run=False)
    with pytest.raises(LaunchInputError, match="input promoted_uri is empty"):
        check_promoted_uri("", local_run=True)


def train_export(data_dir: Path, steps: int, output: Path) -> tuple[ModelArtifact, EvalReport, StagedDataset]:
    """A debug model trained ``steps`` steps on ``data_dir``, exported and evaluated as the pipeline does."""
    dataset = StagedDataset.from_manifest(data_dir, Manifest.load(data_dir))
    cfg = preset("debug").with_overrides({"train.max_steps": steps, "loader.batch_size": 16,
                                          "optim.warmup_steps": 1})
    Trainer(cfg, data_dir, output / "run").train()
    result = export(output / "run" / "checkpoints", output / "model" / WEIGHTS_FILE, dataset_lineage(dataset))
    measured = evaluate(output / "model" / WEIGHTS_FILE, data_dir, "test")
    report = EvalReport(result=measured, lineage=with_test(result.lineage, measured.accuracy, measured.count))
    with_test(result.lineage, measured.accuracy, measured.count).write(output / "model" / LINEAGE_FILE)
    return ModelArtifact(directory=FlyteDirectory(str(output / "model")), export=result), report, dataset


@pytest.fixture(scope="module")
def strong(synthetic_dir, tmp_path_factory):
    return train_export(synthetic_dir, 60, tmp_path_factory.mktemp("strong"))


@pytest.fixture(scope="module")
def weak(synthetic_dir, tmp_path_factory, strong):
    weak = train_export(synthetic_dir, 1, tmp_path_factory.mktemp("weak"))
    # What the refusal tests need, checked rather than assumed: the weak model is clearly worse.
    assert strong[1].result.accuracy - weak[1].result.accuracy > 0.2
    return weak


def gate(challenger, champion: str | None, registry: Path, threshold: float = 0.0, tolerance: float = 0.0):
    model, report, dataset = challenger
    return promotion_gate(model=model, report=report, dataset=dataset, champion=champion,
                          promoted_uri=str(registry), threshold=threshold, tolerance=tolerance)


def test_first_promotion_publishes_the_challenger_with_its_lineage(strong, tmp_path):
    verdict = gate(strong, None, tmp_path / "registry", threshold=0.5)
    registry = Registry(str(tmp_path / "registry"))
    assert verdict.promoted and verdict.champion is None and verdict.champion_origin == ""
    assert "no champion in service" in verdict.reason
    assert registry.latest() == verdict.version and registry.lineage(verdict.version) == strong[1].lineage
    assert registry.lineage(verdict.version).test_accuracy == strong[1].result.accuracy


def test_a_worse_challenger_is_refused_with_both_figures(strong, weak, tmp_path):
    champion_dir = Path(strong[0].directory.path)
    verdict = gate(weak, str(champion_dir), tmp_path / "registry", tolerance=0.1)
    challenger, champion = verdict.challenger.result, verdict.champion.result
    assert not verdict.promoted and verdict.version == ""
    assert (champion.accuracy, champion.confusion) == (strong[1].result.accuracy, strong[1].result.confusion)
    assert champion.count == challenger.count  # the same test split
    assert f"challenger test accuracy {challenger.accuracy:.4f} vs champion {champion.accuracy:.4f}" in \
        verdict.reason and "worse than the champion" in verdict.reason
    assert verdict.champion_origin == str(champion_dir)
    assert verdict.champion.lineage == Lineage.load(champion_dir / LINEAGE_FILE)
    assert Registry(str(tmp_path / "registry")).versions() == []  # nothing published


def test_a_challenger_with_the_champions_weights_is_not_published_again(strong, tmp_path):
    verdict = gate(strong, strong[0].directory.path, tmp_path / "registry")
    assert not verdict.promoted and verdict.champion.result.accuracy == strong[1].result.accuracy
    assert verdict.reason.endswith(f"but the challenger's weights are the champion's (sha256 "
                                   f"{strong[0].export.sha256[:12]}): nothing new to publish")
    assert Registry(str(tmp_path / "registry")).versions() == []


def test_the_champion_is_the_registrys_latest_and_a_better_challenger_replaces_it(strong, weak, tmp_path):
    registry = Registry(str(tmp_path / "registry"))
    served = registry.publish(Path(weak[0].directory.path), weak[1].lineage)
    verdict = gate(strong, None, tmp_path / "registry")
    assert verdict.promoted and verdict.champion_origin == f"{registry.uri}/{served} (latest)"
    assert verdict.champion.result.accuracy == weak[1].result.accuracy
    assert registry.latest() == verdict.version != served and registry.versions() == sorted([served,
                                                                                               verdict.version])


def test_a_champion_of_another_shape_is_refused_clearly(strong, digits_dir, tmp_path):
    other = train_export(digits_dir, 1, tmp_path / "other")
    champion_dir = Path(other[0].directory.path)
    verdict = gate(strong, str(champion_dir), tmp_path / "registry")
    assert not verdict.promoted and verdict.champion is None
    reason = verdict.reason
    assert reason.startswith(f"refused: the champion {champion_dir} cannot be evaluated on the new test "
                             "split")
    assert "the champion's class list is ['0', '1', '2'," in reason and "gone: ['0', '1'," in reason
    assert "the champion's input shape (C, H, W) is [1, 16, 16], the new data's (and the challenger's) is " \
           "[3, 8, 8]" in reason
    fix = f"python -m traincore.registry publish {tmp_path / 'registry'} {strong[0].directory.path}"
    assert fix in reason
    assert Registry(str(tmp_path / "registry")).versions() == []
