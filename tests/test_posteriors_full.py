"""Dense-precision Gaussian (NNG-full) linear algebra against dense float64 NumPy computations."""

import numpy as np
import pytest
import tensorflow as tf

from tfnng.posteriors import full

D = 12


def precision(seed=0):
    rng = np.random.default_rng(seed)
    a = rng.normal(size=(D, D))
    return a @ a.T / D + 0.3 * np.eye(D)


def test_sample_square_root_reproduces_the_covariance():
    p = precision()
    root = full.sample(full.cholesky(p), np.eye(D)).numpy()
    np.testing.assert_allclose(root @ root.T, np.linalg.inv(p), atol=1e-12)


def test_sample_empirical_covariance():
    """100000 draws; every entry within 5 Wishart standard errors (see the low-rank test)."""
    p = precision()
    draws = full.sample(full.cholesky(p), tf.random.stateless_normal((D, 100_000), [1, 2],
                                                                      dtype=tf.float64)).numpy()
    cov = np.linalg.inv(p)
    stderr = np.sqrt((np.outer(np.diag(cov), np.diag(cov)) + cov ** 2) / draws.shape[1])
    assert np.max(np.abs(draws @ draws.T / draws.shape[1] - cov) / stderr) < 5.0


def test_precondition_covariance_and_marginals():
    p = precision()
    chol = full.cholesky(p)
    g = np.random.default_rng(1).normal(size=(D, 2))
    np.testing.assert_allclose(full.precondition(chol, g).numpy(), np.linalg.solve(p, g), rtol=1e-10)
    np.testing.assert_allclose(full.precondition(chol, g[:, 1]).numpy(), np.linalg.solve(p, g[:, 1]),
                               rtol=1e-10)
    np.testing.assert_allclose(full.covariance(chol).numpy(), np.linalg.inv(p), atol=1e-12)
    np.testing.assert_allclose(full.marginal_variances(chol).numpy(), np.diag(np.linalg.inv(p)),
                               rtol=1e-10)
    np.testing.assert_allclose(full.log_det_precision(chol).numpy(), np.linalg.slogdet(p)[1],
                               rtol=1e-12)


def test_kl_to_prior_matches_dense_formula():
    p = precision()
    mean = np.random.default_rng(2).normal(size=D)
    cov, eta = np.linalg.inv(p), 0.4
    dense = 0.5 * (np.trace(cov) / eta + mean @ mean / eta - D + D * np.log(eta)
                   - np.linalg.slogdet(cov)[1])
    np.testing.assert_allclose(full.kl_to_isotropic_prior(mean, full.cholesky(p), eta).numpy(), dense,
                               rtol=1e-10)
    assert dense > 1.0


def test_moving_average_and_damped_precision_follow_nng_eq_9():
    rng = np.random.default_rng(3)
    fisher, grads = precision(), rng.normal(size=(D, 4))
    updated = full.moving_average(fisher, grads, 0.1).numpy()
    np.testing.assert_allclose(updated, 0.9 * fisher + 0.1 * grads @ grads.T, rtol=1e-12)
    n, kl_weight, eta = 50, 0.5, 2.0
    gamma_in = kl_weight / (n * eta)
    np.testing.assert_allclose(full.damped_precision(updated, n / kl_weight, gamma_in).numpy(),
                               n / kl_weight * updated + np.eye(D) / eta, rtol=1e-12)


def test_parameter_limit_raises_a_clear_error():
    assert full.check_parameter_count(10_000) == 10_000
    with pytest.raises(ValueError, match=r"10001 x 10001 .*max_parameters=10000"):
        full.check_parameter_count(10_001)
    assert full.check_parameter_count(20_000, max_parameters=20_000) == 20_000
    with pytest.raises(ValueError, match="max_parameters=5"):
        full.check_parameter_count(6, max_parameters=5)


def test_a_precision_that_rounding_made_singular_is_factorised_with_a_little_damping():
    """F_bar of collinear per-example gradients under a tiny gamma_in: TensorFlow's Cholesky
    factor was NaN, and NNG-full put NaN into its posterior (mean, stddev, KL) with no update
    skipped. The factor is now that of F_bar + delta I for the smallest delta of the retries;
    a positive definite precision is factorised as it is."""
    p = precision()
    np.testing.assert_array_equal(full.cholesky(p), tf.linalg.cholesky(p))
    rng = np.random.default_rng(1)
    g = rng.normal(size=(D, 3))
    g[:, 1] = g[:, 0]                                  # collinear gradients
    singular = full.damped_precision(g @ g.T / 3, 1.0, 1e-18)
    assert not np.all(np.isfinite(tf.linalg.cholesky(singular).numpy()))
    chol = full.cholesky(singular).numpy()
    assert np.all(np.isfinite(chol))
    jitter = np.diag(chol @ chol.T - singular.numpy())
    np.testing.assert_allclose(chol @ chol.T, singular.numpy() + np.diag(jitter), atol=1e-12)
    scale = np.trace(singular.numpy()) / D + 1
    assert np.allclose(jitter, jitter[0]) and 0 < jitter[0] <= 1e-2 * scale


def test_nng_full_posterior_stays_finite_with_collinear_inputs_and_a_tiny_prior_damping():
    import keras
    import tfnng
    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 3)).astype("float32")
    x = np.concatenate([x, x[:, :1]], 1)
    y = (x[:, :1] - x[:, 1:2] + 0.1 * rng.normal(size=(32, 1))).astype("float32")
    keras.utils.set_random_seed(0)
    net = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)], name="collinear")
    model = tfnng.BayesianModel(net, seed=0)
    optimizer = tfnng.optimizers.NoisyNaturalGradient(0.01, num_examples=10**9,
                                                      prior_variance=1e9, beta=0.5, seed=0)
    model.compile(optimizer=optimizer, loss=tfnng.losses.GaussianNLL(noise_variance=0.1))
    for _ in range(60):
        model.train_on_batch(x, y)
    kernel = net.layers[0].kernel
    for value in (optimizer.posterior_mean(kernel), optimizer.posterior_stddev(kernel),
                  optimizer.kl_divergence()):
        assert np.all(np.isfinite(value.numpy()))
    assert optimizer.skipped_updates == 0
