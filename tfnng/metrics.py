"""Evaluation metrics for predictive distributions (NumPy, evaluated eagerly on the host).

Inputs may be NumPy arrays, Python sequences or eager TensorFlow tensors. Every function checks
shapes (``ValueError`` on mismatch; an array of shape ``(N,)`` and one of shape ``(N, 1)`` are
treated as the same shape) and rejects non-numeric, NaN and infinite inputs with a ``ValueError``
(per-sample log-likelihoods may be ``-inf``). Scalar metrics are returned as Python floats.

Classification probabilities are ``(N, K)`` rows of class probabilities, or ``(N, 1)`` holding the
probability of class 1 of a binary problem (the output of
``tfnng.losses.BernoulliNLL.probabilities``), which is treated as the two classes ``[1 - p, p]``.
"""

import numbers
from typing import NamedTuple

import numpy as np
from scipy import special, stats

_PROB_ATOL = 1e-3  # tolerance on probabilities lying in [0, 1] and rows summing to one


def _array(name, x, dtype=np.float64, finite=True):
    """``x`` as a numeric NumPy array; NaN entries (and with ``finite``, +-inf) raise."""
    try:
        x = None if x is None else np.asarray(x, dtype=dtype)      # asarray(None) is NaN
    except (TypeError, ValueError):
        x = None
    if x is None or x.dtype == object or not (np.issubdtype(x.dtype, np.number)
                                             or x.dtype == bool):
        raise ValueError(f"`{name}` must be an array of numbers.")
    if np.issubdtype(x.dtype, np.floating):
        if np.isnan(x).any():
            raise ValueError(f"`{name}` contains NaN.")
        if finite and np.isinf(x).any():
            raise ValueError(f"`{name}` contains +-inf.")
    return x


def _same_shape(**arrays):
    """Check the arrays share a shape, squeezing a trailing singleton axis where ranks differ."""
    items = list(arrays.items())
    target = max((a.shape for _, a in items), key=len)
    squeezed = tuple(target[:-1]) if target and target[-1] == 1 else None
    out = []
    for _, a in items:
        if a.shape != target and a.shape == squeezed:
            a = a[..., np.newaxis]
        out.append(a)
    shapes = ", ".join(f"{name} {a.shape}" for name, a in items)
    if any(a.shape != target for a in out):
        raise ValueError(f"Shape mismatch: {shapes}.")
    if out[0].size == 0:
        raise ValueError(f"Empty inputs: {shapes}.")
    return out


def _class_probs(probs):
    """``(N, K)`` class probabilities; ``(N, 1)`` binary probabilities become ``[1 - p, p]``."""
    probs = _array("probs", probs)
    if probs.ndim != 2 or probs.shape[0] == 0:
        raise ValueError(f"`probs` must have shape (N, K) or (N, 1) with N > 0; got {probs.shape}.")
    if probs.min() < -_PROB_ATOL or probs.max() > 1 + _PROB_ATOL:
        raise ValueError("`probs` must lie in [0, 1]; were logits passed instead of probabilities?")
    if probs.shape[1] == 1:
        probs = np.concatenate([1.0 - probs, probs], axis=1)
    if np.abs(probs.sum(axis=1) - 1.0).max() > _PROB_ATOL:
        raise ValueError("Rows of `probs` must sum to 1.")
    return probs


def _class_labels(labels, num_rows, num_classes):
    """Integer labels ``(N,)`` from ``(N,)``, ``(N, 1)`` or one-hot ``(N, K)`` input."""
    labels = _array("labels", labels, dtype=None)
    if labels.ndim == 2 and labels.shape[1] == num_classes > 1:
        if not (np.isin(labels, (0, 1)).all() and (labels.sum(axis=1) == 1).all()):
            raise ValueError("One-hot `labels` must have a single 1 in each row, zeros elsewhere.")
        labels = labels.argmax(axis=1)
    elif labels.ndim == 2 and labels.shape[1] == 1:
        labels = labels[:, 0]
    if labels.shape != (num_rows,):
        raise ValueError(
            f"`labels` must have shape ({num_rows},), ({num_rows}, 1) or one-hot "
            f"({num_rows}, {num_classes}); got {labels.shape}."
        )
    if np.any(labels != np.round(labels)) or labels.min() < 0 or labels.max() >= num_classes:
        raise ValueError(f"`labels` must be integers in [0, {num_classes}).")
    return labels.astype(np.int64)


def rmse(y_true, y_pred_mean):
    """Root mean squared error sqrt(mean((y - mean)^2)) over all entries (NNG Tables 1, 5)."""
    y_true, y_pred_mean = _same_shape(
        y_true=_array("y_true", y_true), y_pred_mean=_array("y_pred_mean", y_pred_mean)
    )
    return float(np.sqrt(np.mean(np.square(y_true - y_pred_mean))))


def log_mean_exp_log_likelihood(per_sample_log_probs):
    """Per-point Monte Carlo predictive log-likelihood log (1/S) sum_s p(y_n | w_s).

    Input ``(S, N)`` of log p(y_n | w_s) for S posterior samples; returns ``(N,)`` computed as
    logsumexp over s minus log S (the "test log-likelihood" of NNG Tables 1, 5 is its mean).
    ``-inf`` entries (zero likelihood) are allowed; NaN and ``+inf`` are rejected.
    """
    log_probs = _array("per_sample_log_probs", per_sample_log_probs, finite=False)
    if log_probs.ndim != 2 or 0 in log_probs.shape:
        raise ValueError(
            f"`per_sample_log_probs` must have shape (S, N) with S, N > 0; got {log_probs.shape}."
        )
    if np.isposinf(log_probs).any():
        raise ValueError("`per_sample_log_probs` contains +inf.")
    return special.logsumexp(log_probs, axis=0) - np.log(log_probs.shape[0])


def accuracy(labels, probs):
    """Fraction of points whose most probable class (first on ties) equals the label."""
    probs = _class_probs(probs)
    labels = _class_labels(labels, *probs.shape)
    return float(np.mean(probs.argmax(axis=1) == labels))


class ReliabilityDiagram(NamedTuple):
    """Per-bin statistics of a reliability diagram (Guo et al. 2017, sec. 2).

    ``bin_edges`` ``(M + 1,)``; ``confidence`` and ``accuracy`` ``(M,)``, the mean max-probability
    and the accuracy of the points in each bin (NaN for empty bins); ``counts`` ``(M,)`` ints.
    """

    bin_edges: np.ndarray
    confidence: np.ndarray
    accuracy: np.ndarray
    counts: np.ndarray


def reliability_diagram_data(labels, probs, num_bins=15):
    """Bin points by confidence max_k p_k into ``num_bins`` equal-width bins ((m-1)/M, m/M].

    Bin 1 also holds confidence 0. Returns a :class:`ReliabilityDiagram`.
    """
    if isinstance(num_bins, bool) or not isinstance(num_bins, (int, np.integer)) or num_bins < 1:
        raise ValueError(f"`num_bins` must be a positive int; got {num_bins!r}.")
    probs = _class_probs(probs)
    labels = _class_labels(labels, *probs.shape)
    confidence = probs.max(axis=1)
    correct = (probs.argmax(axis=1) == labels).astype(np.float64)
    edges = np.arange(num_bins + 1) / num_bins        # exactly k / M (linspace can be an ulp below)
    bins = np.clip(np.digitize(confidence, edges, right=True) - 1, 0, num_bins - 1)
    counts = np.bincount(bins, minlength=num_bins)
    with np.errstate(invalid="ignore", divide="ignore"):
        mean_conf = np.bincount(bins, weights=confidence, minlength=num_bins) / counts
        mean_acc = np.bincount(bins, weights=correct, minlength=num_bins) / counts
    return ReliabilityDiagram(edges, mean_conf, mean_acc, counts)


def expected_calibration_error(labels, probs, num_bins=15):
    """Expected calibration error, Guo et al. (2017) eq. (3).

    ECE = sum_m (|B_m| / n) |acc(B_m) - conf(B_m)| over equal-width confidence bins B_m of
    :func:`reliability_diagram_data`, with confidence the maximum class probability.
    """
    diagram = reliability_diagram_data(labels, probs, num_bins)
    full = diagram.counts > 0
    gaps = np.abs(diagram.accuracy[full] - diagram.confidence[full])
    return float(np.sum(diagram.counts[full] * gaps) / np.sum(diagram.counts))


def coverage(y_true, mean, std, level=0.95):
    """Fraction of targets inside the central Gaussian interval mean +- z std.

    z = Phi^-1((1 + level) / 2), Phi the standard normal CDF.

    Used as the empirical coverage of the ``level`` predictive interval (ideal value ``level``).
    """
    if isinstance(level, bool) or not isinstance(level, numbers.Real) or not 0 < level < 1:
        raise ValueError(f"`level` must lie in (0, 1); got {level!r}.")
    y_true, mean, std = _same_shape(
        y_true=_array("y_true", y_true), mean=_array("mean", mean), std=_array("std", std)
    )
    if (std < 0).any():
        raise ValueError("`std` must be non-negative.")
    z = stats.norm.ppf(0.5 + 0.5 * level)
    return float(np.mean(np.abs(y_true - mean) <= z * std))
