"""Whether the code being traced is compiled with XLA: some kernels are fast on one side only, and
run-time checks exist on the other side only."""

import tensorflow as tf


def compiled_with_xla():
    """Whether the code being traced is compiled with XLA (``jit_compile=True``)."""
    # Local import: TensorFlow offers this test only in a private module.
    from tensorflow.python.ops.control_flow_util import GraphOrParentsInXlaContext

    return GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph())


def checked(value, valid, message):
    """``value``, after raising ``InvalidArgumentError`` with ``message`` unless all of ``valid``
    holds: eagerly and in graphs, where what uses the returned value runs after the check. XLA
    (``jit_compile=True``) has no run-time assertions: there the check is left out."""
    if compiled_with_xla():
        return value
    with tf.control_dependencies([tf.debugging.assert_equal(tf.reduce_all(valid), True,
                                                            message=message)]):
        return tf.identity(value)
