"""The stage task run locally: where it stages, and reuse of an earlier staging on a cache miss."""

from __future__ import annotations

import os
from pathlib import Path

import tasks.stage
from tasks.stage import stage_dataset
from traincore.config import DataConfig
from traincore.data import Manifest
from traincore.stage import stage

DATA = DataConfig(source="synthetic", image_size=8, synthetic_samples=60, synthetic_classes=3)


def test_local_staging_lives_in_the_user_cache_not_under_tmp():
    staged = stage_dataset(data=DATA)
    path = Path(staged.directory.path)
    assert path.is_relative_to(Path(os.environ["XDG_CACHE_HOME"]) / "flyte-torch-pipeline" / "staged")
    assert Manifest.load(path).splits["train"].count == staged.counts["train"]


def test_a_different_config_stages_elsewhere_and_the_same_config_reuses(monkeypatch):
    first = Path(stage_dataset(data=DATA).directory.path)
    other = Path(stage_dataset(data=DataConfig(**{**DATA.__dict__, "seed": 1})).directory.path)
    assert first != other
    written = (first / "manifest.json").stat().st_mtime_ns
    calls = []
    monkeypatch.setattr(tasks.stage, "stage", lambda *a, **k: calls.append(a) or stage(*a, **k))
    # Flyte's own cache is bypassed here (a new cache version), so the task body runs and must reuse the
    # complete staging on disk instead of writing it again.
    monkeypatch.setattr(stage_dataset.metadata, "cache_version", "bypass-for-this-test")
    again = Path(stage_dataset(data=DATA).directory.path)
    assert len(calls) == 1
    assert again == first and (first / "manifest.json").stat().st_mtime_ns == written
