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
# fast_eig's "auto" method solves the K x K Gram eigenproblem exactly up to this many factor columns.
EXACT_MAX_COLUMNS = 1024
EIG_METHODS = ("auto", "exact", "randomized")


class DenseFactors:
    """A (D, K) factor matrix ``F`` held as a tensor, with what :func:`fast_eig` and :func:`update`
    use: ``matmul(y) = F y``, ``transpose_matmul(x) = F^T x``, ``gram() = F^T F``,
    ``squared_row_norms() = diag(F F^T)``, ``dimension = D``, ``num_columns = K`` (an int, or a
    scalar tensor when only known at run time) and ``dtype``.
    :class:`tfnng.curvature.per_example.ExampleGradients` offers the same without forming F."""

    def __init__(self, matrix, dtype=None):
        self.matrix = tf.convert_to_tensor(matrix) if dtype is None else _linalg.cast(matrix, dtype)
        self.dtype = self.matrix.dtype
        self.dimension = int(self.matrix.shape[0])
        self.num_columns = self.matrix.shape[1]
        if self.num_columns is None:
            self.num_columns = tf.shape(self.matrix)[1]

    def matmul(self, y):
        return self.matrix @ y

    def transpose_matmul(self, x):
        return tf.matmul(self.matrix, x, transpose_a=True)

    def gram(self):
        return tf.matmul(self.matrix, self.matrix, transpose_a=True)

    def squared_row_norms(self):
        return tf.reduce_sum(tf.square(self.matrix), axis=1)


def as_factors(factors, dtype=None):
    """``factors`` if it already offers the products of :class:`DenseFactors`, else a DenseFactors."""
    return factors if hasattr(factors, "gram") else DenseFactors(factors, dtype)


class _LowRankAndFactors:
    """``F = [a U, c G]`` for a (D, L) tensor U and factors G (SLANG eq. 5's rank-(L+M) factor).
    The scalars a, c multiply only the small operands: no (D, L) pass is spent on scaling."""

    def __init__(self, low_rank, low_rank_scale, factors, factors_scale):
        self._u, self._a, self._g, self._c = low_rank, low_rank_scale, factors, factors_scale
        self._rank = int(low_rank.shape[1])
        self.dimension, self.dtype = int(low_rank.shape[0]), low_rank.dtype
        self.num_columns = self._rank + factors.num_columns

    def matmul(self, y):
        return self._u @ (self._a * y[:self._rank]) + self._g.matmul(self._c * y[self._rank:])

    def transpose_matmul(self, x):
        return tf.concat([self._a * tf.matmul(self._u, x, transpose_a=True),
                          self._c * self._g.transpose_matmul(x)], axis=0)

    def gram(self):
        cross = (self._a * self._c) * self._g.transpose_matmul(self._u)        # (c G)^T (a U)
        return tf.concat([
            tf.concat([tf.square(self._a) * tf.matmul(self._u, self._u, transpose_a=True),
                       tf.transpose(cross)], axis=1),
            tf.concat([cross, tf.square(self._c) * self._g.gram()], axis=1)], axis=0)

    def squared_row_norms(self):
        return (tf.square(self._a) * tf.reduce_sum(tf.square(self._u), axis=1)
                + tf.square(self._c) * self._g.squared_row_norms())


def fast_eig(factors, rank, oversampling=DEFAULT_OVERSAMPLING,
             power_iterations=DEFAULT_POWER_ITERATIONS, seed=None, method="auto"):
    """Top-``rank`` eigendecomposition of ``A = F F^T`` given only its factor ``F`` (SLANG Alg. 1, line 7).

    ``F`` (``factors``, shape (D, K)) holds the vectors whose outer products sum to A, e.g. the columns
    ``sqrt(1 - beta) u_j`` and ``sqrt(beta) g_i`` of SLANG eq. 5: a tensor, or an operator with the
    products of :class:`DenseFactors`. A is never formed. Two methods:

    * ``"exact"``: the nonzero eigenpairs of ``F F^T`` are those of the K x K Gram matrix
      ``F^T F = V diag(s) V^T`` (solved in float64), lifted as ``F v / sqrt(s)``. Exact and
      deterministic; cost one Gram matrix, a K x K eigenproblem and one product ``F V``. For the
      per-example gradients of Dense layers the Gram matrix costs only ``B^2 (p + q)``
      (:class:`tfnng.curvature.per_example.ExampleGradients`).
    * ``"randomized"``: the randomised range finder with power iterations (Halko et al. 2011, Alg.
      4.4 and 5.3; SLANG App. C.2): F times a Gaussian test matrix with ``rank + oversampling``
      columns (capped at D) spans the top of range(A) approximately; it is multiplied by A
      ``power_iterations`` more times with re-orthonormalisation in between
      (:func:`_orthonormal_columns`), giving an orthonormal basis Q; the eigenpairs of ``Q^T A Q``
      lifted by Q are returned. The error is close to the best possible ``lambda_{L+1}`` with high
      probability; each power iteration raises the decay ratio to a further power
      ``(lambda_{L+1} / lambda_L)^2``. Cost ``2 (power_iterations + 1)`` products with F or F^T of
      ``L + p`` columns. When ``K <= rank + oversampling`` the exact method is used.
    * ``"auto"`` (default): exact when ``K <= EXACT_MAX_COLUMNS`` (decided at run time when K is only
      known then), randomized otherwise.

    Args:
        factors: (D, K) tensor or factor operator F.
        rank: number L of leading eigenpairs to return, ``L <= min(D, K)``.
        oversampling, power_iterations, seed: of the randomized method (``seed``: anything
            ``keras.random.normal`` accepts).
        method: "auto", "exact" or "randomized".

    Returns:
        ``(eigenvalues, eigenvectors)``: (L,) non-negative eigenvalues in decreasing order and (D, L)
        orthonormal eigenvectors (zero columns for zero eigenvalues of a rank-deficient A).
    """
    return _top_eigenpairs(factors, rank, oversampling, power_iterations, seed, method, power=0.0)


def _top_eigenpairs(factors, rank, oversampling, power_iterations, seed, method, power):
    """:func:`fast_eig`, returning the eigenvectors scaled by ``eigenvalues ** power`` (the scaling is
    applied to the small coefficient matrix before the lift to D rows)."""
    if method not in EIG_METHODS:
        raise ValueError(f"`method` must be one of {EIG_METHODS}, got {method!r}.")
    factors = as_factors(factors)
    dim, count = factors.dimension, factors.num_columns
    static_count = count if isinstance(count, int) else None
    if rank > dim or (static_count is not None and rank > static_count):
        raise ValueError(f"`rank` ({rank}) exceeds the size of the factor matrix ({dim}, {count}).")
    sketch_size = min(rank + oversampling, dim)

    def exact():
        return _exact_eig(factors, rank, power)

    def randomized():
        return _randomized_eig(factors, rank, sketch_size, power_iterations, seed, power)

    if method == "exact" or (static_count is not None and static_count <= sketch_size):
        values, vectors = exact()
    elif method == "randomized":
        values, vectors = randomized()
    elif static_count is not None:
        values, vectors = exact() if static_count <= EXACT_MAX_COLUMNS else randomized()
    else:
        values, vectors = tf.cond(count <= EXACT_MAX_COLUMNS, exact, randomized)
    # Static shapes for the callers, also in a step traced for an unknown batch size.
    return tf.ensure_shape(values, [rank]), tf.ensure_shape(vectors, [dim, rank])


def _exact_eig(factors, rank, power):
    """Eigenvectors ``F v / sqrt(s)`` from the Gram matrix; with ``power`` they come scaled by s^power."""
    values, vectors = tf.linalg.eigh(tf.cast(factors.gram(), tf.float64))
    values, vectors = tf.reverse(values, [0])[:rank], tf.reverse(vectors, [1])[:, :rank]
    keep = values > 1e-12 * tf.maximum(values[0], 0.0)
    scale = tf.where(keep, tf.pow(tf.where(keep, values, 1.0), power - 0.5), 0.0)
    eigenvectors = factors.matmul(tf.cast(vectors * scale, factors.dtype))
    return tf.cast(tf.where(keep, values, 0.0), factors.dtype), eigenvectors


def _randomized_eig(factors, rank, sketch_size, power_iterations, seed, power):
    test_matrix = keras.random.normal(tf.stack([factors.num_columns, sketch_size]),
                                      dtype=factors.dtype, seed=seed)
    basis = _orthonormal_columns(factors.matmul(test_matrix))
    for _ in range(power_iterations):
        basis = _orthonormal_columns(factors.matmul(factors.transpose_matmul(basis)))
    projected = factors.transpose_matmul(basis)          # (Q^T F)^T, so Q^T A Q = P^T P
    values, vectors = tf.linalg.eigh(tf.matmul(projected, projected, transpose_a=True))
    values, vectors = tf.reverse(values, [0])[:rank], tf.reverse(vectors, [1])[:, :rank]
    values = tf.maximum(values, 0.0)
    return values, basis @ (vectors * tf.pow(values, power))


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
           oversampling=DEFAULT_OVERSAMPLING, power_iterations=DEFAULT_POWER_ITERATIONS, seed=None,
           method="auto", curvature_weight=1.0):
    """One SLANG precision update of ``(U, d)`` (SLANG eq. 4-10; Alg. 1, lines 7-10).

    The update it approximates is the VOGN precision step (SLANG eq. 2)::

        P_new = (1 - beta) (U U^T + diag d) + beta (c G G^T + prior_precision I)

    with ``c G G^T`` the curvature estimate, ``c = curvature_weight`` (the empirical Fisher
    ``(1/M) sum_i g_i g_i^T`` for the columns ``g_i`` and ``c = 1/M``). The rank-(L+M) part
    ``(1 - beta) U U^T + beta c G G^T`` (eq. 5) is replaced by its top-L eigendecomposition
    ``Q Lambda Q^T`` (eq. 6, :func:`fast_eig`), ``U_new = Q Lambda^{1/2}`` (eq. 7), and the discarded
    part's diagonal is moved into ``d`` (diagonal correction, eq. 9-10)::

        d_new = (1 - beta) d + beta prior_precision
                + diag[(1 - beta) U U^T + beta c G G^T - U_new U_new^T]

    so ``diag(U_new U_new^T + diag d_new) == diag(P_new)`` exactly (eq. 8; SLANG App. D), also
    with the randomised eigensolver's non-PSD remainder, wherever ``d_new`` stays positive (else
    the correction of that entry is dropped). With
    ``L = D`` the update is exact: SLANG equals the full-covariance update (2).

    Args:
        low_rank: (D, L) tensor U.
        diagonal: (D,) tensor d.
        curvature_factors: (D, M) tensor or factor operator G (see :class:`DenseFactors`).
        beta: step size of the precision, in (0, 1].
        prior_precision: scalar or (D,) prior precision (lambda of SLANG eq. 2).
        rank: L of the result (default: the number of columns of ``low_rank``).
        oversampling, power_iterations, seed, method: passed to :func:`fast_eig`.
        curvature_weight: c.

    Returns:
        ``(U_new, d_new)``.
    """
    low_rank = tf.convert_to_tensor(low_rank)
    dtype = low_rank.dtype
    beta = _linalg.cast(beta, dtype)
    rank = low_rank.shape[1] if rank is None else rank
    combined = _LowRankAndFactors(low_rank, tf.sqrt(1.0 - beta), as_factors(curvature_factors, dtype),
                                  tf.sqrt(beta * _linalg.cast(curvature_weight, dtype)))
    _, new_low_rank = _top_eigenpairs(combined, rank, oversampling, power_iterations, seed, method,
                                      power=0.5)                            # Q Lambda^{1/2}, eq. 7
    # The discarded part's diagonal: >= 0 for exact top-L eigenpairs, but the randomised range
    # finder without power iterations leaves a part that is not positive semi-definite, whose
    # diagonal is negative in places. Kept, so that the diagonal stays exact, wherever d stays
    # positive; where it would not (round-off of two nearly equal row norms in float32 against a
    # tiny d), the correction is dropped: d negative would make its square root NaN.
    correction = combined.squared_row_norms() - tf.reduce_sum(tf.square(new_low_rank), axis=1)
    base = ((1.0 - beta) * _linalg.cast(diagonal, dtype)
            + beta * _linalg.cast(prior_precision, dtype))
    new_diagonal = tf.where(base + correction > 0, base + correction, base)
    return new_low_rank, new_diagonal


def _capacitance_cholesky(scaled, low_rank):
    """Cholesky factor of ``I_L + U^T diag(d)^-1 U`` (Woodbury's capacitance), ``scaled = U / d``."""
    capacitance = tf.transpose(low_rank) @ scaled
    return tf.linalg.cholesky(capacitance + tf.eye(low_rank.shape[1], dtype=low_rank.dtype))


class _Whitened:
    """``P = U U^T + diag d`` written as ``d^{1/2} (I + V V^T) d^{1/2}`` with ``V = d^{-1/2} U`` and
    ``V^T V = W diag(s) W^T``, in float64 (SLANG App. C.3-C.4): one Gram product of the (D, L)
    factor and one L x L eigenproblem, which :func:`fast_inverse`, :func:`fast_sample`,
    :func:`inverse_and_sample`, :func:`marginal_variances` and :func:`covariance_root` build on.

    Every one of them applies ``I - V W diag(k) W^T V^T`` for a coefficient vector k of s:
    ``1 / (1 + s)`` gives ``(I + V V^T)^-1`` (Woodbury; SLANG Alg. 2), and
    ``1 / (sqrt(1 + s) (1 + sqrt(1 + s)))`` its symmetric square root (eigenvalues ``1 / sqrt(1 + s)``
    and 1; the factorisation of Ambikasaran & O'Neil, SLANG Alg. 3). Where ``U U^T >> diag d`` the
    two terms nearly cancel along range(U) (relative rounding ~eps x s, up to s ~ 1e9-1e11 at large
    N or L near D), so the (D, L) products are float64: in float32 the inverse lost those components
    (SLANG's mean steps diverged) and the sampled standard deviations were off by up to a factor
    2.9. ``V`` is never stored: products with it scale the (D, K) operand by ``d^{-1/2}`` instead.
    """

    def __init__(self, low_rank, diagonal):
        self.inv_sqrt = tf.math.rsqrt(tf.cast(diagonal, tf.float64))
        self.low_rank = tf.cast(low_rank, tf.float64)
        whitened = self.low_rank * self.inv_sqrt[:, None]
        values, self.eigenvectors = tf.linalg.eigh(tf.matmul(whitened, whitened, transpose_a=True))
        self.eigenvalues = tf.maximum(values, 0.0)

    def inverse_coefficients(self):
        return 1.0 / (1.0 + self.eigenvalues)

    def root_coefficients(self):
        root = tf.sqrt(1.0 + self.eigenvalues)
        return 1.0 / (root * (1.0 + root))

    def lifted_eigenvectors(self):
        """``Z = V W`` (D, L), orthogonal columns of squared norms s."""
        return self.inv_sqrt[:, None] * (self.low_rank @ self.eigenvectors)

    def apply(self, rows, coefficients):
        """``d^{-1/2} (I - V W diag(k_j) W^T V^T) x_j`` for the float64 rows ``x_j`` of the (K, D)
        ``rows`` and the coefficients ``k_j``, (K, L) or (L,) for all rows: two (D, L) products for
        all K. (Rows, not columns: TensorFlow broadcasts a (D,) vector along rows several times
        faster.)"""
        projected = tf.matmul(rows * self.inv_sqrt, self.low_rank)                 # (V^T x_j)^T
        mixed = tf.matmul(coefficients * (projected @ self.eigenvectors), self.eigenvectors,
                          transpose_b=True)
        return self.inv_sqrt * (rows - self.inv_sqrt * tf.matmul(mixed, self.low_rank,
                                                                 transpose_b=True))


def fast_inverse(low_rank, diagonal, vectors):
    """``(U U^T + diag d)^-1 g`` by the Woodbury identity (SLANG Alg. 2; App. C.3), cost O(D L^2).

    ``vectors`` is a (D,) vector or a (D, K) matrix of K vectors:
    ``d^{-1/2} (I + V V^T)^-1 d^{-1/2} g`` with the L x L capacitance ``I + V^T V`` (Alg. 2, line 1)
    diagonalised instead of inverted (:class:`_Whitened`). Computed in float64 whatever the inputs'
    dtype (the result is cast back to the vectors' dtype), see :class:`_Whitened`.
    """
    whitened = _Whitened(low_rank, diagonal)
    return _apply_to_columns(lambda rows: whitened.apply(whitened.inv_sqrt * rows,
                                                         whitened.inverse_coefficients()), vectors)


def _apply_to_columns(apply, vectors):
    """``apply`` (on float64 (K, D) rows) to the columns of a (D, K) matrix or to a (D,) vector,
    the result in the vectors' dtype."""
    vectors = tf.convert_to_tensor(vectors)
    rows = tf.cast(vectors[None, :] if vectors.shape.rank == 1 else tf.transpose(vectors),
                   tf.float64)
    result = tf.cast(apply(rows), vectors.dtype)
    return result[0] if vectors.shape.rank == 1 else tf.transpose(result)


def covariance_root(low_rank, diagonal):
    """A square root ``R`` of ``(U U^T + diag d)^-1`` (``R R^T`` equals it) as a
    ``tf.linalg.LinearOperator`` (Alg. 3).

    With ``V = d^{-1/2} U`` the covariance is ``d^{-1/2} (I + V V^T)^{-1} d^{-1/2}``, and
    ``R = d^{-1/2} (I - V K V^T)``, where ``I - V K V^T`` is the symmetric square root of
    ``(I + V V^T)^{-1}`` (the symmetric factorisation of Ambikasaran & O'Neil, SLANG ref. [4]; SLANG
    App. C.4). ``R`` itself is symmetric only when ``d`` is constant. Alg. 3 builds the L x L
    matrix K from Cholesky factors of ``V^T V``, which requires U of full column rank; here K comes
    from the eigendecomposition ``V^T V = W diag(s) W^T`` as
    ``K = W diag(1 / (sqrt(1 + s) (1 + sqrt(1 + s)))) W^T`` (:class:`_Whitened`): the same matrix as
    Alg. 3's once its ``K = (C + V^T V)^-1`` is read as ``(C^-1 + V^T V)^-1`` (as printed, a scalar
    V^T V = 3 gives the variance 0.01 instead of 1/4), and well defined for rank-deficient U (e.g.
    zero columns at initialisation). The factor ``I - V K V^T`` has eigenvalues
    ``1 / sqrt(1 + s)`` and 1: positive definite.
    """
    whitened = _Whitened(low_rank, diagonal)
    dtype = tf.as_dtype(diagonal.dtype)
    correction = tf.linalg.LinearOperatorLowRankUpdate(     # Z = V W: orthogonal columns
        tf.linalg.LinearOperatorIdentity(tf.shape(diagonal)[0], dtype=dtype),
        tf.cast(whitened.lifted_eigenvectors(), dtype),
        diag_update=-tf.cast(whitened.root_coefficients(), dtype),
        is_self_adjoint=True, is_positive_definite=True)
    return tf.linalg.LinearOperatorComposition(
        [tf.linalg.LinearOperatorDiag(tf.cast(whitened.inv_sqrt, dtype), is_positive_definite=True),
         correction])


def fast_sample(low_rank, diagonal, standard_normal):
    """Map ``eps ~ N(0, I_D)`` to a draw from ``N(0, (U U^T + diag d)^-1)`` (SLANG Alg. 3; App. C.4):
    ``covariance_root(U, d) eps``, applied as ``d^{-1/2} (eps - V (K (V^T eps)))`` in float64
    (:class:`_Whitened`; the result in the draws' dtype). Cost O(D L^2 + L^3 + D L S) for S draws
    (``standard_normal`` of shape (D,) or (D, S))."""
    whitened = _Whitened(low_rank, diagonal)
    return _apply_to_columns(lambda rows: whitened.apply(rows, whitened.root_coefficients()),
                             standard_normal)


def inverse_and_sample(low_rank, diagonal, vector, standard_normal):
    """``(fast_inverse(U, d, g), fast_sample(U, d, eps))`` for (D,) vectors ``g`` and ``eps``, from
    one :class:`_Whitened` and one pair of (D, L) products for both (SLANG Alg. 2 and 3 share
    their L x L factorisation: a SLANG step's mean update and its next weight sample)."""
    whitened = _Whitened(low_rank, diagonal)
    rows = tf.stack([whitened.inv_sqrt * tf.cast(vector, tf.float64),
                     tf.cast(standard_normal, tf.float64)])
    coefficients = tf.stack([whitened.inverse_coefficients(), whitened.root_coefficients()])
    result = whitened.apply(rows, coefficients)
    return tf.cast(result[0], vector.dtype), tf.cast(result[1], standard_normal.dtype)


def marginal_variances(low_rank, diagonal):
    """``diag((U U^T + diag d)^-1)``, the posterior marginal variances, by Woodbury in O(D L^2):
    ``(1/d) (1 - sum_l Z_il^2 / (1 + s_l))`` with ``Z = V W`` (:class:`_Whitened`).

    Computed in float64 whatever the inputs' dtype (the result is cast back): the difference is
    small against 1 where ``U U^T >> diag d`` (large N, L near D), and in float32 it came out wrong
    in its first digit, or negative."""
    whitened = _Whitened(low_rank, diagonal)
    rows = whitened.lifted_eigenvectors() * tf.sqrt(whitened.inverse_coefficients())
    variances = tf.square(whitened.inv_sqrt) * (1.0 - tf.reduce_sum(tf.square(rows), axis=1))
    return tf.cast(variances, low_rank.dtype)


def log_det_precision(low_rank, diagonal):
    """``log det(U U^T + diag d)`` by the matrix determinant lemma, O(D L^2)."""
    return _log_det_from_capacitance(_capacitance_cholesky(low_rank / diagonal[:, None], low_rank),
                                     diagonal)


def _log_det_from_capacitance(chol, diagonal):
    """``log det(U U^T + diag d) = sum(log d) + log det(I + U^T diag(d)^-1 U)``, given the Cholesky
    factor of the latter (the capacitance)."""
    return (tf.reduce_sum(tf.math.log(diagonal))
            + 2.0 * tf.reduce_sum(tf.math.log(tf.linalg.diag_part(chol))))


def kl_to_isotropic_prior(mean, low_rank, diagonal, prior_variance, covariance_scale=1.0):
    """KL( N(mu, c (U U^T + diag d)^-1) || N(0, eta I) ) in closed form, O(D L^2).

    ``0.5 * (c tr(P^-1)/eta + mu^T mu/eta - D + D log(eta/c) + log det P)`` with ``P = U U^T + diag d``,
    the KL term of the ELBO (SLANG eq. 1) for the isotropic prior of SLANG sec. 2 (precision
    ``1/eta``). With ``W = diag(d)^-1 U`` and the capacitance ``C = I + U^T W``, Woodbury gives
    ``tr(P^-1) = sum(1/d) - tr(C^-1 W^T W)`` and the determinant lemma ``log det P = sum(log d) +
    log det C``: two (L, L) Gram products, no (D, L) solve.
    """
    dtype = diagonal.dtype
    eta = _linalg.cast(prior_variance, dtype)
    scale = _linalg.cast(covariance_scale, dtype)
    dim = tf.cast(tf.size(diagonal), dtype)
    inverse = 1.0 / diagonal
    scaled = low_rank * inverse[:, None]
    chol = _capacitance_cholesky(scaled, low_rank)
    gram = tf.matmul(scaled, scaled, transpose_a=True)
    trace = tf.reduce_sum(inverse) - tf.linalg.trace(tf.linalg.cholesky_solve(chol, gram))
    return 0.5 * (scale * trace / eta + tf.reduce_sum(tf.square(mean)) / eta - dim
                  + dim * tf.math.log(eta / scale) + _log_det_from_capacitance(chol, diagonal))


def precision_operator(low_rank, diagonal):
    """The precision ``U U^T + diag d`` as a positive-definite ``tf.linalg.LinearOperatorLowRankUpdate``."""
    return tf.linalg.LinearOperatorLowRankUpdate(
        tf.linalg.LinearOperatorDiag(diagonal, is_positive_definite=True, is_self_adjoint=True),
        low_rank, is_positive_definite=True, is_self_adjoint=True)
