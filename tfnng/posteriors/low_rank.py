"""Low-rank-plus-diagonal Gaussian posteriors: precision ``U U^T + diag(d)`` (SLANG).

The linear algebra of SLANG (SLANG paper, sec. 3, eq. 3-11, Alg. 1-3) on one flat parameter vector
of length D, with ``U`` a (D, L) matrix and ``d`` a positive (D,) vector, L << D. Every function costs
time and memory linear in D (at most O(D L K) for K curvature vectors), never forming a D x D matrix.
Framework-light TensorFlow functions, unit tested against dense NumPy computations.

Convention: the matrix ``U U^T + diag(d)`` is the *precision* of q; ``fast_inverse`` applies its
inverse, ``fast_sample`` draws from N(0, its inverse).
"""

import keras
import tensorflow as tf

from tfnng.posteriors import _linalg

# Randomised eigendecomposition defaults (Halko et al. 2011, sec. 4.2-4.5): the sketch has
# ``rank + oversampling`` columns; each power iteration multiplies the sketch by the matrix once more
# (with re-orthonormalisation), sharpening the separation between the top-L eigenvalues and the rest.
DEFAULT_OVERSAMPLING = 10
DEFAULT_POWER_ITERATIONS = 2


def fast_eig(factors, rank, oversampling=DEFAULT_OVERSAMPLING,
             power_iterations=DEFAULT_POWER_ITERATIONS, seed=None):
    """Top-``rank`` eigendecomposition of ``A = F F^T`` given only its factor ``F`` (SLANG Alg. 1, line 7).

    ``F`` (``factors``, shape (D, K)) holds the vectors whose outer products sum to A, e.g. the columns
    ``sqrt(1 - beta) u_j`` and ``sqrt(beta) g_i`` of SLANG eq. 5. A is never formed: it is applied
    as ``F (F^T X)``.

    Randomised range finder with power iterations (Halko et al. 2011, Alg. 4.4 and 5.3; SLANG App.
    C.2): F times a Gaussian test matrix with ``rank + oversampling`` columns (capped at D) spans
    range(F) = range(A) approximately; it is multiplied by A ``power_iterations`` more times with
    re-orthonormalisation in between (:func:`_orthonormal_columns`), giving an orthonormal
    basis Q of the approximate top eigenspace; the eigenpairs of the small matrix ``Q^T A Q`` lifted by
    Q are returned. The error of the rank-L approximation is close to the best possible
    ``lambda_{L+1}`` with high probability; oversampling (5-10 is the usual choice) controls the failure
    probability and each power iteration raises the eigenvalue decay ratio to a further power
    ``(lambda_{L+1} / lambda_L)^2``. When ``K <= rank + oversampling`` the range of F itself (at most K
    dimensions) is used instead of a sketch, which is exact and deterministic. Cost O(D K (L + p)) per
    pass plus O(D (L + p)^2) for the orthonormalisations: linear in D.

    Args:
        factors: (D, K) float tensor F.
        rank: number L of leading eigenpairs to return, ``L <= min(D, K)``.
        oversampling: extra sketch columns p.
        power_iterations: number q of extra multiplications by A.
        seed: seed of the Gaussian test matrix (anything ``keras.random.normal`` accepts).

    Returns:
        ``(eigenvalues, eigenvectors)``: (L,) non-negative eigenvalues in decreasing order and (D, L)
        orthonormal eigenvectors.
    """
    factors = tf.convert_to_tensor(factors)
    dim, count = factors.shape          # count is None when the batch size is known only at run time
    if rank > dim or (count is not None and rank > count):
        raise ValueError(f"`rank` ({rank}) exceeds the size of the factor matrix {factors.shape}.")
    sketch_size = min(rank + oversampling, dim)
    if count is not None and count <= sketch_size:
        basis, _ = tf.linalg.qr(factors)
    else:
        # range(F F^T) = range(F): sketch F with a (K, L + p) Gaussian test matrix.
        basis = _orthonormal_columns(factors @ keras.random.normal(
            tf.stack([tf.shape(factors)[1], sketch_size]), dtype=factors.dtype, seed=seed))
        for _ in range(power_iterations):
            basis = _orthonormal_columns(factors @ tf.matmul(factors, basis, transpose_a=True))
    projected = tf.matmul(basis, factors, transpose_a=True)       # Q^T F, so Q^T A Q = (Q^T F)(Q^T F)^T
    values, vectors = tf.linalg.eigh(projected @ tf.transpose(projected))
    values, vectors = tf.reverse(values, [0])[:rank], tf.reverse(vectors, [1])[:, :rank]
    return tf.maximum(values, 0.0), basis @ vectors


def _orthonormal_columns(matrix, passes=2):
    """An orthonormal basis of the column space of a tall (D, k) matrix, by two passes of
    Gram-matrix orthonormalisation (SVQB, Stathopoulos & Wu 2002): with ``Y^T Y = V diag(s) V^T``
    (in float64), ``Q = Y V diag(s)^{-1/2}``. Columns of a numerically rank-deficient ``Y`` (``s`` below
    a relative 1e-12) come out as zeros, which only add zero eigenpairs. Costs two ``D k^2`` products,
    far less than a Householder QR of a tall matrix on the CPU (SLANG App. C.2 uses QR).
    """
    basis = matrix
    for _ in range(passes):
        wide = tf.cast(basis, tf.float64)
        values, vectors = tf.linalg.eigh(tf.matmul(wide, wide, transpose_a=True))
        keep = values > 1e-12 * tf.reduce_max(values)
        scale = tf.where(keep, tf.math.rsqrt(tf.where(keep, values, 1.0)), 0.0)
        basis = basis @ tf.cast(vectors * scale, basis.dtype)
    return basis


def update(low_rank, diagonal, curvature_factors, beta, prior_precision, rank=None,
           oversampling=DEFAULT_OVERSAMPLING, power_iterations=DEFAULT_POWER_ITERATIONS, seed=None):
    """One SLANG precision update of ``(U, d)`` (SLANG eq. 4-10; Alg. 1, lines 7-10).

    The update it approximates is the VOGN precision step (SLANG eq. 2)::

        P_new = (1 - beta) (U U^T + diag d) + beta (G G^T + prior_precision I)

    with ``G G^T`` the curvature estimate (the empirical Fisher ``N/M sum_i g_i g_i^T`` when the caller
    passes the columns ``sqrt(N/M) g_i``). The rank-(L+M) part ``(1 - beta) U U^T + beta G G^T``
    (eq. 5) is replaced by its top-L eigendecomposition ``Q Lambda Q^T`` (eq. 6, :func:`fast_eig`),
    ``U_new = Q Lambda^{1/2}`` (eq. 7), and the discarded part's diagonal is moved into ``d``
    (diagonal correction, eq. 9-10)::

        d_new = (1 - beta) d + beta prior_precision + diag[(1 - beta) U U^T + beta G G^T - U_new U_new^T]

    so ``diag(U_new U_new^T + diag d_new) == diag(P_new)`` exactly (eq. 8; SLANG App. D). With
    ``L = D`` the update is exact: SLANG equals the full-covariance update (2).

    Args:
        low_rank: (D, L) tensor U.
        diagonal: (D,) tensor d.
        curvature_factors: (D, M) tensor G.
        beta: step size of the precision, in (0, 1].
        prior_precision: scalar or (D,) prior precision (lambda of SLANG eq. 2).
        rank: L of the result (default: the number of columns of ``low_rank``).
        oversampling, power_iterations, seed: passed to :func:`fast_eig`.

    Returns:
        ``(U_new, d_new)``.
    """
    low_rank = tf.convert_to_tensor(low_rank)
    dtype = low_rank.dtype
    beta = _linalg.cast(beta, dtype)
    rank = low_rank.shape[1] if rank is None else rank
    combined = tf.concat([tf.sqrt(1.0 - beta) * low_rank,
                          tf.sqrt(beta) * _linalg.cast(curvature_factors, dtype)], axis=1)
    values, vectors = fast_eig(combined, rank, oversampling, power_iterations, seed)
    new_low_rank = vectors * tf.sqrt(values)
    correction = (tf.reduce_sum(tf.square(combined), axis=1)
                  - tf.reduce_sum(tf.square(new_low_rank), axis=1))
    new_diagonal = ((1.0 - beta) * _linalg.cast(diagonal, dtype)
                    + beta * _linalg.cast(prior_precision, dtype) + correction)
    return new_low_rank, new_diagonal


def _capacitance_cholesky(scaled, low_rank):
    """Cholesky factor of ``I_L + U^T diag(d)^-1 U`` (Woodbury's capacitance), ``scaled = U / d``."""
    capacitance = tf.transpose(low_rank) @ scaled
    return tf.linalg.cholesky(capacitance + tf.eye(low_rank.shape[1], dtype=low_rank.dtype))


def fast_inverse(low_rank, diagonal, vectors):
    """``(U U^T + diag d)^-1 g`` by the Woodbury identity (SLANG Alg. 2; App. C.3), cost O(D L^2).

    ``vectors`` is a (D,) vector or a (D, K) matrix of K vectors. The L x L capacitance matrix
    ``I + U^T d^-1 U`` of Alg. 2, line 1 is factorised by Cholesky instead of inverted.
    """
    matrix, squeeze = _linalg.as_matrix(vectors)
    scaled = low_rank / diagonal[:, None]
    chol = _capacitance_cholesky(scaled, low_rank)
    result = matrix / diagonal[:, None] - scaled @ tf.linalg.cholesky_solve(
        chol, tf.transpose(scaled) @ matrix)
    return result[:, 0] if squeeze else result


def covariance_root(low_rank, diagonal):
    """The symmetric square root of ``(U U^T + diag d)^-1`` as a ``tf.linalg.LinearOperator`` (Alg. 3).

    With ``V = d^{-1/2} U`` the covariance is ``d^{-1/2} (I + V V^T)^{-1} d^{-1/2}``, and its square
    root ``d^{-1/2} (I - V K V^T)`` (the symmetric factorisation of Ambikasaran & O'Neil, SLANG ref.
    [4]; SLANG App. C.4). Alg. 3 builds the L x L matrix K from Cholesky factors of ``V^T V``, which
    requires U of full column rank; here K comes from the eigendecomposition
    ``V^T V = W diag(s) W^T`` as ``K = W diag(1 / (sqrt(1 + s) (1 + sqrt(1 + s)))) W^T``, the same
    matrix, well defined for rank-deficient U (e.g. zero columns at initialisation). The factor
    ``I - V K V^T`` has eigenvalues ``1 / sqrt(1 + s)`` and 1: positive definite.
    """
    inv_sqrt = tf.math.rsqrt(diagonal)
    scaled = low_rank * inv_sqrt[:, None]
    values, vectors = tf.linalg.eigh(tf.transpose(scaled) @ scaled)
    root = tf.sqrt(1.0 + tf.maximum(values, 0.0))
    correction = tf.linalg.LinearOperatorLowRankUpdate(
        tf.linalg.LinearOperatorIdentity(tf.shape(diagonal)[0], dtype=diagonal.dtype),
        scaled @ vectors, diag_update=-1.0 / (root * (1.0 + root)),
        is_self_adjoint=True, is_positive_definite=True)
    return tf.linalg.LinearOperatorComposition(
        [tf.linalg.LinearOperatorDiag(inv_sqrt, is_positive_definite=True), correction])


def fast_sample(low_rank, diagonal, standard_normal):
    """Map ``eps ~ N(0, I_D)`` to a draw from ``N(0, (U U^T + diag d)^-1)`` (SLANG Alg. 3; App. C.4):
    ``covariance_root(U, d) eps``. Cost O(D L^2 + L^3 + D L S) for S draws (``standard_normal`` of
    shape (D,) or (D, S))."""
    matrix, squeeze = _linalg.as_matrix(standard_normal)
    result = covariance_root(low_rank, diagonal).matmul(matrix)
    return result[:, 0] if squeeze else result


def marginal_variances(low_rank, diagonal):
    """``diag((U U^T + diag d)^-1)``, the posterior marginal variances, by Woodbury in O(D L^2)."""
    scaled = low_rank / diagonal[:, None]
    chol = _capacitance_cholesky(scaled, low_rank)
    whitened = tf.linalg.triangular_solve(chol, tf.transpose(scaled), lower=True)
    return 1.0 / diagonal - tf.reduce_sum(tf.square(whitened), axis=0)


def log_det_precision(low_rank, diagonal):
    """``log det(U U^T + diag d)`` by the matrix determinant lemma, O(D L^2)."""
    chol = _capacitance_cholesky(low_rank / diagonal[:, None], low_rank)
    return (tf.reduce_sum(tf.math.log(diagonal))
            + 2.0 * tf.reduce_sum(tf.math.log(tf.linalg.diag_part(chol))))


def kl_to_isotropic_prior(mean, low_rank, diagonal, prior_variance):
    """KL( N(mu, (U U^T + diag d)^-1) || N(0, eta I) ) in closed form, O(D L^2).

    ``0.5 * (tr(Sigma)/eta + mu^T mu/eta - D + D log eta + log det(U U^T + diag d))``, the KL term of
    the ELBO (SLANG eq. 1) for the isotropic prior of SLANG sec. 2 (precision ``1/eta``).
    """
    dtype = diagonal.dtype
    eta = _linalg.cast(prior_variance, dtype)
    dim = tf.cast(tf.size(diagonal), dtype)
    trace = tf.reduce_sum(marginal_variances(low_rank, diagonal))
    return 0.5 * (trace / eta + tf.reduce_sum(tf.square(mean)) / eta - dim + dim * tf.math.log(eta)
                  + log_det_precision(low_rank, diagonal))


def precision_operator(low_rank, diagonal):
    """The precision ``U U^T + diag d`` as a positive-definite ``tf.linalg.LinearOperatorLowRankUpdate``."""
    return tf.linalg.LinearOperatorLowRankUpdate(
        tf.linalg.LinearOperatorDiag(diagonal, is_positive_definite=True, is_self_adjoint=True),
        low_rank, is_positive_definite=True, is_self_adjoint=True)
