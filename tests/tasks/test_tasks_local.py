"""Each task alone under flytekit's local execution: train (and resume), export, evaluate with its Deck."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from tasks.evaluate import evaluate_model
from tasks.export import export_model
from tasks.launch import train_task_for
from tasks.report import read_metrics
from tasks.types import StagedDataset, Topology
from traincore.artifacts.evaluate import evaluate
from traincore.artifacts.lineage import Lineage
from traincore.config.presets import preset
from traincore.data.manifest import Manifest


def staged(directory: Path) -> StagedDataset:
    return StagedDataset.from_manifest(directory, Manifest.load(directory))


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
    assert (first.summary.steps, first.summary.resumed_from, first.summary.world_size) == (10, None, 1)
    assert (second.summary.steps, second.summary.resumed_from) == (15, 10)
    assert sorted(p.name for p in root.iterdir()) == ["records", "step-000005", "step-000010", "step-000015"]
    # Each attempt's records were kept in the durable root, and the summary names them.
    assert [second.summary.records, first.summary.records] == [str(root / "records" / f"attempt-{n}")
                                                               for n in (1, 0)]
    first_rows = read_metrics(root / "records" / "attempt-0" / "metrics.jsonl")
    assert max(r["step"] for r in first_rows if r["kind"] == "train") == 10
    assert any((root / "records" / "attempt-1" / "tensorboard").iterdir())
    logs = Path(second.logs.path)
    assert [r["step"] for r in read_metrics(logs / "metrics.jsonl") if r["kind"] == "train"][0] > 10
    assert any((logs / "tensorboard").iterdir())
    assert 0.0 <= second.summary.val_accuracy <= 1.0 and second.summary.final_loss > 0


def test_export_writes_verified_weights_of_the_latest_checkpoint_and_lineage(trained, synthetic_dir):
    dataset = staged(synthetic_dir)
    model = export_model(trained=trained[1], dataset=dataset)
    directory = Path(model.directory.path)
    weights = directory / model.weights_file
    assert model.export.step == 15 and model.export.num_bytes == weights.stat().st_size
    assert hashlib.sha256(weights.read_bytes()).hexdigest() == model.export.sha256
    assert (directory / Path(model.export.config_path).name).is_file()
    lineage = model.export.lineage
    assert Lineage.load(directory / "lineage.json") == lineage
    assert (lineage.source, lineage.source_fingerprint, lineage.staging_format) == (
        dataset.source, dataset.source_fingerprint, dataset.format_version)
    assert (lineage.checkpoint_step, lineage.world_size, lineage.model_sha256) == (15, 1, model.export.sha256)
    assert lineage.execution_id.endswith("/local") and lineage.metrics["steps"] == 15
    assert lineage.config["train"]["max_steps"] == 15


def test_evaluate_reports_the_test_split_and_its_lineage(trained, synthetic_dir):
    model = export_model(trained=trained[1], dataset=staged(synthetic_dir))
    report = evaluate_model(model=model, dataset=staged(synthetic_dir), trained=trained[1])
    direct = evaluate(Path(model.directory.path) / model.weights_file, synthetic_dir, "test")
    result = report.result
    assert (result.accuracy, result.confusion, result.count) == (direct.accuracy, direct.confusion, 10)
    lineage = report.lineage
    assert (lineage.test_accuracy, lineage.test_count) == (direct.accuracy, 10)
    assert lineage.model_sha256 == model.export.sha256
    assert lineage.config_hash == model.export.lineage.config_hash
