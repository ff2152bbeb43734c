"""AlexNet (Krizhevsky et al., 2012), CIFAR-size variant."""

from __future__ import annotations

import torch
from torch import nn

from ._common import check_positive_int, scaled
from .zoo import register_model

__all__ = ["AlexNet", "alexnet"]


class AlexNet(nn.Module):
    """AlexNet's five-conv feature stack with a single linear head, for 32x32 inputs.

    The CIFAR variant used by ``bearpaw/pytorch-classification`` and the Bayesian
    CNN literature: ``conv 64@11x11/4 (pad 5) -> pool -> conv 192@5x5 -> pool ->
    conv 384@3x3 -> conv 256@3x3 -> conv 256@3x3 -> pool -> fc num_classes``,
    with ReLU after every conv. A 32x32 input reaches the head as 256x1x1; an
    ``AdaptiveAvgPool2d(1)`` makes larger inputs work with the same parameters.

    Args:
        num_classes: Number of output logits.
        in_channels: Number of input channels.
        width: Multiplier of every convolution's filter count (rounded, at least 1); ``width=0.5``
            is the half-width AlexNet of Shridhar et al.'s Bayesian CNNs.

    Shape:
        - Input: ``(batch, in_channels, H, W)`` with ``H, W >= 32``.
        - Output: ``(batch, num_classes)``.
    """

    def __init__(self, num_classes: int = 10, in_channels: int = 3, width: float = 1.0) -> None:
        super().__init__()
        check_positive_int("num_classes", num_classes)
        check_positive_int("in_channels", in_channels)
        c1, c2, c3, c4 = (scaled(c, width) for c in (64, 192, 384, 256))
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, c1, kernel_size=11, stride=4, padding=5),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(2),
            nn.Conv2d(c1, c2, kernel_size=5, padding=2),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(2),
            nn.Conv2d(c2, c3, kernel_size=3, padding=1),
            nn.ReLU(inplace=True),
            nn.Conv2d(c3, c4, kernel_size=3, padding=1),
            nn.ReLU(inplace=True),
            nn.Conv2d(c4, c4, kernel_size=3, padding=1),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(2),
            nn.AdaptiveAvgPool2d(1),
        )
        self.classifier = nn.Sequential(nn.Flatten(), nn.Linear(c4, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Map ``(batch, in_channels, H, W)`` images to ``(batch, num_classes)`` logits."""
        return self.classifier(self.features(x))


@register_model()
def alexnet(num_classes: int = 10, in_channels: int = 3, width: float = 1.0) -> AlexNet:
    """CIFAR AlexNet (2,472,266 parameters for 10 classes, 3 channels).

    Example:
        >>> import torch
        >>> alexnet()(torch.zeros(2, 3, 32, 32)).shape
        torch.Size([2, 10])
    """
    return AlexNet(num_classes=num_classes, in_channels=in_channels, width=width)
