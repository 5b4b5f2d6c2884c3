"""NNG-BlkTri on a 3-layer toy net (float64): the optimizer's implied precision against the dense
block-tridiagonal matrix built from its own factors, and its samples' covariance."""

import warnings

import numpy as np
import pytest
import tensorflow as tf
import keras

import tfnng
from tfnng.posteriors import kronecker as kr


def vec(w):
    return np.asarray(w).T.ravel()


def test_blocktri_optimizer_matches_dense_construction_and_samples():
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(40, 3))
    y = np.sin(x[:, :1]) + 0.1 * rng.normal(size=(40, 1))
    net = keras.Sequential([keras.Input((3,), dtype="float64"),
                            keras.layers.Dense(3, activation="tanh", dtype="float64"),
                            keras.layers.Dense(2, activation="tanh", dtype="float64"),
                            keras.layers.Dense(1, dtype="float64")])
    model = tfnng.BayesianModel(net)
    n_data, eta = 40, 0.5
    optimizer = tfnng.optimizers.NoisyKFAC(learning_rate=0.05, num_examples=n_data, prior_variance=eta,
                                           block_tridiagonal=True, stats_every=1, inverse_every=1,
                                           stat_decay=0.1, seed=0)
    model.compile(optimizer=optimizer, loss=tfnng.losses.GaussianNLL(0.1, dtype="float64"))
    model.fit(x, y, batch_size=20, epochs=5, verbose=0)
    chain = optimizer._chains[0]
    assert len(chain) == 3
    optimizer._update_inverses()          # caches from the current factors
    gamma_in = 1.0 / (n_data * eta)
    shapes = [(b.p, b.q) for b in chain]
    sizes = [p * q for p, q in shapes]
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    total = offsets[-1]

    target = np.zeros((total, total))
    for l, block in enumerate(chain):
        a_g, s_g = (m.numpy() for m in kr.damped_factors(block.state["a"], block.state["s"], gamma_in))
        target[offsets[l]:offsets[l + 1], offsets[l]:offsets[l + 1]] = np.kron(s_g, a_g)
        if l < 2:
            off = np.kron(block.state["s_off"].numpy(), block.state["a_off"].numpy())
            target[offsets[l]:offsets[l + 1], offsets[l + 1]:offsets[l + 2]] = off
            target[offsets[l + 1]:offsets[l + 2], offsets[l]:offsets[l + 1]] = off.T

    cache = optimizer._chain_cache(chain, "sample")

    def split(v):
        return [tf.constant(v[offsets[l]:offsets[l + 1]].reshape(q, p).T)
                for l, (p, q) in enumerate(shapes)]

    inverse = np.stack([np.concatenate([vec(w.numpy()) for w in kr.blktri_precondition(cache, split(e))])
                        for e in np.eye(total)], axis=1)
    precision = np.linalg.inv(inverse)
    for l in range(3):
        for m in range(3):
            block = (slice(offsets[l], offsets[l + 1]), slice(offsets[m], offsets[m + 1]))
            if abs(l - m) <= 1:
                np.testing.assert_allclose(precision[block], target[block], rtol=1e-7, atol=1e-9)
            else:
                np.testing.assert_allclose(inverse[block], 0.0, atol=1e-10)
    covariance = inverse / n_data                     # (lambda / N) F_hat^-1
    for block, variances, (p, q), l in zip(chain, kr.blktri_marginal_variances(cache, 1 / np.sqrt(n_data)),
                                           shapes, range(3)):
        np.testing.assert_allclose(vec(variances.numpy()),
                                   np.diag(covariance)[offsets[l]:offsets[l + 1]], rtol=1e-9)

    layers = net.layers

    @tf.function
    def draw():
        optimizer.sample_weights()
        return tf.concat([tf.reshape(tf.transpose(tf.concat([l.kernel, l.bias[None]], 0)), [-1])
                          for l in layers], 0)

    draws = np.array([draw().numpy() for _ in range(3000)])
    means = np.concatenate([vec(optimizer._mean_matrix(b).numpy()) for b in chain])
    emp = np.cov(draws, rowvar=False)
    tol = 5 * np.sqrt((np.outer(np.diag(covariance), np.diag(covariance)) + covariance ** 2) / len(draws))
    assert (np.abs(emp - covariance) < tol).all()
    assert (np.abs(draws.mean(0) - means) < 5 * np.sqrt(np.diag(covariance) / len(draws))).all()
    # the closed-form KL agrees with the dense Gaussian formula
    dense_kl = 0.5 * (np.trace(covariance) / eta + means @ means / eta - total + total * np.log(eta)
                      - np.linalg.slogdet(covariance)[1])
    np.testing.assert_allclose(float(optimizer.kl_divergence()), dense_kl, rtol=1e-8)


class SubclassedStack(keras.Model):
    def __init__(self):
        super().__init__()
        self.stack = [keras.layers.Dense(k, activation="tanh") for k in (4, 3)] + [keras.layers.Dense(1)]

    def call(self, x):
        for layer in self.stack:
            x = layer(x)
        return x


def test_subclassed_dense_stack_is_chained_from_its_build_shapes():
    """A subclassed model's layers have no graph node: the chain uses the shapes they were built with."""
    net = SubclassedStack()
    net(np.zeros((1, 3), "float32"))
    optimizer = tfnng.optimizers.NoisyKFAC(num_examples=10, block_tridiagonal=True)
    model = tfnng.BayesianModel(net)
    model.compile(optimizer=optimizer, loss=tfnng.losses.GaussianNLL(0.1))
    model.fit(np.ones((10, 3), "float32"), np.ones((10, 1), "float32"), batch_size=5, verbose=0)
    assert [len(chain) for chain in optimizer._chains] == [3]


def _dense(name, units, activation="tanh"):
    return keras.layers.Dense(units, activation=activation, name=name)


class PermutedStack(keras.Model):
    """Layers created in the order d0, d2, d1, d3 and called in the order d0, d1, d2, d3."""

    def __init__(self):
        super().__init__()
        self.by_name = {name: _dense(name, units) for name, units in
                        (("d0", 4), ("d2", 4), ("d1", 5), ("d3", 1))}

    def call(self, x):
        for name in ("d0", "d1", "d2", "d3"):
            x = self.by_name[name](x)
        return x


def _nested():
    """d0, then a nested Sequential d1-d2 (Keras flattens nested layers in reverse), then d3."""
    inputs = keras.Input((3,))
    inner = keras.Sequential([keras.Input((4,)), _dense("d1", 5), _dense("d2", 4)])
    return keras.Model(inputs, _dense("d3", 1)(inner(_dense("d0", 4)(inputs))))


def _branches():
    """d0 feeds two parallel layers a and b, concatenated into d3: no layer follows d0 alone."""
    inputs = keras.Input((3,))
    h = _dense("d0", 4)(inputs)
    merged = keras.layers.Concatenate()([_dense("a", 2)(h), _dense("b", 2)(h)])
    return keras.Model(inputs, _dense("d3", 1)(_dense("d4", 2)(merged)))


def _residual():
    """d2 reads d1's output plus d0's (a skip connection around d1): a merge, no chain through d1;
    d2 -> d3 remains (d3 reads d2 alone)."""
    inputs = keras.Input((3,))
    h = _dense("d0", 4)(inputs)
    merged = keras.layers.Add()([h, _dense("d1", 4)(h)])
    return keras.Model(inputs, _dense("d3", 1)(_dense("d2", 2)(merged)))


def _skip_from_the_input():
    """d1 reads the net's input plus d0's output (a skip connection around d0): d1's input does
    not come from d0 alone, so only d1 -> d2 is chained (d0-d1-d2 before: the net's input was no
    source of its own)."""
    inputs = keras.Input((3,))
    merged = keras.layers.Add()([inputs, _dense("d0", 3)(inputs)])
    return keras.Model(inputs, _dense("d2", 1)(_dense("d1", 2)(merged)))


def _skip_to_the_output():
    """The net's output is h + d1(h), h = d0(...): d0's output reaches the output around d1, so
    d0 and d1 are not chained (they were, where a Dense after the merge kept them apart)."""
    inputs = keras.Input((3,))
    h = _dense("d0", 1)(_dense("pre", 4)(inputs))
    return keras.Model(inputs, keras.layers.Add()([h, _dense("d1", 1)(h)]))


def _mixed_dtypes():
    """d0-d1 in float32, d2-d3 in float64: the dtype change used to fail the first step (a float32
    by float64 MatMul of the cross factors)."""
    return keras.Sequential([keras.Input((3,)), _dense("d0", 4), _dense("d1", 5),
                             keras.layers.Dense(4, activation="tanh", name="d2", dtype="float64"),
                             keras.layers.Dense(1, name="d3", dtype="float64")])


class TrainingOnlyHead(keras.Model):
    """An auxiliary head called in training only (a penalty by add_loss): the inference pass that
    finds the links does not call it, which used to raise "were not called"; it gets no links."""

    def __init__(self):
        super().__init__()
        self.d0, self.d1, self.aux = _dense("d0", 4), _dense("d1", 1), _dense("aux", 1)
        self.aux.build((None, 4))

    def call(self, x, training=None):
        hidden = self.d0(x)
        if training:
            self.add_loss(0.01 * keras.ops.mean(keras.ops.square(self.aux(hidden))))
        return self.d1(hidden)


@pytest.mark.parametrize("make_net, chains", [
    (PermutedStack, [["d0", "d1", "d2", "d3"]]),
    (TrainingOnlyHead, [["d0", "d1"]]),
    (_nested, [["d0", "d1", "d2", "d3"]]),
    (_branches, [["d4", "d3"]]),
    (_residual, [["d2", "d3"]]),
    (_skip_from_the_input, [["d1", "d2"]]),
    (_skip_to_the_output, [["pre", "d0"]]),
    (_mixed_dtypes, [["d0", "d1"], ["d2", "d3"]]),
])
def test_chains_follow_the_data_flow_not_the_order_of_creation(make_net, chains):
    """Chains link a layer to the one its output feeds, whatever the order in which the layers were
    created or nested; parallel layers are not chained (the order of creation gave d0-d2-d1-d3
    for the first two, d0-a-b-d4-d3 for the branches), nor are layers around a skip connection
    (it was chained d0-d1-d2-d3, the skip ignored)."""
    keras.utils.set_random_seed(0)
    net = make_net()
    x = np.random.default_rng(0).normal(size=(16, 3)).astype("float32")
    y = np.sin(x[:, :1])
    net(x[:1])
    optimizer = tfnng.optimizers.KFAC(learning_rate=0.1, damping=1e-2, stats_every=1, inverse_every=1,
                                      block_tridiagonal=True)
    model = tfnng.BayesianModel(net)
    model.compile(optimizer=optimizer, loss=tfnng.losses.GaussianNLL(0.1))
    model.fit(x, y, batch_size=16, epochs=1, verbose=0, shuffle=False)
    assert [[block.spec.layer.name for block in chain] for chain in optimizer._chains] == chains


def test_a_net_of_unknown_image_size_is_chained_at_compile_and_restored(tmp_path):
    """Input of unknown height and width: the links are traced from the input specs at compile
    (a zero example with None as 1 failed on the 3x3 convolution), so the optimizer can be built
    before any batch, as keras.models.load_model and the save_weights recipe do."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((None, None, 1))
    h = keras.layers.GlobalAveragePooling2D()(keras.layers.Conv2D(2, 3)(inputs))
    net = keras.Model(inputs, _dense("d2", 1, None)(_dense("d1", 3)(_dense("d0", 4)(h))))
    optimizer = tfnng.optimizers.KFAC(learning_rate=0.1, damping=1e-2, block_tridiagonal=True)
    model = tfnng.BayesianModel(net)
    model.compile(optimizer=optimizer, loss=tfnng.losses.GaussianNLL(0.1))
    assert all(spec.inputs_from is not None for spec in model._layer_capture.specs)
    rng = np.random.default_rng(0)
    model.fit(rng.normal(size=(8, 6, 6, 1)), rng.normal(size=(8, 1)), batch_size=8, verbose=0)
    chains = [[block.spec.layer.name for block in chain] for chain in optimizer._chains]
    assert chains == [["d0", "d1", "d2"]]
    model.save(tmp_path / "model.keras")
    loaded = keras.models.load_model(tmp_path / "model.keras")
    assert [[b.spec.layer.name for b in chain] for chain in loaded.optimizer._chains] == chains
    for saved, restored in zip(optimizer.variables, loaded.optimizer.variables):
        np.testing.assert_array_equal(saved.numpy(), restored.numpy())


class DictInputs(keras.Model):
    """Built from a dict of inputs: its build config gives no input shape to trace."""

    def __init__(self):
        super().__init__()
        self.d0, self.d1 = _dense("d0", 4), _dense("d1", 1, None)

    def call(self, inputs):
        return self.d1(self.d0(tf.concat([inputs["a"], inputs["b"]], axis=-1)))


def test_a_net_without_input_specs_is_chained_from_its_first_batch():
    keras.utils.set_random_seed(0)
    optimizer = tfnng.optimizers.KFAC(learning_rate=0.1, damping=1e-2, block_tridiagonal=True)
    model = tfnng.BayesianModel(DictInputs())
    model.compile(optimizer=optimizer, loss=tfnng.losses.GaussianNLL(0.1))
    rng = np.random.default_rng(0)
    x = {"a": rng.normal(size=(8, 2)).astype("float32"), "b": rng.normal(size=(8, 1)).astype("float32")}
    model.fit(x, rng.normal(size=(8, 1)), batch_size=8, verbose=0)
    assert [[block.spec.layer.name for block in chain] for chain in optimizer._chains] == [
        ["d0", "d1"]]


def test_a_functional_net_with_dict_inputs_is_chained_at_compile_without_warnings():
    """The input specs traced at compile were a list: Keras warned that their structure does not
    match the net's dict of inputs, and only the order of the inputs kept the links right."""
    inputs = {"a": keras.Input((2,), name="a"), "b": keras.Input((1,), name="b")}
    hidden = keras.layers.Concatenate()([_dense("d0", 3)(inputs["a"]), inputs["b"]])
    net = keras.Model(inputs, _dense("d2", 1)(_dense("d1", 4)(hidden)))
    optimizer = tfnng.optimizers.KFAC(learning_rate=0.1, damping=1e-2, block_tridiagonal=True)
    model = tfnng.BayesianModel(net)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model.compile(optimizer=optimizer, loss=tfnng.losses.GaussianNLL(0.1))
    assert [spec.inputs_from for spec in model._layer_capture.specs] == [(), ("d0",), ("d1",)]


def test_a_loaded_functional_model_gets_its_chains_back(tmp_path):
    """keras.models.load_model builds the optimizer at compile, before any batch: the links come
    from a zero example shaped like the net's inputs, and the restored posterior is the saved one."""
    keras.utils.set_random_seed(0)
    optimizer = tfnng.optimizers.NoisyKFAC(num_examples=16, block_tridiagonal=True, seed=0)
    model = tfnng.BayesianModel(_nested())
    model.compile(optimizer=optimizer, loss=tfnng.losses.GaussianNLL(0.1))
    x = np.random.default_rng(0).normal(size=(16, 3)).astype("float32")
    model.fit(x, np.sin(x[:, :1]), batch_size=8, verbose=0)
    model.save(tmp_path / "model.keras")
    loaded = keras.models.load_model(tmp_path / "model.keras")
    assert [[b.spec.layer.name for b in chain] for chain in loaded.optimizer._chains] == [
        ["d0", "d1", "d2", "d3"]]
    np.testing.assert_allclose(float(loaded.optimizer.kl_divergence()), float(optimizer.kl_divergence()),
                               rtol=1e-6)
