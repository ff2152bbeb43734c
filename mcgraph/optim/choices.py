"""The optimizers' options with a fixed set of values, as str-Enums.

Each option accepts the member or its string (``parallel="samples"`` and
``parallel=Parallel.SAMPLES`` are the same); an unknown value is refused with the
argument's name and the accepted strings. The optimizers store the string.
"""

from __future__ import annotations

import enum

__all__ = ["Parallel", "LossReduction", "Curvature", "EStep", "HardStatistic", "LinearGroups", "ConvGroups",
           "PruneConv"]


class _Option(str, enum.Enum):
    def __str__(self) -> str:
        return self.value


class Parallel(_Option):
    """How the ranks of a ``process_group`` share a step."""

    DATA = "data"  #: each rank holds its own batch shard
    SAMPLES = "samples"  #: the ranks hold the same batch and split the K samples


class LossReduction(_Option):
    """How the closure's loss reduces the batch."""

    MEAN = "mean"
    SUM = "sum"


class Curvature(_Option):
    """Adaptive VB's curvature estimate."""

    SQUARED_GRADIENT = "squared_gradient"  #: the minibatch gradient squared
    PER_EXAMPLE = "per_example"  #: the sum of per-example squared gradients


class EStep(_Option):
    """Spike-and-slab EM's E-step."""

    PROBABILITY = "probability"  #: the posterior inclusion probability
    THRESHOLD = "threshold"  #: a hard 0/1 inclusion


class HardStatistic(_Option):
    """The group statistic of the hard E-step."""

    MEAN_SQUARE = "mean_square"
    RANGE = "range"


class LinearGroups(_Option):
    """The weight groups of a linear layer."""

    INPUT = "input"
    OUTPUT = "output"


class ConvGroups(_Option):
    """The weight groups of a convolution."""

    KERNEL = "kernel"
    FILTER = "filter"
    CHANNEL = "channel"


class PruneConv(_Option):
    """How a convolution is pruned."""

    CHANNELS = "channels"  #: whole output channels
    EM = "em"  #: the EM's groups
