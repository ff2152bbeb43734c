"""VGG with BatchNorm (Simonyan & Zisserman, 2015), CIFAR variant."""

from __future__ import annotations

from typing import Sequence, Union

import torch
from torch import nn

from ._common import check_positive_int, conv_bn_relu
from .zoo import register_model

__all__ = ["VGG", "VGG_CONFIGS", "vgg11", "vgg13", "vgg16", "vgg19"]

_Layer = Union[int, str]

VGG_CONFIGS: dict[str, tuple[_Layer, ...]] = {
    "vgg11": (64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"),
    "vgg13": (64, 64, "M", 128, 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"),
    "vgg16": (
        64, 64, "M", 128, 128, "M", 256, 256, 256, "M",
        512, 512, 512, "M", 512, 512, 512, "M",
    ),
    "vgg19": (
        64, 64, "M", 128, 128, "M", 256, 256, 256, 256, "M",
        512, 512, 512, 512, "M", 512, 512, 512, 512, "M",
    ),
}  # fmt: skip
"""Configurations A, B, D, E of the VGG paper: an int is a 3x3 conv+BN+ReLU with
that many output channels, ``"M"`` a 2x2 max-pool."""


class VGG(nn.Module):
    """VGG-BN feature stack with the CIFAR head ``Linear(512, num_classes)``.

    Convs keep their bias (as in the reference VGG-BN implementations), so the
    parameter counts match the published CIFAR VGG-BN counts exactly.

    Five max-pools bring 32x32 inputs to 512x1x1; an ``AdaptiveAvgPool2d(1)``
    (the identity at 32x32) lets larger inputs through.

    Args:
        config: Layer sequence, e.g. ``VGG_CONFIGS["vgg16"]``; the head's input
            width is the last conv's channel count (512 for the standard configs).
        num_classes: Number of output logits.
        in_channels: Number of input channels.

    Raises:
        ValueError: If ``config`` holds an entry that is neither a positive int
            nor ``"M"``, or has no conv layer.

    Shape:
        - Input: ``(batch, in_channels, H, W)`` with ``H, W >= 32``.
        - Output: ``(batch, num_classes)``.
    """

    def __init__(
        self, config: Sequence[_Layer], num_classes: int = 10, in_channels: int = 3
    ) -> None:
        super().__init__()
        check_positive_int("num_classes", num_classes)
        check_positive_int("in_channels", in_channels)
        layers: list[nn.Module] = []
        channels = in_channels
        for entry in config:
            if entry == "M":
                layers.append(nn.MaxPool2d(2))
            elif isinstance(entry, int) and not isinstance(entry, bool) and entry > 0:
                layers.append(conv_bn_relu(2, channels, entry, bias=True))
                channels = entry
            else:
                raise ValueError(f"config entries must be positive ints or 'M', got {entry!r}")
        if not any(isinstance(layer, nn.Sequential) for layer in layers):
            raise ValueError(f"config must contain at least one conv layer, got {config!r}")
        layers.append(nn.AdaptiveAvgPool2d(1))
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Sequential(nn.Flatten(), nn.Linear(channels, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Map ``(batch, in_channels, H, W)`` images to ``(batch, num_classes)`` logits."""
        return self.classifier(self.features(x))


def _vgg(name: str, num_classes: int, in_channels: int) -> VGG:
    return VGG(VGG_CONFIGS[name], num_classes=num_classes, in_channels=in_channels)


@register_model()
def vgg11(num_classes: int = 10, in_channels: int = 3) -> VGG:
    """VGG-11-BN, CIFAR head (9,231,114 parameters for 10 classes)."""
    return _vgg("vgg11", num_classes, in_channels)


@register_model()
def vgg13(num_classes: int = 10, in_channels: int = 3) -> VGG:
    """VGG-13-BN, CIFAR head (9,416,010 parameters for 10 classes)."""
    return _vgg("vgg13", num_classes, in_channels)


@register_model()
def vgg16(num_classes: int = 10, in_channels: int = 3) -> VGG:
    """VGG-16-BN, CIFAR head (14,728,266 parameters for 10 classes).

    Example:
        >>> import torch
        >>> vgg16().eval()(torch.zeros(2, 3, 32, 32)).shape
        torch.Size([2, 10])
    """
    return _vgg("vgg16", num_classes, in_channels)


@register_model()
def vgg19(num_classes: int = 10, in_channels: int = 3) -> VGG:
    """VGG-19-BN, CIFAR head (20,040,522 parameters for 10 classes)."""
    return _vgg("vgg19", num_classes, in_channels)
