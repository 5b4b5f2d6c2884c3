"""Mixed precision (``keras.mixed_precision`` "mixed_float16" / "mixed_bfloat16"): the posterior state
and the curvature statistics stay in float32, training follows the float32 run, and Keras's
LossScaleOptimizer wrapper (mixed_float16) is seen through by BayesianModel, predict and callbacks."""

import functools

import numpy as np
import pytest
import keras
import tensorflow as tf

import tfnng
from tfnng import callbacks, serving
from tfnng.curvature.capture import LayerCapture
from tfnng.models import gradients_and_curvature

POLICIES = ["mixed_float16", "mixed_bfloat16"]
# Largest allowed deviation from the float32 run, relative to how far the float32 run moved the
# posterior mean from its initial value (bfloat16 keeps 8 mantissa bits, float16 11).
TOLERANCE = {"mixed_float16": 0.01, "mixed_bfloat16": 0.05}
N = 1000                                  # num_examples: a posterior narrow enough to compare runs


@pytest.fixture(params=POLICIES)
def policy(request):
    """Sets the global dtype policy for the test and restores the previous one afterwards."""
    previous = keras.mixed_precision.global_policy()
    keras.mixed_precision.set_global_policy(request.param)
    try:
        yield request.param
    finally:
        keras.mixed_precision.set_global_policy(previous)


def data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 4)).astype("float32")
    y = (np.sin(x[:, :1]) + 0.5 * x[:, 1:2]).astype("float32")
    labels = (x[:, 0] + x[:, 1] > 0).astype("int32")
    return x, y, labels


def make_optimizer(kind, fisher=None):
    if kind == "noisy_adam":
        return tfnng.optimizers.NoisyAdam(learning_rate=0.05, num_examples=N, hess_init=1.0, seed=0)
    if kind == "ivon":
        return tfnng.optimizers.IVON(learning_rate=0.05, num_examples=N, seed=0)
    return tfnng.optimizers.NoisyKFAC(learning_rate=0.05, num_examples=N, stats_every=1,
                                      inverse_every=2, fisher=fisher, seed=0)


def train(kind, fisher=None, loss_scale=None):
    """8 steps under the current global policy; returns (net, optimizer, initial weights, history).

    ``loss_scale``: the initial scale of an explicit LossScaleOptimizer (mixed_float16); Keras's
    default (2**15) overflows float16 in the first steps, whose updates it then drops, so a run
    compared step by step with float32 starts from a small scale.
    """
    keras.utils.set_random_seed(0)
    x, y, labels = data()
    outputs = 2 if kind == "kfac" else 1
    net = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="tanh"),
                            keras.layers.Dense(outputs, dtype="float32")])
    initial = [v.numpy() for v in net.trainable_variables]
    optimizer = make_optimizer(kind, fisher)
    compiled = (optimizer if loss_scale is None else
                keras.optimizers.LossScaleOptimizer(optimizer, initial_scale=loss_scale))
    if kind == "kfac":
        model, loss, targets = tfnng.BayesianModel(net), tfnng.losses.CategoricalNLL(), labels
    else:
        model, loss, targets = net, tfnng.losses.GaussianNLL(noise_variance=0.5), y
    model.compile(optimizer=compiled, loss=loss)
    history = model.fit(x, targets, batch_size=8, epochs=1, shuffle=False, verbose=0)
    return net, optimizer, initial, history.history


@functools.lru_cache(maxsize=None)
def float32_run(kind, fisher=None):
    previous = keras.mixed_precision.global_policy()
    keras.mixed_precision.set_global_policy("float32")
    try:
        net, optimizer, initial, _ = train(kind, fisher)
        means = [optimizer.posterior_mean(v).numpy() for v in net.trainable_variables]
        factors = [b.state["s"].numpy() for b in getattr(optimizer, "_blocks", [])]
        return initial, means, factors
    finally:
        keras.mixed_precision.set_global_policy(previous)


def assert_float32_state(optimizer):
    """Means, slots and Kronecker factors in float32 (the K-FAC KL offsets are float64 scalars)."""
    dtypes = {v.path: str(v.dtype) for v in optimizer.variables}
    assert not [p for p, d in dtypes.items() if d in ("float16", "bfloat16")], dtypes
    assert all(str(m.dtype) == "float32" for m in optimizer._means)
    for block in getattr(optimizer, "_blocks", []):
        for name in ("a", "s", "a_inv", "s_inv", "a_root", "s_root"):
            assert str(block.state[name].dtype) == "float32", name


def assert_follows_float32_run(policy, optimizer, net, reference):
    initial, means, _ = reference
    moved = max(np.abs(m - i).max() for m, i in zip(means, initial))
    deviation = max(np.abs(optimizer.posterior_mean(v).numpy() - m).max()
                    for v, m in zip(net.trainable_variables, means))
    assert moved > 0.05                     # the comparison is not between two unmoved starts
    assert deviation <= TOLERANCE[policy] * moved, (deviation, moved)


@pytest.mark.parametrize("kind", ["noisy_adam", "ivon"])
def test_diagonal_optimizers_under_mixed_precision(policy, kind):
    reference = float32_run(kind)
    loss_scale = 16.0 if policy == "mixed_float16" else None
    net, optimizer, _, history = train(kind, loss_scale=loss_scale)
    assert str(net.layers[0].compute_dtype) == policy.split("_")[1]      # really mixed
    assert np.isfinite(history["loss"]).all()
    assert int(optimizer._update_count.numpy()) == 8 and optimizer.skipped_updates == 0
    assert_float32_state(optimizer)
    assert_follows_float32_run(policy, optimizer, net, reference)


@pytest.mark.parametrize("fisher", ["true", "empirical"])
def test_noisy_kfac_bayesian_model_under_mixed_precision(policy, fisher):
    reference = float32_run("kfac", fisher)
    loss_scale = 16.0 if policy == "mixed_float16" else None
    net, optimizer, _, history = train("kfac", fisher, loss_scale=loss_scale)
    assert np.isfinite(history["loss"]).all() and np.isfinite(history["kl"]).all()
    assert int(optimizer._stats_count.numpy()) == 8 and optimizer.skipped_updates == 0
    assert_float32_state(optimizer)
    assert_follows_float32_run(policy, optimizer, net, reference)
    # S comes from the (float16/bfloat16) pre-activation gradients; with a loss scale of 16 an
    # unscaled empirical Fisher would be 256 times too large.
    for block, s_reference in zip(optimizer._blocks, reference[2]):
        s = block.state["s"].numpy()
        assert np.abs(s - s_reference).max() <= TOLERANCE[policy] * np.abs(s_reference).max()


def test_keras_loss_scale_wrapper_is_seen_through(tmp_path):
    previous = keras.mixed_precision.global_policy()
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        keras.utils.set_random_seed(1)
        x, _, labels = data()
        net = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="tanh"),
                                keras.layers.Dense(2, dtype="float32")])
        optimizer = tfnng.optimizers.NoisyKFAC(learning_rate=0.05, num_examples=len(x),
                                               stats_every=1, inverse_every=2, seed=1)
        model = tfnng.BayesianModel(net)
        model.compile(optimizer=optimizer, loss=tfnng.losses.CategoricalNLL())
        history = model.fit(x, labels, batch_size=16, epochs=2, verbose=0, callbacks=[
            callbacks.PredictiveValidation(x, labels, num_samples=4),
            callbacks.PosteriorTensorBoard(tmp_path)]).history
        serving.export(model, tmp_path / "exported", num_samples=5)
    finally:
        keras.mixed_precision.set_global_policy(previous)
    assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
    assert model.optimizer.inner_optimizer is optimizer
    assert int(optimizer._update_count.numpy()) > 0
    np.testing.assert_allclose(history["kl"][-1], float(optimizer.kl_divergence()) / len(x),
                               rtol=0.5)            # the epoch's mean of a slowly moving value
    assert history["kl"][-1] > 0 and np.isfinite(history["val_pred_nll"]).all()
    prediction = tfnng.predict(model, x[:8], num_samples=6, return_samples=True)
    assert np.ptp(prediction.samples, axis=0).max() > 0       # posterior samples, not one point
    assert any(path.name.startswith("events.out.tfevents") for path in tmp_path.iterdir())
    served = tf.saved_model.load(str(tmp_path / "exported")).signatures["seeded"](
        inputs=tf.constant(x[:8]), seed=tf.constant([1, 2], tf.int64))
    np.testing.assert_allclose(served["mean"].numpy().sum(axis=-1), 1.0, rtol=1e-5)
    assert np.ptp(served["samples"].numpy(), axis=1).max() > 0          # posterior samples served


def captured_s_traces(policy, fisher, noise_stddev, weights=None, loss_scaled=True):
    """tr(S) of each layer from one ``gradients_and_curvature`` pass at Keras's default loss scale
    (mixed_float16 with ``loss_scaled``) or none; same weights, data and target seed."""
    previous = keras.mixed_precision.global_policy()
    keras.mixed_precision.set_global_policy(policy)
    try:
        keras.utils.set_random_seed(0)
        net = keras.Sequential([keras.Input((10,)), keras.layers.Dense(32, activation="tanh"),
                                keras.layers.Dense(32, activation="tanh"),
                                keras.layers.Dense(1, dtype="float32")])
        if weights is not None:
            net.set_weights(weights)
        optimizer = tfnng.optimizers.NoisyKFAC(num_examples=10000, fisher=fisher)
        capture = tfnng.curvature.capture.LayerCapture(net)
        optimizer.prepare_curvature(capture.specs)
        optimizer.build(net.trainable_variables)
        compiled = (keras.optimizers.LossScaleOptimizer(optimizer)
                    if policy == "mixed_float16" and loss_scaled else optimizer)
        rng = np.random.default_rng(1)
        x = rng.normal(size=(256, 10)).astype("float32")
        y = (noise_stddev * rng.normal(size=(256, 1))).astype("float32")
        loss = tfnng.losses.GaussianNLL(noise_variance=noise_stddev ** 2)
        *_, records = tfnng.models.gradients_and_curvature(
            net, capture, compiled, loss, x, y, seed=keras.random.SeedGenerator(7))
        traces = [np.trace(tfnng.curvature.kronecker.factors(
            spec, records[spec.name].inputs, records[spec.name].preactivation_grads)[1].numpy())
            for spec in capture.specs]
        return net.get_weights(), traces
    finally:
        keras.mixed_precision.set_global_policy(previous)


@pytest.mark.parametrize("fisher", ["true", "empirical"])
def test_small_log_likelihood_gradients_are_loss_scaled_in_both_fishers(fisher):
    """A Gaussian likelihood of standard deviation 1e7: the per-example pre-activation gradients
    (~1e-8) underflow float16 unless differentiated at the loss scale. The true Fisher's backward
    pass was not scaled: its S came out 2.3 times the float32 one, 86% of the gradients 0."""
    weights, reference = captured_s_traces("float32", fisher, 1e7)
    _, mixed = captured_s_traces("mixed_float16", fisher, 1e7, weights)
    np.testing.assert_allclose(mixed, reference, rtol=0.01)


def test_without_loss_scaling_the_true_fisher_pass_is_taken_at_scale_one():
    """A hand-written loop under mixed_float16 with a bare optimizer: the true Fisher's backward pass
    stays at scale 1 (taken at 1/B it underflowed: S twice the float32 one at a noise standard
    deviation of 3e4, 81% of the gradients 0)."""
    weights, reference = captured_s_traces("float32", "true", 3e4)
    _, mixed = captured_s_traces("mixed_float16", "true", 3e4, weights, loss_scaled=False)
    np.testing.assert_allclose(mixed, reference, rtol=0.01)


def test_an_overflow_of_the_true_fisher_pass_lowers_the_loss_scale():
    """A net fitting its targets 1000 times tighter than the likelihood's noise: the true Fisher's
    sampled targets give gradients 1000 times the loss's, and at the loss scale they overflow float16
    first. The LossScaleOptimizer, growing its scale every 5 finite steps, must see that overflow:
    unseen, it kept raising the scale and the inner optimizer skipped every update from step ~20."""
    previous = keras.mixed_precision.global_policy()
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        keras.utils.set_random_seed(0)
        net = keras.Sequential([keras.Input((8,)), keras.layers.Dense(32, activation="tanh"),
                                keras.layers.Dense(32, activation="tanh"),
                                keras.layers.Dense(1, dtype="float32")])
        rng = np.random.default_rng(1)
        x = rng.normal(size=(64, 8)).astype("float32")
        y = (net(x).numpy() + 1e-3 * rng.normal(size=(64, 1))).astype("float32")
        inner = tfnng.optimizers.NoisyKFAC(learning_rate=1e-4, num_examples=10 ** 6,
                                           fisher="true", seed=0)
        model = tfnng.BayesianModel(net)
        model.compile(optimizer=keras.optimizers.LossScaleOptimizer(
            inner, initial_scale=2.0 ** 18, dynamic_growth_steps=5),
            loss=tfnng.losses.GaussianNLL(1.0))
        scales = []
        for _ in range(40):
            model.train_on_batch(x, y)
            scales.append(float(model.optimizer.dynamic_scale.numpy()))
    finally:
        keras.mixed_precision.set_global_policy(previous)
    assert inner.skipped_updates == 0
    assert int(inner._update_count.numpy()) >= 30
    assert max(scales) > 2.0 ** 20 and scales[-1] < max(scales) * 4      # grew, then held


def noise_precision_fit():
    """IVON on Dense(8) -> Dense(1) -> NoisePrecision with GaussianNLL("learned"), 10 epochs."""
    keras.utils.set_random_seed(0)
    x, y, _ = data()
    layer = tfnng.layers.NoisePrecision(num_examples=len(x))
    net = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="tanh"),
                            keras.layers.Dense(1), layer])
    net.compile(optimizer=tfnng.optimizers.IVON(learning_rate=0.05, num_examples=len(x), seed=0),
                loss=tfnng.losses.GaussianNLL("learned"))
    net.fit(x, y, batch_size=16, epochs=10, shuffle=False, verbose=0)
    return layer, net


def test_noise_precision_keeps_q_tau_in_float32_under_a_mixed_policy(policy):
    """Without its own dtype the layer used to compute in the mixed policy's half precision, where
    its KL mixed float32 and float16 (TypeError at the first step); alpha ~ a0 + N/2 needs float32."""
    layer, net = noise_precision_fit()
    assert str(net.layers[1].compute_dtype) == policy.split("_")[1]      # really mixed
    assert layer.compute_dtype == "float32" and net(data()[0][:2]).dtype == "float32"
    previous = keras.mixed_precision.global_policy()
    keras.mixed_precision.set_global_policy("float32")
    try:
        reference, _ = noise_precision_fit()
    finally:
        keras.mixed_precision.set_global_policy(previous)
    np.testing.assert_allclose(layer.log_parameters.numpy(), reference.log_parameters.numpy(),
                               rtol=TOLERANCE[policy])
    assert float(reference.alpha[0]) > 20          # moved from its initial 6


def test_float64_layers_under_a_float32_floatx_train_in_float64():
    """A tfnng loss with its dtype left unset computed a float64 model's loss in float32 (Keras
    casts to the loss's dtype): the residuals of targets near 1e4 lost 4 digits."""
    assert keras.config.floatx() == "float32"
    rng = np.random.default_rng(5)
    y = tf.constant(1e4 + rng.normal(size=(8, 1)))
    y_pred = tf.constant(y.numpy() + 1e-3 * rng.normal(size=(8, 1)))
    for likelihood in (tfnng.losses.GaussianNLL(), tfnng.losses.GaussianNLL(dtype="float64")):
        with tf.GradientTape() as tape:
            tape.watch(y_pred)
            loss = likelihood(y, y_pred)
        assert loss.dtype == tf.float64
        np.testing.assert_allclose(tape.gradient(loss, y_pred).numpy(), (y_pred - y).numpy() / 8,
                                   rtol=1e-9)
    assert tfnng.losses.GaussianNLL().get_config()["dtype"] is None     # still follows when loaded
    np.testing.assert_allclose(float(tfnng.losses.GaussianNLL()(y, tf.cast(y_pred, "float32"))),
                               float(tfnng.losses.GaussianNLL(dtype="float32")(y, y_pred)))


@pytest.mark.parametrize("fisher", ["true", "empirical"])
@pytest.mark.parametrize("kind", ["NoisyKFAC", "VOGN"])
def test_float64_layers_get_float64_curvature_under_a_float32_floatx(kind, fisher):
    """BayesianModel handed a float64 net's pre-activation gradients to the optimizer in the
    float32 of Keras's compiled loss, and weighed the examples by float32 square roots of their
    weights: K-FAC's S factors were 2e-8 off those of the hand-written loop, which keeps float64
    (same sampled targets); VOGN's curvature likewise, also for a layer without a Dense fast path
    (LayerNormalization: per-example gradients by the generic path)."""
    assert keras.config.floatx() == "float32"
    rng = np.random.default_rng(0)
    x = rng.normal(size=(6, 4)).astype("float32").astype("float64")   # as Keras feeds it
    y = rng.integers(0, 3, size=6)
    weights = np.array([1.0, 0.0, 2.0, 0.5, 1.0, 3.0])
    loss = tfnng.losses.CategoricalNLL(dtype="float64")
    optimizer_class = getattr(tfnng.optimizers, kind)
    settings = dict(stats_every=1, factor_prior_count=0) if kind == "NoisyKFAC" else {}

    def make():
        keras.utils.set_random_seed(0)
        net = keras.Sequential([keras.Input((4,), dtype="float64"),
                                keras.layers.Dense(5, activation="tanh", dtype="float64"),
                                keras.layers.LayerNormalization(dtype="float64"),
                                keras.layers.Dense(3, dtype="float64")], name="f64_net")
        return net, optimizer_class(1e-3, num_examples=60, fisher=fisher, seed=0, **settings)

    net, optimizer = make()
    model = tfnng.BayesianModel(net, seed=0)
    model.compile(optimizer=optimizer, loss=loss)
    model.fit(x, y, sample_weight=weights, batch_size=6, epochs=1, shuffle=False, verbose=0)

    loop_net, loop_optimizer = make()
    capture = LayerCapture(loop_net)
    loop_optimizer.prepare_curvature(capture.specs)
    loop_optimizer.build(loop_net.trainable_variables)
    _, _, grads, curvature = gradients_and_curvature(
        loop_net, capture, loop_optimizer, loss, tf.constant(x), tf.constant(y),
        sample_weight=tf.constant(weights), seed=keras.random.SeedGenerator(0))
    assert {r.preactivation_grads.dtype for r in curvature.values()
            if hasattr(r, "preactivation_grads")} == {tf.float64}
    loop_optimizer.apply_gradients(zip(grads, loop_net.trainable_variables), curvature=curvature)
    if kind == "NoisyKFAC":
        pairs = [(fitted.state["s"], looped.state["s"])
                 for fitted, looped in zip(optimizer._blocks, loop_optimizer._blocks)]
    else:
        pairs = [(optimizer.posterior_stddev(v), loop_optimizer.posterior_stddev(w))
                 for v, w in zip(net.trainable_variables, loop_net.trainable_variables)]
    for fitted, looped in pairs:
        np.testing.assert_allclose(fitted.numpy(), looped.numpy(), rtol=1e-12, atol=0)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_variables_are_refused(dtype):
    """Variables stored in half precision (a non-mixed policy): bfloat16(0.999) == 1, so Vadam's
    bias correction divided by zero and IVON's h never moved; tfnng refuses them at build."""
    net = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, dtype=dtype)])
    for optimizer in (tfnng.optimizers.Vadam(num_examples=8), tfnng.optimizers.IVON(num_examples=8)):
        net.compile(optimizer=optimizer, loss="mse")
        with pytest.raises(ValueError, match="half-precision variables.*mixed"):
            net.fit(np.ones((8, 4)), np.ones((8, 3)), verbose=0)


def test_half_precision_heads_are_summarised_in_float32(policy, tmp_path):
    """A head left in the policy's half-precision compute dtype: Monte Carlo means over 2000 samples
    equal the float64 means of the per-sample values (float16 sums drift, and overflow past 65504)."""
    keras.utils.set_random_seed(0)
    x = data()[0][:4]
    classifier = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    regression = keras.Sequential([keras.Input((4,)), keras.layers.Dense(
        1, bias_initializer=keras.initializers.Constant(100.0))])
    for net, loss in ((classifier, tfnng.losses.CategoricalNLL()),
                      (regression, tfnng.losses.GaussianNLL(1.0))):
        optimizer = tfnng.optimizers.NoisyAdam(num_examples=N, seed=0)
        net.compile(optimizer=optimizer, loss=loss)
        optimizer.build(net.trainable_variables)
        assert keras.backend.standardize_dtype(net(x).dtype) == policy.removeprefix("mixed_")
        predictive = tfnng.predict(net, x, num_samples=2000, return_samples=True)
        assert predictive.outputs.dtype == np.float32    # log_likelihood evaluates these
        mean = predictive.probs if loss.is_classification else predictive.mean
        np.testing.assert_allclose(mean, predictive.samples.astype(np.float64).mean(axis=0), rtol=1e-4)
        serving.export(net, tmp_path / net.name, num_samples=2000, outputs=("mean", "samples"))
        loaded = tf.saved_model.load(str(tmp_path / net.name))      # referenced while it is called
        served = loaded.seeded(tf.constant(x), tf.constant([1, 2], tf.int64))
        np.testing.assert_allclose(served["mean"].numpy(),
                                   served["samples"].numpy().astype(np.float64).mean(axis=1), rtol=1e-4)
