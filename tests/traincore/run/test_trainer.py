"""The training core end to end through its CLI, with real torchrun processes on gloo."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys

import pytest
import torch
from trainruns import TINY, final_weights, killed_and_resumed, run_train, train_losses

from traincore.checkpoint import complete_steps
from traincore.config.schema import ModelConfig
from traincore.run.preflight import check_model_input
from traincore.run.trainer import gc_paused


def test_two_process_training_learns_and_matches_golden_losses(data_dir, tmp_path):
    done = run_train(data_dir, tmp_path / "run", 2, "--max-steps", "20")
    losses = train_losses(tmp_path / "run")
    assert len(losses) == 10 and losses[-1] < 0.5 * losses[0], losses
    # Recorded from this configuration (2 gloo ranks, seed 0); guards the loop's numerics against drift.
    golden = torch.tensor([1.4081, 1.2062, 0.9831, 0.9097, 0.8773])
    torch.testing.assert_close(torch.tensor(losses[:5]), golden, atol=2e-3, rtol=0)
    assert "trained 20 steps" in done.stdout
    # Rank 0 alone reports where start-up went: one log line, one record.
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    startup = [row for row in rows if row["kind"] == "startup"]
    assert len(startup) == 1 and startup[0]["step"] == 1, startup
    assert startup[0]["imports_s"] > 0 and startup[0]["process_group_s"] >= 0
    assert done.stderr.count("to first step: imports") == 1, done.stderr[-3000:]


def test_gc_paused_freezes_what_exists_and_restores_the_collector():
    assert gc.isenabled() and gc.get_freeze_count() == 0
    with gc_paused():
        assert not gc.isenabled()
        assert gc.get_freeze_count() > 0  # existing objects are out of the loop's collections
        garbage = [[]]
        garbage[0].append(garbage)  # a cycle made inside the loop is still collected there
        del garbage
        assert gc.collect() >= 1
    assert gc.isenabled() and gc.get_freeze_count() == 0


def test_killed_run_resumes_to_bitwise_identical_weights(data_dir, tmp_path):
    ref = tmp_path / "reference"
    run_train(data_dir, ref, 2, "--max-steps", "40", "--checkpoint-every", "5")
    killed = tmp_path / "killed"
    killed_and_resumed(data_dir, killed, 40, "--checkpoint-every", "5")
    expected, actual = final_weights(ref), final_weights(killed)
    assert expected.keys() == actual.keys()
    for name in expected:
        assert torch.equal(expected[name], actual[name]), name


@pytest.mark.parametrize("resume_nproc", [1, 3])
def test_resume_on_a_different_world_size(data_dir, tmp_path, resume_nproc):
    out = tmp_path / "run"
    run_train(data_dir, out, 2, "--max-steps", "10", "--checkpoint-every", "5", "--checkpoint-mode", "dcp")
    done = run_train(data_dir, out, resume_nproc, "--max-steps", "20", "--checkpoint-every", "5",
                     "--checkpoint-mode", "dcp")
    assert "resumed from step 10" in done.stdout + done.stderr
    assert complete_steps(out / "checkpoints")[-1] == 20
    losses = train_losses(out)
    assert all(torch.isfinite(torch.tensor(losses)))


@pytest.mark.parametrize("flags, message", [
    (["--config", '{"loader": {"batch_size": 0}}'], "loader.batch_size=0"),
    (["--config", '{"optim": {"lr": -1}}'], "optim.lr=-1"),
    (["--config", '{"loader": {"batch_size": 100000}}'], "lower loader.batch_size"),
    (["--config", '{"nope": {}}'], "unknown config section 'nope'"),
    (["--checkpoint-mode", "dcp", "--config", "{not json"], "not valid JSON"),
])
def test_bad_config_is_rejected_before_any_process_group(data_dir, tmp_path, flags, message):
    cmd = [sys.executable, "-m", "traincore.train", "--data", str(data_dir), "--output", str(tmp_path / "o"),
           "--preset", "debug", *flags]
    # A process-group start would need MASTER_ADDR and block; the error must come first.
    env = {**os.environ, "WORLD_SIZE": "2", "RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 2
    assert message in done.stderr
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("name", ["small_cnn", "resnet18"])
def test_a_batch_of_one_is_refused_where_batch_norm_sees_one_value_per_channel(name):
    # small_cnn pools 4x4 samples down to 1x1, resnet18 16x16 ones: BatchNorm then normalises over the batch
    # alone. Our own models check on CPU zeros, torchvision's on the meta device; both must refuse.
    model, size = ModelConfig(name=name, width=8), 4 if name == "small_cnn" else 16
    check_model_input(model, 3, (1, size, size), "the data", batch_size=2)
    with pytest.raises(ValueError, match=rf"model.name='{name}' cannot take the data: samples of shape "
                       rf"\(1, {size}, {size}\) in batches of 1 \(Expected more than 1 value per channel"):
        check_model_input(model, 3, (1, size, size), "the data", batch_size=1)


def test_images_too_small_for_the_model_are_refused():
    with pytest.raises(ValueError, match=r"model.name='small_cnn' cannot take 2x2 data: .*Output size is too "
                       "small.*stage the data with a larger data.image_size"):
        check_model_input(ModelConfig(name="small_cnn", width=8), 3, (1, 2, 2), "2x2 data")
    # Trains on a batch of 1 without BatchNorm, whatever the image size.
    check_model_input(ModelConfig(name="mlp", width=8), 3, (1, 2, 2), "2x2 data", batch_size=1)


def test_missing_data_directory_is_a_clear_error(tmp_path):
    cmd = [sys.executable, "-m", "traincore.train", "--data", str(tmp_path / "absent"),
           "--output", str(tmp_path)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "is not a staged dataset" in done.stderr


def test_a_trainer_is_complete_once_built_and_restores_process_settings(data_dir, tmp_path):
    """Built = ready (parts up, checkpoint loaded); closing restores deterministic mode and the root
    logger, so a process that trains in-process keeps its own settings."""
    import logging

    from traincore.config.schema import Config
    from traincore.run.trainer import Trainer

    cfg = Config().with_overrides({**TINY, "data": {"source": "synthetic"}, "train": {"max_steps": 4,
                                   "deterministic": True}, "checkpoint": {"every": 2}})
    root = logging.getLogger()
    def process_settings():
        return torch.are_deterministic_algorithms_enabled(), list(root.handlers), root.level

    before = process_settings()
    assert not before[0]
    first = Trainer(cfg, data_dir, tmp_path / "run")
    assert torch.are_deterministic_algorithms_enabled()  # for the run only
    assert first.resumed_from is None and first.progress.step == 0
    assert {"model", "optimizer", "telemetry"} <= set(first.registry.shared)
    assert first.train().steps == 4
    assert process_settings() == before
    with pytest.raises(RuntimeError, match="build a new Trainer"):
        first.train()
    with Trainer(cfg.with_overrides({"train.max_steps": 6}), data_dir, tmp_path / "run") as second:
        assert second.resumed_from == 4 and second.progress.step == 4  # loaded at construction
    assert process_settings() == before
