"""One training step and the schedule, in one process."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from traincore.config.presets import debug
from traincore.config.schema import Config, ConfigError, LoaderConfig, TrainConfig
from traincore.run.cli import main
from traincore.run.preflight import preflight
from traincore.run.steps import (
    NonFiniteLossError,
    check_step_fits_epoch,
    total_steps,
    train_step,
)


def test_total_steps_from_epochs_or_max_steps():
    assert total_steps(Config(train=TrainConfig(epochs=3, max_steps=0)), steps_per_epoch=7) == 21
    assert total_steps(Config(train=TrainConfig(epochs=3, max_steps=5)), steps_per_epoch=7) == 5
    # 3 epochs of 7 batches, 2 to a step: 10 steps read 20 of the 21 batches (not 3 x 3 steps, 18 batches).
    assert total_steps(Config(train=TrainConfig(epochs=3, max_steps=0, grad_accum_steps=2)), 7) == 10


def _accumulating(accum: int, batch_size: int = 64, **train) -> Config:
    """Batches of ``batch_size``, ``accum`` to a step, for 1 epoch unless ``train`` says otherwise."""
    length = {"epochs": 1, "max_steps": 0} | train
    return Config(loader=LoaderConfig(batch_size=batch_size),
                  train=TrainConfig(grad_accum_steps=accum, **length))


@pytest.mark.parametrize("train", [{}, {"max_steps": 3, "epochs": 0}])
def test_a_step_of_more_batches_than_an_epoch_is_refused(train):
    # 1 batch per epoch, 22 to a step: "1 epoch" would have been one step over 22 epochs of samples.
    refused = (r"train.grad_accum_steps=22 batches per optimizer step exceed the 1 batch\(es\) of "
               r"loader.batch_size=64 per process in an epoch of the training split: .*lower "
               r"train.grad_accum_steps to at most 1")
    with pytest.raises(ConfigError, match=refused):
        total_steps(_accumulating(22, **train), steps_per_epoch=1)
    assert total_steps(_accumulating(2, **train), steps_per_epoch=2) == train.get("max_steps", 1)


def test_the_samples_of_one_step_must_fit_the_training_split(monkeypatch, synthetic_dir):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    check_step_fits_epoch(_accumulating(5, batch_size=16), 80, "data")  # 80 samples: 5 batches of 16
    refused = (r"train.grad_accum_steps=22 x loader.batch_size=64 x 1 process\(es\) = 1408 samples per "
               r"optimizer step exceed the 80 training samples in data: .*; lower train.grad_accum_steps to "
               r"at most 1, or stage more")
    with pytest.raises(ConfigError, match=refused):
        check_step_fits_epoch(_accumulating(22), 80, "data")
    monkeypatch.setenv("WORLD_SIZE", "4")  # under torchrun: the whole world's batches count
    with pytest.raises(ConfigError, match=r"3 x loader.batch_size=8 x 4 process\(es\) = 96 samples .* 2,"):
        check_step_fits_epoch(_accumulating(3, batch_size=8), 80, "data")
    monkeypatch.delenv("WORLD_SIZE")
    with pytest.raises(ConfigError, match=r"x 4 process\(es\) = 96 samples"):  # a launcher's worker count
        check_step_fits_epoch(_accumulating(3, batch_size=8), 80, "data", world_size=4)
    # 500 processes on 80 samples: no batch size fixes it alone, so the processes are named too.
    with pytest.raises(ConfigError, match=r"lower loader.batch_size, or run fewer than 500 processes, or "
                                          r"stage"):
        check_step_fits_epoch(_accumulating(1, batch_size=1), 80, "data", world_size=500)
    # Preflight refuses it before any worker starts (synthetic_dir: 80 training samples).
    cfg = debug().with_overrides({"loader.batch_size": 64, "train.grad_accum_steps": 22})
    with pytest.raises(ConfigError, match=f"= 1408 samples per optimizer step exceed the 80 training samples "
                                          f"in {synthetic_dir}"):
        preflight(cfg, synthetic_dir)


class _Poisoned(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 3)

    def forward(self, x):
        return self.linear(x) * float("nan")


def _parts(model: nn.Module) -> tuple:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return model, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)


def test_non_finite_loss_stops_before_the_optimizer_step():
    model, optimizer, scheduler = _parts(_Poisoned())
    before = {k: v.clone() for k, v in model.state_dict().items()}
    batch = (torch.randn(5, 4), torch.tensor([0, 1, 2, 0, 1]))
    with pytest.raises(NonFiniteLossError) as info:
        train_step(model, optimizer, scheduler, [batch], debug())
    # Before any update a learning rate cannot be the cause: the model or its inputs are.
    message = str(info.value)
    assert message.startswith("the loss is nan at step 1, before any optimizer update: the model "
                              "(model.name='small_cnn') or its input already produces non-finite values")
    assert "check the model's forward and its initialisation" in message
    assert "mean and std in the staged manifest.json" in message and "optim.lr" not in message
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name]), name


def test_a_loss_that_turns_non_finite_after_updates_points_at_the_learning_rate():
    model = nn.Sequential(nn.Flatten(), nn.Linear(4, 3))
    model, optimizer, scheduler = _parts(model)
    batch = (torch.randn(5, 4), torch.tensor([0, 1, 2, 0, 1]))
    train_step(model, optimizer, scheduler, [batch], debug())
    with torch.no_grad():
        model[1].weight.fill_(float("inf"))  # what a too-large step does to the weights
    diverged = (r"the loss is nan at step 2, after 1 optimizer updates: training diverged; lower optim.lr "
                r"\(now 0.001\) or raise optim.warmup_steps \(now 2\)$")
    with pytest.raises(NonFiniteLossError, match=diverged):
        train_step(model, optimizer, scheduler, [batch], debug())


NAN_MODEL = """
from torch import nn


class Poisoned(nn.Module):
    def __init__(self, num_classes, in_channels, image_size):
        super().__init__()
        self.linear = nn.Linear(in_channels * image_size ** 2, num_classes)

    def forward(self, x):
        return self.linear(x.flatten(1)) * float("nan")


def build(num_classes, in_channels, image_size):
    return Poisoned(num_classes, in_channels, image_size)
"""


def test_a_model_that_gives_nan_at_once_is_one_error_line_from_the_cli(synthetic_dir, tmp_path, monkeypatch,
                                                                       capsys):
    (tmp_path / "poisoned.py").write_text(NAN_MODEL)
    monkeypatch.syspath_prepend(str(tmp_path))
    code = main(["--data", str(synthetic_dir), "--output", str(tmp_path / "run"), "--preset", "debug",
                 "--max-steps", "2", "--config", '{"model": {"name": "poisoned:build"}}'])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    [line] = [line for line in err.splitlines() if line.startswith("error:")]
    assert line.startswith("error: the loss is nan at step 1, before any optimizer update")


def test_train_step_updates_weights_and_lr():
    model = nn.Sequential(nn.Flatten(), nn.Linear(4, 3))
    model, optimizer, scheduler = _parts(model)
    before = model[1].weight.clone()
    loss = train_step(model, optimizer, scheduler, [(torch.randn(5, 4), torch.tensor([0, 1, 2, 0, 1]))],
                      debug())
    assert loss.ndim == 0 and not loss.requires_grad
    assert not torch.equal(before, model[1].weight)
    assert scheduler.last_epoch == 1
    assert all(p.grad is None for p in model.parameters())


def test_before_update_runs_once_per_step_right_before_the_weights_change():
    model = nn.Sequential(nn.Flatten(), nn.Linear(4, 3))
    model, optimizer, scheduler = _parts(model)
    initial = model[1].weight.clone()
    seen = []

    def before_update():  # the weights as the optimizer is about to update them, gradients in place
        seen.append((model[1].weight.clone(), model[1].weight.grad is not None))

    batch = (torch.randn(5, 4), torch.tensor([0, 1, 2, 0, 1]))
    train_step(model, optimizer, scheduler, [batch], debug(), before_update=before_update)
    assert len(seen) == 1 and seen[0][1]
    assert torch.equal(seen[0][0], initial)
    train_step(model, optimizer, scheduler, [batch], debug(), before_update=before_update)
    assert len(seen) == 2 and not torch.equal(seen[1][0], initial)


def test_before_update_is_not_reached_when_the_loss_is_not_finite():
    model, optimizer, scheduler = _parts(_Poisoned())
    calls = []
    with pytest.raises(NonFiniteLossError):
        train_step(model, optimizer, scheduler, [(torch.randn(5, 4), torch.tensor([0, 1, 2, 0, 1]))], debug(),
                   before_update=lambda: calls.append(1))
    assert calls == []
