"""Exact Gaussian VI references of the logistic-regression benchmark (tfnng.bench.logreg)."""

from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_probability as tfp
from scipy import integrate, special, stats

from tfnng.bench import logreg

DATA_DIR = Path(__file__).parents[1].parent / "shared" / "datasets" / "logreg"


@pytest.fixture(scope="module")
def problem():
    """A small correlated logistic-regression problem: bias + 2 features, N = 40."""
    rng = np.random.default_rng(0)
    features = rng.normal(size=(80, 2)) @ np.array([[1.0, 0.8], [0.0, 0.6]])
    x = np.hstack([np.ones((80, 1)), features])
    y = (rng.uniform(size=80) < special.expit(x @ np.array([0.3, 1.5, -1.0]))).astype(float)
    split = logreg.Split(x[:40], y[:40], x[40:], y[40:], np.array([1e-2, 1.0, 2.0]))
    return split, logreg.fit_full_gaussian(split), logreg.fit_mean_field(split)


def _gaussian_expectations(means, variances, function):
    """E[function(f)] for f ~ N(m, v), by adaptive quadrature (independent of Gauss-Hermite)."""
    return np.array([integrate.quad(lambda f: function(f) * stats.norm.pdf(f, m, np.sqrt(v)),
                                    m - 12 * np.sqrt(v), m + 12 * np.sqrt(v), epsabs=1e-13)[0]
                     for m, v in zip(means, variances)])


def _moments(split, gaussian):
    x = split.x_train
    return x @ gaussian.mean, np.einsum("ij,jk,ik->i", x, gaussian.covariance, x)


def test_full_gaussian_optimum_satisfies_the_fixed_point_conditions(problem):
    """Stationarity of the Gaussian ELBO (Opper & Archambeau 2009): with f_i ~ N(x_i^T mu, x_i^T S x_i),
    sum_i x_i E[y_i - sigmoid(f_i)] = P0 mu  and  S^-1 = sum_i E[sigmoid'(f_i)] x_i x_i^T + P0."""
    split, full, _ = problem
    assert full.info["converged"] and full.info["gradient_sup_norm"] < 1e-8
    m, v = _moments(split, full)
    residual = _gaussian_expectations(m, v, special.expit)
    curvature = _gaussian_expectations(m, v, lambda f: special.expit(f) * special.expit(-f))
    x, precision = split.x_train, np.diag(split.prior_precision)
    np.testing.assert_allclose(x.T @ (split.y_train - residual), precision @ full.mean, atol=1e-6)
    np.testing.assert_allclose(np.linalg.inv(full.covariance),
                               (x.T * curvature) @ x + precision, rtol=1e-6)


def test_mean_field_optimum_fixed_point_and_lower_elbo(problem):
    """The MF optimum: same mean condition, 1/sigma_j^2 = sum_i E[sigmoid'(f_i)] x_ij^2 + p_j; its
    ELBO is below the full-Gaussian one (the features are correlated)."""
    split, full, mean_field = problem
    m, v = _moments(split, mean_field)
    curvature = _gaussian_expectations(m, v, lambda f: special.expit(f) * special.expit(-f))
    x = split.x_train
    np.testing.assert_allclose(1.0 / np.diag(mean_field.covariance),
                               (x ** 2).T @ curvature + split.prior_precision, rtol=1e-6)
    full_metrics = logreg.evaluate(split, full, full)
    mf_metrics = logreg.evaluate(split, mean_field, full)
    assert mf_metrics["neg_elbo_per_example"] > full_metrics["neg_elbo_per_example"] + 1e-4
    assert mf_metrics["symmetric_kl"] > 0.01 and abs(full_metrics["symmetric_kl"]) < 1e-10


def test_slang_code_convention_drops_the_bias_prior_log_precision_from_the_kl(problem):
    """SLANG's Table 1 -ELBO comes from chol_log_reg.m, whose KL term is
    0.5 (log det V + sum_{j >= 2} log p_j - tr(V diag p) - m^T diag p m + D): the bias prior's
    log precision (p_1) is missing. Written out here from that formula, against ours (exact KL)."""
    split, full, _ = problem
    n, dim = split.x_train.shape
    expected_log_lik = logreg.expected_log_likelihood(
        tf.constant(split.x_train), tf.constant(split.y_train), tf.constant(full.mean),
        tf.constant(np.linalg.cholesky(full.covariance))).numpy()
    p, v, m = split.prior_precision, full.covariance, full.mean
    negative_kl = 0.5 * (np.linalg.slogdet(v)[1] + np.sum(np.log(p[1:])) - np.trace(v * p)
                         - m @ (p * m) + dim)
    metrics = logreg.evaluate(split, full, full)
    np.testing.assert_allclose(metrics["neg_elbo_per_example_slang_code"],
                               -(negative_kl + expected_log_lik) / n, rtol=1e-10)
    np.testing.assert_allclose(metrics["neg_elbo_per_example"] - metrics["neg_elbo_per_example_slang_code"],
                               -0.5 * np.log(p[0]) / n, rtol=1e-10)


def test_gauss_hermite_expectation_matches_monte_carlo(problem):
    """The quadrature of E_q[log p(y | X, w)] against 400000 joint draws of w ~ q (tolerance: 4
    Monte Carlo standard errors)."""
    split, full, _ = problem
    x, y = split.x_train, split.y_train
    chol = np.linalg.cholesky(full.covariance)
    quadrature = logreg.expected_log_likelihood(tf.constant(x), tf.constant(y),
                                                tf.constant(full.mean), tf.constant(chol)).numpy()
    draws = full.mean + np.random.default_rng(1).normal(size=(400_000, 3)) @ chol.T
    log_lik = -np.logaddexp(0.0, -(2 * y - 1) * (draws @ x.T)).sum(axis=1)
    stderr = log_lik.std() / np.sqrt(log_lik.size)
    assert abs(quadrature - log_lik.mean()) < 4 * stderr


def test_symmetric_kl_is_the_average_of_both_directions():
    rng = np.random.default_rng(2)
    a, b = rng.normal(size=(4, 4)), rng.normal(size=(4, 4))
    p = logreg.Gaussian(rng.normal(size=4), a @ a.T + np.eye(4))
    q = logreg.Gaussian(rng.normal(size=4), b @ b.T + 0.5 * np.eye(4))
    dist = lambda g: tfp.distributions.MultivariateNormalTriL(    # noqa: E731
        g.mean, tf.linalg.cholesky(g.covariance))
    expected = 0.5 * (tfp.distributions.kl_divergence(dist(p), dist(q))
                      + tfp.distributions.kl_divergence(dist(q), dist(p))).numpy()
    np.testing.assert_allclose(logreg.symmetric_kl(p, q), expected, rtol=1e-10)
    np.testing.assert_allclose(logreg.symmetric_kl(q, p), expected, rtol=1e-10)


@pytest.mark.skipif(not (DATA_DIR / "breast_cancer_scale.mat").is_file(),
                    reason=f"logistic-regression data not found in {DATA_DIR}")
def test_breast_cancer_smoke_run():
    """One random split of Breast-Cancer: the MF-exact symmetric KL is near SLANG Table 1's 7.771."""
    spec = logreg.DATASETS["breast_cancer"]
    x, y = logreg.load_dataset(DATA_DIR, "breast_cancer")
    assert x.shape == (683, 11) and np.all(x[:, 0] == 1) and set(np.unique(y)) == {0.0, 1.0}
    split, = logreg.make_splits(x, y, spec.prior_precision, spec.bias_prior_precision, 1)
    assert split.x_train.shape[0] == 341 and split.prior_precision[0] == 1e-5
    full = logreg.fit_full_gaussian(split)
    mean_field = logreg.fit_mean_field(split)
    metrics = logreg.evaluate(split, mean_field, full)
    assert full.info["converged"] and mean_field.info["converged"]
    assert 4.0 < metrics["symmetric_kl"] < 16.0
    assert metrics["test_log_loss"] < 0.15
