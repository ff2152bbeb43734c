"""Small sequence classifiers (plain ``torch.nn``): an LSTM and a transformer encoder.

Both read a batch of sequences ``(N, T, features)`` (batch first) and return ``(N, num_classes)``
logits, e.g. an image read row by row: sklearn digits as 8 steps of 8 pixels, MNIST as 28 of 28.
Their weighted modules are ``nn.LSTM``, ``nn.Linear``, ``nn.MultiheadAttention`` (inside
``nn.TransformerEncoderLayer``) and ``LayerNorm``, each called through its own ``forward``, so
:func:`mcgraph.nn.bayesify` makes them Bayesian with no other edit.

Example:
    >>> import torch
    >>> from mcgraph.models.sequence import LSTMClassifier, TransformerClassifier
    >>> LSTMClassifier(8, 10)(torch.zeros(2, 8, 8)).shape
    torch.Size([2, 10])
    >>> TransformerClassifier(8, 10, max_len=8)(torch.zeros(2, 8, 8)).shape
    torch.Size([2, 10])
"""

from __future__ import annotations

import torch
from torch import nn

from ._common import check_positive_int
from .zoo import register_model

__all__ = ["LSTMClassifier", "TransformerClassifier", "lstm_classifier", "transformer_classifier",
           "as_sequence"]


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
