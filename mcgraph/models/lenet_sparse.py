"""The networks of the Bayesian-sparsification tables: LeNet-300-100 and LeNet-5-Caffe (MNIST-size inputs).

Both are the architectures of the pruning literature's MNIST tables (Han et al., 2015;
Molchanov, Ashukha & Vetrov, 2017): LeNet-300-100 is a fully connected 784-300-100-10 network,
LeNet-5-Caffe the Caffe variant of LeNet-5 with 20 and 50 convolution filters and a
500-unit hidden layer (20-50-800-500).
"""

from __future__ import annotations

import torch
from torch import nn

from ._common import check_positive_int
from .zoo import register_model

__all__ = ["LeNet300100", "LeNet5Caffe", "lenet300_100", "lenet5_caffe"]


class LeNet300100(nn.Module):
    """Fully connected ``in_features -> 300 -> 100 -> num_classes`` with ReLU.

    The input is flattened first, so images ``(batch, C, H, W)`` and vectors both work.

    Args:
        num_classes: Number of output logits.
        in_channels: Input channels (``in_features = in_channels · image_size²``).
        image_size: Side of the square input image (28 for MNIST, 8 for scikit-learn's digits).

    Shape:
        - Input: ``(batch, in_channels, image_size, image_size)`` or ``(batch, in_features)``.
        - Output: ``(batch, num_classes)``.
    """

    def __init__(self, num_classes: int = 10, in_channels: int = 1, image_size: int = 28) -> None:
        super().__init__()
        check_positive_int("num_classes", num_classes)
        check_positive_int("in_channels", in_channels)
        check_positive_int("image_size", image_size)
        self.classifier = nn.Sequential(
            nn.Flatten(),
            nn.Linear(in_channels * image_size * image_size, 300),
            nn.ReLU(inplace=True),
            nn.Linear(300, 100),
            nn.ReLU(inplace=True),
            nn.Linear(100, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Map the input batch to ``(batch, num_classes)`` logits."""
        return self.classifier(x)


class LeNet5Caffe(nn.Module):
    """LeNet-5-Caffe: ``conv 20@5x5 -> pool -> conv 50@5x5 -> pool -> fc 500 -> fc num_classes``.

    ReLU follows both convolutions and the hidden fully connected layer; max-pooling is 2x2.
    A 28x28 input reaches the classifier as 50x4x4 = 800 features.

    Args:
        num_classes: Number of output logits.
        in_channels: Number of input channels.

    Shape:
        - Input: ``(batch, in_channels, 28, 28)``.
        - Output: ``(batch, num_classes)``.
    """

    def __init__(self, num_classes: int = 10, in_channels: int = 1) -> None:
        super().__init__()
        check_positive_int("num_classes", num_classes)
        check_positive_int("in_channels", in_channels)
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, 20, kernel_size=5),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(2),
            nn.Conv2d(20, 50, kernel_size=5),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(2),
        )
        self.classifier = nn.Sequential(
            nn.Flatten(),
            nn.Linear(50 * 4 * 4, 500),
            nn.ReLU(inplace=True),
            nn.Linear(500, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Map ``(batch, in_channels, 28, 28)`` images to ``(batch, num_classes)`` logits."""
        return self.classifier(self.features(x))


@register_model()
def lenet300_100(num_classes: int = 10, in_channels: int = 1, image_size: int = 28) -> LeNet300100:
    """LeNet-300-100 (266,610 parameters for 10 classes on 28x28 inputs).

    Example:
        >>> import torch
        >>> lenet300_100()(torch.zeros(2, 1, 28, 28)).shape
        torch.Size([2, 10])
        >>> lenet300_100(image_size=8)(torch.zeros(2, 1, 8, 8)).shape    # scikit-learn's digits
        torch.Size([2, 10])
    """
    return LeNet300100(num_classes=num_classes, in_channels=in_channels, image_size=image_size)


@register_model()
def lenet5_caffe(num_classes: int = 10, in_channels: int = 1) -> LeNet5Caffe:
    """LeNet-5-Caffe, 20-50-800-500 (431,080 parameters for 10 classes, 1 channel).

    Example:
        >>> import torch
        >>> lenet5_caffe()(torch.zeros(2, 1, 28, 28)).shape
        torch.Size([2, 10])
    """
    return LeNet5Caffe(num_classes=num_classes, in_channels=in_channels)
