"""The retraining cycle end to end, locally, on an image folder that grows between runs.

Run 1 stages, trains and promotes (no champion yet). Images are added: run 2 stages again (the source's
fingerprint changed), trains, evaluates the registry's latest (run 1's model) and the new model on the same
new test split and promotes or refuses by the rule. Run 3, on unchanged images, reuses the staging (the task
cache) and again compares against whatever ``latest`` names. One training process, a few steps, 12 px.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import fields
from pathlib import Path

import pytest

import tasks.stage
from tasks.promote import decide
from traincore.artifacts.lineage import Lineage
from traincore.artifacts.registry import Registry
from workflows.schedules import retrain_and_promote

OVERRIDES = {"data": {"image_size": 12}, "train": {"max_steps": 12}, "loader": {"batch_size": 8},
             "telemetry": {"tensorboard": False}}
THRESHOLD, TOLERANCE = 0.5, 0.05


def grow(images: Path, more: Path) -> None:
    """Move the images of ``more`` into ``images``, class by class, under new names."""
    for path in more.glob("*/*.jpg"):
        shutil.move(path, images / path.parent.name / f"new_{path.name}")


def forbid_staging(monkeypatch):
    def staging_started(*args, **kwargs):
        raise AssertionError("the dataset was staged")

    monkeypatch.setattr(tasks.stage, "stage", staging_started)


def check_verdict(verdict, registry: Registry, previous_latest: str) -> None:
    """The verdict follows the rule on the figures it reports, and ``latest`` follows the verdict."""
    challenger, champion = verdict.challenger.result, verdict.champion.result
    assert champion.count == challenger.count and champion.classes == challenger.classes  # the same split
    same_weights = verdict.challenger.lineage.model_sha256 == verdict.champion.lineage.model_sha256
    rule = decide(challenger.accuracy, THRESHOLD, champion.accuracy, TOLERANCE)[0]
    assert verdict.promoted is (rule and not same_weights)
    assert ("nothing new to publish" in verdict.reason) is (rule and same_weights)
    assert f"{challenger.accuracy:.4f}" in verdict.reason and f"{champion.accuracy:.4f}" in verdict.reason
    assert verdict.champion_origin == f"{registry.uri}/{previous_latest} (latest)"
    assert registry.latest() == (verdict.version if verdict.promoted else previous_latest)


def test_a_growing_image_folder_is_restaged_retrained_and_promoted(image_folder_factory, tmp_path,
                                                                   monkeypatch):
    images = image_folder_factory("images", per_class=20, seed=0)
    registry = Registry(str(tmp_path / "registry"))
    run = dict(source=f"imagefolder:{images}", preset="debug", config_overrides=json.dumps(OVERRIDES),
               threshold=THRESHOLD, tolerance=TOLERANCE, promoted_uri=registry.uri, nproc_per_node=1)

    first = retrain_and_promote(**run, warm_start=True)  # nothing in service yet: from scratch
    assert first.promoted and first.champion is None and first.champion_origin == ""
    assert registry.latest() == first.version and registry.versions() == [first.version]
    published = Registry(registry.uri).lineage(first.version)
    assert published == first.challenger.lineage  # what was decided on is what was published
    assert [spec.name for spec in fields(Lineage) if getattr(published, spec.name) in ("", 0, {}, None)] == [
        "init_sha256", "search"]  # trained from scratch (no model.init_from), by no search
    assert published.source_fingerprint == first.model.export.lineage.source_fingerprint
    assert published.test_accuracy == first.challenger.result.accuracy
    assert (tmp_path / "registry" / first.version / "model.safetensors").is_file()

    grow(images, image_folder_factory("more", per_class=10, seed=1))
    second = retrain_and_promote(**run)
    assert second.challenger.lineage.source_fingerprint != first.challenger.lineage.source_fingerprint
    assert second.challenger.result.count > first.challenger.result.count  # staged again: more test images
    check_verdict(second, registry, first.version)
    assert second.champion.lineage == published  # the champion's lineage as it was published

    forbid_staging(monkeypatch)
    latest = registry.latest()
    # Unchanged images: the staging comes from the task cache. Warm-started: the new model starts from the
    # one in service, every tensor of it.
    third = retrain_and_promote(**run, warm_start=True)
    assert third.challenger.lineage.source_fingerprint == second.challenger.lineage.source_fingerprint
    assert third.challenger.result.count == second.challenger.result.count
    assert third.challenger.lineage.init_sha256 == registry.lineage(latest).model_sha256
    check_verdict(third, registry, latest)
    assert len(registry.versions()) == 1 + second.promoted + third.promoted


def test_bad_promotion_inputs_fail_before_anything_stages(tmp_path, monkeypatch):
    forbid_staging(monkeypatch)
    with pytest.raises(Exception, match=r"input tolerance=1.5 is invalid: .* must be in \[0, 1\]"):
        retrain_and_promote(source="synthetic", preset="debug", tolerance=1.5, promoted_uri=str(tmp_path))
    with pytest.raises(Exception, match="input promoted_uri='nosuch://bucket/models': .* unknown scheme"):
        retrain_and_promote(source="synthetic", preset="debug", promoted_uri="nosuch://bucket/models")
    with pytest.raises(Exception, match=f"input champion='{tmp_path}/typo' holds no model.safetensors"):
        retrain_and_promote(source="synthetic", preset="debug", champion=f"{tmp_path}/typo",
                            promoted_uri=str(tmp_path))
    with pytest.raises(Exception, match="input warm_start=True starts from the model in service, and input "
                                        "config_overrides sets model.init_from too: give one of them"):
        retrain_and_promote(source="synthetic", preset="debug", warm_start=True, promoted_uri=str(tmp_path),
                            config_overrides='{"model": {"init_from": "/models/model.safetensors"}}')
    assert not any(tmp_path.iterdir())  # no registry was created
    # Each of these once trained and evaluated first, then failed in the promotion with a traceback.
    (tmp_path / "afile").write_text("x")
    with pytest.raises(Exception, match=r"input promoted_uri='.*afile': registry directory .*afile is a "
                                        "file, not a directory: set promoted_uri to a directory you can "
                                        "write to"):
        retrain_and_promote(source="synthetic", preset="debug", promoted_uri=str(tmp_path / "afile"))
    with pytest.raises(Exception, match="input promoted_uri='ftp://host/reg': ftp:// cannot hold checkpoints "
                                        "or models"):
        retrain_and_promote(source="synthetic", preset="debug", promoted_uri="ftp://host/reg")
    fake = tmp_path / "fake"
    fake.mkdir()
    (fake / "model.safetensors").write_bytes(b"not a model")
    with pytest.raises(Exception, match=f"input champion='{fake}': .*model.json"):
        retrain_and_promote(source="synthetic", preset="debug", champion=str(fake),
                            promoted_uri=str(tmp_path / "registry"))
    assert not (tmp_path / "registry").exists()
