"""Tests of tfnng.metrics on hand-computed examples."""

import math

import numpy as np
import pytest
import tensorflow as tf

from tfnng import metrics


def test_rmse_by_hand():
    assert metrics.rmse([1.0, 2.0, 3.0], [1.0, 2.0, 5.0]) == pytest.approx(math.sqrt(4 / 3))
    # (N,) against (N, 1), and eager tensors.
    assert metrics.rmse(tf.constant([1.0, 2.0]), np.array([[2.0], [4.0]])) == pytest.approx(
        math.sqrt(5 / 2)
    )


def test_rmse_rejects_bad_inputs():
    with pytest.raises(ValueError, match="Shape mismatch"):
        metrics.rmse(np.zeros(3), np.zeros(4))
    with pytest.raises(ValueError, match="Shape mismatch"):
        metrics.rmse(np.zeros((3, 2)), np.zeros(3))
    with pytest.raises(ValueError, match="NaN"):
        metrics.rmse([1.0, float("nan")], [1.0, 2.0])
    with pytest.raises(ValueError, match="Empty"):
        metrics.rmse([], [])
    with pytest.raises(ValueError, match="inf"):                   # NaN, reported as such
        metrics.rmse([np.inf], [np.inf])
    for bad in (None, ["a", "b"]):                                 # "contains NaN", ValueError
        with pytest.raises(ValueError, match="array of numbers"):
            metrics.rmse(bad, [1.0, 2.0])


def test_log_mean_exp_by_hand_and_stable():
    log_probs = np.log(np.array([[0.2, 0.5], [0.4, 0.1], [0.6, 0.3]]))
    np.testing.assert_allclose(
        metrics.log_mean_exp_log_likelihood(log_probs), np.log([0.4, 0.3]), rtol=1e-12
    )
    # exp(-1000) underflows; log((e^-1000 + e^-1001) / 2) = -1000 + log((1 + e^-1) / 2).
    got = metrics.log_mean_exp_log_likelihood([[-1000.0], [-1001.0]])
    np.testing.assert_allclose(got, [-1000.0 + math.log((1 + math.exp(-1)) / 2)], rtol=1e-12)
    got = metrics.log_mean_exp_log_likelihood([[-np.inf], [0.0]])
    np.testing.assert_allclose(got, [math.log(0.5)])


def test_log_mean_exp_rejects_bad_inputs():
    with pytest.raises(ValueError, match=r"\(S, N\)"):
        metrics.log_mean_exp_log_likelihood(np.zeros(3))
    for empty in (np.zeros((0, 3)), np.zeros((4, 0))):
        with pytest.raises(ValueError, match=r"S, N > 0"):
            metrics.log_mean_exp_log_likelihood(empty)
    with pytest.raises(ValueError, match="NaN"):
        metrics.log_mean_exp_log_likelihood([[0.0, np.nan]])
    with pytest.raises(ValueError, match=r"\+inf"):
        metrics.log_mean_exp_log_likelihood([[0.0, np.inf]])


def test_accuracy_by_hand():
    probs = [[0.7, 0.2, 0.1], [0.1, 0.3, 0.6], [0.5, 0.4, 0.1], [0.2, 0.5, 0.3]]
    assert metrics.accuracy([0, 2, 1, 1], probs) == pytest.approx(3 / 4)
    assert metrics.accuracy(np.eye(3)[[0, 2, 1, 1]], probs) == pytest.approx(3 / 4)
    # Binary (N, 1): probability of class 1.
    assert metrics.accuracy([[1], [0], [0]], [[0.9], [0.2], [0.7]]) == pytest.approx(2 / 3)


# Four points, ten bins. Confidence / correct: 0.95 / yes -> bin (0.9, 1]; 0.85 / no -> (0.8, 0.9];
# 0.65 / yes and 0.62 / no -> (0.6, 0.7].
ECE_PROBS = [[0.95, 0.05], [0.85, 0.15], [0.35, 0.65], [0.38, 0.62]]
ECE_LABELS = [0, 1, 1, 0]


def test_ece_by_hand():
    gap_top = abs(1.0 - 0.95)
    gap_mid = abs(0.0 - 0.85)
    gap_low = abs(0.5 - (0.65 + 0.62) / 2)
    expected = (1 * gap_top + 1 * gap_mid + 2 * gap_low) / 4
    assert metrics.expected_calibration_error(ECE_LABELS, ECE_PROBS, num_bins=10) == pytest.approx(
        expected
    )
    # One bin: |accuracy - mean confidence| over everything.
    one_bin = abs(2 / 4 - (0.95 + 0.85 + 0.65 + 0.62) / 4)
    assert metrics.expected_calibration_error(ECE_LABELS, ECE_PROBS, num_bins=1) == pytest.approx(
        one_bin
    )


def test_ece_is_zero_when_calibrated():
    probs = np.tile([[0.7, 0.2, 0.1]], (10, 1))
    labels = [0] * 7 + [1, 2, 1]
    assert metrics.expected_calibration_error(labels, probs) == pytest.approx(0.0, abs=1e-12)


def test_ece_binary_probabilities_are_two_classes():
    # p(class 1) = 0.92 -> conf 0.92, predict 1, correct; 0.15 -> conf 0.85, predict 0, correct;
    # 0.66 -> conf 0.66, predict 1, wrong. All in separate bins of ten.
    expected = ((1 - 0.92) + (1 - 0.85) + 0.66) / 3
    got = metrics.expected_calibration_error([1, 0, 0], [[0.92], [0.15], [0.66]], num_bins=10)
    assert got == pytest.approx(expected)


def test_reliability_diagram_data_by_hand():
    diagram = metrics.reliability_diagram_data(ECE_LABELS, ECE_PROBS, num_bins=10)
    np.testing.assert_allclose(diagram.bin_edges, np.linspace(0, 1, 11))
    np.testing.assert_array_equal(diagram.counts, [0, 0, 0, 0, 0, 0, 2, 0, 1, 1])
    np.testing.assert_allclose(diagram.confidence[[6, 8, 9]], [0.635, 0.85, 0.95])
    np.testing.assert_allclose(diagram.accuracy[[6, 8, 9]], [0.5, 0.0, 1.0])
    assert np.isnan(diagram.confidence[0]) and np.isnan(diagram.accuracy[0])


@pytest.mark.parametrize(
    "labels,probs,match",
    [
        ([0, 1], [[0.5, 0.5]], "labels"),
        ([0, 3], [[0.5, 0.5], [0.2, 0.8]], "labels"),
        ([0, 2], [[0.5, 0.5], [0.2, 0.8]], "labels"),             # class ids are 0..K-1
        ([0, 0.5], [[0.5, 0.5], [0.2, 0.8]], "labels"),
        ([0, 1], [[2.0, -1.0], [0.2, 0.8]], "logits"),
        ([0, 1], [[0.5, 0.6], [0.2, 0.8]], "sum to 1"),
        ([1], [[-0.5, 0.8, 0.7]], "logits"),                       # sums to 1, max <= 1
        ([0, 1], [[0.5, np.nan], [0.2, 0.8]], "NaN"),
        ([0, 1], [0.5, 0.2], r"\(N, K\)"),
        ([[0, 0, 0], [0, 1, 0]], [[0.5, 0.3, 0.2], [0.2, 0.7, 0.1]], "single 1"),
        ([[1, 1, 0], [0, 1, 0]], [[0.5, 0.3, 0.2], [0.2, 0.7, 0.1]], "single 1"),
        ([[0.5, 0.5, 0], [0, 1, 0]], [[0.5, 0.3, 0.2], [0.2, 0.7, 0.1]], "single 1"),
    ],
)
def test_classification_metrics_reject_bad_inputs(labels, probs, match):
    with pytest.raises(ValueError, match=match):
        metrics.expected_calibration_error(labels, probs)
    with pytest.raises(ValueError, match=match):
        metrics.accuracy(labels, probs)


def test_a_confidence_on_a_bin_edge_falls_in_the_bin_it_closes():
    """Bins are ((m-1)/M, m/M]: a confidence of exactly k/M belongs to bin k (1-based), for every
    M and k (``np.linspace`` edges lie an ulp below k/M for some, e.g. 5/7, 5/6)."""
    for num_bins in range(1, 51):
        for k in range(1, num_bins + 1):
            confidence = k / num_bins
            if confidence < 0.5:                      # the max of two probabilities is >= 1/2
                continue
            diagram = metrics.reliability_diagram_data([0], [[1.0 - confidence, confidence]],
                                                       num_bins=num_bins)
            assert diagram.counts[k - 1] == 1, (num_bins, k)


def test_num_bins_must_be_positive_int():
    with pytest.raises(ValueError, match="num_bins"):
        metrics.expected_calibration_error(ECE_LABELS, ECE_PROBS, num_bins=0)


def test_coverage_by_hand():
    y = [0.0, 1.0, 3.0, -2.5]
    # z(0.95) = 1.96: 0 and 1 are inside, 3 and -2.5 outside.
    assert metrics.coverage(y, np.zeros(4), np.ones(4)) == pytest.approx(0.5)
    # z(0.5) = 0.674: only 0 is inside; with std 2, also 1 (|1| <= 1.349).
    assert metrics.coverage(y, np.zeros(4), np.ones(4), level=0.5) == pytest.approx(0.25)
    assert metrics.coverage(y, np.zeros(4), 2 * np.ones(4), level=0.5) == pytest.approx(0.5)
    # The interval is closed: an exact point prediction (std 0) covers its target.
    assert metrics.coverage([1.0, 2.0, 3.0], [1.0, 2.0, 2.5], [0.0, 0.0, 0.0]) == pytest.approx(2 / 3)


def test_coverage_of_gaussian_samples():
    rng = np.random.default_rng(0)
    mean = rng.normal(size=20_000)
    std = rng.uniform(0.5, 2.0, size=20_000)
    y = mean + std * rng.normal(size=20_000)
    tolerance = 5 * math.sqrt(0.95 * 0.05 / 20_000)
    assert metrics.coverage(y, mean, std[:, None]) == pytest.approx(0.95, abs=tolerance)


def test_coverage_rejects_bad_inputs():
    with pytest.raises(ValueError, match="level"):
        metrics.coverage([0.0], [0.0], [1.0], level=1.0)
    with pytest.raises(ValueError, match="non-negative"):
        metrics.coverage([0.0], [0.0], [-1.0])
    with pytest.raises(ValueError, match="Shape mismatch"):
        metrics.coverage([0.0, 1.0], [0.0], [1.0])
    with pytest.raises(ValueError, match="NaN"):
        metrics.coverage([0.0], [np.nan], [1.0])
    with pytest.raises(ValueError, match="inf"):                   # coverage 1.0
        metrics.coverage([0.0, 1.0], [100.0, 100.0], [np.inf, np.inf])
    for level in ("0.9", None, float("nan"), True):               # TypeError for the first two
        with pytest.raises(ValueError, match="level"):
            metrics.coverage([0.0], [0.0], [1.0], level=level)
