"""CIFAR ResNets (He et al., 2016a) and pre-activation ResNets (He et al., 2016b).

Both families share one :class:`ResNet` trunk: a 3x3 stem conv (no max-pool),
four stages of 64/128/256/512 base widths at strides 1/2/2/2, global average
pooling and a linear head. Only the residual block differs.
"""

from __future__ import annotations

from typing import Sequence, Type

import torch
from torch import nn

from ._common import check_positive_int
from .zoo import register_model

__all__ = [
    "BasicBlock",
    "Bottleneck",
    "PreActBasicBlock",
    "PreActBottleneck",
    "ResNet",
    "resnet18",
    "resnet34",
    "resnet50",
    "resnet101",
    "resnet152",
    "preact_resnet18",
    "preact_resnet34",
    "preact_resnet50",
]


def _conv(in_channels: int, out_channels: int, kernel_size: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(
        in_channels, out_channels, kernel_size, stride=stride, padding=kernel_size // 2, bias=False
    )


def _projection(in_channels: int, out_channels: int, stride: int, norm: bool) -> nn.Module:
    """1x1 strided conv shortcut (+ BN for post-activation blocks), or identity."""
    if stride == 1 and in_channels == out_channels:
        return nn.Identity()
    layers: list[nn.Module] = [_conv(in_channels, out_channels, 1, stride)]
    if norm:
        layers.append(nn.BatchNorm2d(out_channels))
    return nn.Sequential(*layers)


def _residual(
    in_channels: int, planes: int, stride: int, expansion: int, post_norm: bool
) -> nn.Sequential:
    """Residual branch: two 3x3 convs (``expansion == 1``) or 1x1-3x3-1x1 (``== 4``).

    Each conv but the last is followed by BN-ReLU; the last is followed by BN
    only when ``post_norm`` (post-activation blocks). The stride sits on the
    3x3 conv that comes first in a basic block, second in a bottleneck.
    """
    if expansion == 1:
        specs = [(in_channels, planes, 3, stride), (planes, planes, 3, 1)]
    else:
        specs = [
            (in_channels, planes, 1, 1),
            (planes, planes, 3, stride),
            (planes, planes * expansion, 1, 1),
        ]
    layers: list[nn.Module] = []
    for index, (c_in, c_out, k, s) in enumerate(specs):
        layers.append(_conv(c_in, c_out, k, s))
        last = index == len(specs) - 1
        if not last or post_norm:
            layers.append(nn.BatchNorm2d(c_out))
        if not last:
            layers.append(nn.ReLU(inplace=True))
    return nn.Sequential(*layers)


class BasicBlock(nn.Module):
    """Post-activation block: ``relu(bn(conv3x3(relu(bn(conv3x3(x))))) + shortcut(x))``.

    The shortcut is the identity, or a strided 1x1 conv + BN when the shape
    changes (option B of He et al., 2016a).

    Args:
        in_channels: Input channels.
        planes: Block width; the output has ``planes * expansion`` channels.
        stride: Stride of the (first) 3x3 conv and of the projection shortcut.

    Shape:
        ``(batch, in_channels, H, W) -> (batch, planes * expansion, H / stride, W / stride)``.
    """

    expansion = 1

    def __init__(self, in_channels: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        out_channels = planes * self.expansion
        self.residual = _residual(in_channels, planes, stride, self.expansion, post_norm=True)
        self.shortcut = _projection(in_channels, out_channels, stride, norm=True)
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the block; see the class docstring for shapes."""
        return self.relu(self.residual(x) + self.shortcut(x))


class Bottleneck(BasicBlock):
    """Post-activation bottleneck: 1x1 reduce, 3x3 (strided), 1x1 expand by 4, + shortcut."""

    expansion = 4


class PreActBasicBlock(nn.Module):
    """Pre-activation block: ``y = r(relu(bn(x))) + s(x)`` (He et al., 2016b).

    ``r`` is ``conv3x3 -> BN -> ReLU -> conv3x3``. The shortcut ``s`` is the
    identity on ``x``, or, when the shape changes, a bare strided 1x1 conv
    reading the pre-activated input ``relu(bn(x))``.

    Args:
        in_channels: Input channels.
        planes: Block width; the output has ``planes * expansion`` channels.
        stride: Stride of the (first) 3x3 conv and of the projection shortcut.

    Shape:
        ``(batch, in_channels, H, W) -> (batch, planes * expansion, H / stride, W / stride)``.
    """

    expansion = 1

    def __init__(self, in_channels: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        out_channels = planes * self.expansion
        self.preact = nn.Sequential(nn.BatchNorm2d(in_channels), nn.ReLU())
        self.residual = _residual(in_channels, planes, stride, self.expansion, post_norm=False)
        self.shortcut = _projection(in_channels, out_channels, stride, norm=False)
        self.projects = not isinstance(self.shortcut, nn.Identity)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the block; see the class docstring for shapes."""
        out = self.preact(x)
        skip = self.shortcut(out) if self.projects else x
        return self.residual(out) + skip


class PreActBottleneck(PreActBasicBlock):
    """Pre-activation bottleneck: BN-ReLU-1x1, BN-ReLU-3x3 (strided), BN-ReLU-1x1 (x4)."""

    expansion = 4


_Block = Type[nn.Module]


class ResNet(nn.Module):
    """CIFAR ResNet trunk: 3x3 stem, four stages, global average pool, linear head.

    Args:
        block: One of :class:`BasicBlock`, :class:`Bottleneck`,
            :class:`PreActBasicBlock`, :class:`PreActBottleneck` (any class with
            an ``expansion`` attribute and ``(in_channels, planes, stride)``).
        num_blocks: Blocks per stage, four positive ints.
        num_classes: Number of output logits.
        in_channels: Number of input channels.
        preact: If True, the stem is a bare conv and a final BN-ReLU precedes
            pooling (He et al., 2016b); otherwise the stem is conv-BN-ReLU.

    Raises:
        ValueError: If ``num_blocks`` is not four positive ints.

    Shape:
        - Input: ``(batch, in_channels, H, W)`` with ``H, W >= 32``.
        - Output: ``(batch, num_classes)``.
    """

    widths = (64, 128, 256, 512)

    def __init__(
        self,
        block: _Block,
        num_blocks: Sequence[int],
        num_classes: int = 10,
        in_channels: int = 3,
        preact: bool = False,
    ) -> None:
        super().__init__()
        check_positive_int("num_classes", num_classes)
        check_positive_int("in_channels", in_channels)
        if len(num_blocks) != len(self.widths):
            raise ValueError(f"num_blocks must have 4 entries, got {tuple(num_blocks)!r}")
        for n in num_blocks:
            check_positive_int("num_blocks entries", n)

        stem: list[nn.Module] = [_conv(in_channels, self.widths[0], 3)]
        if not preact:
            stem += [nn.BatchNorm2d(self.widths[0]), nn.ReLU(inplace=True)]
        self.stem = nn.Sequential(*stem)

        stages: list[nn.Module] = []
        channels = self.widths[0]
        for index, (planes, count) in enumerate(zip(self.widths, num_blocks)):
            blocks: list[nn.Module] = []
            for j in range(count):
                stride = 2 if index > 0 and j == 0 else 1
                blocks.append(block(channels, planes, stride))
                channels = planes * block.expansion
            stages.append(nn.Sequential(*blocks))
        self.stages = nn.Sequential(*stages)

        head: list[nn.Module] = []
        if preact:
            head += [nn.BatchNorm2d(channels), nn.ReLU(inplace=True)]
        head += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(channels, num_classes)]
        self.head = nn.Sequential(*head)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Map ``(batch, in_channels, H, W)`` images to ``(batch, num_classes)`` logits."""
        return self.head(self.stages(self.stem(x)))


@register_model()
def resnet18(num_classes: int = 10, in_channels: int = 3) -> ResNet:
    """CIFAR ResNet-18 (11,173,962 parameters for 10 classes).

    Example:
        >>> import torch
        >>> resnet18().eval()(torch.zeros(2, 3, 32, 32)).shape
        torch.Size([2, 10])
    """
    return ResNet(BasicBlock, (2, 2, 2, 2), num_classes, in_channels)


@register_model()
def resnet34(num_classes: int = 10, in_channels: int = 3) -> ResNet:
    """CIFAR ResNet-34 (21,282,122 parameters for 10 classes)."""
    return ResNet(BasicBlock, (3, 4, 6, 3), num_classes, in_channels)


@register_model()
def resnet50(num_classes: int = 10, in_channels: int = 3) -> ResNet:
    """CIFAR ResNet-50 (23,520,842 parameters for 10 classes)."""
    return ResNet(Bottleneck, (3, 4, 6, 3), num_classes, in_channels)


@register_model()
def resnet101(num_classes: int = 10, in_channels: int = 3) -> ResNet:
    """CIFAR ResNet-101 (42,512,970 parameters for 10 classes)."""
    return ResNet(Bottleneck, (3, 4, 23, 3), num_classes, in_channels)


@register_model()
def resnet152(num_classes: int = 10, in_channels: int = 3) -> ResNet:
    """CIFAR ResNet-152 (58,156,618 parameters for 10 classes)."""
    return ResNet(Bottleneck, (3, 8, 36, 3), num_classes, in_channels)


@register_model()
def preact_resnet18(num_classes: int = 10, in_channels: int = 3) -> ResNet:
    """CIFAR pre-activation ResNet-18 (11,172,170 parameters for 10 classes)."""
    return ResNet(PreActBasicBlock, (2, 2, 2, 2), num_classes, in_channels, preact=True)


@register_model()
def preact_resnet34(num_classes: int = 10, in_channels: int = 3) -> ResNet:
    """CIFAR pre-activation ResNet-34 (21,280,330 parameters for 10 classes)."""
    return ResNet(PreActBasicBlock, (3, 4, 6, 3), num_classes, in_channels, preact=True)


@register_model()
def preact_resnet50(num_classes: int = 10, in_channels: int = 3) -> ResNet:
    """CIFAR pre-activation ResNet-50 (23,513,162 parameters for 10 classes)."""
    return ResNet(PreActBottleneck, (3, 4, 6, 3), num_classes, in_channels, preact=True)
