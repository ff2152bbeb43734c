"""LeNet-5 (LeCun et al., 1998) for 28x28 MNIST-size inputs."""

from __future__ import annotations

import torch
from torch import nn

from ._common import check_positive_int, scaled
from .zoo import register_model

__all__ = ["LeNet5", "lenet5"]


class LeNet5(nn.Module):
    """LeNet-5 with ReLU and max-pooling (the common modern variant).

    ``conv 6@5x5 (pad 2) -> pool -> conv 16@5x5 -> pool -> fc 120 -> fc 84 ->
    fc num_classes``. An ``AdaptiveAvgPool2d((5, 5))`` before the classifier is
    the identity at 28x28 and lets larger inputs (e.g. 32x32) through unchanged
    in parameter count.

    Args:
        num_classes: Number of output logits.
        in_channels: Number of input channels.
        width: Multiplier of every hidden width (filters and units, rounded, at least 1);
            ``width=0.5`` is the half-width LeNet-5 of Shridhar et al.'s Bayesian CNNs.

    Shape:
        - Input: ``(batch, in_channels, H, W)`` with ``H, W >= 28``.
        - Output: ``(batch, num_classes)``.
    """

    def __init__(self, num_classes: int = 10, in_channels: int = 1, width: float = 1.0) -> None:
        super().__init__()
        check_positive_int("num_classes", num_classes)
        check_positive_int("in_channels", in_channels)
        c1, c2, f1, f2 = (scaled(c, width) for c in (6, 16, 120, 84))
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, c1, kernel_size=5, padding=2),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(2),
            nn.Conv2d(c1, c2, kernel_size=5),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(2),
            nn.AdaptiveAvgPool2d((5, 5)),
        )
        self.classifier = nn.Sequential(
            nn.Flatten(),
            nn.Linear(c2 * 5 * 5, f1),
            nn.ReLU(inplace=True),
            nn.Linear(f1, f2),
            nn.ReLU(inplace=True),
            nn.Linear(f2, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Map ``(batch, in_channels, H, W)`` images to ``(batch, num_classes)`` logits."""
        return self.classifier(self.features(x))


@register_model()
def lenet5(num_classes: int = 10, in_channels: int = 1, width: float = 1.0) -> LeNet5:
    """LeNet-5 for 28x28 inputs (61,706 parameters for 10 classes, 1 channel; 15,738 at ``width=0.5``).

    Example:
        >>> import torch
        >>> lenet5()(torch.zeros(2, 1, 28, 28)).shape
        torch.Size([2, 10])
        >>> sum(p.numel() for p in lenet5(width=0.5).parameters())
        15738
    """
    return LeNet5(num_classes=num_classes, in_channels=in_channels, width=width)
