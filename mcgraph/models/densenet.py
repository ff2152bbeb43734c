"""CIFAR DenseNet-BC (Huang et al., 2017): bottleneck layers, compression 0.5."""

from __future__ import annotations

import math
from typing import Sequence

import torch
from torch import nn

from ._common import check_positive_int
from .zoo import register_model

__all__ = [
    "DenseLayer",
    "Transition",
    "DenseNet",
    "densenet121",
    "densenet161",
    "densenet169",
    "densenet201",
]


class DenseLayer(nn.Module):
    """Bottleneck dense layer: ``cat([conv3x3(BRC(conv1x1(BRC(x)))), x])``.

    ``BRC`` is BatchNorm-ReLU before each conv; the 1x1 conv has ``4 * growth``
    outputs, the 3x3 conv ``growth``.

    Args:
        in_channels: Input channels.
        growth: Channels added by this layer.

    Shape:
        ``(batch, in_channels, H, W) -> (batch, in_channels + growth, H, W)``.
    """

    def __init__(self, in_channels: int, growth: int) -> None:
        super().__init__()
        self.branch = nn.Sequential(
            nn.BatchNorm2d(in_channels),
            nn.ReLU(inplace=True),
            nn.Conv2d(in_channels, 4 * growth, kernel_size=1, bias=False),
            nn.BatchNorm2d(4 * growth),
            nn.ReLU(inplace=True),
            nn.Conv2d(4 * growth, growth, kernel_size=3, padding=1, bias=False),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Append ``growth`` new feature maps to ``x``; see the class docstring."""
        return torch.cat([self.branch(x), x], dim=1)


class Transition(nn.Sequential):
    """BN-ReLU-conv1x1 to ``out_channels``, then 2x2 average pooling.

    Shape:
        ``(batch, in_channels, H, W) -> (batch, out_channels, H / 2, W / 2)``.
    """

    def __init__(self, in_channels: int, out_channels: int) -> None:
        super().__init__(
            nn.BatchNorm2d(in_channels),
            nn.ReLU(inplace=True),
            nn.Conv2d(in_channels, out_channels, kernel_size=1, bias=False),
            nn.AvgPool2d(2),
        )


class DenseNet(nn.Module):
    """CIFAR DenseNet-BC: 3x3 stem with ``2 * growth`` channels, four dense blocks
    joined by compressing transitions, final BN-ReLU, global average pool, linear.

    After each of the first three blocks with ``c`` channels, a transition keeps
    ``floor(reduction * c)`` channels.

    Args:
        block_config: Dense layers per block, four positive ints.
        growth: Growth rate ``k``.
        reduction: Compression factor ``theta`` in ``(0, 1]``.
        num_classes: Number of output logits.
        in_channels: Number of input channels.

    Raises:
        ValueError: If ``block_config`` is not four positive ints, or
            ``reduction`` is outside ``(0, 1]``.

    Shape:
        - Input: ``(batch, in_channels, H, W)`` with ``H, W >= 32``.
        - Output: ``(batch, num_classes)``.
    """

    def __init__(
        self,
        block_config: Sequence[int],
        growth: int = 32,
        reduction: float = 0.5,
        num_classes: int = 10,
        in_channels: int = 3,
    ) -> None:
        super().__init__()
        check_positive_int("num_classes", num_classes)
        check_positive_int("in_channels", in_channels)
        check_positive_int("growth", growth)
        if len(block_config) != 4:
            raise ValueError(f"block_config must have 4 entries, got {tuple(block_config)!r}")
        for n in block_config:
            check_positive_int("block_config entries", n)
        if not 0.0 < reduction <= 1.0:
            raise ValueError(f"reduction must lie in (0, 1], got {reduction!r}")

        channels = 2 * growth
        layers: list[nn.Module] = [
            nn.Conv2d(in_channels, channels, kernel_size=3, padding=1, bias=False)
        ]
        for index, count in enumerate(block_config):
            for _ in range(count):
                layers.append(DenseLayer(channels, growth))
                channels += growth
            if index < len(block_config) - 1:
                out_channels = math.floor(reduction * channels)
                layers.append(Transition(channels, out_channels))
                channels = out_channels
        layers += [nn.BatchNorm2d(channels), nn.ReLU(inplace=True), nn.AdaptiveAvgPool2d(1)]
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Sequential(nn.Flatten(), nn.Linear(channels, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Map ``(batch, in_channels, H, W)`` images to ``(batch, num_classes)`` logits."""
        return self.classifier(self.features(x))


@register_model()
def densenet121(num_classes: int = 10, in_channels: int = 3) -> DenseNet:
    """CIFAR DenseNet-121, growth 32 (6,956,298 parameters for 10 classes).

    Example:
        >>> import torch
        >>> densenet121().eval()(torch.zeros(2, 3, 32, 32)).shape
        torch.Size([2, 10])
    """
    return DenseNet((6, 12, 24, 16), 32, 0.5, num_classes, in_channels)


@register_model()
def densenet161(num_classes: int = 10, in_channels: int = 3) -> DenseNet:
    """CIFAR DenseNet-161, growth 48 (26,482,378 parameters for 10 classes)."""
    return DenseNet((6, 12, 36, 24), 48, 0.5, num_classes, in_channels)


@register_model()
def densenet169(num_classes: int = 10, in_channels: int = 3) -> DenseNet:
    """CIFAR DenseNet-169, growth 32 (12,493,322 parameters for 10 classes)."""
    return DenseNet((6, 12, 32, 32), 32, 0.5, num_classes, in_channels)


@register_model()
def densenet201(num_classes: int = 10, in_channels: int = 3) -> DenseNet:
    """CIFAR DenseNet-201, growth 32 (18,104,330 parameters for 10 classes)."""
    return DenseNet((6, 12, 48, 32), 32, 0.5, num_classes, in_channels)
