"""Small sequence classifiers (plain ``torch.nn``): an LSTM and a transformer encoder.

Both read a batch of sequences ``(N, T, features)`` (batch first) and return ``(N, num_classes)``
logits, e.g. an image read row by row: sklearn digits as 8 steps of 8 pixels, MNIST as 28 of 28.
Their weighted modules are ``nn.LSTM``, ``nn.Linear``, ``nn.MultiheadAttention`` (inside
``nn.TransformerEncoderLayer``) and ``LayerNorm``, each called through its own ``forward``, so
:func:`mcgraph.nn.bayesify` makes them Bayesian with no other edit.

:func:`sequence_model` builds a registered sequence model for inputs of ``steps × features``
(``mcgraph train`` does, for the datasets read as rows by :func:`mcgraph.apps.data.load_dataset`);
a new sequence model is a builder registered with :func:`~mcgraph.models.zoo.register_model` plus one
:data:`SEQUENCE_INPUTS` entry saying which builder arguments the input's size sets.

Example:
    >>> import torch
    >>> from mcgraph.models.sequence import LSTMClassifier, TransformerClassifier, sequence_model
    >>> LSTMClassifier(8, 10)(torch.zeros(2, 8, 8)).shape
    torch.Size([2, 10])
    >>> TransformerClassifier(8, 10, max_len=8)(torch.zeros(2, 8, 8)).shape
    torch.Size([2, 10])
    >>> sequence_model("transformer", steps=40, features=1, num_classes=10)(torch.zeros(2, 40, 1)).shape
    torch.Size([2, 10])
"""

from __future__ import annotations

import torch
from torch import nn

from ..registry import Registry
from ._common import check_positive_int
from .zoo import get_model, register_model

__all__ = ["LSTMClassifier", "TransformerClassifier", "lstm_classifier", "transformer_classifier",
           "as_sequence", "SEQUENCE_INPUTS", "is_sequence_model", "sequence_model"]

SEQUENCE_INPUTS: Registry = Registry("sequence model", unique=True)
"""Model name → ``sizes(steps, features) -> dict``: the builder's keyword arguments that the input's number of
steps and features per step set (``input_size``, ``max_len``, …). Its keys are the models of
:data:`~mcgraph.models.zoo.MODELS` that read ``(N, steps, features)`` sequences."""


def as_sequence(x: torch.Tensor) -> torch.Tensor:
    """``(N, T, F)`` from an image batch read row by row: ``(N, 1, H, W)`` or ``(N, H, W)`` → ``(N, H, W)``."""
    if x.dim() == 4:
        if x.shape[1] != 1:
            raise ValueError(f"x: a row-by-row reading needs one channel, got shape {tuple(x.shape)}")
        return x[:, 0]
    if x.dim() != 3:
        raise ValueError(f"x: expected (N, T, F) sequences or (N, 1, H, W) images, got shape {tuple(x.shape)}")
    return x


class LSTMClassifier(nn.Module):
    """An LSTM over the sequence, a linear head on the last step's output.

    Args:
        input_size: features per step (e.g. 8 for digits read by rows).
        num_classes: output classes.
        hidden_size, num_layers, dropout, bidirectional: of the ``nn.LSTM``.
    """

    def __init__(self, input_size: int = 28, num_classes: int = 10, hidden_size: int = 64, num_layers: int = 1,
                 dropout: float = 0.0, bidirectional: bool = False) -> None:
        super().__init__()
        check_positive_int("input_size", input_size)
        check_positive_int("num_classes", num_classes)
        check_positive_int("hidden_size", hidden_size)
        check_positive_int("num_layers", num_layers)
        self.lstm = nn.LSTM(input_size, hidden_size, num_layers, batch_first=True, dropout=dropout,
                            bidirectional=bidirectional)
        self.head = nn.Linear(hidden_size * (2 if bidirectional else 1), num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.lstm(as_sequence(x))
        return self.head(out[:, -1])


class TransformerClassifier(nn.Module):
    """A linear embedding of each step plus a learned position table, a ``TransformerEncoder``,
    mean pooling over steps and a linear head.

    Args:
        input_size: features per step.
        num_classes: output classes.
        d_model, nhead, num_layers, dim_feedforward, dropout: of the encoder.
        max_len: the longest sequence (length of the position table).
    """

    def __init__(self, input_size: int = 28, num_classes: int = 10, d_model: int = 32, nhead: int = 4,
                 num_layers: int = 2, dim_feedforward: int = 64, dropout: float = 0.0, max_len: int = 64) -> None:
        super().__init__()
        for name, value in (("input_size", input_size), ("num_classes", num_classes), ("d_model", d_model),
                            ("nhead", nhead), ("num_layers", num_layers), ("dim_feedforward", dim_feedforward),
                            ("max_len", max_len)):
            check_positive_int(name, value)
        if d_model % nhead:
            raise ValueError(f"d_model must be divisible by nhead, got d_model={d_model} and nhead={nhead}")
        self.embed = nn.Linear(input_size, d_model)
        # a table added to every sequence (not looked up per example): a point estimate, never converted
        self.position = nn.Parameter(torch.randn(max_len, d_model) * 0.02)
        layer = nn.TransformerEncoderLayer(d_model, nhead, dim_feedforward, dropout, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers, enable_nested_tensor=False)
        self.head = nn.Linear(d_model, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = as_sequence(x)
        if x.shape[1] > self.position.shape[0]:
            raise ValueError(f"x: sequences of at most max_len={self.position.shape[0]} steps, got shape "
                             f"{tuple(x.shape)}")
        h = self.embed(x) + self.position[:x.shape[1]]
        return self.head(self.encoder(h).mean(1))


@register_model("lstm")
def lstm_classifier(num_classes: int = 10, in_channels: int = 1, input_size: int = 28, hidden_size: int = 64,
                    num_layers: int = 1, **kwargs) -> LSTMClassifier:
    """:class:`LSTMClassifier` (``in_channels`` must be 1: images are read row by row)."""
    if in_channels != 1:
        raise ValueError(f"in_channels must be 1 (images are read row by row), got {in_channels!r}")
    return LSTMClassifier(input_size, num_classes, hidden_size, num_layers, **kwargs)


@register_model("transformer")
def transformer_classifier(num_classes: int = 10, in_channels: int = 1, input_size: int = 28,
                           **kwargs) -> TransformerClassifier:
    """:class:`TransformerClassifier` (``in_channels`` must be 1: images are read row by row)."""
    if in_channels != 1:
        raise ValueError(f"in_channels must be 1 (images are read row by row), got {in_channels!r}")
    return TransformerClassifier(input_size, num_classes, **kwargs)


SEQUENCE_INPUTS.register("lstm", lambda steps, features: {"input_size": features})
SEQUENCE_INPUTS.register("transformer", lambda steps, features: {"input_size": features, "max_len": steps})


def is_sequence_model(name: str) -> bool:
    """Whether the registered model ``name`` reads ``(N, steps, features)`` sequences (a key of
    :data:`SEQUENCE_INPUTS`) rather than ``(N, C, *spatial)`` arrays."""
    return isinstance(name, str) and name in SEQUENCE_INPUTS


def sequence_model(name: str, steps: int, features: int, num_classes: int = 10, **kwargs) -> nn.Module:
    """The registered sequence model ``name`` for inputs ``(N, steps, features)``.

    Args:
        name: a key of :data:`SEQUENCE_INPUTS` (``"lstm"``, ``"transformer"``).
        steps: the sequence length ``T`` (rows of an image, samples of a signal).
        features: the features per step ``F`` (pixels of a row, channels of a signal).
        num_classes: output classes.
        **kwargs: the builder's other arguments (``hidden_size``, ``d_model``, …).

    Returns:
        A freshly initialised plain ``nn.Module`` mapping ``(N, steps, features)`` to ``(N, num_classes)``.

    Raises:
        ValueError: ``name`` is not a registered sequence model (the message lists them), or ``steps`` /
            ``features`` is not a positive int.

    Example:
        >>> import torch
        >>> sequence_model("lstm", steps=8, features=8, hidden_size=16)(torch.zeros(3, 8, 8)).shape
        torch.Size([3, 10])
    """
    if not is_sequence_model(name):
        raise ValueError(f"name must be one of the sequence models {sorted(SEQUENCE_INPUTS)}, got {name!r}")
    check_positive_int("steps", steps)
    check_positive_int("features", features)
    return get_model(name, num_classes=num_classes, **SEQUENCE_INPUTS[name](steps, features), **kwargs)
