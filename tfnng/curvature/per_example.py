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

Algorithms that only need products with the per-example gradients (SLANG's eigendecomposition)
get them from :class:`ExampleGradients`, which never forms the gradients of Dense layers.
"""

import dataclasses

import keras
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
            axis is the batch), e.g. ``keras.losses.binary_crossentropy`` or a tfnng or Keras loss
            object with ``reduction="none"``. Its value is summed per example. (The
            ``vectorized_map`` method also takes their sum, ``reduction="sum"``.)
        x, y: the batch (``x`` may be a nested structure of tensors with a common leading axis).
        variables: the variables to differentiate (default ``model.trainable_variables``).
        method: ``"vectorized_map"`` (per-example backward passes vectorised by ``pfor``),
            ``"jacobian"`` (``GradientTape.jacobian`` of the per-example losses of one batched pass,
            evaluated in a ``tf.while_loop``), or ``"auto"``: ``vectorized_map``, falling back to
            ``jacobian`` if ``pfor`` raises while converting the model; ``jacobian`` for a model
            with a recurrent layer, whose converted while loop can fail when it runs (seen with
            a ``TimeDistributed`` layer feeding a ``SimpleRNN``), a grouped convolution
            (``groups > 1``) or a ``TextVectorization``, whose converted passes fail when they run.
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
    if method == "auto" and _fails_when_vectorized(model):
        return _jacobian_gradients(model, loss_fn, x, y, variables, training,
                                   why="method='auto' takes the Jacobian for a model with a "
                                       "recurrent layer, a grouped convolution, an EinsumDense "
                                       "or a TextVectorization, and")
    try:
        return _vectorized_gradients(model, loss_fn, x, y, variables, training)
    except (ValueError, TypeError, NotImplementedError, tf.errors.OpError):
        if method == "vectorized_map":
            raise
    return _jacobian_gradients(model, loss_fn, x, y, variables, training,
                               why="method='auto' fell back to the Jacobian (vectorized_map "
                                   "failed for this model), which")


def _fails_when_vectorized(model):
    """Whether ``model`` has a layer whose pfor-converted pass can fail when it runs (not when
    converted, where "auto" falls back): a recurrent layer, a grouped convolution, a
    TextVectorization (its string split has a length per example), an EinsumDense (also inside
    MultiHeadAttention: its vectorised gradient aborts the process in TensorFlow's oneDNN
    kernels, with no Python exception to fall back on)."""
    layers = model._flatten_layers(include_self=True, recursive=True) if isinstance(
        model, keras.layers.Layer) else []
    convolutions = (keras.layers.Conv1D, keras.layers.Conv2D, keras.layers.Conv3D)
    never_vectorized = (keras.layers.RNN, keras.layers.TextVectorization, keras.layers.EinsumDense)
    return any(isinstance(layer, never_vectorized)
               or (isinstance(layer, convolutions) and layer.groups > 1) for layer in layers)


def _vectorized_gradients(model, loss_fn, x, y, variables, training):
    def single_example(example):
        xi, yi = tf.nest.map_structure(lambda t: tf.expand_dims(t, 0), example)
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(loss_fn(yi, model(xi, training=training)))
        # Zeros for a variable the loss does not reach, made here: TensorFlow's own
        # (UnconnectedGradients.ZERO) read a Keras variable's dtype name as a DType and failed.
        return [tf.zeros(v.shape, v.dtype) if g is None else tf.convert_to_tensor(g)
                for g, v in zip(tape.gradient(loss, variables), variables)]

    return tf.vectorized_map(single_example, (x, y), fallback_to_while_loop=True)


def _jacobian_gradients(model, loss_fn, x, y, variables, training,
                        why="per_example_gradients(method='jacobian')"):
    # Eagerly, a while-loop Jacobian replays the tape once per example: it must be persistent.
    with tf.GradientTape(persistent=tf.executing_eagerly()) as tape:
        losses = loss_fn(y, model(x, training=training))
        if losses.shape.rank == 0:
            raise ValueError(
                f"{why} needs the loss of each example (a loss with reduction='none'); `loss_fn` "
                "returned one scalar, a sum or mean over the batch, which does not split by "
                "example.")
        losses = tf.reshape(losses, [tf.shape(losses)[0], -1])
        losses = tf.reduce_sum(losses, axis=1)
    jacobians = tape.jacobian(losses, variables, experimental_use_pfor=False)
    return [tf.zeros((tf.shape(losses)[0],) + tuple(v.shape), v.dtype) if j is None else j
            for j, v in zip(jacobians, variables)]


def squared_gradient_sums(per_example):
    """``sum_i g_i^2`` (elementwise) for each ``(B, *shape)`` tensor: VOGN's ``M * h_hat`` (eq. 9)."""
    return [tf.reduce_sum(tf.square(g), axis=0) for g in per_example]


def _example_rows(tensor):
    """``(B, *shape)`` as ``(B, prod(shape))``, the width static even when the batch size is not."""
    return tf.reshape(tensor, [-1, tensor.shape[1:].num_elements()])


def flatten(per_example):
    """Concatenate per-variable ``(B, *shape)`` gradients into one ``(B, D)`` matrix (rows g_i^T)."""
    return tf.concat([_example_rows(g) for g in per_example], axis=1)


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


class ExampleGradients:
    """The per-example gradients ``g_1 .. g_B`` of a flat vector of variables as the columns of a
    (D, B) matrix ``F = G^T`` (``G`` the rows of :func:`flatten`), with the products that SLANG's
    eigendecomposition (SLANG Alg. 1, lines 6-7; App. C.1) and NNG-full need.

    For a Dense layer on rank-2 inputs ``g_n = a_n Ds_n^T`` (homogeneous (p, q) weights), so with
    ``A`` (B, p) and ``Ds`` (B, q) its captured rows, ``X`` (p, q, m) and ``y`` (B, m)::

        F y       -> sum_n y_n a_n Ds_n^T = A^T [Ds (x) y]    cost B p q m
        F^T X     -> a_n^T X Ds_n         = rowsum((A X) Ds)  cost B p q m
        F^T F     = (A A^T) * (Ds Ds^T)                       cost B^2 (p + q)
        diag(F F^T) = (A^2)^T (Ds^2)                          cost B p q

    none of which forms the (B, p, q) per-example gradients (Goodfellow 2015 for the last two).
    Other layers (Conv2D, whose gradients are sums over positions, and layers without a fast path)
    contribute materialised ``(B, size)`` gradients.

    Args:
        layout: one ``(block, part)`` per variable, in the order of the flat vector; blocks come
            from :func:`layer_block` and :func:`variable_block` (a layer's block serves its kernel
            and its bias).
    """

    def __init__(self, layout):
        self._layout = list(layout)
        self._blocks = list({id(block): block for block, _ in self._layout}.values())
        self._sizes = [block.sizes[part] for block, part in self._layout]
        self.dimension = sum(self._sizes)
        self.dtype = self._blocks[0].dtype
        # B, the number of examples (a scalar tensor when the batch size is dynamic).
        self.num_columns = self._blocks[0].batch_size

    def matmul(self, y):
        """``F y`` for ``y`` of shape (B, m): the (D, m) sums ``sum_n y_n g_n``."""
        return self._in_layout({id(block): block.matmul(y) for block in self._blocks})

    def transpose_matmul(self, x):
        """``F^T x`` for ``x`` of shape (D, m): the (B, m) inner products ``g_n . x``."""
        pieces = {id(block): {} for block in self._blocks}
        for (block, part), piece in zip(self._layout, tf.split(x, self._sizes, axis=0)):
            pieces[id(block)][part] = piece
        return tf.add_n([block.transpose_matmul(pieces[id(block)]) for block in self._blocks])

    def gram(self):
        """``F^T F``: the (B, B) inner products ``g_n . g_k`` (over the parts in the layout only: a
        layer whose bias is point-estimated contributes its kernel)."""
        parts = {id(block): set() for block in self._blocks}
        for block, part in self._layout:
            parts[id(block)].add(part)
        return tf.add_n([block.gram(parts[id(block)]) for block in self._blocks])

    def squared_row_norms(self):
        """``diag(F F^T) = sum_n g_n^2`` (elementwise), shape (D,)."""
        return self._in_layout({id(block): block.squared_row_norms() for block in self._blocks})

    def to_dense(self):
        """``F`` itself, (D, B)."""
        return self._in_layout({id(block): block.columns() for block in self._blocks})

    def _in_layout(self, per_block):
        """Concatenate the blocks' per-part results (``id(block) -> {part: rows}``) in flat order."""
        return tf.concat([per_block[id(block)][part] for block, part in self._layout], axis=0)


class _OuterProductBlock:
    """A captured layer with one position: ``g_n = a_n Ds_n^T``, kept as its rows (B, p), (B, q)."""

    def __init__(self, spec, activations, gradients):
        self._a, self._ds = activations, gradients
        self._q = int(spec.weight_shape[1])
        self._has_bias = spec.has_bias
        self.sizes = {"kernel": int(spec.kernel.shape.num_elements())}
        if spec.has_bias:
            self.sizes["bias"] = self._q
        self.batch_size, self.dtype = _batch_size(activations), activations.dtype

    def _activations(self, part):
        """The columns of ``A`` that multiply the kernel's rows or the bias row."""
        if not self._has_bias:
            return self._a
        return self._a[:, :-1] if part == "kernel" else self._a[:, -1:]

    def matmul(self, y):
        weighted = tf.reshape(self._ds[:, :, None] * y[:, None, :], [self.batch_size, -1])
        return {part: tf.reshape(tf.matmul(self._activations(part), weighted, transpose_a=True),
                                 [size, -1])
                for part, size in self.sizes.items()}

    def transpose_matmul(self, pieces):
        products = tf.add_n([
            self._activations(part) @ tf.reshape(piece, [self._activations(part).shape[1], -1])
            for part, piece in pieces.items()])
        products = tf.reshape(products, [self.batch_size, self._q, -1])
        return tf.reduce_sum(products * self._ds[:, :, None], axis=1)

    def gram(self, parts):
        a = self._a if len(parts) == len(self.sizes) else self._activations(next(iter(parts)))
        return tf.matmul(a, a, transpose_b=True) * tf.matmul(self._ds, self._ds, transpose_b=True)

    def squared_row_norms(self):
        return {part: tf.reshape(squared_gradient_sums_from_rows(self._activations(part)[:, None],
                                                                 self._ds[:, None]), [-1])
                for part in self.sizes}

    def columns(self):
        return {part: tf.reshape(tf.einsum("bp,bq->pqb", self._activations(part), self._ds),
                                 [size, -1])
                for part, size in self.sizes.items()}


class _MaterialisedBlock:
    """Per-example gradients held as ``(B, size)`` rows, one matrix per part."""

    def __init__(self, rows):
        self._rows = rows
        self.sizes = {part: int(r.shape[1]) for part, r in rows.items()}
        first = next(iter(rows.values()))
        self.batch_size, self.dtype = _batch_size(first), first.dtype

    def matmul(self, y):
        return {part: tf.matmul(r, y, transpose_a=True) for part, r in self._rows.items()}

    def transpose_matmul(self, pieces):
        return tf.add_n([self._rows[part] @ piece for part, piece in pieces.items()])

    def gram(self, parts):
        return tf.add_n([tf.matmul(self._rows[part], self._rows[part], transpose_b=True)
                         for part in parts])

    def squared_row_norms(self):
        return {part: tf.reduce_sum(tf.square(r), axis=0) for part, r in self._rows.items()}

    def columns(self):
        return {part: tf.transpose(r) for part, r in self._rows.items()}


def _batch_size(tensor):
    return tensor.shape[0] if tensor.shape[0] is not None else tf.shape(tensor)[0]


def layer_block(spec, captured, dtype):
    """Fast path (SLANG App. C.1): the :class:`ExampleGradients` block of one captured Dense/Conv2D
    layer (parts "kernel" and "bias"), from its :class:`~tfnng.curvature.capture.CapturedLayer`
    (inputs and per-example pre-activation gradients): its rows when the layer has one position,
    else its per-example gradients ``DW_n`` (:func:`gradients_from_rows`), materialised."""
    a = tf.cast(_rows.activation_rows(spec, captured.inputs), dtype)
    ds = tf.cast(_rows.gradient_rows(spec, captured.preactivation_grads), dtype)
    if a.shape[1] == 1:
        return _OuterProductBlock(spec, a[:, 0], ds[:, 0])
    kernel, bias = _split_homogeneous(spec, gradients_from_rows(a, ds), [tf.shape(a)[0]])
    rows = {"kernel": kernel} if bias is None else {"kernel": kernel, "bias": bias}
    return _MaterialisedBlock({part: _example_rows(g) for part, g in rows.items()})


def variable_block(gradients, dtype):
    """The :class:`ExampleGradients` block (part None) of one variable's ``(B, *shape)`` gradients."""
    return _MaterialisedBlock({None: _example_rows(tf.cast(gradients, dtype))})
