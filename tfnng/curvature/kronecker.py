"""Kronecker factors of the Fisher from captured layer inputs and pre-activation gradients.

Notation (NNG sec. 2.4, eq. 3, and eq. 12): a layer computes ``s = a^T W`` with the *homogeneous*
weight matrix ``W = [kernel; bias]`` of shape ``(p, q)`` and input ``a = [x; 1]`` (the 1 only when
the layer has a bias). With ``Ds`` the per-example gradient of ``log p(y | x, w)`` with respect to
``s`` (targets sampled from the model's predictive for the *true* Fisher, NNG footnote 1, or the
observed ones for the *empirical* Fisher), ``DW = a Ds^T`` and the per-example Fisher block

    F = E[vec(DW) vec(DW)^T] ~= S (x) A,   A = E[a a^T] (p x p),   S = E[Ds Ds^T] (q x q)   (eq. 3)

(column-stacking ``vec``). Expectations are batch averages; because ``Ds`` is the gradient of the
*per-example* log-likelihood, ``N * (S (x) A)`` approximates the Fisher of the summed
log-likelihood, i.e. the Fisher of the Keras mean loss times N (docs/math.md, "Notation and
conventions").

Convolutions (KFC, Grosse & Martens 2016): with the input patches ``a_t`` (``kh*kw*c_in`` values,
plus the homogeneous 1) and the pre-activation gradients ``Ds_t`` at the ``|T|`` output positions t,
``DW = sum_t a_t Ds_t^T``. Under KFC's assumptions (independent activations and derivatives,
spatial homogeneity, spatially uncorrelated derivatives) the Fisher block is ``Gamma (x) Omega`` with

    Omega = E[sum_t a_t a_t^T]                 (sum over positions: A below)
    Gamma = E[(1/|T|) sum_t Ds_t Ds_t^T]       (mean over positions: S below)

Dense layers applied to inputs of rank > 2 (e.g. ``(B, T, c)``) share weights across the extra axes
exactly as a 1x1 convolution does and get the same treatment; for rank-2 inputs ``|T| = 1`` and the
formulas reduce to eq. (3).

Only the product ``S (x) A`` is determined; how a scale is distributed between the factors does not
matter for NNG because the damping split pi (eq. 13) compensates exactly.
"""

import tensorflow as tf

from tfnng._dtypes import at_least_float32
from tfnng.curvature.capture import CONV2D


def _to_channels_last(layer, tensor):
    if getattr(layer, "data_format", "channels_last") == "channels_first":
        return tf.transpose(tensor, [0, 2, 3, 1])
    return tensor


def _positions_rows(tensor, width):
    """``tensor`` ``(B, ..., width)`` as ``(B, |T|, width)``, with ``|T|`` static whenever the
    non-batch shape is (a step traced for an unknown batch size still knows its positions)."""
    positions = tensor.shape[1:-1].num_elements()
    if positions is None:
        return tf.reshape(tensor, [tf.shape(tensor)[0], -1, width])
    return tf.reshape(tensor, [-1, positions, width])


def activation_rows(spec, inputs):
    """Homogeneous input vectors per example and position, shape ``(B, |T|, p)``.

    Dense: the input with its leading non-batch axes flattened into positions. Conv2D: the input
    patches (``tf.image.extract_patches``, ordered like the kernel's ``(kh, kw, c_in)`` axes).
    """
    layer = spec.layer
    inputs = tf.convert_to_tensor(inputs)
    if spec.kind == CONV2D:
        x = _to_channels_last(layer, inputs)
        kh, kw = layer.kernel_size
        sh, sw = layer.strides
        dh, dw = layer.dilation_rate
        patches = tf.image.extract_patches(
            x, sizes=[1, kh, kw, 1], strides=[1, sh, sw, 1], rates=[1, dh, dw, 1],
            padding=layer.padding.upper())
        rows = _positions_rows(patches, kh * kw * x.shape[-1])
    else:
        rows = _positions_rows(inputs, layer.kernel.shape[0])    # (a sparse input's is unknown)
    rows = tf.cast(rows, spec.kernel.dtype)
    if spec.has_bias:
        rows = tf.concat([rows, tf.ones_like(rows[..., :1])], axis=-1)
    return rows


def gradient_rows(spec, preactivation_grads):
    """Per-example pre-activation gradients per position, shape ``(B, |T|, q)``."""
    g = tf.convert_to_tensor(preactivation_grads)
    if spec.kind == CONV2D:
        g = _to_channels_last(spec.layer, g)
    return tf.cast(_positions_rows(g, spec.layer.kernel.shape[-1]), spec.kernel.dtype)


def example_gradient_norm_bounds(spec, inputs, preactivation_grads):
    """Upper bounds ``b_n >= ||DW_n||_F`` on each example's homogeneous weight gradient, shape
    ``(B,)``, in at least float32, without forming patches or per-example gradients.

    ``||DW_n|| <= sum_t ||a_nt|| ||Ds_nt|| <= sqrt(sum_t ||a_nt||^2) sqrt(sum_t ||Ds_nt||^2)``
    (triangle and Cauchy-Schwarz inequalities), and ``sum_t ||a_nt||^2 <= kh kw ||x_n||^2 + |T|``
    for a Conv2D (an input value lies in at most ``kh kw`` patches; ``|T|`` homogeneous 1s when the
    layer has a bias), ``||x_n||^2 + |T|`` for a Dense layer. Per-example squared gradients and
    their Gram matrices are bounded by ``b_n^2`` and ``b_n b_k``: they are finite when the sum of
    ``b_n^2`` is, although they can overflow where ``x`` and ``Ds`` themselves do not.
    """
    inputs = at_least_float32(tf.convert_to_tensor(inputs))
    grads = tf.cast(at_least_float32(tf.convert_to_tensor(preactivation_grads)), inputs.dtype)
    input_norms = tf.reduce_sum(tf.square(tf.reshape(inputs, [tf.shape(inputs)[0], -1])), axis=1)
    grad_rows = tf.reshape(grads, [tf.shape(grads)[0], -1])
    if spec.kind == CONV2D:
        kh, kw = spec.layer.kernel_size
        input_norms *= kh * kw
    if spec.has_bias:
        positions = tf.cast(tf.shape(grad_rows)[1], inputs.dtype) / spec.weight_shape[1]
        input_norms += positions
    return tf.sqrt(input_norms) * tf.sqrt(tf.reduce_sum(tf.square(grad_rows), axis=1))


def factors(spec, inputs, preactivation_grads):
    """The batch estimates ``(A, S)`` of eq. (12) (KFC for Conv2D), see the module docstring.

    ``A = (1/B) sum_n sum_t a_nt a_nt^T`` and ``S = (1/(B |T|)) sum_n sum_t Ds_nt Ds_nt^T``.
    """
    a = activation_rows(spec, inputs)
    g = gradient_rows(spec, preactivation_grads)
    batch = tf.cast(tf.shape(a)[0], a.dtype)
    positions = tf.cast(tf.shape(g)[1], g.dtype)
    a_flat = tf.reshape(a, [-1, a.shape[-1]])
    g_flat = tf.reshape(g, [-1, g.shape[-1]])
    a_factor = tf.matmul(a_flat, a_flat, transpose_a=True) / batch
    s_factor = tf.matmul(g_flat, g_flat, transpose_a=True) / (batch * positions)
    return a_factor, s_factor


def cross_factors(spec_1, inputs_1, grads_1, spec_2, inputs_2, grads_2):
    """Cross-layer factors ``(A_12, S_12) = (E[a_1 a_2^T], E[Ds_1 Ds_2^T])`` of two Dense layers.

    They give the off-diagonal Fisher blocks ``F_12 ~= S_12 (x) A_12`` of the block-tridiagonal
    approximation (Martens & Grosse 2015, sec. 4.3). Defined for layers without weight-sharing
    positions (rank-2 inputs) only.
    """
    a1 = activation_rows(spec_1, inputs_1)[:, 0, :]
    a2 = activation_rows(spec_2, inputs_2)[:, 0, :]
    g1 = gradient_rows(spec_1, grads_1)[:, 0, :]
    g2 = gradient_rows(spec_2, grads_2)[:, 0, :]
    batch = tf.cast(tf.shape(a1)[0], a1.dtype)
    return (tf.matmul(a1, a2, transpose_a=True) / batch,
            tf.matmul(g1, g2, transpose_a=True) / batch)


def isotropic_part(factor):
    """``(tr F / d) I`` for a ``d x d`` factor ``F``: the multiple of the identity with its trace (its
    mean eigenvalue times I), the start of noisy K-FAC's factor averages."""
    dim = factor.shape[0]
    return tf.eye(dim, dtype=factor.dtype) * (tf.linalg.trace(factor) / dim)
