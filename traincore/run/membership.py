"""Node ranges and the membership changes of an elastic run.

A range ``MIN:MAX`` of nodes (torchrun's ``--nnodes``, the workflow's ``nnodes`` input) lets torch elastic
go on with fewer nodes when one is lost and take one back when it returns. The run keeps its global batch
across such changes: :func:`elastic_config` fixes ``train.global_batch`` at the largest world, and
:func:`check_node_range` refuses a range where some node count cannot split it into whole batches.

A membership change: the world a run resumes at is not the one its checkpoint was saved at. torch elastic
re-forms the workers when a node is lost (the survivors, at no fewer than the range's
minimum) or when one arrives (at the next restart of the workers); each time, every worker starts afresh
and resumes from the last committed checkpoint, which reshards to the new world (traincore.checkpoint), and
the loader's position, being world-size independent, continues the same sample order. What changes is how
the global batch is split: :func:`traincore.run.steps.accumulation`.

:class:`Membership` is the run's record of the world it trains at, saved with every checkpoint; the worker
that loads one saved at another world size reports the change once, at its first step: one ``membership:``
line and one record of kind "membership" (old and new world size, the step resumed from, the steps trained
again since it, the seconds from the last step before the change to the first after it).
"""

from __future__ import annotations

import math

from traincore.config import Config, ConfigError


class Membership:
    """The world size of the run, saved with every checkpoint; a resume at another size is a change."""

    def __init__(self, world_size: int, global_batch: int):
        self.world_size, self.global_batch = world_size, global_batch
        self.saved_world_size: int | None = None  # the loaded checkpoint's, once one is loaded
        # Over the whole run (restored on resume): changes, steps trained again, seconds from the last step
        # before each change to the first after it.
        self.changes, self.steps_redone, self.seconds_lost = 0, 0, 0.0

    def state_dict(self) -> dict[str, float]:
        return {"world_size": self.world_size, "changes": self.changes, "steps_redone": self.steps_redone,
                "seconds_lost": self.seconds_lost}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.saved_world_size = int(state["world_size"])
        self.changes, self.steps_redone = int(state["changes"]), int(state["steps_redone"])
        self.seconds_lost = float(state["seconds_lost"])
        if self.changed:
            self.changes += 1

    @property
    def changed(self) -> bool:
        """Whether the loaded checkpoint was saved at another world size."""
        return self.saved_world_size is not None and self.saved_world_size != self.world_size

    def record(self, resumed_from: int, last: tuple[int, float] | None,
               first_step_time: float) -> dict[str, float]:
        """The change as one record, and its line on stdout. ``last`` is the (step, time) of the newest
        step the earlier attempt logged (telemetry.log_every apart, so the steps trained again are counted to
        that), None where its metrics are not in this output directory (its main rank was on a lost node)."""
        redone = max(last[0] - resumed_from, 0) if last else -1
        lost = first_step_time - last[1] if last else -1.0
        if last:
            self.steps_redone, self.seconds_lost = self.steps_redone + redone, self.seconds_lost + lost
        record = {"old_world_size": self.saved_world_size, "new_world_size": self.world_size,
                  "resumed_from": resumed_from, "steps_redone": redone, "seconds_lost": round(lost, 3),
                  "global_batch": self.global_batch, "changes": self.changes}
        since = (f"{redone} step(s) trained again, {lost:.1f} s from the last step before the change to the "
                 "first after it" if last else "the earlier attempt's metrics are not in this output "
                 "directory, so the steps trained again and the time lost are unknown")
        print(f"membership: world size {self.saved_world_size} -> {self.world_size}, resumed from step "
              f"{resumed_from} with the global batch at {self.global_batch}: {since}", flush=True)
        return record



def node_range(text: str | int) -> tuple[int, int]:
    """(MIN, MAX) nodes from ``"N"`` (a fixed count) or ``"MIN:MAX"``; ValueError naming the problem."""
    parts = str(text).strip().split(":")
    form = "give a node count N (e.g. 2) or a range MIN:MAX with 1 <= MIN <= MAX (e.g. 1:2)"
    if len(parts) > 2 or not all(part.strip().isdigit() for part in parts):
        raise ValueError(f"nnodes={text!r} is not a node count: {form}")
    low, high = int(parts[0]), int(parts[-1])
    if low < 1 or high < low:
        raise ValueError(f"nnodes={text!r} is invalid: {form}")
    return low, high


def elastic_config(cfg: Config, nodes: tuple[int, int], nproc_per_node: int) -> Config:
    """``cfg`` for a run on ``nodes`` (MIN, MAX) of ``nproc_per_node`` processes: with a range and no
    train.global_batch, the global batch of the largest world (train.grad_accum_steps folded into it), so
    a smaller world accumulates instead of training on smaller steps. Checked by :func:`check_node_range`."""
    low, high = nodes
    if low == high or cfg.train.global_batch:
        check_node_range(cfg, nodes, nproc_per_node)
        return cfg
    global_batch = cfg.loader.batch_size * nproc_per_node * high * cfg.train.grad_accum_steps
    cfg = cfg.with_overrides({"train": {"global_batch": global_batch, "grad_accum_steps": 1}})
    check_node_range(cfg, nodes, nproc_per_node)
    return cfg


def check_node_range(cfg: Config, nodes: tuple[int, int], nproc_per_node: int) -> None:
    """ConfigError unless train.global_batch (when set) is a whole number of batches of loader.batch_size
    at every node count of ``nodes``, as :func:`traincore.run.steps.accumulation` needs."""
    global_batch, batch = cfg.train.global_batch, cfg.loader.batch_size
    if not global_batch:
        return
    counts = range(nodes[0], nodes[1] + 1)
    bad = [n for n in counts if global_batch % (batch * nproc_per_node * n)]
    if bad:
        multiple = math.lcm(*(batch * nproc_per_node * n for n in counts))
        raise ConfigError(
            f"train.global_batch={global_batch} cannot be split into whole batches of loader.batch_size="
            f"{batch} on {', '.join(map(str, bad))} node(s) of {nproc_per_node} process(es), which nnodes="
            f"{nodes[0]}:{nodes[1]} allows: set train.global_batch to a multiple of {multiple}, or narrow "
            "the range")
