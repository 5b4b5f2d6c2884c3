"""Kronecker-factored Gaussian posteriors: matrix-variate (NNG-MVG) and block-tridiagonal (NNG-BlkTri).

Framework-light functions on tensors, unit tested against dense matrices (``tests/test_kfac_posteriors.py``).

Conventions. A layer's weights form the homogeneous matrix ``W`` of shape ``(p, q)`` (bias as the
last row, see :mod:`tfnng.curvature.kronecker`). The paper's ``vec`` stacks columns, and
``MN(W; M, Sigma_1, Sigma_2) = N(vec W; vec M, Sigma_2 (x) Sigma_1)`` (sec. 3.4), with ``Sigma_1``
(``p x p``) the covariance among rows (inputs) and ``Sigma_2`` (``q x q``) among columns (outputs).
TensorFlow's row-major ``tf.reshape(W, [-1])`` is the column-stacking vec of ``W^T``, so on that
flattening the same covariance is ``Sigma_1 (x) Sigma_2``; the ``tf.linalg.LinearOperatorKronecker``
operators returned here act on the row-major flattening and say so.

Matrix-variate Gaussian (NNG eq. 13, Alg. 2). With the EMA factors ``A``, ``S`` of eq. (12), a damping
``gamma`` and the split ``pi = sqrt((tr A / p) / (tr S / q))`` (``pi = 1`` when a trace is zero)

    A_gamma = A + pi sqrt(gamma) I,       S_gamma = S + (1/pi) sqrt(gamma) I,
    Sigma   = (lambda/N) S_gamma^-1 (x) A_gamma^-1                                   (eq. 13)

``A_gamma (x) S_gamma = A (x) S + gamma I + sqrt(gamma) (pi I (x) S + (1/pi) A (x) I)``: the factored
damping adds the last, cross term to the exact ``A (x) S + gamma I`` (Martens & Grosse 2015 sec. 6.3);
pi minimises its size. Sampling (``gamma = gamma_in``) draws
``W = M + sqrt(lambda/N) A_gamma^-1/2 E S_gamma^-1/2`` with ``E ~ MN(0, I, I)``; the mean step
(``gamma = gamma_in + gamma_ex``) preconditions ``V`` as ``A_gamma^-1 V S_gamma^-1`` (eq. 4).
Inverses and inverse square roots come from one symmetric eigendecomposition per factor and are
cached (:func:`mvg_cache`), so each step costs two small matmuls per layer.

Block tridiagonal (Martens & Grosse 2015 sec. 4.3; NNG sec. 3.5). For a chain of layers ``1..L`` whose
consecutive Fisher blocks are coupled, let ``F_ll = S_l (x) A_l`` (damped as above) and
``F_l,l+1 = S_l,l+1 (x) A_l,l+1`` with the cross factors ``A_l,l+1 = E[a_l a_l+1^T]``,
``S_l,l+1 = E[Ds_l Ds_l+1^T]`` (not damped). The approximation ``F_hat`` is the unique matrix that
agrees with these tridiagonal blocks and whose *inverse* is block tridiagonal: the covariance of the
Gaussian chain (a directed model from the last layer backwards)

    vec W_L ~ N(0, F_LL),   vec W_l = Psi_l vec W_l+1 + eps_l,   eps_l ~ N(0, Sigma_l|l+1),
    Psi_l = F_l,l+1 F_l+1,l+1^-1 = (S_l,l+1 S_l+1^-1) (x) (A_l,l+1 A_l+1^-1) = Psi^S_l (x) Psi^A_l,
    Sigma_l|l+1 = F_ll - Psi_l F_l+1,l+1 Psi_l^T = S_l (x) A_l - C^S_l (x) C^A_l,
    C^A_l = A_l,l+1 A_l+1^-1 A_l+1,l,   C^S_l = S_l,l+1 S_l+1^-1 S_l+1,l.

Writing the chain as ``Xi w = eps`` with ``Xi`` block upper bidiagonal (identity blocks, ``-Psi_l`` at
``(l, l+1)``) gives ``F_hat^-1 = Xi^T Lambda Xi`` with ``Lambda = blockdiag(Sigma_1|2^-1, ...,
Sigma_L-1|L^-1, F_LL^-1)``: ``F_hat^-1`` (hence the posterior covariance ``(lambda/N) F_hat^-1``) is
block tridiagonal, and ``F_hat``'s tridiagonal blocks equal the given ones. Each
``Sigma_l|l+1`` (a difference of Kronecker products) is inverted by simultaneous diagonalisation
(Martens & Grosse 2015 App. B): with ``K_A = A_l^-1/2 E_A`` where ``A_l^-1/2 C^A_l A_l^-1/2 =
E_A diag(sigma_A) E_A^T`` (and likewise for S), ``K_A^T A_l K_A = I`` and ``K_A^T C^A_l K_A =
diag(sigma_A)``, so

    Sigma_l|l+1^-1 = (K_S (x) K_A) diag(1 / (1 - sigma_S (x) sigma_A)) (K_S (x) K_A)^T,

where ``0 <= sigma < 1`` because ``A_l - C^A_l`` is a Schur complement of the PSD joint second
moment of ``(a_l, a_l+1)`` and ``A_l`` is damped. The last block uses the same form with
``sigma = 0`` and ``K = A_L^-1/2``. Sampling ``w = Xi^T Lambda^1/2 eps`` and preconditioning
``Xi^T Lambda Xi v`` then cost a few small matmuls per layer (:func:`blktri_sample_noise`,
:func:`blktri_precondition`).
"""

import tensorflow as tf

from tfnng.posteriors import _linalg

_EIGH_TRIES = 4
_SIGMA_MAX = 1.0 - 1e-6


# ------------------------------------------------------------------------------------------ basics
def _f64(x):
    """``x`` as float64 (Python numbers exactly, not through float32)."""
    if isinstance(x, (int, float)):
        return tf.constant(x, tf.float64)
    return tf.cast(x, tf.float64)


def damping_split(a_factor, s_factor):
    """pi = sqrt((tr A / dim A) / (tr S / dim S)) of eq. (13); 1 when a trace is zero (or not finite)."""
    a_mean = tf.linalg.trace(a_factor) / tf.cast(tf.shape(a_factor)[0], a_factor.dtype)
    s_mean = tf.linalg.trace(s_factor) / tf.cast(tf.shape(s_factor)[0], s_factor.dtype)
    valid = (a_mean > 0) & (s_mean > 0)
    pi = tf.sqrt(tf.where(valid, a_mean, tf.ones_like(a_mean)) /
                 tf.where(valid, s_mean, tf.ones_like(s_mean)))
    return tf.where(valid & tf.math.is_finite(pi), pi, tf.ones_like(pi))


def safe_eigh(matrix, tries=_EIGH_TRIES):
    """Eigendecomposition of a symmetric PSD matrix in float64, guarded like kfac-jax.

    Symmetrises, then factorises ``matrix + delta I``, with ``delta = 0`` first; if the result is not
    finite the damping ``delta`` is raised (``1e-6``, ``1e-4``, ... times the mean diagonal plus one)
    and the factorisation retried. Eigenvalues are clipped at 0.

    Returns ``(eigenvalues, eigenvectors, ok)`` in float64; ``ok`` is False if every try failed
    (the caller then keeps its previous inverses).
    """
    m = tf.cast(matrix, tf.float64)
    m = 0.5 * (m + tf.transpose(m))
    n = tf.shape(m)[0]
    eye = tf.eye(n, dtype=tf.float64)
    sane = tf.reduce_all(tf.math.is_finite(m))
    m = tf.where(sane, m, eye)
    (values, vectors), ok = _linalg.with_growing_jitter(tf.linalg.eigh, m, tries)
    values = tf.where(tf.math.is_finite(values), tf.maximum(values, 0.0), tf.zeros_like(values))
    vectors = tf.where(tf.math.is_finite(vectors), vectors, tf.zeros_like(vectors))
    return values, vectors, ok & sane


def _split_from_values(a_values, s_values):
    """pi of eq. (13) from the (clipped) spectra of A and S, whose sums are the traces."""
    a_mean = tf.reduce_mean(a_values)
    s_mean = tf.reduce_mean(s_values)
    valid = (a_mean > 0) & (s_mean > 0)
    ratio = tf.where(valid, a_mean, tf.ones_like(a_mean)) / tf.where(valid, s_mean, tf.ones_like(s_mean))
    return tf.where(valid, tf.sqrt(ratio), tf.ones_like(ratio))


def matrix_function(values, vectors, fn):
    """``Q diag(fn(values)) Q^T``."""
    return tf.matmul(vectors * fn(values)[tf.newaxis, :], vectors, transpose_b=True)


def damped_factors(a_factor, s_factor, damping):
    """``(A + pi sqrt(gamma) I, S + (1/pi) sqrt(gamma) I)`` of eq. (13) (dense; tests and references)."""
    pi = damping_split(a_factor, s_factor)
    root = tf.cast(tf.sqrt(_f64(damping)), a_factor.dtype)
    return (a_factor + pi * root * tf.eye(tf.shape(a_factor)[0], dtype=a_factor.dtype),
            s_factor + root / pi * tf.eye(tf.shape(s_factor)[0], dtype=s_factor.dtype))


# ----------------------------------------------------------------------------- matrix-variate Gaussian
def mvg_cache(a_factor, s_factor, sample_damping, step_damping, tries=_EIGH_TRIES):
    """Everything the MVG posterior needs until the next inverse update (float64).

    Returns a dict with ``a_inv``, ``s_inv`` (damped with ``step_damping``, the mean step),
    ``a_root``, ``s_root`` (inverse square roots damped with ``sample_damping``, sampling),
    ``a_values``, ``s_values`` (eigenvalues of the sampling-damped factors, for KL and log-dets),
    ``pi`` and ``ok`` (False if a factorisation failed even after retries).
    """
    a_values, a_vectors, a_ok = safe_eigh(a_factor, tries)
    s_values, s_vectors, s_ok = safe_eigh(s_factor, tries)
    pi = _split_from_values(a_values, s_values)
    root_in = tf.sqrt(_f64(sample_damping))
    root_all = tf.sqrt(_f64(step_damping))
    a_in, s_in = a_values + pi * root_in, s_values + root_in / pi
    a_all, s_all = a_values + pi * root_all, s_values + root_all / pi
    return {
        "a_inv": matrix_function(a_all, a_vectors, tf.math.reciprocal),
        "s_inv": matrix_function(s_all, s_vectors, tf.math.reciprocal),
        "a_root": matrix_function(a_in, a_vectors, tf.math.rsqrt),
        "s_root": matrix_function(s_in, s_vectors, tf.math.rsqrt),
        "a_values": a_in,
        "s_values": s_in,
        "pi": pi,
        "ok": a_ok & s_ok,
    }


def mvg_precondition(a_inv, s_inv, v):
    """``A_gamma^-1 V S_gamma^-1`` = ``(S_gamma (x) A_gamma)^-1 vec V`` (eq. 4, column-stacking vec)."""
    return tf.matmul(tf.matmul(a_inv, v), s_inv)


def mvg_sample(mean, a_root, s_root, noise, scale):
    """``M + scale * A_gamma^-1/2 E S_gamma^-1/2``: a draw from ``MN(M, scale^2 A_gamma^-1, S_gamma^-1)``."""
    return mean + scale * tf.matmul(tf.matmul(a_root, noise), s_root)


def mvg_marginal_variances(a_root, s_root, scale):
    """Variances of the entries of W: ``scale^2 diag(A_gamma^-1) diag(S_gamma^-1)^T``, shape (p, q)."""
    a_diag = tf.reduce_sum(tf.square(a_root), axis=1)
    s_diag = tf.reduce_sum(tf.square(s_root), axis=1)
    return scale ** 2 * a_diag[:, tf.newaxis] * s_diag[tf.newaxis, :]


def mvg_kl_to_isotropic_prior(mean, a_values, s_values, scale, prior_variance):
    """KL( MN(M, scale^2 A_g^-1, S_g^-1) || N(0, eta I) ) in closed form (float64).

    With ``Sigma_1 = scale^2 A_g^-1`` (eigenvalues ``scale^2 / a_values``), ``Sigma_2 = S_g^-1``:
    ``0.5 [tr Sigma_1 tr Sigma_2 / eta + |M|_F^2 / eta - pq + pq log eta - q log|Sigma_1| - p log|Sigma_2|]``.
    """
    mean = tf.cast(mean, tf.float64)
    a_values = tf.cast(a_values, tf.float64)
    s_values = tf.cast(s_values, tf.float64)
    eta = _f64(prior_variance)
    scale2 = _f64(scale) ** 2
    p = tf.cast(tf.size(a_values), tf.float64)
    q = tf.cast(tf.size(s_values), tf.float64)
    trace = scale2 * tf.reduce_sum(1.0 / a_values) * tf.reduce_sum(1.0 / s_values)
    log_det_1 = p * tf.math.log(scale2) - tf.reduce_sum(tf.math.log(a_values))
    log_det_2 = -tf.reduce_sum(tf.math.log(s_values))
    return 0.5 * (trace / eta + tf.reduce_sum(tf.square(mean)) / eta - p * q
                  + p * q * tf.math.log(eta) - q * log_det_1 - p * log_det_2)


def mvg_covariance_operator(a_root, s_root, scale):
    """Covariance as a ``LinearOperatorKronecker`` acting on the *row-major* flattening of W.

    ``scale^2 A_g^-1 (x) S_g^-1`` (row-major), i.e. the paper's ``Sigma_2 (x) Sigma_1`` on ``vec W``.
    Never materialises the ``(pq) x (pq)`` matrix.
    """
    sigma_1 = scale ** 2 * tf.matmul(a_root, a_root)
    sigma_2 = tf.matmul(s_root, s_root)
    return tf.linalg.LinearOperatorKronecker(
        [tf.linalg.LinearOperatorFullMatrix(sigma_1, is_self_adjoint=True, is_positive_definite=True),
         tf.linalg.LinearOperatorFullMatrix(sigma_2, is_self_adjoint=True, is_positive_definite=True)],
        is_self_adjoint=True, is_positive_definite=True)


def mvg_scale_operator(a_root, s_root, scale):
    """A square root ``L`` (``L L^T`` = covariance) as a ``LinearOperatorKronecker`` (row-major)."""
    return tf.linalg.LinearOperatorKronecker(
        [tf.linalg.LinearOperatorFullMatrix(scale * a_root, is_self_adjoint=True),
         tf.linalg.LinearOperatorFullMatrix(s_root, is_self_adjoint=True)])


# ----------------------------------------------------------------------------------- block tridiagonal
def blktri_cache(a_diag, s_diag, a_off, s_off, damping, tries=_EIGH_TRIES):
    """Factors of ``F_hat^-1 = Xi^T Lambda Xi`` for one damping (module docstring), float64.

    Args:
        a_diag, s_diag: lists of the ``L`` undamped diagonal factors ``A_l``, ``S_l``.
        a_off, s_off: lists of the ``L - 1`` cross factors ``A_l,l+1`` (``p_l x p_l+1``) and
            ``S_l,l+1`` (``q_l x q_l+1``).
        damping: gamma; the diagonal blocks are damped with the pi split of eq. (13).

    Returns:
        ``(blocks, ok)``: per layer a dict with ``k_a`` (``p x p``), ``k_s`` (``q x q``), ``d``
        (``p x q``, the diagonal ``1 / (1 - sigma_A sigma_S^T)``), and for ``l < L`` also ``psi_a``
        (``p_l x p_l+1``) and ``psi_s`` (``q_l x q_l+1``).
    """
    num = len(a_diag)
    root = tf.sqrt(_f64(damping))
    ok = tf.constant(True)
    inv, inv_sqrt = [], []
    for a, s in zip(a_diag, s_diag):
        a_values, a_vectors, a_ok = safe_eigh(a, tries)
        s_values, s_vectors, s_ok = safe_eigh(s, tries)
        pi = _split_from_values(a_values, s_values)
        a_d, s_d = a_values + pi * root, s_values + root / pi
        inv.append((matrix_function(a_d, a_vectors, tf.math.reciprocal),
                    matrix_function(s_d, s_vectors, tf.math.reciprocal)))
        inv_sqrt.append((matrix_function(a_d, a_vectors, tf.math.rsqrt),
                         matrix_function(s_d, s_vectors, tf.math.rsqrt)))
        ok = ok & a_ok & s_ok
    blocks = []
    for l in range(num):
        a_is, s_is = inv_sqrt[l]
        block = {}
        if l < num - 1:
            a_lm = tf.cast(a_off[l], tf.float64)
            s_lm = tf.cast(s_off[l], tf.float64)
            psi_a = tf.matmul(a_lm, inv[l + 1][0])
            psi_s = tf.matmul(s_lm, inv[l + 1][1])
            c_a = tf.matmul(psi_a, a_lm, transpose_b=True)
            c_s = tf.matmul(psi_s, s_lm, transpose_b=True)
            sig_a, e_a, ok_a = safe_eigh(tf.matmul(tf.matmul(a_is, c_a), a_is), tries)
            sig_s, e_s, ok_s = safe_eigh(tf.matmul(tf.matmul(s_is, c_s), s_is), tries)
            ok = ok & ok_a & ok_s
            sig_a = tf.minimum(sig_a, _SIGMA_MAX)
            sig_s = tf.minimum(sig_s, _SIGMA_MAX)
            block.update(psi_a=psi_a, psi_s=psi_s,
                         k_a=tf.matmul(a_is, e_a), k_s=tf.matmul(s_is, e_s),
                         d=1.0 / (1.0 - sig_a[:, tf.newaxis] * sig_s[tf.newaxis, :]))
        else:
            p, q = tf.shape(a_is)[0], tf.shape(s_is)[0]
            block.update(k_a=a_is, k_s=s_is, d=tf.ones([p, q], tf.float64))
        blocks.append(block)
    return blocks, ok


def _lambda_apply(block, u, power):
    """``Lambda_l^power``-type product: ``K_A ((K_A^T U K_S) * D^power) K_S^T`` (power 1), or the
    square-root factor ``K_A (U * D^1/2) K_S^T`` (power 0.5, applied to white noise)."""
    k_a, k_s, d = block["k_a"], block["k_s"], block["d"]
    if power == 1:
        inner = tf.matmul(tf.matmul(k_a, u, transpose_a=True), k_s) * d
    else:
        inner = u * tf.sqrt(d)
    return tf.matmul(tf.matmul(k_a, inner), k_s, transpose_b=True)


def _psi(block, v):
    """``Psi_l vec V`` = ``vec(Psi^A V Psi^S^T)``."""
    return tf.matmul(tf.matmul(block["psi_a"], v), block["psi_s"], transpose_b=True)


def _psi_t(block, u):
    """``Psi_l^T vec U`` = ``vec(Psi^A^T U Psi^S)``."""
    return tf.matmul(tf.matmul(block["psi_a"], u, transpose_a=True), block["psi_s"])


def _xi_transpose(blocks, u):
    out = [u[0]]
    for l in range(1, len(blocks)):
        out.append(u[l] - _psi_t(blocks[l - 1], u[l - 1]))
    return out


def blktri_precondition(blocks, v):
    """``F_hat^-1 v = Xi^T Lambda Xi v`` for a list of per-layer matrices ``v`` (shapes ``(p_l, q_l)``)."""
    num = len(blocks)
    xi_v = [v[l] - _psi(blocks[l], v[l + 1]) if l < num - 1 else v[l] for l in range(num)]
    u = [_lambda_apply(blocks[l], xi_v[l], 1) for l in range(num)]
    return _xi_transpose(blocks, u)


def blktri_sample_noise(blocks, noise):
    """``Xi^T Lambda^1/2 eps``: a draw from ``N(0, F_hat^-1)`` from white noise matrices ``noise``."""
    u = [_lambda_apply(blocks[l], noise[l], 0.5) for l in range(len(blocks))]
    return _xi_transpose(blocks, u)


def blktri_marginal_variances(blocks, scale):
    """Diagonal of ``scale^2 Xi^T Lambda Xi`` as per-layer ``(p_l, q_l)`` matrices."""
    out = []
    for l, block in enumerate(blocks):
        var = tf.matmul(tf.matmul(tf.square(block["k_a"]), block["d"]), tf.square(block["k_s"]),
                        transpose_b=True)
        if l > 0:
            prev = blocks[l - 1]
            ka_psi = tf.matmul(prev["k_a"], prev["psi_a"], transpose_a=True)
            ks_psi = tf.matmul(prev["k_s"], prev["psi_s"], transpose_a=True)
            var += tf.matmul(tf.matmul(tf.square(ka_psi), prev["d"], transpose_a=True),
                             tf.square(ks_psi))
        out.append(scale ** 2 * var)
    return out


def _log_abs_det(k):
    """``log |det K|`` of an invertible square ``K`` as ``log det(K^T K) / 2`` (a Cholesky inside:
    XLA has no kernel for ``tf.linalg.slogdet``)."""
    return 0.5 * tf.linalg.logdet(tf.matmul(k, k, transpose_a=True))


def blktri_kl_to_isotropic_prior(means, blocks, scale, prior_variance):
    """KL( N(M, scale^2 Xi^T Lambda Xi) || N(0, eta I) ) in closed form (float64).

    ``log|Xi| = 0``; ``log|Lambda_l| = sum log D_l + 2 log|K_A (x) K_S|``; the trace uses
    ``tr(Xi^T Lambda Xi) = sum_l tr(Lambda_l) + tr(Psi_l^T Lambda_l Psi_l)`` (marginal variances).
    """
    eta = _f64(prior_variance)
    scale2 = _f64(scale) ** 2
    variances = blktri_marginal_variances(blocks, _f64(scale))
    total = tf.constant(0.0, tf.float64)
    for mean, block, var in zip(means, blocks, variances):
        mean = tf.cast(mean, tf.float64)
        p = tf.cast(tf.shape(block["k_a"])[0], tf.float64)
        q = tf.cast(tf.shape(block["k_s"])[0], tf.float64)
        log_det_k = q * _log_abs_det(block["k_a"]) + p * _log_abs_det(block["k_s"])
        log_det_lambda = tf.reduce_sum(tf.math.log(block["d"])) + 2.0 * log_det_k
        log_det_cov = p * q * tf.math.log(scale2) + log_det_lambda
        total += 0.5 * (tf.reduce_sum(var) / eta + tf.reduce_sum(tf.square(mean)) / eta - p * q
                        + p * q * tf.math.log(eta) - log_det_cov)
    return total

