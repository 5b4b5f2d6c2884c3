"""Small tensor helpers shared by the posterior families."""

import tensorflow as tf


def cast(value, dtype):
    """``value`` in ``dtype``; Python and NumPy numbers are converted directly (no float32 rounding)."""
    return tf.cast(value, dtype) if tf.is_tensor(value) else tf.constant(value, dtype)


def as_matrix(vectors):
    """``(matrix, was_vector)``: a rank-1 input becomes one column."""
    vectors = tf.convert_to_tensor(vectors)
    return (vectors[:, None], True) if vectors.shape.rank == 1 else (vectors, False)


def with_growing_jitter(factorise, matrix, tries):
    """``factorise(matrix + delta I)``, guarded like kfac-jax: ``delta = 0`` first; while the result
    (a tensor or a tuple of tensors) is not finite, ``delta`` grows to ``1e-6``, ``1e-4``, ... times
    the mean absolute diagonal plus one. Returns ``(result, ok)``; ``ok`` is False if every one
    of the ``tries`` failed."""
    n = tf.shape(matrix)[0]
    eye = tf.eye(n, dtype=matrix.dtype)
    scale = tf.abs(tf.linalg.trace(matrix)) / tf.cast(n, matrix.dtype) + 1.0

    def attempt(k):
        delta = 0.0 if k == 0 else scale * 10.0 ** (-8 + 2 * k)
        result = factorise(matrix + delta * eye)
        ok = tf.reduce_all([tf.reduce_all(tf.math.is_finite(t)) for t in tf.nest.flatten(result)])
        return result, ok

    def try_from(k):
        result, ok = attempt(k)
        if k == tries - 1:
            return result, ok
        return tf.cond(ok, lambda: (result, ok), lambda: try_from(k + 1))

    return try_from(0)
