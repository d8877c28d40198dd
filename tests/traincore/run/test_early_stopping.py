"""Validation during training: each validated step's checkpoint records its metrics, the best is kept and
exported by default, and early stopping ends a plateaued run, counting on across a resume."""

from __future__ import annotations

import logging
import shutil

import pytest
from safetensors.torch import load_file

from traincore.artifacts.export import export
from traincore.artifacts.export import main as export_main
from traincore.checkpoint import complete_steps, step_metrics
from traincore.config import preset
from traincore.run import Trainer
from traincore.run.early_stopping import EarlyStopping
from traincore.telemetry.summary import format_summary

TINY = {"model": {"name": "small_cnn", "width": 8}, "optim": {"lr": 3e-3, "warmup_steps": 2},
        "loader": {"batch_size": 8}, "telemetry": {"log_every": 2}, "train": {"eval_every": 4}}


def _train(data, output, **overrides):
    cfg = preset("debug").with_overrides(TINY).with_overrides(overrides)
    return Trainer(cfg, data, output).train()


def test_the_best_validated_checkpoint_is_kept_and_exported_not_the_latest(data_dir, tmp_path, capsys):
    # A constant, high learning rate: accuracy peaks, then the last steps are worse.
    summary = _train(data_dir, tmp_path / "run", **{"optim.lr": 0.03, "optim.min_lr_ratio": 1.0,
                                                    "train.max_steps": 20, "checkpoint.keep_last": 2})
    root = tmp_path / "run" / "checkpoints"
    recorded = {step: metrics["val_accuracy"] for step, metrics in step_metrics(root).items()}
    best = summary.best_step
    assert best is not None and best < 20 and recorded[best] == summary.best_value > recorded[20], recorded
    assert best == min(step for step, value in recorded.items() if value == max(recorded.values()))
    # keep_last=2 keeps steps 16 and 20, and the best past them.
    assert complete_steps(root) == sorted({best, 16, 20})
    assert f"(best val_accuracy {summary.best_value:.4f} at step {best})" in format_summary(summary)

    chosen = export(root, tmp_path / "best" / "model.safetensors")
    assert chosen.step == best and chosen.selected.startswith("the best val_accuracy")
    assert export(root, tmp_path / "latest" / "model.safetensors", select="latest").step == 20
    # By loss instead: the step of the lowest val_loss that a marker records.
    losses = {step: metrics["val_loss"] for step, metrics in step_metrics(root).items()}
    assert export(root, tmp_path / "loss" / "model.safetensors", metric="val_loss").step == min(
        losses, key=losses.get)
    weights = load_file(tmp_path / "best" / "model.safetensors")
    assert weights.keys() == load_file(tmp_path / "latest" / "model.safetensors").keys()
    capsys.readouterr()
    assert export_main(["--checkpoint", str(root), "--output", str(tmp_path / "cli" / "model.safetensors"),
                        "--select", "best"]) == 0
    said = capsys.readouterr().out
    assert said.endswith(f"step {best} is the best val_accuracy ({recorded[best]:.4f}) of the checkpoints "
                         "that record it\n"), said


def test_early_stopping_ends_a_plateau_says_so_and_a_resume_counts_on(data_dir, tmp_path, caplog):
    stopping = {"train.max_steps": 40, "train.early_stopping": {"patience": 2}}
    with caplog.at_level(logging.INFO, logger="traincore.run.trainer"):
        summary = _train(data_dir, tmp_path / "run", **stopping)
    # Validation accuracy reaches 1.0 at step 16 and stays there: steps 20 and 24 do not improve on it.
    assert summary.stopped_early and summary.steps == 24 and summary.best_step == 16, summary
    assert ("early stopping at step 24: val_accuracy has not improved by more than 0 for 2 validations "
            "(train.early_stopping patience 2); the best, 1.0000, was at step 16") in caplog.text
    assert "trained 24 steps (stopped early)" in format_summary(summary)
    root = tmp_path / "run" / "checkpoints"
    assert complete_steps(root)[-1] == 24
    # Resumed from step 20 (its one stale validation saved with it), the run stops at the same step with
    # the same weights; without the saved count it would train on to step 32.
    resumed = tmp_path / "resumed"
    shutil.copytree(tmp_path / "run", resumed)
    shutil.rmtree(resumed / "checkpoints" / "step-000024")
    again = _train(data_dir, resumed, **stopping)
    assert again.resumed_from == 20 and again.steps == 24 and again.stopped_early and again.best_step == 16
    ours, theirs = (export(r / "checkpoints", r / "export" / "model.safetensors", select="latest")
                    for r in (tmp_path / "run", resumed))
    assert ours.sha256 == theirs.sha256


def test_patience_counts_validations_that_do_not_improve_by_more_than_min_delta():
    watch = EarlyStopping("val_loss", patience=2, min_delta=0.1)
    assert not watch.observe(10, {"val_loss": 1.0})
    assert not watch.observe(20, {"val_loss": 0.95})  # better, but not by more than 0.1: stale
    assert watch.observe(30, {"val_loss": 0.91})
    assert (watch.best, watch.best_step, watch.stale) == (1.0, 10, 2)
    restored = EarlyStopping("val_loss", patience=2, min_delta=0.1)
    restored.load_state_dict(watch.state_dict())
    assert (restored.best, restored.best_step, restored.stale) == (1.0, 10, 2)
    other = EarlyStopping("val_accuracy", patience=2)
    other.load_state_dict(watch.state_dict())  # ranked by another metric: nothing carries over
    assert (other.best, other.stale) == (None, 0)
    never = EarlyStopping("val_accuracy")
    assert not any(never.observe(step, {"val_accuracy": 0.5}) for step in range(10))


@pytest.mark.parametrize(("stopping", "message"), [
    ({"patience": 0}, "train.early_stopping.patience=0 is invalid: must be an integer >= 1"),
    ({"patience": 2, "min_delta": -1}, "train.early_stopping.min_delta=-1 is invalid: must be a number >= 0"),
    ({"patience": 2, "after": 3}, "train.early_stopping={'patience': 2, 'after': 3} is invalid: expected"),
    ({"min_delta": 0.1}, "train.early_stopping.patience=None is invalid"),
])
def test_bad_early_stopping_settings_are_named(stopping, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("{", r"\{").replace("[", r"\[")):
        preset("debug").with_overrides({"train.eval_every": 5, "train.early_stopping": stopping})
    with pytest.raises(ValueError, match="train.eval_every is 0: set train.eval_every"):
        preset("debug").with_overrides({"train.early_stopping": {"patience": 2}})
