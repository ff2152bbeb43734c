"""U-Net contracting path used as a volume classifier (Nazarovs et al., UAI 2021)."""

from __future__ import annotations

import torch
from torch import nn

from ._common import check_positive_int, check_spatial_dims, conv_bn_relu
from .zoo import register_model

__all__ = ["UNetEncoder", "unet3d_encoder"]

_MAX_POOL = {1: nn.MaxPool1d, 2: nn.MaxPool2d, 3: nn.MaxPool3d}
_AVG_POOL = {1: nn.AdaptiveAvgPool1d, 2: nn.AdaptiveAvgPool2d, 3: nn.AdaptiveAvgPool3d}


class UNetEncoder(nn.Module):
    """The encoder half of a U-Net (Ronneberger et al., 2015; Cicek et al., 2016)
    followed by global average pooling and a linear classifier.

    Level ``i`` (``0 <= i < depth``) is two ``3^d`` conv-BN-ReLU layers with
    ``base_channels * 2**i`` output channels; a ``2^d`` max-pool sits between
    consecutive levels (``depth - 1`` pools, the deepest level being U-Net's
    bottleneck). This is the contracting path of the 3D U-Net in Nazarovs et
    al., "Graph Reparameterizations for Enabling 1000+ Monte Carlo Iterations
    in Bayesian Deep Neural Networks", UAI 2021, Fig. 9.

    Args:
        spatial_dims: 1, 2 or 3 (``nn.Conv{spatial_dims}d`` and friends).
        in_channels: Number of input channels.
        num_classes: Number of output logits.
        base_channels: Channels of the first level; doubled at every level.
        depth: Number of levels.

    Raises:
        ValueError: If an argument is not a positive int, or ``spatial_dims``
            is not 1, 2 or 3.

    Shape:
        - Input: ``(batch, in_channels, *spatial)`` with every spatial size
          ``>= 2 ** (depth - 1)``.
        - Output: ``(batch, num_classes)``.
    """

    def __init__(
        self,
        spatial_dims: int = 3,
        in_channels: int = 1,
        num_classes: int = 2,
        base_channels: int = 8,
        depth: int = 4,
    ) -> None:
        super().__init__()
        d = check_spatial_dims(spatial_dims)
        check_positive_int("in_channels", in_channels)
        check_positive_int("num_classes", num_classes)
        check_positive_int("base_channels", base_channels)
        check_positive_int("depth", depth)

        layers: list[nn.Module] = []
        channels = in_channels
        for level in range(depth):
            if level > 0:
                layers.append(_MAX_POOL[d](2))
            width = base_channels * 2**level
            layers += [conv_bn_relu(d, channels, width), conv_bn_relu(d, width, width)]
            channels = width
        layers.append(_AVG_POOL[d](1))
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Sequential(nn.Flatten(), nn.Linear(channels, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Map ``(batch, in_channels, *spatial)`` inputs to ``(batch, num_classes)`` logits."""
        return self.classifier(self.features(x))


@register_model()
def unet3d_encoder(
    in_channels: int = 1, num_classes: int = 2, base_channels: int = 8, depth: int = 4
) -> UNetEncoder:
    """3D U-Net encoder classifier (220,282 parameters with the defaults).

    Example:
        >>> import torch
        >>> unet3d_encoder().eval()(torch.zeros(2, 1, 32, 32, 32)).shape
        torch.Size([2, 2])
    """
    return UNetEncoder(3, in_channels, num_classes, base_channels, depth)
