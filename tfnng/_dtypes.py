"""Half precision (``mixed_float16`` / ``mixed_bfloat16`` heads) widened where tfnng computes."""

import tensorflow as tf


def at_least_float32(x):
    """``x`` as a tensor, float16/bfloat16 cast to float32 (other dtypes unchanged): Monte Carlo
    sums drift in half precision, squares overflow past 65504 (float16), and sampling from a
    bfloat16 distribution rounds away most of its spread (8 bits of mantissa)."""
    x = tf.convert_to_tensor(x)
    return tf.cast(x, tf.float32) if x.dtype in (tf.float16, tf.bfloat16) else x
