"""Kronecker factors from the capture equal brute-force computations (float64, tight tolerance).

Ground truth is computed without the capture: per-example forward passes written out with
``tf.nn`` ops, per-example gradients of the log-likelihood with respect to the pre-activations taken
by a tape on those explicit tensors, and convolution patches extracted by numpy loops.
"""

import numpy as np
import pytest
import tensorflow as tf
import keras

import tfnng
from tfnng.curvature import capture as cap
from tfnng.curvature import kronecker as kfac_factors


class _Fisher:
    """Stands in for an optimizer in ``gradients_and_curvature`` (factors due on every step)."""

    def __init__(self, fisher):
        self.curvature_requirements = tfnng.curvature.Requirements(kronecker=True, fisher=fisher)

    def curvature_due(self):
        return tf.constant(True)


def _first_target_seed(seed):
    """The stateless seed of the true Fisher's targets at the first draw of a generator seeded
    ``seed`` (as :func:`_captured_factors` passes it)."""
    return tfnng.models._target_seed(keras.random.SeedGenerator(seed))


def _captured_factors(net, loss, x, y, fisher, seed=7):
    capture = cap.LayerCapture(net)
    _, _, grads, captured = tfnng.models.gradients_and_curvature(
        net, capture, _Fisher(fisher), loss, tf.constant(x), tf.constant(y),
        seed=keras.random.SeedGenerator(seed))
    out = {}
    for spec in capture.specs:
        record = captured[spec.name]
        out[spec.layer.name] = [f.numpy() for f in kfac_factors.factors(
            spec, record.inputs, record.preactivation_grads)]
    return out, capture, grads


def _mlp():
    keras.utils.set_random_seed(1)
    inputs = keras.Input((3,), dtype="float64")
    h = keras.layers.Dense(4, activation="tanh", dtype="float64", name="d1")(inputs)
    h = keras.layers.Dense(5, activation="relu", use_bias=False, dtype="float64", name="d2")(h)
    out = keras.layers.Dense(3, dtype="float64", name="d3")(h)
    return keras.Model(inputs, out)


@pytest.mark.parametrize("fisher", ["true", "empirical"])
def test_mlp_factors_equal_brute_force(fisher):
    net = _mlp()
    rng = np.random.default_rng(0)
    x = rng.normal(size=(6, 3))
    y = rng.integers(0, 3, size=6)
    loss = tfnng.losses.CategoricalNLL(dtype="float64")
    factors, _, _ = _captured_factors(net, loss, x, y, fisher)

    d1, d2, d3 = (net.get_layer(n) for n in ("d1", "d2", "d3"))
    if fisher == "true":     # the same targets as the capture drew
        targets = loss.sample(net(x), seed=_first_target_seed(7)).numpy()
    else:
        targets = y
    acts = {n: [] for n in ("d1", "d2", "d3")}
    grads = {n: [] for n in ("d1", "d2", "d3")}
    for n in range(len(x)):
        xn = tf.constant(x[n:n + 1])
        with tf.GradientTape(persistent=True) as tape:
            s1 = tf.matmul(xn, d1.kernel) + d1.bias
            tape.watch(s1)
            h1 = tf.tanh(s1)
            s2 = tf.matmul(h1, d2.kernel)
            tape.watch(s2)
            h2 = tf.nn.relu(s2)
            s3 = tf.matmul(h2, d3.kernel) + d3.bias
            tape.watch(s3)
            log_p = tf.nn.log_softmax(s3)[0, int(targets[n])]
        for name, s in (("d1", s1), ("d2", s2), ("d3", s3)):
            grads[name].append(tape.gradient(log_p, s).numpy()[0])
        acts["d1"].append(np.append(x[n], 1.0))
        acts["d2"].append(h1.numpy()[0])                 # d2 has no bias: no homogeneous 1
        acts["d3"].append(np.append(h2.numpy()[0], 1.0))
    for name in ("d1", "d2", "d3"):
        a = np.array(acts[name])
        g = np.array(grads[name])
        np.testing.assert_allclose(factors[name][0], a.T @ a / len(x), rtol=1e-12, atol=1e-14)
        np.testing.assert_allclose(factors[name][1], g.T @ g / len(x), rtol=1e-12, atol=1e-14)


def test_single_example_factors_are_the_outer_product_of_the_weight_gradient():
    """With one example, S (x) A = vec(DW) vec(DW)^T exactly, DW = [dkernel; dbias] (column-stacking vec)."""
    net = _mlp()
    x = np.array([[0.3, -1.2, 0.8]])
    y = np.array([2])
    loss = tfnng.losses.CategoricalNLL(dtype="float64")
    factors, capture, grads = _captured_factors(net, loss, x, y, "empirical")
    by_var = {id(v): g for v, g in zip(net.trainable_variables, grads)}
    for spec in capture.specs:
        a_factor, s_factor = factors[spec.layer.name]
        dw = by_var[id(spec.kernel)].numpy()
        if spec.has_bias:
            dw = np.vstack([dw, by_var[id(spec.bias)].numpy()[None]])
        v = dw.T.ravel()
        np.testing.assert_allclose(np.kron(s_factor, a_factor), np.outer(v, v), rtol=1e-10,
                                   atol=1e-14)


def _numpy_patches(x, kernel_size, strides, dilation, padding):
    """Patches (B, T, kh*kw*c) in the kernel's (kh, kw, c) order, TF padding semantics."""
    batch, height, width, channels = x.shape
    kh, kw = kernel_size
    eff_h, eff_w = (kh - 1) * dilation[0] + 1, (kw - 1) * dilation[1] + 1
    if padding == "valid":
        out_h = (height - eff_h) // strides[0] + 1
        out_w = (width - eff_w) // strides[1] + 1
        top = left = 0
    else:
        out_h, out_w = -(-height // strides[0]), -(-width // strides[1])
        pad_h = max((out_h - 1) * strides[0] + eff_h - height, 0)
        pad_w = max((out_w - 1) * strides[1] + eff_w - width, 0)
        top, left = pad_h // 2, pad_w // 2
    padded = np.zeros((batch, height + eff_h + top, width + eff_w + left, channels))
    padded[:, top:top + height, left:left + width] = x
    patches = np.zeros((batch, out_h * out_w, kh * kw * channels))
    for i in range(out_h):
        for j in range(out_w):
            rows = i * strides[0] + dilation[0] * np.arange(kh)
            cols = j * strides[1] + dilation[1] * np.arange(kw)
            block = padded[:, rows][:, :, cols]                   # (B, kh, kw, c)
            patches[:, i * out_w + j] = block.reshape(batch, -1)
    return patches


CONV_CASES = [
    dict(filters=3, kernel_size=(3, 3), strides=(1, 1), padding="same", dilation_rate=(1, 1), use_bias=True),
    dict(filters=2, kernel_size=(2, 3), strides=(2, 1), padding="valid", dilation_rate=(1, 1), use_bias=False),
    dict(filters=2, kernel_size=(3, 2), strides=(2, 2), padding="same", dilation_rate=(1, 1), use_bias=True),
    dict(filters=2, kernel_size=(2, 2), strides=(1, 1), padding="valid", dilation_rate=(2, 2), use_bias=True),
]


@pytest.mark.parametrize("case", range(len(CONV_CASES)))
def test_cnn_factors_equal_brute_force_kfc(case):
    """KFC (Grosse & Martens 2016): A = E[sum_t a_t a_t^T], S = E[(1/|T|) sum_t Ds_t Ds_t^T]."""
    config = CONV_CASES[case]
    keras.utils.set_random_seed(2)
    conv = keras.layers.Conv2D(activation="relu", dtype="float64", name="conv", **config)
    dense = keras.layers.Dense(3, dtype="float64", name="out")
    inputs = keras.Input((6, 5, 2), dtype="float64")
    net = keras.Model(inputs, dense(keras.layers.Flatten(dtype="float64")(conv(inputs))))
    rng = np.random.default_rng(case)
    x = rng.normal(size=(4, 6, 5, 2))
    y = rng.normal(size=(4, 3))
    loss = tfnng.losses.GaussianNLL(noise_variance=0.5, dtype="float64")
    factors, _, _ = _captured_factors(net, loss, x, y, "true", seed=3)
    targets = loss.sample(net(x), seed=_first_target_seed(3)).numpy()

    patches = _numpy_patches(x, config["kernel_size"], config["strides"], config["dilation_rate"],
                             config["padding"])
    kernel = conv.kernel.numpy().reshape(-1, config["filters"])
    a_all, g_all = [], []
    for n in range(len(x)):
        with tf.GradientTape() as tape:
            s = tf.nn.convolution(x[n:n + 1], conv.kernel, strides=config["strides"],
                             padding=config["padding"].upper(), dilations=config["dilation_rate"])
            if config["use_bias"]:
                s = s + conv.bias
            tape.watch(s)
            out = tf.matmul(tf.reshape(tf.nn.relu(s), [1, -1]), dense.kernel) + dense.bias
            log_p = tf.reduce_sum(-0.5 * (targets[n] - out) ** 2 / 0.5)
        ds = tape.gradient(log_p, s).numpy().reshape(-1, config["filters"])     # (T, q)
        # the numpy patches reproduce the convolution (checks patch/kernel ordering)
        bias = conv.bias.numpy() if config["use_bias"] else 0.0
        np.testing.assert_allclose(patches[n] @ kernel + bias, s.numpy().reshape(-1, config["filters"]),
                                   rtol=1e-10, atol=1e-12)
        a = patches[n]
        if config["use_bias"]:
            a = np.hstack([a, np.ones((len(a), 1))])
        a_all.append(a)
        g_all.append(ds)
    a_all, g_all = np.array(a_all), np.array(g_all)
    batch, positions = g_all.shape[:2]
    a_bf = np.einsum("ntp,ntr->pr", a_all, a_all) / batch
    s_bf = np.einsum("ntp,ntr->pr", g_all, g_all) / (batch * positions)
    np.testing.assert_allclose(factors["conv"][0], a_bf, rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(factors["conv"][1], s_bf, rtol=1e-12, atol=1e-14)


def test_channels_first_conv_rows_equal_the_channels_last_rows_of_the_transposed_tensors():
    """A channels-first Conv2D (NCHW; TensorFlow runs it on GPUs only, so no forward pass here) gives
    the rows, hence the factors and per-example gradients, of the same layer on NHWC tensors."""
    rng = np.random.default_rng(5)
    specs = []
    for data_format, shape in (("channels_first", (None, 2, 6, 5)), ("channels_last", (None, 6, 5, 2))):
        layer = keras.layers.Conv2D(3, (3, 2), strides=(2, 1), padding="same", dtype="float64",
                                    data_format=data_format)
        layer.build(shape)
        specs.append(cap.LayerSpec(layer, cap.CONV2D, layer.kernel, layer.bias, data_format))
    x_nhwc, g_nhwc = rng.normal(size=(4, 6, 5, 2)), rng.normal(size=(4, 3, 5, 3))
    x_nchw, g_nchw = x_nhwc.transpose(0, 3, 1, 2), g_nhwc.transpose(0, 3, 1, 2)
    first, last = specs
    np.testing.assert_array_equal(kfac_factors.activation_rows(first, x_nchw),
                                  kfac_factors.activation_rows(last, x_nhwc))
    np.testing.assert_array_equal(kfac_factors.gradient_rows(first, g_nchw),
                                  kfac_factors.gradient_rows(last, g_nhwc))
    assert kfac_factors.gradient_rows(last, g_nhwc).shape == (4, 15, 3)


def test_dense_on_sequences_treats_extra_axes_as_positions():
    """Dense on (B, T, c) shares weights across T like a 1x1 convolution: the KFC formulas."""
    keras.utils.set_random_seed(3)
    inputs = keras.Input((4, 3), dtype="float64")
    dense = keras.layers.Dense(2, activation="tanh", dtype="float64", name="seq")
    out = keras.layers.Dense(2, dtype="float64", name="head")(keras.layers.Flatten(dtype="float64")(dense(inputs)))
    net = keras.Model(inputs, out)
    rng = np.random.default_rng(5)
    x = rng.normal(size=(5, 4, 3))
    y = rng.integers(0, 2, size=5)
    loss = tfnng.losses.CategoricalNLL(dtype="float64")
    factors, _, _ = _captured_factors(net, loss, x, y, "empirical")
    head = net.get_layer("head")
    a_all, g_all = [], []
    for n in range(len(x)):
        with tf.GradientTape() as tape:
            s = tf.matmul(x[n], dense.kernel) + dense.bias                   # (T, q)
            tape.watch(s)
            logits = tf.matmul(tf.reshape(tf.tanh(s), [1, -1]), head.kernel) + head.bias
            log_p = tf.nn.log_softmax(logits)[0, int(y[n])]
        g_all.append(tape.gradient(log_p, s).numpy())
        a_all.append(np.hstack([x[n], np.ones((4, 1))]))
    a_all, g_all = np.array(a_all), np.array(g_all)
    np.testing.assert_allclose(factors["seq"][0], np.einsum("ntp,ntr->pr", a_all, a_all) / 5,
                               rtol=1e-12)
    np.testing.assert_allclose(factors["seq"][1], np.einsum("ntp,ntr->pr", g_all, g_all) / 20,
                               rtol=1e-10, atol=1e-15)


def _built_kfac(net, **kwargs):
    capture = cap.LayerCapture(net)
    if kwargs.get("block_tridiagonal"):
        capture.find_links(tf.zeros((1,) + tuple(net.input_shape[1:]), net.inputs[0].dtype))
    optimizer = tfnng.optimizers.NoisyKFAC(num_examples=100, seed=0, **kwargs)
    optimizer.prepare_curvature(capture.specs)
    optimizer.build(net.trainable_variables)
    return optimizer, capture


@pytest.mark.parametrize("count, stat_decay", [(0, 0.3), (1, 0.3), (4, 0.01)])
def test_factor_averages_start_at_an_isotropic_prior_worth_factor_prior_count_batches(count,
                                                                                      stat_decay):
    """Step 1 of the noisy K-FAC module docstring: the averages start, at the first statistics
    update, at ``(tr F_1 / d) I`` counted as c batches; the n-th update has rate
    max(beta~, 1/(n + c)). Checked against that recursion in numpy for four random batches of two
    examples (fewer than the factors' dimensions 4-6: one batch's factors are singular)."""
    net = _mlp()
    optimizer, capture = _built_kfac(net, stat_decay=stat_decay, factor_prior_count=count)
    rng = np.random.default_rng(3)
    expected = {}
    for n in range(1, 5):
        captured = {}
        for spec in capture.specs:
            fan_in = spec.kernel.shape[0]
            captured[spec.name] = cap.CapturedLayer(
                inputs=tf.constant(rng.normal(size=(2, fan_in))), zero=None,
                preactivation_grads=tf.constant(rng.normal(size=(2, spec.kernel.shape[1]))))
        optimizer._update_factors(captured)
        if n == 1:     # positive definite with the prior, of rank 2 without
            smallest = min(np.linalg.eigvalsh(b.state[k].numpy())[0]
                           for b in optimizer._blocks for k in ("a", "s"))
            assert (smallest > 1e-3) if count else (abs(smallest) < 1e-12)
        rate = max(stat_decay, 1.0 / (n + count))
        for spec in capture.specs:
            record = captured[spec.name]
            batch = [f.numpy() for f in kfac_factors.factors(spec, record.inputs,
                                                              record.preactivation_grads)]
            if n == 1:
                expected[spec.name] = [np.trace(f) / len(f) * np.eye(len(f)) for f in batch]
            expected[spec.name] = [(1 - rate) * old + rate * new
                                   for old, new in zip(expected[spec.name], batch)]
    for block in optimizer._blocks:
        a, s = expected[block.spec.name]
        np.testing.assert_allclose(block.state["a"].numpy(), a, rtol=1e-12, atol=1e-14)
        np.testing.assert_allclose(block.state["s"].numpy(), s, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("block_tridiagonal", [False, True])
def test_initial_cache_is_the_one_of_the_initial_factors(block_tridiagonal):
    """Until the first inverse update the optimizer samples and preconditions with its initial cache
    (and reports its KL): it must be what an inverse update computes from the initial (zero)
    factors — the prior, around the model's initial weights."""
    net = _mlp()
    optimizer, _ = _built_kfac(net, prior_variance=0.3, block_tridiagonal=block_tridiagonal)
    assert bool(optimizer._chains) == block_tridiagonal
    cached = [(name, v, v.numpy()) for block in optimizer._blocks
              for name, v in _cache_variables(block)]
    assert cached
    kl_before = optimizer.kl_divergence().numpy()
    optimizer._update_inverses()
    for name, variable, before in cached:
        np.testing.assert_allclose(before, variable.numpy(), rtol=1e-6, atol=1e-12, err_msg=name)
    np.testing.assert_allclose(kl_before, optimizer.kl_divergence().numpy(), rtol=1e-9)


@pytest.mark.parametrize("block_tridiagonal", [False, True])
def test_the_first_monte_carlo_group_samples_from_the_first_batchs_curvature(block_tridiagonal):
    """With mc_samples=2 the inverses waited for the end of the group, so its second evaluation
    was drawn from the initial cache, the prior (posterior stddev sqrt(eta) = 1, a loss 20x
    higher). After one evaluation the cache is the one mc_samples=1 has after its first step: the
    same evaluation at the initial weights gives the same factors."""
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(16, 3)), rng.integers(0, 3, size=16)
    stddevs = {}
    for mc_samples in (1, 2):
        net = _mlp()
        model = tfnng.BayesianModel(net)
        model.compile(optimizer=tfnng.optimizers.NoisyKFAC(
            1e-2, num_examples=6000, fisher="empirical", mc_samples=mc_samples,
            block_tridiagonal=block_tridiagonal, seed=3),
            loss=tfnng.losses.CategoricalNLL(dtype="float64"), jit_compile=False)
        model.fit(x, y, batch_size=16, epochs=1, verbose=0)           # one evaluation
        stddevs[mc_samples] = [model.optimizer.posterior_stddev(v).numpy()
                               for v in net.trainable_variables]
    for one, two in zip(stddevs[1], stddevs[2]):
        np.testing.assert_allclose(two, one, rtol=1e-10)
        assert one.max() < 0.2                                         # not the prior's 1


def _cache_variables(block):
    for key in ("a_inv", "s_inv", "a_root", "s_root", "kl_offset"):
        if key in block.state:
            yield key, block.state[key]
    for kind in ("step", "sample"):
        for key, variable in block.state.get(kind, {}).items():
            yield f"{kind}/{key}", variable


@pytest.mark.parametrize("fisher", ["true", "empirical"])
def test_an_output_mask_weighs_the_examples_as_the_loss_does(fisher):
    """A masked example has weight 0 in the loss and the others B / valid (Keras's apply_mask). The
    true Fisher used to count the masked example in full, the empirical one to scale the kept
    examples' gradients by B / valid instead of its square root."""
    keras.utils.set_random_seed(0)
    x = np.random.default_rng(0).normal(size=(4, 3)).astype("float32")
    x[1] = 0.0                                             # masked by Masking(0.0)
    y = np.array([0, 1, 1, 0])
    net = keras.Sequential([keras.Input((3,)), keras.layers.Masking(0.0), keras.layers.Dense(2)])
    capture = cap.LayerCapture(net)
    loss, y_pred, _, captured = tfnng.models.gradients_and_curvature(
        net, capture, _Fisher(fisher), tfnng.losses.CategoricalNLL(), tf.constant(x), tf.constant(y),
        seed=keras.random.SeedGenerator(1))
    grads = captured[capture.specs[0].name].preactivation_grads.numpy()
    probs = tf.nn.softmax(y_pred).numpy()
    np.testing.assert_array_equal(grads[1], 0.0)
    kept = [0, 2, 3]
    unweighted = grads[kept] / np.sqrt(4 / 3) + probs[kept]   # the one-hot (sampled) targets
    if fisher == "empirical":
        np.testing.assert_allclose(unweighted, np.eye(2)[y[kept]], atol=1e-6)
    else:
        np.testing.assert_allclose(np.sort(unweighted, axis=1), [[0.0, 1.0]] * 3, atol=1e-6)
    np.testing.assert_allclose(float(loss), -np.mean(np.log(probs[kept, y[kept]])), rtol=1e-6)


def test_a_per_position_output_mask_is_refused():
    net = keras.Sequential([keras.Input((3,), dtype="int32"),
                            keras.layers.Embedding(5, 4, mask_zero=True), keras.layers.Dense(2)])
    x, y = tf.constant([[1, 2, 0], [3, 0, 0]]), tf.constant([[0, 1, 0], [1, 0, 0]])
    with pytest.raises(ValueError, match=r"mask of shape \(2, 3\) \(per position\)"):
        tfnng.models.gradients_and_curvature(
            net, cap.LayerCapture(net), _Fisher("empirical"),
            keras.losses.SparseCategoricalCrossentropy(from_logits=True), x, y)


class _FoldsTimeIntoTheBatch(keras.Model):
    """A Dense applied to every time step by folding the time axis into the batch."""

    def __init__(self):
        super().__init__(name="folding")
        self.step = keras.layers.Dense(4, activation="tanh")
        self.head = keras.layers.Dense(2)

    def call(self, x):
        h = self.step(tf.reshape(x, [-1, 2]))
        return self.head(tf.reshape(h, [-1, 3 * 4]))


@pytest.mark.parametrize("fisher", ["empirical", "true"])
@pytest.mark.parametrize("static_batch", [True, False])
def test_a_layer_without_the_batch_on_its_first_axis_is_refused(fisher, static_batch):
    """Folding time into the batch gave the step layer one "example" per time step and scaled
    every layer's empirical-Fisher gradients by T (the head's squared gradients 9x too large);
    both Fisher types now refuse it, at tracing when the batch size is static, else at run time."""
    net = _FoldsTimeIntoTheBatch()
    x = np.random.default_rng(0).normal(size=(4, 3, 2)).astype("float32")
    y = np.array([0, 1, 1, 0])
    net(x)
    capture = cap.LayerCapture(net)

    seed = keras.random.SeedGenerator(1)

    def statistics(x, y):
        records = tfnng.models.gradients_and_curvature(
            net, capture, _Fisher(fisher), tfnng.losses.CategoricalNLL(), x, y, seed=seed)[3]
        return records[capture.specs[0].name].preactivation_grads

    if static_batch:
        with pytest.raises(ValueError, match="batch on the first axis.*Rows: 12, batch: 4"):
            statistics(tf.constant(x), tf.constant(y))
    else:
        traced = tf.function(statistics, input_signature=[
            tf.TensorSpec((None, 3, 2), tf.float32), tf.TensorSpec((None,), tf.int64)])
        with pytest.raises(tf.errors.InvalidArgumentError, match="batch on the first axis"):
            traced(tf.constant(x), tf.constant(y))


class ConfidencePenalty(tfnng.BayesianModel):
    """Keras's documented way to add a loss term: an overridden ``compute_loss``."""

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        loss = super().compute_loss(x, y, y_pred, sample_weight, training)
        p = tf.nn.softmax(y_pred)
        return loss + 0.5 * tf.reduce_mean(tf.reduce_sum(p * tf.math.log(p), -1))


class TripledOutput(tfnng.BayesianModel):
    """A wrapper whose own ``call`` changes the net's output."""

    def call(self, inputs, training=None):
        return 3.0 * self.net(inputs, training=training)


@pytest.mark.parametrize("model_class", [tfnng.BayesianModel, ConfidencePenalty, TripledOutput])
def test_empirical_s_of_a_wrapper_subclass_is_its_likelihoods(model_class, float64_keras):
    """K-FAC's first S against the brute-force S of each example's log-likelihood gradient at the
    pre-activations. An overridden compute_loss's own term entered S (6.9% off); an overridden call
    was bypassed: the curvature (and the gradients) were the bare net's."""
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(8, 3)), rng.integers(0, 3, size=8)
    net = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4, activation="tanh"),
                            keras.layers.Dense(3)])
    kernel, bias, out_kernel, out_bias = [w.numpy().copy() for w in net.weights]
    scale = 3.0 if model_class is TripledOutput else 1.0
    optimizer = tfnng.optimizers.KFAC(learning_rate=1e-3, fisher="empirical", stats_every=1,
                                      factor_prior_count=0)
    model = model_class(net)
    model.compile(optimizer=optimizer, loss=tfnng.losses.CategoricalNLL())
    model.fit(x, y, batch_size=8, epochs=1, verbose=0, shuffle=False)
    per_example = []
    for n in range(len(x)):
        pre_activation = tf.constant(x[n:n + 1] @ kernel + bias)
        with tf.GradientTape() as tape:
            tape.watch(pre_activation)
            logits = scale * (tf.tanh(pre_activation) @ out_kernel + out_bias)
            log_p = tf.nn.log_softmax(logits)[0, y[n]]
        per_example.append(tape.gradient(log_p, pre_activation).numpy()[0])
    per_example = np.array(per_example)
    np.testing.assert_allclose(optimizer._blocks[0].state["s"].numpy(),
                               per_example.T @ per_example / len(x), rtol=1e-9, atol=1e-12)


class QueriesTable(keras.Model):
    """A Dense applied to a learned table of 8 query vectors (no batch axis), mixed with the batch."""

    def __init__(self):
        super().__init__(name="queries")
        self.table = self.add_weight(shape=(8, 5), initializer="random_normal", name="table")
        self.keys = keras.layers.Dense(3, name="keys")
        self.queries = keras.layers.Dense(3, name="table_queries")
        self.head = keras.layers.Dense(1, name="head")

    def call(self, x):
        scores = keras.ops.matmul(self.keys(x), keras.ops.transpose(self.queries(self.table)))
        return self.head(scores)


def test_a_layer_on_a_table_with_as_many_rows_as_the_batch_is_refused():
    """A Dense on an 8-row table passed the row-count check with batches of 8: K-FAC and VOGN took
    the table's rows for the examples (and the true Fisher crashed with a TypeError). Traced with an
    unknown batch size, its input's row count is known: refused when the model is compiled, and in
    a hand-written step traced with an unknown batch size."""
    x = np.random.default_rng(0).normal(size=(16, 5)).astype("float32")
    y = np.zeros((16, 1), "float32")
    for make in [lambda: tfnng.optimizers.KFAC(learning_rate=1e-2, fisher="empirical"),
                 lambda: tfnng.optimizers.VOGN(learning_rate=1e-2, num_examples=16)]:
        net = QueriesTable()
        net(x[:1])
        model = tfnng.BayesianModel(net)
        with pytest.raises(ValueError, match="table_queries.*8 rows whatever the batch size"):
            model.compile(optimizer=make(), loss=tfnng.losses.GaussianNLL())
            model.fit(x, y, batch_size=8, epochs=1, verbose=0)

    capture = cap.LayerCapture(net)

    @tf.function(input_signature=[tf.TensorSpec((None, 5)), tf.TensorSpec((None, 1))])
    def statistics(x, y):
        return tfnng.models.gradients_and_curvature(
            net, capture, _Fisher("empirical"), tfnng.losses.GaussianNLL(), x, y)[0]

    with pytest.raises(ValueError, match="8 rows whatever the batch size"):
        statistics(x[:8], y[:8])


@pytest.mark.parametrize("case", ["dense", "dense_sequence", "dense_no_bias"]
                         + [f"conv{i}" for i in range(len(CONV_CASES))])
@pytest.mark.parametrize("values", ["random", "ones"])
def test_example_gradient_norm_bounds_hold_and_are_tight_for_aligned_inputs(case, values):
    """The non-finite guard's bound ``b_n >= ||DW_n||_F`` (kronecker.example_gradient_norm_bounds)
    against each example's weight gradient formed from its patches. With constant inputs and
    pre-activation gradients a stride-1 convolution's patches all align, and the bound (with its
    ``kh kw`` factor for values shared by overlapping patches) is reached up to the padded border."""
    if case.startswith("conv"):
        config = CONV_CASES[int(case[4:])]
        layer = keras.layers.Conv2D(dtype="float64", **config)
        input_shape = (6, 5, 2)
    else:
        layer = keras.layers.Dense(3, use_bias=case != "dense_no_bias", dtype="float64")
        input_shape = (4, 2) if case == "dense_sequence" else (5,)
    output = layer(keras.Input(input_shape, dtype="float64"))
    [spec] = cap.LayerCapture(keras.Model(layer.input, output)).specs
    rng = np.random.default_rng(0)
    shape_x, shape_g = (3,) + input_shape, (3,) + tuple(output.shape[1:])
    x = np.ones(shape_x) if values == "ones" else rng.normal(size=shape_x)
    ds = np.ones(shape_g) if values == "ones" else rng.normal(size=shape_g)

    per_example = tfnng.curvature.per_example.gradients_from_rows(
        kfac_factors.activation_rows(spec, x), kfac_factors.gradient_rows(spec, ds)).numpy()
    norms = np.sqrt(np.sum(per_example ** 2, axis=(1, 2)))
    bounds = kfac_factors.example_gradient_norm_bounds(spec, x, ds).numpy()
    assert np.all(norms <= bounds * (1 + 1e-12))
    if values == "ones" and case in ("dense", "dense_sequence", "dense_no_bias", "conv0"):
        np.testing.assert_allclose(norms, bounds, rtol=0.3 if case == "conv0" else 1e-12)


def test_cross_factors_are_the_batch_means_of_the_outer_products():
    """Block-tridiagonal cross factors (A_12, S_12) = (a_1^T a_2 / B, Ds_1^T Ds_2 / B) against numpy."""
    keras.utils.set_random_seed(1)
    inputs = keras.Input((3,), dtype="float64")
    hidden = keras.layers.Dense(4, activation="tanh", dtype="float64")(inputs)
    net = keras.Model(inputs, keras.layers.Dense(2, dtype="float64")(hidden))
    spec_1, spec_2 = cap.LayerCapture(net).specs
    rng = np.random.default_rng(0)
    x1, g1, x2, g2 = (rng.normal(size=(6, d)) for d in (3, 4, 4, 2))
    a12, s12 = (t.numpy() for t in kfac_factors.cross_factors(
        spec_1, tf.constant(x1), tf.constant(g1), spec_2, tf.constant(x2), tf.constant(g2)))
    a1, a2 = np.hstack([x1, np.ones((6, 1))]), np.hstack([x2, np.ones((6, 1))])
    np.testing.assert_allclose(a12, a1.T @ a2 / 6, rtol=1e-12)
    np.testing.assert_allclose(s12, g1.T @ g2 / 6, rtol=1e-12)
