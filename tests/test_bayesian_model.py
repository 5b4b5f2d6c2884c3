"""BayesianModel + NoisyKFAC/KFAC as Keras citizens: fit/evaluate/predict round trips (Dense, Conv2D,
mixed with BatchNorm), metrics, schedules, damping roles, KL clipping, tape loops and bad input."""

import logging
import math

import numpy as np
import pytest
import tensorflow as tf
import keras

import tfnng
from tfnng.bench import speed
from tfnng.curvature import capture as cap
from tfnng.posteriors import kronecker as kr


def classification_data(n=96, shape=(6,), seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n,) + shape).astype("float32")
    flat = x.reshape(n, -1)
    y = (flat[:, 0] + flat[:, 1] - flat[:, 2] > 0).astype("int32")
    return x, y


def dense_net():
    return keras.Sequential([keras.Input((6,)), keras.layers.Dense(12, activation="relu"),
                             keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(2)])


def conv_net(batch_norm=False):
    layers = [keras.Input((6, 6, 1)),
              keras.layers.Conv2D(4, 3, padding="same", activation="relu"),
              keras.layers.Conv2D(3, 2, strides=2, use_bias=False)]
    if batch_norm:
        layers.append(keras.layers.BatchNormalization())
    layers += [keras.layers.Flatten(), keras.layers.Dense(2)]
    return keras.Sequential(layers)


def fit(net, optimizer, x, y, epochs=4, batch_size=16, jit_compile=False, **kwargs):
    model = tfnng.BayesianModel(net)
    model.compile(optimizer=optimizer, loss=tfnng.losses.CategoricalNLL(), jit_compile=jit_compile)
    history = model.fit(x, y, batch_size=batch_size, epochs=epochs, verbose=0,
                        validation_data=(x, y), **kwargs)
    return model, history.history


def test_dense_round_trip_metrics_schedules_and_samples():
    keras.utils.set_random_seed(0)
    x, y = classification_data()
    optimizer = tfnng.optimizers.NoisyKFAC(learning_rate=0.05, num_examples=len(x), stats_every=2,
                                           inverse_every=5, seed=0)
    model, history = fit(dense_net(), optimizer, x, y, epochs=6)
    for key in ("loss", "nll", "kl", "val_loss", "val_nll", "val_kl"):
        assert np.isfinite(history[key]).all(), key
    np.testing.assert_allclose(history["loss"], np.add(history["nll"], history["kl"]), rtol=1e-5)
    assert history["nll"][-1] < 0.8 * history["nll"][0]
    updates = 6 * math.ceil(len(x) / 16)
    assert int(optimizer._update_count.numpy()) == updates
    assert int(optimizer._stats_count.numpy()) == math.ceil(updates / 2)
    kl = float(optimizer.kl_divergence())
    np.testing.assert_allclose(history["val_kl"][-1], kl / len(x), rtol=1e-5)   # state fixed in evaluate
    # the model holds a draw from the MVG posterior of each layer
    layer = model.net.layers[0]
    mean = optimizer.posterior_mean(layer.kernel).numpy()
    std = optimizer.posterior_stddev(layer.kernel).numpy()
    z = (layer.kernel.numpy() - mean) / std
    assert std.min() > 0 and 0.6 < z.std() < 1.4
    prediction = tfnng.predict(model, x, num_samples=8)
    assert prediction.probs.shape == (len(x), 2)
    assert (prediction.probs.argmax(1) == y).mean() > 0.8
    evaluated = model.evaluate(x, y, verbose=0, return_dict=True)
    assert set(evaluated) >= {"loss", "nll", "kl"}


def test_conv_round_trip_with_empirical_fisher_and_momentum():
    keras.utils.set_random_seed(1)
    x, y = classification_data(shape=(6, 6, 1))
    optimizer = tfnng.optimizers.NoisyKFAC(learning_rate=0.05, num_examples=len(x), stats_every=1,
                                           inverse_every=3, fisher="empirical", momentum=0.5,
                                           seed=1)
    model, history = fit(conv_net(), optimizer, x, y, epochs=5)
    assert np.isfinite(history["loss"]).all()
    assert history["nll"][-1] < history["nll"][0]
    assert [b.spec.kind for b in optimizer._blocks] == ["conv2d", "conv2d", "dense"]
    assert optimizer._fallback == []
    prediction = tfnng.predict(model, x, num_samples=4)
    assert np.isfinite(prediction.probs).all()


def test_mixed_model_falls_back_to_diagonal_for_batch_norm_and_says_so_once(caplog):
    keras.utils.set_random_seed(2)
    x, y = classification_data(shape=(6, 6, 1))
    optimizer = tfnng.optimizers.NoisyKFAC(learning_rate=0.02, num_examples=len(x), stats_every=1,
                                           inverse_every=4, seed=2)
    with caplog.at_level(logging.WARNING, logger="tfnng"):
        model, history = fit(conv_net(batch_norm=True), optimizer, x, y, epochs=3)
    messages = [r.getMessage() for r in caplog.records if "batch_normalization" in r.getMessage()]
    assert len(messages) == 1, messages
    assert np.isfinite(history["loss"]).all()
    bn = model.net.layers[2]
    assert optimizer.posterior_stddev(bn.gamma).numpy().min() > 0
    assert np.isfinite(float(optimizer.kl_divergence()))
    tfnng.predict(model, x, num_samples=3)


def test_diagonal_fallback_takes_noisy_adams_first_step_from_hess_init():
    """Alg. 1 from f = hess_init (NoisyAdam's default 1) with beta_2 = 1 - stat_decay: from f = 0
    a BatchNormalization scale moved by 100-150 learning rates per step at N = 60000."""
    keras.utils.set_random_seed(4)
    x, y = classification_data(n=16, shape=(6, 6, 1))
    net = conv_net(batch_norm=True)
    capture = cap.LayerCapture(net)
    optimizer = tfnng.optimizers.NoisyKFAC(learning_rate=1e-3, num_examples=60000, momentum=0.5,
                                           kl_clip=1e-3, seed=4)
    optimizer.prepare_curvature(capture.specs)
    optimizer.build(net.trainable_variables)
    gamma = net.layers[2].gamma
    _, _, grads, curvature = tfnng.models.gradients_and_curvature(
        net, capture, optimizer, tfnng.losses.CategoricalNLL(), tf.constant(x), tf.constant(y))
    g = grads[[v is gamma for v in net.trainable_variables].index(True)].numpy().astype(np.float64)
    w = gamma.numpy().astype(np.float64)                     # the first sample is the initial mean
    optimizer.apply_gradients(zip(grads, net.trainable_variables), curvature=curvature)
    beta_2 = 1.0 - optimizer.stat_decay
    f = beta_2 * optimizer.hess_init + (1 - beta_2) * g ** 2
    step = 1e-3 * (g + optimizer.intrinsic_damping * w) / (f + optimizer.step_damping)
    np.testing.assert_allclose(optimizer.posterior_mean(gamma).numpy(), w - step, rtol=1e-5)
    assert np.abs(step).max() < 1e-3


def test_epoch_loss_is_nll_plus_kl_with_uneven_batches():
    """The kl tracker averaged per batch while nll and loss averaged per example: with batches of
    9 and 1 examples the epoch's loss was not nll + kl."""
    x, y = classification_data(n=10)
    optimizer = tfnng.optimizers.NoisyAdam(learning_rate=0.05, num_examples=10, seed=0)
    _, history = fit(dense_net(), optimizer, x, y, epochs=2, batch_size=9)
    np.testing.assert_allclose(history["loss"], np.add(history["nll"], history["kl"]), rtol=1e-6)


def test_evaluate_reports_the_weighted_kl_and_runs_the_net_in_inference_mode():
    """``kl`` is zero before the first step and ``kl_weight KL / N`` after it (the test step traced
    by the first ``evaluate`` had kept kl = 0 as a constant); ``nll`` is the loss of
    ``net(x, training=False)``, and evaluating leaves the BatchNormalization statistics alone."""
    keras.utils.set_random_seed(0)
    x, y = classification_data(n=32)
    net = keras.Sequential([keras.Input((6,)), keras.layers.BatchNormalization(),
                            keras.layers.Dense(2)])
    optimizer = tfnng.optimizers.NoisyAdam(learning_rate=0.01, num_examples=32, kl_weight=0.3, seed=0)
    model = tfnng.BayesianModel(net)
    model.compile(optimizer=optimizer, loss=tfnng.losses.CategoricalNLL())
    untrained = model.evaluate(x, y, batch_size=32, verbose=0, return_dict=True)
    assert untrained["kl"] == 0.0 and untrained["loss"] == untrained["nll"]
    model.fit(x, y, batch_size=32, epochs=1, verbose=0)
    shifted = 3 * x + 5                                    # far from the training statistics
    statistics = [v.numpy() for v in net.non_trainable_variables]
    evaluated = model.evaluate(shifted, y, batch_size=32, verbose=0, return_dict=True)
    np.testing.assert_allclose(evaluated["kl"], 0.3 * float(optimizer.kl_divergence()) / 32, rtol=1e-5)
    np.testing.assert_allclose(evaluated["nll"],
                               float(model.loss(y, net(shifted, training=False))), rtol=1e-5)
    for variable, value in zip(net.non_trainable_variables, statistics):
        np.testing.assert_array_equal(variable.numpy(), value)
    # Each metric once (the trackers used to be listed twice: evaluate's list, test_on_batch).
    assert model.metrics_names == ["loss", "nll", "kl"]
    assert model.test_on_batch(shifted, y) == pytest.approx(
        [evaluated[name] for name in model.metrics_names], rel=1e-5)


def test_plain_kfac_has_no_posterior_distribution():
    x, y = classification_data(n=32)
    optimizer = tfnng.optimizers.KFAC(learning_rate=0.1)
    model, _ = fit(dense_net(), optimizer, x, y, epochs=1)
    assert float(optimizer.kl_divergence()) == 0.0
    with pytest.raises(ValueError, match="point estimate"):           # used to be KeyError 'a_root'
        optimizer.posterior()


def test_plain_kfac_follows_weights_assigned_or_restored_between_steps():
    """The model holds plain K-FAC's mean: after EarlyStopping's restore_best_weights (here an
    assignment) posterior_mean read the last step's mean, tfnng.predict predicted with it, and the
    next step wrote it back over the restored weights."""
    x, y = classification_data(n=32)
    optimizer = tfnng.optimizers.KFAC(learning_rate=0.1)
    model, _ = fit(dense_net(), optimizer, x, y, epochs=1)
    restored = [v.numpy() + 0.25 for v in model.net.trainable_variables]
    for variable, value in zip(model.net.trainable_variables, restored):
        variable.assign(value)
    for variable, value in zip(model.net.trainable_variables, restored):
        np.testing.assert_array_equal(optimizer.posterior_mean(variable).numpy(), value)
    np.testing.assert_allclose(tfnng.predict(model, x, num_samples=2).probs,
                               tf.nn.softmax(model.predict(x, verbose=0)), rtol=1e-5, atol=1e-7)
    optimizer.learning_rate = 0.0
    model.fit(x, y, batch_size=32, epochs=1, verbose=0)
    for variable, value in zip(model.net.trainable_variables, restored):
        np.testing.assert_array_equal(variable.numpy(), value)


def test_plain_kfac_trains_without_noise_under_xla(caplog):
    """Trains under XLA, with a warning that XLA's CPU eigensolver makes inverse updates slow
    (not given without XLA)."""
    keras.utils.set_random_seed(3)
    x, y = classification_data()
    optimizer = tfnng.optimizers.KFAC(learning_rate=0.1, damping=0.01, l2=1e-4, stats_every=1,
                                      inverse_every=5)
    with caplog.at_level(logging.WARNING, logger="tfnng"):
        fit(dense_net(), tfnng.optimizers.KFAC(learning_rate=0.1), x, y, epochs=1)
        assert "jit_compile=False" not in caplog.text
        model, history = fit(dense_net(), optimizer, x, y, epochs=5, jit_compile=True)
    assert "compiled with XLA on the CPU" in caplog.text
    assert history["nll"][-1] < 0.6 * history["nll"][0]
    assert history["kl"][-1] == 0.0
    for variable in model.net.trainable_variables:
        np.testing.assert_array_equal(variable.numpy(), optimizer.posterior_mean(variable).numpy())


def test_block_tridiagonal_trains_under_xla():
    """Its KL offset needs log-determinants: XLA has no kernel for slogdet (it failed at the first
    step); the Cholesky-based one equals numpy's, eagerly and compiled."""
    matrix = np.random.default_rng(0).normal(size=(5, 5))      # not symmetric, det of either sign
    expected = np.linalg.slogdet(matrix)[1]
    np.testing.assert_allclose(kr._log_abs_det(tf.constant(matrix)).numpy(), expected, rtol=1e-12)
    compiled = tf.function(kr._log_abs_det, jit_compile=True)
    np.testing.assert_allclose(compiled(tf.constant(matrix)).numpy(), expected, rtol=1e-12)
    keras.utils.set_random_seed(4)
    x, y = classification_data()
    optimizer = tfnng.optimizers.NoisyKFAC(learning_rate=0.05, num_examples=len(x),
                                           block_tridiagonal=True, stats_every=1, inverse_every=3,
                                           seed=4)
    _, history = fit(dense_net(), optimizer, x, y, epochs=2, jit_compile=True)
    assert np.isfinite(history["loss"]).all() and np.isfinite(history["kl"]).all()


def test_block_tridiagonal_round_trip():
    keras.utils.set_random_seed(4)
    x, y = classification_data()
    optimizer = tfnng.optimizers.NoisyKFAC(learning_rate=0.05, num_examples=len(x),
                                           block_tridiagonal=True, stats_every=1, inverse_every=3,
                                           seed=4)
    model, history = fit(dense_net(), optimizer, x, y, epochs=4)
    assert len(optimizer._chains) == 1 and len(optimizer._chains[0]) == 3
    assert np.isfinite(history["loss"]).all() and history["nll"][-1] < history["nll"][0]
    variances = optimizer.layer_posterior(model.net.layers[1])["marginal_variance"].numpy()
    assert variances.min() > 0
    assert int(optimizer._inverse_failures.numpy()) == 0
    tfnng.predict(model, x, num_samples=3)


def small_trained_optimizer(**kwargs):
    keras.utils.set_random_seed(5)
    x, y = classification_data(n=32)
    net = keras.Sequential([keras.Input((6,)), keras.layers.Dense(3, activation="tanh"),
                            keras.layers.Dense(2)])
    optimizer = tfnng.optimizers.NoisyKFAC(num_examples=50, stats_every=1, seed=5, **kwargs)
    fit(net, optimizer, x, y, epochs=2, batch_size=8)
    return net, optimizer


@pytest.mark.parametrize("kl_clip", [None, 1e-6])
def test_a_float64_mean_step_is_exact_in_float64(kl_clip, float64_keras):
    """NNG Alg. 2's mean step M <- M - alpha [A^g]^-1 (G + gamma_in W) [S^g]^-1, with the KL-clipped
    alpha of App. C.2 eq. 26 when ``kl_clip`` is set. The step size was computed in float32: a
    float64 model's step was off by 1.5e-8 relative (alpha = 0.1)."""
    optimizer = tfnng.optimizers.NoisyKFAC(learning_rate=0.1, num_examples=20, stats_every=1,
                                           inverse_every=1, kl_clip=kl_clip, seed=2)
    gradient, before, after = one_dense_step(optimizer)
    block = optimizer._blocks[0]
    v = gradient + before / 20                                          # gamma_in = 1/(N eta)
    direction = block.state["a_inv"].numpy() @ v @ block.state["s_inv"].numpy()
    alpha = 0.1 if kl_clip is None else min(0.1, np.sqrt(kl_clip / np.sum(direction * v)))
    assert kl_clip is None or alpha < 0.1                               # the clip is active
    np.testing.assert_allclose(after - before, -alpha * direction, rtol=1e-12)


def curvature_step(net, capture, optimizer, loss, x, y):
    """One hand-written training step (BayesianModel.train_step's curvature branch); the gradients."""
    _, _, grads, captured = tfnng.models.gradients_and_curvature(net, capture, optimizer, loss, x, y)
    optimizer.apply_gradients(zip(grads, net.trainable_variables), curvature=captured)
    return grads


def one_dense_step(optimizer):
    """One step of ``optimizer`` on a 3-2 Dense net and a fixed batch (GaussianNLL(0.5)): the
    gradient, mean before and mean after, each as the (4, 2) matrix [W; b]."""
    keras.utils.set_random_seed(2)
    rng = np.random.default_rng(2)
    x, y = rng.normal(size=(8, 3)), rng.normal(size=(8, 2))
    net = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    capture = cap.LayerCapture(net)
    optimizer.prepare_curvature(capture.specs)
    layer = net.layers[0]
    before = np.vstack([layer.kernel.numpy(), layer.bias.numpy()[None]])
    grads = curvature_step(net, capture, optimizer, tfnng.losses.GaussianNLL(0.5), x, y)
    after = np.vstack([optimizer.posterior_mean(layer.kernel).numpy(),
                       optimizer.posterior_mean(layer.bias).numpy()[None]])
    return np.vstack([grads[0].numpy(), grads[1].numpy()[None]]), before, after


def test_sampling_uses_gamma_in_and_the_step_gamma_in_plus_gamma_ex():
    net, optimizer = small_trained_optimizer(learning_rate=0.01, extrinsic_damping=0.3,
                                             inverse_every=1, prior_variance=0.5)
    block = optimizer._blocks[0]
    a, s = (block.state[k].numpy().astype(np.float64) for k in ("a", "s"))
    gamma_in = 1.0 / (50 * 0.5)
    a_in, s_in = (m.numpy() for m in kr.damped_factors(tf.constant(a), tf.constant(s), gamma_in))
    a_all, s_all = (m.numpy() for m in kr.damped_factors(tf.constant(a), tf.constant(s),
                                                         gamma_in + 0.3))
    # the inverses were computed at the last update, from the factors as they were before its
    # statistics; recompute from the stored factors after one more inverse update
    optimizer._update_inverses()
    np.testing.assert_allclose(block.state["a_inv"].numpy(), np.linalg.inv(a_all), rtol=2e-4, atol=1e-5)
    np.testing.assert_allclose(block.state["s_inv"].numpy(), np.linalg.inv(s_all), rtol=2e-4, atol=1e-5)
    posterior = optimizer.layer_posterior(net.layers[0])
    np.testing.assert_allclose(posterior["sigma_1"].numpy(), np.linalg.inv(a_in) / 50, rtol=2e-4, atol=1e-6)
    np.testing.assert_allclose(posterior["sigma_2"].numpy(), np.linalg.inv(s_in), rtol=2e-4, atol=1e-5)
    # samples written by sample_weights have the covariance Sigma_2 (x) Sigma_1 (column-stacking vec)
    layer = net.layers[0]

    @tf.function
    def draw():
        optimizer.sample_weights()
        return tf.reshape(tf.transpose(tf.concat([layer.kernel, layer.bias[None]], 0)), [-1])

    draws = [draw().numpy() for _ in range(2000)]
    dense = np.kron(posterior["sigma_2"].numpy(), posterior["sigma_1"].numpy())
    emp = np.cov(np.array(draws), rowvar=False)
    tol = 5 * np.sqrt((np.outer(np.diag(dense), np.diag(dense)) + dense ** 2) / len(draws))
    assert (np.abs(emp - dense) < tol).all()
    np.testing.assert_allclose(np.mean(draws, 0),
                               posterior["mean"].numpy().T.ravel(), atol=5 * np.sqrt(np.diag(dense).max() / 2000))


def test_default_extrinsic_damping_keeps_a_large_data_set_stable(wide_mlp_and_one_batch):
    """With N = 60000, gamma_in = 1/(N eta) is 1.7e-5. Alg. 2 with gamma_ex = 0 (the default before)
    or 1e-4 sent this MLP's weights to 1e13-1e18 and its loss to NaN within 60 steps on one batch
    (with the first batch's factors alone, ``factor_prior_count=0``; with the factor prior they
    train); the default gamma_ex = 1e-3 must keep the training finite and the weights moderate."""
    net, batches = wide_mlp_and_one_batch
    optimizer = tfnng.optimizers.NoisyKFAC(learning_rate=1e-3, num_examples=60000, seed=0)
    assert optimizer.extrinsic_damping == 1e-3
    model = tfnng.BayesianModel(net)
    model.compile(optimizer=optimizer, loss=tfnng.losses.CategoricalNLL())
    history = model.fit(batches, steps_per_epoch=20, epochs=3, verbose=0).history
    assert np.all(np.isfinite(history["nll"])), history
    assert max(float(tf.reduce_max(tf.abs(w))) for w in net.trainable_variables) < 10.0


def test_default_factor_prior_keeps_the_first_steps_of_a_cnn_stable():
    """The CNN of ``bench speed`` (N = 60000, one batch of 128 random images and labels, learning
    rate 1e-3, no KL clipping). With the first batch's factors alone (``factor_prior_count=0``,
    the behaviour before the factor prior) the posterior is as wide as the prior in every
    direction that batch does not reach, and this test fails: the batch's mean NLL is 23 at the
    2nd step, 5e16 at the 5th, and the updates are skipped (NaN) from the 6th on. With the
    default every update is applied and the mean NLL of the 12 steps is 3.0."""
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((128, 28, 28, 1)).astype("float32")
    y = rng.integers(0, 10, 128)
    net = speed.MODELS["cnn"]()
    optimizer = tfnng.optimizers.NoisyKFAC(learning_rate=1e-3, num_examples=60000, seed=0)
    model = tfnng.BayesianModel(net)
    model.compile(optimizer=optimizer, loss=tfnng.losses.CategoricalNLL())
    batches = tf.data.Dataset.from_tensors((x, y)).repeat()
    nll = model.fit(batches, steps_per_epoch=12, epochs=1, verbose=0).history["nll"][-1]
    assert optimizer.skipped_updates == 0
    assert nll < 4.0, nll         # less than twice the initial log(10) = 2.30


def test_kl_clipped_step_has_the_requested_fisher_norm():
    """App. C.2, eq. 25-26: the step's squared norm under the damped approximate Fisher is c."""
    net, optimizer = small_trained_optimizer(learning_rate=10.0, kl_clip=1e-6, inverse_every=1000)
    capture = cap.LayerCapture(net)
    x, y = classification_data(n=8, seed=9)
    loss_fn = tfnng.losses.CategoricalNLL()
    _, _, grads, curvature = tfnng.models.gradients_and_curvature(
        net, capture, optimizer, loss_fn, tf.constant(x), tf.constant(y))
    before = [optimizer._mean_matrix(b).numpy() for b in optimizer._blocks]
    optimizer.apply_gradients(zip(grads, net.trainable_variables), curvature=curvature)
    norm = 0.0
    for block, old in zip(optimizer._blocks, before):
        delta = optimizer._mean_matrix(block).numpy() - old
        a_g = np.linalg.inv(block.state["a_inv"].numpy().astype(np.float64))
        s_g = np.linalg.inv(block.state["s_inv"].numpy().astype(np.float64))
        norm += np.sum(delta * (a_g @ delta @ s_g))
    np.testing.assert_allclose(norm, 1e-6, rtol=1e-3)


def test_hand_written_loop():
    keras.utils.set_random_seed(6)
    x, y = classification_data(n=64)
    net = dense_net()
    capture = cap.LayerCapture(net)
    optimizer = tfnng.optimizers.NoisyKFAC(learning_rate=0.05, num_examples=64, stats_every=1,
                                           inverse_every=2, seed=6)
    optimizer.prepare_curvature(capture.specs)
    optimizer.build(net.trainable_variables)
    loss_fn = tfnng.losses.CategoricalNLL()
    seed = keras.random.SeedGenerator(0)

    @tf.function
    def step(xb, yb):
        loss, _, grads, curvature = tfnng.models.gradients_and_curvature(
            net, capture, optimizer, loss_fn, xb, yb, seed=seed)
        optimizer.apply_gradients(zip(grads, net.trainable_variables), curvature=curvature)
        return loss

    losses = [float(step(tf.constant(x), tf.constant(y))) for _ in range(30)]
    assert np.isfinite(losses).all() and np.mean(losses[-5:]) < losses[0]


def test_a_block_given_only_its_bias_gradient_steps_as_with_a_zero_kernel_gradient():
    """A Kronecker block received in a hand-written loop with its bias gradient alone crashed in
    the diagonal step ("'NoneType' object has no attribute 'assign'"); its kernel, without a
    gradient, now gets zeros, as a bias without one always did. A kernel frozen on its own while
    its bias trains is refused: the block's posterior covers both."""
    x, y = classification_data(n=16)
    results = []
    for kernel_gradient in ("left out", "zeros"):
        keras.utils.set_random_seed(6)
        net = keras.Sequential([keras.Input((6,)), keras.layers.Dense(2)])
        capture = cap.LayerCapture(net)
        optimizer = tfnng.optimizers.NoisyKFAC(learning_rate=0.05, num_examples=16, seed=6)
        optimizer.prepare_curvature(capture.specs)
        optimizer.build(net.trainable_variables)
        for _ in range(2):
            _, _, grads, curvature = tfnng.models.gradients_and_curvature(
                net, capture, optimizer, tfnng.losses.CategoricalNLL(), x, y,
                seed=keras.random.SeedGenerator(0))
            kernel, bias = net.layers[0].kernel, net.layers[0].bias
            pairs = [(grads[1], bias)] + (
                [(tf.zeros_like(grads[0]), kernel)] if kernel_gradient == "zeros" else [])
            optimizer.apply_gradients(pairs, curvature=curvature)
        results.append([v.numpy() for v in net.trainable_variables]
                       + [optimizer.posterior_mean(v).numpy() for v in net.trainable_variables])
    for left_out, zeros in zip(*results):
        np.testing.assert_array_equal(left_out, zeros)
    kernel.trainable = False
    with pytest.raises(ValueError, match="kernel no longer trainable .*freeze the whole layer"):
        optimizer.apply_gradients([(grads[1], bias)], curvature=curvature)


def test_hand_written_loop_with_the_nets_losses_equals_fit():
    """docs/kfac.md's loop with ``compute_loss`` adding ``net.losses`` (a kernel regulariser here)
    gives BayesianModel.fit's posterior on the same batches and seeds, bit for bit."""
    x, y = classification_data(n=16)
    loss_fn = tfnng.losses.CategoricalNLL()

    def setup():
        keras.utils.set_random_seed(1)
        net = keras.Sequential([keras.Input((6,)), keras.layers.Dense(
            5, activation="tanh", kernel_regularizer=keras.regularizers.L2(0.5)), keras.layers.Dense(2)])
        return net, tfnng.optimizers.NoisyKFAC(learning_rate=0.05, num_examples=16, seed=3)

    net, optimizer = setup()
    model = tfnng.BayesianModel(net, seed=0)
    model.compile(optimizer=optimizer, loss=loss_fn)
    model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    by_fit = [optimizer.posterior_mean(v).numpy() for v in net.trainable_variables]

    net, optimizer = setup()
    seed = keras.random.SeedGenerator(0)          # BayesianModel's seed of the sampled targets
    capture = cap.LayerCapture(net)
    optimizer.prepare_curvature(capture.specs)
    optimizer.build(net.trainable_variables)

    @tf.function
    def step(xb, yb):
        _, _, grads, curvature = tfnng.models.gradients_and_curvature(
            net, capture, optimizer, loss_fn, xb, yb, seed=seed,
            compute_loss=lambda y_pred: loss_fn(yb, y_pred) + sum(net.losses))
        optimizer.apply_gradients(zip(grads, net.trainable_variables), curvature=curvature)

    for _ in range(2):
        for start in (0, 8):
            step(x[start:start + 8], y[start:start + 8])
    for loop, fit in zip([optimizer.posterior_mean(v).numpy() for v in net.trainable_variables],
                         by_fit):
        np.testing.assert_array_equal(loop, fit)


class _NoiselessKFAC(tfnng.optimizers.NoisyKFAC):
    """NoisyKFAC whose samples are the mean (sqrt(lambda / N) = 0): deterministic evaluations."""

    @property
    def noise_scale(self):
        return 0.0


@pytest.mark.parametrize("block_tridiagonal", [False, True])
def test_mc_samples_average_the_evaluations_of_a_group_into_one_mean_step(block_tridiagonal):
    # Noise-free samples (the mean) make the evaluations deterministic. mc_samples=2 fed batch b1
    # then b2 must move the means as one mc_samples=1 update with the gradient (g1 + g2) / 2 and the
    # curvature of b2 (stat_decay = 1: the factors are the latest evaluation's). Using g2 alone,
    # summing, or stepping at every evaluation all fail.
    x, y = classification_data(n=48)
    batches = [(tf.constant(x[i:i + 8]), tf.constant(y[i:i + 8])) for i in range(0, 48, 8)]
    init = dense_net().get_weights()
    loss_fn = tfnng.losses.CategoricalNLL()

    def setup(mc_samples):
        net = dense_net()
        net.set_weights(init)
        capture = cap.LayerCapture(net)
        capture.find_links(batches[0][0])
        optimizer = _NoiselessKFAC(learning_rate=0.05, num_examples=len(x), stat_decay=1.0,
                                   momentum=0.9, stats_every=1, inverse_every=2, kl_clip=0.01,
                                   fisher="empirical", block_tridiagonal=block_tridiagonal,
                                   mc_samples=mc_samples, seed=0)
        optimizer.prepare_curvature(capture.specs)
        optimizer.build(net.trainable_variables)
        return net, capture, optimizer

    def evaluate(net, capture, optimizer, batch):
        _, _, grads, curvature = tfnng.models.gradients_and_curvature(
            net, capture, optimizer, loss_fn, *batch, seed=keras.random.SeedGenerator(0))
        return grads, curvature

    grouped, reference = setup(2), setup(1)
    for b1, b2 in zip(batches[::2], batches[1::2]):
        net, _, optimizer = grouped
        for batch in (b1, b2):
            grads, curvature = evaluate(*grouped, batch)
            optimizer.apply_gradients(zip(grads, net.trainable_variables), curvature=curvature)
        net, _, optimizer = reference
        g1, _ = evaluate(*reference, b1)
        g2, curvature = evaluate(*reference, b2)
        averaged = [(a + b) / 2 for a, b in zip(g1, g2)]
        optimizer.apply_gradients(zip(averaged, net.trainable_variables), curvature=curvature)
    assert int(grouped[2]._update_count.numpy()) == int(reference[2]._update_count.numpy()) == 3
    means = {mc: [opt.posterior_mean(v).numpy() for v in net.trainable_variables]
             for mc, (net, _, opt) in ((2, grouped), (1, reference))}
    assert min(np.abs(m - w).max() for m, w in zip(means[1], init)) > 1e-3
    for two, one in zip(means[2], means[1]):
        np.testing.assert_allclose(two, one, rtol=1e-4, atol=1e-6)


class SubclassedNet(keras.Model):
    def __init__(self):
        super().__init__()
        self.hidden, self.out = keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(2)

    def call(self, x):
        return self.out(self.hidden(x))


@pytest.mark.parametrize("make_net", [
    SubclassedNet, lambda: keras.Sequential([keras.layers.Dense(8, activation="tanh"),
                                             keras.layers.Dense(2)])])
def test_nets_built_by_their_first_batch_get_every_layer_captured(make_net, tmp_path):
    """Keras builds an unbuilt net while tracing the first train step: K-FAC still gets its layers,
    and the wrapper is built too (its weights could not be saved: "not yet been built")."""
    x, y = classification_data(n=32)
    optimizer = tfnng.optimizers.NoisyKFAC(learning_rate=0.05, num_examples=len(x), seed=0)
    model, history = fit(make_net(), optimizer, x, y, epochs=2)
    assert len(optimizer._blocks) == 2 and np.isfinite(history["loss"]).all()
    assert int(optimizer._update_count.numpy()) == 2 * 2
    assert model.built
    model.save_weights(tmp_path / "model.weights.h5")
    restored = tfnng.BayesianModel(make_net())
    restored.compile(optimizer=tfnng.optimizers.NoisyKFAC(learning_rate=0.05, num_examples=len(x)),
                     loss=tfnng.losses.CategoricalNLL())
    restored.fit(x[:16], y[:16], batch_size=16, epochs=1, verbose=0)     # builds net and optimizer
    restored.load_weights(tmp_path / "model.weights.h5")
    for variable, twin in zip(model.net.trainable_variables, restored.net.trainable_variables):
        np.testing.assert_array_equal(restored.optimizer.posterior_mean(twin),
                                      optimizer.posterior_mean(variable))


class PReLUNet(keras.Model):
    """Dense(PReLU) -> Dense."""

    def __init__(self):
        super().__init__(name="prelu_net")
        self.hidden = keras.layers.Dense(4, activation=keras.layers.PReLU())
        self.head = keras.layers.Dense(2)

    def call(self, x):
        return self.head(self.hidden(x))


@keras.saving.register_keras_serializable(package="tests")
class NoisyHeadModel(tfnng.BayesianModel):
    """A BayesianModel whose own ``call`` adds a layer (a learned noise precision) after the net."""

    def __init__(self, net, **kwargs):
        super().__init__(net, **kwargs)
        self.noise = tfnng.layers.NoisePrecision(num_examples=16, name="noise")

    def call(self, inputs, training=None):
        return self.noise(self.net(inputs, training=training))


def test_variables_created_by_the_first_forward_pass_are_trained_or_get_a_clear_error():
    """A Keras layer as a Dense activation creates its variable when the Dense first runs, a layer
    a BayesianModel subclass adds in its own ``call`` when the wrapper first runs. The first step
    runs the model's forward pass before the curvature optimizer is built (Keras's "Unknown
    variable" error, which advised a new optimizer, stopped the first step; later the wrapper's
    own layers still did, and the error's advice to call the net did not help). An optimizer built
    before the first step gets an error that names the variable, and its advice works."""
    x, y = classification_data(n=16)

    def sequential():
        return keras.Sequential([keras.Input((6,)),
                                 keras.layers.Dense(4, activation=keras.layers.PReLU()),
                                 keras.layers.Dense(2)])

    def subclassed():
        net = PReLUNet()
        net.hidden.build((None, 6))
        net.head.build((None, 4))
        net.built = True
        return net

    for net in (subclassed(), sequential()):
        model, history = fit(net, tfnng.optimizers.VOGN(learning_rate=0.05, num_examples=len(x)),
                             x, y, epochs=1)
        assert len(model.optimizer._trainable_variables) == 5 and np.isfinite(history["loss"]).all()
    regression = x[:, :1] - x[:, 1:2]
    for make in (tfnng.optimizers.VOGN, tfnng.optimizers.NoisyKFAC):
        model = NoisyHeadModel(keras.Sequential([keras.Input((6,)), keras.layers.Dense(1)]),
                               name=f"noisy_head_{make.__name__}")
        model.compile(optimizer=make(learning_rate=0.05, num_examples=len(x)),
                      loss=tfnng.losses.GaussianNLL("learned"))
        history = model.fit(x, regression, batch_size=8, epochs=1, verbose=0).history
        assert len(model.optimizer._trainable_variables) == 3 and np.isfinite(history["loss"]).all()

    model = tfnng.BayesianModel(subclassed())
    model.compile(optimizer=tfnng.optimizers.VOGN(learning_rate=0.05, num_examples=len(x)),
                  loss=tfnng.losses.CategoricalNLL())
    model.optimizer.build(model.trainable_variables)
    with pytest.raises(ValueError, match=r"VOGN was built .* without .*p_re_lu.*/alpha: created by "
                                         r"the model's first forward pass.*`model\(x\[:1\]\)`"):
        model.fit(x, y, verbose=0)
    model = tfnng.BayesianModel(subclassed())
    model(x[:1])
    model.compile(optimizer=tfnng.optimizers.VOGN(learning_rate=0.05, num_examples=len(x)),
                  loss=tfnng.losses.CategoricalNLL())
    model.optimizer.build(model.trainable_variables)
    assert np.isfinite(model.fit(x, y, verbose=0).history["loss"]).all()


class TemperedModel(tfnng.BayesianModel):
    """A BayesianModel whose own ``build`` adds a weight (an output scale) its ``call`` uses."""

    def build(self, input_shape=None):
        self.scale = self.add_weight(shape=(), initializer="ones", name="scale")
        super().build(input_shape)

    def call(self, inputs, training=None):
        return self.net(inputs, training=training) * self.scale


class HeadOnFrozenNetModel(tfnng.BayesianModel):
    """A frozen feature extractor (the net) under a trainable head the subclass holds."""

    def __init__(self, net, **kwargs):
        super().__init__(net, **kwargs)
        self.head = keras.layers.Dense(1, name="head")

    def call(self, inputs, training=None):
        return self.head(self.net(inputs, training=training))


@pytest.mark.parametrize("make", [tfnng.optimizers.NoisyAdam, tfnng.optimizers.VOGN,
                                  tfnng.optimizers.NoisyKFAC])
def test_subclasses_with_weights_of_their_own_train_save_and_load(make, tmp_path):
    """Weights a subclass adds (in its build, or by a layer its call adds) are trained and saved
    with the net's, also when the net was built before: the subclass's build was skipped (an
    AttributeError in the first step), a frozen net under a trainable head was refused ("no
    trainable weights"), load_model built the optimizer before the head's variables existed
    ("the saved optimizer state has 16 variables, this optimizer has 14"), and so did the
    documented restore into a fresh model (optimizer.build after compile)."""
    x, y = classification_data(n=16)
    y = (x[:, :1] - x[:, 1:2]).astype("float32")

    def dense_net(name):
        return keras.Sequential([keras.Input((6,)), keras.layers.Dense(3, activation="tanh")],
                                name=name)

    frozen = dense_net("frozen")
    frozen.trainable = False
    for model, own in [(TemperedModel(dense_net("tempered_net"), name="tempered"), "scale"),
                       (HeadOnFrozenNetModel(frozen, name="head_on_frozen"), "head/kernel"),
                       (NoisyHeadModel(dense_net("noisy_head_net"), name="noisy_head"),
                        "noise/log_parameters")]:
        model.compile(optimizer=make(learning_rate=0.01, num_examples=len(x)),
                      loss=tfnng.losses.GaussianNLL("learned" if own.startswith("noise") else 1.0))
        targets = y if own.startswith("head") else np.tile(y, 3)     # the net's width is 3
        history = model.fit(x, targets, batch_size=8, epochs=1, verbose=0).history
        paths = [v.path for v in model.optimizer._trainable_variables]
        assert any(path.endswith(own) for path in paths), paths
        assert np.isfinite(history["loss"]).all()
    model.save(tmp_path / "model.keras")
    loaded = keras.models.load_model(tmp_path / "model.keras")
    model.save_weights(tmp_path / "model.weights.h5")
    fresh = NoisyHeadModel(dense_net("fresh_net"), name="fresh")   # docs/saving.md's recipe
    fresh.compile(optimizer=make(learning_rate=0.01, num_examples=len(x)),
                  loss=tfnng.losses.GaussianNLL("learned"))
    fresh.optimizer.build(fresh.trainable_variables)     # compile built the subclass's layers
    fresh.load_weights(tmp_path / "model.weights.h5")
    for restored in (loaded, fresh):
        for a, b in zip(model.optimizer.variables + model.weights,
                        restored.optimizer.variables + restored.weights):
            np.testing.assert_array_equal(b.numpy(), a.numpy(), err_msg=a.path)


def test_a_net_that_overrides_compute_loss_is_refused():
    """BayesianModel trains on its own compiled loss: the net's extra term was dropped silently."""

    class NetWithATerm(keras.Model):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.dense = keras.layers.Dense(1)

        def call(self, x):
            return self.dense(x)

        def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
            return super().compute_loss(x, y, y_pred, sample_weight, training) + 1.0

    with pytest.raises(ValueError, match="'with_a_term' overrides compute_loss.*BayesianModel "
                                         "subclass's compute_loss"):
        tfnng.BayesianModel(NetWithATerm(name="with_a_term"))


@pytest.mark.parametrize("make_optimizer", [
    lambda n: tfnng.optimizers.NoisyAdam(learning_rate=0.05, num_examples=n, seed=0),
    lambda n: tfnng.optimizers.NoisyKFAC(learning_rate=0.05, num_examples=n, seed=0)])
def test_a_loss_keyed_by_the_nets_output_name_or_given_as_a_class_trains_as_the_loss_itself(
        make_optimizer):
    """Keras matches a dict loss against ``model.output_names``, which the wrapper takes from its
    net (the first step failed with "'NoneType' object is not iterable"). Keras also takes a loss
    class for its default instance, which the true Fisher's sampler was handed as it is
    ("sample() missing 1 required positional argument")."""
    x, y = classification_data(n=32)
    results = []
    for loss in (tfnng.losses.CategoricalNLL(), {"logits": tfnng.losses.CategoricalNLL()},
                 tfnng.losses.CategoricalNLL):
        keras.utils.set_random_seed(0)
        inputs = keras.Input((6,))
        hidden = keras.layers.Dense(8, activation="tanh")(inputs)
        model = tfnng.BayesianModel(keras.Model(inputs, keras.layers.Dense(2, name="logits")(hidden)))
        model.compile(optimizer=make_optimizer(len(x)), loss=loss)
        history = model.fit(x, y, batch_size=16, epochs=2, verbose=0).history
        results.append((history["loss"], [v.numpy() for v in model.trainable_variables]))
    assert model.output_names == ["logits"]
    for other in results[1:]:
        np.testing.assert_array_equal(results[0][0], other[0])
        for first, second in zip(results[0][1], other[1]):
            np.testing.assert_array_equal(first, second)
    probabilities = tfnng.predict(model, x[:4], num_samples=3).probs
    np.testing.assert_allclose(np.sum(probabilities, axis=-1), 1.0, rtol=1e-6)


@pytest.mark.parametrize("make_optimizer, joint", [
    (lambda n: tfnng.optimizers.NoisyKFAC(learning_rate=0.05, num_examples=n), True),
    (lambda n: tfnng.optimizers.SLANG(learning_rate=0.05, num_examples=n, rank=2), True),
    (lambda n: tfnng.optimizers.VOGN(learning_rate=0.05, num_examples=n), False)])
def test_freezing_a_layer_and_recompiling_with_the_same_optimizer(make_optimizer, joint):
    """Per-variable curvature (VOGN) trains on; joint curvature state (K-FAC, SLANG) says why not."""
    x, y = classification_data(n=32)
    optimizer = make_optimizer(len(x))
    model, _ = fit(dense_net(), optimizer, x, y, epochs=1)
    model.net.layers[0].trainable = False
    if joint:
        with pytest.raises(ValueError, match="built for the layers"):
            model.compile(optimizer=optimizer, loss=tfnng.losses.CategoricalNLL())
        return
    frozen = model.net.layers[0].kernel.numpy()
    model.compile(optimizer=optimizer, loss=tfnng.losses.CategoricalNLL())
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    assert int(optimizer._update_count.numpy()) == 4
    np.testing.assert_array_equal(model.net.layers[0].kernel.numpy(), frozen)


@pytest.mark.parametrize("make_optimizer", [
    lambda n: tfnng.optimizers.NoisyKFAC(learning_rate=0.05, num_examples=n, seed=0),
    lambda n: tfnng.optimizers.VOGN(learning_rate=0.05, num_examples=n, seed=0),
    lambda n: tfnng.optimizers.SLANG(learning_rate=0.05, num_examples=n, rank=2, seed=0),
    lambda n: tfnng.optimizers.NoisyNaturalGradient(learning_rate=0.05, num_examples=n, seed=0),
    lambda n: tfnng.optimizers.NoisyAdam(learning_rate=0.05, num_examples=n, fisher="true",
                                         seed=0)])
def test_a_layer_frozen_between_compile_and_fit_trains_as_if_frozen_before(make_optimizer):
    """The per-example optimizers failed with a bare KeyError in build (the layer was among the
    captured layers, not among the optimizer's variables); fit now captures the layers trainable
    at the first step. A hand-written loop can still hand over a frozen layer's spec: the
    optimizer skips it."""
    x, y = classification_data(n=32)
    means = {}
    for when in ("before", "after"):
        keras.utils.set_random_seed(0)
        net = dense_net()
        frozen = net.layers[1].kernel.numpy()
        model = tfnng.BayesianModel(net)
        if when == "before":
            net.layers[1].trainable = False
        optimizer = make_optimizer(len(x))
        model.compile(optimizer=optimizer, loss=tfnng.losses.CategoricalNLL())
        net.layers[1].trainable = False
        model.fit(x, y, batch_size=16, epochs=2, verbose=0)
        np.testing.assert_array_equal(net.layers[1].kernel.numpy(), frozen)
        means[when] = [optimizer.posterior_mean(v).numpy() for v in net.trainable_variables]
    assert len(means["after"]) == 4
    for after, before in zip(means["after"], means["before"]):
        np.testing.assert_array_equal(after, before)
    net = dense_net()
    capture = cap.LayerCapture(net)
    optimizer = make_optimizer(len(x))
    optimizer.prepare_curvature(capture.specs)
    net.layers[1].trainable = False
    optimizer.build(net.trainable_variables)
    curvature_step(net, capture, optimizer, tfnng.losses.CategoricalNLL(), x, y)
    assert int(optimizer._update_count.numpy()) == 1


class UnusedHead(keras.Model):
    """A net whose auxiliary head the forward pass does not call (built, with trainable weights)."""

    def __init__(self):
        super().__init__()
        self.body, self.head = keras.layers.Dense(2), keras.layers.Dense(2)

    def build(self, input_shape):
        self.body.build(input_shape)
        self.head.build(input_shape)

    def call(self, x):
        return self.body(x)


def test_a_layer_the_step_does_not_call_is_a_clear_error_and_freezing_it_works():
    x, y = classification_data(n=16)
    net = UnusedHead()
    net.build((None, 6))
    model = tfnng.BayesianModel(net)
    model.compile(optimizer=tfnng.optimizers.VOGN(num_examples=16), loss=tfnng.losses.CategoricalNLL())
    with pytest.raises(ValueError, match=r"not called in the forward pass.*freeze a layer the step "
                                         r"does not use"):
        model.fit(x, y, batch_size=8, verbose=0)
    model = tfnng.BayesianModel(net)
    model.compile(optimizer=tfnng.optimizers.VOGN(num_examples=16), loss=tfnng.losses.CategoricalNLL())
    net.head.trainable = False                       # after compile: read at the first step
    head = [v.numpy() for v in net.head.weights]
    assert np.isfinite(model.fit(x, y, batch_size=8, verbose=0).history["loss"]).all()
    for before, variable in zip(head, net.head.weights):
        np.testing.assert_array_equal(variable.numpy(), before)


@pytest.mark.parametrize("train", ["fit", "train_on_batch"])
def test_trainable_changed_between_compile_and_fit_sets_the_kronecker_structure(train):
    """The layers are those trainable at the first step, as Keras's: a Dense unfrozen after
    compile gets its block (it fell back to a diagonal posterior), and a chain links across a
    Dense frozen after compile (block-tridiagonal had silently lost the chain)."""
    x, y = classification_data(n=16)

    def structure(frozen_at_compile, frozen_at_fit, **kwargs):
        keras.utils.set_random_seed(0)
        net = keras.Sequential([keras.Input((6,)), keras.layers.Dense(5, activation="tanh", name="a"),
                                keras.layers.Dense(5, activation="relu", name="b"),
                                keras.layers.Dense(2, name="c")])
        net.get_layer("b").trainable = not frozen_at_compile
        model = tfnng.BayesianModel(net)
        optimizer = tfnng.optimizers.NoisyKFAC(learning_rate=0.01, num_examples=16, **kwargs)
        model.compile(optimizer=optimizer, loss=tfnng.losses.CategoricalNLL())
        net.get_layer("b").trainable = not frozen_at_fit
        if train == "fit":
            model.fit(x, y, batch_size=16, verbose=0)
        else:
            model.train_on_batch(x, y)
        return ([block.spec.layer.name for block in optimizer._blocks],
                [[block.spec.layer.name for block in chain] for chain in optimizer._chains])

    assert structure(True, False) == structure(False, False) == (["a", "b", "c"], [])
    assert (structure(False, True, block_tridiagonal=True)
            == structure(True, True, block_tridiagonal=True) == (["a", "c"], [["a", "c"]]))


@pytest.mark.parametrize("make_optimizer", [
    lambda n: tfnng.optimizers.NoisyKFAC(learning_rate=0.05, num_examples=n),
    lambda n: tfnng.optimizers.VOGN(learning_rate=0.05, num_examples=n)])
def test_one_optimizer_compiled_with_two_models_says_so(make_optimizer):
    """The optimizer keeps the layers of the last compile: training the first model used to fail
    with a bare KeyError deep in build."""
    x, y = classification_data(n=16)
    optimizer = make_optimizer(len(x))
    first, second = tfnng.BayesianModel(dense_net()), tfnng.BayesianModel(dense_net())
    for model in (first, second):
        model.compile(optimizer=optimizer, loss=tfnng.losses.CategoricalNLL())
    with pytest.raises(ValueError, match="another model's layers"):
        first.fit(x, y, batch_size=8, epochs=1, verbose=0)


def test_errors_and_serialization():
    x, y = classification_data(n=16)
    net = dense_net()
    net.compile(optimizer=tfnng.optimizers.NoisyKFAC(num_examples=16), loss="mse")
    with pytest.raises(ValueError, match="BayesianModel.*hand-written loop.*prepare_curvature"):
        net.fit(x, y.astype("float32"), verbose=0)
    unbuilt = keras.Sequential([keras.layers.Dense(2)])   # found no layers: all fell back silently
    with pytest.raises(ValueError, match="LayerCapture needs a built model"):
        cap.LayerCapture(unbuilt)
    with pytest.raises(ValueError, match="fisher"):
        tfnng.optimizers.NoisyKFAC(num_examples=16, fisher="exact")
    with pytest.raises(ValueError, match="mc_samples"):
        tfnng.optimizers.KFAC(mc_samples=2)
    with pytest.raises(ValueError, match="damping"):
        tfnng.optimizers.KFAC(damping=0.0)
    with pytest.raises(ValueError, match="factor_prior_count"):
        tfnng.optimizers.KFAC(factor_prior_count=-1)
    with pytest.raises(ValueError, match="hess_init"):
        tfnng.optimizers.NoisyKFAC(num_examples=16, hess_init=0.0)
    with pytest.raises(ValueError, match="kl_clip_decay"):       # zeta > 1 used to grow c_k
        tfnng.optimizers.NoisyKFAC(num_examples=16, kl_clip=0.01, kl_clip_decay=1.5)
    for optimizer in (tfnng.optimizers.NoisyKFAC(learning_rate=0.1, num_examples=7, kl_clip=0.01,
                                                 block_tridiagonal=True, stats_every=3,
                                                 factor_prior_count=2, hess_init=0.5),
                      tfnng.optimizers.KFAC(learning_rate=0.2, damping=0.1, l2=0.01)):
        config = optimizer.get_config()
        clone = type(optimizer).from_config(config)
        assert clone.get_config() == config


class PenaltyLayer(keras.layers.Layer):
    """Adds the mean square of its input to the model's losses (``add_loss``)."""

    def call(self, x):
        self.add_loss(keras.ops.mean(x ** 2))
        return x


@pytest.mark.parametrize("make", [lambda: tfnng.optimizers.VOGN(num_examples=8),
                                  lambda: tfnng.optimizers.NoisyKFAC(num_examples=8)],
                         ids=["VOGN", "NoisyKFAC"])
def test_the_true_fisher_without_a_likelihood_loss_says_what_to_pass(make):
    """A net whose only loss was an add_loss term was told another loss "is supported only with
    fisher='empirical'", not that compile had no loss. Another loss is refused at compile."""
    x, y = np.zeros((8, 3), "float32"), np.zeros((8, 1), "float32")
    net = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1, name="out"),
                            PenaltyLayer(name="penalty")])
    model = tfnng.BayesianModel(net)
    model.compile(optimizer=make())
    with pytest.raises(ValueError, match=r"compiled without one: pass it to compile"):
        model.fit(x, y, verbose=0)
    model = tfnng.BayesianModel(keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)]))
    with pytest.raises(ValueError, match=r"needs a tfnng likelihood loss.*another loss is "
                                         r"supported only with fisher='empirical'"):
        model.compile(optimizer=make(), loss="mse")


def test_the_true_fishers_targets_follow_the_models_seed():
    """BayesianModel seeded its target generator with a fixed 0: runs with other global and
    optimizer seeds drew the same target noise at every step. The seed is now the model's (None:
    drawn from Python's random state, which keras.utils.set_random_seed fixes); a hand-written
    loop's fixed seed, which would repeat the targets at every step, is refused."""
    x, y = classification_data(n=16)

    def statistics(global_seed, seed=None):
        keras.utils.set_random_seed(0)
        net = dense_net()                               # the same weights in every run
        keras.utils.set_random_seed(global_seed)
        model = tfnng.BayesianModel(net, seed=seed)
        model.compile(optimizer=tfnng.optimizers.NoisyKFAC(num_examples=16, stats_every=1,
                                                           seed=5),
                      loss=tfnng.losses.CategoricalNLL())
        model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
        assert tfnng.BayesianModel.from_config(model.get_config()).seed == model.seed
        return np.concatenate([b.state["s"].numpy().ravel() for b in model.optimizer._blocks])

    np.testing.assert_array_equal(statistics(1), statistics(1))
    assert not np.allclose(statistics(1), statistics(2))
    np.testing.assert_array_equal(statistics(1, seed=3), statistics(2, seed=3))
    assert not np.allclose(statistics(1, seed=3), statistics(1, seed=4))
    with pytest.raises(ValueError, match="integer"):
        tfnng.BayesianModel(dense_net(), seed=1.5)
    net = dense_net()
    optimizer = tfnng.optimizers.NoisyKFAC(num_examples=16)
    capture = cap.LayerCapture(net)
    optimizer.prepare_curvature(capture.specs)
    optimizer.build(net.trainable_variables)
    with pytest.raises(ValueError, match="same targets at every step"):
        tfnng.models.gradients_and_curvature(net, capture, optimizer,
                                             tfnng.losses.CategoricalNLL(), x, y, seed=7)


@pytest.mark.parametrize("make", [lambda: tfnng.optimizers.NoisyAdam(num_examples=16,
                                                                       fisher="true"),
                                  lambda: tfnng.optimizers.VOGN(num_examples=16),
                                  lambda: tfnng.optimizers.NoisyKFAC(num_examples=16)])
def test_an_optimizer_whose_first_step_failed_trains_after_recompiling(make):
    """The first step builds a curvature optimizer; when that step failed to trace (targets of
    the wrong shape), its state, made while tracing, was never initialised: the next fit failed
    ("must be a scalar, but it has shape [0]"), and so did tfnng.predict."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(16, 3)).astype("float32")
    y = rng.normal(size=(16, 1)).astype("float32")
    model = tfnng.BayesianModel(keras.Sequential([
        keras.Input((3,)), keras.layers.Dense(4, activation="tanh"), keras.layers.Dense(1)]))
    optimizer = make()
    model.compile(optimizer=optimizer, loss=tfnng.losses.GaussianNLL(0.5))
    with pytest.raises(ValueError, match="does not match the predicted mean"):
        model.fit(x, np.zeros((16, 3, 2), "float32"), batch_size=8, verbose=0)
    model.compile(optimizer=optimizer, loss=tfnng.losses.GaussianNLL(0.5))
    history = model.fit(x, y, batch_size=8, epochs=2, verbose=0)
    assert np.all(np.isfinite(history.history["loss"]))
    assert int(optimizer.iterations) == 4
    assert np.all(np.isfinite(tfnng.predict(model, x, num_samples=3).mean))


@pytest.mark.parametrize("make", [lambda: tfnng.optimizers.NoisyAdam(num_examples=8),
                                  lambda: tfnng.optimizers.VOGN(num_examples=8),
                                  lambda: tfnng.optimizers.NoisyKFAC(num_examples=8)])
def test_a_net_without_trainable_weights_is_a_clear_error(make):
    """The curvature steps failed on an empty list ("not enough values to unpack")."""
    net = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    net.trainable = False
    model = tfnng.BayesianModel(net)
    model.compile(optimizer=make(), loss=tfnng.losses.GaussianNLL())
    with pytest.raises(ValueError, match="no trainable weights"):
        model.fit(np.zeros((8, 3)), np.zeros((8, 1)), verbose=0)


def test_bayesian_model_with_a_diagonal_optimizer_and_config_round_trip():
    keras.utils.set_random_seed(7)
    x, y = classification_data(n=32)
    optimizer = tfnng.optimizers.NoisyAdam(learning_rate=0.01, num_examples=32, seed=7)
    model, history = fit(dense_net(), optimizer, x, y, epochs=2)
    np.testing.assert_allclose(history["val_loss"], np.add(history["val_nll"], history["val_kl"]),
                               rtol=1e-5)
    np.testing.assert_allclose(history["val_kl"][-1], float(optimizer.kl_divergence()) / 32, rtol=1e-5)
    clone = tfnng.BayesianModel.from_config(model.get_config())
    assert [l.__class__ for l in clone.net.layers] == [l.__class__ for l in model.net.layers]
    assert clone.input_shape == model.input_shape == (None, 6)


def test_failed_factorisation_keeps_the_previous_inverses():
    net, optimizer = small_trained_optimizer(learning_rate=0.01, inverse_every=1)
    block = optimizer._blocks[0]
    before = block.state["a_inv"].numpy(), block.state["a_root"].numpy()
    failures = optimizer.inverse_failures
    block.state["a"].assign(np.full(block.state["a"].shape, np.nan, np.float32))
    optimizer._update_inverses()
    assert optimizer.inverse_failures == failures + 1
    np.testing.assert_array_equal(block.state["a_inv"].numpy(), before[0])
    np.testing.assert_array_equal(block.state["a_root"].numpy(), before[1])
    optimizer.sample_weights()
    assert all(np.isfinite(v.numpy()).all() for v in net.trainable_variables)


class _ActivationPenalty(keras.layers.Layer):
    """``add_loss`` of a penalty on the activations passing through."""

    def call(self, h):
        self.add_loss(0.5 * tf.reduce_sum(tf.square(h)))
        return h


@pytest.mark.parametrize("penalty", ["activity_regularizer", "add_loss", "kernel_regularizer",
                                     "activity_and_kernel_regularizers"])
def test_empirical_fisher_is_the_likelihoods_without_the_nets_penalties(penalty, float64_keras):
    """Penalties are in the training loss (and its gradient), not in the likelihood whose curvature
    the empirical Fisher estimates: S of the first layer equals the brute-force E[Ds Ds^T] of the
    per-example log-likelihood gradients, with activity regularisers and add_loss terms in the net
    (with two penalties, S used to include the activity regulariser's gradient)."""
    keras.utils.set_random_seed(0)
    regularizer = keras.regularizers.L2(0.5)
    hidden = keras.layers.Dense(
        4, activation="tanh",
        activity_regularizer=regularizer if penalty.startswith("activity") else None,
        kernel_regularizer=regularizer if "kernel" in penalty else None)
    layers = [keras.Input((3,)), hidden] + ([_ActivationPenalty()] if penalty == "add_loss" else [])
    net = keras.Sequential(layers + [keras.layers.Dense(3)])
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(8, 3)), rng.integers(0, 3, size=8)
    kernel, bias, out_kernel, out_bias = [w.numpy().copy() for w in net.weights]
    # The first statistics update takes the batch's factors whole (no isotropic start).
    optimizer = tfnng.optimizers.KFAC(learning_rate=1e-3, fisher="empirical", stats_every=1,
                                      factor_prior_count=0)
    model = tfnng.BayesianModel(net)
    model.compile(optimizer=optimizer, loss=tfnng.losses.CategoricalNLL())
    model.fit(x, y, batch_size=8, epochs=1, verbose=0, shuffle=False)

    block = optimizer._blocks[0]
    assert block.spec.layer is hidden
    s_factor = block.state["s"].numpy()
    ds = []
    for n in range(len(x)):
        s = tf.constant(x[n:n + 1] @ kernel + bias)
        with tf.GradientTape() as tape:
            tape.watch(s)
            log_p = tf.nn.log_softmax(tf.tanh(s) @ out_kernel + out_bias)[0, y[n]]
        ds.append(tape.gradient(log_p, s).numpy()[0])
    ds = np.array(ds)
    np.testing.assert_allclose(s_factor, ds.T @ ds / len(x), rtol=1e-10, atol=1e-14)
    assert net.losses          # the penalty is there, and in the training loss


def test_tempered_posterior_scales_the_covariance_by_the_kl_weight(float64_keras):
    """kl_weight lambda != 1: variance eta before data, then the MVG (lambda/N) [A^g_in]^-1, [S^g_in]^-1."""
    n, eta, lam = 100, 0.3, 0.5
    keras.utils.set_random_seed(1)
    net = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    optimizer = tfnng.optimizers.NoisyKFAC(num_examples=n, prior_variance=eta, kl_weight=lam, seed=0)
    capture = cap.LayerCapture(net)
    optimizer.prepare_curvature(capture.specs)
    optimizer.build(net.trainable_variables)
    layer = net.layers[0]
    np.testing.assert_allclose(optimizer.layer_posterior(layer)["marginal_variance"].numpy(), eta, rtol=1e-9)
    rng = np.random.default_rng(0)
    optimizer._update_factors({capture.specs[0].name: cap.CapturedLayer(
        inputs=tf.constant(rng.normal(size=(6, 3))), zero=None,
        preactivation_grads=tf.constant(rng.normal(size=(6, 2))))})
    optimizer._update_inverses()
    block = optimizer._blocks[0]
    a, s = block.state["a"].numpy(), block.state["s"].numpy()
    g_in = lam / (n * eta)
    pi = np.sqrt((np.trace(a) / 4) / (np.trace(s) / 2))
    sigma_1 = lam / n * np.linalg.inv(a + pi * np.sqrt(g_in) * np.eye(4))
    sigma_2 = np.linalg.inv(s + np.sqrt(g_in) / pi * np.eye(2))
    np.testing.assert_allclose(optimizer.layer_posterior(layer)["sigma_1"].numpy(), sigma_1, rtol=1e-9)
    stddev = np.sqrt(np.outer(np.diag(sigma_1), np.diag(sigma_2)))      # rows: kernel, then bias
    np.testing.assert_allclose(optimizer.posterior_stddev(layer.kernel).numpy(), stddev[:-1], rtol=1e-9)
    np.testing.assert_allclose(optimizer.posterior_stddev(layer.bias).numpy(), stddev[-1], rtol=1e-9)


@pytest.mark.parametrize("make", [
    lambda: (tfnng.optimizers.NoisyKFAC(learning_rate=0.1, num_examples=20, stats_every=1,
                                        inverse_every=1, momentum=0.9, seed=2), 1 / 20, 1 / 20 + 1e-3),
    lambda: (tfnng.optimizers.KFAC(learning_rate=0.1, stats_every=1, inverse_every=1, damping=0.01,
                                   l2=0.5), 0.5, 0.51)], ids=["noisy_momentum", "kfac_l2"])
def test_first_step_with_momentum_and_l2_matches_numpy(make, float64_keras):
    """First mean step -alpha A_g^-1 (G + c W) S_g^-1: bias-corrected momentum; KFAC l2 as decay and damping."""
    optimizer, c, gamma = make()
    gradient, before, after = one_dense_step(optimizer)
    block = optimizer._blocks[0]
    a, s = block.state["a"].numpy(), block.state["s"].numpy()
    pi = np.sqrt((np.trace(a) / 4) / (np.trace(s) / 2))
    a_g, s_g = a + pi * np.sqrt(gamma) * np.eye(4), s + np.sqrt(gamma) / pi * np.eye(2)
    v = gradient + c * before
    np.testing.assert_allclose(after - before, -0.1 * np.linalg.inv(a_g) @ v @ np.linalg.inv(s_g), rtol=1e-9)


def test_config_round_trip_keeps_every_non_default_constructor_argument():
    """from_config(get_config()) gives an optimizer whose attributes equal the non-default arguments."""
    kwargs = dict(num_examples=7, hess_init=0.5, inverse_warmup=False, factor_prior_count=2,
                  stats_every=3, inverse_every=6, kl_weight=0.5, prior_variance=0.3, momentum=0.9)
    clone = tfnng.optimizers.NoisyKFAC.from_config(tfnng.optimizers.NoisyKFAC(**kwargs).get_config())
    assert {k: getattr(clone, k) for k in kwargs} == kwargs
    clone = keras.optimizers.deserialize(keras.optimizers.serialize(tfnng.optimizers.KFAC(
        l2=0.01, damping=0.1, inverse_warmup=False)))
    assert (clone.l2, clone.damping, clone.inverse_warmup) == (0.01, 0.1, False)


def test_diagonal_fallback_step_is_damped_by_gamma_in_plus_gamma_ex(float64_keras):
    """The Alg. 1 fallback step is alpha (g + gamma_in w) / (f + gamma_in + gamma_ex), gamma_ex = 0.5."""
    keras.utils.set_random_seed(4)
    x, y = classification_data(n=16)
    net = keras.Sequential([keras.Input((6,)), keras.layers.Dense(4), keras.layers.BatchNormalization(),
                            keras.layers.Dense(2)])
    capture = cap.LayerCapture(net)
    optimizer = tfnng.optimizers.NoisyKFAC(learning_rate=1e-2, num_examples=100, extrinsic_damping=0.5,
                                           seed=4)
    optimizer.prepare_curvature(capture.specs)
    optimizer.build(net.trainable_variables)
    gamma = net.layers[1].gamma
    w = gamma.numpy()                                        # the first sample is the initial mean
    grads = curvature_step(net, capture, optimizer, tfnng.losses.CategoricalNLL(), tf.constant(x),
                           tf.constant(y))
    g = grads[[v is gamma for v in net.trainable_variables].index(True)].numpy()
    f = (1 - optimizer.stat_decay) * optimizer.hess_init + optimizer.stat_decay * g ** 2
    step = 1e-2 * (g + optimizer.intrinsic_damping * w) / (f + optimizer.intrinsic_damping + 0.5)
    np.testing.assert_allclose(w - optimizer.posterior_mean(gamma).numpy(), step, rtol=1e-9)


def _float64_mlp_and_optimizer(**kwargs):
    keras.utils.set_random_seed(1)
    net = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4, activation="tanh"), keras.layers.Dense(2)])
    capture = cap.LayerCapture(net)
    optimizer = tfnng.optimizers.NoisyKFAC(seed=0, **kwargs)
    optimizer.prepare_curvature(capture.specs)
    optimizer.build(net.trainable_variables)
    return net, capture, optimizer


def test_statistics_and_inverse_schedule_with_warm_up(float64_keras):
    """stats_every=2, inverse_every=10: statistics at even updates, inverses at 0, 2, 4, 6, 8 (warm-up)."""
    net, capture, optimizer = _float64_mlp_and_optimizer(num_examples=50, stats_every=2, inverse_every=10)
    rng, block = np.random.default_rng(0), optimizer._blocks[0]
    due, stats_changed, inverse_changed = [], [], []
    for k in range(10):
        x, y = rng.normal(size=(8, 3)), rng.integers(0, 2, 8)
        due.append(bool(optimizer.curvature_due()))
        a, a_inv = block.state["a"].numpy().copy(), block.state["a_inv"].numpy().copy()
        curvature_step(net, capture, optimizer, tfnng.losses.CategoricalNLL(), x, y)
        stats_changed.append(not np.array_equal(a, block.state["a"].numpy()))
        inverse_changed.append(not np.array_equal(a_inv, block.state["a_inv"].numpy()))
    assert due == stats_changed == [k % 2 == 0 for k in range(10)]
    assert inverse_changed == [k in (0, 2, 4, 6, 8) for k in range(10)]


def test_due_inverse_update_waits_for_the_last_evaluation_of_an_mc_group(float64_keras):
    """mc_samples=2: the sampling cache is unchanged after a group's 1st evaluation, refreshed after
    its 2nd; in the first group after each (its initial cache is the prior's, see
    test_kfac_factors.py::test_the_first_monte_carlo_group_samples_from_the_first_batchs_curvature)."""
    net, capture, optimizer = _float64_mlp_and_optimizer(num_examples=16, stats_every=1, inverse_every=1,
                                                         mc_samples=2)
    rng, block = np.random.default_rng(0), optimizer._blocks[0]
    changed = []
    for _ in range(4):
        root = block.state["a_root"].numpy().copy()
        x, y = rng.normal(size=(8, 3)), rng.integers(0, 2, 8)
        curvature_step(net, capture, optimizer, tfnng.losses.CategoricalNLL(), x, y)
        changed.append(not np.array_equal(root, block.state["a_root"].numpy()))
    assert changed == [True, True, False, True]
