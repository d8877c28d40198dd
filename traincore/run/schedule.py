"""The learning-rate schedule: a multiplier of ``optim.lr`` for every step, a pure function of the step, so
LambdaLR's saved position (its step count) is all a resume needs to continue it bitwise.

``optim.schedule`` picks the shape after ``optim.warmup_steps`` of linear warmup from 0:
    cosine    half a cosine down to ``min_lr_ratio`` at the last step (the default)
    linear    a straight line down to ``min_lr_ratio`` at the last step
    step      x ``step_gamma`` at each of ``step_milestones`` (fractions of the steps after warmup), as
              torchvision's reference decays ResNets x0.1 every 30 of 90 epochs; never below min_lr_ratio
    constant  the peak until the end
    onecycle  Smith's one cycle as torch's OneCycleLR draws it: half a cosine up from lr/25 over the
              warmup (30% of the run when warmup_steps is 0), then half a cosine down to min_lr_ratio;
              the momentum is not cycled
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable

from traincore.config import Config

ONECYCLE_START = 1 / 25  # OneCycleLR's default div_factor
ONECYCLE_RISE = 0.3  # OneCycleLR's default pct_start, when warmup_steps is 0


def lr_factor(cfg: Config, steps: int) -> Callable[[int], float]:
    """The multiplier of optim.lr at each step (0-based) of a run of ``steps`` optimizer steps."""
    optim = cfg.optim
    floor, warmup = optim.min_lr_ratio, optim.warmup_steps
    if optim.schedule == "onecycle":
        return _one_cycle(warmup or max(1, round(ONECYCLE_RISE * steps)), steps, floor)
    decay = {"cosine": lambda p: floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * p)),
             "linear": lambda p: 1 - (1 - floor) * p,
             "constant": lambda p: 1.0,
             "step": lambda p: max(floor, optim.step_gamma ** bisect.bisect_right(optim.step_milestones, p))
             }[optim.schedule]

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return decay(min(1.0, (step - warmup) / max(1, steps - warmup)))

    return factor


def _one_cycle(rise: int, steps: int, floor: float) -> Callable[[int], float]:
    def factor(step: int) -> float:
        if step < rise:
            return _cosine_between(ONECYCLE_START, 1.0, step / rise)
        return _cosine_between(1.0, floor, min(1.0, (step - rise) / max(1, steps - rise)))

    return factor


def _cosine_between(start: float, end: float, progress: float) -> float:
    """From ``start`` (progress 0) to ``end`` (progress 1) along half a cosine."""
    return end + (start - end) * 0.5 * (1 + math.cos(math.pi * progress))
