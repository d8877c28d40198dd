"""Lineage: the record, its hash and code version, and the lineage.json a real export writes."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import asdict, fields
from pathlib import Path

import pytest

from traincore.artifacts.export import export
from traincore.artifacts.lineage import (
    LINEAGE_FILE,
    Lineage,
    LineageError,
    code_version,
    config_hash,
    metric_summary,
    with_test,
)
from traincore.config.presets import preset
from traincore.files import sha256_file
from traincore.run.trainer import Trainer

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def exported(synthetic_dir, tmp_path_factory):
    """A debug model trained 6 steps on the synthetic data and exported with a run's lineage."""
    run = tmp_path_factory.mktemp("lineage-run")
    cfg = preset("debug").with_overrides({"train.max_steps": 6, "loader.batch_size": 16,
                                          "data.source": "synthetic"})
    summary = Trainer(cfg, synthetic_dir, run / "train").train()
    given = Lineage(source_fingerprint="f" * 64, staging_format=3, execution_id="proj/dev/abc123",
                    metrics=metric_summary(summary))
    return cfg, summary, export(run / "train" / "checkpoints", run / "model" / "model.safetensors", given)


def test_export_writes_a_complete_lineage_beside_the_weights(exported):
    cfg, summary, result = exported
    lineage = result.lineage
    weights = Path(result.path)
    assert Lineage.load(weights.with_name(LINEAGE_FILE)) == lineage  # the file is the record
    assert lineage.config == cfg.to_dict() and lineage.config_hash == config_hash(cfg.to_dict())
    assert lineage.data_config_hash == config_hash(cfg.to_dict()["data"])
    assert lineage.model_sha256 == sha256_file(weights) == result.sha256
    assert (lineage.checkpoint_step, lineage.world_size, lineage.source) == (6, 1, "synthetic")
    assert (lineage.source_fingerprint, lineage.staging_format, lineage.execution_id) == (
        "f" * 64, 3, "proj/dev/abc123")  # what the checkpoint cannot know comes from the caller
    assert lineage.metrics["steps"] == 6 and lineage.metrics["final_loss"] == summary.final_loss
    assert lineage.code_version == code_version()
    assert lineage.test_accuracy is None  # not evaluated yet
    empty = [spec.name for spec in fields(Lineage) if getattr(lineage, spec.name) in ("", 0, {}, None)]
    assert empty == ["init_sha256", "test_accuracy", "test_count", "search"]  # from scratch, untested


def test_json_round_trip_and_what_a_newer_writer_may_add(exported):
    lineage = with_test(exported[2].lineage, 0.875, 40)
    assert (lineage.test_accuracy, lineage.test_count) == (0.875, 40)
    assert Lineage.from_json(lineage.to_json()) == lineage
    newer = json.dumps({**asdict(lineage), "added_later": 1})
    assert Lineage.from_json(newer) == lineage


@pytest.mark.parametrize("text, match", [('{"source": "dig', "is not valid JSON"),
                                         ("[1, 2]", "holds a JSON list, not an object")])
def test_a_damaged_lineage_is_named(tmp_path, text, match):
    path = tmp_path / LINEAGE_FILE
    path.write_text(text)
    with pytest.raises(LineageError, match=f"{path} {match}"):
        Lineage.load(path)
    with pytest.raises(LineageError, match=f"{tmp_path / 'nope.json'} does not exist: export the model"):
        Lineage.load(tmp_path / "nope.json")


def test_config_hash_is_canonical():
    cfg = preset("debug").to_dict()
    reordered = {name: dict(reversed(section.items())) for name, section in reversed(cfg.items())}
    assert config_hash(reordered) == config_hash(cfg)
    assert config_hash(preset("debug").with_overrides({"train.max_steps": 21}).to_dict()) != config_hash(cfg)
    assert re.fullmatch(r"[0-9a-f]{64}", config_hash(cfg))


def test_code_version_names_the_package_and_the_checkout():
    version = code_version()
    assert version.startswith("flyte-torch-pipeline 0.1.0 (git ")
    if (REPO / ".git").exists():
        revision = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True,
                                  text=True, check=True).stdout.strip()
        assert re.fullmatch(rf"flyte-torch-pipeline \S+ \(git {revision[:12]}(-dirty)?\)", version)


def test_code_version_never_fails_without_git():
    """No git on the PATH (a slim image): the revision is unknown, the version still comes back."""
    env = {**os.environ, "PATH": "/nonexistent", "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-c", "from traincore.artifacts.lineage import code_version; "
                           "print(code_version())"], capture_output=True, text=True, env=env, check=True)
    assert done.stdout.strip() == "flyte-torch-pipeline 0.1.0 (git unknown)"
