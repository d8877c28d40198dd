"""A small residual CNN as a team would write it, built by ``model.name = "teamnet.models:resnet_tiny"``."""

from __future__ import annotations

from torch import nn


class Block(nn.Module):
    """Two 3x3 convolutions with a shortcut."""

    def __init__(self, channels: int):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(channels, channels, 3, padding=1, bias=False),
                                  nn.BatchNorm2d(channels), nn.ReLU(inplace=True),
                                  nn.Conv2d(channels, channels, 3, padding=1, bias=False),
                                  nn.BatchNorm2d(channels))

    def forward(self, x):
        return (x + self.body(x)).relu()


class ResNetTiny(nn.Module):
    def __init__(self, in_channels: int, num_classes: int, width: int, depth: int):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(in_channels, width, 3, padding=1, bias=False),
                                  nn.BatchNorm2d(width), nn.ReLU(inplace=True))
        self.blocks = nn.Sequential(*(Block(width) for _ in range(depth)))
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(width, num_classes))

    def forward(self, x):
        return self.head(self.blocks(self.stem(x)))


def resnet_tiny(num_classes: int, in_channels: int, image_size: int, width: int = 32,
                depth: int = 2) -> nn.Module:
    """The factory traincore calls; ``width`` and ``depth`` come from ``model.kwargs``."""
    return ResNetTiny(in_channels, num_classes, width, depth)


def shard_units(model: ResNetTiny) -> list[nn.Module]:
    """FSDP shards each residual block on its own (the default would pick the same blocks here)."""
    return list(model.blocks)
