"""A model factory of the user's (model.name ``"<module>:<callable>"``): imported, called with the arguments
it takes, and fitted to the staged data where it cannot take them.

The factory gets ``num_classes``, ``in_channels`` and ``image_size`` (from the staged data) where its
signature names them or takes ``**kwargs``, and ``model.kwargs`` as they are. A ``**kwargs`` factory that
hands them on to a class that rejects one (torchvision's builders: ``resnet18(**kwargs)`` passes them to
``ResNet``, which takes ``num_classes`` only) is called again without it. Where the factory took no
``in_channels``, a first layer that is a ``Conv2d`` for another channel count (torchvision's are for RGB) is
replaced by one for the data's; where it took no ``num_classes``, a last layer that is a ``Linear`` of
another width is replaced by one of ``num_classes`` outputs. Both replacements are freshly initialised and
logged; the rest of the model is the factory's.
"""

from __future__ import annotations

import inspect
import logging
import re
from collections.abc import Callable
from typing import Any

from torch import nn
from torch.nn.modules.lazy import LazyModuleMixin

from traincore.config import ModelConfig
from traincore.imports import import_callable, import_module, no_exit

log = logging.getLogger(__name__)

_REJECTED = re.compile(r"unexpected keyword argument '(\w+)'")


class ModelImportError(ValueError):
    """An imported model factory cannot be imported, called or does not return a module; the message names
    its import path and the fix."""


def import_factory(name: str) -> Callable[..., Any]:
    """The model factory ``"<module>:<callable>"`` names; ModelImportError naming it and the fix."""
    return import_callable(name, f"model.name={name!r}", ModelImportError)


def build_imported(cfg: ModelConfig, in_channels: int, num_classes: int, image_size: int) -> nn.Module:
    """The model ``cfg.name``'s factory returns for data of ``in_channels`` channels, ``image_size`` pixels
    and ``num_classes`` classes, fitted to them where the factory could not take them."""
    factory = import_factory(cfg.name)
    data = {"num_classes": num_classes, "in_channels": in_channels, "image_size": image_size}
    model, taken = _call(factory, cfg, {key: value for key, value in data.items() if _takes(factory, key)})
    if not isinstance(model, nn.Module):
        raise ModelImportError(f"model.name={cfg.name!r}: {_spelled(cfg.name, taken, cfg.kwargs)} returned a "
                               f"{type(model).__name__}, not a torch.nn.Module: return the model itself")
    if "in_channels" not in taken:
        _fit_stem(model, cfg.name, in_channels)
    if "num_classes" not in taken:
        _fit_head(model, cfg.name, num_classes)
    return model


def _takes(factory: Callable[..., Any], argument: str) -> bool:
    """Whether ``factory``'s signature names ``argument`` or takes ``**kwargs`` (or cannot be read)."""
    try:
        parameters = inspect.signature(factory).parameters
    except (TypeError, ValueError):  # a builtin without a signature: offer everything
        return True
    keyword = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return ((argument in parameters and parameters[argument].kind in keyword)
            or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()))


def _call(factory: Callable[..., Any], cfg: ModelConfig,
          offered: dict[str, int]) -> tuple[Any, dict[str, int]]:
    """Call ``factory`` with ``offered`` and ``cfg.kwargs``; an offered argument that a ``**kwargs`` factory
    passes on to something that rejects it is withdrawn and the call repeated. The result and the data
    arguments it took."""
    while True:
        try:
            return factory(**offered, **cfg.kwargs), offered
        except ModelImportError:  # the factory called sys.exit (traincore.imports.no_exit)
            raise
        except TypeError as exc:
            rejected = _REJECTED.search(str(exc))
            if rejected is None or rejected.group(1) not in offered:
                raise _failed(cfg, offered, exc) from exc
            offered = {key: value for key, value in offered.items() if key != rejected.group(1)}
        except Exception as exc:  # the factory is the user's code
            raise _failed(cfg, offered, exc) from exc


def _failed(cfg: ModelConfig, offered: dict[str, int], exc: Exception) -> ModelImportError:
    return ModelImportError(f"model.name={cfg.name!r}: {_spelled(cfg.name, offered, cfg.kwargs)} raised "
                            f"{type(exc).__name__}: {exc}: fix the factory or model.kwargs")


def _spelled(name: str, offered: dict[str, int], kwargs: dict) -> str:
    arguments = {**offered, **kwargs}
    return f"{name}({', '.join(f'{key}={value!r}' for key, value in arguments.items())})"


def _end_layer(model: nn.Module, last: bool) -> tuple[str, nn.Module] | None:
    """The first (or last) module, in registration order, that holds parameters of its own, with its
    qualified name; None when there is none, or it is lazy (``nn.LazyConv2d`` fits its first input)."""
    layers = [(name, module) for name, module in model.named_modules()
              if any(True for _ in module.parameters(recurse=False))]
    if not layers or isinstance(layers[-1 if last else 0][1], LazyModuleMixin):
        return None
    return layers[-1 if last else 0]


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent), leaf, new)


def _fit_stem(model: nn.Module, factory: str, channels: int) -> None:
    """Replace a first ``Conv2d`` made for another channel count by one for ``channels``."""
    found = _end_layer(model, last=False)
    if found is None or not isinstance(found[1], nn.Conv2d) or found[1].in_channels == channels:
        return  # not a convolution this can refit: the preflight forward judges the model as it is
    name, conv = found
    if conv.groups != 1:
        raise ModelImportError(
            f"model.name={factory!r}: the factory takes no in_channels and its first layer {name} is a "
            f"grouped Conv2d for {conv.in_channels} channels, which cannot be refit to the data's "
            f"{channels}: write a factory of your own that takes in_channels and builds that layer for them "
            "(docs/own-model.md)")
    _replace(model, name, nn.Conv2d(channels, conv.out_channels, conv.kernel_size, conv.stride, conv.padding,
                                    conv.dilation, bias=conv.bias is not None, padding_mode=conv.padding_mode,
                                    device=conv.weight.device, dtype=conv.weight.dtype))
    log.info("model.name=%r takes no in_channels: its first layer %s (a Conv2d for %d channels) is replaced "
             "by a fresh one for the data's %d", factory, name, conv.in_channels, channels)


def _fit_head(model: nn.Module, factory: str, num_classes: int) -> None:
    """Replace a last ``Linear`` of another width by one of ``num_classes`` outputs."""
    found = _end_layer(model, last=True)
    if found is None or not isinstance(found[1], nn.Linear) or found[1].out_features == num_classes:
        return  # the preflight forward checks the logits' shape
    name, head = found
    _replace(model, name, nn.Linear(head.in_features, num_classes, bias=head.bias is not None,
                                    device=head.weight.device, dtype=head.weight.dtype))
    log.info("model.name=%r takes no num_classes: its last layer %s (a Linear of %d outputs) is replaced "
             "by a fresh one of %d", factory, name, head.out_features, num_classes)


def hooked_units(model: nn.Module, name: str) -> list[nn.Module] | None:
    """What the ``shard_units(model)`` of the factory's module returns, or None when it defines none;
    ModelImportError naming it when it raises, exits or returns modules that are not part of ``model``."""
    setting = f"model.name={name!r}"
    hook = getattr(import_module(name.partition(":")[0], setting, ModelImportError), "shard_units", None)
    if not callable(hook):
        return None
    try:
        with no_exit(f"{setting}: its module's shard_units(model)", ModelImportError):
            units = list(hook(model))
    except ModelImportError:
        raise
    except Exception as exc:  # the hook is the user's code
        raise ModelImportError(f"{setting}: its module's shard_units(model) raised {type(exc).__name__}: "
                               f"{exc}: fix it, or remove it to shard by the default units") from exc
    strays = [type(unit).__name__ for unit in units
              if not any(unit is module for module in model.modules())]
    if strays:
        raise ModelImportError(f"{setting}: its module's shard_units returned modules that are not part of "
                               f"the model ({', '.join(strays)}): return submodules of it")
    return units
