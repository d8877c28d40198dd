"""The learning-rate schedules: the multiplier of optim.lr at each step."""

from __future__ import annotations

import math

import pytest
import torch

from traincore.config import ConfigError, preset
from traincore.run.schedule import lr_factor


def _factors(steps: int = 20, **optim) -> list[float]:
    factor = lr_factor(preset("debug").with_overrides({"optim": optim}), steps)
    return [factor(step) for step in range(steps + 1)]


def test_warmup_then_cosine_to_the_floor():
    f = _factors(warmup_steps=4, min_lr_ratio=0.1)
    assert f[:4] == [0.25, 0.5, 0.75, 1.0]
    assert f[4] == pytest.approx(1.0)
    assert f[12] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert f[20] == pytest.approx(0.1)
    assert all(f[s] >= f[s + 1] for s in range(4, 20))


def test_linear_constant_and_step_after_the_same_warmup():
    linear = _factors(warmup_steps=4, min_lr_ratio=0.2, schedule="linear")
    assert linear[:4] == [0.25, 0.5, 0.75, 1.0] and linear[12] == pytest.approx(0.6)
    assert linear[20] == pytest.approx(0.2)
    assert _factors(warmup_steps=4, schedule="constant")[4:] == [1.0] * 17
    step = _factors(warmup_steps=4, min_lr_ratio=0.0, schedule="step", step_milestones=[0.25, 0.5],
                    step_gamma=0.5)
    # 16 steps after warmup: x0.5 from 4 of them on, x0.25 from 8 on.
    assert step[4:8] == [1.0] * 4 and step[8:12] == [0.5] * 4 and step[12:] == [0.25] * 9
    assert min(_factors(warmup_steps=0, min_lr_ratio=0.05, schedule="step")) == 0.05  # never under the floor


def test_one_cycle_rises_from_a_25th_then_falls_to_the_floor():
    f = _factors(warmup_steps=5, min_lr_ratio=0.0, schedule="onecycle")
    assert f[0] == pytest.approx(1 / 25) and f[5] == pytest.approx(1.0) and f[20] == pytest.approx(0.0)
    assert all(f[s] < f[s + 1] for s in range(5)) and all(f[s] > f[s + 1] for s in range(5, 20))
    # Without warmup_steps the rise takes 30% of the run, as OneCycleLR's default.
    no_warmup = _factors(steps=100, warmup_steps=0, schedule="onecycle")
    assert max(range(101), key=no_warmup.__getitem__) == 30


@pytest.mark.parametrize(("optim", "message"), [
    ({"schedule": "exp"}, "optim.schedule='exp' is invalid: must be one of cosine, linear, step"),
    ({"step_milestones": [0.75, 0.5]}, "optim.step_milestones=[0.75, 0.5] is invalid: expected ascending"),
    ({"step_milestones": [0, 1]}, "optim.step_milestones=[0, 1] is invalid"),
    ({"step_gamma": 0}, "optim.step_gamma=0 is invalid: must be in (0, 1]"),
])
def test_bad_schedules_are_named(optim, message):
    with pytest.raises(ConfigError) as caught:
        preset("debug").with_overrides({"optim": optim})
    assert str(caught.value).startswith(message), caught.value


@pytest.mark.parametrize("schedule", ["cosine", "linear", "step", "constant", "onecycle"])
def test_every_schedule_resumed_from_its_state_gives_the_same_rates(schedule):
    """What a checkpoint keeps of a schedule is LambdaLR's step count: a schedule rebuilt and loaded from it
    at step 7 goes on with exactly the rates of one that never stopped (the whole runs that are killed and
    resumed bitwise cover cosine, step and one-cycle through every part of a checkpoint)."""
    cfg = preset("debug").with_overrides({"optim": {"schedule": schedule, "warmup_steps": 3}})

    def schedule_of(weights: torch.Tensor) -> torch.optim.lr_scheduler.LambdaLR:
        optimizer = torch.optim.SGD([weights], lr=0.1)
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor(cfg, 20))

    def rates(scheduler, steps: int) -> list[float]:
        taken = []
        for _ in range(steps):
            scheduler.optimizer.step()
            scheduler.step()
            taken.append(scheduler.get_last_lr()[0])
        return taken

    whole = rates(schedule_of(torch.zeros(1, requires_grad=True)), 20)
    first = schedule_of(torch.zeros(1, requires_grad=True))
    before = rates(first, 7)
    resumed = schedule_of(torch.zeros(1, requires_grad=True))
    resumed.load_state_dict(first.state_dict())
    assert before + rates(resumed, 13) == whole
    assert len(set(whole)) > 1  # warmup at least: the rates move
