"""Bayesian linear regression with known noise: exact answers for the diagonal optimizers.

Posterior N(mu*, Lambda^-1), Lambda = X^T X / s2 + I / eta (docs/math.md). The design has orthogonal
columns, so Lambda is diagonal and the exact posterior is also the optimal mean-field Gaussian.
"""

import numpy as np
import pytest
import tensorflow as tf
import keras

import tfnng

N, D, NOISE_VAR, ETA = 100, 3, 0.25, 1.0
STEPS = 4000


def design():
    rng = np.random.default_rng(0)
    q, _ = np.linalg.qr(rng.normal(size=(N, D)))
    x = q * np.sqrt(N) * np.array([1.0, 0.5, 2.0])
    y = x @ np.array([0.5, -1.0, 2.0]) + np.sqrt(NOISE_VAR) * rng.normal(size=N)
    precision = x.T @ x / NOISE_VAR + np.eye(D) / ETA
    return x, y, np.linalg.solve(precision, x.T @ y / NOISE_VAR), precision


def train(optimizer):
    x, y, _, _ = design()
    x, y = tf.constant(x), tf.constant(y)
    w = tf.Variable(tf.zeros(D, tf.float64))
    optimizer.build([w])

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(0.5 * (y - tf.linalg.matvec(x, w)) ** 2 / NOISE_VAR)
        optimizer.apply_gradients([(tape.gradient(loss, w), w)])

    for _ in range(STEPS):
        step()
    return w


def decay(lr):
    return keras.optimizers.schedules.PolynomialDecay(lr, STEPS, lr * 1e-3, power=2.0)


OPTIMIZERS = {
    "noisy_adam": lambda: tfnng.optimizers.NoisyAdam(learning_rate=decay(0.02), num_examples=N,
                                                     prior_variance=ETA, seed=0),
    "vadam": lambda: tfnng.optimizers.Vadam(learning_rate=decay(0.05), num_examples=N,
                                            prior_variance=ETA, seed=0),
    "ivon": lambda: tfnng.optimizers.IVON(learning_rate=decay(0.5), num_examples=N,
                                          prior_variance=ETA, beta_2=0.999, seed=0),
}


@pytest.mark.parametrize("method", sorted(OPTIMIZERS))
def test_posterior_mean_converges_to_exact_mean(method):
    _, _, exact_mean, precision = design()
    optimizer = OPTIMIZERS[method]()
    w = train(optimizer)
    exact_sd = 1 / np.sqrt(np.diag(precision))
    error_in_sds = np.abs(optimizer.posterior_mean(w).numpy() - exact_mean) / exact_sd
    assert error_in_sds.max() < 0.25, error_in_sds


def test_ivon_stddev_converges_to_exact_mean_field_stddev():
    """IVON's reparameterisation Hessian estimate is unbiased: sigma -> diag(Lambda)^-1/2."""
    _, _, _, precision = design()
    optimizer = OPTIMIZERS["ivon"]()
    w = train(optimizer)
    np.testing.assert_allclose(optimizer.posterior_stddev(w).numpy(),
                               1 / np.sqrt(np.diag(precision)), rtol=0.05)


def test_noisy_adam_stddev_is_the_papers_formula_at_the_gm_fixed_point():
    """Alg. 1 samples with variance (lambda/N)/(f + gamma_in). With full-batch gradients
    g = h (w - mu*) (h the mean-loss curvature) the GM estimate's fixed point is
    f = E[g^2] = h^2 sigma^2, i.e. f (f + gamma_in) = h^2 / N — not the GGN h (Khan et al. Thm. 1)."""
    x, _, _, _ = design()
    optimizer = OPTIMIZERS["noisy_adam"]()
    w = train(optimizer)
    gamma = optimizer.intrinsic_damping
    f = optimizer._slot("fisher", 0).numpy()
    np.testing.assert_allclose(optimizer.posterior_stddev(w).numpy(),
                               np.sqrt(1 / N / (f + gamma)), rtol=1e-12)
    h = np.diag(x.T @ x) / N / NOISE_VAR
    f_fixed_point = (-gamma + np.sqrt(gamma ** 2 + 4 * h ** 2 / N)) / 2
    np.testing.assert_allclose(f, f_fixed_point, rtol=0.15)


def test_kl_to_prior_matches_dense_gaussian_formula():
    w = tf.Variable(tf.zeros((4, 3), tf.float64))
    b = tf.Variable(tf.zeros(3, tf.float64))
    optimizer = tfnng.optimizers.Vadam(learning_rate=0.1, num_examples=7, prior_variance=0.3,
                                       hess_init=0.2, seed=1)
    for _ in range(3):
        optimizer.apply_gradients([(tf.random.normal(w.shape, dtype=tf.float64), w),
                                   (tf.random.normal(b.shape, dtype=tf.float64), b)])
    mu = np.concatenate([optimizer.posterior_mean(v).numpy().ravel() for v in (w, b)])
    var = np.concatenate([optimizer.posterior_stddev(v).numpy().ravel() ** 2 for v in (w, b)])
    k, eta = mu.size, 0.3
    sigma = np.diag(var)
    dense = 0.5 * (np.trace(sigma) / eta + mu @ mu / eta - k + k * np.log(eta)
                   - np.linalg.slogdet(sigma)[1])
    np.testing.assert_allclose(float(optimizer.kl_divergence()), dense, rtol=1e-10)
    assert dense > 0.1


def test_kl_of_float32_posteriors_is_summed_accurately():
    """float32 means and variances have their KL terms computed in float32 (for speed); the total
    of ~10^5 terms, some near 0 (sigma^2 close to eta), stays within 1e-5 of float64."""
    rng = np.random.default_rng(0)
    eta = 0.5
    means = [rng.normal(0.0, 0.3, (400, 300)), rng.normal(0.0, 0.3, 300)]
    variances = [eta * rng.uniform(1e-4, 1.0, (400, 300)), eta * np.full(300, 1.0 + 1e-3)]
    var_ratio = [v / eta for v in variances]
    exact = sum(0.5 * np.sum(r + m ** 2 / eta - 1.0 - np.log(r)) for m, r in zip(means, var_ratio))

    kl32 = tfnng.posteriors.diagonal.kl_to_isotropic_prior(
        [tf.constant(m, tf.float32) for m in means], [tf.constant(v, tf.float32) for v in variances],
        eta)
    mixed = tfnng.posteriors.diagonal.kl_to_isotropic_prior(
        [tf.constant(means[0], tf.float32), tf.constant(means[1])],
        [tf.constant(variances[0], tf.float32), tf.constant(variances[1])], eta)
    # Near the prior (KL ~0.03 from 1.2e5 terms) the KL is not lost to the rounding of sum(r) - D.
    near_prior = tfnng.posteriors.diagonal.kl_to_isotropic_prior(
        [tf.zeros((400, 300))], [tf.fill((400, 300), 0.3 * (1 + 1e-3))], 0.3)

    assert kl32.dtype == tf.float64
    np.testing.assert_allclose(float(kl32), exact, rtol=1e-5)
    np.testing.assert_allclose(float(mixed), exact, rtol=1e-5)
    np.testing.assert_allclose(float(near_prior), 0.5 * 120000 * (1e-3 - np.log1p(1e-3)), rtol=1e-3)
    # sigma^2 / eta below float32's smallest normal number (sigma 6e-17, eta 1e6): the ratio
    # flushed to 0 and the KL was +inf, though every variance is a normal float32.
    tiny = tfnng.posteriors.diagonal.kl_to_isotropic_prior(
        [tf.zeros(3)], [tf.constant([3.6e-33, 1e-30, 0.5e6], tf.float32)], 1e6)
    ratios = np.array([3.6e-33, 1e-30, 0.5e6], np.float32).astype(np.float64) / 1e6
    np.testing.assert_allclose(float(tiny), 0.5 * np.sum(ratios - 1.0 - np.log(ratios)), rtol=1e-6)
