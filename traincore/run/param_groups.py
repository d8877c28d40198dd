"""Parameter groups by name (``optim.param_groups``): a learning-rate multiplier, or frozen.

The standard fine-tune, a new head at 10x the backbone's rate with the stem frozen::

    "optim.param_groups": [{"pattern": "fc.*", "lr_mult": 10}, {"pattern": "conv1.*", "freeze": true}]

Patterns are fnmatch patterns over the model's parameter names as ``named_parameters()`` of the bare model
gives them (what ``model.init_exclude`` matches too, less the buffers); a parameter takes the first group
whose pattern matches it, and the rest of the model keeps optim.lr. A frozen parameter gets
``requires_grad=False`` before the model is wrapped (DDP and FSDP2 leave it out of their gradient
reduction) and is in no optimizer group. The LR schedule multiplies each group's own rate, so a group keeps
its multiple of the schedule. A pattern that matches nothing is refused before any worker starts.
"""

from __future__ import annotations

from fnmatch import fnmatchcase

from torch import nn

from traincore.config import Config


def _group_of(name: str, groups: list[dict]) -> dict | None:
    return next((group for group in groups if fnmatchcase(name, group["pattern"])), None)


def check_param_groups(model: nn.Module, groups: list[dict]) -> None:
    """ValueError naming the first group whose pattern matches none of ``model``'s parameters (built on any
    device, e.g. preflight's meta model), with some of the names it could match."""
    names = [name for name, _ in model.named_parameters()]
    if names and all((_group_of(name, groups) or {}).get("freeze") for name in names):
        raise ValueError("optim.param_groups freeze every parameter of the model, so nothing would train: "
                         "narrow the frozen patterns")
    for index, group in enumerate(groups):
        if not any(fnmatchcase(name, group["pattern"]) for name in names):
            shown = ", ".join(names[:6]) + (", ..." if len(names) > 6 else "")
            raise ValueError(f"optim.param_groups[{index}] pattern {group['pattern']!r} matches no parameter "
                             f"of the model (its parameters: {shown}): fix the pattern, e.g. "
                             f"{names[-1].rsplit('.', 1)[0] + '.*' if names else 'fc.*'!r}")


def freeze(model: nn.Module, groups: list[dict]) -> int:
    """Set ``requires_grad=False`` on the bare model's parameters of a frozen group; their count."""
    frozen = 0
    for name, param in model.named_parameters():
        group = _group_of(name, groups)
        if group is not None and group.get("freeze"):
            param.requires_grad_(False)
            frozen += param.numel()
    return frozen


def optimizer_groups(model: nn.Module, cfg: Config) -> list[dict]:
    """The optimizer's parameter groups of ``model`` (bare: canonical names; its parameters may be sharded):
    the unmatched parameters at optim.lr first, then one group per lr_mult group, in config order; frozen
    parameters are left out."""
    groups = cfg.optim.param_groups
    members: dict[int, list] = {-1: []}
    for name, param in model.named_parameters():
        group = _group_of(name, groups)
        if group is None:
            members[-1].append(param)
        elif not group.get("freeze"):
            members.setdefault(groups.index(group), []).append(param)
    return [{"params": params, "lr": cfg.optim.lr * (groups[index]["lr_mult"] if index >= 0 else 1.0)}
            for index, params in sorted(members.items()) if params]
