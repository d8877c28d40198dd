"""An exponential moving average of the model's weights (``optim.ema_decay``), validated and exported in
place of the live weights when on.

After every optimizer step each averaged parameter moves ``1 - decay`` of the way to the live one (torch's
``get_ema_multi_avg_fn``: one fused lerp over all of them); buffers (BatchNorm statistics) are copied, as
timm's ModelEmaV3 does by default. The average is a second instance of the model, wrapped as the live one is
sharded (FSDP2: the same units on the same mesh, so each rank averages its own shards; DDP: a plain copy,
the same on every rank), and a checkpoint saves it as it saves the model (:class:`ModelState`: full or
sharded, resharded on load). torch.optim.swa_utils.AveragedModel, which wraps the same function, deep-copies
the module and keeps its own step counter beside it; here the copy is built sharded like the live model and
the run's own step counts.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.optim.swa_utils import get_ema_multi_avg_fn

from traincore.run.state import ModelState, unwrap_model


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a (possibly sharded) tensor, sharing its storage."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


class EMA:
    """The average of ``model``'s weights. ``sharded_copy`` builds a fresh model wrapped as ``model`` is
    sharded (None: the model is not sharded, and a copy of it is the average's start)."""

    def __init__(self, model: nn.Module, decay: float, sharded_copy: Callable[[], nn.Module] | None = None):
        self.decay, self.live = decay, unwrap_model(model)
        self._average = get_ema_multi_avg_fn(decay)
        self.model = sharded_copy() if sharded_copy is not None else copy.deepcopy(self.live)
        self.model.requires_grad_(False)
        self._pairs = [(_local(mine), _local(theirs)) for mine, theirs in
                       zip(self.model.parameters(), self.live.parameters(), strict=True)]
        self._buffers = list(zip(self.model.buffers(), self.live.buffers(), strict=True))
        self.copy_weights()

    @torch.no_grad()
    def copy_weights(self) -> None:
        """Make the average the live weights (its start, before the first step)."""
        for mine, theirs in [*self._pairs, *self._buffers]:
            mine.copy_(theirs)

    @torch.no_grad()
    def update(self) -> None:
        """Move the average towards the live weights after an optimizer step."""
        averaged, live = zip(*self._pairs, strict=True)
        self._average(list(averaged), list(live), None)
        for mine, theirs in self._buffers:
            mine.copy_(theirs)

    def state_dict(self) -> dict[str, Any]:
        return ModelState(self.model).state_dict()

    def full_state_dict(self) -> dict[str, Any]:
        return ModelState(self.model).full_state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        ModelState(self.model).load_state_dict(state)
