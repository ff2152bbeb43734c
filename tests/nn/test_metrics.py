"""Tests for mcgraph.metrics: hand-computed cases, scikit-learn, properties, validation."""

from __future__ import annotations

import doctest
import math

import numpy as np
import pytest
import torch
from sklearn import metrics as skm

from mcgraph import metrics as M


def _random_problem(n=200, k=5, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    logits = 2.0 * torch.randn(n, k, generator=g, dtype=dtype)
    probs = logits.softmax(-1)
    labels = torch.randint(0, k, (n,), generator=g)
    return probs, labels


def _random_samples(s=8, n=50, k=4, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return (3.0 * torch.randn(s, n, k, generator=g, dtype=dtype)).softmax(-1)


# --------------------------------------------------------------------------- #
# accuracy / nll / brier
# --------------------------------------------------------------------------- #


def test_accuracy_hand():
    probs = torch.tensor([[0.7, 0.3], [0.4, 0.6], [0.9, 0.1], [0.2, 0.8]])
    labels = torch.tensor([0, 0, 0, 1])
    assert M.accuracy(probs, labels).item() == pytest.approx(0.75)


def test_accuracy_ties_go_to_lowest_index():
    probs = torch.tensor([[0.5, 0.5], [0.5, 0.5]])
    assert M.accuracy(probs, torch.tensor([0, 1])).item() == pytest.approx(0.5)
    assert M.accuracy(probs, torch.tensor([0, 0])).item() == pytest.approx(1.0)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_accuracy_matches_sklearn(seed):
    probs, labels = _random_problem(seed=seed)
    expected = skm.accuracy_score(labels.numpy(), probs.argmax(-1).numpy())
    assert M.accuracy(probs, labels).item() == pytest.approx(expected, abs=1e-12)


def test_nll_hand():
    probs = torch.tensor([[0.5, 0.5], [0.25, 0.75]], dtype=torch.float64)
    expected = -(math.log(0.5) + math.log(0.75)) / 2
    assert M.nll(probs, torch.tensor([0, 1])).item() == pytest.approx(expected, rel=1e-12)


def test_nll_clamps_zero_probability():
    probs = torch.tensor([[1.0, 0.0]], dtype=torch.float64)
    out = M.nll(probs, torch.tensor([1]), eps=1e-8)
    assert torch.isfinite(out)
    assert out.item() == pytest.approx(-math.log(1e-8))


@pytest.mark.parametrize("k", [2, 3, 7])
def test_nll_matches_sklearn_log_loss(k):
    probs, labels = _random_problem(k=k, seed=k)
    expected = skm.log_loss(labels.numpy(), probs.numpy(), labels=list(range(k)))
    assert M.nll(probs, labels).item() == pytest.approx(expected, rel=1e-10)


def test_brier_hand():
    probs = torch.tensor([[0.75, 0.25], [0.5, 0.5], [0.2, 0.3]], dtype=torch.float64)
    labels = torch.tensor([0, 1, 1])
    # (0.0625 + 0.0625) + (0.25 + 0.25) + (0.04 + 0.49) = 1.155
    assert M.brier(probs, labels).item() == pytest.approx(1.155 / 3, rel=1e-12)


def test_brier_binary_matches_sklearn():
    probs, labels = _random_problem(k=2, seed=3)
    binary = skm.brier_score_loss(labels.numpy(), probs[:, 1].numpy())
    # sklearn's default binary score is half of the multi-class sum over K = 2.
    assert M.brier(probs, labels).item() == pytest.approx(2 * binary, rel=1e-10)


def test_brier_multiclass_matches_sklearn():
    probs, labels = _random_problem(k=4, seed=4)
    expected = skm.brier_score_loss(
        labels.numpy(), probs.numpy(), labels=list(range(4)), scale_by_half=False
    )
    assert M.brier(probs, labels).item() == pytest.approx(expected, rel=1e-10)


def test_perfect_predictions_score_zero():
    labels = torch.tensor([2, 0, 1])
    probs = torch.nn.functional.one_hot(labels, 3).double()
    assert M.brier(probs, labels).item() == 0.0
    assert M.nll(probs, labels).item() == 0.0
    assert M.accuracy(probs, labels).item() == 1.0
    assert M.ece(probs, labels).item() == 0.0


@pytest.mark.parametrize("fn", [M.nll, M.brier])
def test_scoring_rules_gradcheck(fn):
    probs, labels = _random_problem(n=6, k=3, seed=5)
    probs.requires_grad_(True)
    assert torch.autograd.gradcheck(lambda p: fn(p, labels), (probs,))


def test_half_precision_accumulates_in_float32():
    probs, labels = _random_problem(n=64, k=3, seed=6)
    for fn in (M.accuracy, M.nll, M.brier, M.ece):
        out16 = fn(probs.half(), labels)
        assert out16.dtype == torch.float32
        assert out16.item() == pytest.approx(fn(probs, labels).item(), abs=5e-3)


# --------------------------------------------------------------------------- #
# ECE / reliability diagram
# --------------------------------------------------------------------------- #


def _ece_reference(probs, labels, num_bins):
    """Loop-based ECE with (lo, hi] bins, after Guo et al. (2017)."""
    conf, pred = probs.max(-1)
    correct = (pred == labels).double()
    edges = torch.linspace(0, 1, num_bins + 1, dtype=probs.dtype)
    total = 0.0
    for b in range(num_bins):
        lo, hi = edges[b], edges[b + 1]
        mask = (conf > lo) & (conf <= hi) if b > 0 else conf <= hi
        if mask.any():
            frac = mask.double().mean()
            total += frac * (correct[mask].mean() - conf[mask].double().mean()).abs()
    return float(total)


def test_ece_hand():
    probs = torch.tensor([[0.9, 0.1], [0.8, 0.2], [0.3, 0.7], [0.4, 0.6]], dtype=torch.float64)
    labels = torch.tensor([0, 1, 1, 0])
    # 2 bins: (0, .5] empty; (.5, 1] has conf {.9, .8, .7, .6} (mean .75) and
    # correct {1, 0, 1, 0} (acc .5): ECE = |0.5 - 0.75| = 0.25.
    assert M.ece(probs, labels, num_bins=2).item() == pytest.approx(0.25, rel=1e-12)
    # 5 bins: (.8, 1] -> {.9}: |1 - .9| ; (.6, .8] -> {.8, .7}: |.5 - .75|*2 ;
    # (.4, .6] -> {.6}: |0 - .6|.  ECE = (.1 + .5 + .6) / 4 = 0.3
    assert M.ece(probs, labels, num_bins=5).item() == pytest.approx(0.3, rel=1e-12)


@pytest.mark.parametrize("num_bins", [1, 3, 10, 15])
@pytest.mark.parametrize("seed", [0, 1])
def test_ece_matches_loop_reference(num_bins, seed):
    probs, labels = _random_problem(n=300, k=4, seed=seed)
    expected = _ece_reference(probs, labels, num_bins)
    assert M.ece(probs, labels, num_bins=num_bins).item() == pytest.approx(expected, abs=1e-12)


def test_ece_zero_for_perfectly_calibrated_data():
    # Within each confidence level c, exactly a fraction c of predictions are right.
    rows, labels = [], []
    for conf, n, n_correct in [(0.6, 10, 6), (0.8, 5, 4), (1.0, 3, 3), (0.75, 4, 3)]:
        for i in range(n):
            rows.append([conf, 1.0 - conf])
            labels.append(0 if i < n_correct else 1)
    probs = torch.tensor(rows, dtype=torch.float64)
    labels = torch.tensor(labels)
    for num_bins in (1, 4, 10, 15):
        assert M.ece(probs, labels, num_bins=num_bins).item() == pytest.approx(0.0, abs=1e-12)
    # Flipping one label breaks calibration.
    labels[0] = 1
    assert M.ece(probs, labels, num_bins=10).item() > 0.01


def test_ece_one_bin_is_accuracy_gap():
    probs, labels = _random_problem(seed=7)
    gap = (M.accuracy(probs, labels) - probs.max(-1).values.mean()).abs()
    assert M.ece(probs, labels, num_bins=1).item() == pytest.approx(gap.item(), abs=1e-12)


def test_reliability_diagram_hand_and_empty_bins():
    probs = torch.tensor([[0.9, 0.1], [0.8, 0.2], [0.3, 0.7]], dtype=torch.float64)
    rd = M.reliability_diagram(probs, torch.tensor([0, 1, 1]), num_bins=4)
    assert rd.count.tolist() == [0, 0, 1, 2]
    assert rd.count.dtype == torch.int64
    assert torch.isnan(rd.confidence[:2]).all() and torch.isnan(rd.accuracy[:2]).all()
    torch.testing.assert_close(rd.confidence[2:], torch.tensor([0.7, 0.85], dtype=torch.float64))
    torch.testing.assert_close(rd.accuracy[2:], torch.tensor([1.0, 0.5], dtype=torch.float64))


def test_reliability_diagram_bins_are_right_closed():
    # With 5 bins, a confidence of exactly 0.6 belongs to (0.4, 0.6], not (0.6, 0.8].
    probs = torch.tensor([[0.6, 0.4], [0.4, 0.6]], dtype=torch.float64)
    rd = M.reliability_diagram(probs, torch.tensor([0, 1]), num_bins=5)
    assert rd.count.tolist() == [0, 0, 2, 0, 0]


def test_reliability_diagram_consistent_with_ece():
    probs, labels = _random_problem(n=500, k=6, seed=8)
    rd = M.reliability_diagram(probs, labels, num_bins=12)
    assert int(rd.count.sum()) == probs.shape[0]
    nonempty = rd.count > 0
    weights = rd.count[nonempty].double() / probs.shape[0]
    via_diagram = (weights * (rd.accuracy[nonempty] - rd.confidence[nonempty]).abs()).sum()
    assert M.ece(probs, labels, num_bins=12).item() == pytest.approx(via_diagram.item(), abs=1e-12)


# --------------------------------------------------------------------------- #
# Entropy decomposition
# --------------------------------------------------------------------------- #


def test_predictive_entropy_hand():
    probs = torch.tensor([[0.5, 0.5, 0.0], [1.0, 0.0, 0.0], [0.25, 0.25, 0.5]], dtype=torch.float64)
    expected = torch.tensor([math.log(2), 0.0, 1.5 * math.log(2)], dtype=torch.float64)
    out = M.predictive_entropy(probs)
    assert out.shape == (3,)
    torch.testing.assert_close(out, expected)


def test_predictive_entropy_uniform_is_log_k():
    probs = torch.full((4, 10), 0.1, dtype=torch.float64)
    expected = torch.full((4,), math.log(10), dtype=torch.float64)
    torch.testing.assert_close(M.predictive_entropy(probs), expected)


def test_predictive_entropy_matches_scipy():
    from scipy.stats import entropy

    probs, _ = _random_problem(n=20, k=5, seed=9)
    expected = torch.from_numpy(entropy(probs.numpy(), axis=-1))
    torch.testing.assert_close(M.predictive_entropy(probs), expected)


def test_expected_entropy_hand():
    sample_probs = torch.tensor(
        [[[0.5, 0.5], [1.0, 0.0]], [[1.0, 0.0], [0.5, 0.5]], [[0.5, 0.5], [0.5, 0.5]]],
        dtype=torch.float64,
    )  # S=3, N=2
    expected = torch.tensor([2 * math.log(2) / 3, 2 * math.log(2) / 3], dtype=torch.float64)
    torch.testing.assert_close(M.expected_entropy(sample_probs), expected)


def test_mutual_information_hand():
    # Two confident samples that disagree: total = log 2, aleatoric = 0.
    sample_probs = torch.tensor([[[1.0, 0.0]], [[0.0, 1.0]]], dtype=torch.float64)
    torch.testing.assert_close(
        M.mutual_information(sample_probs), torch.tensor([math.log(2)], dtype=torch.float64)
    )


@pytest.mark.parametrize("seed", range(4))
def test_mutual_information_nonnegative_and_decomposes(seed):
    sample_probs = _random_samples(seed=seed)
    mi = M.mutual_information(sample_probs)
    assert mi.shape == (sample_probs.shape[1],)
    assert (mi >= 0).all()
    assert (mi > 1e-6).any()  # random samples disagree somewhere
    total = M.predictive_entropy(sample_probs.mean(0))
    torch.testing.assert_close(total, M.expected_entropy(sample_probs) + mi)


def test_mutual_information_zero_when_samples_agree():
    probs, _ = _random_problem(n=30, k=5, seed=10)
    sample_probs = probs.expand(16, -1, -1)
    mi = M.mutual_information(sample_probs)
    torch.testing.assert_close(mi, torch.zeros(30, dtype=torch.float64), atol=1e-12, rtol=0)
    torch.testing.assert_close(M.expected_entropy(sample_probs), M.predictive_entropy(probs))


# --------------------------------------------------------------------------- #
# AUROC
# --------------------------------------------------------------------------- #


def test_auroc_hand_with_tie():
    # Pairs (in, out): 0.5 vs {0.1, 0.4} wins, vs 0.5 ties; 0.9 wins all -> 5.5 / 6.
    out = M.auroc(torch.tensor([0.1, 0.4, 0.5]), torch.tensor([0.5, 0.9]))
    assert out.item() == pytest.approx(5.5 / 6)


def test_auroc_extremes():
    low, high = torch.tensor([0.0, 0.1, 0.2]), torch.tensor([0.5, 0.6])
    assert M.auroc(low, high).item() == 1.0
    assert M.auroc(high, low).item() == 0.0
    same = torch.tensor([0.3, 0.3])
    assert M.auroc(same, same).item() == 0.5


@pytest.mark.parametrize("seed", range(5))
def test_auroc_matches_sklearn_with_ties(seed):
    rng = np.random.default_rng(seed)
    s_in = np.round(rng.normal(0.0, 1.0, size=137), 1)  # rounding creates many ties
    s_out = np.round(rng.normal(0.7, 1.0, size=61), 1)
    y = np.concatenate([np.zeros_like(s_in), np.ones_like(s_out)])
    expected = skm.roc_auc_score(y, np.concatenate([s_in, s_out]))
    got = M.auroc(torch.from_numpy(s_in), torch.from_numpy(s_out))
    assert got.dtype == torch.float64
    assert got.item() == pytest.approx(expected, abs=1e-12)


def test_auroc_integer_and_mixed_dtypes():
    s_in = torch.tensor([0, 1, 1, 2])
    s_out = torch.tensor([1, 2, 3])
    y = np.r_[np.zeros(4), np.ones(3)]
    expected = skm.roc_auc_score(y, np.r_[s_in.numpy(), s_out.numpy()])
    assert M.auroc(s_in, s_out).item() == pytest.approx(expected)
    assert M.auroc(s_in.float(), s_out).item() == pytest.approx(expected)
    assert M.auroc(s_in.float(), s_out).dtype == torch.float32


# --------------------------------------------------------------------------- #
# Confidence-set curves
# --------------------------------------------------------------------------- #


def test_confidence_set_curves_hand():
    probs = torch.tensor([[0.9, 0.1], [0.8, 0.2], [0.4, 0.6], [0.55, 0.45]], dtype=torch.float64)
    labels = torch.tensor([0, 1, 1, 1])  # correct: T, F, T, F
    curves = M.confidence_set_curves(probs, labels, [0.0, 0.6, 0.8, 0.85, 1.0])
    # tau=0.6 keeps {.9, .8, .6} (>= is inclusive): 2 of 3 correct.
    torch.testing.assert_close(
        curves.accuracy[:4], torch.tensor([0.5, 2 / 3, 0.5, 1.0], dtype=torch.float64)
    )
    assert torch.isnan(curves.accuracy[4])
    torch.testing.assert_close(
        curves.size, torch.tensor([1.0, 0.75, 0.5, 0.25, 0.0], dtype=torch.float64)
    )


@pytest.mark.parametrize("seed", [0, 1])
def test_confidence_set_curves_match_masks(seed):
    probs, labels = _random_problem(n=250, k=3, seed=seed)
    thresholds = torch.linspace(0.0, 1.0, 41, dtype=torch.float64)[torch.randperm(41)]
    curves = M.confidence_set_curves(probs, labels, thresholds)
    conf, pred = probs.max(-1)
    correct = pred == labels
    for t, acc, size in zip(thresholds, curves.accuracy, curves.size):
        mask = conf >= t
        assert size.item() == pytest.approx(mask.double().mean().item())
        if mask.any():
            assert acc.item() == pytest.approx(correct[mask].double().mean().item())
        else:
            assert torch.isnan(acc)


def test_confidence_set_curves_lowest_threshold_is_accuracy_and_size_monotone():
    probs, labels = _random_problem(n=100, k=4, seed=11)
    thresholds = torch.linspace(0.0, 1.0, 21)
    curves = M.confidence_set_curves(probs, labels, thresholds)
    assert curves.accuracy[0].item() == pytest.approx(M.accuracy(probs, labels).item())
    assert curves.size[0].item() == 1.0
    assert (curves.size[1:] <= curves.size[:-1]).all()


# --------------------------------------------------------------------------- #
# Validation
# --------------------------------------------------------------------------- #

_P = torch.full((4, 3), 1 / 3)
_Y = torch.tensor([0, 1, 2, 0])


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: M.accuracy(_P[0], _Y), r"probs must be 2-D.*\(3,\)"),
        (lambda: M.nll(_P.unsqueeze(0), _Y), r"probs must be 2-D.*\(1, 4, 3\)"),
        (lambda: M.brier(_P, _Y[:3]), r"labels has shape \(3,\).*\(4, 3\)"),
        (lambda: M.ece(_P, _Y.view(2, 2)), r"labels must be 1-D.*\(2, 2\)"),
        (lambda: M.accuracy(_P, torch.tensor([0, 1, 3, 0])), r"labels must lie in \[0, 3\)"),
        (lambda: M.nll(_P, torch.tensor([0, -1, 2, 0])), r"labels must lie in \[0, 3\)"),
        (lambda: M.ece(_P, _Y, num_bins=0), r"num_bins must be >= 1, got 0"),
        (lambda: M.reliability_diagram(_P, _Y, num_bins=-2), r"num_bins must be >= 1"),
        (lambda: M.nll(_P, _Y, eps=-1.0), r"eps must be >= 0"),
        (lambda: M.predictive_entropy(_P.unsqueeze(0)), r"probs must be 2-D.*\(1, 4, 3\)"),
        (lambda: M.expected_entropy(_P), r"sample_probs must be 3-D.*\(4, 3\)"),
        (lambda: M.mutual_information(_P[0]), r"sample_probs must be 3-D.*\(3,\)"),
        (lambda: M.accuracy(torch.empty(0, 3), torch.empty(0, dtype=torch.long)), r"N >= 1"),
        (lambda: M.auroc(torch.zeros(2, 2), torch.zeros(3)), r"scores_in must be 1-D.*\(2, 2\)"),
        (lambda: M.auroc(torch.zeros(3), torch.zeros(0)), r"scores_out must hold at least one"),
        (lambda: M.confidence_set_curves(_P, _Y, 0.5), r"thresholds must be 1-D.*\(\)"),
        (lambda: M.confidence_set_curves(_P, _Y[1:], [0.5]), r"labels has shape \(3,\)"),
    ],
)
def test_validation_value_errors(call, match):
    with pytest.raises(ValueError, match=match):
        call()


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: M.accuracy(_P, _Y.float()), r"labels must be an integer tensor"),
        (lambda: M.brier(_P.long(), _Y), r"probs must be a floating-point tensor"),
        (lambda: M.ece(_P, _Y, num_bins=2.5), r"num_bins must be an int"),
        (lambda: M.nll(_P.numpy(), _Y), r"probs must be a torch.Tensor"),
        (lambda: M.set_validate_args(1), r"value must be a bool"),
    ],
)
def test_validation_type_errors(call, match):
    with pytest.raises(TypeError, match=match):
        call()


def test_set_validate_args_skips_label_range_check():
    bad = torch.tensor([0, 1, 5, 0])
    M.set_validate_args(False)
    try:
        # The range check is skipped: the out-of-range label simply never matches.
        assert M.accuracy(_P, bad).item() == pytest.approx(0.5)
    finally:
        M.set_validate_args(True)
    with pytest.raises(ValueError, match="labels must lie in"):
        M.accuracy(_P, bad)


def test_docstring_examples():
    result = doctest.testmod(
        M, extraglobs={"torch": torch}, optionflags=doctest.NORMALIZE_WHITESPACE
    )
    assert result.attempted > 10
    assert result.failed == 0
