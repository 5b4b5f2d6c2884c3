"""Per-example gradients: the generic path and the Dense/Conv2D row formulas against a Python loop."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfnng.curvature import per_example

B = 5
F64 = "float64"


class Wiggle(keras.layers.Layer):
    """A layer with no fast path: elementwise scale and shift inside a sine."""

    def build(self, input_shape):
        self.scale = self.add_weight(shape=input_shape[-1:], initializer="ones", dtype=F64)
        self.shift = self.add_weight(shape=(), initializer="zeros", dtype=F64)

    def call(self, x):
        return tf.sin(x * self.scale + self.shift)


def dense_model():
    return keras.Sequential([keras.Input((5,), dtype=F64), keras.layers.Dense(4, "tanh", dtype=F64),
                             keras.layers.Dense(2, dtype=F64)])


def conv_model():
    return keras.Sequential([keras.Input((6, 5, 2), dtype=F64),
                             keras.layers.Conv2D(3, (3, 2), strides=(2, 1), padding="same",
                                                 activation="tanh", dtype=F64),
                             keras.layers.Flatten(dtype=F64), keras.layers.Dense(2, dtype=F64)])


def layer_norm_model():
    return keras.Sequential([keras.Input((5,), dtype=F64), keras.layers.Dense(4, dtype=F64),
                             keras.layers.LayerNormalization(dtype=F64), Wiggle(dtype=F64),
                             keras.layers.Dense(2, dtype=F64)])


MODELS = {"dense": dense_model, "conv2d": conv_model, "layer_norm_and_custom": layer_norm_model}


def batch(model):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(B,) + tuple(model.input_shape[1:]))
    return tf.constant(x), tf.constant(rng.normal(size=(B, 2)))


def loop_gradients(model, x, y):
    rows = []
    for i in range(B):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(keras.losses.mean_squared_error(y[i:i + 1], model(x[i:i + 1])))
        rows.append([tf.convert_to_tensor(g).numpy()      # (an embedding's are IndexedSlices)
                     for g in tape.gradient(loss, model.trainable_variables)])
    return [np.stack(parts) for parts in zip(*rows)]


@pytest.mark.parametrize("method", per_example.METHODS)
@pytest.mark.parametrize("name", sorted(MODELS))
def test_generic_path_equals_a_loop_over_single_examples(name, method):
    keras.utils.set_random_seed(1)
    model = MODELS[name]()
    x, y = batch(model)
    got = per_example.per_example_gradients(model, keras.losses.mean_squared_error, x, y,
                                            method=method)
    expected = loop_gradients(model, x, y)
    assert len(got) == len(expected) == len(model.trainable_variables)
    for g, e, v in zip(got, expected, model.trainable_variables):
        assert tuple(g.shape) == (B,) + tuple(v.shape)
        np.testing.assert_allclose(g.numpy(), e, rtol=1e-10, atol=1e-12)
    sums = per_example.squared_gradient_sums(got)
    for s, e in zip(sums, expected):
        np.testing.assert_allclose(s.numpy(), np.sum(e ** 2, axis=0), rtol=1e-10, atol=1e-12)
    flat = per_example.flatten(got).numpy()
    np.testing.assert_allclose(flat, np.concatenate([e.reshape(B, -1) for e in expected], axis=1))


@pytest.mark.parametrize("method", per_example.METHODS)
def test_a_variable_the_loss_does_not_reach_gets_zero_gradients(method):
    """vectorized_map asked TensorFlow for zeros of unconnected Keras variables, which failed
    ("'str' object has no attribute '_type_enum'") for a BayesianModel subclass's own variable."""
    model = dense_model()
    x, y = batch(model)
    unused = keras.Variable(np.ones((2, 3)), dtype=F64, name="unused")
    got = per_example.per_example_gradients(model, keras.losses.mean_squared_error, x, y,
                                            variables=[model.trainable_variables[0], unused],
                                            method=method)
    np.testing.assert_allclose(got[0].numpy(), loop_gradients(model, x, y)[0], rtol=1e-10)
    assert got[1].dtype == tf.float64
    np.testing.assert_array_equal(got[1].numpy(), np.zeros((B, 2, 3)))


def test_auto_falls_back_to_the_jacobian_when_vectorized_map_fails(monkeypatch):
    keras.utils.set_random_seed(2)
    model = dense_model()
    x, y = batch(model)

    def unsupported(*args, **kwargs):
        raise ValueError("no pfor converter")

    monkeypatch.setattr(tf, "vectorized_map", unsupported)
    got = per_example.per_example_gradients(model, keras.losses.mean_squared_error, x, y)
    for g, e in zip(got, loop_gradients(model, x, y)):
        np.testing.assert_allclose(g.numpy(), e, rtol=1e-10, atol=1e-12)
    with pytest.raises(ValueError, match="pfor"):
        per_example.per_example_gradients(model, keras.losses.mean_squared_error, x, y,
                                          method="vectorized_map")
    with pytest.raises(ValueError, match="method"):
        per_example.per_example_gradients(model, keras.losses.mean_squared_error, x, y,
                                          method="loop")


def test_the_jacobian_method_needs_per_example_losses():
    """A summed loss reached the Jacobian's reshape: "slice index 0 of dimension 0 out of bounds"."""
    model = dense_model()
    x, y = batch(model)
    summed = keras.losses.MeanSquaredError(reduction="sum", dtype=F64)
    with pytest.raises(ValueError, match="needs the loss of each example.*one scalar"):
        per_example.per_example_gradients(model, summed, x, y, method="jacobian")
    # "auto" takes the Jacobian for a grouped convolution: the message says so (it named
    # method='jacobian', which the caller had not chosen).
    grouped = grouped_conv_model()
    gx, gy = batch(grouped)
    with pytest.raises(ValueError, match=r"method='auto' takes the Jacobian for a model with "
                                         r"a recurrent layer, a grouped convolution.*"
                                         r"reduction='none'"):
        per_example.per_example_gradients(grouped, summed, gx, gy)
    for g, e in zip(per_example.per_example_gradients(model, summed, x, y, method="vectorized_map"),
                    loop_gradients(model, x, y)):
        np.testing.assert_allclose(g.numpy(), e, rtol=1e-10, atol=1e-12)


def grouped_conv_model():
    return keras.Sequential([keras.Input((6, 5, 4), dtype=F64),
                             keras.layers.Conv2D(4, 3, groups=2, activation="tanh", dtype=F64),
                             keras.layers.Flatten(dtype=F64), keras.layers.Dense(2, dtype=F64)])


def test_auto_takes_the_jacobian_where_vectorized_passes_fail_when_they_run():
    """A grouped convolution's and a TextVectorization's pfor-converted passes convert, then fail
    when they run (inside fit: an opaque InvalidArgumentError); "auto" takes the Jacobian."""
    keras.utils.set_random_seed(6)
    model = grouped_conv_model()
    x, y = batch(model)
    compute = tf.function(lambda x, y: per_example.per_example_gradients(
        model, keras.losses.mean_squared_error, x, y))
    for g, e in zip(compute(x, y), loop_gradients(model, x, y)):
        np.testing.assert_allclose(g.numpy(), e, rtol=1e-10, atol=1e-12)
    vectorizer = keras.layers.TextVectorization(max_tokens=20)
    vectorizer.adapt(["a b c", "b c d e", "e f"])
    text = keras.Sequential([vectorizer, keras.layers.Embedding(20, 3, dtype=F64),
                             keras.layers.GlobalAveragePooling1D(dtype=F64),
                             keras.layers.Dense(2, dtype=F64)])
    sentences = tf.constant(["a b", "c d e f", "b", "a c e", "f e d c b"])
    text(sentences)
    compute = tf.function(lambda x, y, method: per_example.per_example_gradients(
        text, keras.losses.mean_squared_error, x, y, method=method))
    # (Not a loop over single sentences: the batch pads each to the longest.)
    for g, e in zip(compute(sentences, y, "auto"), compute(sentences, y, "jacobian")):
        np.testing.assert_array_equal(g.numpy(), e.numpy())


def test_auto_takes_the_jacobian_for_einsum_dense_layers():
    """The vectorised gradient of a Keras EinsumDense (also inside MultiHeadAttention) aborts the
    process in float32 (TensorFlow's oneDNN kernels; VOGN, SLANG and NNG-full on an attention
    model killed Python): "auto" takes the Jacobian, which gives the loop's gradients."""
    keras.utils.set_random_seed(7)
    inputs = keras.Input((4, 3), dtype=F64)
    attended = keras.layers.MultiHeadAttention(2, 2, dtype=F64)(inputs, inputs)
    model = keras.Model(inputs, keras.layers.Dense(2, dtype=F64)(
        keras.layers.Flatten(dtype=F64)(attended)))
    x, y = batch(model)
    summed = keras.losses.MeanSquaredError(reduction="sum", dtype=F64)
    with pytest.raises(ValueError, match=r"method='auto' takes the Jacobian for a model with .*"
                                         r"an EinsumDense"):
        per_example.per_example_gradients(model, summed, x, y)
    for g, e in zip(per_example.per_example_gradients(model, keras.losses.mean_squared_error, x, y),
                    loop_gradients(model, x, y)):
        np.testing.assert_allclose(g.numpy(), e, rtol=1e-10, atol=1e-12)


def rows_and_reference(layer, x):
    """Homogeneous input rows, pre-activation gradient rows and loop per-example (kernel, bias)
    gradients for ``loss_n = sum(sin(layer(x_n)))`` (``layer`` linear, so its output is ``s``)."""
    x = tf.constant(x)
    with tf.GradientTape() as tape:
        s = layer(x)
        tape.watch(s)
        loss = tf.reduce_sum(tf.sin(s))
    ds = tape.gradient(loss, s)                                     # row n = d loss_n / d s_n
    if isinstance(layer, keras.layers.Conv2D):
        kh, kw = layer.kernel_size
        patches = tf.image.extract_patches(
            x, sizes=[1, kh, kw, 1], strides=[1, *layer.strides, 1],
            rates=[1, *layer.dilation_rate, 1], padding=layer.padding.upper())
        a = tf.reshape(patches, [B, -1, kh * kw * x.shape[-1]])
    else:
        a = tf.reshape(x, [B, -1, x.shape[-1]])
    a = tf.concat([a, tf.ones_like(a[..., :1])], axis=-1)
    ds = tf.reshape(ds, [B, -1, ds.shape[-1]])
    reference = []
    for i in range(B):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.sin(layer(x[i:i + 1])))
        kernel, bias = tape.gradient(loss, [layer.kernel, layer.bias])
        reference.append(np.concatenate([kernel.numpy().reshape(-1, kernel.shape[-1]),
                                         bias.numpy()[None]], axis=0))
    return a, ds, np.stack(reference)


LAYERS = {
    "dense": (lambda: keras.layers.Dense(3, dtype=F64), (B, 4)),
    "dense_sequence": (lambda: keras.layers.Dense(3, dtype=F64), (B, 7, 4)),
    "conv2d_strided": (lambda: keras.layers.Conv2D(3, (3, 2), strides=(2, 1), padding="same",
                                                   dtype=F64), (B, 6, 5, 2)),
    "conv2d_dilated": (lambda: keras.layers.Conv2D(2, 2, dilation_rate=2, padding="valid",
                                                   dtype=F64), (B, 6, 6, 3)),
}


@pytest.mark.parametrize("name", sorted(LAYERS))
def test_row_formulas_equal_a_loop_for_dense_and_conv2d(name):
    keras.utils.set_random_seed(3)
    build, shape = LAYERS[name]
    layer = build()
    a, ds, reference = rows_and_reference(layer, np.random.default_rng(4).normal(size=shape))
    np.testing.assert_allclose(per_example.gradients_from_rows(a, ds).numpy(), reference,
                               rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(per_example.squared_gradient_sums_from_rows(a, ds).numpy(),
                               np.sum(reference ** 2, axis=0), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("method", ["vectorized_map", "jacobian"])
def test_generic_path_inside_tf_function(method):
    keras.utils.set_random_seed(5)
    model = conv_model()
    x, y = batch(model)
    compute = tf.function(lambda x, y: per_example.per_example_gradients(
        model, keras.losses.mean_squared_error, x, y, method=method))
    for g, e in zip(compute(x, y), loop_gradients(model, x, y)):
        np.testing.assert_allclose(g.numpy(), e, rtol=1e-10, atol=1e-12)
