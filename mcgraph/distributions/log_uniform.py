"""Improper log-uniform prior (sparse variational dropout)."""

from __future__ import annotations

import torch
from torch.distributions import Distribution, constraints

__all__ = ["LogUniform"]


class LogUniform(Distribution):
    r"""Improper log-uniform (scale-invariant) prior on the real line.

    The prior of sparse variational dropout (Molchanov, Ashukha & Vetrov,
    ICML 2017, Sec. 4.2; Kingma et al., 2015), :math:`p(\log|w|) \propto
    \mathrm{const}`, i.e.

    .. math::

        \log p(w) = -\log|w| + C .

    The density is **improper** (it does not integrate to a finite value), so
    ``log_prob`` returns :math:`-\log|w|` with the additive constant
    :math:`C` set to 0; only differences and gradients of it are meaningful,
    as in a KL term up to a constant. It has no sampler, mean or variance.

    Args:
        validate_args (bool, optional): whether to validate samples (torch's
            global default when ``None``).
        shape (tuple of int): the batch shape; each element is an
            independent scalar prior (``event_shape == ()``).

    Example:
        >>> p = LogUniform(shape=(2,))
        >>> p.log_prob(torch.tensor([1.0, 0.5]))
        tensor([-0.0000, 0.6931])
    """

    arg_constraints: dict = {}
    support = constraints.real
    has_rsample = False

    def __init__(self, validate_args: bool | None = None, shape=()) -> None:
        if validate_args is not None and not isinstance(validate_args, bool):
            raise TypeError(
                "Expected validate_args to be a bool or None, got "
                f"{validate_args!r}; pass the batch shape as LogUniform(shape=...)."
            )
        try:
            batch_shape = torch.Size(shape)
        except TypeError as err:
            raise ValueError(
                f"Expected shape to be a tuple of ints, got shape={shape!r}."
            ) from err
        super().__init__(batch_shape, validate_args=validate_args)

    def expand(self, batch_shape, _instance=None):
        new = self._get_checked_instance(LogUniform, _instance)
        super(LogUniform, new).__init__(torch.Size(batch_shape), validate_args=False)
        new._validate_args = self._validate_args
        return new

    def rsample(self, sample_shape=torch.Size()):
        raise NotImplementedError(
            "LogUniform is an improper prior (its density does not integrate to "
            "a finite value) and cannot be sampled; use it only through log_prob."
        )

    def sample(self, sample_shape=torch.Size()):
        return self.rsample(sample_shape)

    def log_prob(self, value: torch.Tensor) -> torch.Tensor:
        if self._validate_args:
            self._validate_sample(value)
        log_p = -torch.log(torch.abs(value))
        shape = torch.broadcast_shapes(log_p.shape, self.batch_shape)
        if log_p.shape != shape:
            log_p = log_p.expand(shape)
        return log_p
