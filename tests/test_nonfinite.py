"""The non-finite policy of NoisyOptimizer (``nonfinite="skip"`` / ``"raise"``): NaN/Inf in gradients
or in curvature statistics never reaches the posterior; "skip" counts and warns, "raise" fails
before any state changes, and bad policy values are rejected."""

import logging
import re

import numpy as np
import pytest
import tensorflow as tf
import keras

import tfnng
from tfnng.curvature import capture as cap


def regression_data(n=48, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 3)).astype("float32")
    y = (x[:, :1] - 0.5 * x[:, 1:2]).astype("float32")
    return x, y


def small_net():
    return keras.Sequential([keras.Input((3,)), keras.layers.Dense(5, activation="tanh"),
                             keras.layers.Dense(1)])


def posterior_state(optimizer):
    """Every optimizer variable except Keras's own step counter, by path."""
    return {v.path: v.numpy().copy() for v in optimizer.variables if "iteration" not in v.path}


# What a skipped update changes: its count, and the noise generator that drew the fresh sample.
SKIP_CHANGES = ("skipped_updates", "seed_generator_state")


def assert_same_state(before, after, ignore=()):
    assert before.keys() == after.keys()
    for path in before:
        if not path.endswith(ignore):
            np.testing.assert_array_equal(before[path], after[path], err_msg=path)


class StateRecorder(keras.callbacks.Callback):
    """Records the optimizer state and the model's weights after every training batch."""

    def __init__(self):
        super().__init__()
        self.states, self.weights = [], []

    def on_train_batch_end(self, batch, logs=None):
        self.states.append(posterior_state(self.model.optimizer))
        self.weights.append([v.numpy().copy() for v in self.model.trainable_variables])


def tfnng_warnings(caplog):
    return [r.getMessage() for r in caplog.records
            if r.name == "tfnng" and r.levelno == logging.WARNING and "skipped" in r.getMessage()]


@pytest.mark.parametrize("bad", ["ignore", "Skip", None, 1, ("skip",)])
def test_bad_policy_is_rejected(bad):
    with pytest.raises(ValueError, match="nonfinite"):
        tfnng.optimizers.NoisyAdam(num_examples=10, nonfinite=bad)


def test_policy_round_trips_through_get_config():
    for optimizer in (tfnng.optimizers.IVON(num_examples=10, nonfinite="raise"),
                      tfnng.optimizers.KFAC(damping=0.1, nonfinite="raise"),
                      tfnng.optimizers.Vadam(num_examples=10)):
        config = optimizer.get_config()
        clone = type(optimizer).from_config(config)
        assert clone.nonfinite == config["nonfinite"] == optimizer.nonfinite
    assert tfnng.optimizers.Vadam(num_examples=10).nonfinite == "skip"


@pytest.mark.parametrize("jit_compile", [False, True])
def test_skip_in_fit_keeps_the_posterior_counts_and_warns_without_xla(jit_compile, caplog):
    keras.utils.set_random_seed(0)
    x, y = regression_data()
    y[20] = np.nan                                   # only the second batch of 16 is bad
    model = small_net()
    optimizer = tfnng.optimizers.NoisyAdam(learning_rate=0.05, num_examples=len(x), seed=0)
    model.compile(optimizer=optimizer, loss="mse", jit_compile=jit_compile)
    recorder = StateRecorder()
    with caplog.at_level(logging.WARNING, logger="tfnng"):
        model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0, callbacks=[recorder])
    after_good, after_bad, after_next = recorder.states
    mean_paths = [p for p in after_good if p.endswith(("posterior_mean", "momentum", "fisher"))]
    assert len(mean_paths) == 3 * len(model.trainable_variables)
    for path in mean_paths:                           # the bad batch changed no posterior state
        np.testing.assert_array_equal(after_bad[path], after_good[path], err_msg=path)
        assert not np.array_equal(after_next[path], after_bad[path]), path
    assert optimizer.skipped_updates == 1
    assert int(optimizer._update_count.numpy()) == 2
    # ... but the model holds a fresh, finite sample of the unchanged posterior
    assert all(np.isfinite(w).all() for w in recorder.weights[1])
    assert not np.array_equal(recorder.weights[1][0], recorder.weights[0][0])
    messages = tfnng_warnings(caplog)
    if jit_compile:
        assert messages == []                       # XLA cannot call back into Python
    else:
        assert len(messages) == 1
        for variable in model.trainable_variables:
            assert f"the gradient of {variable.path}" in messages[0]
        assert "1 updates skipped" in messages[0]


def test_skip_warnings_repeat_at_powers_of_two_in_a_tape_loop(caplog):
    w = tf.Variable(tf.ones((3, 2)), name="w")
    optimizer = tfnng.optimizers.Vadam(learning_rate=0.1, num_examples=10)
    optimizer.apply_gradients([(tf.ones_like(w), w)])
    before = posterior_state(optimizer)
    bad = tf.constant([[1.0, np.nan], [0.0, 1.0], [np.inf, 2.0]])
    with caplog.at_level(logging.WARNING, logger="tfnng"):
        for _ in range(5):
            optimizer.apply_gradients([(bad, w)])
    assert optimizer.skipped_updates == 5
    assert_same_state(before, posterior_state(optimizer), ignore=SKIP_CHANGES)
    messages = tfnng_warnings(caplog)
    assert [int(re.search(r"\((\d+) updates skipped", m).group(1)) for m in messages] == [1, 2, 4]
    assert all("the gradient of w:0" in m for m in messages)
    assert np.isfinite(w.numpy()).all()


@pytest.mark.parametrize("clip", [{"clipvalue": 1.0}, {"clipnorm": 1.0}, {"global_clipnorm": 1.0}])
def test_skip_and_raise_judge_the_gradients_before_keras_clipping(clip):
    """clipvalue turned an Inf or 1e20 gradient into a finite one before the skip check (the raise
    check came first): the two policies disagreed about the same step."""
    for bad in ([np.inf, 0.1], [1e20, 0.1], [np.nan, 0.1]):
        for policy in ("skip", "raise"):
            w = tf.Variable([1.0, 2.0], name="w")
            optimizer = tfnng.optimizers.Vadam(0.1, num_examples=10, seed=0, nonfinite=policy, **clip)
            optimizer.apply_gradients([(tf.constant([0.5, 0.5]), w)])
            before = posterior_state(optimizer)
            if policy == "skip":
                optimizer.apply_gradients([(tf.constant(bad), w)])
                assert optimizer.skipped_updates == 1
            else:
                with pytest.raises(tf.errors.InvalidArgumentError):
                    optimizer.apply_gradients([(tf.constant(bad), w)])
            assert_same_state(before, posterior_state(optimizer),
                              ignore=SKIP_CHANGES if policy == "skip" else ())
    # A finite gradient is still clipped: [50, 0] clips to [1, 0] under each of the three options.
    w, v = tf.Variable([1.0, 2.0], name="w"), tf.Variable([1.0, 2.0], name="v")
    clipped = tfnng.optimizers.Vadam(0.1, num_examples=10, seed=0, **clip)
    clipped.apply_gradients([(tf.constant([50.0, 0.0]), w)])
    reference = tfnng.optimizers.Vadam(0.1, num_examples=10, seed=0)
    reference.apply_gradients([(tf.constant([1.0, 0.0]), v)])
    assert clipped.skipped_updates == 0
    np.testing.assert_array_equal(clipped.posterior_mean(w), reference.posterior_mean(v))
    np.testing.assert_array_equal(w.numpy(), v.numpy())


@pytest.mark.parametrize("name", ["NoisyAdam", "Vadam", "Vprop", "VadaGrad", "IVON"])
def test_finite_gradient_with_overflowing_square_is_not_applied(name):
    """1e20 is a finite float32 whose square is Inf: squared into the Fisher/Hessian estimate it
    would freeze the posterior (NoisyAdam: standard deviation 0 forever); it is skipped or raised
    like a NaN."""
    huge = tf.constant([1e20, 1.0, 1.0])
    assert np.isfinite(huge.numpy()).all() and not np.isfinite(np.square(huge.numpy())).all()
    for policy in ("skip", "raise"):
        w = tf.Variable(tf.ones((3,)), name="w")
        optimizer = getattr(tfnng.optimizers, name)(learning_rate=0.01, num_examples=100, seed=1,
                                                    nonfinite=policy)
        optimizer.apply_gradients([(tf.ones_like(w), w)])
        before = posterior_state(optimizer)
        if policy == "skip":
            optimizer.apply_gradients([(huge, w)])
            assert optimizer.skipped_updates == 1
        else:
            with pytest.raises(tf.errors.InvalidArgumentError, match="overflowing square"):
                optimizer.apply_gradients([(huge, w)])
        assert_same_state(before, posterior_state(optimizer),
                          ignore=SKIP_CHANGES if policy == "skip" else ())
        optimizer.apply_gradients([(tf.ones_like(w), w)])
        assert np.all(optimizer.posterior_stddev(w).numpy() > 0)
        assert np.isfinite(optimizer.posterior_mean(w).numpy()).all()


def test_raise_in_fit_names_the_variable_and_changes_nothing():
    keras.utils.set_random_seed(1)
    x, y = regression_data()
    model = small_net()
    optimizer = tfnng.optimizers.IVON(learning_rate=0.05, num_examples=len(x), seed=0,
                                      nonfinite="raise")
    model.compile(optimizer=optimizer, loss="mse", jit_compile=False)
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)          # finite data: trains normally
    before = posterior_state(optimizer)
    iterations = int(optimizer.iterations.numpy())
    weights = [v.numpy().copy() for v in model.trainable_variables]
    x_bad = x.copy()
    x_bad[3, 1] = np.inf                                         # first batch of the next fit
    with pytest.raises(tf.errors.InvalidArgumentError) as error:
        model.fit(x_bad, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    assert "nonfinite='raise'" in str(error.value)
    assert model.layers[0].kernel.path in str(error.value)
    assert_same_state(before, posterior_state(optimizer))
    assert int(optimizer.iterations.numpy()) == iterations     # Keras's counter too
    for variable, value in zip(model.trainable_variables, weights):
        np.testing.assert_array_equal(variable.numpy(), value)


def test_raise_eagerly_and_refusal_under_xla():
    w = tf.Variable(tf.ones((2,)), name="w")
    optimizer = tfnng.optimizers.NoisyAdam(learning_rate=0.1, num_examples=10, nonfinite="raise")
    optimizer.apply_gradients([(tf.ones_like(w), w)])
    before = posterior_state(optimizer)
    with pytest.raises(tf.errors.InvalidArgumentError, match="gradient of w:0"):
        optimizer.apply_gradients([(tf.constant([np.nan, 1.0]), w)])
    assert_same_state(before, posterior_state(optimizer))

    x, y = regression_data(n=16)
    model = small_net()
    model.compile(optimizer=tfnng.optimizers.NoisyAdam(num_examples=16, nonfinite="raise"),
                  loss="mse", jit_compile=True)
    with pytest.raises(ValueError, match="jit_compile=False"):
        model.fit(x, y, batch_size=16, epochs=1, verbose=0)


def kfac_setup(optimizer_class):
    keras.utils.set_random_seed(3)
    rng = np.random.default_rng(3)
    x = rng.normal(size=(32, 4)).astype("float32")
    y = (x[:, 0] - x[:, 1] > 0).astype("int32")
    net = keras.Sequential([keras.Input((4,)), keras.layers.Dense(6, activation="tanh"),
                            keras.layers.Dense(2)])
    kwargs = {"damping": 0.01} if optimizer_class is tfnng.optimizers.KFAC else {"num_examples": 32}
    optimizers = {policy: optimizer_class(learning_rate=0.05, stats_every=1, inverse_every=1,
                                          seed=0, nonfinite=policy, **kwargs)
                  for policy in ("skip", "raise")}
    return net, x, y, optimizers


def curvature_step(net, capture, optimizer, x, y, corrupt=None):
    loss_fn = tfnng.losses.CategoricalNLL()
    _, _, grads, curvature = tfnng.models.gradients_and_curvature(
        net, capture, optimizer, loss_fn, x, y, seed=keras.random.SeedGenerator(0))
    if corrupt is not None:
        record = curvature[corrupt]
        record.preactivation_grads = tf.tensor_scatter_nd_update(
            record.preactivation_grads, [[0, 0]], tf.constant([np.nan], tf.float32))
    assert all(np.isfinite(g.numpy()).all() for g in grads)     # only the curvature is bad
    optimizer.apply_gradients(zip(grads, net.trainable_variables), curvature=curvature)


@pytest.mark.parametrize("optimizer_class", [tfnng.optimizers.NoisyKFAC, tfnng.optimizers.KFAC])
def test_nan_in_kfac_curvature_statistics_never_reaches_the_factors(optimizer_class, caplog):
    net, x, y, optimizers = kfac_setup(optimizer_class)
    initial = [v.numpy().copy() for v in net.trainable_variables]
    for policy, optimizer in optimizers.items():
        for variable, value in zip(net.trainable_variables, initial):
            variable.assign(value)
        capture = cap.LayerCapture(net)
        optimizer.prepare_curvature(capture.specs)
        curvature_step(net, capture, optimizer, x[:16], y[:16])          # a good step first
        before = posterior_state(optimizer)
        factor_paths = [p for p in before if p.endswith(("_a", "_s", "_a_inv", "_s_inv"))]
        assert len(factor_paths) == 8 and all(np.abs(before[p]).sum() > 0 for p in factor_paths)
        layer = capture.specs[1].name
        if policy == "skip":
            with caplog.at_level(logging.WARNING, logger="tfnng"):
                curvature_step(net, capture, optimizer, x[16:], y[16:], corrupt=layer)
            messages = tfnng_warnings(caplog)
            assert len(messages) == 1
            assert f"the pre-activation gradients captured for {layer}" in messages[0]
            assert "the gradient of" not in messages[0]
            assert optimizer.skipped_updates == 1
        else:
            with pytest.raises(tf.errors.InvalidArgumentError,
                               match=f"pre-activation gradients captured for {layer}"):
                curvature_step(net, capture, optimizer, x[16:], y[16:], corrupt=layer)
        assert_same_state(before, posterior_state(optimizer),
                          ignore=SKIP_CHANGES if policy == "skip" else ())
        assert all(np.isfinite(v.numpy()).all() for v in net.trainable_variables)
        curvature_step(net, capture, optimizer, x[16:], y[16:])          # and training goes on
        assert int(optimizer._update_count.numpy()) == 2


@pytest.mark.parametrize("make", [
    lambda: tfnng.optimizers.VOGN(1e-3, num_examples=1000, fisher="empirical", seed=0),
    lambda: tfnng.optimizers.SLANG(1e-3, num_examples=1000, rank=2, fisher="empirical", seed=0),
    lambda: tfnng.optimizers.NoisyNaturalGradient(1e-3, num_examples=1000, fisher="empirical",
                                                  seed=0),
    lambda: tfnng.optimizers.NoisyAdam(1e-3, num_examples=1000, fisher="empirical", seed=0),
], ids=["vogn", "slang", "nng_full", "noisy_adam"])
def test_overflowing_per_example_products_are_skipped(make):
    """One example with inputs of 1e10: its inputs (1e20 squared) and pre-activation gradients
    (~7e24 squared) and the batch gradient (~4e37 squared) are finite, but its per-example
    gradient's square (~7e44) is not. The squared per-example gradients put Inf into VOGN's and
    NoisyAdam's curvature (standard deviation 0, mean frozen for good), and NaN into NNG-full's
    factor; the step must be skipped like any non-finite statistic, and training go on."""
    x, y = regression_data(64)
    x = np.concatenate([x, x[:, :1]], axis=1)
    outlier = x.copy()
    outlier[0] = 1e10
    keras.utils.set_random_seed(0)
    net = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1, kernel_initializer="ones")])
    model = tfnng.BayesianModel(net)
    optimizer = make()
    model.compile(optimizer=optimizer, loss=tfnng.losses.GaussianNLL(1.0))
    model.train_on_batch(x, y)
    kernel = net.layers[0].kernel
    mean = optimizer.posterior_mean(kernel).numpy()
    before = posterior_state(optimizer)
    model.train_on_batch(outlier, y)
    assert optimizer.skipped_updates == 1
    assert_same_state(before, posterior_state(optimizer), ignore=SKIP_CHANGES)
    for _ in range(3):
        model.train_on_batch(x, y)
    stddev = optimizer.posterior_stddev(kernel).numpy()
    assert np.all(np.isfinite(stddev)) and np.all(stddev > 0)
    assert np.all(optimizer.posterior_mean(kernel).numpy() != mean)


def test_skipped_nan_target_batch_leaves_the_true_fisher_factors_unchanged():
    """A NaN target skips the update: the true Fisher's (finite, sampled-target) statistics change no factor."""
    keras.utils.set_random_seed(0)
    x, y = regression_data()
    y[20] = np.nan                                   # only the second batch of 16 is bad
    model = tfnng.BayesianModel(small_net())
    optimizer = tfnng.optimizers.NoisyKFAC(learning_rate=0.05, num_examples=len(x), stats_every=1,
                                           inverse_every=1, seed=0)
    model.compile(optimizer=optimizer, loss=tfnng.losses.GaussianNLL(0.5))
    recorder = StateRecorder()
    model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0, callbacks=[recorder])
    assert optimizer.skipped_updates == 1
    after_good, after_bad, _ = recorder.states
    assert_same_state(after_good, after_bad, ignore=SKIP_CHANGES)


def test_factor_overflowing_in_its_sum_is_not_averaged_in():
    """Two inputs of 1.5e19 pass the step's guard but A = x^T x / B overflows: the factors stay as they were."""
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(8, 3)).astype("float32")
    x[0, 0] = x[1, 0] = 1.5e19                         # x^2 sums to 4.5e38 > float32 max
    y = rng.integers(0, 2, 8)
    net = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4, activation="tanh"),
                            keras.layers.Dense(2)])
    capture = cap.LayerCapture(net)
    optimizer = tfnng.optimizers.NoisyKFAC(learning_rate=1e-2, num_examples=100, stats_every=1,
                                           inverse_every=1, seed=0)
    optimizer.prepare_curvature(capture.specs)
    optimizer.build(net.trainable_variables)
    before = posterior_state(optimizer)
    curvature_step(net, capture, optimizer, x, y)
    after = posterior_state(optimizer)
    paths = [p for p in before if p.endswith(("_a", "_s", "_a_inv", "_s_inv", "stats_count"))]
    assert len(paths) == 9
    for path in paths:
        np.testing.assert_array_equal(before[path], after[path], err_msg=path)
    assert optimizer.inverse_failures == 0


@pytest.mark.parametrize("nan_at", [0, 1])
def test_skipped_evaluation_is_neither_summed_nor_counted_in_an_mc_group(nan_at):
    """mc_samples=2: a NaN evaluation is skipped whole; each update uses the mean of two finite gradients."""
    finite = [np.array([1.0, -2.0]), np.array([3.0, 0.5]), np.array([-1.0, 4.0]), np.array([2.0, 2.0])]
    grads = finite[:nan_at] + [np.array([np.nan, 1.0])] + finite[nan_at:]
    w = tf.Variable([0.5, -0.5], dtype=tf.float64)
    optimizer = tfnng.optimizers.Vprop(learning_rate=0.1, num_examples=10, mc_samples=2, seed=0)
    for g in grads:
        optimizer.apply_gradients([(tf.constant(g, tf.float64), w)])
    assert optimizer.skipped_updates == 1
    assert int(optimizer._update_count.numpy()) == 2
    mu, s, damping, beta_2 = np.array([0.5, -0.5]), np.ones(2), optimizer.intrinsic_damping, 0.999
    for g in (np.mean(finite[:2], axis=0), np.mean(finite[2:], axis=0)):
        s = beta_2 * s + (1 - beta_2) * g ** 2
        mu = mu - 0.1 * (g + damping * mu) / (np.sqrt(s) + damping)
    np.testing.assert_allclose(optimizer.posterior_mean(w).numpy(), mu, rtol=1e-6)
