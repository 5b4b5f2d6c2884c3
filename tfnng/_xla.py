"""Whether the code being traced is compiled with XLA: some kernels are fast on one side only."""

import tensorflow as tf


def compiled_with_xla():
    """Whether the code being traced is compiled with XLA (``jit_compile=True``)."""
    # Local import: TensorFlow offers this test only in a private module.
    from tensorflow.python.ops.control_flow_util import GraphOrParentsInXlaContext

    return GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph())
