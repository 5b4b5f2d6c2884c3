"""The layer registry and the zero-tensor capture: what is supported, what falls back, no leftovers."""

import numpy as np
import pytest
import tensorflow as tf
import keras

from tfnng.curvature import capture as cap


def test_registry_supports_dense_and_conv2d_and_lists_other_weighted_layers():
    inputs = keras.Input((8, 8, 3))
    h = keras.layers.Conv2D(4, 3, padding="same", activation="relu", name="c")(inputs)
    h = keras.layers.BatchNormalization(name="bn")(h)
    h = keras.layers.Conv2D(4, 3, groups=2, name="grouped")(h)      # groups != 1: fallback
    h = keras.layers.MaxPooling2D()(h)
    h = keras.layers.Flatten()(h)
    h = keras.layers.Dense(5, use_bias=False, name="d")(h)
    frozen = keras.layers.Dense(3, name="frozen")
    frozen.trainable = False
    out = frozen(h)
    net = keras.Model(inputs, out)
    specs, fallback = cap.find_layers(net)
    assert [(s.layer.name, s.kind) for s in specs] == [("c", "conv2d"), ("d", "dense")]
    assert specs[0].weight_shape == (3 * 3 * 3 + 1, 4) and specs[1].weight_shape == (36, 5)
    assert sorted(layer.name for layer in fallback) == ["bn", "grouped"]


def test_nested_models_and_subclasses_with_their_own_call():
    class MyDense(keras.layers.Dense):
        def call(self, inputs):
            return super().call(inputs) * 2.0

    inner = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, name="inner_dense")])
    inputs = keras.Input((4,))
    out = MyDense(2, name="custom")(inner(inputs))
    specs, fallback = cap.find_layers(keras.Model(inputs, out))
    assert [s.layer.name for s in specs] == ["inner_dense"]
    assert [layer.name for layer in fallback] == ["custom"]


class StandardizedConv2D(keras.layers.Conv2D):
    """keras-io's weight-standardised convolution: it convolves with another weight than its kernel."""

    def convolution_op(self, inputs, kernel):
        mean, variance = tf.nn.moments(kernel, axes=[0, 1, 2], keepdims=True)
        return super().convolution_op(inputs, (kernel - mean) / tf.sqrt(variance + 1e-10))


def test_a_conv2d_with_its_own_convolution_op_falls_back():
    """It was captured as a plain Conv2D: VOGN's curvature for its kernel was 96% off."""
    inputs = keras.Input((5, 5, 2))
    out = StandardizedConv2D(3, 3, name="standardized")(keras.layers.Conv2D(2, 3, name="plain")(inputs))
    specs, fallback = cap.find_layers(keras.Model(inputs, out))
    assert [s.layer.name for s in specs] == ["plain"]
    assert [layer.name for layer in fallback] == ["standardized"]


def test_recording_captures_inputs_and_preactivation_gradients_then_restores_the_layers():
    keras.utils.set_random_seed(0)
    dense = keras.layers.Dense(3, activation="tanh")
    net = keras.Sequential([keras.Input((2,)), dense])
    capture = cap.LayerCapture(net)
    before = dict(dense.__dict__)
    x = tf.constant(np.random.default_rng(0).normal(size=(5, 2)), tf.float32)
    with tf.GradientTape() as tape:
        with capture.recording(tape):
            y = net(x)
        loss = tf.reduce_sum(y ** 2)
    record = capture.captured()[capture.specs[0].name]
    grad = tape.gradient(loss, record.zero)
    s = x @ dense.kernel + dense.bias
    np.testing.assert_allclose(record.inputs.numpy(), x.numpy())
    np.testing.assert_allclose(grad.numpy(), (2 * np.tanh(s) * (1 - np.tanh(s) ** 2)), rtol=1e-5)
    np.testing.assert_allclose(y.numpy(), np.tanh(s), rtol=1e-6)
    assert "call" not in dense.__dict__ and dense.__dict__["activation"] is before["activation"]
    np.testing.assert_allclose(net(x).numpy(), y.numpy())        # outside the context: untouched


def test_recording_restores_layers_after_an_error_and_rejects_shared_layers():
    shared = keras.layers.Dense(2)
    inputs = keras.Input((2,))
    net = keras.Model(inputs, shared(shared(inputs)))
    capture = cap.LayerCapture(net)
    with pytest.raises(ValueError, match="more than once"):
        with tf.GradientTape() as tape, capture.recording(tape):
            net(tf.ones((1, 2)))
    assert "call" not in shared.__dict__
    np.testing.assert_allclose(net(tf.ones((1, 2))).shape, (1, 2))


class IteratedDense(keras.Model):
    """A Dense layer applied in a symbolic loop: its tensors live in the loop's graph."""

    def __init__(self):
        super().__init__()
        self.step = keras.layers.Dense(2, activation="tanh")

    def call(self, x):
        return keras.ops.fori_loop(0, 3, lambda i, h: self.step(h), x)


def test_a_layer_in_a_symbolic_loop_is_refused_by_name():
    """It failed with TensorFlow's "out of scope" error about a while-loop placeholder."""
    net = IteratedDense()
    net(tf.ones((1, 2)))
    capture = cap.LayerCapture(net)

    @tf.function
    def record(x):
        with tf.GradientTape() as tape, capture.recording(tape):
            return net(x)

    with pytest.raises(ValueError, match="'.*dense.*' is called inside a symbolic loop"):
        record(tf.ones((1, 2)))


def test_find_links_names_the_layers_each_layer_reads_directly():
    """inputs_from: the supported layers whose output reaches a layer's input without passing
    another supported layer: through activations and merges, including a skip connection."""
    inputs = keras.Input((3,))
    h0 = keras.layers.Dense(4, activation="tanh", name="d0")(inputs)
    h1 = keras.layers.Dense(4, activation="relu", name="d1")(h0)
    h2 = keras.layers.Dense(2, name="d2")(keras.layers.Add()([h0, h1]))
    net = keras.Model(inputs, keras.layers.Dense(1, name="d3")(keras.layers.Activation("tanh")(h2)))
    capture = cap.LayerCapture(net)
    capture.find_links(tf.zeros((1, 3)))
    assert {spec.layer.name: spec.inputs_from for spec in capture.specs} == {
        "d0": (), "d1": ("d0",), "d2": ("d0", "d1"), "d3": ("d2",)}


def test_two_models_sharing_a_layer_record_side_by_side_in_two_threads():
    """Overlapping recordings of two captures (two models sharing a Dense) in two threads: each
    thread gets its own inputs and pre-activation gradients, and the layer is left untouched
    (the first capture to finish used to remove the other's wrapper: "Layers ['shared'] were not
    called", and a stale wrapper stayed on the layer)."""
    import threading

    keras.utils.set_random_seed(0)
    shared = keras.layers.Dense(3, activation="tanh", name="shared")
    before = dict(shared.__dict__)
    first_in, second_in = keras.Input((2,)), keras.Input((2,))
    nets = [keras.Model(first_in, shared(first_in)),
            keras.Model(second_in, keras.layers.Dense(1, name="head")(shared(second_in)))]
    captures = [cap.LayerCapture(net) for net in nets]
    inputs = [tf.constant([[1.0, 2.0], [0.5, -1.0]]), tf.constant([[-1.0, 0.0], [3.0, 1.0]])]
    barrier, results = threading.Barrier(2, timeout=60), {}

    def record(i):
        with tf.GradientTape() as tape:
            with captures[i].recording(tape):
                barrier.wait()                   # both recordings are open
                if i == 1:
                    barrier.wait()               # the first one has ended
                y = nets[i](inputs[i])
                loss = tf.reduce_sum(y ** 2)
            records = captures[i].captured()
        if i == 0:
            barrier.wait()
        results[i] = (records["shared"].inputs, tape.gradient(loss, records["shared"].zero))

    threads = [threading.Thread(target=record, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    kernel, bias = shared.kernel.numpy(), shared.bias.numpy()
    head = nets[1].get_layer("head")
    for i, x in enumerate(inputs):
        recorded, grad = results[i]
        np.testing.assert_allclose(recorded.numpy(), x.numpy())
        h = np.tanh(x.numpy() @ kernel + bias)
        d_out = 2 * h if i == 0 else 2 * (h @ head.kernel.numpy() + head.bias.numpy()) @ head.kernel.numpy().T
        np.testing.assert_allclose(grad.numpy(), d_out * (1 - h ** 2), rtol=1e-5, atol=1e-7)
    assert "call" not in shared.__dict__ and shared.__dict__["activation"] is before["activation"]


def test_a_dense_with_a_frozen_bias_and_a_trainable_kernel_falls_back():
    """A Dense whose bias alone is frozen is not Kronecker-captured (its [W; b] holds a bias nobody trains)."""
    net = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4, activation="tanh", name="part"),
                            keras.layers.Dense(2, name="full")])
    net.get_layer("part").bias.trainable = False
    specs, fallback = cap.find_layers(net)
    assert [s.layer.name for s in specs] == ["full"]
    assert [layer.name for layer in fallback] == ["part"]


def test_a_nested_recording_of_a_second_model_sharing_a_layer_restores_the_outer_one():
    """Recording model 2 inside model 1's recording (one thread) leaves model 1 capturing the shared layer."""
    keras.utils.set_random_seed(0)
    shared = keras.layers.Dense(3, activation="tanh", name="shared")
    outer = keras.Sequential([keras.Input((2,)), shared, keras.layers.Dense(1, name="head")])
    inner = keras.Sequential([keras.Input((2,)), shared])
    captures = [cap.LayerCapture(outer), cap.LayerCapture(inner)]
    x = tf.constant([[1.0, 2.0], [0.5, -1.0]])
    with tf.GradientTape() as tape:
        with captures[0].recording(tape):
            with captures[1].recording(tape):
                inner(-x)
            loss = tf.reduce_sum(outer(x))
        record = captures[0].captured()[captures[0].specs[0].name]
    np.testing.assert_allclose(record.inputs.numpy(), x.numpy())
    h = np.tanh(x.numpy() @ shared.kernel.numpy() + shared.bias.numpy())
    head = outer.get_layer("head").kernel.numpy()[:, 0]
    np.testing.assert_allclose(tape.gradient(loss, record.zero).numpy(), head * (1 - h ** 2), rtol=1e-5)
    assert "call" not in shared.__dict__
