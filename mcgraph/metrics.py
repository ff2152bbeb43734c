"""Evaluation metrics for probabilistic classifiers and Bayesian neural networks.

Everything here is pure torch and works on *probabilities*, not logits. The
shape conventions follow the rest of mcgraph (sample axis first):

* ``probs``: ``(N, K)`` predictive probabilities of ``N`` examples over ``K``
  classes, e.g. the Monte Carlo average ``sample_probs.mean(0)``.
* ``sample_probs``: ``(S, N, K)`` per-sample probabilities from ``S`` Monte
  Carlo draws of the weights.
* ``labels``: ``(N,)`` integer class indices in ``[0, K)``.

Scalar metrics return 0-d tensors on the input's device, so a training or
evaluation loop decides when to synchronise with the host. Inputs in float16
or bfloat16 are accumulated in float32; float32 and float64 keep their dtype.
Entropies are in nats.

Shape checks are free and always run. The one value-dependent check (labels in
``[0, K)``) costs a host synchronisation; switch it off with
:func:`set_validate_args` in hot loops.

Example:
    >>> import torch
    >>> from mcgraph import metrics
    >>> sample_probs = torch.tensor([[[0.9, 0.1]], [[0.1, 0.9]]])  # S=2, N=1
    >>> probs = sample_probs.mean(0)
    >>> labels = torch.tensor([0])
    >>> metrics.accuracy(probs, labels)
    tensor(1.)
    >>> metrics.mutual_information(sample_probs)  # the samples disagree
    tensor([0.3681])
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import torch
from torch import Tensor

__all__ = [
    "ConfidenceSetCurves",
    "ReliabilityDiagram",
    "accuracy",
    "auroc",
    "brier",
    "confidence_set_curves",
    "ece",
    "expected_entropy",
    "mutual_information",
    "nll",
    "prediction_metrics",
    "predictive_entropy",
    "reliability_diagram",
    "set_validate_args",
]

_VALIDATE_ARGS = True


def set_validate_args(value: bool) -> None:
    """Switch the value-dependent input checks on or off.

    Shape and dtype checks always run. With validation on (the default), the
    label range ``0 <= labels < K`` is also checked, which reads one boolean
    back from the device. Mirrors
    :meth:`torch.distributions.Distribution.set_default_validate_args`.

    Args:
        value: ``True`` to check label ranges, ``False`` to skip the check.

    Raises:
        TypeError: If ``value`` is not a ``bool``.

    Example:
        >>> from mcgraph import metrics
        >>> metrics.set_validate_args(False)
        >>> metrics.set_validate_args(True)
    """
    if not isinstance(value, bool):
        raise TypeError(f"set_validate_args: value must be a bool, got {type(value).__name__}")
    global _VALIDATE_ARGS
    _VALIDATE_ARGS = value


# --------------------------------------------------------------------------- #
# Validation helpers
# --------------------------------------------------------------------------- #


def _acc(t: Tensor) -> Tensor:
    """Upcast half-precision floats to float32 for accumulation."""
    if t.dtype in (torch.float16, torch.bfloat16):
        return t.float()
    return t


def _check_tensor(x: object, name: str, fn: str) -> Tensor:
    if not isinstance(x, Tensor):
        raise TypeError(f"{fn}: {name} must be a torch.Tensor, got {type(x).__name__}")
    return x


def _check_probs(probs: object, fn: str, name: str = "probs") -> Tensor:
    probs = _check_tensor(probs, name, fn)
    if probs.dim() != 2:
        raise ValueError(
            f"{fn}: {name} must be 2-D with shape (N, K), got shape {tuple(probs.shape)}"
        )
    if not probs.is_floating_point():
        raise TypeError(f"{fn}: {name} must be a floating-point tensor, got dtype {probs.dtype}")
    if probs.shape[0] < 1 or probs.shape[1] < 1:
        raise ValueError(
            f"{fn}: {name} must have N >= 1 and K >= 1, got shape {tuple(probs.shape)}"
        )
    return _acc(probs)


def _check_sample_probs(sample_probs: object, fn: str) -> Tensor:
    sample_probs = _check_tensor(sample_probs, "sample_probs", fn)
    if sample_probs.dim() != 3:
        raise ValueError(
            f"{fn}: sample_probs must be 3-D with shape (S, N, K), "
            f"got shape {tuple(sample_probs.shape)}"
        )
    if not sample_probs.is_floating_point():
        raise TypeError(
            f"{fn}: sample_probs must be a floating-point tensor, got dtype {sample_probs.dtype}"
        )
    if min(sample_probs.shape) < 1:
        raise ValueError(
            f"{fn}: sample_probs must have S, N, K >= 1, got shape {tuple(sample_probs.shape)}"
        )
    return _acc(sample_probs)


def _check_labels(labels: object, probs: Tensor, fn: str) -> Tensor:
    labels = _check_tensor(labels, "labels", fn)
    if labels.dim() != 1:
        raise ValueError(
            f"{fn}: labels must be 1-D with shape (N,), got shape {tuple(labels.shape)}"
        )
    if labels.is_floating_point() or labels.is_complex() or labels.dtype == torch.bool:
        raise TypeError(f"{fn}: labels must be an integer tensor, got dtype {labels.dtype}")
    n, k = probs.shape
    if labels.shape[0] != n:
        raise ValueError(
            f"{fn}: labels has shape {tuple(labels.shape)} but probs has shape "
            f"{tuple(probs.shape)}; expected labels of shape ({n},)"
        )
    if labels.device != probs.device:
        raise ValueError(
            f"{fn}: labels is on {labels.device} but probs is on {probs.device}"
        )
    if _VALIDATE_ARGS and bool(((labels < 0) | (labels >= k)).any()):
        raise ValueError(
            f"{fn}: labels must lie in [0, {k}) for probs of shape {tuple(probs.shape)}, "
            f"got values in [{int(labels.min())}, {int(labels.max())}]"
        )
    return labels.long()


def _check_num_bins(num_bins: object, fn: str) -> int:
    if isinstance(num_bins, bool) or not isinstance(num_bins, int):
        raise TypeError(f"{fn}: num_bins must be an int, got {type(num_bins).__name__}")
    if num_bins < 1:
        raise ValueError(f"{fn}: num_bins must be >= 1, got {num_bins}")
    return num_bins


def _check_scores(scores: object, name: str, fn: str) -> Tensor:
    scores = _check_tensor(scores, name, fn)
    if scores.dim() != 1:
        raise ValueError(
            f"{fn}: {name} must be 1-D with shape (n,), got shape {tuple(scores.shape)}"
        )
    if scores.shape[0] < 1:
        raise ValueError(f"{fn}: {name} must hold at least one score, got shape (0,)")
    if scores.is_complex():
        raise TypeError(f"{fn}: {name} must be real, got dtype {scores.dtype}")
    return scores


def _entropy(p: Tensor) -> Tensor:
    """Shannon entropy over the last axis, with 0 log 0 = 0."""
    return -torch.special.xlogy(p, p).sum(-1)


# --------------------------------------------------------------------------- #
# Proper scoring rules and accuracy
# --------------------------------------------------------------------------- #


def accuracy(probs: Tensor, labels: Tensor) -> Tensor:
    r"""Top-1 accuracy of the predictive distribution.

    .. math::

        \mathrm{acc} = \frac{1}{N} \sum_{i=1}^{N}
            \mathbb{1}\left[\arg\max_k p_{ik} = y_i\right]

    Ties in :math:`\arg\max` go to the lowest class index (as in
    :func:`torch.argmax` and :func:`numpy.argmax`).

    Args:
        probs: ``(N, K)`` predictive probabilities.
        labels: ``(N,)`` integer labels in ``[0, K)``.

    Returns:
        0-d tensor in the accumulation dtype of ``probs``.

    Raises:
        ValueError: If the shapes do not match the conventions or a label is
            out of range.

    Example:
        >>> probs = torch.tensor([[0.7, 0.3], [0.4, 0.6], [0.9, 0.1]])
        >>> accuracy(probs, torch.tensor([0, 0, 0]))
        tensor(0.6667)
    """
    probs = _check_probs(probs, "accuracy")
    labels = _check_labels(labels, probs, "accuracy")
    return (probs.argmax(-1) == labels).to(probs.dtype).mean()


def nll(probs: Tensor, labels: Tensor, eps: float = 1e-12) -> Tensor:
    r"""Mean negative log-likelihood (log loss) of the true labels.

    .. math::

        \mathrm{NLL} = -\frac{1}{N} \sum_{i=1}^{N} \log \max(p_{i y_i}, \varepsilon)

    The clamp at :math:`\varepsilon` keeps a zero probability on the true class
    finite. ``probs`` is not renormalised.

    Args:
        probs: ``(N, K)`` predictive probabilities.
        labels: ``(N,)`` integer labels in ``[0, K)``.
        eps: Lower clamp for the probability of the true class; ``>= 0``.

    Returns:
        0-d tensor in the accumulation dtype of ``probs``, differentiable with
        respect to ``probs``.

    Raises:
        ValueError: If the shapes do not match, a label is out of range, or
            ``eps`` is negative.

    Example:
        >>> probs = torch.tensor([[0.5, 0.5], [0.25, 0.75]])
        >>> nll(probs, torch.tensor([0, 1]))  # -(log 0.5 + log 0.75) / 2
        tensor(0.4904)
    """
    probs = _check_probs(probs, "nll")
    labels = _check_labels(labels, probs, "nll")
    if not eps >= 0:
        raise ValueError(f"nll: eps must be >= 0, got {eps}")
    p_true = probs.gather(1, labels.unsqueeze(1)).squeeze(1)
    return -p_true.clamp_min(eps).log().mean()


def brier(probs: Tensor, labels: Tensor) -> Tensor:
    r"""Multi-class Brier score (Brier, 1950).

    .. math::

        \mathrm{BS} = \frac{1}{N} \sum_{i=1}^{N} \sum_{k=1}^{K}
            \left(p_{ik} - \mathbb{1}[y_i = k]\right)^2

    For ``K = 2`` this is twice the binary score
    :math:`\frac{1}{N}\sum_i (p_{i1} - y_i)^2` that
    ``sklearn.metrics.brier_score_loss`` reports by default.

    Args:
        probs: ``(N, K)`` predictive probabilities.
        labels: ``(N,)`` integer labels in ``[0, K)``.

    Returns:
        0-d tensor in the accumulation dtype of ``probs``, in ``[0, 2]`` for
        probability vectors.

    Raises:
        ValueError: If the shapes do not match or a label is out of range.

    Example:
        >>> probs = torch.tensor([[0.75, 0.25], [0.5, 0.5]])
        >>> brier(probs, torch.tensor([0, 1]))  # (0.125 + 0.5) / 2
        tensor(0.3125)
    """
    probs = _check_probs(probs, "brier")
    labels = _check_labels(labels, probs, "brier")
    onehot = torch.nn.functional.one_hot(labels, probs.shape[1]).to(probs.dtype)
    return (probs - onehot).square().sum(-1).mean()


# --------------------------------------------------------------------------- #
# Calibration
# --------------------------------------------------------------------------- #


class ReliabilityDiagram(NamedTuple):
    """Per-bin statistics of a reliability diagram (Guo et al., 2017).

    Bin ``b`` of ``B`` covers confidences in ``(b / B, (b + 1) / B]``; the first
    bin also takes a confidence of exactly 0. Empty bins have ``count == 0``
    and NaN ``confidence`` and ``accuracy``.

    Attributes:
        confidence: ``(B,)`` mean max-probability of the examples in each bin.
        accuracy: ``(B,)`` fraction of correct top-1 predictions in each bin.
        count: ``(B,)`` int64 number of examples in each bin.
    """

    confidence: Tensor
    accuracy: Tensor
    count: Tensor


def _binned_sums(probs: Tensor, labels: Tensor, num_bins: int) -> tuple[Tensor, Tensor, Tensor]:
    """Per-bin sums of confidence and correctness, and counts, without host syncs."""
    conf, pred = probs.max(-1)
    correct = (pred == labels).to(probs.dtype)
    # Interior edges of the equal-width bins; bucketize(right=False) puts x
    # with edges[b-1] < x <= edges[b] into bin b, i.e. bins are (lo, hi].
    edges = torch.linspace(0.0, 1.0, num_bins + 1, dtype=probs.dtype, device=probs.device)
    idx = torch.bucketize(conf.detach(), edges[1:-1], right=False)
    zeros = probs.new_zeros(num_bins)
    conf_sum = zeros.index_add(0, idx, conf)
    correct_sum = zeros.index_add(0, idx, correct)
    count = torch.bincount(idx, minlength=num_bins)
    return conf_sum, correct_sum, count


def reliability_diagram(probs: Tensor, labels: Tensor, num_bins: int = 15) -> ReliabilityDiagram:
    r"""Reliability diagram over equal-width confidence bins.

    With confidence :math:`c_i = \max_k p_{ik}`, prediction
    :math:`\hat y_i = \arg\max_k p_{ik}` and bins :math:`B_b`,

    .. math::

        \mathrm{conf}(B_b) = \frac{1}{|B_b|} \sum_{i \in B_b} c_i, \qquad
        \mathrm{acc}(B_b) = \frac{1}{|B_b|} \sum_{i \in B_b}
            \mathbb{1}[\hat y_i = y_i].

    Args:
        probs: ``(N, K)`` predictive probabilities.
        labels: ``(N,)`` integer labels in ``[0, K)``.
        num_bins: Number ``B >= 1`` of equal-width bins on ``[0, 1]``.

    Returns:
        A :class:`ReliabilityDiagram` of ``(B,)`` tensors; the bin edges are
        ``torch.linspace(0, 1, B + 1)``.

    Raises:
        ValueError: If the shapes do not match, a label is out of range, or
            ``num_bins < 1``.

    Example:
        >>> probs = torch.tensor([[0.9, 0.1], [0.8, 0.2], [0.3, 0.7]])
        >>> rd = reliability_diagram(probs, torch.tensor([0, 1, 1]), num_bins=2)
        >>> rd.count
        tensor([0, 3])
        >>> rd.accuracy
        tensor([   nan, 0.6667])
    """
    probs = _check_probs(probs, "reliability_diagram")
    labels = _check_labels(labels, probs, "reliability_diagram")
    num_bins = _check_num_bins(num_bins, "reliability_diagram")
    conf_sum, correct_sum, count = _binned_sums(probs, labels, num_bins)
    denom = count.to(probs.dtype)
    return ReliabilityDiagram(conf_sum / denom, correct_sum / denom, count)


def ece(probs: Tensor, labels: Tensor, num_bins: int = 15) -> Tensor:
    r"""Expected calibration error with equal-width confidence bins.

    Following Guo et al. (ICML 2017, Eq. 3), with the bins of
    :func:`reliability_diagram`,

    .. math::

        \mathrm{ECE} = \sum_{b=1}^{B} \frac{|B_b|}{N}
            \left|\mathrm{acc}(B_b) - \mathrm{conf}(B_b)\right|
        = \frac{1}{N} \sum_{b=1}^{B}
            \Bigl|\sum_{i \in B_b} \bigl(\mathbb{1}[\hat y_i = y_i] - c_i\bigr)\Bigr|.

    Empty bins contribute zero.

    Args:
        probs: ``(N, K)`` predictive probabilities.
        labels: ``(N,)`` integer labels in ``[0, K)``.
        num_bins: Number ``B >= 1`` of equal-width bins on ``[0, 1]``.

    Returns:
        0-d float tensor in ``[0, 1]`` for probability vectors.

    Raises:
        ValueError: If the shapes do not match, a label is out of range, or
            ``num_bins < 1``.

    Example:
        >>> probs = torch.tensor([[0.9, 0.1], [0.8, 0.2], [0.3, 0.7]])
        >>> ece(probs, torch.tensor([0, 1, 1]), num_bins=2)  # |2 - 2.4| / 3
        tensor(0.1333)
    """
    probs = _check_probs(probs, "ece")
    labels = _check_labels(labels, probs, "ece")
    num_bins = _check_num_bins(num_bins, "ece")
    conf_sum, correct_sum, _ = _binned_sums(probs, labels, num_bins)
    return (correct_sum - conf_sum).abs().sum() / probs.shape[0]


# --------------------------------------------------------------------------- #
# Uncertainty decomposition
# --------------------------------------------------------------------------- #


def predictive_entropy(probs: Tensor) -> Tensor:
    r"""Entropy of the predictive distribution of each example (total uncertainty).

    .. math::

        \mathbb{H}[p_i] = -\sum_{k=1}^{K} p_{ik} \log p_{ik},
        \qquad 0 \log 0 = 0.

    Args:
        probs: ``(N, K)`` predictive probabilities.

    Returns:
        ``(N,)`` entropies in nats.

    Raises:
        ValueError: If ``probs`` is not 2-D.

    Example:
        >>> predictive_entropy(torch.tensor([[0.5, 0.5], [1.0, 0.0]]))
        tensor([0.6931, -0.0000])
    """
    probs = _check_probs(probs, "predictive_entropy")
    return _entropy(probs)


def expected_entropy(sample_probs: Tensor) -> Tensor:
    r"""Monte Carlo expected entropy of each example (aleatoric uncertainty).

    .. math::

        \mathbb{E}_{q(w)}\bigl[\mathbb{H}[p(y \mid x_i, w)]\bigr]
        \approx \frac{1}{S} \sum_{s=1}^{S} \mathbb{H}[p^{(s)}_i]

    (Depeweg et al., ICML 2018; Gal, 2016, Sec. 3.3.1).

    Args:
        sample_probs: ``(S, N, K)`` per-sample probabilities, sample axis first.

    Returns:
        ``(N,)`` expected entropies in nats.

    Raises:
        ValueError: If ``sample_probs`` is not 3-D.

    Example:
        >>> sample_probs = torch.tensor([[[0.5, 0.5]], [[1.0, 0.0]]])
        >>> expected_entropy(sample_probs)  # (log 2 + 0) / 2
        tensor([0.3466])
    """
    sample_probs = _check_sample_probs(sample_probs, "expected_entropy")
    return _entropy(sample_probs).mean(0)


def mutual_information(sample_probs: Tensor) -> Tensor:
    r"""Mutual information between label and weights (epistemic uncertainty).

    The BALD score (Houlsby et al., 2011): entropy of the Monte Carlo mean
    minus the mean entropy,

    .. math::

        \mathbb{I}[y; w \mid x_i] \approx
        \mathbb{H}\Bigl[\frac{1}{S}\sum_{s} p^{(s)}_i\Bigr]
        - \frac{1}{S}\sum_{s} \mathbb{H}[p^{(s)}_i] \;\ge\; 0.

    It is non-negative by Jensen's inequality and zero exactly when all
    samples agree; the result is clamped at zero to remove round-off.

    Args:
        sample_probs: ``(S, N, K)`` per-sample probabilities, sample axis first.

    Returns:
        ``(N,)`` mutual information in nats.

    Raises:
        ValueError: If ``sample_probs`` is not 3-D.

    Example:
        >>> sample_probs = torch.tensor([[[1.0, 0.0]], [[0.0, 1.0]]])
        >>> mutual_information(sample_probs)  # log 2 - 0
        tensor([0.6931])
    """
    sample_probs = _check_sample_probs(sample_probs, "mutual_information")
    total = _entropy(sample_probs.mean(0))
    aleatoric = _entropy(sample_probs).mean(0)
    return (total - aleatoric).clamp_min(0.0)


# --------------------------------------------------------------------------- #
# Out-of-distribution detection
# --------------------------------------------------------------------------- #


def auroc(scores_in: Tensor, scores_out: Tensor) -> Tensor:
    r"""Area under the ROC curve for separating out-of-distribution inputs.

    A higher score means "more likely OOD" (e.g. predictive entropy or mutual
    information), so the OOD examples are the positives. The area equals the
    normalised Mann–Whitney U statistic, with ties counted as one half (the
    average-rank convention of ``sklearn.metrics.roc_auc_score``):

    .. math::

        \mathrm{AUROC} = \frac{1}{n_\text{in}\, n_\text{out}}
            \sum_{i=1}^{n_\text{in}} \sum_{j=1}^{n_\text{out}}
            \Bigl(\mathbb{1}[s^\text{out}_j > s^\text{in}_i]
            + \tfrac{1}{2}\,\mathbb{1}[s^\text{out}_j = s^\text{in}_i]\Bigr).

    Computed in :math:`O((n_\text{in} + n_\text{out}) \log n_\text{in})` by
    sorting the in-distribution scores, with no host synchronisation. NaN
    scores are not checked for.

    Args:
        scores_in: ``(n_in,)`` scores of in-distribution examples.
        scores_out: ``(n_out,)`` scores of out-of-distribution examples.

    Returns:
        0-d tensor in ``[0, 1]``: float64 for integer or float64 scores, else
        float32. 1 means every OOD score ranks above every in-distribution
        score, 0.5 is chance.

    Raises:
        ValueError: If either input is not 1-D or is empty.

    Example:
        >>> auroc(torch.tensor([0.1, 0.4, 0.5]), torch.tensor([0.5, 0.9]))
        tensor(0.9167)
    """
    scores_in = _check_scores(scores_in, "scores_in", "auroc")
    scores_out = _check_scores(scores_out, "scores_out", "auroc")
    if scores_in.device != scores_out.device:
        raise ValueError(
            f"auroc: scores_in is on {scores_in.device} but scores_out is on {scores_out.device}"
        )
    common = torch.promote_types(scores_in.dtype, scores_out.dtype)
    sorted_in = torch.sort(scores_in.to(common)).values
    out = scores_out.to(common).contiguous()
    # less_j = #{i : s_in_i < s_out_j}, leq_j = #{i : s_in_i <= s_out_j};
    # the U statistic is sum_j (less_j + leq_j) / 2, exact in int64.
    less = torch.searchsorted(sorted_in, out, right=False)
    leq = torch.searchsorted(sorted_in, out, right=True)
    twice_u = (less + leq).sum()
    low_precision = (torch.float16, torch.bfloat16, torch.float32)
    res_dtype = torch.float32 if common in low_precision else torch.float64
    n_pairs = 2.0 * scores_in.shape[0] * scores_out.shape[0]
    return (twice_u.to(torch.float64) / n_pairs).to(res_dtype)


# --------------------------------------------------------------------------- #
# Confidence sets
# --------------------------------------------------------------------------- #


class ConfidenceSetCurves(NamedTuple):
    """Confidence-set accuracy and size curves, one entry per threshold.

    Attributes:
        accuracy: ``(T,)`` top-1 accuracy on the examples whose confidence is
            at least the threshold; NaN where that set is empty.
        size: ``(T,)`` fraction of all examples in that set, in ``[0, 1]``.
    """

    accuracy: Tensor
    size: Tensor


def confidence_set_curves(
    probs: Tensor, labels: Tensor, thresholds: Tensor | Sequence[float]
) -> ConfidenceSetCurves:
    r"""Confidence-set accuracy and size as functions of a threshold.

    The curves of Nazarovs et al. (UAI 2021, Figs. 7–8). For a threshold
    :math:`\tau`, the confidence set keeps the examples the model is at least
    :math:`\tau`-confident about,

    .. math::

        C_\tau = \{\, i : \max_k p_{ik} \ge \tau \,\}, \qquad
        \mathrm{acc}(\tau) = \frac{1}{|C_\tau|} \sum_{i \in C_\tau}
            \mathbb{1}[\hat y_i = y_i], \qquad
        \mathrm{size}(\tau) = \frac{|C_\tau|}{N}.

    A well-calibrated, useful model has accuracy rising with :math:`\tau`
    while the size falls slowly. Computed by sorting the confidences, without
    host synchronisation.

    Args:
        probs: ``(N, K)`` predictive probabilities.
        labels: ``(N,)`` integer labels in ``[0, K)``.
        thresholds: ``(T,)`` thresholds :math:`\tau`, a tensor or a sequence
            of floats, in any order. A tensor is cast to the dtype of
            ``probs``; a sequence is converted to it directly.

    Returns:
        A :class:`ConfidenceSetCurves` of two ``(T,)`` tensors in the
        accumulation dtype of ``probs``.

    Raises:
        ValueError: If the shapes do not match, a label is out of range, or
            ``thresholds`` is not 1-D.

    Example:
        >>> probs = torch.tensor([[0.9, 0.1], [0.8, 0.2], [0.4, 0.6]])
        >>> curves = confidence_set_curves(probs, torch.tensor([0, 1, 1]), [0.5, 0.85, 1.0])
        >>> curves.accuracy
        tensor([0.6667, 1.0000,    nan])
        >>> curves.size
        tensor([1.0000, 0.3333, 0.0000])
    """
    probs = _check_probs(probs, "confidence_set_curves")
    labels = _check_labels(labels, probs, "confidence_set_curves")
    # Sequences of Python floats are converted directly to the dtype of probs
    # (not via float32), so a threshold of 0.6 includes a float64 confidence
    # of exactly 0.6.
    if isinstance(thresholds, Tensor):
        thresholds = thresholds.to(device=probs.device)
    else:
        thresholds = torch.as_tensor(thresholds, dtype=probs.dtype, device=probs.device)
    if thresholds.dim() != 1:
        raise ValueError(
            "confidence_set_curves: thresholds must be 1-D with shape (T,), "
            f"got shape {tuple(thresholds.shape)}"
        )
    if thresholds.is_complex():
        raise TypeError(
            f"confidence_set_curves: thresholds must be real, got dtype {thresholds.dtype}"
        )
    n = probs.shape[0]
    conf, pred = probs.detach().max(-1)
    correct = (pred == labels).long()
    conf_sorted, order = torch.sort(conf)
    # tail[j] = number of correct predictions among the n - j most confident
    # (exact int64 counts); the set for tau starts at the first sorted
    # confidence >= tau.
    tail = torch.cat([correct[order].flip(0).cumsum(0).flip(0), correct.new_zeros(1)])
    first = torch.searchsorted(conf_sorted, thresholds.to(probs.dtype).contiguous(), right=False)
    in_set = (n - first).to(probs.dtype)
    return ConfidenceSetCurves(tail[first].to(probs.dtype) / in_set, in_set / n)


def prediction_metrics(probs: torch.Tensor, y: torch.Tensor) -> dict:
    """Accuracy, NLL, ECE (15 bins), Brier score, mean predictive entropy and the count of ``probs`` ``(N, K)``."""
    return {
        "accuracy": float(accuracy(probs, y)),
        "nll": float(nll(probs, y)),
        "ece": float(ece(probs, y, num_bins=15)),
        "brier": float(brier(probs, y)),
        "entropy": float(predictive_entropy(probs).mean()),
        "examples": int(y.shape[0]),
    }
