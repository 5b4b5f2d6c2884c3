"""Kronecker-factored posteriors against dense matrices (float64).

``vec`` is the paper's column-stacking vec (``W.T.ravel()`` in numpy); the MVG covariance on it is
``Sigma_2 (x) Sigma_1`` and the damped curvature ``S_g (x) A_g``.
"""

import numpy as np
import pytest
import tensorflow as tf

from tfnng.posteriors import kronecker as kr


def vec(w):
    return np.asarray(w).T.ravel()


def unvec(v, p, q):
    return np.asarray(v).reshape(q, p).T


def random_psd(rng, n, rank=None):
    x = rng.normal(size=(rank or 2 * n, n))
    return x.T @ x / x.shape[0]


def test_damping_split_and_zero_trace():
    rng = np.random.default_rng(0)
    a, s = random_psd(rng, 4), 3.0 * random_psd(rng, 2)
    pi = kr.damping_split(tf.constant(a), tf.constant(s)).numpy()
    np.testing.assert_allclose(pi, np.sqrt((np.trace(a) / 4) / (np.trace(s) / 2)), rtol=1e-12)
    assert kr.damping_split(tf.constant(a), tf.zeros((2, 2), tf.float64)).numpy() == 1.0
    assert kr.damping_split(tf.zeros((4, 4), tf.float64), tf.constant(s)).numpy() == 1.0


def test_safe_eigh_clips_negative_eigenvalues_and_flags_non_finite_input():
    m = np.diag([2.0, -1e-9, 0.5])
    values, vectors, ok = kr.safe_eigh(tf.constant(m))
    assert bool(ok) and values.numpy().min() == 0.0
    bad = m.copy()
    bad[0, 1] = np.nan
    values, vectors, ok = kr.safe_eigh(tf.constant(bad))
    assert not bool(ok)
    assert np.isfinite(values.numpy()).all() and np.isfinite(vectors.numpy()).all()


@pytest.mark.parametrize("p,q", [(4, 3), (5, 1)])
def test_preconditioned_step_equals_dense_solve(p, q):
    rng = np.random.default_rng(p * 10 + q)
    a, s = random_psd(rng, p, rank=2), random_psd(rng, q)   # A singular: damping matters
    gamma_in, gamma = 0.02, 0.05
    cache = kr.mvg_cache(tf.constant(a), tf.constant(s), gamma_in, gamma)
    v = rng.normal(size=(p, q))
    step = kr.mvg_precondition(cache["a_inv"], cache["s_inv"], tf.constant(v)).numpy()
    pi = np.sqrt((np.trace(a) / p) / (np.trace(s) / q))
    a_g = a + pi * np.sqrt(gamma) * np.eye(p)
    s_g = s + np.sqrt(gamma) / pi * np.eye(q)
    dense = np.linalg.solve(np.kron(s_g, a_g), vec(v))
    np.testing.assert_allclose(vec(step), dense, rtol=1e-9, atol=1e-12)
    # the sampling factors use gamma_in only
    a_in = a + pi * np.sqrt(gamma_in) * np.eye(p)
    np.testing.assert_allclose(cache["a_root"].numpy() @ cache["a_root"].numpy(),
                               np.linalg.inv(a_in), rtol=1e-9, atol=1e-12)


def test_samples_have_the_mvg_covariance_and_operators_match_dense():
    rng = np.random.default_rng(1)
    p, q, n = 3, 2, 200_000
    a, s = random_psd(rng, p), random_psd(rng, q)
    gamma_in, scale = 0.1, 0.7
    cache = kr.mvg_cache(tf.constant(a), tf.constant(s), gamma_in, gamma_in)
    pi = np.sqrt((np.trace(a) / p) / (np.trace(s) / q))
    sigma_1 = scale ** 2 * np.linalg.inv(a + pi * np.sqrt(gamma_in) * np.eye(p))
    sigma_2 = np.linalg.inv(s + np.sqrt(gamma_in) / pi * np.eye(q))
    dense = np.kron(sigma_2, sigma_1)                                   # on the column-stacking vec
    mean = rng.normal(size=(p, q))
    noise = tf.constant(rng.normal(size=(n, p, q)))
    draws = kr.mvg_sample(tf.constant(mean), cache["a_root"], cache["s_root"], noise, scale).numpy()
    flat = np.transpose(draws, (0, 2, 1)).reshape(n, -1)
    np.testing.assert_allclose(flat.mean(0), vec(mean), atol=4 * np.sqrt(np.diag(dense).max() / n))
    emp = np.cov(flat, rowvar=False)
    tol = 5 * np.sqrt((np.outer(np.diag(dense), np.diag(dense)) + dense ** 2) / n)
    assert (np.abs(emp - dense) < tol).all(), np.abs(emp - dense) / tol
    # marginals, Kronecker operators (row-major flattening) and the closed-form KL
    np.testing.assert_allclose(
        kr.mvg_marginal_variances(cache["a_root"], cache["s_root"], scale).numpy(),
        unvec(np.diag(dense), p, q), rtol=1e-10)
    op = kr.mvg_covariance_operator(cache["a_root"], cache["s_root"], scale)
    np.testing.assert_allclose(op.to_dense().numpy(), np.kron(sigma_1, sigma_2), rtol=1e-10)
    root = kr.mvg_scale_operator(cache["a_root"], cache["s_root"], scale).to_dense().numpy()
    np.testing.assert_allclose(root @ root.T, np.kron(sigma_1, sigma_2), rtol=1e-10, atol=1e-14)
    eta, k = 0.8, p * q
    kl_dense = 0.5 * (np.trace(dense) / eta + vec(mean) @ vec(mean) / eta - k + k * np.log(eta)
                      - np.linalg.slogdet(dense)[1])
    kl = kr.mvg_kl_to_isotropic_prior(tf.constant(mean), cache["a_values"], cache["s_values"],
                                      scale, eta).numpy()
    np.testing.assert_allclose(kl, kl_dense, rtol=1e-10)
    as_tensor = kr.mvg_kl_to_isotropic_prior(tf.constant(mean), cache["a_values"],
                                             cache["s_values"], scale, tf.constant(eta, tf.float32))
    np.testing.assert_allclose(as_tensor, kl_dense, rtol=1e-6)   # eta rounded to float32


def _chain_factors(rng, dims_in, dims_out, n=40):
    """Joint second moments of a 3-layer chain from random correlated activations/gradients."""
    a_all = rng.normal(size=(n, sum(dims_in))) @ rng.normal(size=(sum(dims_in),) * 2) * 0.5
    g_all = rng.normal(size=(n, sum(dims_out))) @ rng.normal(size=(sum(dims_out),) * 2) * 0.5
    a_all[:, np.cumsum(dims_in) - 1] = 1.0                      # homogeneous coordinates
    a_split = np.split(a_all, np.cumsum(dims_in)[:-1], axis=1)
    g_split = np.split(g_all, np.cumsum(dims_out)[:-1], axis=1)
    second = lambda x, y: x.T @ y / n
    return ([second(x, x) for x in a_split], [second(g, g) for g in g_split],
            [second(a_split[l], a_split[l + 1]) for l in range(2)],
            [second(g_split[l], g_split[l + 1]) for l in range(2)])


def test_block_tridiagonal_matches_dense_construction():
    rng = np.random.default_rng(2)
    dims_in, dims_out = [3, 4, 3], [3, 2, 2]     # p_l (with homogeneous 1) and q_l
    a_diag, s_diag, a_off, s_off = _chain_factors(rng, dims_in, dims_out)
    gamma = 0.05
    blocks, ok = kr.blktri_cache([tf.constant(x) for x in a_diag], [tf.constant(x) for x in s_diag],
                                 [tf.constant(x) for x in a_off], [tf.constant(x) for x in s_off], gamma)
    assert bool(ok)
    sizes = [p * q for p, q in zip(dims_in, dims_out)]
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    n = offsets[-1]

    def split(v):
        return [tf.constant(unvec(v[offsets[l]:offsets[l + 1]], dims_in[l], dims_out[l]))
                for l in range(3)]

    def join(ws):
        return np.concatenate([vec(w.numpy()) for w in ws])

    # dense F_hat^-1 (the covariance up to lambda/N) by preconditioning unit vectors
    inverse = np.stack([join(kr.blktri_precondition(blocks, split(e))) for e in np.eye(n)], axis=1)
    np.testing.assert_allclose(inverse, inverse.T, atol=1e-10)
    # the block-tridiagonal target built densely from the same (damped) factors
    target = np.zeros((n, n))
    for l in range(3):
        a_g, s_g = (x.numpy() for x in kr.damped_factors(tf.constant(a_diag[l]),
                                                          tf.constant(s_diag[l]), gamma))
        target[offsets[l]:offsets[l + 1], offsets[l]:offsets[l + 1]] = np.kron(s_g, a_g)
        if l < 2:
            off = np.kron(s_off[l], a_off[l])
            target[offsets[l]:offsets[l + 1], offsets[l + 1]:offsets[l + 2]] = off
            target[offsets[l + 1]:offsets[l + 2], offsets[l]:offsets[l + 1]] = off.T
    precision = np.linalg.inv(inverse)
    for l in range(3):
        for m in range(3):
            block = (slice(offsets[l], offsets[l + 1]), slice(offsets[m], offsets[m + 1]))
            if abs(l - m) <= 1:     # F_hat agrees with the given tridiagonal blocks ...
                np.testing.assert_allclose(precision[block], target[block], rtol=1e-7, atol=1e-9)
            else:                   # ... and its inverse (the covariance) is block tridiagonal
                np.testing.assert_allclose(inverse[block], 0.0, atol=1e-10)
                assert np.abs(precision[block]).max() > 1e-4     # F_hat itself is not
    # sampling map B with B B^T = F_hat^-1, marginals and KL
    sampler = np.stack([join(kr.blktri_sample_noise(blocks, split(e))) for e in np.eye(n)], axis=1)
    np.testing.assert_allclose(sampler @ sampler.T, inverse, rtol=1e-8, atol=1e-10)
    scale, eta = 0.3, 2.0
    variances = kr.blktri_marginal_variances(blocks, scale)
    np.testing.assert_allclose(join(variances), scale ** 2 * np.diag(inverse), rtol=1e-9)
    means = [rng.normal(size=(p, q)) for p, q in zip(dims_in, dims_out)]
    cov = scale ** 2 * inverse
    mu = np.concatenate([vec(m) for m in means])
    kl_dense = 0.5 * (np.trace(cov) / eta + mu @ mu / eta - n + n * np.log(eta)
                      - np.linalg.slogdet(cov)[1])
    kl = kr.blktri_kl_to_isotropic_prior([tf.constant(m) for m in means], blocks, scale, eta)
    np.testing.assert_allclose(kl.numpy(), kl_dense, rtol=1e-9)
    as_tensor = kr.blktri_kl_to_isotropic_prior([tf.constant(m) for m in means], blocks, scale,
                                                tf.constant(eta, tf.float32))
    np.testing.assert_allclose(as_tensor, kl_dense, rtol=1e-6)   # a float32 tensor, as elsewhere
