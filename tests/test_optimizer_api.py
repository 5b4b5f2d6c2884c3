"""The diagonal optimizers as Keras citizens: fit (jit on/off), tape loops, retracing, MC samples,
posterior access, serialization and bad input."""

import numpy as np
import scipy.sparse
import pytest
import tensorflow as tf
import keras

import tfnng
from tfnng.predict import predictive_moments

METHODS = {
    "noisy_adam": tfnng.optimizers.NoisyAdam,
    "vadam": tfnng.optimizers.Vadam,
    "vprop": tfnng.optimizers.Vprop,
    "vadagrad": tfnng.optimizers.VadaGrad,
    "ivon": tfnng.optimizers.IVON,
}


def regression_data(n=128, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 4)).astype("float32")
    y = (np.sin(x[:, :1]) + 0.5 * x[:, 1:2] + 0.1 * rng.normal(size=(n, 1))).astype("float32")
    return x, y


def small_net():
    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(16, activation="tanh"),
                             keras.layers.Dense(1)])


@pytest.mark.parametrize("jit_compile", [False, True])
@pytest.mark.parametrize("method", sorted(METHODS))
def test_fit_reduces_loss_and_keeps_variables_at_posterior_samples(method, jit_compile):
    keras.utils.set_random_seed(0)
    x, y = regression_data()
    model = small_net()
    optimizer = METHODS[method](learning_rate=0.1 if method == "ivon" else 0.01,
                                num_examples=len(x), seed=0)
    model.compile(optimizer=optimizer, loss="mse", jit_compile=jit_compile)
    first = model.evaluate(x, y, verbose=0)
    history = model.fit(x, y, batch_size=16, epochs=15, verbose=0)
    with optimizer.use_mean():
        at_mean = model.evaluate(x, y, verbose=0)
    assert np.isfinite(history.history["loss"]).all()
    assert at_mean < 0.7 * first
    kernel = model.layers[0].kernel
    sample = kernel.numpy()
    std = optimizer.posterior_stddev(kernel).numpy()
    z = (sample - optimizer.posterior_mean(kernel).numpy()) / std
    assert std.min() > 0 and 0.7 < z.std() < 1.3      # the model holds a draw from q
    assert int(optimizer._update_count.numpy()) == 15 * len(x) // 16


@pytest.mark.parametrize("jit_compile", [False, True])
def test_fit_starts_the_posterior_at_the_initial_weights_and_hess_init(jit_compile):
    """Keras builds the optimizer while tracing the train function: state must still start right."""
    x, y = regression_data()
    model = small_net()
    initial = [v.numpy() for v in model.trainable_variables]
    optimizer = tfnng.optimizers.IVON(learning_rate=0.0, num_examples=len(x), hess_init=0.7)
    model.compile(optimizer=optimizer, loss="mse", jit_compile=jit_compile)
    model.fit(x[:16], y[:16], batch_size=16, epochs=1, verbose=0)
    for variable, value in zip(model.trainable_variables, initial):
        np.testing.assert_array_equal(optimizer.posterior_mean(variable).numpy(), value)
        np.testing.assert_allclose(optimizer._slot("hess", 0).numpy(), 0.7, rtol=1e-4)


def test_a_new_optimizer_starts_from_the_weights_the_model_holds():
    """The recipe of docs/which_optimizer.md, "Switching optimizers": after fit the model holds a
    sample, which a newly compiled optimizer takes as its mean unless the old mean is written in."""
    x, y = regression_data()
    model = small_net()
    model.compile(optimizer=tfnng.optimizers.NoisyAdam(learning_rate=0.01, num_examples=len(x)),
                  loss="mse")
    model.fit(x, y, batch_size=32, epochs=2, verbose=0)
    old = model.optimizer
    sample = [v.numpy() for v in model.trainable_variables]
    mean = [old.posterior_mean(v).numpy() for v in model.trainable_variables]

    def first_mean_of_a_new_optimizer():
        model.compile(optimizer=tfnng.optimizers.IVON(learning_rate=0.0, num_examples=len(x)),
                      loss="mse")
        model.fit(x[:32], y[:32], batch_size=32, epochs=1, verbose=0)
        return [model.optimizer.posterior_mean(v).numpy() for v in model.trainable_variables]

    for got, want in zip(first_mean_of_a_new_optimizer(), sample):
        np.testing.assert_array_equal(got, want)
    for variable, value in zip(model.trainable_variables, sample):
        variable.assign(value)                       # back to the state fit left
    for variable in model.trainable_variables:       # the recipe
        variable.assign(old.posterior_mean(variable))
    for got, want in zip(first_mean_of_a_new_optimizer(), mean):
        np.testing.assert_array_equal(got, want)
    assert not np.allclose(mean[0], sample[0])


def noisy_adam_regression(num_examples):
    model = small_net()
    model.compile(optimizer=tfnng.optimizers.NoisyAdam(learning_rate=0.01, num_examples=num_examples),
                  loss=tfnng.losses.GaussianNLL(noise_variance=0.1))
    return model


def test_use_mean_restores_the_sample_and_predict_leaves_weights_unchanged():
    x, y = regression_data()
    model = noisy_adam_regression(len(x))
    model.fit(x, y, batch_size=32, epochs=1, verbose=0)
    kernel = model.layers[0].kernel
    before = kernel.numpy()
    with model.optimizer.use_mean():
        np.testing.assert_array_equal(kernel.numpy(), model.optimizer.posterior_mean(kernel).numpy())
    np.testing.assert_array_equal(kernel.numpy(), before)
    tfnng.predict(model, x, num_samples=3)
    np.testing.assert_array_equal(kernel.numpy(), before)


def test_predict_keeps_frozen_variables_fixed_and_restores_every_variable():
    """Variables frozen after training keep their values during and after tfnng.predict."""
    x, y = regression_data()
    model = noisy_adam_regression(len(x))
    model.fit(x, y, batch_size=32, epochs=1, verbose=0)
    before = [v.numpy() for v in model.variables]
    model.trainable = False
    prediction = tfnng.predict(model, x[:5], num_samples=4)
    np.testing.assert_array_equal(prediction.epistemic_variance, 0.0)   # nothing sampled
    np.testing.assert_allclose(prediction.mean, model(x[:5]).numpy(), rtol=1e-5, atol=1e-6)
    model.trainable = True
    model.layers[0].trainable = False
    prediction = tfnng.predict(model, x[:5], num_samples=4)
    assert prediction.epistemic_variance.min() > 0                      # the last layer is
    for variable, value in zip(model.variables, before):
        np.testing.assert_array_equal(variable.numpy(), value)


def test_predictive_log_likelihood_is_the_log_mean_exp_over_weight_samples():
    """``log (1/S) sum_s p(y | x, w_s)`` against SciPy's logsumexp of the likelihoods written out
    for the samples' outputs (a Gaussian of variance 0.1; a softmax), not the mean of the logs."""
    from scipy import special

    x, y = regression_data(n=32)
    for loss, targets in ((tfnng.losses.GaussianNLL(0.1), y),
                          (tfnng.losses.CategoricalNLL(), (y[:, 0] > 0).astype("int64"))):
        net = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1 if targets is y else 2)])
        net.compile(optimizer=tfnng.optimizers.NoisyAdam(num_examples=len(x), seed=0), loss=loss)
        net.fit(x, targets, batch_size=8, epochs=1, verbose=0)
        prediction = tfnng.predict(net, x, num_samples=50)
        out = prediction.outputs.astype(np.float64)                      # (S, N, d)
        if targets is y:
            per_sample = (-0.5 * (y - out) ** 2 / 0.1 - 0.5 * np.log(2 * np.pi * 0.1))[..., 0]
        else:
            per_sample = special.log_softmax(out, axis=-1)[:, np.arange(len(x)), targets]
        assert np.ptp(per_sample, axis=0).max() > 0.1            # the samples do differ
        np.testing.assert_allclose(prediction.log_likelihood(targets),
                                   special.logsumexp(per_sample, axis=0) - np.log(50), rtol=1e-5)


def test_predict_with_a_point_estimate_gives_the_one_forward_pass():
    x, y = regression_data(n=16)
    net = small_net()
    net.compile(optimizer="adam", loss=tfnng.losses.GaussianNLL(0.1))
    prediction = tfnng.predict(net, x, num_samples=20, return_samples=True)
    assert prediction.outputs.shape == (1, 16, 1)
    np.testing.assert_allclose(prediction.mean, net(x).numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(prediction.epistemic_variance, 0.0)


def test_predict_traces_once_draws_anew_each_call_and_keeps_nothing_alive():
    """Repeated calls reuse one trace of the forward pass and of the draw, yet sample fresh weights;
    the traces hold neither model nor optimizer."""
    import gc
    import weakref
    from tfnng.predict import _FORWARD_PASSES, _POSTERIOR_DRAWS

    x, y = regression_data(n=32)
    model = noisy_adam_regression(len(x))
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    first = tfnng.predict(model, x, num_samples=3).outputs
    second = tfnng.predict(model, x, num_samples=3).outputs
    assert not np.allclose(first, second)                                  # fresh weight samples
    assert _FORWARD_PASSES[model].experimental_get_tracing_count() == 1
    assert _POSTERIOR_DRAWS[model.optimizer].experimental_get_tracing_count() == 1
    alive = weakref.ref(model), weakref.ref(model.optimizer)
    del model
    gc.collect()
    assert alive[0]() is None and alive[1]() is None


def test_predict_rejects_bad_arguments_and_an_untrained_posterior():
    x, y = regression_data(n=16)
    model = noisy_adam_regression(len(x))
    with pytest.raises(ValueError, match="no posterior yet"):       # not one silent deterministic draw
        tfnng.predict(model, x, num_samples=10)
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    for bad in (tf.data.Dataset.from_tensor_slices(x).batch(4), [x, x], {"x": x}):
        with pytest.raises(TypeError, match="one array or tensor"):
            tfnng.predict(model, bad, num_samples=2)
    with pytest.raises(ValueError, match="at least one input example"):
        tfnng.predict(model, x[:0], num_samples=2)
    with pytest.raises(ValueError, match="contain NaN or Inf"):          # NaN rows, silently
        tfnng.predict(model, np.where(np.eye(16, 4) > 0, np.inf, x), num_samples=2)
    for bad in (np.nan, np.inf):     # -inf silently, or an error about `per_sample_log_probs`
        with pytest.raises(ValueError, match="targets `y` contain NaN or Inf"):
            tfnng.predict(model, x, num_samples=2).log_likelihood(np.where(np.eye(16, 1) > 0, bad, y))
    tfnng.predict(model, x, num_samples=2)       # after a call, the relaxed trace took any width:
    with pytest.raises(ValueError, match=r"takes inputs of shape \(None, 4\)"):   # MatMul error
        tfnng.predict(model, x[:, :3], num_samples=2)
    for bad in (0, -2, 2.5):
        with pytest.raises(ValueError, match="batch_size"):
            tfnng.predict(model, x, num_samples=2, batch_size=bad)
    for bad in (0, 1.5, True):
        with pytest.raises(ValueError, match="num_samples"):
            tfnng.predict(model, x, num_samples=bad)
    nested = tfnng.predict(model, x[:3].tolist(), num_samples=2, batch_size=2)   # nested lists: one array
    assert nested.mean.shape == (3, 1)
    inputs = keras.Input((4,))
    two_outputs = keras.Model(inputs, [keras.layers.Dense(1)(inputs), keras.layers.Dense(1)(inputs)])
    two_outputs.compile(optimizer=tfnng.optimizers.NoisyAdam(num_examples=16),
                        loss=[tfnng.losses.GaussianNLL(), tfnng.losses.GaussianNLL()])
    two_outputs.fit(x, [y, y], epochs=1, verbose=0)
    weights = [v.numpy() for v in two_outputs.trainable_variables]
    with pytest.raises(ValueError, match="one output tensor"):        # was an AttributeError
        tfnng.predict(two_outputs, x, num_samples=2, likelihood=tfnng.losses.GaussianNLL())
    with pytest.raises(ValueError, match="compiled with 2 losses, one per output"):
        tfnng.predict(two_outputs, x, num_samples=2)
    for before, variable in zip(weights, two_outputs.trainable_variables):
        np.testing.assert_array_equal(before, variable.numpy())


@pytest.mark.parametrize("offset", [0.0, 1e5, -3e4])
def test_predictive_moments_of_predictions_far_from_zero_keep_float32_accuracy(offset):
    """Per-sample predictions 1e5 with a spread of 1e-2: the float32 mean over 200 samples was
    0.2 off and the epistemic variance (about that mean) 0.06 where the samples' is 1e-4; the
    moments now equal the float64 ones of the same float32 samples."""
    rng = np.random.default_rng(0)
    samples = (offset + 1e-2 * rng.normal(size=(200, 5, 1))).astype("float32")
    moments = predictive_moments(tf.constant(samples), tfnng.losses.GaussianNLL(noise_variance=1e-4))
    exact = samples.astype(np.float64)
    ulp = np.spacing(np.float32(max(abs(offset), 1.0)))
    np.testing.assert_allclose(moments["mean"], exact.mean(axis=0), rtol=0, atol=ulp)
    np.testing.assert_allclose(moments["epistemic_variance"], exact.var(axis=0), rtol=1e-4)
    np.testing.assert_allclose(moments["variance"], exact.var(axis=0) + 1e-4, rtol=1e-4)


def test_predict_takes_any_batch_size_of_a_sequential_built_by_fit():
    """Without keras.Input, Keras records the first batch's size in ``model.input_shape``."""
    x, y = regression_data(n=16)
    model = keras.Sequential([keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(1)])
    model.compile(optimizer=tfnng.optimizers.NoisyAdam(learning_rate=0.01, num_examples=16),
                  loss=tfnng.losses.GaussianNLL(noise_variance=0.1))
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    assert model.input_shape == (8, 4)
    assert tfnng.predict(model, x[:3], num_samples=2).mean.shape == (3, 1)
    with pytest.raises(ValueError, match=r"takes inputs of shape \(None, 4\)"):
        tfnng.predict(model, x[:3, :3], num_samples=2)


def test_predict_takes_sparse_inputs_as_their_dense_values():
    """A model on sparse inputs (bag of words) trains on a SparseTensor or a scipy matrix; predict
    failed in tf.convert_to_tensor."""
    x, y = regression_data(n=16)
    x = np.where(np.abs(x) > 0.5, x, 0).astype("float32")
    model = keras.Sequential([keras.Input((4,), sparse=True), keras.layers.Dense(1)])
    model.compile(optimizer=tfnng.optimizers.NoisyAdam(learning_rate=0.01, num_examples=16),
                  loss=tfnng.losses.GaussianNLL(noise_variance=0.1))
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    predictive, state = [], model.optimizer._seed_generator.state.numpy()
    for inputs in (x, tf.sparse.from_dense(x), scipy.sparse.csr_matrix(x)):
        model.optimizer._seed_generator.state.assign(state)        # the same weight samples
        predictive.append(tfnng.predict(model, inputs, num_samples=4))
    for sparse in predictive[1:]:
        np.testing.assert_array_equal(sparse.mean, predictive[0].mean)
        np.testing.assert_array_equal(sparse.epistemic_variance, predictive[0].epistemic_variance)
    assert np.all(predictive[0].epistemic_variance > 0)


def test_a_one_output_model_may_list_its_loss_or_name_its_output():
    """``loss=[l]`` or ``{name: l}`` (Keras accepts both for one output) is the likelihood ``l``; an
    output in a one-entry dict is the output (predict said "several outputs", and
    PredictiveValidation failed in a TensorFlow conversion), and so are its targets named the same
    way (PredictiveValidation said "`y` has 0 targets")."""
    x, y = regression_data(n=16)
    likelihood = tfnng.losses.GaussianNLL(noise_variance=0.1)
    predictive = {}
    for name, loss in [("bare", likelihood), ("list", [likelihood]), ("dict", {"out": likelihood}),
                       ("dict output", {"out": likelihood})]:
        keras.utils.set_random_seed(0)
        inputs = keras.Input((4,))
        outputs = keras.layers.Dense(1, name="out")(inputs)
        model = keras.Model(inputs, {"out": outputs} if name == "dict output" else outputs)
        model.compile(optimizer=tfnng.optimizers.NoisyAdam(num_examples=16, seed=0), loss=loss)
        targets = {"out": y} if name == "dict output" else y      # as Keras's fit takes them
        validation = tfnng.callbacks.PredictiveValidation(x, targets, num_samples=2)
        model.fit(x, targets, epochs=1, verbose=0, callbacks=[validation])
        predictive[name] = tfnng.predict(model, x, num_samples=2)
        assert np.isfinite(validation.model.history.history["val_pred_nll"]).all()
    for name in ("list", "dict", "dict output"):
        assert predictive[name].likelihood is likelihood
        np.testing.assert_array_equal(predictive[name].mean, predictive["bare"].mean)
    np.testing.assert_array_equal(predictive["dict output"].log_likelihood({"out": y}),
                                  predictive["dict output"].log_likelihood(y))
    with pytest.raises(ValueError, match="one array of targets, got a dict of 2"):
        predictive["dict output"].log_likelihood({"out": y, "other": y})
    with pytest.raises(TypeError, match=r"likelihood instance, e.g. `GaussianNLL\(\)`"):
        tfnng.predict(model, x, num_samples=2, likelihood=tfnng.losses.GaussianNLL)


def test_hand_written_tape_loop_and_retracing():
    x, y = regression_data()
    model = small_net()
    optimizer = tfnng.optimizers.IVON(learning_rate=0.1, num_examples=len(x), seed=0)
    model.build((None, 4))
    optimizer.build(model.trainable_variables)
    traces = []

    @tf.function
    def step(xb, yb):
        traces.append(1)
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((model(xb, training=True) - yb) ** 2)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    losses = [float(step(x[i:i + bs], y[i:i + bs]))
              for bs in (16, 8, 32) for i in range(0, 96, bs)]
    assert len(traces) == 3                       # one trace per batch shape, state kept across them
    assert int(optimizer._update_count.numpy()) == 6 + 12 + 3
    assert np.isfinite(losses).all()
    eager_loss = tf.reduce_mean((model(x) - y) ** 2)  # the optimizer also works eagerly
    assert np.isfinite(eager_loss.numpy())


def test_mc_samples_update_once_per_group_of_evaluations():
    x, y = regression_data()
    model = small_net()
    optimizer = tfnng.optimizers.NoisyAdam(learning_rate=0.01, num_examples=len(x), mc_samples=4)
    model.compile(optimizer=optimizer, loss="mse")
    kernel = model.layers[0].kernel
    model.fit(x[:48], y[:48], batch_size=16, epochs=1, verbose=0, shuffle=False)   # 3 evaluations
    assert int(optimizer._update_count.numpy()) == 0
    mean_before = optimizer.posterior_mean(kernel).numpy()
    np.testing.assert_array_equal(mean_before, optimizer._means[0].numpy())
    model.fit(x[:16], y[:16], batch_size=16, epochs=1, verbose=0)                  # 4th: update
    assert int(optimizer._update_count.numpy()) == 1
    assert not np.allclose(optimizer.posterior_mean(kernel).numpy(), mean_before)


def test_nonfinite_gradients_skip_the_update_without_corrupting_the_posterior():
    w = tf.Variable(tf.ones((3, 2)))
    optimizer = tfnng.optimizers.NoisyAdam(learning_rate=0.1, num_examples=10)
    optimizer.apply_gradients([(tf.ones_like(w), w)])
    state = [v.numpy().copy() for v in optimizer.variables if v.path.endswith(("mean", "momentum", "fisher"))]
    bad = tf.constant([[1.0, np.nan], [0.0, 1.0], [np.inf, 2.0]])
    optimizer.apply_gradients([(bad, w)])
    after = [v.numpy() for v in optimizer.variables if v.path.endswith(("mean", "momentum", "fisher"))]
    for a, b in zip(state, after):
        np.testing.assert_array_equal(a, b)
    assert optimizer.skipped_updates == 1
    assert np.isfinite(w.numpy()).all()


def test_posterior_distribution_kl_and_marginals():
    x, y = regression_data()
    model = small_net()
    optimizer = tfnng.optimizers.Vadam(learning_rate=0.01, num_examples=len(x), prior_variance=2.0)
    model.compile(optimizer=optimizer, loss="mse")
    model.fit(x, y, batch_size=32, epochs=1, verbose=0)
    posterior = optimizer.posterior()
    assert set(posterior.model) == {v.path for v in model.trainable_variables}
    kernel = model.layers[0].kernel
    point = {v.path: optimizer.posterior_mean(v) for v in model.trainable_variables}
    expected = sum(
        float(tf.reduce_sum(tfnng.posteriors.diagonal.tfd.Normal(
            optimizer.posterior_mean(v), optimizer.posterior_stddev(v)).log_prob(point[v.path])))
        for v in model.trainable_variables)
    np.testing.assert_allclose(float(posterior.log_prob(point)), expected, rtol=1e-5)
    draw = posterior.sample(seed=1)
    assert draw[kernel.path].shape == kernel.shape
    assert float(optimizer.kl_divergence()) > 0


class UnregisteredDecay(keras.optimizers.schedules.LearningRateSchedule):
    """A user's schedule that is not registered with Keras."""

    def __init__(self, initial):
        self.initial = initial

    def __call__(self, step):
        return self.initial / (1.0 + tf.cast(step, tf.float32))

    def get_config(self):
        return {"initial": self.initial}


@pytest.mark.parametrize("make", [tfnng.optimizers.VOGN, tfnng.optimizers.SLANG,
                                  tfnng.optimizers.NoisyNaturalGradient])
def test_from_config_takes_custom_objects_for_a_beta_schedule(make):
    """Keras's from_config passed ``custom_objects`` to the learning rate only: an unregistered
    ``beta`` schedule failed ("Cannot deserialize object of type 'UnregisteredDecay'")."""
    optimizer = make(learning_rate=UnregisteredDecay(0.1), beta=UnregisteredDecay(0.5),
                     num_examples=10)
    clone = make.from_config(optimizer.get_config(),
                             custom_objects={"UnregisteredDecay": UnregisteredDecay})
    assert isinstance(clone.beta, UnregisteredDecay) and clone.beta.initial == 0.5
    assert clone.get_config() == optimizer.get_config()


@pytest.mark.parametrize("method", sorted(METHODS))
def test_config_round_trip_and_registered_serialization(method):
    optimizer = METHODS[method](learning_rate=0.02, num_examples=123, prior_variance=0.5,
                                kl_weight=0.3, mc_samples=2, seed=7)
    config = optimizer.get_config()
    clone = type(optimizer).from_config(config)
    assert clone.get_config() == config
    # The constructor's arguments themselves (a key missing from the config passes the line above)
    for name, value in (("num_examples", 123), ("prior_variance", 0.5), ("kl_weight", 0.3),
                        ("mc_samples", 2), ("seed", 7)):
        assert getattr(clone, name) == value, name
    assert clone.intrinsic_damping == pytest.approx(0.3 / (123 * 0.5))
    restored = keras.optimizers.deserialize(keras.optimizers.serialize(optimizer))
    assert type(restored) is type(optimizer) and restored.get_config() == config


def test_ivon_aliases_map_onto_the_common_vocabulary():
    by_alias = tfnng.optimizers.IVON(ess=200, weight_decay=1e-3, beta1=0.8, beta2=0.9)
    common = tfnng.optimizers.IVON(num_examples=200, prior_variance=1 / (200 * 1e-3),
                                   beta_1=0.8, beta_2=0.9)
    assert by_alias.get_config() | {"name": None} == common.get_config() | {"name": None}
    assert by_alias.intrinsic_damping == pytest.approx(1e-3)
    # weight_decay is delta = gamma_in, whatever the KL weight (eta = lambda / (N delta))
    tempered = tfnng.optimizers.IVON(num_examples=200, weight_decay=1e-3, kl_weight=2.0)
    assert tempered.intrinsic_damping == pytest.approx(1e-3)
    assert tempered.prior_variance == pytest.approx(2.0 / (200 * 1e-3))
    # prior_precision is 1 / eta
    by_precision = tfnng.optimizers.NoisyAdam(num_examples=100, prior_precision=4.0)
    assert by_precision.prior_variance == pytest.approx(0.25)
    assert by_precision.intrinsic_damping == pytest.approx(4.0 / 100)
    with pytest.raises(ValueError, match="ess"):
        tfnng.optimizers.IVON(ess=200, num_examples=200)
    # A tempered optimizer's ess is not an integer; IVON(ess=...) re-creates it.
    for ess in (tfnng.optimizers.IVON(num_examples=1000, kl_weight=3.0).ess, 0.4, 200.5):
        again = tfnng.optimizers.IVON(ess=ess, weight_decay=1e-3)
        assert again.ess == pytest.approx(ess, rel=1e-12) and again.num_examples == max(1, round(ess))
        assert again.intrinsic_damping == pytest.approx(1e-3)
    for both in ({"beta_1": 0.5, "beta1": 0.8}, {"beta_2": 0.9, "beta2": 0.95}):
        with pytest.raises(ValueError, match="not both"):
            tfnng.optimizers.IVON(num_examples=10, **both)
    # Arguments passed explicitly at their defaults (None) are no conflict.
    explicit = tfnng.optimizers.IVON(ess=200, weight_decay=1e-3, prior_variance=None,
                                     prior_precision=None, beta_1=None, beta2=None)
    assert explicit.get_config() | {"name": None} == by_alias.get_config() | {
        "name": None, "beta_1": 0.9, "beta_2": 0.99999}


@pytest.mark.parametrize("kwargs, match", [
    ({}, "num_examples.*required"),
    ({"num_examples": -5}, "positive integer"),
    ({"num_examples": 2.5}, "positive integer"),
    ({"num_examples": 10, "prior_variance": 0.0}, "prior_variance"),
    ({"num_examples": 10, "prior_variance": -1.0}, "prior_variance"),
    ({"num_examples": 10, "prior_variance": 1.0, "prior_precision": 1.0}, "not both"),
    ({"num_examples": 10, "prior_precision": float("nan")}, "prior_precision"),
    ({"num_examples": 10, "kl_weight": 0.0}, "kl_weight"),
    ({"num_examples": 10, "mc_samples": 0}, "mc_samples"),
    ({"num_examples": 10, "weight_decay": 0.1}, "weight_decay"),
    ({"num_examples": 10, "beta_2": 1.0}, "beta_2"),
    ({"num_examples": float("inf")}, "positive integer"),
    ({"num_examples": 10, "hess_init": float("inf")}, "hess_init"),
    ({"num_examples": 10, "hess_init": float("nan")}, "hess_init"),
    ({"num_examples": 10, "extrinsic_damping": "0.1x"}, "extrinsic_damping"),
    ({"num_examples": 10, "beta_1": None}, "beta_1"),
    ({"num_examples": 10, "learning_rate": float("nan")}, "learning_rate"),
    ({"num_examples": 10, "learning_rate": -0.01}, "learning_rate"),
    ({"num_examples": 10, "clipnorm": -1.0}, "clipnorm"),      # Keras drops these silently
    ({"num_examples": 10, "clipvalue": 0.0}, "clipvalue"),
    ({"num_examples": 10, "global_clipnorm": float("nan")}, "global_clipnorm"),
    ({"num_examples": 10, "loss_scale_factor": 0.0}, "loss_scale_factor"),   # every step skipped
    ({"num_examples": 10, "loss_scale_factor": float("inf")}, "loss_scale_factor"),
    # float() would take these as 1.0, 0.5, 1.0 and 1.0
    ({"num_examples": 10, "kl_weight": True}, "kl_weight"),
    ({"num_examples": 10, "prior_variance": "0.5"}, "prior_variance"),
    ({"num_examples": 10, "learning_rate": True}, "learning_rate"),
    ({"num_examples": 10, "prior_precision": np.True_}, "prior_precision"),
])
def test_bad_hyper_parameters_raise_clear_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        tfnng.optimizers.NoisyAdam(**kwargs)


@pytest.mark.parametrize("make, match", [
    (lambda: tfnng.optimizers.VadaGrad(num_examples=10, hess_init=float("nan")), "hess_init"),
    (lambda: tfnng.optimizers.IVON(ess=0.0), "ess"),
    (lambda: tfnng.optimizers.IVON(ess=float("inf")), "ess"),
    # weight_decay's mapping divides by them: they used to end in ZeroDivisionError/TypeError
    (lambda: tfnng.optimizers.IVON(num_examples=10, kl_weight=0, weight_decay=0.1), "kl_weight"),
    (lambda: tfnng.optimizers.IVON(num_examples=10, kl_weight=-1, weight_decay=0.1), "kl_weight"),
    (lambda: tfnng.optimizers.IVON(num_examples="100", weight_decay=0.1), "num_examples"),
    (lambda: tfnng.optimizers.IVON(weight_decay=0.1), "num_examples.*required"),
    (lambda: tfnng.optimizers.VadaGrad(num_examples=10, tau=None), "tau"),
    (lambda: tfnng.optimizers.IVON(num_examples=10, clip_radius=None), "clip_radius"),
    (lambda: tfnng.optimizers.IVON(num_examples=10, clip_radius=float("nan")), "clip_radius"),
    (lambda: tfnng.optimizers.NoisyKFAC(num_examples=10, learning_rate=float("inf")),
     "learning_rate"),
    (lambda: tfnng.optimizers.KFAC(damping=float("nan")), "damping"),
    (lambda: tfnng.optimizers.KFAC(l2=float("inf")), "l2"),
    (lambda: tfnng.optimizers.SLANG(num_examples=10, oversampling=-2), "oversampling"),
    (lambda: tfnng.optimizers.NoisyNaturalGradient(num_examples=10, max_parameters=0),
     "max_parameters"),
    # bool("False") is True; a decay without a clip did nothing
    (lambda: tfnng.optimizers.NoisyKFAC(num_examples=10, block_tridiagonal="False"),
     "block_tridiagonal"),
    (lambda: tfnng.optimizers.NoisyKFAC(num_examples=10, inverse_warmup="no"), "inverse_warmup"),
    (lambda: tfnng.optimizers.NoisyKFAC(num_examples=10, kl_clip_decay=0.5), "need `kl_clip`"),
    (lambda: tfnng.optimizers.KFAC(kl_clip_decay_steps=10), "need `kl_clip`"),
    # "practically never": accepted, then fit failed converting them to TensorFlow's int64
    (lambda: tfnng.optimizers.NoisyKFAC(num_examples=10, inverse_every=1e20),
     r"inverse_every.*at most 2\*\*63 - 1"),
    (lambda: tfnng.optimizers.NoisyKFAC(num_examples=10, stats_every=2**63), "stats_every"),
    (lambda: tfnng.optimizers.KFAC(kl_clip=1e-3, kl_clip_decay=0.5, kl_clip_decay_steps=1e20),
     "kl_clip_decay_steps"),
])
def test_method_specific_hyper_parameters_are_validated(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_checked_keras_arguments_keep_the_optimizers_name():
    """The loop checking Keras's arguments once reused the variable holding the `name` argument."""
    for kwargs in ({}, {"clipnorm": 1.0, "loss_scale_factor": 2.0}):
        assert tfnng.optimizers.NoisyAdam(num_examples=3, **kwargs).name == "noisy_adam"
        assert tfnng.optimizers.IVON(num_examples=3, name="mine", **kwargs).name == "mine"


def test_weight_constraints_are_refused_at_build():
    """A constraint would project the sample, never the posterior (its mean and draws)."""
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(
        3, kernel_constraint=keras.constraints.NonNeg())])
    model.compile(optimizer=tfnng.optimizers.IVON(num_examples=8), loss="mse")
    with pytest.raises(ValueError, match="weight constraint"):
        model.fit(np.ones((8, 4)), np.ones((8, 3)), verbose=0)
    constrained = tf.Variable([1.0], name="c", constraint=lambda x: tf.maximum(x, 0.0))
    with pytest.raises(ValueError, match="weight constraint.*c:0"):      # a plain tf.Variable too
        tfnng.optimizers.Vadam(num_examples=8).build([constrained])


def test_plain_tf_variables_have_a_posterior_keyed_by_name():
    """A hand-written loop may train plain tf.Variables, which have no Keras ``path``."""
    w = tf.Variable([1.0, 2.0], name="w")
    optimizer = tfnng.optimizers.Vadam(learning_rate=0.01, num_examples=10, seed=0)
    optimizer.apply_gradients([(tf.constant([0.5, -0.5]), w)])
    posterior = optimizer.posterior()
    np.testing.assert_allclose(posterior.model["w:0"].mean(), optimizer.posterior_mean(w))
    np.testing.assert_allclose(posterior.model["w:0"].stddev(), optimizer.posterior_stddev(w))


def test_keras_per_variable_weight_decay_is_refused():
    """IVON takes ``weight_decay`` (the prior), but Keras's per-variable exclusion used to be
    accepted and ignored: the excluded variable was decayed all the same."""
    for optimizer in (tfnng.optimizers.IVON(num_examples=10, weight_decay=0.1),
                      tfnng.optimizers.NoisyAdam(num_examples=10)):
        with pytest.raises(ValueError, match="no per-variable weight decay"):
            optimizer.exclude_from_weight_decay(var_names=["bias"])


def test_weight_decay_reads_back_ivons_delta_and_cannot_be_assigned():
    """IVON(weight_decay=1e-3).weight_decay read None (Keras's attribute), and assigning a weight
    decay to a tfnng optimizer, built or not, was accepted and ignored by the update."""
    ivon = tfnng.optimizers.IVON(num_examples=100, weight_decay=1e-3)
    assert ivon.weight_decay == pytest.approx(1e-3)
    assert tfnng.optimizers.IVON(num_examples=100, prior_variance=2.0).weight_decay == \
        pytest.approx(1 / 200)
    assert tfnng.optimizers.NoisyAdam(num_examples=100).weight_decay is None
    assert "weight_decay" not in ivon.get_config()
    variable = keras.Variable(np.ones(3, "float32"))
    for optimizer in (ivon, tfnng.optimizers.NoisyAdam(num_examples=100)):
        with pytest.raises(AttributeError, match="weight_decay cannot be set"):
            optimizer.weight_decay = 0.5
        optimizer.build([variable])
        with pytest.raises(AttributeError, match="weight_decay cannot be set"):
            optimizer.weight_decay = 0.5
    assert ivon.weight_decay == pytest.approx(1e-3)


def test_posterior_access_before_build_or_for_a_foreign_variable_is_a_clear_error():
    with pytest.raises(ValueError, match="no posterior yet"):
        tfnng.optimizers.Vprop(num_examples=10).kl_divergence()
    optimizer = tfnng.optimizers.Vprop(num_examples=10)
    model = small_net()
    optimizer.build(model.trainable_variables)
    with pytest.raises(ValueError, match="no posterior for"):
        optimizer.posterior_mean(keras.Variable(np.zeros(3, "float32")))
    for not_a_variable in (model.layers[0].kernel.path, model.layers[0], tf.zeros(3)):
        with pytest.raises(TypeError, match="the posterior's variable itself"):   # AttributeError
            optimizer.posterior_stddev(not_a_variable)
    with pytest.raises(TypeError, match="marks one variable"):    # the mark was never read
        tfnng.mark_point_estimate(model.layers[0])


@pytest.mark.parametrize("learning_rate", [
    keras.optimizers.schedules.PolynomialDecay(-0.05, 100, end_learning_rate=-0.05),
    lambda: float("nan")])
def test_learning_rate_schedules_giving_negative_or_nan_values_stop_training(learning_rate):
    """A negative value trained uphill, NaN made the posterior mean NaN: both silently."""
    x, y = regression_data(n=32)
    model = small_net()
    model.compile(optimizer=tfnng.optimizers.NoisyAdam(learning_rate, num_examples=32),
                  loss=tfnng.losses.GaussianNLL())
    with pytest.raises(tf.errors.InvalidArgumentError, match="learning rate must be finite"):
        model.fit(x, y, batch_size=16, epochs=1, verbose=0)


@pytest.mark.parametrize("rate", [-0.01, float("nan")])
def test_learning_rates_assigned_after_construction_are_checked_at_each_step(rate):
    """Keras's LearningRateScheduler assigns its value to the optimizer's rate variable: NaN made
    every posterior mean NaN (and every later update was skipped), a negative rate trained uphill."""
    x, y = regression_data(n=32)
    model = small_net()
    model.compile(optimizer=tfnng.optimizers.NoisyAdam(0.01, num_examples=32),
                  loss=tfnng.losses.GaussianNLL())
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    means = [model.optimizer.posterior_mean(v).numpy() for v in model.trainable_variables]
    with pytest.raises(tf.errors.InvalidArgumentError, match="learning rate must be finite"):
        model.fit(x, y, batch_size=16, epochs=2, verbose=0,
                  callbacks=[keras.callbacks.LearningRateScheduler(lambda epoch: rate)])
    for variable, mean in zip(model.trainable_variables, means):
        np.testing.assert_array_equal(model.optimizer.posterior_mean(variable), mean)


@pytest.mark.parametrize("make, wrap", [
    (lambda: tfnng.optimizers.NoisyAdam(0.01, num_examples=32, seed=0), False),
    (lambda: tfnng.optimizers.NoisyKFAC(0.01, num_examples=32, seed=0), True),
    (lambda: tfnng.optimizers.VOGN(0.01, num_examples=32, seed=0, beta=keras.optimizers.schedules
                                   .PiecewiseConstantDecay([1], [0.1, -0.5])), True)])
def test_a_step_refused_by_a_run_time_check_changes_no_state(make, wrap):
    """The learning-rate check (and a beta schedule's) stopped training, but in the compiled step
    the state changes that do not read the checked value had run: NoisyAdam's Fisher and momentum
    (its stddev moved while its mean did not), K-FAC's update count, Keras's iterations."""
    x, y = regression_data(n=32)
    keras.utils.set_random_seed(0)
    model = tfnng.BayesianModel(small_net()) if wrap else small_net()
    model.compile(optimizer=make(), loss=tfnng.losses.GaussianNLL())
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    optimizer = model.optimizer
    before = {v.path: v.numpy() for v in optimizer.variables if "learning_rate" not in v.path}
    schedule_check = isinstance(getattr(optimizer, "beta", None),
                                keras.optimizers.schedules.LearningRateSchedule)
    callbacks = [] if schedule_check else [keras.callbacks.LearningRateScheduler(lambda e: -0.01)]
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match="`beta` schedule" if schedule_check else "learning rate must be"):
        model.fit(x, y, batch_size=16, epochs=2, initial_epoch=1, verbose=0, callbacks=callbacks)
    for path, value in before.items():
        np.testing.assert_array_equal(
            [v for v in optimizer.variables if v.path == path][0].numpy(), value, err_msg=path)


@pytest.mark.parametrize("method", sorted(METHODS))
def test_hyper_parameters_are_fixed_once_built_and_the_state_moves_to_a_new_optimizer(method,
                                                                                    tmp_path):
    """A compiled step keeps the values it was traced with: after the build, assigning a
    hyper-parameter (which training ignored while the posterior accessors read it) is refused.
    Before the build it is taken; the learning rate stays assignable. The advice of the error,
    saving the weights and loading them into a new optimizer, keeps the posterior means."""
    x, y = regression_data(n=32)
    model = small_net()
    optimizer = METHODS[method](0.01, num_examples=32, seed=1)
    optimizer.kl_weight = 0.5
    model.compile(optimizer=optimizer, loss=tfnng.losses.GaussianNLL(noise_variance=0.5))
    model.fit(x, y, batch_size=8, verbose=0)
    assert optimizer.kl_weight == 0.5
    for name in ("kl_weight", "num_examples", "prior_variance", "mc_samples", "hess_init", "seed"):
        value = getattr(optimizer, name)
        with pytest.raises(AttributeError, match=f"{type(optimizer).__name__}.{name} cannot "
                                                 "change once the optimizer is built"):
            setattr(optimizer, name, 2 * value if isinstance(value, (int, float)) else 1)
        assert getattr(optimizer, name) == value
    optimizer.learning_rate = 0.02
    assert float(optimizer.learning_rate) == pytest.approx(0.02)

    model.save_weights(tmp_path / "trained.weights.h5")
    tempered = type(optimizer).from_config({**optimizer.get_config(), "kl_weight": 0.25})
    model.compile(optimizer=tempered, loss=tfnng.losses.GaussianNLL(noise_variance=0.5))
    tempered.build(model.trainable_variables)
    model.load_weights(tmp_path / "trained.weights.h5")
    assert tempered.kl_weight == 0.25
    for variable in model.trainable_variables:
        np.testing.assert_array_equal(tempered.posterior_mean(variable),
                                      optimizer.posterior_mean(variable))
    kernel = model.trainable_variables[0]
    assert not np.allclose(tempered.posterior_stddev(kernel), optimizer.posterior_stddev(kernel))


def test_posterior_access_before_the_first_step_does_not_fix_where_the_posterior_starts():
    """The means start at the weights the model holds at the first update: a look at the initial
    posterior before loading pre-trained weights used to fix the means at the random initial
    weights. ``sample_weights`` does fix them (it overwrites the weights with a sample)."""
    x, y = regression_data(n=32)
    model = small_net()
    model.compile(optimizer=tfnng.optimizers.NoisyAdam(0.0, num_examples=32),
                  loss=tfnng.losses.GaussianNLL())
    optimizer = model.optimizer
    optimizer.build(model.trainable_variables)
    kernel = model.layers[0].kernel
    initial = kernel.numpy()
    np.testing.assert_array_equal(optimizer.posterior_mean(kernel), initial)
    float(optimizer.kl_divergence())
    tfnng.predict(model, x, num_samples=2)
    with optimizer.use_mean():
        pass
    pretrained = [np.full_like(w, 0.5) for w in model.get_weights()]
    model.set_weights(pretrained)
    np.testing.assert_array_equal(optimizer.posterior_mean(kernel), pretrained[0])
    optimizer.sample_weights()
    sample = [v.numpy() for v in model.trainable_variables]
    assert not np.allclose(sample[0], 0.5)
    model.fit(x, y, batch_size=32, epochs=1, verbose=0)       # learning rate 0: the mean stays
    for variable, value in zip(model.trainable_variables, pretrained):
        np.testing.assert_array_equal(optimizer.posterior_mean(variable), value)


@pytest.mark.parametrize("method", ["noisy_adam", "ivon"])
def test_predict_before_the_first_step_draws_independent_samples_of_the_initial_posterior(method):
    """Each traced draw copied the weights, the previous sample, into the never-updated means: a
    random walk (epistemic variance 13-170x the exact one on a linear model, 300 draws)."""
    keras.utils.set_random_seed(0)
    x = np.random.default_rng(0).normal(size=(30, 4)).astype("float32")
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile(optimizer=METHODS[method](1e-2, num_examples=30), loss=tfnng.losses.GaussianNLL())
    model.optimizer.build(model.trainable_variables)
    outputs = model(x).numpy()[:, 0]
    layer = model.layers[0]
    variances = np.concatenate([model.optimizer.posterior_stddev(v).numpy().ravel() ** 2
                                for v in (layer.kernel, layer.bias)])
    exact = np.c_[x, np.ones(len(x))] ** 2 @ variances      # Var[h^T w] of a linear model
    num_samples = 1000
    predictive = tfnng.predict(model, x, num_samples=num_samples)
    np.testing.assert_allclose(predictive.epistemic_variance[:, 0], exact, rtol=0.3)
    assert np.all(np.abs(predictive.mean[:, 0] - outputs) < 5 * np.sqrt(exact / num_samples))


def test_a_mark_made_after_the_optimizer_is_built_is_refused_when_the_step_is_traced():
    """The optimizer reads the marks at build: a later mark was silently ignored (the variable kept
    its noise and prior), and the per-example path, which read it live, failed with "no
    per-example gradients"."""
    x, y = regression_data(n=32)
    model = small_net()
    optimizer = tfnng.optimizers.NoisyAdam(0.01, num_examples=32)
    loss = tfnng.losses.GaussianNLL()
    with tf.GradientTape() as tape:                 # a hand-written eager loop: every step checks
        value = loss(y, model(x, training=True))
    grads = tape.gradient(value, model.trainable_variables)
    optimizer.apply_gradients(zip(grads, model.trainable_variables))
    tfnng.mark_point_estimate(model.layers[-1].bias)
    with pytest.raises(ValueError, match=r"sequential.*/bias was marked .* after NoisyAdam was built"):
        optimizer.apply_gradients(zip(grads, model.trainable_variables))

    net = keras.Sequential([keras.Input((4,)), keras.layers.Dense(4),
                            keras.layers.LayerNormalization(), keras.layers.Dense(1)])
    wrapped = tfnng.BayesianModel(net)
    wrapped.compile(optimizer=tfnng.optimizers.VOGN(0.01, num_examples=32), loss=loss)
    wrapped.fit(x, y, batch_size=16, epochs=1, verbose=0)
    tfnng.mark_point_estimate(net.layers[1].gamma)
    with pytest.raises(ValueError, match="gamma was marked .* after VOGN was built"):
        wrapped.fit(x, y, batch_size=8, epochs=1, verbose=0)        # another batch size: retraced


def test_a_numpy_integer_seed_is_a_seed():
    """Keras's SeedGenerator refused np.int64(3) ("must be an integer. Received: seed=3"), and
    seed=True failed converting a sequence to a tensor."""
    by_numpy = tfnng.optimizers.NoisyAdam(num_examples=10, seed=np.int64(3))
    assert by_numpy.seed == 3 and type(by_numpy.seed) is int
    np.testing.assert_array_equal(by_numpy._seed_generator.state.numpy(),
                                  tfnng.optimizers.NoisyAdam(num_examples=10, seed=3)
                                  ._seed_generator.state.numpy())
    for bad in (True, 1.5, "3", 2**64):
        with pytest.raises(ValueError, match="`seed` must be an integer"):
            tfnng.optimizers.NoisyAdam(num_examples=10, seed=bad)


def test_weight_noise_is_seeded_and_drawn_with_philox_also_under_xla():
    """The noise comes from the optimizer's seed generator (``seed`` fixes the stream) and, under XLA,
    from ``stateless_normal`` with the Philox algorithm named in the graph: TensorFlow's "auto_select"
    default is about 20 times slower under XLA on the CPU. Under XLA the draws are still standard
    normal."""
    def first_draws(seed):
        optimizer = tfnng.optimizers.NoisyAdam(1e-3, num_examples=10, seed=seed)
        return [optimizer._standard_normal((1000,), "float32").numpy() for _ in range(2)]
    first, second = first_draws(3)
    np.testing.assert_array_equal(first, first_draws(3)[0])
    assert not np.allclose(first, second) and not np.allclose(first, first_draws(4)[0])

    optimizer = tfnng.optimizers.NoisyAdam(1e-3, num_examples=10, seed=3)
    draw = tf.function(lambda: optimizer._standard_normal((20000,), "float32"), jit_compile=True)
    graph = draw.get_concrete_function().graph
    [op] = [op for op in graph.get_operations() if op.type == "StatelessRandomNormalV2"]
    algorithm = tf.get_static_value(op.inputs[3])           # inputs: shape, key, counter, alg
    assert algorithm == tf.random.Algorithm.PHILOX.value
    values = draw().numpy()
    assert abs(values.mean()) < 5 / np.sqrt(values.size)
    assert abs(values.var() - 1.0) < 5 * np.sqrt(2 / values.size)


class _Offset(keras.layers.Layer):
    """Adds a scalar marked with ``tfnng.mark_point_estimate``: a variational parameter fitted by
    Adam, without weight noise or prior."""

    def build(self, input_shape):
        self.offset = tfnng.mark_point_estimate(self.add_weight(shape=(), initializer="zeros"))

    def call(self, inputs):
        return inputs + self.offset


@pytest.mark.parametrize("method,mc_samples", [("NoisyAdam", 1), ("VOGN", 1), ("NoisyAdam", 3),
                                                ("VOGN", 2), ("NoisyNaturalGradient", 2)])
def test_point_estimates_take_a_bias_corrected_adam_step(method, mc_samples):
    # The Dense layer sees zero inputs, so the prediction is the offset c alone and the Gaussian NLL
    # with noise variance 1/2, (y - c)^2 + const, has the gradient 2 (c - mean y) whatever weight
    # sample is drawn. With mc_samples = S the offset is updated once per S evaluations, with the
    # posterior (here S equal gradients, so their average is the gradient).
    y = np.linspace(0.5, 1.5, 8, dtype=np.float32)[:, None]
    net = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1, use_bias=False), _Offset()])
    lr = 0.05
    optimizer = getattr(tfnng.optimizers, method)(learning_rate=lr, num_examples=len(y),
                                                  mc_samples=mc_samples)
    model = net if method == "NoisyAdam" else tfnng.BayesianModel(net)
    model.compile(optimizer=optimizer, loss=tfnng.losses.GaussianNLL(0.5))
    c, m, v = 0.0, 0.0, 0.0
    for t in range(1, 6):
        before = float(net.layers[-1].offset)
        for _ in range(mc_samples - 1):
            model.fit(np.zeros_like(y), y, batch_size=len(y), verbose=0)
            assert float(net.layers[-1].offset) == before
        model.fit(np.zeros_like(y), y, batch_size=len(y), verbose=0)
        g = 2 * (c - float(y.mean()))
        m, v = 0.9 * m + 0.1 * g, 0.999 * v + 0.001 * g**2
        c -= lr * (m / (1 - 0.9**t)) / (np.sqrt(v / (1 - 0.999**t)) + 1e-7)
        offset = net.layers[-1].offset
        assert float(offset) == pytest.approx(c, rel=1e-5)
        # its posterior is the point mass at its value
        assert float(optimizer.posterior_mean(offset)) == float(offset)
        assert float(optimizer.posterior_stddev(offset)) == 0.0


def test_a_point_estimates_posterior_mean_is_the_variables_value():
    """Keras restores weights (EarlyStopping's restore_best_weights): a point estimate is the model's
    variable, which the optimizer's copy used to contradict."""
    x, y = regression_data(n=32)
    model = small_net()
    bias = tfnng.mark_point_estimate(model.layers[-1].bias)
    model.compile(optimizer=tfnng.optimizers.NoisyAdam(0.01, num_examples=32), loss="mse")
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    bias.assign([0.25])
    np.testing.assert_array_equal(model.optimizer.posterior_mean(bias), [0.25])
    np.testing.assert_array_equal(model.optimizer.posterior_stddev(bias), [0.0])


def test_schedules_see_posterior_updates_not_gradient_evaluations():
    """mc_samples = 2: six evaluations are three updates, so the rate is schedule(3), not schedule(6)."""
    schedule = keras.optimizers.schedules.ExponentialDecay(0.1, decay_steps=1, decay_rate=0.5)
    weights = tf.Variable([0.5, -0.5])
    optimizer = tfnng.optimizers.Vprop(schedule, num_examples=10, mc_samples=2, seed=0)
    for _ in range(6):
        optimizer.apply_gradients([(tf.ones_like(weights), weights)])
    assert int(optimizer.iterations) == 6
    assert float(optimizer.learning_rate) == pytest.approx(0.1 * 0.5**3)


@pytest.mark.parametrize("method", sorted(METHODS))
def test_sparse_gradients_update_like_their_dense_equivalent(method):
    """An Embedding's gradient arrives as tf.IndexedSlices; IVON's momentum used to fail on it
    (float * IndexedSlices). Sparse and densified gradients give the same posterior and samples."""
    def run(densify):
        keras.utils.set_random_seed(0)
        embedding = keras.layers.Embedding(6, 2)
        embedding.build((None,))
        optimizer = METHODS[method](learning_rate=0.05, num_examples=20, seed=0)
        for _ in range(3):
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum((embedding(tf.constant([1, 2, 2])) - 1.0) ** 2)
            gradient = tape.gradient(loss, embedding.embeddings)
            assert isinstance(gradient, tf.IndexedSlices)
            optimizer.apply_gradients([(tf.convert_to_tensor(gradient) if densify else gradient,
                                        embedding.embeddings)])
        return optimizer.posterior_mean(embedding.embeddings).numpy(), embedding.embeddings.numpy()

    (mean, sample), (dense_mean, dense_sample) = run(False), run(True)
    np.testing.assert_array_equal(mean, dense_mean)
    np.testing.assert_array_equal(sample, dense_sample)
    assert np.abs(mean[[1, 2]] - mean[[0, 3]]).max() > 1e-3   # the looked-up rows moved


def test_embedding_models_train_in_fit_and_through_bayesian_model():
    x = np.random.default_rng(0).integers(0, 10, size=(32, 3))
    y = (x.sum(axis=1, keepdims=True) / 10.0).astype("float32")

    def net():
        return keras.Sequential([keras.Input((3,), dtype="int32"), keras.layers.Embedding(10, 4),
                                 keras.layers.Flatten(), keras.layers.Dense(1)])

    for model, optimizer in [(net(), tfnng.optimizers.IVON(num_examples=32, seed=0)),
                             (tfnng.BayesianModel(net()),
                              tfnng.optimizers.NoisyKFAC(num_examples=32, seed=0))]:
        model.compile(optimizer=optimizer, loss=tfnng.losses.GaussianNLL(noise_variance=0.5))
        history = model.fit(x, y, batch_size=8, epochs=2, verbose=0).history
        assert np.isfinite(history["loss"]).all() and optimizer.skipped_updates == 0
        assert int(optimizer._update_count.numpy()) == 8


def test_mc_sums_of_a_variable_without_gradient_at_the_groups_last_evaluation_do_not_carry_over():
    """mc_samples=3 in a hand-written loop: a Bayesian and a point-estimated variable have gradients
    at the first two evaluations of a group, none at the third. They get no update for the group
    (as a variable without a gradient at mc_samples=1), and the next group averages its own three
    gradients only."""
    w1 = tf.Variable([0.5, -0.5], name="w1")
    w2 = tf.Variable([0.2, 0.3], name="w2")
    w3 = tfnng.mark_point_estimate(tf.Variable([0.1, 0.1], name="w3"))
    optimizer = tfnng.optimizers.Vprop(learning_rate=0.1, num_examples=10, mc_samples=3, seed=0)
    for step, used in enumerate([True, True, False, True, True]):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(w1 ** 2) + (tf.reduce_sum(w2) + tf.reduce_sum(w3) if used else 0.0)
        optimizer.apply_gradients(zip(tape.gradient(loss, [w1, w2, w3]), [w1, w2, w3]))
        if step == 2:
            assert int(optimizer._update_count) == 1
            np.testing.assert_array_equal(optimizer._accumulators["grad"][1].numpy(), 0.0)
            np.testing.assert_array_equal(optimizer._point_gradient_sums[2].numpy(), 0.0)
    np.testing.assert_array_equal(optimizer._accumulators["grad"][1].numpy(), 2.0)   # 2 of group 2
    np.testing.assert_array_equal(optimizer._point_gradient_sums[2].numpy(), 2.0)


def test_posterior_access_before_build_is_a_clear_error():
    net = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    optimizer = tfnng.optimizers.NoisyAdam(0.05, num_examples=4)
    for access in (optimizer.posterior_mean, optimizer.posterior_stddev):
        with pytest.raises(ValueError, match="no posterior yet"):
            access(net.trainable_variables[0])


def test_unique_names_never_repeat_a_name():
    from tfnng._names import unique_names
    assert unique_names(["a", "a", "b"]) == ["a", "a_1", "b"]
    for names in (["a", "a", "a"], ["a", "a_1", "a", "a"], ["x", "x", "x_1", "x", "x_2"]):
        result = unique_names(names)
        assert len(set(result)) == len(result), result
        assert all(r == n or r.startswith(n + "_") for r, n in zip(result, names))


def test_at_least_float32_widens_half_precision_only():
    from tfnng._dtypes import at_least_float32
    for dtype, widened in ((tf.float16, tf.float32), (tf.bfloat16, tf.float32), (tf.float32, tf.float32),
                           (tf.float64, tf.float64), (tf.int32, tf.int32)):
        assert at_least_float32(tf.ones(2, dtype)).dtype == widened
