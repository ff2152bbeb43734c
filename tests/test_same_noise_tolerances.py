"""The same-noise check's handling of overflowed reference gradients (``same_noise_tolerances``)."""

from __future__ import annotations

import pytest
import torch

from same_noise_tolerances import TOLERANCES, assert_same

RTOL, ATOL = TOLERANCES[torch.float32]
INF = float("inf")


def _check(ref_grad, got_grad, witness=None):
    value = torch.tensor(1.0)
    assert_same((value, (torch.tensor(ref_grad),)), (value, (torch.tensor(got_grad),)), RTOL, ATOL, "case",
                witness=witness)


@pytest.mark.parametrize("got", [-INF, INF, float("nan")])
def test_a_non_finite_reference_accepts_any_non_finite_value(got):
    _check([-INF, 2.0], [got, 2.0])


def test_a_finite_value_where_the_reference_overflowed_needs_a_recomputation():
    with pytest.raises(AssertionError, match="no recomputation"):
        _check([-INF, 2.0], [-2.4e37, 2.0])


def test_a_finite_value_equal_to_the_recomputation_passes():
    _check([-INF, 2.0], [-2.4e37, 2.0], witness=lambda: (torch.tensor([-2.4e37, 2.0], dtype=torch.float64),))


@pytest.mark.parametrize("recomputed", [-1.0e37, -4.0e38, INF], ids=["another value", "beyond float32", "inf"])
def test_a_finite_value_unlike_the_recomputation_fails(recomputed):
    witness = lambda: (torch.tensor([recomputed, 2.0], dtype=torch.float64),)  # noqa: E731
    with pytest.raises(AssertionError, match="finite here and not the recomputed gradient"):
        _check([-INF, 2.0], [-2.4e37, 2.0], witness=witness)


def test_finite_entries_are_compared_as_before():
    witness = lambda: (torch.tensor([-2.4e37, 2.0], dtype=torch.float64),)  # noqa: E731
    with pytest.raises(AssertionError, match="grad 0"):
        _check([-INF, 2.0], [-2.4e37, 3.0], witness=witness)
