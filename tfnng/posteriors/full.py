"""Full-covariance Gaussian posteriors with a dense precision matrix (NNG-full, VOGN-full).

The linear algebra of full-covariance noisy natural gradient (NNG paper sec. 3, eq. 7-10) and of the
full-covariance VOGN update (SLANG eq. 2) on one flat parameter vector of length D. The precision
``P`` is a dense (D, D) symmetric positive-definite matrix; everything else is derived from its
Cholesky factor ``P = C C^T`` (C lower triangular), computed once per update by :func:`cholesky`.
Memory is O(D^2) and the factorisation O(D^3), so the family is meant for small models:
:func:`check_parameter_count` refuses models above a configurable size.

Framework-light TensorFlow functions, unit tested against dense NumPy computations.
"""

import tensorflow as tf

from tfnng.posteriors import _linalg

# D x D float64 Fisher average plus a float32 Cholesky factor: 12 D^2 bytes, 1.2 GB at D = 10^4
# (16 D^2 for a float64 model, another 8 D^2 with mc_samples > 1, and float64 D x D temporaries).
DEFAULT_MAX_PARAMETERS = 10_000


def check_parameter_count(num_parameters, max_parameters=DEFAULT_MAX_PARAMETERS):
    """Raise a ValueError when a dense D x D precision would be too large (D > ``max_parameters``)."""
    if num_parameters > max_parameters:
        gigabytes = 12 * num_parameters ** 2 / 1e9
        raise ValueError(
            f"The full-covariance posterior stores a dense {num_parameters} x {num_parameters} "
            f"precision matrix (float64) and its Cholesky factor (at least {gigabytes:.1f} GB for "
            f"a float32 model, more in float64 or with mc_samples > 1, and O(D^3) time per "
            f"factorisation), but the limit is "
            f"max_parameters={max_parameters}. Use a "
            "structured family (SLANG, noisy K-FAC, a diagonal optimizer) or raise max_parameters.")
    return int(num_parameters)


def moving_average(matrix, factors, beta):
    """``(1 - beta) M + beta F F^T``: the exponential moving average of outer products (NNG eq. 9).

    With ``M`` the running Fisher ``F_bar`` and the columns of ``F`` the gradients ``Dw`` of a batch
    (scaled by ``1/sqrt(B)`` for a batch average) this is NNG eq. 9; with ``M`` the whole precision
    and the prior's precision added by the caller it is the VOGN step of SLANG eq. 2.
    """
    matrix = tf.convert_to_tensor(matrix)
    beta = _linalg.cast(beta, matrix.dtype)
    factors = _linalg.cast(factors, matrix.dtype)
    return (1.0 - beta) * matrix + beta * tf.matmul(factors, factors, transpose_b=True)


def damped_precision(fisher, scale, damping):
    """``scale * (F_bar + damping I)``, e.g. the precision ``(N/lambda)(F_bar + lambda/(N eta) I)`` of
    NNG eq. 9 (``scale = N/lambda``, ``damping = gamma_in``; the mean update, eq. 10, uses the total
    damping instead and ``scale = 1``)."""
    fisher = tf.convert_to_tensor(fisher)
    dtype = fisher.dtype
    eye = tf.eye(fisher.shape[0], dtype=dtype)
    return _linalg.cast(scale, dtype) * (fisher + _linalg.cast(damping, dtype) * eye)


# Factorisations of a precision that rounding made singular are retried with growing damping.
_CHOLESKY_TRIES = 4


def cholesky(precision):
    """Lower-triangular ``C`` with ``C C^T = precision``; if rounding left ``precision`` not
    positive definite (a Fisher of collinear gradients under a tiny gamma_in: TensorFlow's factor
    is then NaN), that of ``precision + delta I`` with the smallest ``delta`` of
    :func:`tfnng.posteriors._linalg.with_growing_jitter` that factorises."""
    return _linalg.with_growing_jitter(tf.linalg.cholesky, precision, _CHOLESKY_TRIES)[0]


def sample(chol, standard_normal):
    """Map ``eps ~ N(0, I)`` to a draw from ``N(0, P^-1)``: ``C^-T eps`` (one triangular solve).

    ``standard_normal`` is a (D,) vector or a (D, S) matrix of S draws. With ``P`` the precision of
    NNG eq. 9 this is the weight perturbation of full-covariance NNG.
    """
    matrix, squeeze = _linalg.as_matrix(standard_normal)
    result = tf.linalg.triangular_solve(chol, matrix, lower=True, adjoint=True)
    return result[:, 0] if squeeze else result


def precondition(chol, vectors):
    """``P^-1 g`` by two triangular solves: the natural-gradient direction of NNG eq. 10."""
    matrix, squeeze = _linalg.as_matrix(vectors)
    result = tf.linalg.cholesky_solve(chol, matrix)
    return result[:, 0] if squeeze else result


def covariance(chol):
    """The dense covariance ``P^-1``."""
    return tf.linalg.cholesky_solve(chol, tf.eye(chol.shape[0], dtype=chol.dtype))


def marginal_variances(chol):
    """``diag(P^-1)`` = column sums of squares of ``C^-1``."""
    inverse = tf.linalg.triangular_solve(chol, tf.eye(chol.shape[0], dtype=chol.dtype), lower=True)
    return tf.reduce_sum(tf.square(inverse), axis=0)


def log_det_precision(chol):
    """``log det P = 2 sum log diag(C)``."""
    return 2.0 * tf.reduce_sum(tf.math.log(tf.linalg.diag_part(chol)))


def kl_to_isotropic_prior(mean, chol, prior_variance):
    """KL( N(mu, P^-1) || N(0, eta I) ) in closed form: the KL term of the ELBO (NNG eq. 1).

    ``0.5 * (tr(P^-1)/eta + mu^T mu/eta - D + D log eta + log det P)``.
    """
    dtype = chol.dtype
    eta = _linalg.cast(prior_variance, dtype)
    dim = tf.cast(chol.shape[0], dtype)
    mean = _linalg.cast(mean, dtype)
    return 0.5 * (tf.reduce_sum(marginal_variances(chol)) / eta + tf.reduce_sum(tf.square(mean)) / eta
                  - dim + dim * tf.math.log(eta) + log_det_precision(chol))
