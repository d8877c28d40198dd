"""Models by name, or from a factory of the user's. Input shape and class count come from the staged
manifest; nothing is downloaded.

An imported model (model.name ``"<module>:<callable>"``, docs/own-model.md) is built by calling
``callable(num_classes=..., in_channels=..., image_size=..., **model.kwargs)``, each of the first three where
the callable takes it (traincore.model.factory). FSDP shards it by :func:`default_units` unless its module
defines ``shard_units(model) -> list[nn.Module]``.
"""

from __future__ import annotations

import torch
from torch import nn

from traincore.config import ModelConfig, is_imported_model
from traincore.model.factory import ModelImportError, build_imported, hooked_units


class SmallCNN(nn.Module):
    """Three conv blocks and a linear head: the default for digits-sized images."""

    def __init__(self, in_channels: int, num_classes: int, width: int = 32, dropout: float = 0.0):
        super().__init__()

        def block(cin: int, cout: int) -> nn.Sequential:
            return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout),
                                 nn.ReLU(inplace=True))

        self.features = nn.Sequential(
            block(in_channels, width), nn.MaxPool2d(2),
            block(width, 2 * width), nn.MaxPool2d(2),
            block(2 * width, 4 * width), nn.AdaptiveAvgPool2d(1),
        )
        self.head = nn.Sequential(nn.Flatten(), nn.Dropout(dropout), nn.Linear(4 * width, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


class MLP(nn.Module):
    """Two hidden layers over the flattened image: a baseline and a fast test model."""

    def __init__(self, in_features: int, num_classes: int, width: int = 128, dropout: float = 0.0):
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(in_features, width), nn.ReLU(inplace=True),
                                 nn.Dropout(dropout), nn.Linear(width, width), nn.ReLU(inplace=True),
                                 nn.Linear(width, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


VIT_TINY = {"patch_size": 4, "num_layers": 4, "num_heads": 4, "hidden_dim": 128, "mlp_dim": 256}
"""vit_tiny: a ViT for 32x32 images (64 patches of 4x4) small enough to train a few hundred steps on CPU."""
_VIT_PATCHES = {"vit_b_16": 16, "vit_tiny": VIT_TINY["patch_size"]}


def _vision_transformer(name: str, in_channels: int, num_classes: int, image_size: int) -> nn.Module:
    import torchvision

    patch = _VIT_PATCHES[name]
    if image_size % patch:
        raise ValueError(f"model {name} needs an image size divisible by {patch}, got {image_size}: "
                         f"stage with data.image_size={max(patch, image_size - image_size % patch)} "
                         f"(or another multiple of {patch})")
    if name == "vit_b_16":
        model = torchvision.models.vit_b_16(weights=None, num_classes=num_classes, image_size=image_size)
    else:
        model = torchvision.models.VisionTransformer(image_size=image_size, num_classes=num_classes,
                                                     **VIT_TINY)
    if in_channels != 3:
        conv = model.conv_proj
        model.conv_proj = nn.Conv2d(in_channels, conv.out_channels, conv.kernel_size, conv.stride)
    return model


def _resnet(name: str, in_channels: int, num_classes: int) -> nn.Module:
    import torchvision

    model = getattr(torchvision.models, name)(weights=None, num_classes=num_classes)
    if in_channels != 3:
        model.conv1 = nn.Conv2d(in_channels, 64, kernel_size=7, stride=2, padding=3, bias=False)
    return model


def build_model(cfg: ModelConfig, num_classes: int, shape: tuple[int, int, int],
                seed: int | None = None) -> nn.Module:
    """Build ``cfg.name`` for ``shape`` (C, H, W) inputs and ``num_classes`` outputs, randomly initialised:
    from ``seed`` when given (the same weights on every rank, the process's random streams untouched),
    else from torch's global generator."""
    if seed is not None:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return build_model(cfg, num_classes, shape)
    channels, height, width = shape
    if is_imported_model(cfg.name):
        return build_imported(cfg, channels, num_classes, height)
    if cfg.name == "small_cnn":
        return SmallCNN(channels, num_classes, cfg.width, cfg.dropout)
    if cfg.name == "mlp":
        return MLP(channels * height * width, num_classes, cfg.width, cfg.dropout)
    if cfg.name in _VIT_PATCHES:
        return _vision_transformer(cfg.name, channels, num_classes, height)
    return _resnet(cfg.name, channels, num_classes)


TRUST_FLAGS = "--trust-model-code, or --model-name with that import path"


def check_trusted(name: str, trust_model: bool | str, source: str) -> None:
    """ModelImportError unless rebuilding ``name`` may import code: a built-in model always may; an
    imported one (``"<module>:<callable>"``) only when ``trust_model`` is True or that same import path.
    A model file names the code that rebuilds it, and importing that code runs it: as with Hugging Face's
    ``trust_remote_code``, running it is the user's choice, never the file's."""
    if not is_imported_model(name) or trust_model is True or trust_model == name:
        return
    if isinstance(trust_model, str) and trust_model:
        raise ModelImportError(
            f"{source} was trained with the imported model {name!r}, not {trust_model!r} that you allowed: "
            f"pass the import path it names ({name}) if you trust that module's code")
    raise ModelImportError(
        f"{source} was trained with the imported model {name!r}: rebuilding it imports and runs that "
        f"module's code, which only you can allow: pass {TRUST_FLAGS} ({name})")


def shard_units(model: nn.Module, name: str = "") -> list[nn.Module]:
    """The blocks FSDP shards one by one (each gathered only while it computes), in forward order:
    transformer layers, residual stages, conv blocks, linear layers. The root takes the rest.

    An imported model (``name``: its model.name) gets what its factory's module's ``shard_units(model)``
    returns when it defines one, else :func:`default_units`."""
    if is_imported_model(name):
        units = hooked_units(model, name)
        return default_units(model) if units is None else units
    if isinstance(model, SmallCNN):
        return [m for m in model.features if isinstance(m, nn.Sequential)]
    if isinstance(model, MLP):
        return [m for m in model.net if isinstance(m, nn.Linear)]
    layers = getattr(getattr(model, "encoder", None), "layers", None)  # torchvision VisionTransformer
    if isinstance(layers, nn.Module):
        return list(layers)
    stages = [getattr(model, f"layer{i}", None) for i in range(1, 5)]  # torchvision ResNet
    if all(isinstance(stage, nn.Module) for stage in stages):
        return stages
    raise ValueError(f"{type(model).__name__} has no known blocks to shard: name them in "
                     "traincore.model.build.shard_units")


def default_units(model: nn.Module) -> list[nn.Module]:
    """How an imported model without a ``shard_units`` of its own is sharded: the blocks of its largest
    repeated stack (the nn.ModuleList or nn.Sequential with the most parameters among those holding two or
    more blocks with parameters: transformer layers, residual stages), else its direct children that hold
    parameters. The root takes the rest. Fewer, larger units gather more at once; a model whose memory
    matters names its own units."""
    def holds_parameters(module: nn.Module) -> bool:
        return any(True for _ in module.parameters())

    def size(module: nn.Module) -> int:
        return sum(p.numel() for p in module.parameters())

    stacks = [module for module in model.modules() if isinstance(module, (nn.ModuleList, nn.Sequential))
              and sum(holds_parameters(child) for child in module.children()) >= 2]
    if stacks:
        return [child for child in max(stacks, key=size).children() if holds_parameters(child)]
    return [child for child in model.children() if holds_parameters(child)]


def parameter_count(model: nn.Module) -> int:
    """Number of trainable parameters."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)
