"""The training recipe's knobs: optim.name (adamw, sgd with momentum and nesterov), train.label_smoothing."""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn.functional as F

from traincore.checkpoint import complete_steps, read_checkpoint, step_dir
from traincore.config.presets import debug
from traincore.config.schema import ConfigError, OptimConfig, TrainConfig
from traincore.run.steps import train_step
from traincore.run.trainer import Trainer, optimizer_and_schedule


def test_the_recipe_fields_are_checked():
    with pytest.raises(ConfigError, match="optim.name='lamb' is invalid: must be one of adamw, sgd"):
        OptimConfig(name="lamb")
    with pytest.raises(ConfigError, match="optim.nesterov=True is invalid: needs optim.momentum > 0"):
        OptimConfig(name="sgd", momentum=0.0, nesterov=True)
    with pytest.raises(ConfigError, match=r"train.label_smoothing=1.0 is invalid: must be in \[0, 1\)"):
        TrainConfig(label_smoothing=1.0)


def test_sgd_is_built_as_configured_and_the_loss_is_smoothed():
    cfg = debug().with_overrides({"optim": {"name": "sgd", "lr": 0.05, "momentum": 0.8, "nesterov": True,
                                            "weight_decay": 1e-4, "warmup_steps": 0},
                                  "train": {"label_smoothing": 0.2}})
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(12, 3))
    optimizer, scheduler = optimizer_and_schedule(cfg, model, 10)
    assert isinstance(optimizer, torch.optim.SGD)
    group = optimizer.param_groups[0]
    assert (group["momentum"], group["nesterov"], group["weight_decay"]) == (0.8, True, 1e-4)
    images, labels = torch.randn(8, 3, 2, 2), torch.randint(0, 3, (8,))
    with torch.no_grad():
        expected = F.cross_entropy(model(images), labels, label_smoothing=0.2)
        plain = F.cross_entropy(model(images), labels)
    loss = train_step(model, optimizer, scheduler, [(images, labels)], cfg)
    assert torch.allclose(loss, expected) and not torch.allclose(loss, plain)
    assert optimizer.state[model[1].weight]["momentum_buffer"] is not None


def test_an_sgd_run_with_label_smoothing_resumes_bitwise(synthetic_dir, tmp_path):
    cfg = debug().with_overrides({"optim": {"name": "sgd", "lr": 0.05, "nesterov": True},
                                  "train": {"label_smoothing": 0.1, "max_steps": 8},
                                  "checkpoint": {"every": 4, "mode": "dcp"},
                                  "telemetry": {"tensorboard": False}})
    whole = Trainer(cfg, synthetic_dir, tmp_path / "whole").train()
    # The same run stopped after its step-4 checkpoint (its step-8 one never written), then resumed.
    shutil.copytree(tmp_path / "whole", tmp_path / "split")
    shutil.rmtree(step_dir(tmp_path / "split" / "checkpoints", 8))
    resumed = Trainer(cfg, synthetic_dir, tmp_path / "split").train()
    assert resumed.resumed_from == 4 and whole.final_loss < 1.4  # 4 classes: ln 4 = 1.39 at chance
    a, _ = read_checkpoint(step_dir(tmp_path / "whole" / "checkpoints", 8))
    b, _ = read_checkpoint(step_dir(tmp_path / "split" / "checkpoints", 8))
    assert a.keys() == b.keys() and all(torch.equal(a[name], b[name]) for name in a)


MLP = {"model": {"name": "mlp", "width": 32}, "optim": {"warmup_steps": 0, "lr": 0.01},
       "telemetry": {"tensorboard": False}, "checkpoint": {"every": 2}}


def final_weights(output) -> dict[str, torch.Tensor]:
    root = output / "checkpoints"
    return read_checkpoint(step_dir(root, max(complete_steps(root))))[0]


def close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.allclose(a[n], b[n], rtol=1e-4, atol=1e-6) for n in a)


def test_accumulated_batches_make_the_step_of_one_batch_of_all_their_samples(synthetic_dir, tmp_path):
    """Two optimizer steps of 2 accumulated batches of 16 are two steps of batches of 32 (the same
    samples, in the same order), within float rounding, on a model without BatchNorm."""
    base = debug().with_overrides(MLP).with_overrides({"train.max_steps": 2})
    one = Trainer(base.with_overrides({"loader.batch_size": 32}), synthetic_dir, tmp_path / "one").train()
    accumulated = Trainer(base.with_overrides({"loader.batch_size": 16, "train.grad_accum_steps": 2}),
                          synthetic_dir, tmp_path / "accumulated").train()
    assert close(final_weights(tmp_path / "one"), final_weights(tmp_path / "accumulated"))
    assert abs(one.final_loss - accumulated.final_loss) < 1e-4
    differs = Trainer(base.with_overrides({"loader.batch_size": 16}), synthetic_dir, tmp_path / "16").train()
    assert not close(final_weights(tmp_path / "one"), final_weights(tmp_path / "16")), differs


@pytest.mark.parametrize("parallelism", ["ddp", "fsdp"])
def test_ranks_accumulate_locally_and_synchronise_once_per_step(synthetic_dir, forked_train, tmp_path,
                                                                parallelism):
    """Two workers of 2 accumulated batches of 8 each (no gradient sync but in the last backward) end where
    one process of 2 accumulated batches of 16 does; a kill after step 2 and a resume end bitwise where the
    uninterrupted two-worker run did."""
    base = debug().with_overrides(MLP).with_overrides({"train.max_steps": 4, "train.grad_accum_steps": 2})
    Trainer(base.with_overrides({"loader.batch_size": 16}), synthetic_dir, tmp_path / "one").train()
    config = MLP | {"loader": {"batch_size": 8}, "train": {"grad_accum_steps": 2}}
    flags = ("--parallelism", parallelism, "--max-steps", "4")
    printed = forked_train(synthetic_dir, tmp_path / "two", 2, *flags, config=config)
    assert "global batch 32 (2 accumulated batches of 16)" in printed
    assert close(final_weights(tmp_path / "one"), final_weights(tmp_path / "two"))
    shutil.copytree(tmp_path / "two", tmp_path / "resumed")
    shutil.rmtree(step_dir(tmp_path / "resumed" / "checkpoints", 4))  # killed before its last save
    printed = forked_train(synthetic_dir, tmp_path / "resumed", 2, *flags, config=config)
    assert "resumed from step 2" in printed, printed[-3000:]
    a, b = final_weights(tmp_path / "two"), final_weights(tmp_path / "resumed")
    assert all(torch.equal(a[name], b[name]) for name in a)
