"""Successive halving: every trial trains to the first rung's budget; the best 1/reduction of them go on,
from their own checkpoints, to the next rung's; the last rung's budget is the whole run.

With 8 trials, 3 rungs and reduction 2 over max_steps M: budgets M/4, M/2, M for 8, 4 and 2 trials, which
spends 8 M/4 + 4 M/4 + 2 M/2 = 4 M steps, half of the 8 M that training every trial to the end would.
"""

from __future__ import annotations

import math

from traincore.checkpoint import HIGHER_IS_BETTER


def rung_budgets(max_steps: int, rungs: int, reduction: int) -> list[int]:
    """The step each rung trains its trials to, the last one ``max_steps``; ValueError naming the inputs
    when the first rung would train less than one step."""
    if rungs < 1 or reduction < 2:
        raise ValueError(f"rungs={rungs} and reduction={reduction}: a search needs rungs >= 1 and a "
                         "reduction >= 2 (the share of trials a rung keeps is 1/reduction)")
    budgets = [max_steps // reduction ** (rungs - 1 - rung) for rung in range(rungs)]
    if budgets[0] < 1:
        raise ValueError(f"rungs={rungs} with reduction {reduction} give the first rung max_steps / "
                         f"{reduction ** (rungs - 1)} = {max_steps / reduction ** (rungs - 1):g} steps: "
                         f"lower rungs, or raise max_steps to at least {reduction ** (rungs - 1)}")
    return budgets


def rung_sizes(trials: int, rungs: int, reduction: int) -> list[int]:
    """How many trials each rung trains: all of them, then 1/reduction of the previous rung's (at least
    one)."""
    sizes = [trials]
    for _ in range(rungs - 1):
        sizes.append(max(1, math.ceil(sizes[-1] / reduction)))
    return sizes


def survivors(values: dict[int, float], keep: int, metric: str) -> list[int]:
    """The ``keep`` trials with the best ``metric`` (ties: the lower trial number), best first."""
    sign = -1 if HIGHER_IS_BETTER[metric] else 1
    return sorted(values, key=lambda trial: (sign * values[trial], trial))[:keep]


def steps_spent(budgets: list[int], sizes: list[int]) -> int:
    """Steps a search of these rungs trains across all its trials (each rung continues from the last)."""
    previous = [0, *budgets[:-1]]
    rungs = zip(sizes, budgets, previous, strict=True)
    return sum(size * (budget - before) for size, budget, before in rungs)
