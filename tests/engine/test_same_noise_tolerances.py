"""The same-noise check's handling of overflowed reference gradients (``same_noise_tolerances``)."""

from __future__ import annotations

import pytest
import torch

from support.same_noise_tolerances import TOLERANCES, assert_same

RTOL, ATOL = TOLERANCES[torch.float32]
INF = float("inf")


def _check(ref_grad, got_grad, witness=None):
    value = torch.tensor(1.0)
    assert_same((value, (torch.tensor(ref_grad),)), (value, (torch.tensor(got_grad),)), RTOL, ATOL, "case",
                witness=witness)


def _passes(check, *args, **kwargs) -> bool:
    """Whether ``check(*args, **kwargs)`` accepts (returns) rather than raising AssertionError."""
    try:
        check(*args, **kwargs)
    except AssertionError:
        return False
    return True


def _recomputed(grad):
    return lambda: (None, (torch.tensor(grad, dtype=torch.float64),))


@pytest.mark.parametrize("got", [-INF, INF, float("nan")])
def test_a_non_finite_reference_accepts_any_non_finite_value(got):
    assert _passes(_check, [-INF, 2.0], [got, 2.0])
    assert not _passes(_check, [-INF, 2.0], [got, 2.1])  # the finite entry is still compared


def test_a_finite_value_where_the_reference_overflowed_needs_a_recomputation():
    with pytest.raises(AssertionError, match="no recomputation"):
        _check([-INF, 2.0], [-2.4e37, 2.0])


def test_a_finite_value_equal_to_the_recomputation_passes():
    assert _passes(_check, [-INF, 2.0], [-2.4e37, 2.0], witness=_recomputed([-2.4e37, 2.0]))
    assert not _passes(_check, [-INF, 2.0], [-2.4e37, 2.0], witness=_recomputed([-2.5e37, 2.0]))


@pytest.mark.parametrize("recomputed", [-1.0e37, -4.0e38, INF], ids=["another value", "beyond float32", "inf"])
def test_a_finite_value_unlike_the_recomputation_fails(recomputed):
    with pytest.raises(AssertionError, match="finite here and not the recomputation"):
        _check([-INF, 2.0], [-2.4e37, 2.0], witness=_recomputed([recomputed, 2.0]))


def test_finite_entries_are_compared_as_before():
    with pytest.raises(AssertionError, match="grad 0"):
        _check([-INF, 2.0], [-2.4e37, 3.0], witness=_recomputed([-2.4e37, 2.0]))


def test_a_finite_estimate_where_the_reference_overflowed_must_equal_the_recomputed_one():
    value, grads = torch.tensor(-3.5), (torch.tensor(1.0),)
    witness = lambda v: lambda: (torch.tensor(v, dtype=torch.float64), (None,))  # noqa: E731
    assert_same((torch.tensor(-INF), grads), (value, grads), RTOL, ATOL, "case", witness=witness(-3.5))
    with pytest.raises(AssertionError, match="value: non-finite in the reference, finite here and not"):
        assert_same((torch.tensor(-INF), grads), (value, grads), RTOL, ATOL, "case", witness=witness(-3.0))
    with pytest.raises(AssertionError, match="value: non-finite in the reference, finite here \\(no"):
        assert_same((torch.tensor(float("nan")), grads), (value, grads), RTOL, ATOL, "case")


def _grad_case(ref, got, recomputed):
    value = torch.tensor(1.0)
    witness = lambda: (value.double(), (torch.tensor(recomputed, dtype=torch.float64),))  # noqa: E731
    assert_same((value, (torch.tensor(ref),)), (value, (torch.tensor(got),)), RTOL, ATOL, "case", witness=witness)


def test_an_ill_conditioned_reference_is_judged_by_accuracy_against_the_wider_recomputation():
    ref, recomputed = [16.4816, -1.7822], [16.4720, -1.7822]
    assert _passes(_grad_case, ref, [16.4975, -1.7822], recomputed)  # 2.6× the reference's error
    assert not _passes(_grad_case, ref, [16.4975, -1.7900], recomputed)  # the other entry is still compared


def test_a_tier_much_farther_from_the_wider_recomputation_than_the_reference_fails():
    with pytest.raises(AssertionError, match="farther from the recomputation"):
        _grad_case([16.4816, -1.7822], [16.60, -1.7822], [16.4720, -1.7822])  # 13× the reference's error


def test_without_a_wider_recomputation_the_tolerance_stands():
    value = torch.tensor(1.0)
    with pytest.raises(AssertionError, match="grad 0"):
        assert_same((value, (torch.tensor([16.4816]),)), (value, (torch.tensor([16.4975]),)), RTOL, ATOL, "case")
    witness = lambda: (value.double(), (torch.tensor([16.4720]),))  # noqa: E731  float32: not wider
    with pytest.raises(AssertionError, match="grad 0"):
        assert_same((value, (torch.tensor([16.4816]),)), (value, (torch.tensor([16.4975]),)), RTOL, ATOL, "case",
                    witness=witness)
