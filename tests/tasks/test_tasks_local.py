"""Each task alone under flytekit's local execution: train (and resume), export, evaluate with its Deck."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

import pytest
from flytekit.types.directory import FlyteDirectory

from tasks.evaluate import deck_html, evaluate
from tasks.export import export_model
from tasks.report import read_metrics
from tasks.train import train_task_for
from tasks.types import StagedDataset, Topology
from traincore.config import preset
from traincore.data import Manifest
from traincore.evaluate import evaluate as evaluate_split


def staged(directory: Path) -> StagedDataset:
    manifest = Manifest.load(directory)
    return StagedDataset(directory=FlyteDirectory(str(directory)), source=manifest.source, classes=manifest.classes,
                         shape=list(manifest.shape), counts={k: s.count for k, s in manifest.splits.items()},
                         format_version=manifest.format_version)


def debug_config(max_steps: int):
    return preset("debug").with_overrides({"train.max_steps": max_steps, "checkpoint.every": 5,
                                           "loader.batch_size": 16})


@pytest.fixture(scope="module")
def trained(synthetic_dir, tmp_path_factory):
    """Two attempts on one checkpoint root: 10 steps, then (as a retry would) on to 15 steps."""
    root = str(tmp_path_factory.mktemp("durable") / "checkpoints")
    task = train_task_for(Topology(nproc_per_node=1), debug_config(10))
    first = task(config=debug_config(10), dataset=staged(synthetic_dir), checkpoint_root=root)
    second = task(config=debug_config(15), dataset=staged(synthetic_dir), checkpoint_root=root)
    return first, second, Path(root)


def test_train_returns_rank_zeros_result_and_resumes_from_the_durable_root(trained):
    first, second, root = trained
    assert (first.steps, first.resumed_from, first.world_size) == (10, None, 1)
    assert (second.steps, second.resumed_from) == (15, 10)
    assert sorted(p.name for p in root.iterdir()) == ["step-000005", "step-000010", "step-000015"]
    logs = Path(second.logs.path)
    assert [r["step"] for r in read_metrics(logs / "metrics.jsonl") if r["kind"] == "train"][0] > 10
    assert any((logs / "tensorboard").iterdir())
    assert 0.0 <= second.val_accuracy <= 1.0 and second.final_loss > 0


def test_export_writes_verified_weights_of_the_latest_checkpoint(trained):
    model = export_model(trained=trained[1])
    weights = Path(model.directory.path) / model.weights_file
    assert model.step == 15 and model.num_bytes == weights.stat().st_size
    assert hashlib.sha256(weights.read_bytes()).hexdigest() == model.sha256
    assert (Path(model.directory.path) / model.config_file).is_file()


def test_evaluate_reports_the_test_split_and_draws_the_deck(trained, synthetic_dir):
    model = export_model(trained=trained[1])
    report = evaluate(model=model, dataset=staged(synthetic_dir), trained=trained[1])
    direct = evaluate_split(Path(model.directory.path) / model.weights_file, synthetic_dir, "test")
    assert (report.accuracy, report.confusion, report.count) == (direct.accuracy, direct.confusion, 10)
    assert report.model_sha256 == model.sha256
    page = deck_html(direct, read_metrics(Path(trained[1].logs.path) / "metrics.jsonl"))
    assert len(re.findall(r'<img alt="[^"]+" src="data:image/png;base64,', page)) == 2
    assert f"test accuracy: {direct.accuracy:.3f}" in page
