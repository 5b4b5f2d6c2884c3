"""Tests of tfnng.layers.NoisePrecision (NNG App. C.1, eq. 23-24)."""

import math

import keras
import numpy as np
import pytest
import tensorflow as tf
from scipy import integrate, special, stats

import tfnng
from tfnng._markers import is_point_estimate, natural_step
from tfnng.layers import NoisePrecision
from tfnng.losses import GaussianNLL


def _set_posterior(layer, alpha, beta):
    layer.log_parameters.assign(np.log(np.asarray([alpha, beta], np.float64)))


def _gamma_kl_closed_form(a, b, a0, b0):
    """KL(Gam(a, rate b) || Gam(a0, rate b0))."""
    return (
        (a - a0) * special.digamma(a)
        - special.gammaln(a)
        + special.gammaln(a0)
        + a0 * (np.log(b) - np.log(b0))
        + a * (b0 - b) / b
    )


def _gamma_kl_numeric(a, b, a0, b0):
    q, p = stats.gamma(a, scale=1 / b), stats.gamma(a0, scale=1 / b0)
    def integrand(t):
        return q.pdf(t) * (q.logpdf(t) - p.logpdf(t))

    value, _ = integrate.quad(integrand, 0, np.inf, limit=200)
    return value


def _mean_model(num_outputs, layer, dtype="float32"):
    """A model whose predicted mean is its input, followed by ``layer``."""
    return keras.Sequential([keras.Input((num_outputs,), dtype=dtype), layer])


def test_output_layout_and_initial_posterior():
    layer = NoisePrecision(100, initial_shape=5.0, initial_rate=2.5)
    mean = np.arange(6, dtype=np.float32).reshape(3, 2)
    out = layer(mean).numpy()
    assert out.shape == (3, 6)
    np.testing.assert_allclose(out[:, :2], mean)
    np.testing.assert_allclose(out[:, 2:4], 5.0, rtol=1e-5)
    np.testing.assert_allclose(out[:, 4:], 2.5, rtol=1e-5)
    q = layer.posterior()
    assert q.batch_shape == (2,)
    np.testing.assert_allclose(q.mean(), [2.0, 2.0], rtol=1e-5)
    assert layer.compute_output_shape((None, 2)) == (None, 6)


def test_default_initialisation_gives_a_few_units_of_precision():
    layer = NoisePrecision(10)
    layer.build((None, 1))
    assert 1.0 < float(layer.posterior().mean()[0]) < 10.0


@pytest.mark.parametrize(
    "a,b,a0,b0", [(2.0, 3.0, 6.0, 6.0), (40.0, 9.0, 6.0, 6.0), (0.8, 0.4, 2.0, 1.0)]
)
def test_gamma_kl_matches_closed_form_and_numeric_integration(a, b, a0, b0):
    layer = NoisePrecision(10, prior_shape=a0, prior_rate=b0, dtype="float64")
    layer.build((None, 1))
    _set_posterior(layer, [a], [b])
    got = float(layer.kl_divergence())
    assert got == pytest.approx(_gamma_kl_numeric(a, b, a0, b0), rel=1e-6, abs=1e-9)
    assert got == pytest.approx(_gamma_kl_closed_form(a, b, a0, b0), rel=1e-9)


@pytest.mark.parametrize("dtype", [None, "mixed_float16", "mixed_bfloat16"])
def test_add_loss_is_weighted_kl_over_num_examples(dtype):
    """Also with a mixed dtype given: q(tau) stays in float32 (a half-precision read of the log
    parameters had met the float32 prior in the KL: a dtype error)."""
    layer = NoisePrecision(250, kl_weight=0.5, dtype=dtype)
    model = _mean_model(3, layer)
    _set_posterior(layer, [2.0, 7.0, 30.0], [1.0, 5.0, 4.0])
    outputs = model(np.zeros((4, 3), np.float32))
    assert outputs.dtype == (dtype or "float32").replace("mixed_", "")
    expected = 0.5 * sum(
        _gamma_kl_closed_form(a, b, 6.0, 6.0) for a, b in [(2.0, 1.0), (7.0, 5.0), (30.0, 4.0)]
    ) / 250
    assert len(model.losses) == 1
    assert float(model.losses[0]) == pytest.approx(expected, rel=1e-5)


def test_variables_are_marked_as_natural_parameters():
    net = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2), NoisePrecision(20)])
    layer = net.layers[-1]
    assert {v.path for v in net.trainable_variables if is_point_estimate(v)} == {
        layer.log_parameters.path}
    assert [v.path for v in net.trainable_variables if natural_step(v) is not None] == [
        layer.log_parameters.path]


def _known_mean_problem(n=40, a0=6.0, b0=6.0, seed=3):
    """y ~ N(0, 0.7^2) with a known (zero) mean: p(tau | y) = Gam(a0 + n/2, b0 + sum y^2 / 2)."""
    y = np.random.default_rng(seed).normal(scale=0.7, size=(n, 1))
    return y, a0 + n / 2, b0 + 0.5 * np.sum(y**2)


def _objective_gradient(layer, model, y):
    """Gradient of the per-example negative ELBO (loss + KL / N) with respect to the variable."""
    loss = GaussianNLL("learned", dtype=layer.dtype)
    with tf.GradientTape() as tape:
        total = loss(y, model(np.zeros_like(y))) + tf.add_n(model.losses)
    return tape.gradient(total, layer.log_parameters)


@pytest.mark.parametrize("alpha,beta", [(6.0, 2.0), (1.5, 40.0), (300.0, 7.0)])
def test_natural_step_is_the_conjugate_update_and_lands_on_the_posterior(alpha, beta):
    # The natural gradient of ELBO / N in theta = (alpha - 1, -beta) is dL/dm: one full-batch step
    # of size 1 (scale N) reaches the exact posterior from anywhere, and a step of size rho moves
    # (alpha, beta) a fraction rho of the way.
    y, a_n, b_n = _known_mean_problem()
    n = len(y)
    layer = NoisePrecision(n, dtype="float64")
    model = _mean_model(1, layer, dtype="float64")
    _set_posterior(layer, [alpha], [beta])
    gradient = _objective_gradient(layer, model, y)
    step = natural_step(layer.log_parameters)
    for rho in (1.0, 0.3):
        new = np.exp(step(layer.log_parameters, gradient, rho).numpy())[:, 0]
        np.testing.assert_allclose(new, [(1 - rho) * alpha + rho * a_n, (1 - rho) * beta + rho * b_n],
                                   rtol=1e-9)


@pytest.mark.parametrize("kl_weight", [0.5, 3.0])
def test_natural_step_with_a_kl_weight_moves_towards_the_tempered_posterior(kl_weight):
    """With the KL weighted by w the fixed point is Gam(a0 + n / (2 w), b0 + sum y^2 / (2 w)); the
    step size is capped at 1 / w for w > 1, which lands on it at once (before, the step of size 1
    with w = 3 overshot to a negative alpha and q(tau) never moved)."""
    y, _, _ = _known_mean_problem()
    n = len(y)
    a_w, b_w = 6.0 + n / (2 * kl_weight), 6.0 + 0.5 * np.sum(y ** 2) / kl_weight
    layer = NoisePrecision(n, kl_weight=kl_weight, dtype="float64")
    model = _mean_model(1, layer, dtype="float64")
    step = natural_step(layer.log_parameters)
    for rho in (1.0, 0.2):
        _set_posterior(layer, [300.0], [7.0])
        new = np.exp(step(layer.log_parameters, _objective_gradient(layer, model, y), rho).numpy())
        r = min(rho, 1 / kl_weight)
        np.testing.assert_allclose(new[:, 0], [(1 - r * kl_weight) * 300.0 + r * kl_weight * a_w,
                                               (1 - r * kl_weight) * 7.0 + r * kl_weight * b_w],
                                   rtol=1e-9)
    for _ in range(40):                                # and repeated steps converge to it
        layer.log_parameters.assign(step(layer.log_parameters,
                                         _objective_gradient(layer, model, y), 1.0))
    np.testing.assert_allclose([layer.alpha.numpy()[0], layer.beta.numpy()[0]], [a_w, b_w], rtol=1e-6)


def test_natural_step_that_would_leave_the_gamma_family_keeps_the_old_values():
    """A step size of 3 (or float32 gradients of a diverged network, ~1e17 squared residuals) would
    make alpha negative and log alpha NaN: q(tau) keeps its previous alpha and beta instead."""
    y, a_n, b_n = _known_mean_problem()
    layer = NoisePrecision(len(y), dtype="float64")
    model = _mean_model(1, layer, dtype="float64")
    _set_posterior(layer, [300.0], [7.0])
    assert -2 * 300.0 + 3 * a_n < 0                          # the unguarded step's alpha
    step = natural_step(layer.log_parameters)
    before = layer.log_parameters.numpy()
    after = step(layer.log_parameters, _objective_gradient(layer, model, y), 3.0).numpy()
    np.testing.assert_array_equal(after, before)
    assert np.all(np.isfinite(step(layer.log_parameters, tf.fill((2, 1), tf.constant(np.nan, tf.float64)),
                                   0.5).numpy()))


def test_natural_step_keeps_only_the_outputs_whose_step_is_invalid():
    """Two outputs, the second's gradient NaN (a diverged output): the first still takes its
    conjugate step towards Gam(a_n, b_n), the second keeps its alpha and beta."""
    y, a_n, b_n = _known_mean_problem()
    y = np.concatenate([y, y], axis=1)
    layer = NoisePrecision(len(y), dtype="float64")
    model = _mean_model(2, layer, dtype="float64")
    _set_posterior(layer, [6.0, 6.0], [2.0, 2.0])
    gradient = _objective_gradient(layer, model, y).numpy()
    gradient[:, 1] = np.nan
    new = np.exp(natural_step(layer.log_parameters)(layer.log_parameters, tf.constant(gradient),
                                                     0.5).numpy())
    np.testing.assert_allclose(new[:, 0], [0.5 * 6.0 + 0.5 * a_n, 0.5 * 2.0 + 0.5 * b_n], rtol=1e-9)
    np.testing.assert_allclose(new[:, 1], [6.0, 2.0], rtol=1e-12)


@pytest.mark.parametrize("learning_rate", [0.25, 1.5])
def test_tfnng_optimizer_takes_the_natural_gradient_step(learning_rate):
    # Inside model.fit, a tfnng optimizer moves q(tau) by v <- v - min(lr, 1) N g: with a predicted
    # mean fixed at zero (the input is zero), each full-batch step is the conjugate update above
    # (at lr 1.5, the step of size 1 that lands on the posterior, not past it).
    # N is the layer's own (the N its KL term is divided by), not the optimizer's: an optimizer told
    # another N still lands on the layer's posterior.
    y, a_n, b_n = _known_mean_problem()
    n = len(y)
    net = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1, use_bias=False),
                            NoisePrecision(n)])
    rho = min(learning_rate, 1.0)
    net.compile(optimizer=tfnng.optimizers.NoisyAdam(learning_rate=learning_rate, num_examples=10 * n),
                loss=GaussianNLL("learned"))
    layer = net.layers[-1]
    alpha, beta = 6.0, 2.0
    for _ in range(3):
        net.fit(np.zeros((n, 1), np.float32), y.astype(np.float32), batch_size=n, verbose=0)
        alpha, beta = (1 - rho) * alpha + rho * a_n, (1 - rho) * beta + rho * b_n
        np.testing.assert_allclose([float(layer.alpha[0]), float(layer.beta[0])], [alpha, beta],
                                   rtol=1e-5)


def test_exact_posterior_maximises_elbo_and_attains_log_evidence():
    # With a known (zero) mean, p(tau | y) = Gam(a0 + N/2, b0 + sum y^2 / 2) is in the variational
    # family, so it is the stationary point of eq. (24) and the ELBO equals log p(y) there.
    a0, b0 = 6.0, 6.0
    y, a_n, b_n = _known_mean_problem(a0=a0, b0=b0)
    n = len(y)
    log_evidence = (
        a0 * np.log(b0) - special.gammaln(a0) + special.gammaln(a_n) - a_n * np.log(b_n)
        - 0.5 * n * np.log(2 * np.pi)
    )
    layer = NoisePrecision(n, prior_shape=a0, prior_rate=b0, dtype="float64")
    model = _mean_model(1, layer, dtype="float64")
    loss = GaussianNLL("learned", dtype="float64")
    _set_posterior(layer, [a_n], [b_n])
    with tf.GradientTape() as tape:
        total = loss(y, model(np.zeros((n, 1)))) + tf.add_n(model.losses)
    grads = tape.gradient(total, layer.log_parameters).numpy()
    assert -n * float(total) == pytest.approx(log_evidence, rel=1e-10)
    assert np.max(np.abs(grads)) < 1e-10
    # Away from the posterior the objective is larger (ELBO smaller) and the gradient is not zero.
    _set_posterior(layer, [a_n * 1.2], [b_n])
    with tf.GradientTape() as tape:
        worse = loss(y, model(np.zeros((n, 1)))) + tf.add_n(model.losses)
    assert float(worse) > float(total)
    assert abs(float(tape.gradient(worse, layer.log_parameters)[0, 0])) > 1e-3


def test_keras_total_loss_is_negative_elbo_per_example():
    rng = np.random.default_rng(4)
    n = 32
    x = rng.normal(size=(n, 2)).astype(np.float32)
    y = rng.normal(size=(n, 2)).astype(np.float32)
    layer = NoisePrecision(n)
    model = _mean_model(2, layer)
    model.compile(optimizer="adam", loss=GaussianNLL("learned"))
    reported = model.evaluate(x, y, batch_size=n, verbose=0)
    alpha, beta = 6.0, 2.0  # the default initial posterior
    expected_nll = 0.5 * np.sum(
        alpha / beta * (y - x) ** 2 - (special.digamma(alpha) - np.log(beta)) + np.log(2 * np.pi),
        axis=-1,
    ).mean()
    kl = 2 * _gamma_kl_closed_form(alpha, beta, 6.0, 6.0)
    assert reported == pytest.approx(expected_nll + kl / n, rel=1e-5)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"num_examples": 0}, "num_examples"),
        ({"num_examples": -5}, "num_examples"),
        ({"num_examples": 10.0}, "num_examples"),
        ({"num_examples": True}, "num_examples"),
        ({"num_examples": "100"}, "num_examples"),
        ({"num_examples": 10, "prior_shape": 0.0}, "prior_shape"),
        ({"num_examples": 10, "prior_rate": float("nan")}, "prior_rate"),
        ({"num_examples": 10, "initial_rate": -1.0}, "initial_rate"),
        ({"num_examples": 10, "kl_weight": -0.1}, "kl_weight"),
    ],
)
def test_bad_arguments_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        NoisePrecision(**kwargs)


def test_rank1_input_raises():
    with pytest.raises(ValueError, match=r"\(batch, d\)"):
        NoisePrecision(10).build((None,))


def test_config_round_trip():
    layer = NoisePrecision(
        123, prior_shape=2.0, prior_rate=3.0, kl_weight=0.25, initial_shape=4.0, initial_rate=5.0,
        name="noise",
    )
    config = layer.get_config()
    restored = NoisePrecision.from_config(config)
    assert restored.get_config() == config
    assert (restored.num_examples, restored.kl_weight, restored.initial_rate) == (123, 0.25, 5.0)
    serialized = keras.saving.serialize_keras_object(layer)
    assert serialized["registered_name"] == "tfnng>NoisePrecision"


def test_settings_are_fixed_once_built_and_the_documented_way_to_change_them_works():
    """kl_weight set on a built layer (a Sequential with an Input builds it at once) reached the KL
    term but not the natural-gradient step made at build: q(tau) then oscillated at step size 1
    instead of landing on the tempered optimum."""
    layer = NoisePrecision(40, name="noise")
    layer.kl_weight = 2.0                             # not built yet: the constructor's value
    net = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1, use_bias=False), layer])
    for name in ("kl_weight", "num_examples", "prior_shape", "prior_rate"):
        with pytest.raises(AttributeError, match=f"NoisePrecision.{name} is fixed once the layer"):
            setattr(layer, name, 3.0)
    assert layer.kl_weight == 2.0
    net.layers[0].set_weights([np.zeros((1, 1), np.float32)])
    y = np.random.default_rng(3).normal(scale=0.7, size=(40, 1)).astype(np.float32)
    tempered = NoisePrecision.from_config({**layer.get_config(), "kl_weight": 4.0})
    net = keras.Sequential([keras.Input((1,)), net.layers[0], tempered])
    tempered.set_weights(layer.get_weights())
    net.compile(optimizer=tfnng.optimizers.NoisyAdam(learning_rate=1.0, num_examples=40),
                loss=GaussianNLL("learned"))
    for _ in range(2):      # the step capped at 1 / w lands on the fixed point (docs/math.md)
        net.fit(np.zeros((40, 1), np.float32), y, batch_size=40, verbose=0)
        expected = [6.0 + 40 / (2 * 4.0), 6.0 + 0.5 * np.sum(y.astype(np.float64) ** 2) / 4.0]
        np.testing.assert_allclose([float(tempered.alpha[0]), float(tempered.beta[0])], expected,
                                   rtol=1e-4)


def test_save_and_load_model_without_custom_objects(tmp_path):
    rng = np.random.default_rng(5)
    x = rng.normal(size=(50, 3)).astype(np.float32)
    y = (x @ np.array([[1.0], [-2.0], [0.5]]) + 0.3 * rng.normal(size=(50, 1))).astype(np.float32)
    model = keras.Sequential(
        [keras.Input((3,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(1),
         NoisePrecision(len(x))]
    )
    model.compile(optimizer=keras.optimizers.Adam(0.05), loss=GaussianNLL("learned"))
    history = model.fit(x, y, batch_size=10, epochs=3, verbose=0)
    assert history.history["loss"][-1] < history.history["loss"][0]
    path = tmp_path / "noise.keras"
    model.save(path)

    loaded = keras.models.load_model(path)
    np.testing.assert_allclose(loaded.predict(x, verbose=0), model.predict(x, verbose=0), rtol=1e-6)
    assert isinstance(loaded.loss, GaussianNLL) and loaded.loss.learned
    noise = loaded.layers[-1]
    assert isinstance(noise, NoisePrecision)
    assert noise.get_config() == model.layers[-1].get_config()
    assert natural_step(noise.log_parameters) is not None
    reloaded_loss = loaded.evaluate(x, y, verbose=0)
    assert math.isfinite(reloaded_loss)
    assert reloaded_loss == pytest.approx(model.evaluate(x, y, verbose=0), rel=1e-5)


def test_mark_natural_parameter_requires_a_step_function():
    """Not only None: a number or a string given as ``natural_step`` would fail at the first update."""
    for bad in (None, 0.5, "conjugate"):
        variable = tf.Variable([0.0])
        with pytest.raises(TypeError, match="natural_step"):
            tfnng.mark_natural_parameter(variable, bad)
        assert natural_step(variable) is None and not is_point_estimate(variable)
    variable = tfnng.mark_natural_parameter(tf.Variable([0.0]), lambda value, gradient, step: value)
    assert callable(natural_step(variable)) and is_point_estimate(variable)
