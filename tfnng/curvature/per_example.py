"""Per-example gradients and their squared sums, for VOGN, SLANG and full-covariance NNG.

VOGN's Gauss-Newton estimate (weight-perturbation paper eq. 9-10) needs ``sum_i g_i^2``, SLANG's
low-rank update (SLANG Alg. 1, line 6) and full-covariance NNG (NNG eq. 9) need the individual
gradients ``g_i`` themselves; a minibatch gradient only gives ``sum_i g_i``.

Two routes:

* Generic (:func:`per_example_gradients`): works for any Keras layer. Each example's loss is
  differentiated on its own, vectorised over the batch with ``tf.vectorized_map`` (``pfor``); if
  ``pfor`` cannot convert the model, the Jacobian of the vector of per-example losses of one batched
  forward pass is taken with ``tf.GradientTape.jacobian`` in a ``tf.while_loop`` instead. Cost: about
  B single-example backward passes, memory B x D.
* Fast (SLANG App. C.1, Goodfellow 2015): for Dense and Conv2D layers the per-example weight
  gradient is an outer product (summed over positions) of the layer's input rows and the gradients
  with respect to its pre-activations, both of which one batched forward/backward pass provides.
  :func:`gradients_from_rows` and :func:`squared_gradient_sums_from_rows` are that math, on the
  ``(B, |T|, p)`` homogeneous input rows and ``(B, |T|, q)`` pre-activation gradient rows of
  :mod:`tfnng.curvature.kronecker` (``|T|`` positions: 1 for a Dense layer on rank-2 inputs, the
  output pixels of a Conv2D); obtaining those rows is the job of :mod:`tfnng.curvature.capture`.
"""

import dataclasses

import tensorflow as tf

from tfnng.curvature import kronecker as _rows

METHODS = ("auto", "vectorized_map", "jacobian")


@dataclasses.dataclass
class CapturedVariable:
    """Generic-path record of one variable that no captured layer owns (see :mod:`tfnng.models`).

    ``gradients``: per-example gradients of the log-likelihood, shape ``(B, *variable.shape)``.
    """

    variable: object
    gradients: tf.Tensor


def per_example_gradients(model, loss_fn, x, y, variables=None, method="auto", training=False):
    """Gradients of each example's loss with respect to ``variables``, shape ``(B, *var.shape)`` each.

    Row i of the result for variable v is ``d loss_fn(y[i:i+1], model(x[i:i+1])) / d v``, i.e. the
    gradient of the summed loss of example i alone (no 1/B factor).

    Args:
        model: a callable Keras model (or layer): ``model(x, training=training)``.
        loss_fn: ``loss_fn(y_true, y_pred)`` returning per-example losses (any shape whose leading
            axis is the batch) or their sum, e.g. ``keras.losses.binary_crossentropy`` or a Keras loss
            object with ``reduction="sum"``. Its value is summed per example.
        x, y: the batch (``x`` may be a nested structure of tensors with a common leading axis).
        variables: the variables to differentiate (default ``model.trainable_variables``).
        method: ``"vectorized_map"`` (per-example backward passes vectorised by ``pfor``),
            ``"jacobian"`` (``GradientTape.jacobian`` of the per-example losses of one batched pass,
            evaluated in a ``tf.while_loop``), or ``"auto"``: ``vectorized_map``, falling back to
            ``jacobian`` if ``pfor`` raises while converting the model.
        training: the ``training`` flag of the forward pass. Default False: layers that mix examples
            in training mode (``BatchNormalization``) make per-example gradients ill defined, and
            stochastic layers would draw their noise differently per example.

    Returns:
        A list with one ``(B, *v.shape)`` tensor per variable, in the order of ``variables``.
    """
    if method not in METHODS:
        raise ValueError(f"`method` must be one of {METHODS}, got {method!r}.")
    variables = list(model.trainable_variables if variables is None else variables)
    if method == "jacobian":
        return _jacobian_gradients(model, loss_fn, x, y, variables, training)
    try:
        return _vectorized_gradients(model, loss_fn, x, y, variables, training)
    except (ValueError, TypeError, NotImplementedError, tf.errors.OpError):
        if method == "vectorized_map":
            raise
    return _jacobian_gradients(model, loss_fn, x, y, variables, training)


def _vectorized_gradients(model, loss_fn, x, y, variables, training):
    def single_example(example):
        xi, yi = tf.nest.map_structure(lambda t: tf.expand_dims(t, 0), example)
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(loss_fn(yi, model(xi, training=training)))
        grads = tape.gradient(loss, variables, unconnected_gradients=tf.UnconnectedGradients.ZERO)
        return [tf.convert_to_tensor(g) for g in grads]

    return tf.vectorized_map(single_example, (x, y), fallback_to_while_loop=True)


def _jacobian_gradients(model, loss_fn, x, y, variables, training):
    # Eagerly, a while-loop Jacobian replays the tape once per example: it must be persistent.
    with tf.GradientTape(persistent=tf.executing_eagerly()) as tape:
        losses = loss_fn(y, model(x, training=training))
        losses = tf.reshape(losses, [tf.shape(losses)[0], -1])
        losses = tf.reduce_sum(losses, axis=1)
    jacobians = tape.jacobian(losses, variables, experimental_use_pfor=False)
    return [tf.zeros((tf.shape(losses)[0],) + tuple(v.shape), v.dtype) if j is None else j
            for j, v in zip(jacobians, variables)]


def squared_gradient_sums(per_example):
    """``sum_i g_i^2`` (elementwise) for each ``(B, *shape)`` tensor: VOGN's ``M * h_hat`` (eq. 9)."""
    return [tf.reduce_sum(tf.square(g), axis=0) for g in per_example]


def flatten(per_example):
    """Concatenate per-variable ``(B, *shape)`` gradients into one ``(B, D)`` matrix (rows g_i^T)."""
    return tf.concat([tf.reshape(g, [tf.shape(g)[0], -1]) for g in per_example], axis=1)


def gradients_from_rows(activation_rows, gradient_rows):
    """Per-example homogeneous weight gradients ``DW_n = sum_t a_nt Ds_nt^T``, shape ``(B, p, q)``.

    ``activation_rows`` ``(B, |T|, p)`` and ``gradient_rows`` ``(B, |T|, q)`` as in the module
    docstring (Goodfellow's per-example gradient for Dense; its sum over output positions for Conv2D).
    Row-major reshaping of ``DW_n[:p_kernel]`` gives the kernel's gradient, ``DW_n[-1]`` the bias's
    when the rows carry the homogeneous coordinate.
    """
    return tf.einsum("btp,btq->bpq", activation_rows, gradient_rows)


def squared_gradient_sums_from_rows(activation_rows, gradient_rows):
    """``sum_n DW_n^2`` (elementwise, shape ``(p, q)``) of :func:`gradients_from_rows`.

    With one position (Dense on rank-2 inputs) ``DW_n = a_n Ds_n^T`` is rank one, so
    ``sum_n DW_n^2 = (a^2)^T (Ds^2)``: one ``(p, B) x (B, q)`` product, no ``(B, p, q)`` tensor
    (Goodfellow 2015). With several positions the per-example gradients are formed first.
    """
    if activation_rows.shape[1] == 1:
        return tf.matmul(tf.square(activation_rows[:, 0]), tf.square(gradient_rows[:, 0]),
                         transpose_a=True)
    return tf.reduce_sum(tf.square(gradients_from_rows(activation_rows, gradient_rows)), axis=0)


def _split_homogeneous(spec, tensor, leading):
    """Split a ``(*leading, p, q)`` homogeneous weight tensor into the layer's kernel and bias shapes."""
    if spec.has_bias:
        kernel = tf.reshape(tensor[..., :-1, :], leading + list(spec.kernel.shape))
        return kernel, tf.reshape(tensor[..., -1, :], leading + list(spec.bias.shape))
    return tf.reshape(tensor, leading + list(spec.kernel.shape)), None


def layer_gradients(spec, captured):
    """Fast path: per-example gradients of one captured Dense/Conv2D layer (SLANG App. C.1).

    ``spec`` is the layer's :class:`~tfnng.curvature.capture.LayerSpec`, ``captured`` its
    :class:`~tfnng.curvature.capture.CapturedLayer` (inputs and per-example pre-activation
    gradients). Returns ``(kernel, bias)`` of shapes ``(B, *kernel.shape)`` and ``(B, *bias.shape)``
    (``bias`` None without one).
    """
    gradients = gradients_from_rows(_rows.activation_rows(spec, captured.inputs),
                                    _rows.gradient_rows(spec, captured.preactivation_grads))
    return _split_homogeneous(spec, gradients, [tf.shape(gradients)[0]])


def layer_squared_gradient_means(spec, captured):
    """Fast path: ``(1/B) sum_n g_n^2`` of one captured Dense/Conv2D layer (Goodfellow 2015).

    The diagonal Fisher / Gauss-Newton estimate of NNG Alg. 1 and VOGN eq. 9, shaped ``(kernel,
    bias)`` like the layer's variables (``bias`` None without one), without materialising the
    per-example gradients of Dense layers on rank-2 inputs.
    """
    a = _rows.activation_rows(spec, captured.inputs)
    ds = _rows.gradient_rows(spec, captured.preactivation_grads)
    squares = squared_gradient_sums_from_rows(a, ds) / tf.cast(tf.shape(a)[0], a.dtype)
    return _split_homogeneous(spec, squares, [])
