"""Shared helpers for the deterministic model zoo.

Everything here builds plain ``torch.nn`` modules only (``nn.Conv{1,2,3}d``,
``nn.BatchNorm{1,2,3}d``, pooling, ``nn.ReLU``), so that a later pass can swap
every ``Linear``/``Conv`` module for a Bayesian one without touching ``forward``.
"""

from __future__ import annotations

from torch import nn

_CONV = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}
_BATCH_NORM = {1: nn.BatchNorm1d, 2: nn.BatchNorm2d, 3: nn.BatchNorm3d}


def check_positive_int(name: str, value: object) -> int:
    """Return ``value`` if it is a positive ``int``, else raise ``ValueError``.

    Args:
        name: Argument name used in the error message.
        value: The value to check (``bool`` is rejected).

    Returns:
        ``value`` unchanged.

    Raises:
        ValueError: If ``value`` is not an ``int`` or is smaller than 1.
    """
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


def scaled(channels: int, width: object) -> int:
    """``max(1, round(channels · width))``: a hidden width scaled by the model's ``width`` multiplier.

    Raises:
        ValueError: ``width`` is not a positive finite real number.
    """
    if isinstance(width, bool) or not isinstance(width, (int, float)) or not 0 < width < float("inf"):
        raise ValueError(f"width must be a positive finite number, got {width!r}")
    return max(1, int(round(channels * width)))


def check_spatial_dims(spatial_dims: object) -> int:
    """Return ``spatial_dims`` if it is 1, 2 or 3, else raise ``ValueError``."""
    if spatial_dims not in _CONV or isinstance(spatial_dims, bool):
        raise ValueError(f"spatial_dims must be one of 1, 2, 3, got {spatial_dims!r}")
    return spatial_dims  # type: ignore[return-value]


def conv(
    spatial_dims: int,
    in_channels: int,
    out_channels: int,
    kernel_size: int,
    stride: int = 1,
    padding: int = 0,
    bias: bool = False,
) -> nn.Module:
    """An ``nn.Conv{spatial_dims}d``; bias-free by default (a BatchNorm follows)."""
    return _CONV[spatial_dims](
        in_channels, out_channels, kernel_size, stride=stride, padding=padding, bias=bias
    )


def batch_norm(spatial_dims: int, num_features: int) -> nn.Module:
    """An ``nn.BatchNorm{spatial_dims}d`` over ``num_features`` channels."""
    return _BATCH_NORM[spatial_dims](num_features)


def conv_bn_relu(
    spatial_dims: int,
    in_channels: int,
    out_channels: int,
    kernel_size: int = 3,
    bias: bool = False,
) -> nn.Sequential:
    """``conv(k, stride 1, 'same' padding) -> BatchNorm -> ReLU``.

    ``bias`` defaults to False since the BatchNorm shift makes a conv bias
    redundant; VGG-BN keeps it to match the reference parameter counts.
    """
    return nn.Sequential(
        conv(
            spatial_dims,
            in_channels,
            out_channels,
            kernel_size,
            padding=kernel_size // 2,
            bias=bias,
        ),
        batch_norm(spatial_dims, out_channels),
        nn.ReLU(inplace=True),
    )
