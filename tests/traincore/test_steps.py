"""One training step and the schedule, in one process."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from traincore.config import Config, OptimConfig, TrainConfig
from traincore.presets import debug
from traincore.steps import NonFiniteLossError, total_steps, train_step, warmup_cosine


def test_warmup_then_cosine_to_the_floor():
    cfg = Config(optim=OptimConfig(warmup_steps=4, min_lr_ratio=0.1))
    factor = warmup_cosine(cfg, steps=20)
    assert [factor(s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert factor(4) == pytest.approx(1.0)
    assert factor(12) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert factor(20) == pytest.approx(0.1)
    assert all(factor(s) >= factor(s + 1) for s in range(4, 20))


def test_total_steps_from_epochs_or_max_steps():
    assert total_steps(Config(train=TrainConfig(epochs=3, max_steps=0)), steps_per_epoch=7) == 21
    assert total_steps(Config(train=TrainConfig(epochs=3, max_steps=5)), steps_per_epoch=7) == 5


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
    with pytest.raises(NonFiniteLossError, match="step 1.*lower optim.lr"):
        train_step(model, optimizer, scheduler, [batch], debug())
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name]), name


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
