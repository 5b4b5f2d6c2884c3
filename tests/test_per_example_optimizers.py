"""VOGN, SLANG and NNG-full: per-example gradients from the model, NumPy references of the paper
updates, and the exact Bayesian-linear-regression fixed points.

Bayesian linear regression with known noise s2 and prior N(0, eta I) has the exact posterior
N(mu*, Lambda^-1), Lambda = X^T X / s2 + I / eta; its optimal mean-field Gaussian is N(mu*, diag(Lambda)^-1)
(docs/math.md). The design below has correlated columns, so the two differ.
"""

import json
import logging

import keras
import numpy as np
import pytest
import tensorflow as tf
from scipy import stats

import tfnng
from tfnng.curvature.capture import LayerCapture
from tfnng.models import gradients_and_curvature
from tfnng.posteriors import low_rank as low_rank_posteriors

F64 = "float64"
N, D, NOISE_VAR, ETA = 100, 3, 0.5, 2.0
GAMMA_IN = 1.0 / (N * ETA)


def regression_data(seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(N, D)) @ np.array([[1.0, 0.8, 0.0], [0.0, 0.6, 0.5], [0.0, 0.0, 0.7]])
    y = x @ np.array([0.5, -1.0, 2.0]) + np.sqrt(NOISE_VAR) * rng.normal(size=N)
    precision = x.T @ x / NOISE_VAR + np.eye(D) / ETA
    return x, y[:, None], np.linalg.solve(precision, x.T @ y / NOISE_VAR), precision


def linear_net():
    return keras.Sequential([keras.Input((D,), dtype=F64),
                             keras.layers.Dense(1, use_bias=False, kernel_initializer="zeros",
                                                dtype=F64)])


def make_step(net, optimizer, loss, seed=0, compiled=True, input_signature=None):
    """A hand-written training step (the tape-loop form of BayesianModel.train_step)."""
    capture = LayerCapture(net)
    optimizer.prepare_curvature(capture.specs)
    optimizer.build(net.trainable_variables)
    generator = keras.random.SeedGenerator(seed)

    def step(x, y):
        _, _, grads, curvature = gradients_and_curvature(net, capture, optimizer, loss, x, y,
                                                         seed=generator)
        optimizer.apply_gradients(zip(grads, net.trainable_variables), curvature=curvature)

    return tf.function(step, input_signature=input_signature) if compiled else step


# ------------------------------------------------------------------ per-example gradients, both paths
class Wiggle(keras.layers.Layer):
    """A layer with no fast path."""

    def build(self, input_shape):
        self.scale = self.add_weight(shape=input_shape[-1:], initializer="ones", dtype=F64)

    def call(self, x):
        return tf.sin(x * self.scale)


def mixed_net():
    return keras.Sequential([
        keras.Input((6, 5, 2), dtype=F64),
        keras.layers.Conv2D(3, 3, padding="same", activation="tanh", dtype=F64),
        keras.layers.Flatten(dtype=F64), keras.layers.LayerNormalization(dtype=F64),
        Wiggle(dtype=F64), keras.layers.Dense(2, dtype=F64)])


def loop_gradients(net, loss, x, y, variable):
    """grad_variable log p(y_n | x_n) for each example n, one example at a time."""
    gradients = []
    for n in range(len(x)):
        with tf.GradientTape() as tape:
            ll = tf.reduce_sum(loss.log_prob(y[n:n + 1], net(x[n:n + 1], training=False)))
        gradients.append(tape.gradient(ll, variable).numpy())
    return gradients


def vogn_after_one_batch(net, loss, x, y, sample_weight=None, fisher="empirical"):
    """A VOGN built for ``net`` that has received the curvature of one batch."""
    optimizer = tfnng.optimizers.VOGN(1e-3, num_examples=10, fisher=fisher)
    capture = LayerCapture(net)
    optimizer.prepare_curvature(capture.specs)
    optimizer.build(net.trainable_variables)
    _, _, _, curvature = gradients_and_curvature(net, capture, optimizer, loss, x, y, sample_weight,
                                                 seed=keras.random.SeedGenerator(0))
    optimizer.receive_curvature(curvature)
    return optimizer


def assert_squared_gradient_means_match_the_loop(optimizer, net, loss, x, y):
    for i, variable in enumerate(net.trainable_variables):
        np.testing.assert_allclose(optimizer._squared_gradient_mean(i).numpy(),
                                   np.mean(np.square(loop_gradients(net, loss, x, y, variable)), 0),
                                   rtol=1e-9, atol=1e-12)


def test_per_example_gradients_select_fast_and_generic_paths_automatically():
    """Every variable's per-example gradient, as the optimizer sees it, equals a loop over examples
    of grad log p(y_i | x_i) — Conv2D/Dense by the fast path, LayerNormalization and a custom layer by
    the generic one — and the fast path is used exactly for the captured layers. The products of
    the gradient operator (Dense rows never formed) equal those of the dense (D, B) matrix."""
    net = mixed_net()
    loss = tfnng.losses.GaussianNLL(noise_variance=0.3, dtype=F64)
    rng = np.random.default_rng(1)
    x, y = tf.constant(rng.normal(size=(4, 6, 5, 2))), tf.constant(rng.normal(size=(4, 2)))
    optimizer = vogn_after_one_batch(net, loss, x, y)
    fast = {i for i in range(len(net.trainable_variables)) if i in optimizer._fast_sources}
    kinds = (keras.layers.Conv2D, keras.layers.Dense)
    expected_fast = {id(v) for layer in net.layers if isinstance(layer, kinds)
                     for v in layer.trainable_variables}
    assert {id(net.trainable_variables[i]) for i in fast} == expected_fast
    rows = []
    for i, variable in enumerate(net.trainable_variables):
        expected = loop_gradients(net, loss, x, y, variable)
        np.testing.assert_allclose(optimizer._squared_gradient_mean(i).numpy(),
                                   np.mean(np.square(expected), axis=0), rtol=1e-9, atol=1e-12)
        rows.append(np.reshape(expected, (4, -1)))
    # A flat order unlike the model's: each layer's kernel and bias apart, the Dense bias first.
    order = [6, 0, 4, 5, 2, 1, 3]
    assert sorted(order) == list(range(len(net.trainable_variables)))
    dense = np.concatenate([rows[i] for i in order], axis=1).T                      # (D, B)
    columns = optimizer._example_gradient_columns(order, F64)
    assert (columns.dimension, columns.num_columns) == dense.shape
    np.testing.assert_allclose(columns.to_dense().numpy(), dense, rtol=1e-9, atol=1e-12)
    y_probe, x_probe = rng.normal(size=(4, 3)), rng.normal(size=(dense.shape[0], 2))
    np.testing.assert_allclose(columns.matmul(tf.constant(y_probe)).numpy(), dense @ y_probe,
                               rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(columns.transpose_matmul(tf.constant(x_probe)).numpy(),
                               dense.T @ x_probe, rtol=1e-9)
    np.testing.assert_allclose(columns.gram().numpy(), dense.T @ dense, rtol=1e-9)
    np.testing.assert_allclose(columns.squared_row_norms().numpy(), np.sum(dense ** 2, axis=1),
                               rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("conv", [False, True])
@pytest.mark.parametrize("point", [None, "kernel", "bias"])
def test_gram_covers_only_the_bayesian_parts_of_a_layer(conv, point):
    """``gram()`` (what SLANG's exact eigendecomposition factors) equals ``F^T F`` of ``to_dense()``
    when part of a Dense/Conv2D layer is point-estimated (it used to include that part: off by 14%
    of max|F^T F| for a point-estimated Dense bias, more than 100% for its kernel)."""
    rng = np.random.default_rng(0)
    init = keras.initializers.RandomNormal(stddev=0.7, seed=1)
    shape = (4, 4, 1) if conv else (3,)
    layer = (keras.layers.Conv2D(2, 3, dtype=F64, kernel_initializer=init, bias_initializer=init)
             if conv else keras.layers.Dense(2, dtype=F64, kernel_initializer=init,
                                             bias_initializer=init))
    net = keras.Sequential([keras.Input(shape, dtype=F64), layer, keras.layers.Flatten(dtype=F64)])
    if point is not None:
        tfnng.mark_point_estimate(getattr(layer, point))
    optimizer = tfnng.optimizers.SLANG(0.1, num_examples=20, rank=1, fisher="empirical")
    capture = LayerCapture(net)
    optimizer.prepare_curvature(capture.specs)
    optimizer.build(net.trainable_variables)
    x = tf.constant(rng.normal(size=(5,) + shape))
    y = tf.constant(rng.normal(size=(5, net.output_shape[-1])))
    _, _, _, curvature = gradients_and_curvature(
        net, capture, optimizer, tfnng.losses.GaussianNLL(noise_variance=0.5, dtype=F64), x, y)
    optimizer.receive_curvature(curvature)
    columns = optimizer._example_gradient_columns(optimizer._flat_indices, tf.float64)
    dense = columns.to_dense().numpy()
    sizes = {None: 0, "kernel": layer.kernel.shape.num_elements(), "bias": 2}
    assert dense.shape == (sum(v.shape.num_elements() for v in net.trainable_variables)
                           - sizes[point], 5)
    np.testing.assert_allclose(columns.gram().numpy(), dense.T @ dense, rtol=1e-12, atol=1e-12)


def test_sample_weights_weigh_each_examples_curvature_on_both_paths():
    """With Keras's sample_weight the log-likelihood is sum_n w_n log p(y_n | x_n): every variable's
    squared per-example gradient mean is (1/B) sum_n w_n g_n^2, on the fast path (Conv2D, Dense) and
    the generic one (LayerNormalization, a custom layer) alike. The fast path used to carry w_n^2
    (the weighted loss's gradients, squared) and the generic path and the true Fisher no weight."""
    net = mixed_net()
    loss = tfnng.losses.GaussianNLL(noise_variance=0.3, dtype=F64)
    rng = np.random.default_rng(4)
    x, y = tf.constant(rng.normal(size=(4, 6, 5, 2))), tf.constant(rng.normal(size=(4, 2)))
    weights = np.array([0.0, 1.0, 2.5, 0.5])
    optimizer = vogn_after_one_batch(net, loss, x, y, tf.constant(weights))
    for i, variable in enumerate(net.trainable_variables):
        squares = np.square(loop_gradients(net, loss, x, y, variable))
        np.testing.assert_allclose(optimizer._squared_gradient_mean(i).numpy(),
                                   np.tensordot(weights, squares, axes=1) / len(weights),
                                   rtol=1e-9, atol=1e-12)
    # True Fisher (same sampled targets for the same seed): a constant weight c multiplies it by c.
    unweighted = vogn_after_one_batch(net, loss, x, y, fisher="true")
    weighted = vogn_after_one_batch(net, loss, x, y, tf.fill([4], tf.constant(4.0, F64)), "true")
    for i in range(len(net.trainable_variables)):
        np.testing.assert_allclose(weighted._squared_gradient_mean(i).numpy(),
                                   4.0 * unweighted._squared_gradient_mean(i).numpy(), rtol=1e-9)
    with pytest.raises(ValueError, match="one weight per example"):
        vogn_after_one_batch(net, loss, x, y, tf.ones((4, 2), F64))
    with pytest.raises(tf.errors.InvalidArgumentError, match="non-negative"):
        vogn_after_one_batch(net, loss, x, y, tf.constant([1.0, -1.0, 1.0, 1.0], F64))


def test_losses_not_averaged_over_the_batch_are_refused():
    """The optimizers scale the mean loss by N. A summed loss used to be accepted (its empirical
    statistics rescaled): the mean step then saw B times the gradient, and noisy K-FAC's posterior
    mean on Bayesian linear regression settled on a prior B times too weak."""
    net = mixed_net()
    rng = np.random.default_rng(5)
    x, y = tf.constant(rng.normal(size=(4, 6, 5, 2))), tf.constant(rng.normal(size=(4, 2)))
    for reduction in ("sum", None):
        with pytest.raises(ValueError, match=f"averaged over the batch.*reduction={reduction!r}"):
            vogn_after_one_batch(net, tfnng.losses.GaussianNLL(0.3, reduction=reduction, dtype=F64), x, y)
    for optimizer in (tfnng.optimizers.NoisyAdam(num_examples=8), tfnng.optimizers.NoisyKFAC(num_examples=8)):
        model = tfnng.BayesianModel(keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)]))
        with pytest.raises(ValueError, match="averaged over the batch"):
            model.compile(optimizer=optimizer, loss=tfnng.losses.GaussianNLL(1.0, reduction="sum"))
        with pytest.raises(ValueError, match="averaged over the batch"):     # one loss per output
            model.compile(optimizer=optimizer, loss=[keras.losses.MeanSquaredError(reduction="sum")])
    model = tfnng.BayesianModel(keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)]))
    model.compile(optimizer=keras.optimizers.Adam(), loss=keras.losses.MeanSquaredError(reduction="sum"))
    # ignore_class averages over the kept labels: the empirical curvature was B/kept too large.
    ignoring = keras.losses.SparseCategoricalCrossentropy(from_logits=True, ignore_class=-1)
    with pytest.raises(ValueError, match=r"ignore_class=-1\) averages over the examples it keeps"):
        vogn_after_one_batch(keras.Sequential([keras.Input((2,), dtype=F64),
                                               keras.layers.Dense(3, dtype=F64)]),
                             ignoring, x[:, 0, 0], tf.constant([0, -1, 2, 1]))


def test_time_distributed_and_recurrent_layers_fall_back_and_train():
    """A Dense inside TimeDistributed (or an RNN cell) is called once per time step: it used to be
    captured and then fail fit as a 'shared layer'; it now takes the generic path."""
    inputs = keras.Input((3, 2))
    hidden = keras.layers.TimeDistributed(keras.layers.Dense(4, activation="tanh"))(inputs)
    hidden = keras.layers.SimpleRNN(3)(hidden)
    net = keras.Model(inputs, keras.layers.Dense(1)(hidden))
    capture = LayerCapture(net)
    assert [type(spec.layer).__name__ for spec in capture.specs] == ["Dense"]     # the last one
    assert {type(layer).__name__ for layer in capture.fallback_layers} == {"Dense", "SimpleRNNCell"}
    x = np.random.default_rng(6).normal(size=(16, 3, 2)).astype("float32")
    y = x.sum(axis=(1, 2))[:, None]
    # The generic path takes the jacobian for a recurrent model: pfor's conversion of this one
    # traced, then failed when it ran.
    for optimizer in (tfnng.optimizers.VOGN(1e-2, num_examples=16),
                      tfnng.optimizers.NoisyKFAC(num_examples=16)):
        model = tfnng.BayesianModel(net)
        model.compile(optimizer=optimizer, loss=tfnng.losses.GaussianNLL(0.5))
        history = model.fit(x, y, batch_size=8, epochs=1, verbose=0).history
        assert np.isfinite(history["loss"]).all() and optimizer.skipped_updates == 0


def test_a_stateful_recurrent_layer_is_refused_by_the_generic_path():
    """The generic path runs the net a second time: a stateful LSTM's state advanced twice per
    step, silently, and its per-example gradients were taken from the advanced state."""
    batch = 4
    x = np.random.default_rng(7).normal(size=(batch, 3, 2)).astype("float32")
    inputs = keras.Input(batch_shape=(batch, 3, 2))
    lstm = keras.layers.LSTM(3, stateful=True, name="stateful_lstm")
    model = tfnng.BayesianModel(keras.Model(inputs, keras.layers.Dense(1)(lstm(inputs))))
    model.compile(optimizer=tfnng.optimizers.VOGN(1e-2, num_examples=16),
                  loss=tfnng.losses.GaussianNLL())
    with pytest.raises(ValueError, match=r"Stateful layers \(stateful_lstm\) cannot take the generic"):
        model.train_on_batch(x, x.sum(axis=(1, 2))[:, None])


class LayerNamedLikeAWeight(keras.layers.Layer):
    """Holds a weight named "proj" and a Dense sub-layer named "proj": layer path == variable path."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(3, name="proj")

    def build(self, input_shape):
        self.scale = self.add_weight(shape=(input_shape[-1],), initializer="ones", name="proj")
        self.dense.build(input_shape)

    def call(self, x):
        return self.dense(x * self.scale)


def test_a_layer_path_equal_to_a_variable_path_keeps_both_records():
    """The generic record of the variable "blk/proj" used to replace the record of the Dense layer
    "blk/proj" (AttributeError in VOGN and SLANG)."""
    inputs = keras.Input((2,))
    net = keras.Model(inputs, keras.layers.Dense(1)(LayerNamedLikeAWeight(name="blk")(inputs)))
    assert "blk/proj" in [spec.name for spec in LayerCapture(net).specs]
    assert "blk/proj" in [v.path for v in net.trainable_variables]
    x = np.random.default_rng(7).normal(size=(8, 2)).astype("float32")
    for optimizer in (tfnng.optimizers.VOGN(1e-2, num_examples=8),
                      tfnng.optimizers.SLANG(1e-2, num_examples=8, rank=2)):
        model = tfnng.BayesianModel(net)
        model.compile(optimizer=optimizer, loss=tfnng.losses.GaussianNLL(0.5))
        assert np.isfinite(model.fit(x, x[:, :1], batch_size=4, verbose=0).history["loss"]).all()


def test_multi_output_models_need_the_empirical_fisher_and_say_so():
    inputs = keras.Input((2,))
    hidden = keras.layers.Dense(3, activation="tanh")(inputs)
    net = keras.Model(inputs, [keras.layers.Dense(2)(hidden), keras.layers.Dense(1)(hidden)])
    x = np.random.default_rng(8).normal(size=(8, 2)).astype("float32")
    targets = [(x[:, 0] > 0).astype("int32"), x[:, :1]]
    losses = [tfnng.losses.CategoricalNLL(), tfnng.losses.GaussianNLL(0.5)]
    model = tfnng.BayesianModel(net)
    optimizer = tfnng.optimizers.NoisyKFAC(num_examples=8)
    # At compile: an error in the first (traced) step used to leave the optimizer built by Keras
    # with uninitialised variables, and tfnng.predict then failed with an unrelated message.
    with pytest.raises(ValueError, match="one loss per output is supported only with "
                                         "fisher='empirical'"):
        model.compile(optimizer=optimizer, loss=losses)
    assert not optimizer.built
    model = tfnng.BayesianModel(net)
    model.compile(optimizer=tfnng.optimizers.NoisyKFAC(num_examples=8, fisher="empirical"),
                  loss=losses)
    assert np.isfinite(model.fit(x, targets, batch_size=4, verbose=0).history["loss"]).all()


def test_a_multi_output_model_weighs_each_examples_curvature_by_its_mask_and_sample_weight():
    """Keras hands the one sample-weight array to every output, and a mask reaches every output:
    the curvature is (1/B) sum_n w_n (B / valid) m_n g_n^2 with g_n the gradient of example n's
    summed log-likelihoods. Structured weights used to be refused, and the masks of a structured
    output were not seen (the kept examples entered with (B / valid)^2)."""
    rng = np.random.default_rng(5)
    size, classes = 6, 3
    x = rng.normal(size=(size, 3)).astype("float32")
    x[[1, 4]] = 0.0                                               # masked by Masking(0.0)
    y = {"reg": rng.normal(size=(size, 1)).astype("float32"), "cls": rng.integers(0, classes, size)}
    sample_weight = np.array([1.0, 2.0, 0.5, 0.0, 1.5, 1.0], "float32")
    mask = np.any(x != 0, axis=1)
    example_weights = sample_weight * mask * size / mask.sum()
    losses = {"reg": tfnng.losses.GaussianNLL(1.0), "cls": tfnng.losses.CategoricalNLL()}
    keras.utils.set_random_seed(1)
    inputs = keras.Input((3,))
    hidden = keras.layers.Dense(4, activation="tanh")(keras.layers.Masking(0.0)(inputs))
    net = keras.Model(inputs, {"reg": keras.layers.Dense(1, name="reg")(hidden),
                               "cls": keras.layers.Dense(classes, name="cls")(hidden)})
    squares = []
    for n in range(size):
        with tf.GradientTape() as tape:
            outputs = net(x[n:n + 1])
            nll = tf.reduce_sum(sum(losses[k].call(y[k][n:n + 1], outputs[k]) for k in losses))
        squares.append([np.square(g.numpy()) for g in tape.gradient(nll, net.trainable_variables)])
    model = tfnng.BayesianModel(net)
    optimizer = tfnng.optimizers.VOGN(learning_rate=0.0, num_examples=100, beta=1.0, hess_init=0.0,
                                      fisher="empirical")
    model.compile(optimizer=optimizer, loss=losses)
    model.fit(x, y, sample_weight=sample_weight, batch_size=size, epochs=1, verbose=0, shuffle=False)
    for i in range(len(net.trainable_variables)):
        expected = sum(w * square[i] for w, square in zip(example_weights, squares)) / size
        np.testing.assert_allclose(optimizer._slot("hessian", i).numpy(), expected,   # beta = 1
                                   rtol=2e-5, atol=1e-7)

    def weights(sample_weight=None, outputs=None):
        return tfnng.models._masked_example_weights(tfnng.models._example_weights(sample_weight),
                                                    outputs)

    np.testing.assert_array_equal(weights([1.0, 2.0, 0.0]), [1.0, 2.0, 0.0])   # a list of numbers
    np.testing.assert_array_equal(weights({"a": sample_weight, "b": sample_weight}), sample_weight)
    with pytest.raises(tf.errors.InvalidArgumentError, match="must be equal"):
        weights([sample_weight, 2 * sample_weight])
    masked = [tf.ones((3, 1)), tf.ones((3, 2))]
    masked[0]._keras_mask = tf.constant([True, False, True])
    with pytest.raises(ValueError, match="some outputs of the model carry a Keras mask"):
        weights(outputs=masked)
    masked[1]._keras_mask = tf.constant([True, True, False])
    with pytest.raises(tf.errors.InvalidArgumentError, match="different Keras masks"):
        weights(outputs=masked)


def test_a_layer_without_fast_path_needs_a_likelihood_and_says_which_and_what_else():
    """The generic path scores each example with the likelihood, also for the empirical Fisher;
    the error used to advise fisher='empirical' to an optimizer that had it."""
    x = np.random.default_rng(8).normal(size=(8, 2)).astype("float32")
    y = (x[:, 0] > 0).astype("int32")
    net = keras.Sequential([keras.Input((2,)), keras.layers.Dense(3, activation="tanh"),
                            keras.layers.LayerNormalization(name="norm"), keras.layers.Dense(2)])
    model = tfnng.BayesianModel(net)
    model.compile(optimizer=tfnng.optimizers.VOGN(num_examples=8, fisher="empirical"),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    with pytest.raises(ValueError, match=r"per-example gradients of sequential\S*/norm .*"
                                         r"mark these layers' variables as point estimates"):
        model.fit(x, y, batch_size=4, verbose=0)
    for variable in net.get_layer("norm").trainable_variables:       # the advice works
        tfnng.mark_point_estimate(variable)
    model = tfnng.BayesianModel(net)
    model.compile(optimizer=tfnng.optimizers.VOGN(num_examples=8, fisher="empirical"),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    assert np.isfinite(model.fit(x, y, batch_size=4, verbose=0).history["loss"]).all()


def test_the_empirical_fisher_of_a_learned_noise_squares_the_training_loss_on_both_paths():
    """With GaussianNLL("learned") the Dense variables squared the gradients of the training loss
    (eq. 23) and the generic path those of the Student-t predictive, 18x apart in one model."""
    keras.utils.set_random_seed(3)
    rng = np.random.default_rng(3)
    net = keras.Sequential([keras.Input((3,), dtype=F64), Wiggle(dtype=F64),
                            keras.layers.Dense(1, dtype=F64),
                            tfnng.layers.NoisePrecision(10, dtype=F64)])
    loss = tfnng.losses.GaussianNLL("learned", dtype=F64)
    x, y = tf.constant(rng.normal(size=(6, 3))), tf.constant(rng.normal(size=(6, 1)))
    optimizer = vogn_after_one_batch(net, loss, x, y)
    for i, variable in enumerate(net.trainable_variables[:3]):     # Wiggle's scale, the Dense's
        squares = []
        for n in range(len(x)):
            with tf.GradientTape() as tape:
                training_loss = tf.reduce_sum(loss.call(y[n:n + 1], net(x[n:n + 1])))
            squares.append(tape.gradient(training_loss, variable).numpy() ** 2)
        np.testing.assert_allclose(optimizer._squared_gradient_mean(i).numpy(), np.mean(squares, 0),
                                   rtol=1e-9, atol=1e-12, err_msg=variable.path)


class ShiftedInTraining(keras.layers.Layer):
    """Adds 100 to its input in training mode only (as dropout or batch statistics change the
    training pass's output)."""

    def call(self, x, training=None):
        return x + 100.0 if training else x


def test_the_generic_paths_true_fisher_samples_its_targets_from_its_own_inference_pass():
    """The targets came from the training pass, the generic path's gradients from an inference-mode
    pass: its curvature held the gap between the two (here 100^2 times too large)."""
    keras.utils.set_random_seed(4)
    net = keras.Sequential([keras.Input((3,), dtype=F64), Wiggle(dtype=F64),
                            keras.layers.Dense(1, dtype=F64), ShiftedInTraining(dtype=F64)])
    x = tf.constant(np.random.default_rng(4).normal(size=(40, 3)))
    optimizer = vogn_after_one_batch(net, tfnng.losses.GaussianNLL(1.0, dtype=F64), x,
                                     tf.zeros((40, 1), F64), fisher="true")
    scale = net.layers[0].scale
    jacobians = []
    for n in range(len(x)):
        with tf.GradientTape() as tape:
            output = tf.reduce_sum(net(x[n:n + 1], training=False))
        jacobians.append(tape.gradient(output, scale).numpy())
    exact = np.mean(np.square(jacobians), 0)          # E_y[(y - f)^2] J^2 with unit noise variance
    ratio = optimizer._squared_gradient_mean(0).numpy() / exact     # 40 draws per element
    assert np.all((ratio > 0.4) & (ratio < 2.0)), ratio


class MaskLastClass(keras.layers.Layer):
    """Forbids the last class: its logit becomes -inf."""

    def call(self, logits):
        return tf.where([True, True, False], logits, tf.constant(-np.inf, logits.dtype))


def test_the_true_fishers_targets_never_take_a_class_masked_by_minus_infinity():
    """The target sampler replaced every non-finite logit by 0, so a class masked out with -inf
    was drawn (here for a fifth of the examples), whose gradient -p made the curvature wrong. The
    kernel's per-example gradient for class k is 1[y = k] - p_k (input 1): E[(.)^2] = p_k (1 - p_k)
    under the model's own predictive."""
    keras.utils.set_random_seed(1)
    net = keras.Sequential([keras.Input((1,), dtype=F64),
                            keras.layers.Dense(3, use_bias=False, dtype=F64,
                                               kernel_initializer=keras.initializers.Constant(
                                                   [[0.0, 1.0, 0.5]])),
                            MaskLastClass(dtype=F64)])
    batch = 4000
    optimizer = vogn_after_one_batch(net, tfnng.losses.CategoricalNLL(dtype=F64),
                                     tf.ones((batch, 1), F64), tf.zeros(batch, tf.int32),
                                     fisher="true")
    p = np.exp([0.0, 1.0]) / np.sum(np.exp([0.0, 1.0]))
    curvature = optimizer._squared_gradient_mean(0).numpy().ravel()
    assert curvature[2] == 0.0
    np.testing.assert_allclose(curvature[:2], p * (1 - p), atol=0.012)   # ~4 standard errors


class Scaled(keras.layers.Layer):
    """Multiplies its input by one learned scalar (no fast path)."""

    def build(self, input_shape):
        self.factor = self.add_weight(shape=(), initializer=keras.initializers.Constant(1.5),
                                      dtype=F64)

    def call(self, x):
        return x * self.factor


@pytest.mark.parametrize("seed", [keras.random.SeedGenerator(3), None], ids=["seeded", "unseeded"])
def test_both_paths_differentiate_the_same_sampled_targets(seed):
    """The Dense/Conv2D path and the generic path drew their true-Fisher targets independently, so
    the cross terms between their blocks (SLANG, full covariance) averaged to zero. For
    f = s (x.k + b) and unit noise variance, the Dense pre-activation's log-likelihood gradient is
    s (y~ - f) and the scale's is (x.k + b)(y~ - f): one residual per example in both."""
    net = keras.Sequential([keras.Input((3,), dtype=F64), keras.layers.Dense(1, dtype=F64),
                            Scaled(dtype=F64)])
    x = tf.constant(np.random.default_rng(9).normal(size=(12, 3)))
    optimizer = tfnng.optimizers.VOGN(1e-3, num_examples=10, fisher="true")
    capture = LayerCapture(net)
    optimizer.prepare_curvature(capture.specs)
    optimizer.build(net.trainable_variables)
    _, _, _, records = gradients_and_curvature(net, capture, optimizer,
                                               tfnng.losses.GaussianNLL(1.0, dtype=F64), x,
                                               tf.zeros((12, 1), F64), seed=seed)
    dense, scaled = net.layers
    preactivation = (x @ dense.kernel + dense.bias).numpy().ravel()
    by_dense = records[capture.specs[0].name].preactivation_grads.numpy().ravel() / 1.5
    by_scale = [r.gradients for name, r in records.items() if name != capture.specs[0].name]
    by_scale = by_scale[0].numpy().ravel() / preactivation
    assert np.std(by_dense) > 0.3                     # sampled residuals, not zeros
    np.testing.assert_allclose(by_scale, by_dense, rtol=1e-9)


def test_sparse_inputs_give_the_statistics_of_their_dense_values():
    """A Dense on a sparse input (keras.Input(sparse=True)) crashed the capture with a TypeError."""
    rng = np.random.default_rng(6)
    dense = (rng.random((6, 5)) < 0.4) * rng.normal(size=(6, 5))
    y = tf.constant(rng.normal(size=(6, 1)))
    squares = []
    for x in (tf.constant(dense), tf.sparse.from_dense(tf.constant(dense))):
        keras.utils.set_random_seed(6)
        net = keras.Sequential([keras.Input((5,), dtype=F64, sparse=True),
                                keras.layers.Dense(3, activation="tanh", dtype=F64),
                                keras.layers.Dense(1, dtype=F64)])
        optimizer = vogn_after_one_batch(net, tfnng.losses.GaussianNLL(1.0, dtype=F64), x, y)
        squares.append([optimizer._squared_gradient_mean(i).numpy() for i in range(4)])
    for from_dense, from_sparse in zip(*squares):
        np.testing.assert_allclose(from_sparse, from_dense, rtol=1e-12)


def test_integer_inputs_train_as_their_values():
    """A Dense on integer inputs (word counts, keras.Input(dtype="int32")) crashed VOGN's
    non-finite guard with a TypeError (int input norms added to float ones)."""
    rng = np.random.default_rng(7)
    counts = rng.integers(0, 3, size=(8, 4))
    y = rng.normal(size=(8, 1))
    stddevs = []
    for x, dtype in ((counts.astype("float64"), F64), (counts.astype("int32"), "int32")):
        keras.utils.set_random_seed(7)
        net = keras.Sequential([keras.Input((4,), dtype=dtype),
                                keras.layers.Dense(3, activation="tanh", dtype=F64),
                                keras.layers.Dense(1, dtype=F64)])
        model = tfnng.BayesianModel(net)
        optimizer = tfnng.optimizers.VOGN(learning_rate=0.01, num_examples=8, seed=0)
        model.compile(optimizer=optimizer, loss=tfnng.losses.GaussianNLL(1.0, dtype=F64))
        model.fit(x, y, batch_size=4, epochs=1, verbose=0)
        stddevs.append([optimizer.posterior_stddev(v).numpy() for v in net.trainable_variables])
    prior = np.sqrt(optimizer.prior_variance)
    assert all(np.all(s < 0.99 * prior) for s in stddevs[0])     # the data moved every variance
    for from_floats, from_integers in zip(*stddevs):
        np.testing.assert_allclose(from_integers, from_floats, rtol=1e-12)


@pytest.mark.parametrize("make", [
    lambda: tfnng.optimizers.VOGN(learning_rate=0.1, num_examples=8, seed=0),
    lambda: tfnng.optimizers.VOGN(learning_rate=0.1, num_examples=8, seed=0, fisher="empirical"),
    lambda: tfnng.optimizers.NoisyKFAC(learning_rate=0.1, num_examples=8, seed=0)],
    ids=["VOGN", "VOGN-empirical", "NoisyKFAC"])
def test_a_one_output_model_may_list_its_likelihood_or_name_its_output(make):
    """``loss=[l]`` (Keras accepts it for one output) trains exactly as ``loss=l``, also where the
    generic path scores each example (the LayerNormalization); so does an output named in a
    one-entry dict (the true Fisher's sampler failed on the dict: "Expected any non-tensor type"),
    with its targets named too (the generic path's empirical Fisher failed on them alike)."""
    x = np.random.default_rng(8).normal(size=(8, 2)).astype("float32")
    y = (x[:, 0] > 0).astype("int32")
    likelihood = tfnng.losses.CategoricalNLL()
    means = {}
    for name, loss in [("bare", likelihood), ("list", [likelihood]),
                       ("dict output", {"out": likelihood}),
                       ("dict output and targets", {"out": likelihood})]:
        keras.utils.set_random_seed(0)
        inputs = keras.Input((2,))
        hidden = keras.layers.LayerNormalization()(keras.layers.Dense(3, activation="tanh")(inputs))
        outputs = keras.layers.Dense(2, name="out")(hidden)
        net = keras.Model(inputs, {"out": outputs} if name.startswith("dict") else outputs)
        model = tfnng.BayesianModel(net)
        optimizer = make()
        model.compile(optimizer=optimizer, loss=loss)
        model.fit(x, {"out": y} if name.endswith("targets") else y, batch_size=4, epochs=2,
                  verbose=0)
        means[name] = [optimizer.posterior_mean(v).numpy() for v in net.trainable_variables]
    for name in ("list", "dict output", "dict output and targets"):
        for listed, bare in zip(means[name], means["bare"]):
            np.testing.assert_array_equal(listed, bare)


class TwinNames(keras.Model):
    """Two LayerNormalization and two Dense layers sharing a name: their variable paths repeat."""

    def __init__(self):
        super().__init__()
        self.norms = [keras.layers.LayerNormalization(name="ln", dtype=F64) for _ in range(2)]
        self.dense = [keras.layers.Dense(k, activation="tanh", name="blk", dtype=F64) for k in (4, 2)]

    def call(self, x):
        return self.dense[1](self.norms[1](self.dense[0](self.norms[0](x))))


def test_repeated_variable_paths_keep_each_variable_its_own_statistics_and_posterior():
    net = TwinNames()
    net(tf.zeros((1, 3), F64))
    variables = net.trainable_variables
    assert len({v.path for v in variables}) < len(variables) == 8
    loss = tfnng.losses.GaussianNLL(noise_variance=0.3, dtype=F64)
    rng = np.random.default_rng(2)
    x, y = tf.constant(rng.normal(size=(5, 3))), tf.constant(rng.normal(size=(5, 2)))
    optimizer = vogn_after_one_batch(net, loss, x, y)
    assert_squared_gradient_means_match_the_loop(optimizer, net, loss, x, y)
    assert len(optimizer.posterior().model) == len(variables)        # no part dropped
    kfac = tfnng.optimizers.NoisyKFAC(num_examples=10)
    kfac.prepare_curvature(LayerCapture(net).specs)
    kfac.build(variables)
    assert len(kfac.posterior().model) == 2 + 4         # two MVG layers, four diagonal LN variables
    for flat in (tfnng.optimizers.SLANG(num_examples=10, rank=1),
                 tfnng.optimizers.NoisyNaturalGradient(num_examples=10)):
        flat.prepare_curvature(LayerCapture(net).specs)
        flat.build(variables)
        names = [name for name, _ in flat.posterior_layout()]
        assert len(set(names)) == len(names) == len(variables)


class TiedDecoder(keras.layers.Layer):
    """Holds and uses the transposed kernel of another (Dense) layer: a tied weight."""

    def __init__(self, encoder_kernel, **kwargs):
        super().__init__(**kwargs)
        self.tied_kernel = encoder_kernel

    def build(self, input_shape):
        self.bias = self.add_weight(shape=(self.tied_kernel.shape[0],), initializer="zeros",
                                    dtype=F64)

    def call(self, h):
        return tf.matmul(h, self.tied_kernel, transpose_b=True) + self.bias


def test_tied_weights_take_the_generic_path():
    """A Dense kernel that another layer also uses gets its per-example gradients from the generic
    path: the Dense layer's own inputs and pre-activation gradients would miss the decoder's use."""
    inputs = keras.Input((4,), dtype=F64)
    encoder = keras.layers.Dense(3, activation="tanh", dtype=F64)
    hidden = encoder(inputs)
    net = keras.Model(inputs, TiedDecoder(encoder.kernel, dtype=F64)(hidden))
    loss = tfnng.losses.GaussianNLL(noise_variance=0.3, dtype=F64)
    assert LayerCapture(net).specs == []
    rng = np.random.default_rng(3)
    x, y = tf.constant(rng.normal(size=(5, 4))), tf.constant(rng.normal(size=(5, 4)))
    assert_squared_gradient_means_match_the_loop(vogn_after_one_batch(net, loss, x, y), net, loss, x, y)


# ------------------------------------------------------------------- NumPy references, fixed noise
LR, BETA, GAMMA_EX, H0, KL_WEIGHT = 0.3, 0.2, 0.05, 0.5, 0.7
B, STEPS = 10, 6


def reference_batches():
    x, y, _, _ = regression_data()
    return [(x[k * B:(k + 1) * B], y[k * B:(k + 1) * B]) for k in range(STEPS)]


def example_gradients(w, x, y):
    """Empirical Fisher: gradients of log N(y_i | x_i w, s2), one row per example."""
    return x * ((y[:, 0] - x @ w) / NOISE_VAR)[:, None]


def noisy_steps(optimizer, eps, initial_mean=None):
    """Train on ``reference_batches`` with the weight noise ``eps`` (one draw per step, all of them
    used), from the kernel ``initial_mean`` (default zeros), yielding ``(t, x, y, net)`` after each
    step t."""
    net = linear_net()
    if initial_mean is not None:
        net.layers[0].kernel.assign(np.asarray(initial_mean)[:, None])
    step = make_step(net, optimizer, tfnng.losses.GaussianNLL(noise_variance=NOISE_VAR, dtype=F64),
                     compiled=False)       # eager: the fixed noise is read at every step
    queue = list(eps)
    optimizer._standard_normal = lambda shape, dtype: tf.constant(queue.pop(0), dtype)
    for t, (x, y) in enumerate(reference_batches()):
        step(tf.constant(x), tf.constant(y))
        yield t, x, y, net
    assert not queue


def run_optimizer(optimizer, eps, initial_mean=None):
    means = [optimizer.posterior_mean(net.trainable_variables[0]).numpy()[:, 0]
             for _, _, _, net in noisy_steps(optimizer, eps, initial_mean)]
    return np.array(means), optimizer


def common_kwargs(**extra):
    return dict(learning_rate=LR, num_examples=N, prior_variance=ETA, kl_weight=KL_WEIGHT, beta=BETA,
                hess_init=H0, extrinsic_damping=GAMMA_EX, fisher="empirical", **extra)


GAMMA = KL_WEIGHT / (N * ETA)     # intrinsic damping with this kl_weight
SCALE = KL_WEIGHT / N             # covariance = SCALE * P^-1


@pytest.mark.parametrize("momentum,initial_mean", [(0.6, np.zeros(D)), (0.0, np.zeros(D)),
                                                   (0.6, np.array([0.4, -0.3, 0.8]))])
def test_vogn_equals_numpy_reference_with_natural_momentum(momentum, initial_mean):
    """Also from a nonzero mean, where a first step with momentum would show (mu_prev is mu_0)."""
    eps = list(np.random.default_rng(2).normal(size=(STEPS, D, 1)))
    means, optimizer = run_optimizer(tfnng.optimizers.VOGN(momentum=momentum, **common_kwargs()),
                                     eps, initial_mean)
    # mu_prev is state only with momentum: without it VOGN keeps the mean and s per weight
    assert any("previous_mean" in v.path for v in optimizer.variables) == (momentum > 0)
    mu, prev, s, w = initial_mean, initial_mean, np.full(D, H0), initial_mean
    expected = []
    for t, (x, y) in enumerate(reference_batches()):
        g_i = example_gradients(w, x, y)
        g, h = -g_i.mean(0), np.mean(g_i ** 2, 0)
        new_s = (1 - BETA) * s + BETA * h
        velocity = mu - prev if t > 0 else 0.0
        new_mu = (mu - LR * (g + GAMMA * mu) / (new_s + GAMMA + GAMMA_EX)
                  + momentum * (s + GAMMA + GAMMA_EX) / (new_s + GAMMA + GAMMA_EX) * velocity)
        prev, mu, s = mu, new_mu, new_s
        w = mu + np.sqrt(SCALE / (s + GAMMA)) * eps[t][:, 0]
        expected.append(mu)
    np.testing.assert_allclose(means, expected, rtol=1e-6, atol=1e-9)   # lr is float32


def test_noisy_natural_gradient_equals_numpy_reference_of_nng_eq_9_10():
    eps = list(np.random.default_rng(3).normal(size=(STEPS, D)))
    means, optimizer = run_optimizer(tfnng.optimizers.NoisyNaturalGradient(**common_kwargs()), eps)
    mu, fisher, w = np.zeros(D), H0 * np.eye(D), np.zeros(D)
    expected = []
    for t, (x, y) in enumerate(reference_batches()):
        g_i = example_gradients(w, x, y)
        fisher = (1 - BETA) * fisher + BETA * g_i.T @ g_i / B
        mu = mu - LR * np.linalg.solve(fisher + (GAMMA + GAMMA_EX) * np.eye(D),
                                       -g_i.mean(0) + GAMMA * w)
        chol = np.linalg.cholesky(fisher + GAMMA * np.eye(D))
        w = mu + np.sqrt(SCALE) * np.linalg.solve(chol.T, eps[t])
        expected.append(mu)
    np.testing.assert_allclose(means, expected, rtol=1e-6, atol=1e-9)
    covariance = SCALE * np.linalg.inv(fisher + GAMMA * np.eye(D))
    np.testing.assert_allclose(optimizer.covariance().numpy(), covariance, rtol=1e-6)
    np.testing.assert_allclose(optimizer.posterior().covariance().numpy(), covariance, rtol=1e-6)
    np.testing.assert_allclose(optimizer.posterior_stddev(optimizer._trainable_variables[0]).numpy()[:, 0],
                               np.sqrt(np.diag(covariance)), rtol=1e-6)


@pytest.mark.parametrize("scheduled", [False, True])
def test_noisy_natural_gradient_averages_mc_samples_before_each_update(scheduled):
    """mc_samples = 2: each update uses the averages of gradient, sample and G^T G / B over two
    evaluations, each at its own weight sample (the curvature estimate has a fixed shape). A beta
    schedule sees updates: update k uses beta(k), not beta(evaluations)."""
    betas = [BETA, 0.5, 0.35] if scheduled else [BETA] * 3          # 6 evaluations, 3 updates
    beta = keras.optimizers.schedules.PiecewiseConstantDecay([0, 1], betas) if scheduled else BETA
    eps = list(np.random.default_rng(4).normal(size=(STEPS, D)))
    means, _ = run_optimizer(tfnng.optimizers.NoisyNaturalGradient(
        mc_samples=2, **{**common_kwargs(), "beta": beta}), eps)
    mu, fisher, w = np.zeros(D), H0 * np.eye(D), np.zeros(D)
    chol = np.linalg.cholesky(fisher + GAMMA * np.eye(D))
    expected, group = [], []
    for t, (x, y) in enumerate(reference_batches()):
        g_i = example_gradients(w, x, y)
        group.append((-g_i.mean(0), w, g_i.T @ g_i / B))
        if len(group) == 2:
            g, weight, curvature = (np.mean(parts, axis=0) for parts in zip(*group))
            group, beta_k = [], betas[t // 2]
            fisher = (1 - beta_k) * fisher + beta_k * curvature
            mu = mu - LR * np.linalg.solve(fisher + (GAMMA + GAMMA_EX) * np.eye(D), g + GAMMA * weight)
            chol = np.linalg.cholesky(fisher + GAMMA * np.eye(D))
        w = mu + np.sqrt(SCALE) * np.linalg.solve(chol.T, eps[t])
        expected.append(mu)
    np.testing.assert_allclose(means, expected, rtol=1e-6, atol=1e-9)


def full_vogn_reference(steps_eps):
    """SLANG eq. 2 (full-Gaussian VOGN) in tfnng's units, prior term at the mean (Alg. 1, line 11)."""
    mu, precision, w = np.zeros(D), (H0 + GAMMA) * np.eye(D), np.zeros(D)
    means, precisions = [], []
    for t, (x, y) in enumerate(reference_batches()):
        g_i = example_gradients(w, x, y)
        precision = (1 - BETA) * precision + BETA * (g_i.T @ g_i / B + GAMMA * np.eye(D))
        mu = mu - LR * np.linalg.solve(precision + GAMMA_EX * np.eye(D), -g_i.mean(0) + GAMMA * mu)
        w = mu.copy() if steps_eps is None else mu + steps_eps(t, precision)
        means.append(mu)
        precisions.append(precision)
    return np.array(means), precisions


def test_slang_with_full_rank_equals_full_gaussian_vogn():
    """L = D: no eigenvalue is discarded, so SLANG is the full-Gaussian VOGN update (SLANG eq. 2).
    With zero noise the samples are the means and both runs see the same gradients."""
    means, optimizer = run_optimizer(tfnng.optimizers.SLANG(rank=D, **common_kwargs()),
                                     [np.zeros(D)] * STEPS)
    expected_means, precisions = full_vogn_reference(None)
    np.testing.assert_allclose(means, expected_means, rtol=1e-6, atol=1e-9)
    low_rank, diagonal = optimizer.precision_factors()
    np.testing.assert_allclose(low_rank.numpy() @ low_rank.numpy().T + np.diag(diagonal.numpy()),
                               precisions[-1] / SCALE, rtol=1e-6)
    np.testing.assert_allclose(optimizer.posterior().covariance().numpy(),
                               SCALE * np.linalg.inv(precisions[-1]), rtol=1e-6)
    np.testing.assert_allclose(float(optimizer.kl_divergence()), kl_dense(
        expected_means[-1], SCALE * np.linalg.inv(precisions[-1])), rtol=1e-6)


@pytest.mark.parametrize("extrinsic_damping", [0.0, GAMMA_EX])
def test_slang_steps_from_its_weight_noise_and_draws_the_next_sample_from_the_update(
        extrinsic_damping):
    """With weight noise, full rank. Each step is the full-Gaussian VOGN step (SLANG eq. 2) at the
    sample the previous step wrote, and the sample it writes is ``mu + sqrt(lambda/N) R eps`` with
    R the covariance root of the *updated* precision (Alg. 3; :func:`fast_sample`, checked against
    dense algebra in test_posteriors_low_rank) and eps the step's own draw. Without extrinsic
    damping the step and the sample share one float64 factorisation (``inverse_and_sample``),
    with it they are computed apart: both wirings must do the same."""
    eps = list(np.random.default_rng(6).normal(size=(STEPS, D)))
    kwargs = {**common_kwargs(), "extrinsic_damping": extrinsic_damping}
    optimizer = tfnng.optimizers.SLANG(rank=D, **kwargs)
    mu, precision, w = np.zeros(D), (H0 + GAMMA) * np.eye(D), np.zeros(D)
    for t, x, y, net in noisy_steps(optimizer, eps):
        g_i = example_gradients(w, x, y)
        precision = (1 - BETA) * precision + BETA * (g_i.T @ g_i / B + GAMMA * np.eye(D))
        mu = mu - LR * np.linalg.solve(precision + extrinsic_damping * np.eye(D),
                                       -g_i.mean(0) + GAMMA * mu)
        got_mean = optimizer.posterior_mean(net.trainable_variables[0]).numpy()[:, 0]
        np.testing.assert_allclose(got_mean, mu, rtol=1e-6, atol=1e-9)
        u, d = optimizer._low_rank.numpy(), optimizer._diagonal.numpy()
        np.testing.assert_allclose(u @ u.T + np.diag(d), precision, rtol=1e-6)
        w = net.trainable_variables[0].numpy()[:, 0]
        noise = low_rank_posteriors.fast_sample(u, d, eps[t]).numpy()
        np.testing.assert_allclose(w, got_mean + np.sqrt(SCALE) * noise, rtol=1e-10, atol=1e-12)


def kl_dense(mean, covariance):
    d = len(mean)
    return 0.5 * (np.trace(covariance) / ETA + mean @ mean / ETA - d + d * np.log(ETA)
                  - np.linalg.slogdet(covariance)[1])


def test_slang_keeps_the_precision_diagonal_exact_after_every_step():
    """Rank 1 < D: diag(U U^T + diag d) equals the diagonal of the full update it approximates,
    ``(1 - beta) P_prev + beta (G^T G / B + gamma_in I)``, after every step (SLANG eq. 8-10)."""
    optimizer = tfnng.optimizers.SLANG(rank=1, **common_kwargs())
    net = linear_net()
    step = make_step(net, optimizer, tfnng.losses.GaussianNLL(noise_variance=NOISE_VAR, dtype=F64))
    for x, y in reference_batches():
        low_rank, diagonal = (v.numpy() for v in (optimizer._low_rank, optimizer._diagonal))
        previous = low_rank @ low_rank.T + np.diag(diagonal)
        w = net.trainable_variables[0].numpy()[:, 0]
        g_i = example_gradients(w, x, y)
        target = (1 - BETA) * previous + BETA * (g_i.T @ g_i / B + GAMMA * np.eye(D))
        step(tf.constant(x), tf.constant(y))
        low_rank, diagonal = (v.numpy() for v in (optimizer._low_rank, optimizer._diagonal))
        np.testing.assert_allclose(np.diag(low_rank @ low_rank.T) + diagonal, np.diag(target),
                                   rtol=1e-10)
        assert low_rank.shape == (D, 1)


# ---------------------------------------------------------- exact Bayesian-linear-regression targets
def fit_blr(optimizer, steps=1500):
    """Full-batch training with the true Fisher; the step size drops tenfold for the last third."""
    x, y, mu_star, precision = regression_data()
    net = linear_net()
    step = make_step(net, optimizer, tfnng.losses.GaussianNLL(noise_variance=NOISE_VAR, dtype=F64), seed=4)
    x, y = tf.constant(x), tf.constant(y)
    for _ in range(steps):
        step(x, y)
    mean = optimizer.posterior_mean(net.trainable_variables[0]).numpy()[:, 0]
    return mean, mu_star, precision, net


def blr_optimizer(cls, **kwargs):
    schedule = keras.optimizers.schedules.PiecewiseConstantDecay([1000], [0.2, 0.02])
    return cls(learning_rate=schedule, num_examples=N, prior_variance=ETA, beta=0.01, hess_init=1.0,
               seed=5, **kwargs)


def test_vogn_fixed_point_is_the_optimal_mean_field_gaussian():
    optimizer = blr_optimizer(tfnng.optimizers.VOGN)
    mean, mu_star, precision, net = fit_blr(optimizer)
    std = optimizer.posterior_stddev(net.trainable_variables[0]).numpy()[:, 0]
    # Tolerances: the precision is an EMA (beta = 0.01) of a 100-example Monte Carlo estimate, whose
    # relative noise is about sqrt(2/N) * sqrt(beta/2) = 1%: 5% leaves room. The mean fluctuates
    # by about sqrt(lr/2) = 0.1 posterior standard deviations at the final step size.
    np.testing.assert_allclose(1 / std ** 2, np.diag(precision), rtol=0.05)
    assert np.all(np.abs(mean - mu_star) < 0.3 * np.sqrt(1 / np.diag(precision)))
    # And it is not the exact posterior: the exact marginal variances are larger.
    assert np.all(std ** 2 < 0.9 * np.diag(np.linalg.inv(precision)))


@pytest.mark.parametrize("cls, kwargs", [(tfnng.optimizers.NoisyNaturalGradient, {}),
                                         (tfnng.optimizers.SLANG, {"rank": D})])
def test_full_covariance_fixed_point_is_the_exact_posterior(cls, kwargs):
    optimizer = blr_optimizer(cls, **kwargs)
    mean, mu_star, precision, _ = fit_blr(optimizer)
    covariance = optimizer.posterior().covariance().numpy()
    # Same tolerances as above, on the whole precision matrix (relative to its diagonal).
    scale = np.sqrt(np.outer(np.diag(precision), np.diag(precision)))
    np.testing.assert_allclose(np.linalg.inv(covariance) / scale, precision / scale, atol=0.05)
    exact_std = np.sqrt(np.diag(np.linalg.inv(precision)))
    assert np.all(np.abs(mean - mu_star) < 0.3 * exact_std)


# ----------------------------------------------------------------------------- Keras integration
@pytest.mark.parametrize("make", [
    lambda n: tfnng.optimizers.VOGN(1e-2, num_examples=n, hess_init=1.0, beta=0.1, seed=1),
    lambda n: tfnng.optimizers.SLANG(1e-2, num_examples=n, rank=2, hess_init=1.0, beta=0.1, seed=1),
    lambda n: tfnng.optimizers.NoisyNaturalGradient(1e-2, num_examples=n, hess_init=1.0, beta=0.1,
                                                    seed=1)])
def test_fit_predict_with_layers_without_fast_path(make):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 3)).astype("float32")
    y = (x @ np.array([[1.0], [-2.0], [0.5]]) + 0.3 * rng.normal(size=(64, 1))).astype("float32")
    net = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4, activation="tanh"),
                            keras.layers.LayerNormalization(), keras.layers.Dense(1),
                            tfnng.layers.NoisePrecision(64)])
    model = tfnng.BayesianModel(net)
    optimizer = make(64)
    model.compile(optimizer=optimizer, loss=tfnng.losses.GaussianNLL(noise_variance="learned"))
    history = model.fit(x, y, batch_size=16, epochs=4, verbose=0)
    assert history.history["loss"][-1] < history.history["loss"][0]
    assert {"loss", "nll", "kl"} <= set(history.history)
    prediction = tfnng.predict(model, x[:5], num_samples=8)
    assert np.all(np.isfinite(prediction.mean))
    restored = type(optimizer).from_config(optimizer.get_config())
    assert restored.get_config() == optimizer.get_config()


@pytest.mark.parametrize("make", [
    lambda: tfnng.optimizers.SLANG(1e-2, num_examples=40, rank=3, seed=1),
    lambda: tfnng.optimizers.NoisyNaturalGradient(1e-2, num_examples=40, seed=1)],
    ids=["slang", "nng_full"])
def test_a_step_traced_for_an_unknown_batch_size_is_the_step_for_the_known_one(make):
    """Keras traces the step with an unknown batch size for a last partial batch or a tf.data
    pipeline: the update must not depend on it (SLANG and NNG-full used to fail there)."""
    loss = tfnng.losses.GaussianNLL(noise_variance=0.3, dtype=F64)
    rng = np.random.default_rng(2)
    x, y = tf.constant(rng.normal(size=(5, 6, 5, 2))), tf.constant(rng.normal(size=(5, 2)))
    unknown = [tf.TensorSpec([None, 6, 5, 2], F64), tf.TensorSpec([None, 2], F64)]
    states = []
    for signature in (None, unknown):
        keras.utils.set_random_seed(0)
        net, optimizer = mixed_net(), make()
        make_step(net, optimizer, loss, input_signature=signature)(x, y)
        states.append([v.numpy() for v in optimizer.variables])
    for known, dynamic in zip(*states):
        np.testing.assert_allclose(dynamic, known, rtol=1e-9, atol=1e-12)

    net = mixed_net()                                       # and model.fit with 40 = 3 x 12 + 4
    model = tfnng.BayesianModel(net)
    model.compile(optimizer=make(), loss=loss)
    x, y = rng.normal(size=(40, 6, 5, 2)), rng.normal(size=(40, 2))
    history = model.fit(x, y, batch_size=12, epochs=1, verbose=0)
    assert np.isfinite(history.history["loss"]).all()


def test_bad_arguments_raise_clear_errors():
    with pytest.raises(ValueError, match="num_examples"):
        tfnng.optimizers.VOGN(1e-3)
    for bad in (1.5, 0.0, float("nan"), "x", None):     # "x" and None gave float()'s own errors
        with pytest.raises(ValueError, match="`beta` must be in"):
            tfnng.optimizers.SLANG(1e-3, num_examples=10, beta=bad)
    with pytest.raises(ValueError, match="mc_samples"):
        tfnng.optimizers.SLANG(1e-3, num_examples=10, mc_samples=2)
    with pytest.raises(ValueError, match="eig_method"):
        tfnng.optimizers.SLANG(1e-3, num_examples=10, eig_method="lanczos")
    with pytest.raises(ValueError, match="fisher"):
        tfnng.optimizers.NoisyNaturalGradient(1e-3, num_examples=10, fisher="hessian")
    net = keras.Sequential([keras.Input((200,)), keras.layers.Dense(60)])
    optimizer = tfnng.optimizers.NoisyNaturalGradient(1e-3, num_examples=10)
    optimizer.prepare_curvature(LayerCapture(net).specs)
    with pytest.raises(ValueError, match="max_parameters"):
        optimizer.build(net.trainable_variables)
    plain = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    plain.compile(optimizer=tfnng.optimizers.SLANG(1e-3, num_examples=10), loss="mse")
    with pytest.raises(ValueError, match="BayesianModel"):
        plain.fit(np.zeros((4, 3)), np.zeros((4, 1)), verbose=0)


@pytest.mark.parametrize("beta", [3.0, -0.5, 0.0])
def test_beta_schedules_outside_the_unit_interval_stop_training(beta):
    """A schedule was never checked: 3.0 made the curvature negative (NaN loss, blamed on the
    gradients), -0.5 made it grow without bound, silently; 0 would never update it."""
    schedule = keras.optimizers.schedules.PolynomialDecay(beta, 100, end_learning_rate=beta)
    model = tfnng.BayesianModel(keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)]))
    model.compile(optimizer=tfnng.optimizers.VOGN(1e-2, num_examples=8, beta=schedule),
                  loss=tfnng.losses.GaussianNLL())
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"`beta` schedule must give values"):
        model.fit(np.zeros((8, 3)), np.zeros((8, 1)), batch_size=4, verbose=0)


@pytest.mark.parametrize("make", [lambda: tfnng.optimizers.VOGN(1e-2, num_examples=8),
                                  lambda: tfnng.optimizers.NoisyKFAC(1e-2, num_examples=8)],
                         ids=["VOGN", "NoisyKFAC"])
def test_curvature_missing_from_a_custom_loop_is_a_clear_error(make):
    """Both used to end in Python errors about None (TypeError, AttributeError); the message then
    told a BayesianModel with its own train_step to "train a tfnng.BayesianModel"."""
    net = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    optimizer = make()
    optimizer.prepare_curvature(LayerCapture(net).specs)
    with pytest.raises(ValueError, match=r"received no curvature statistics.*custom train_step.*"
                                         r"gradients_and_curvature.*curvature=curvature"):
        optimizer.apply_gradients(zip([tf.zeros_like(v) for v in net.trainable_variables],
                                      net.trainable_variables))
    with pytest.raises(ValueError, match="consumes curvature statistics.*got NoisyAdam"):
        gradients_and_curvature(net, LayerCapture(net), tfnng.optimizers.NoisyAdam(num_examples=8),
                                tfnng.losses.GaussianNLL(), np.zeros((4, 3)), np.zeros((4, 1)))


def test_slang_config_round_trip_keeps_the_eigendecomposition_settings():
    optimizer = tfnng.optimizers.SLANG(1e-3, num_examples=10, rank=3, eig_method="randomized",
                                       oversampling=4, power_iterations=1)
    restored = tfnng.optimizers.SLANG.from_config(optimizer.get_config())
    assert (restored.rank, restored.eig_method, restored.oversampling,
            restored.power_iterations) == (3, "randomized", 4, 1)


def test_slang_passes_its_eigendecomposition_settings_to_the_update(monkeypatch):
    calls = []

    def recording_update(*args, **kwargs):
        calls.append({k: kwargs.get(k) for k in ("method", "oversampling", "power_iterations")})
        return update(*args, **kwargs)

    update = low_rank_posteriors.update
    monkeypatch.setattr(low_rank_posteriors, "update", recording_update)
    x, y, _, _ = regression_data()
    optimizer = tfnng.optimizers.SLANG(1e-2, num_examples=N, rank=1, eig_method="randomized",
                                       oversampling=0, power_iterations=0, seed=0)
    step = make_step(linear_net(), optimizer, tfnng.losses.GaussianNLL(noise_variance=NOISE_VAR),
                     compiled=False)
    step(x[:10], y[:10])
    assert calls == [{"method": "randomized", "oversampling": 0, "power_iterations": 0}]


# ------------------------------------------------------------------ precision of the reported posterior
@pytest.mark.parametrize("family", ["slang", "nng"])
def test_float64_posterior_is_scaled_by_lambda_over_n_without_float32_rounding(family):
    """lambda/N = 0.014 is not a float32 number: the covariance, KL and precision factors of a
    float64 model must use it in float64 (they used to round it to float32, a 3e-8 relative error)."""
    x, y, _, _ = regression_data()
    net, kl_weight = linear_net(), 0.7
    kwargs = dict(num_examples=50, kl_weight=kl_weight, prior_variance=ETA, beta=0.3,
                  fisher="empirical", seed=0)
    optimizer = (tfnng.optimizers.SLANG(0.1, rank=D, **kwargs) if family == "slang"
                 else tfnng.optimizers.NoisyNaturalGradient(0.1, **kwargs))
    step = make_step(net, optimizer, tfnng.losses.GaussianNLL(noise_variance=NOISE_VAR))
    step(x[:10], y[:10])
    if family == "slang":
        u, d = optimizer._low_rank.numpy(), optimizer._diagonal.numpy()
        precision = u @ u.T + np.diag(d)
    else:
        chol = optimizer._chol.numpy()
        precision = chol @ chol.T
    covariance = (kl_weight / 50) * np.linalg.inv(precision)
    np.testing.assert_allclose(optimizer.posterior().covariance().numpy(), covariance, rtol=1e-12)
    mean = optimizer.posterior_mean(net.trainable_variables[0]).numpy().ravel()
    kl = 0.5 * (np.trace(covariance) / ETA + mean @ mean / ETA - D + D * np.log(ETA)
                - np.linalg.slogdet(covariance)[1])
    np.testing.assert_allclose(float(optimizer.kl_divergence()), kl, rtol=1e-13)
    if family == "slang":
        u_scaled, d_scaled = (t.numpy() for t in optimizer.precision_factors())
        np.testing.assert_allclose(u_scaled @ u_scaled.T + np.diag(d_scaled),
                                   np.linalg.inv(covariance), rtol=1e-12)


def test_nng_full_float32_model_keeps_a_positive_definite_precision_for_large_n():
    """Collinear inputs leave one direction without gradient, where F_bar decays to 0 and the
    precision to gamma_in = 1/(N eta) = 1.7e-5, far below float32 rounding of F_bar's largest
    eigenvalue (~3e3). A float32 F_bar drifted to negative eigenvalues there, the Cholesky
    factorisation filled NaN and training died with every later update 'skipped'."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(128, 2))
    x = (3 * np.concatenate([x, x.sum(1, keepdims=True)], 1)).astype("float32")
    y = (x[:, :1] - x[:, 1:2] + 0.1 * rng.normal(size=(128, 1))).astype("float32")
    keras.utils.set_random_seed(1)
    net = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    optimizer = tfnng.optimizers.NoisyNaturalGradient(0.1, num_examples=60000, beta=0.5, seed=1)
    step = make_step(net, optimizer, tfnng.losses.GaussianNLL(noise_variance=0.01))
    for _ in range(15):
        for start in range(0, 128, 32):
            step(x[start:start + 32], y[start:start + 32])
    chol = optimizer._chol.numpy().astype(np.float64)
    assert optimizer.skipped_updates == 0 and np.isfinite(chol).all()
    eigenvalues = np.linalg.eigvalsh(optimizer._fisher.numpy())
    assert eigenvalues.max() > 1e3 and eigenvalues.min() > -1e-9 * eigenvalues.max()
    np.testing.assert_allclose(chol @ chol.T, optimizer._fisher.numpy()
                               + optimizer.intrinsic_damping * np.eye(4), rtol=1e-5, atol=1e-7)
    assert np.isfinite(optimizer.posterior_mean(net.layers[0].kernel).numpy()).all()
    # posterior() from the precision's factor: re-factorising the float32 covariance gave NaN.
    covariance = np.linalg.inv(optimizer._fisher.numpy() + optimizer.intrinsic_damping * np.eye(4))
    covariance /= 60000
    posterior = optimizer.posterior()
    mean = posterior.mean().numpy().astype(np.float64)
    assert float(posterior.log_prob(mean)) == pytest.approx(
        stats.multivariate_normal(mean, covariance).logpdf(mean), rel=1e-5)
    np.testing.assert_allclose(posterior.stddev().numpy(), np.sqrt(np.diag(covariance)), rtol=1e-4)


def test_slang_float32_diagonal_stays_positive_on_raw_scale_inputs():
    """With rank = D nothing is discarded, so SLANG's diagonal correction is 0 up to rounding. On
    inputs of scale 100 its two terms are ~5e3 and float32 rounding is larger than d itself: the
    correction (the diagonal of a discarded PSD part) must not go negative (d < 0 crashed the
    sampler's square root after ~100 steps)."""
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    x = (100.0 * rng.normal(size=(4000, 5))).astype("float32")
    logits = x @ (rng.normal(size=(5, 1)) / 100.0)
    y = (rng.uniform(size=(4000, 1)) < 1 / (1 + np.exp(-logits))).astype("float32")
    net = keras.Sequential([keras.Input((5,)), keras.layers.Dense(1)])
    optimizer = tfnng.optimizers.SLANG(1e-2, num_examples=60000, rank=6, beta=0.05, seed=0,
                                       fisher="empirical")
    model = tfnng.BayesianModel(net)
    model.compile(optimizer=optimizer, loss=tfnng.losses.BernoulliNLL())
    model.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)   # 125 steps
    assert optimizer.iterations.numpy() == 125
    assert np.all(optimizer._diagonal.numpy() >= 0)
    assert np.all(np.isfinite(optimizer.posterior_stddev(net.layers[0].kernel).numpy()))


@pytest.mark.parametrize("make", [
    lambda: tfnng.optimizers.VOGN(0.1, num_examples=N, fisher="empirical"),
    lambda: tfnng.optimizers.SLANG(0.1, num_examples=N, rank=2, fisher="empirical"),
    lambda: tfnng.optimizers.NoisyNaturalGradient(0.1, num_examples=N, fisher="empirical"),
])
def test_layers_on_the_generic_path_are_named_once_at_build(make, caplog):
    """Only layers with Bayesian weights: NoisePrecision's point-estimated q(tau) needs no
    per-example gradients."""
    keras.utils.set_random_seed(0)
    net = keras.Sequential([keras.Input((D,), dtype=F64), Wiggle(dtype=F64, name="wiggle"),
                            keras.layers.Dense(1, dtype=F64, name="out"),
                            tfnng.layers.NoisePrecision(N, dtype=F64)])
    optimizer = make()
    with caplog.at_level(logging.INFO, logger="tfnng"):
        make_step(net, optimizer, tfnng.losses.GaussianNLL("learned", dtype=F64))
    messages = [r.getMessage() for r in caplog.records if r.name == "tfnng"]
    assert len(messages) == 1 and "generic path" in messages[0], messages
    listed = messages[0].split(" gradients of ")[1].split(" by the generic path")[0].split(", ")
    assert [path.rsplit("/", 1)[-1] for path in listed] == ["wiggle"], messages   # not "out", "noise_precision"


@pytest.mark.parametrize("make", [
    lambda: tfnng.optimizers.SLANG(0.01, num_examples=1000, rank=2, seed=0),
    lambda: tfnng.optimizers.NoisyNaturalGradient(0.01, num_examples=1000, seed=0)],
    ids=["SLANG", "NNG-full"])
def test_a_float64_layer_after_a_float32_one_keeps_its_precision(make):
    """The flat posterior took the dtype of the first Bayesian variable: a float64 layer after a
    float32 one was rounded to float32 at every step (its mean moved at learning rate 0), and
    posterior_stddev of the float32 layer came back in float64."""
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(32, 4)).astype("float32"), rng.integers(0, 2, size=32)
    for learning_rate in (0.0, 0.01):
        keras.utils.set_random_seed(0)
        net = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="tanh"),
                                keras.layers.Dense(2, dtype=F64)])
        kernel = net.layers[1].kernel
        kernel.assign(kernel.numpy() + 1e-12)           # digits that float32 cannot hold
        initial = kernel.numpy()
        model = tfnng.BayesianModel(net)
        optimizer = make()
        optimizer.learning_rate = learning_rate
        model.compile(optimizer=optimizer, loss=tfnng.losses.CategoricalNLL())
        model.fit(x, y, batch_size=16, epochs=1, verbose=0, shuffle=False)
        mean = optimizer.posterior_mean(kernel).numpy()
        if learning_rate == 0.0:
            np.testing.assert_array_equal(mean, initial)
        else:
            assert np.any(mean != mean.astype(np.float32).astype(np.float64))
        for variable in net.trainable_variables:
            assert optimizer.posterior_mean(variable).dtype == variable.dtype
            assert optimizer.posterior_stddev(variable).dtype == variable.dtype
            assert variable.dtype == ("float64" if variable.path.startswith(net.layers[1].path)
                                      else "float32")


@pytest.mark.parametrize("make", [
    lambda: tfnng.optimizers.SLANG(0.05, num_examples=32, rank=2, seed=3),
    lambda: tfnng.optimizers.NoisyNaturalGradient(0.05, num_examples=32, seed=3),
    lambda: tfnng.optimizers.VOGN(0.05, num_examples=32, seed=3)],
    ids=["SLANG", "NNG-full", "VOGN"])
def test_a_layer_frozen_in_a_hand_written_loop_is_left_alone_or_refused(make):
    """SLANG and NNG-full moved a layer frozen after the build (its mean, and a new sample written
    into it at every step) although the loop no longer passed it: they now refuse, naming it;
    VOGN, whose posterior is per variable, leaves it alone."""
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(16, 4)).astype("float32"), rng.normal(size=(16, 1)).astype("float32")
    keras.utils.set_random_seed(1)
    net = keras.Sequential([keras.Input((4,)), keras.layers.Dense(5, activation="tanh"),
                            keras.layers.Dense(1)])
    optimizer = make()
    step = make_step(net, optimizer, tfnng.losses.GaussianNLL(noise_variance=0.5), compiled=False)
    step(x[:8], y[:8])
    net.layers[0].trainable = False
    kernel = net.layers[0].kernel
    before = kernel.numpy(), optimizer.posterior_mean(kernel).numpy()
    if isinstance(optimizer, tfnng.optimizers.VOGN):
        step(x[8:], y[8:])
        np.testing.assert_array_equal(kernel.numpy(), before[0])
        np.testing.assert_array_equal(optimizer.posterior_mean(kernel).numpy(), before[1])
    else:
        with pytest.raises(ValueError, match=f"{kernel.path}.* no longer trainable .*jointly"):
            step(x[8:], y[8:])


def test_freezing_a_generic_path_layer_after_build_says_why_it_fails():
    """SLANG/NNG-full hold one posterior over the variables they were built for: a layer frozen
    afterwards (here one without a fast path) is named as frozen, not just as missing."""
    keras.utils.set_random_seed(0)
    norm = keras.layers.LayerNormalization()
    net = keras.Sequential([keras.Input((D,)), keras.layers.Dense(2, activation="tanh"), norm,
                            keras.layers.Dense(1)])
    x, y, _, _ = regression_data()
    model = tfnng.BayesianModel(net)
    optimizer = tfnng.optimizers.SLANG(0.01, num_examples=N, rank=2, seed=0)
    model.compile(optimizer=optimizer, loss=tfnng.losses.GaussianNLL(noise_variance=NOISE_VAR))
    model.fit(x.astype("float32"), y.astype("float32"), batch_size=20, epochs=1, verbose=0)
    norm.trainable = False
    model.compile(optimizer=optimizer, loss=tfnng.losses.GaussianNLL(noise_variance=NOISE_VAR))
    with pytest.raises(ValueError, match="no longer trainable"):
        model.fit(x.astype("float32"), y.astype("float32"), batch_size=20, epochs=1, verbose=0)


@pytest.mark.parametrize("frozen", [None, "a"])
def test_layers_sharing_a_name_keep_their_statistics_after_a_freeze_and_recompile(frozen):
    """Three Dense layers named "d": freezing the first renamed the capture of the others (d_1 to
    d, d_2 to d_1), so VOGN, recompiled, read each layer's statistics from another layer (an error
    here, where the shapes differ; silently wrong curvature where they agree). With beta = 1 the
    curvature after a step is that step's mean squared per-example gradient, checked against a
    loop over single examples."""

    class Net(keras.Model):
        def __init__(self):
            super().__init__()
            self.a = keras.layers.Dense(4, activation="tanh", name="d")
            self.b = keras.layers.Dense(4, activation="tanh", name="d")
            self.c = keras.layers.Dense(1, name="d")

        def call(self, x):
            return self.c(self.b(self.a(x)))

    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(8, 3)).astype("float32"), rng.normal(size=(8, 1)).astype("float32")
    keras.utils.set_random_seed(0)
    net = Net()
    net(x[:1])
    optimizer = tfnng.optimizers.VOGN(1e-2, num_examples=8, fisher="empirical", beta=1.0)
    loss = tfnng.losses.GaussianNLL(noise_variance=0.5)
    model = tfnng.BayesianModel(net)
    model.compile(optimizer=optimizer, loss=loss)
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    if frozen:
        getattr(net, frozen).trainable = False
    model.compile(optimizer=optimizer, loss=loss)
    expected = []
    for layer in (net.b, net.c):
        rows = []
        for n in range(8):
            with tf.GradientTape() as tape:
                log_p = loss.log_prob(y[n:n + 1], net(x[n:n + 1]))
            rows.append(tape.gradient(log_p, layer.kernel).numpy())
        expected.append(np.mean(np.square(rows), axis=0))
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    for layer, squares in zip((net.b, net.c), expected):
        curvature = optimizer._slot("hessian", optimizer._get_variable_index(layer.kernel)).numpy()
        np.testing.assert_allclose(curvature, squares, rtol=1e-4)


def test_slang_below_full_rank_reports_and_samples_its_dense_covariance():
    """Rank 1 < D: posterior_stddev and the sampler's root R (c R R^T) against the numpy covariance
    c (U U^T + diag d)^-1, c = lambda / N."""
    x, y, _, _ = regression_data()
    net = linear_net()
    optimizer = tfnng.optimizers.SLANG(0.1, num_examples=N, rank=1, beta=0.3, prior_variance=ETA,
                                       fisher="empirical", seed=0)
    step = make_step(net, optimizer, tfnng.losses.GaussianNLL(noise_variance=NOISE_VAR))
    for k in range(5):
        step(x[10 * k:10 * (k + 1)], y[10 * k:10 * (k + 1)])
    u, d = optimizer._low_rank.numpy(), optimizer._diagonal.numpy()
    covariance = np.linalg.inv(u @ u.T + np.diag(d)) / N
    assert np.abs(covariance[0, 1]) > 0.1 * np.sqrt(covariance[0, 0] * covariance[1, 1])   # correlated
    np.testing.assert_allclose(optimizer.posterior_stddev(net.trainable_variables[0]).numpy()[:, 0],
                               np.sqrt(np.diag(covariance)), rtol=1e-10)
    root = optimizer.perturb(optimizer.sampling_state(), tf.eye(D, dtype=tf.float64)).numpy()
    np.testing.assert_allclose(root @ root.T / N, covariance, rtol=1e-10, atol=1e-14)


@pytest.mark.parametrize("make", [
    lambda beta: tfnng.optimizers.NoisyNaturalGradient(
        1e-2, num_examples=10, beta=beta, max_parameters=20000, fisher="empirical", hess_init=0.3),
    lambda beta: tfnng.optimizers.SLANG(
        1e-2, num_examples=10, beta=beta, rank=3, eig_method="randomized", oversampling=4,
        power_iterations=1, fisher="empirical", hess_init=0.3),
    lambda beta: tfnng.optimizers.VOGN(1e-2, num_examples=10, beta=beta, fisher="empirical",
                                       hess_init=0.3)], ids=["nng", "slang", "vogn"])
def test_config_round_trip_keeps_every_argument_and_a_beta_schedule(make):
    """The clone's attributes are the constructor's (a key missing from the config would pass a
    config-to-config comparison); a beta schedule survives as a JSON config."""
    optimizer = make(0.2)
    restored = type(optimizer).from_config(optimizer.get_config())
    names = {tfnng.optimizers.NoisyNaturalGradient: ("max_parameters",),
             tfnng.optimizers.SLANG: ("rank", "eig_method", "oversampling", "power_iterations")
             }.get(type(optimizer), ())
    for name in names + ("fisher", "hess_init", "beta"):
        assert getattr(restored, name) == getattr(optimizer, name), name
    assert (restored.fisher, restored.hess_init) == ("empirical", 0.3)
    schedule = keras.optimizers.schedules.PiecewiseConstantDecay([10], [0.5, 0.1])
    config = json.loads(json.dumps(make(schedule).get_config()))
    restored = type(optimizer).from_config(config)
    assert isinstance(restored.beta, keras.optimizers.schedules.PiecewiseConstantDecay)
    np.testing.assert_allclose([float(restored.beta(step)) for step in (0, 20)], [0.5, 0.1], rtol=1e-6)
