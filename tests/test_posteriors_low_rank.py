"""SLANG's low-rank-plus-diagonal linear algebra against dense float64 NumPy computations."""

import numpy as np
import pytest
import tensorflow as tf

from tfnng.posteriors import low_rank

D, L = 40, 4


def factors(seed=0, dim=D, rank=L):
    rng = np.random.default_rng(seed)
    u = rng.normal(size=(dim, rank)) * np.array([3.0, 2.0, 1.0, 0.5])[:rank]
    d = rng.uniform(0.5, 2.0, size=dim)
    return u, d


def dense_precision(u, d):
    return u @ u.T + np.diag(d)


def test_fast_inverse_equals_dense_solve():
    u, d = factors()
    g = np.random.default_rng(1).normal(size=(D, 3))
    expected = np.linalg.solve(dense_precision(u, d), g)
    np.testing.assert_allclose(low_rank.fast_inverse(u, d, g).numpy(), expected, rtol=1e-10)
    np.testing.assert_allclose(low_rank.fast_inverse(u, d, g[:, 0]).numpy(), expected[:, 0],
                               rtol=1e-10)


@pytest.mark.parametrize("rank_deficient", [False, True])
def test_fast_sample_square_root_reproduces_dense_covariance_exactly(rank_deficient):
    """Feeding eps = I_D returns the square-root matrix S itself; S S^T must be the dense inverse."""
    u, d = factors()
    if rank_deficient:
        u[:, 2:] = 0.0          # e.g. zero columns at initialisation: Alg. 3's Cholesky would fail
    root = low_rank.fast_sample(u, d, np.eye(D)).numpy()
    np.testing.assert_allclose(root @ root.T, np.linalg.inv(dense_precision(u, d)), atol=1e-12)


def test_fast_sample_empirical_covariance_matches_dense_inverse():
    """Statistical check with S = 200000 draws. Each entry of the empirical covariance has standard
    error sqrt((C_ii C_jj + C_ij^2) / S) (Wishart variance); we require every entry within 5 standard
    errors, a bound whose family-wise false-alarm probability over the 820 distinct entries is below
    1e-3 (Gaussian tail 5.7e-7 per entry)."""
    u, d = factors()
    samples = 200_000
    eps = tf.random.stateless_normal((D, samples), seed=[3, 4], dtype=tf.float64)
    draws = low_rank.fast_sample(u, d, eps).numpy()
    empirical = draws @ draws.T / samples
    cov = np.linalg.inv(dense_precision(u, d))
    stderr = np.sqrt((np.outer(np.diag(cov), np.diag(cov)) + cov ** 2) / samples)
    assert np.max(np.abs(empirical - cov) / stderr) < 5.0
    np.testing.assert_allclose(draws.mean(axis=1), 0.0, atol=5 * np.sqrt(np.diag(cov).max() / samples))


@pytest.mark.parametrize("dtype", [tf.float64, tf.float32])
def test_inverse_and_sample_equal_the_dense_solve_and_the_covariance_root(dtype):
    """The shared-factorisation form of a SLANG step: its solve is the dense solve, and its sample
    is R eps for the root R of the dense-checked test above (R = fast_sample(., I))."""
    u, d = factors()
    rng = np.random.default_rng(4)
    g, eps = rng.normal(size=D), rng.normal(size=D)
    direction, noise = low_rank.inverse_and_sample(tf.constant(u, dtype), tf.constant(d, dtype),
                                                   tf.constant(g, dtype), tf.constant(eps, dtype))
    assert direction.dtype == noise.dtype == dtype
    rtol = 1e-10 if dtype == tf.float64 else 1e-5
    np.testing.assert_allclose(direction.numpy(), np.linalg.solve(dense_precision(u, d), g),
                               rtol=rtol, atol=rtol)
    root = low_rank.fast_sample(u, d, np.eye(D)).numpy()
    np.testing.assert_allclose(noise.numpy(), root @ eps, rtol=rtol, atol=rtol)


@pytest.mark.parametrize("method", ["exact", "randomized"])
def test_fast_eig_recovers_top_eigenpairs_of_low_rank_plus_noise(method):
    rng = np.random.default_rng(2)
    basis, _ = np.linalg.qr(rng.normal(size=(D, L)))
    strong = basis * np.sqrt([50.0, 30.0, 20.0, 10.0])
    columns = np.concatenate([strong, 0.01 * rng.normal(size=(D, 30))], axis=1)   # K = 34 > L + p
    matrix = columns @ columns.T
    values, vectors = low_rank.fast_eig(columns, L, seed=7, method=method)
    exact_values, exact_vectors = np.linalg.eigh(matrix)
    exact_values, exact_vectors = exact_values[::-1][:L], exact_vectors[:, ::-1][:, :L]
    np.testing.assert_allclose(values.numpy(), exact_values, rtol=1e-8)
    overlaps = np.abs(np.sum(vectors.numpy() * exact_vectors, axis=0))
    np.testing.assert_allclose(overlaps, 1.0, atol=1e-8)
    np.testing.assert_allclose(vectors.numpy().T @ vectors.numpy(), np.eye(L), atol=1e-12)


def test_fast_eig_is_exact_when_the_factor_is_narrow():
    rng = np.random.default_rng(3)
    columns = rng.normal(size=(D, 6))
    values, vectors = low_rank.fast_eig(columns, 6)
    reconstructed = (vectors.numpy() * values.numpy()) @ vectors.numpy().T
    np.testing.assert_allclose(reconstructed, columns @ columns.T, atol=1e-10)


@pytest.mark.parametrize("method", ["exact", "randomized"])
def test_fast_eig_of_a_rank_deficient_factor_gives_zero_pairs_beyond_its_rank(method):
    """F of rank 3 with zero columns (SLANG's [U, G] while U = 0), rank 6: as documented, the last 3
    eigenvalues are 0 with zero (not NaN) columns; the first 3 are those of F F^T."""
    rng = np.random.default_rng(0)
    factors = np.concatenate([rng.normal(size=(40, 3)), np.zeros((40, 17))], axis=1)
    values, vectors = (t.numpy() for t in low_rank.fast_eig(factors, 6, method=method, seed=1))
    np.testing.assert_allclose(values[:3], np.sort(np.linalg.eigvalsh(factors.T @ factors))[::-1][:3],
                               rtol=1e-8)
    np.testing.assert_array_equal(values[3:], 0.0)
    np.testing.assert_array_equal(vectors[:, 3:], 0.0)


def test_fast_eig_rejects_a_rank_larger_than_the_factor_and_unknown_methods():
    with pytest.raises(ValueError, match="rank"):
        low_rank.fast_eig(np.ones((5, 2)), 3)
    with pytest.raises(ValueError, match="method"):
        low_rank.fast_eig(np.ones((5, 2)), 1, method="lanczos")


def test_fast_eig_auto_picks_the_method_by_factor_width(monkeypatch):
    """"auto" is exact up to EXACT_MAX_COLUMNS columns and randomized above; with the width known only
    at run time (inside tf.function) it decides there. Both give the top eigenpairs of a matrix with
    a clear spectral gap."""
    rng = np.random.default_rng(8)
    basis, _ = np.linalg.qr(rng.normal(size=(D, L)))
    columns = np.concatenate([basis * np.sqrt([50.0, 30.0, 20.0, 10.0]),
                              0.01 * rng.normal(size=(D, 30))], axis=1)
    exact_values = np.linalg.eigvalsh(columns @ columns.T)[::-1][:L]
    calls = []
    for name in ("_exact_eig", "_randomized_eig"):
        original = getattr(low_rank, name)
        monkeypatch.setattr(low_rank, name,
                            lambda *args, _f=original, _n=name: calls.append(_n) or _f(*args))
    for limit, chosen in ((1024, "_exact_eig"), (10, "_randomized_eig")):
        monkeypatch.setattr(low_rank, "EXACT_MAX_COLUMNS", limit)
        calls.clear()
        values, _ = low_rank.fast_eig(columns, L, seed=3)
        assert calls == [chosen]
        np.testing.assert_allclose(values.numpy(), exact_values, rtol=1e-8)
        calls.clear()
        dynamic = tf.function(lambda f: low_rank.fast_eig(f, L, seed=3),
                              input_signature=[tf.TensorSpec((D, None), tf.float64)])
        values, _ = dynamic(tf.constant(columns))
        assert sorted(calls) == ["_exact_eig", "_randomized_eig"]       # a tf.cond of both
        np.testing.assert_allclose(values.numpy(), exact_values, rtol=1e-8)


def dense_update(u, d, g, beta, prior_precision):
    return ((1 - beta) * dense_precision(u, d) + beta * (g @ g.T + prior_precision * np.eye(len(d))))


@pytest.mark.parametrize("method", ["exact", "randomized"])
def test_update_keeps_the_diagonal_exact_after_every_step(method):
    """SLANG eq. 8 / App. D: the diagonal of U U^T + diag(d) equals that of the VOGN update (2) it
    approximates, step after step, while the off-diagonal part is only approximated."""
    rng = np.random.default_rng(4)
    u, d = np.zeros((D, L)), np.ones(D)
    beta, prior_precision, batch = 0.1, 0.5, 16   # L + M > L + p: a real sketch when randomized
    for step in range(10):
        g = rng.normal(size=(D, batch)) * np.sqrt(100 / batch)
        target = dense_update(u, d, g, beta, prior_precision)
        u, d = (t.numpy() for t in low_rank.update(u, d, g, beta, prior_precision, seed=step,
                                                   method=method))
        np.testing.assert_allclose(np.diag(dense_precision(u, d)), np.diag(target), rtol=1e-12)
        assert not np.allclose(dense_precision(u, d), target)
    assert np.all(d > 0)


def test_update_with_full_rank_equals_the_dense_update():
    """With L = D the eigendecomposition is exact and SLANG is the update (2) itself."""
    rng = np.random.default_rng(5)
    dim = 6
    u, d = rng.normal(size=(dim, dim)), rng.uniform(0.5, 1.0, size=dim)
    g = rng.normal(size=(dim, 3))
    target = dense_update(u, d, g, 0.3, 2.0)
    u_new, d_new = low_rank.update(u, d, g, 0.3, 2.0)
    np.testing.assert_allclose(dense_precision(u_new.numpy(), d_new.numpy()), target, atol=1e-10)


def test_update_of_low_rank_part_is_the_best_rank_l_approximation():
    """SLANG eq. 6-7: U_new U_new^T is the truncated eigendecomposition of the rank-(L+M) part (5)."""
    rng = np.random.default_rng(6)
    u, d = rng.normal(size=(D, L)), np.ones(D)
    g = rng.normal(size=(D, 5))
    beta = 0.2
    part = (1 - beta) * u @ u.T + beta * g @ g.T
    values, vectors = np.linalg.eigh(part)
    best = (vectors[:, -L:] * values[-L:]) @ vectors[:, -L:].T
    u_new, _ = low_rank.update(u, d, g, beta, 1.0)
    np.testing.assert_allclose(u_new.numpy() @ u_new.numpy().T, best, atol=1e-10)


def dense_gaussian_kl_to_isotropic(mean, cov, eta):
    k = len(mean)
    return 0.5 * (np.trace(cov) / eta + mean @ mean / eta - k + k * np.log(eta)
                  - np.linalg.slogdet(cov)[1])


def test_kl_marginals_and_log_det_match_dense_formulas():
    u, d = factors()
    mean = np.random.default_rng(7).normal(size=D)
    cov = np.linalg.inv(dense_precision(u, d))
    np.testing.assert_allclose(low_rank.marginal_variances(u, d).numpy(), np.diag(cov), rtol=1e-10)
    np.testing.assert_allclose(low_rank.log_det_precision(u, d).numpy(),
                               np.linalg.slogdet(dense_precision(u, d))[1], rtol=1e-12)
    expected = dense_gaussian_kl_to_isotropic(mean, cov, 0.7)
    np.testing.assert_allclose(low_rank.kl_to_isotropic_prior(mean, u, d, 0.7).numpy(), expected,
                               rtol=1e-10)
    assert expected > 1.0
    # q = N(mu, c P^-1), c = lambda/N as in SLANG's posterior
    scaled_kl = low_rank.kl_to_isotropic_prior(mean, u, d, 0.7, covariance_scale=0.03)
    np.testing.assert_allclose(scaled_kl.numpy(), dense_gaussian_kl_to_isotropic(mean, 0.03 * cov, 0.7),
                               rtol=1e-10)


@pytest.mark.parametrize("diagonal", [1e-2, 1e-4, 1e-6])
def test_float32_marginal_variances_survive_a_dominant_low_rank_part(diagonal):
    """U U^T >> diag d (well-determined directions, d ~ lambda / (N eta) for large N): Woodbury's
    ``1/d - ...`` cancels; in float32 it gave -0.000977 for 0.000641 at d = 1e-4."""
    u = np.random.default_rng(0).normal(size=(3, 3)) * 30.0
    d = np.full(3, diagonal)
    exact = np.diag(np.linalg.inv(u @ u.T + np.diag(d)))
    got = low_rank.marginal_variances(tf.constant(u, tf.float32), tf.constant(d, tf.float32))
    assert got.dtype == tf.float32
    np.testing.assert_allclose(got.numpy(), exact, rtol=1e-3)


@pytest.mark.parametrize("diagonal", [1e-2, 1e-4, 1e-6])
def test_float32_fast_inverse_survives_a_dominant_low_rank_part(diagonal):
    """SLANG's mean step along range(U) where U U^T >> diag d: Woodbury's two terms cancel; in
    float32 the solve was off by 0.32 of its size at eigenvalues of U^T d^-1 U of 9e6 (diverging
    SLANG at large N)."""
    rng = np.random.default_rng(0)
    u = rng.normal(size=(3, 3)) * 30.0
    d = np.full(3, diagonal)
    g = u @ np.array([1.0, -2.0, 0.5])
    exact = np.linalg.solve(u @ u.T + np.diag(d), g)
    got = low_rank.fast_inverse(tf.constant(u, tf.float32), tf.constant(d, tf.float32),
                                tf.constant(g, tf.float32))
    assert got.dtype == tf.float32
    np.testing.assert_allclose(got.numpy(), exact, rtol=1e-4)


def test_float32_fast_sample_error_stays_within_its_documented_bound():
    """float32 inputs where U U^T >> diag d: along an eigenvector of U^T d^-1 U with eigenvalue s the
    sampled standard deviation may carry a relative error of a few eps sqrt(s) (the bound of the
    version that subtracted in float32; fast_sample now computes in float64 and rounds the draw at
    the end). The whitened covariance ``C^T R R^T C`` (``P = C C^T``) must be I up to that bound.
    With ``W c W^T`` formed in float32 the error was 0.71 here (rounding amplified by the spread of
    the eigenvalues, 1e3), and with it formed in float64 but applied through the non-orthogonal
    ``V = d^-1/2 U``, 0.044; a randomly rotated SLANG-like U with eigenvalues from 1 to 1e9 (D =
    40) gave 2.9 then."""
    rng = np.random.default_rng(1)
    u, d = rng.normal(size=(3, 3)) * 30.0, np.full(3, 1e-7)
    precision = u @ u.T + np.diag(d)
    s_max = np.linalg.eigvalsh(u.T @ u / 1e-7).max()
    root = low_rank.fast_sample(tf.constant(u, tf.float32), tf.constant(d, tf.float32),
                                tf.eye(3)).numpy().astype(np.float64)
    factor = np.linalg.cholesky(precision)
    stddevs = np.sqrt(np.linalg.eigvalsh(factor.T @ root @ root.T @ factor))
    eps = np.finfo(np.float32).eps
    assert s_max > 1e9
    np.testing.assert_allclose(stddevs, 1.0, atol=4 * eps * np.sqrt(s_max))
    rng = np.random.default_rng(3)                       # the rotated SLANG-like case
    q = np.linalg.qr(rng.normal(size=(40, 40)))[0]
    u = q * np.sqrt(1e-4 * np.logspace(0, 9, 40))
    u = u @ np.linalg.qr(rng.normal(size=(40, 40)))[0]
    d = np.full(40, 1e-4)
    root = low_rank.fast_sample(tf.constant(u, tf.float32), tf.constant(d, tf.float32),
                                tf.eye(40)).numpy().astype(np.float64)
    factor = np.linalg.cholesky(u @ u.T + np.diag(d))
    stddevs = np.sqrt(np.linalg.eigvalsh(factor.T @ root @ root.T @ factor))
    np.testing.assert_allclose(stddevs, 1.0, atol=4 * eps * np.sqrt(1e9))


def test_precision_operator_is_the_dense_precision():
    u, d = factors()
    operator = low_rank.precision_operator(u, d)
    np.testing.assert_allclose(operator.to_dense().numpy(), dense_precision(u, d), rtol=1e-12)
    g = np.random.default_rng(8).normal(size=(D, 2))
    np.testing.assert_allclose(operator.solve(g).numpy(), low_rank.fast_inverse(u, d, g).numpy(),
                               rtol=1e-9)


def test_randomized_update_without_power_iterations_keeps_the_diagonal_exact_where_it_can():
    """The randomised range finder without power iterations leaves a discarded part that is not
    positive semi-definite: its negative diagonal entries were clamped to 0, so the precision's
    diagonal came out too large (here by up to 17%). They are kept wherever d stays positive;
    where d would not (a remainder larger than d), the entry is dropped, never made too small."""
    for low, high, exact in ((5.0, 10.0, True), (0.5, 1.0, False)):
        for seed in range(5):
            rng = np.random.default_rng(seed)
            u, d = rng.normal(size=(60, 4)), rng.uniform(low, high, 60)
            g = rng.normal(size=(60, 64))
            new_u, new_d = low_rank.update(u, d, g, 0.1, 0.01, method="randomized",
                                           power_iterations=0, seed=seed, curvature_weight=1 / 64)
            target = 0.9 * (np.sum(u ** 2, 1) + d) + 0.1 * (np.sum(g ** 2, 1) / 64 + 0.01)
            got = np.sum(new_u.numpy() ** 2, 1) + new_d.numpy()
            assert np.all(new_d.numpy() > 0)
            if exact:
                np.testing.assert_allclose(got, target, rtol=1e-12)
            else:
                assert np.all(got >= target * (1 - 1e-12))
