"""The run's state registry and the Stateful views of its parts.

Everything with state registers here under a name; the checkpointer saves and restores the registry without
knowing its members (as TorchTitan's checkpointer does with its dict of Stateful objects), so adding a
component never edits the checkpointer. A member is either shared (the same on every rank: model, optimizer,
schedule, loader position, telemetry totals) or per-rank (RNG streams), which rank 0 gathers.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from traincore.run.dist import broadcast_buffers

log = logging.getLogger(__name__)


class Stateful(Protocol):
    """Anything that can be checkpointed: a state_dict of plain values and tensors, and its inverse."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


def unwrap_model(model: nn.Module) -> nn.Module:
    """The module that DistributedDataParallel / torch.compile wrap: its parameter names are canonical."""
    while True:
        if isinstance(model, DistributedDataParallel):
            model = model.module
        elif isinstance(getattr(model, "_orig_mod", None), nn.Module):
            model = model._orig_mod
        else:
            return model


# torch.distributed.checkpoint.state_dict is imported where it is used, not with this module: importing it
# loads the whole torch.distributed.checkpoint package (DTensor, sympy: most of a second), which a run pays
# only once it saves or loads a checkpoint.


def _options(full: bool, offload: bool = False) -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=full, cpu_offload=offload)


def holds_shards(state: Any) -> bool:
    """Whether a (nested) state holds DTensors, the shards of a sharded (FSDP) run, or full tensors only."""
    from torch.distributed.tensor import DTensor

    if isinstance(state, dict):
        return any(holds_shards(value) for value in state.values())
    if isinstance(state, (list, tuple)):
        return any(holds_shards(value) for value in state)
    return isinstance(state, DTensor)


def reshards(model: nn.Module, state: Any) -> bool:
    """Whether loading ``state`` into ``model`` takes full tensors onto a sharded (FSDP) model: those are
    split onto this rank's shards (``full_state_dict`` loading); anything else loads as it is."""
    return any(holds_shards(p) for p in model.parameters()) and not holds_shards(state)


class ModelState:
    """The model's weights under canonical names, whatever wraps it (DDP, FSDP, torch.compile).

    ``state_dict`` is this rank's view: full tensors under DDP, this rank's shards (DTensors) under FSDP;
    ``full_state_dict`` gathers the whole model onto rank 0's CPU (empty elsewhere), for a checkpoint
    that one process writes. ``load_state_dict`` takes either: full tensors are resharded onto this run.
    """

    def __init__(self, model: nn.Module):
        self.model = model

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        broadcast_buffers(self.model)  # one copy of each buffer is saved: rank 0's, on every rank
        return get_model_state_dict(unwrap_model(self.model))

    def full_state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        broadcast_buffers(self.model)
        return get_model_state_dict(unwrap_model(self.model), options=_options(True, offload=True))

    def load_state_dict(self, state: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_model_state_dict

        model = unwrap_model(self.model)
        set_model_state_dict(model, state, options=_options(reshards(model, state)))


def load_model_tensors(model: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Copy full tensors, by canonical name, into ``model`` whatever wraps or shards it (a warm start's
    partial load: the model's other tensors keep their values). Every rank passes the same tensors."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    bare = unwrap_model(model)
    set_model_state_dict(bare, tensors,
                         options=StateDictOptions(full_state_dict=reshards(bare, tensors), strict=False))


class OptimizerState:
    """The optimizer's state keyed by parameter names (reshardable), not by position; full or sharded as
    :class:`ModelState` describes."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer):
        self.model, self.optimizer = model, optimizer

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        return get_optimizer_state_dict(unwrap_model(self.model), self.optimizer)

    def full_state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        return get_optimizer_state_dict(unwrap_model(self.model), self.optimizer,
                                        options=_options(True, offload=True))

    def load_state_dict(self, state: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        model = unwrap_model(self.model)
        set_optimizer_state_dict(model, self.optimizer, state, options=_options(reshards(model, state)))


class RNGState:
    """Python, NumPy, torch CPU and CUDA generator states of this process (a per-rank member)."""

    def state_dict(self) -> dict[str, Any]:
        kind, keys, *rest = np.random.get_state()
        on_cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
        return {"python": random.getstate(), "numpy": [kind, keys.tolist(), *rest],
                "torch": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state_all() if on_cuda else []}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        random.setstate(state["python"])
        kind, keys, *rest = state["numpy"]
        np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), *rest))
        torch.set_rng_state(state["torch"])
        if state["cuda"] and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(state["cuda"])


@dataclass
class Progress:
    """How far the run is: the number of optimizer steps taken."""

    step: int = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])


@dataclass
class RunMeta:
    """What the run trains on and with (config, classes, sample shape, normalisation): export rebuilds the
    model from it, and a resume refuses a checkpoint of other data."""

    meta: dict[str, Any] = field(default_factory=dict)

    def state_dict(self) -> dict[str, Any]:
        return dict(self.meta)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # The record is this run's own, but for where the weights started: the run that began them loaded
        # model.init_from (traincore.model.warmstart), and a resumed run carries that on. Whether a saved
        # record
        # fits the run is decided before any member is loaded (traincore.checkpoint.check_fit).
        self.meta.pop("init", None)
        if "init" in state:
            self.meta["init"] = state["init"]


class StateRegistry:
    """Named Stateful members of one run, saved and restored as a whole."""

    def __init__(self) -> None:
        self.shared: dict[str, Stateful] = {}
        self.per_rank: dict[str, Stateful] = {}

    def register(self, name: str, member: Stateful, per_rank: bool = False) -> None:
        """Add ``member`` under ``name``; names are unique across shared and per-rank members."""
        assert name not in self.shared and name not in self.per_rank, f"state {name!r} registered twice"
        (self.per_rank if per_rank else self.shared)[name] = member

    def shared_state(self, full: bool = False) -> dict[str, Any]:
        """The shared members' states, in registration order. ``full``: sharded members (model and
        optimizer under FSDP) gathered whole onto rank 0 (``full_state_dict``), for a one-writer save."""
        return {name: member.full_state_dict() if full and hasattr(member, "full_state_dict")
                else member.state_dict() for name, member in self.shared.items()}

    def rank_state(self) -> dict[str, Any]:
        """This rank's per-rank members' states."""
        return {name: member.state_dict() for name, member in self.per_rank.items()}

    def load(self, shared: dict[str, Any], rank: dict[str, Any] | None) -> None:
        """Restore every member; ``rank`` is None when saved per-rank states cannot be matched to ranks.

        A member the checkpoint lacks (written before the member existed) keeps its current state.
        """
        for members, states in ((self.shared, shared), (self.per_rank, rank)):
            for name, member in members.items():
                if states is None or name not in states:
                    log.info("the checkpoint holds no %s state; keeping the current one", name)
                    continue
                member.load_state_dict(states[name])


def training_registry(model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Stateful,
                      loader: Stateful, progress: Progress, meta: dict[str, Any]) -> StateRegistry:
    """The registry of a training run's core parts, under the names every checkpoint uses.

    The Trainer adds its telemetry; anything else with state is one more ``register`` call.
    """
    registry = StateRegistry()
    members = {"run": RunMeta(meta), "progress": progress, "model": ModelState(model),
               "optimizer": OptimizerState(model, optimizer), "scheduler": scheduler, "loader": loader}
    for name, member in members.items():
        registry.register(name, member)
    registry.register("rng", RNGState(), per_rank=True)
    return registry
