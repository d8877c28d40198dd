"""train.overfit: the lifecycle's first check, a model fitting a few samples and measured on those."""

from __future__ import annotations

import pytest

from traincore.config import preset
from traincore.run import Trainer, preflight

TINY = {"model": {"name": "small_cnn", "width": 8}, "optim": {"lr": 1e-2, "warmup_steps": 2},
        "loader": {"batch_size": 8}, "telemetry": {"log_every": 10, "tensorboard": False}}


def test_a_model_fits_its_first_samples_and_is_measured_on_them(data_dir, tmp_path):
    cfg = preset("debug").with_overrides(TINY).with_overrides({"train.overfit": 16, "train.max_steps": 40})
    trainer = Trainer(cfg, data_dir, tmp_path / "run")
    assert len(trainer.loader.split) == 16 and trainer.val_split is trainer.loader.split
    assert (trainer.loader.split.labels == trainer.val_split.labels[:16]).all()
    summary = trainer.train()
    assert summary.val_accuracy == 1.0  # 16 samples learnt by heart: the model and the labels line up
    with pytest.raises(ValueError, match=r"loader.batch_size=8 exceeds the 4 training samples in .* "
                                         r"\(train.overfit=4\): lower loader.batch_size"):
        preflight(cfg.with_overrides({"train.overfit": 4}), data_dir)
    # More than the split: once capped in silence, training on all of it and validating on the training split.
    with pytest.raises(ValueError, match=r"train.overfit=100000 exceeds the \d+ training samples in .*: give "
                                         r"at most \d+, or 0 to train on the whole split"):
        preflight(cfg.with_overrides({"train.overfit": 100000}), data_dir)
