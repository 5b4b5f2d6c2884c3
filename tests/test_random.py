"""The weight-noise draw ``tfnng._random.standard_normal``: a standard normal sample (Box-Muller outside
XLA, TensorFlow's op inside), deterministic in its seed."""

import numpy as np
import pytest
import tensorflow as tf
from scipy import stats

from tfnng._random import standard_normal

SEED = tf.constant([3, 11], tf.int32)


def test_draws_are_independent_standard_normals():
    z = standard_normal((500, 401), SEED).numpy().ravel()      # odd size: the last pair is cut
    n = z.size

    assert abs(z.mean()) < 4.0 / np.sqrt(n)
    assert abs(z.var() - 1.0) < 4.0 * np.sqrt(2.0 / n)
    assert abs(stats.kurtosis(z)) < 4.0 * np.sqrt(24.0 / n)      # excess kurtosis of a Gaussian: 0
    assert stats.kstest(z, "norm").pvalue > 1e-3
    # Box-Muller's two outputs of one pair (cos and sin halves) are independent, not just uncorrelated.
    half = n // 2
    first, second = z[:half], z[half:2 * half]
    for a, b in [(first, second), (first ** 2, second ** 2)]:
        assert abs(np.corrcoef(a, b)[0, 1]) < 4.0 / np.sqrt(half)


def test_a_seed_fixes_the_draw_and_the_dtype_is_kept():
    a = standard_normal((7, 3), SEED)
    np.testing.assert_array_equal(a.numpy(), standard_normal((7, 3), SEED).numpy())
    assert not np.allclose(a.numpy(), standard_normal((7, 3), SEED + 1).numpy())
    assert a.shape == (7, 3) and a.dtype == tf.float32

    in_graph = tf.function(lambda: standard_normal((7, 3), SEED))()
    np.testing.assert_array_equal(a.numpy(), in_graph.numpy())
    for dtype in (tf.float64, tf.float16, tf.bfloat16):
        z = standard_normal((1001,), SEED, dtype)
        assert z.dtype == dtype and np.all(np.isfinite(z.numpy().astype(np.float64)))
    # float64 draws use float64 uniforms: more distinct values than float32's 2^23-step grid allows
    wide = standard_normal((200_000,), SEED, tf.float64).numpy()
    assert not np.array_equal(wide, wide.astype(np.float32).astype(np.float64))


def test_a_zero_uniform_gives_a_finite_draw():
    """Philox's float32 uniforms hit 0 with probability 2^-23: the stream of seed [0, 0] does within
    2^23 draws (one step of an 8M-weight model). The radius takes log(1 - u), finite there, and the
    tails end at sqrt(-2 log 2^-23) = 5.65 (u <= 1 - 2^-23)."""
    seed = tf.constant([0, 0], tf.int32)
    uniforms = tf.random.stateless_uniform((2, 2 ** 22), seed, alg="philox").numpy()
    assert (uniforms[0] == 0).any()                          # the case is in this stream
    z = standard_normal((2 ** 23,), seed).numpy()
    assert np.isfinite(z).all() and np.abs(z).max() <= np.sqrt(-2 * np.log(2.0 ** -23))


def test_under_xla_it_is_tensorflows_op():
    xla = tf.function(lambda: standard_normal((50, 4), SEED), jit_compile=True)()
    op_under_xla = tf.function(lambda: tf.random.stateless_normal((50, 4), SEED, alg="philox"),
                               jit_compile=True)()

    np.testing.assert_array_equal(xla.numpy(), op_under_xla.numpy())
    assert not np.allclose(xla.numpy(), standard_normal((50, 4), SEED).numpy())


@pytest.mark.parametrize("shape", [(), (1,), (0, 3)])
def test_degenerate_shapes(shape):
    assert standard_normal(shape, SEED).shape == shape
