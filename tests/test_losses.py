"""Tests of tfnng.losses against scipy densities, numeric integration and Monte Carlo."""

import math

import keras
import numpy as np
import pytest
import tensorflow as tf
from scipy import integrate, special, stats

import tfnng.losses
from tfnng.losses import BernoulliNLL, CategoricalNLL, GaussianNLL

RNG = np.random.default_rng(0)


def _learned_y_pred(mean, alpha, beta):
    return np.concatenate([mean, alpha, beta], axis=-1).astype(np.float32)


# ----------------------------------------------------------------------------- GaussianNLL (fixed)


def test_fixed_noise_log_prob_matches_scipy_and_call_is_its_negative():
    mean = RNG.normal(size=(5, 3)).astype(np.float32)
    y = RNG.normal(size=(5, 3)).astype(np.float32)
    loss = GaussianNLL(noise_variance=0.3)
    expected = stats.norm.logpdf(y, loc=mean, scale=math.sqrt(0.3)).sum(axis=-1)
    np.testing.assert_allclose(loss.log_prob(y, mean), expected, rtol=1e-5)
    np.testing.assert_allclose(loss.call(tf.constant(y), tf.constant(mean)), -expected, rtol=1e-5)
    # Keras' default reduction averages the per-example value over the batch.
    np.testing.assert_allclose(float(loss(y, mean)), -expected.mean(), rtol=1e-5)


def test_fixed_noise_accepts_rank1_targets_for_single_output():
    mean = RNG.normal(size=(6, 1)).astype(np.float32)
    y = RNG.normal(size=(6,)).astype(np.float32)
    loss = GaussianNLL(2.0)
    np.testing.assert_allclose(
        loss.log_prob(y, mean), stats.norm.logpdf(y, mean[:, 0], math.sqrt(2.0)), rtol=1e-5
    )


def test_fixed_noise_mean_and_variance_and_distribution_shapes():
    mean = RNG.normal(size=(4, 2)).astype(np.float32)
    loss = GaussianNLL(0.5)
    m, v = loss.mean_and_variance(mean)
    np.testing.assert_allclose(m, mean)
    np.testing.assert_allclose(v, np.full((4, 2), 0.5))
    dist = loss.distribution(mean)
    assert dist.batch_shape == (4,) and dist.event_shape == (2,)
    assert not GaussianNLL.is_classification


# --------------------------------------------------------------------------- GaussianNLL (learned)


def test_learned_log_prob_is_student_t_from_scipy():
    mean = RNG.normal(size=(5, 2))
    alpha = RNG.uniform(0.5, 8.0, size=(5, 2))
    beta = RNG.uniform(0.3, 4.0, size=(5, 2))
    y = RNG.normal(size=(5, 2))
    loss = GaussianNLL("learned")
    expected = stats.t.logpdf(y, df=2 * alpha, loc=mean, scale=np.sqrt(beta / alpha)).sum(-1)
    got = loss.log_prob(y.astype(np.float32), _learned_y_pred(mean, alpha, beta))
    np.testing.assert_allclose(got, expected, rtol=1e-4)
    dist = loss.distribution(_learned_y_pred(mean, alpha, beta))
    assert dist.batch_shape == (5,) and dist.event_shape == (2,)


def test_learned_log_prob_is_gaussian_integrated_over_gamma_precision():
    # The predictive of one weight sample: int N(y | m, 1/tau) Gam(tau | a, rate b) dtau.
    m, a, b, y = 0.3, 2.5, 1.7, 1.4
    density, _ = integrate.quad(
        lambda tau: stats.norm.pdf(y, m, 1 / math.sqrt(tau)) * stats.gamma.pdf(tau, a, scale=1 / b),
        0,
        np.inf,
    )
    got = GaussianNLL("learned").log_prob([[y]], _learned_y_pred([[m]], [[a]], [[b]]))
    np.testing.assert_allclose(got, [math.log(density)], rtol=1e-5)


def _expected_nll_numeric(y, m, a, b):
    """-E_{tau ~ Gam(a, rate b)} log N(y | m, 1/tau) by quadrature."""
    value, _ = integrate.quad(
        lambda tau: -stats.norm.logpdf(y, m, 1 / math.sqrt(tau))
        * stats.gamma.pdf(tau, a, scale=1 / b),
        0,
        np.inf,
    )
    return value


def test_learned_call_is_minus_eq23_expectation_by_quadrature():
    mean = np.array([[0.1, -0.4], [1.2, 0.0]])
    alpha = np.array([[3.0, 0.7], [6.0, 1.5]])
    beta = np.array([[2.0, 0.5], [6.0, 4.0]])
    y = np.array([[0.5, 0.9], [-0.3, 2.0]])
    expected = [
        sum(_expected_nll_numeric(y[n, j], mean[n, j], alpha[n, j], beta[n, j]) for j in range(2))
        for n in range(2)
    ]
    got = GaussianNLL("learned").call(
        tf.constant(y, tf.float32), tf.constant(_learned_y_pred(mean, alpha, beta))
    )
    np.testing.assert_allclose(got, expected, rtol=1e-5)


def test_learned_call_matches_monte_carlo_over_tau():
    m, a, b, y = -0.2, 4.0, 3.0, 0.8
    tau = np.random.default_rng(1).gamma(a, 1 / b, size=200_000)
    nll = -stats.norm.logpdf(y, m, 1 / np.sqrt(tau))
    y_pred = _learned_y_pred([[m]], [[a]], [[b]])
    got = float(GaussianNLL("learned").call(tf.constant([[y]]), tf.constant(y_pred))[0])
    assert abs(got - nll.mean()) < 4 * nll.std() / math.sqrt(nll.size)


def test_learned_mean_and_variance():
    mean = np.array([[0.0, 1.0, 2.0]])
    alpha = np.array([[3.0, 1.0, 0.5]])
    beta = np.array([[2.0, 1.0, 1.0]])
    m, v = GaussianNLL("learned").mean_and_variance(_learned_y_pred(mean, alpha, beta))
    np.testing.assert_allclose(m, mean)
    # Student-t variance for df = 2 alpha > 2; infinite otherwise.
    expected = stats.t.var(df=6.0, scale=math.sqrt(2.0 / 3.0))
    assert v.numpy()[0, 0] == pytest.approx(expected, rel=1e-5)
    assert np.isinf(v.numpy()[0, 1:]).all()


# ----------------------------------------------------------------------------------- classification


def test_categorical_log_prob_with_every_label_format():
    logits = RNG.normal(size=(6, 4)).astype(np.float32)
    labels = RNG.integers(0, 4, size=6)
    expected = special.log_softmax(logits, axis=-1)[np.arange(6), labels]
    loss = CategoricalNLL()
    for y_true in (labels, labels[:, None], labels.astype(np.float32), np.eye(4)[labels]):
        np.testing.assert_allclose(loss.log_prob(y_true, logits), expected, rtol=1e-5)
    np.testing.assert_allclose(float(loss(labels, logits)), -expected.mean(), rtol=1e-5)
    np.testing.assert_allclose(
        loss.probabilities(logits), special.softmax(logits, axis=-1), rtol=1e-5
    )
    assert CategoricalNLL.is_classification


def test_categorical_soft_labels_give_cross_entropy():
    logits = RNG.normal(size=(3, 3)).astype(np.float32)
    soft = np.array([[0.2, 0.3, 0.5], [1.0, 0.0, 0.0], [0.0, 0.5, 0.5]], np.float32)
    expected = (soft * special.log_softmax(logits, axis=-1)).sum(-1)
    np.testing.assert_allclose(CategoricalNLL().log_prob(soft, logits), expected, rtol=1e-5)


def test_categorical_one_hot_labels_score_a_class_masked_by_minus_infinity():
    """A logit of -inf (a class masked out) with one-hot or soft labels: 0 log 0 counts as 0, as
    with class ids (it gave NaN: 0 * -inf), and the gradient stays finite."""
    logits = tf.constant([[1.0, -np.inf, 0.5], [0.0, 2.0, -np.inf]])
    log_softmax = special.log_softmax(logits.numpy().astype(np.float64), axis=-1)
    ids = np.array([0, 1])
    soft = np.array([[0.5, 0.0, 0.5], [0.0, 1.0, 0.0]], np.float32)
    expected = {"ids": log_softmax[[0, 1], ids],
                "one-hot": log_softmax[[0, 1], ids],
                "soft": [0.5 * (log_softmax[0, 0] + log_softmax[0, 2]), log_softmax[1, 1]]}
    for kind, y_true in (("ids", ids), ("one-hot", np.eye(3, dtype=np.float32)[ids]),
                         ("soft", soft)):
        with tf.GradientTape() as tape:
            tape.watch(logits)
            log_p = CategoricalNLL().log_prob(y_true, logits)
        np.testing.assert_allclose(log_p, expected[kind], rtol=1e-6, err_msg=kind)
        assert np.all(np.isfinite(tape.gradient(log_p, logits).numpy())), kind


@pytest.mark.parametrize("loss, y_pred", [
    (GaussianNLL(1.0), np.zeros((3, 1), np.float32)),
    (BernoulliNLL(), np.zeros((3, 1), np.float32)),
    (CategoricalNLL(), np.zeros((3, 2), np.float32))])
def test_targets_of_unknown_rank_are_refused(loss, y_pred):
    """Traced with the targets' shape left open, GaussianNLL broadcast (batch,) targets against
    the (batch, 1) mean: each example scored the sum over all targets. The Bernoulli and
    categorical losses crashed writing their own error ("Cannot iterate over a shape with unknown
    rank")."""
    y_true = np.array([1.0, 0.0, 1.0], np.float32)
    expected = loss.log_prob(y_true, y_pred).numpy()
    for method in (loss.log_prob, loss.call):
        traced = tf.function(method, input_signature=[tf.TensorSpec(None, tf.float32),
                                                      tf.TensorSpec(y_pred.shape, tf.float32)])
        with pytest.raises(ValueError, match="y_true has an unknown rank"):
            traced(y_true, y_pred)
    known = tf.function(loss.log_prob, input_signature=[tf.TensorSpec([None], tf.float32),
                                                        tf.TensorSpec([None, y_pred.shape[1]])])
    np.testing.assert_allclose(known(y_true, y_pred), expected, rtol=1e-6)


def test_bernoulli_infinite_logit_scores_its_own_label_zero():
    """A logit of +-inf: log p = 0 for the label it predicts, -inf for the other, a soft label in
    between gets -inf, and the gradient stays finite (it gave NaN: inf - inf)."""
    logits = tf.constant([[np.inf], [-np.inf], [np.inf], [-np.inf], [np.inf]])
    y = tf.constant([1.0, 0.0, 0.0, 1.0, 0.5])
    with tf.GradientTape() as tape:
        tape.watch(logits)
        log_p = BernoulliNLL().log_prob(y, logits)
        predicted = tf.reduce_sum(log_p[:2])
    np.testing.assert_array_equal(log_p, [0.0, 0.0, -np.inf, -np.inf, -np.inf])
    grad = tape.gradient(predicted, logits).numpy()
    np.testing.assert_array_equal(grad, np.zeros((5, 1)))


def test_bernoulli_log_prob_matches_scipy():
    logits = RNG.normal(size=(7, 1)).astype(np.float32) * 3
    y = RNG.integers(0, 2, size=7)
    expected = stats.bernoulli.logpmf(y, special.expit(logits[:, 0]))
    loss = BernoulliNLL()
    np.testing.assert_allclose(loss.log_prob(y, logits), expected, rtol=1e-5)
    np.testing.assert_allclose(loss.log_prob(y[:, None], logits), expected, rtol=1e-5)
    keras_style = loss.call(tf.constant(y[:, None], tf.float32), tf.constant(logits))
    np.testing.assert_allclose(keras_style, -expected, rtol=1e-5)
    probs = loss.probabilities(logits)
    assert probs.shape == (7, 1)
    np.testing.assert_allclose(probs, special.expit(logits), rtol=1e-5)
    assert loss.distribution(logits).batch_shape == (7,)


def test_labels_out_of_range_raise_eagerly_in_graphs_and_in_fit():
    """Non-integral or out-of-range class ids, NaN labels and Bernoulli targets outside [0, 1] are
    errors (they used to be truncated, gathered out of range or given a meaningless density)."""
    logits = RNG.normal(size=(3, 4)).astype(np.float32)
    graph_log_prob = tf.function(lambda y, out: CategoricalNLL().log_prob(y, out))
    for labels, message in (([0.0, 1.5, 2.0], "integral"), ([0.0, np.nan, 2.0], "integral"),
                            ([0, 4, 1], r"\[0, K\)"), ([0, -1, 1], r"\[0, K\)")):
        for log_prob in (CategoricalNLL().log_prob, graph_log_prob):
            with pytest.raises(tf.errors.InvalidArgumentError, match=message):
                log_prob(np.asarray(labels), logits)
    logit = RNG.normal(size=(3, 1)).astype(np.float32)
    for targets in ([0.0, 2.0, 1.0], [0.0, -1.0, 1.0], [np.nan, 0.0, 1.0]):
        with pytest.raises(tf.errors.InvalidArgumentError, match=r"\[0, 1\]"):
            BernoulliNLL().log_prob(np.asarray(targets, np.float32), logit)
    soft = np.array([0.3, 1.0, 0.0], np.float32)          # a probability target: the cross-entropy
    expected = soft * special.log_expit(logit[:, 0]) + (1 - soft) * special.log_expit(-logit[:, 0])
    np.testing.assert_allclose(BernoulliNLL().log_prob(soft, logit), expected, rtol=1e-5)

    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(3)])
    model.compile(optimizer="sgd", loss=CategoricalNLL())
    x = np.zeros((4, 2), np.float32)
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"\[0, K\)"):
        model.fit(x, np.array([0, 1, 2, 3]), epochs=1, verbose=0)


# ------------------------------------------------------------------------------------------ sample


def test_sample_moments_match_distribution():
    n = 20_000
    seed = tf.constant([3, 4])
    fixed = GaussianNLL(0.25)
    mean = np.tile([[1.0, -2.0]], (n, 1)).astype(np.float32)
    draws = fixed.sample(mean, seed=seed).numpy()
    assert draws.shape == (n, 2)
    np.testing.assert_allclose(draws.mean(0), [1.0, -2.0], atol=5 * 0.5 / math.sqrt(n))
    np.testing.assert_allclose(draws.var(0), [0.25, 0.25], rtol=0.05)

    learned = GaussianNLL("learned")
    y_pred = np.tile(_learned_y_pred([[0.5]], [[6.0]], [[3.0]]), (n, 1))
    draws = learned.sample(y_pred, seed=seed).numpy()
    var = stats.t.var(df=12.0, scale=math.sqrt(0.5))
    assert draws.shape == (n, 1)
    assert abs(draws.mean() - 0.5) < 5 * math.sqrt(var / n)
    assert draws.var() == pytest.approx(var, rel=0.06)

    logits = np.tile([[0.0, 1.0, -1.0]], (n, 1)).astype(np.float32)
    ids = CategoricalNLL().sample(logits, seed=seed).numpy()
    assert ids.shape == (n,) and np.issubdtype(ids.dtype, np.integer)
    p = special.softmax([0.0, 1.0, -1.0])
    freq = np.bincount(ids, minlength=3) / n
    assert (np.abs(freq - p) < 5 * np.sqrt(p * (1 - p) / n)).all()

    bits = BernoulliNLL().sample(np.full((n, 1), 0.7, np.float32), seed=seed).numpy()
    assert bits.shape == (n, 1)
    p1 = special.expit(0.7)
    assert abs(bits.mean() - p1) < 5 * math.sqrt(p1 * (1 - p1) / n)


@pytest.mark.parametrize("dtype", [tf.float16, tf.bfloat16])
def test_half_precision_heads_sample_in_float32(dtype):
    """A mixed-precision model's float16/bfloat16 head: the true-Fisher samplers draw from the
    float32 distribution (bfloat16 Bernoulli draws at logit 6 were all 1: the example's Fisher
    p (1 - p) came out 0 instead of 0.0025; bfloat16 Gaussian draws around 100 took three values)."""
    n, seed = 40_000, tf.constant([5, 6])
    bits = BernoulliNLL().sample(tf.fill((n, 1), tf.constant(6.0, dtype)), seed=seed).numpy()
    p1 = special.expit(6.0)
    assert abs(bits.mean() - p1) < 5 * math.sqrt(p1 * (1 - p1) / n)
    draws = GaussianNLL(0.01).sample(tf.fill((n, 1), tf.constant(100.0, dtype)), seed=seed)
    assert draws.dtype == tf.float32
    assert np.var(draws.numpy()) == pytest.approx(0.01, rel=0.05)
    assert len(np.unique(draws.numpy())) > n // 2


@pytest.mark.parametrize("make", [lambda d: CategoricalNLL(dtype=d), lambda d: BernoulliNLL(dtype=d),
                                  lambda d: GaussianNLL(1.0, dtype=d)])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "mixed_bfloat16"])
def test_half_precision_loss_dtype_is_refused(make, dtype):
    """Keras casts the targets to the loss's dtype before ``call``: in float16 class id 2049 became
    2048 and a target of 70000 gave a NaN loss, silently."""
    with pytest.raises(ValueError, match="would round"):
        make(dtype)


@pytest.mark.parametrize("floatx", ["float16", "bfloat16"])
def test_losses_with_their_dtype_unset_work_under_a_half_precision_floatx(floatx):
    """The refusal above is for a half-precision dtype given to the loss; Keras fills an unset
    dtype from floatx, which under float16 refused every loss made without a dtype."""
    previous = keras.config.floatx()
    keras.config.set_floatx(floatx)
    try:
        losses = (CategoricalNLL(), BernoulliNLL(), GaussianNLL(1.0))
    finally:
        keras.config.set_floatx(previous)
    logits = tf.constant([[0.5, -1.0, 2.0]], floatx)
    value = losses[0](np.array([2]), logits)
    assert value.dtype == tf.float32
    expected = -special.log_softmax(tf.cast(logits, tf.float32).numpy(), axis=-1)[0, 2]
    assert float(value) == pytest.approx(expected, rel=1e-6)
    assert [loss.get_config()["dtype"] for loss in losses] == [None] * 3


def test_float64_loss_keeps_large_class_ids():
    ids, logits = np.array([2049, 257]), np.zeros((2, 3000))
    logits[0, 2049] = logits[1, 257] = 5.0
    loss = CategoricalNLL(dtype="float64")(ids, logits).numpy()
    expected = -np.mean(special.log_softmax(logits, axis=-1)[[0, 1], ids])
    assert loss == pytest.approx(expected, rel=1e-12)


def test_seed_conventions():
    loss = GaussianNLL(1.0)
    mean = np.zeros((8, 1), np.float32)
    np.testing.assert_array_equal(loss.sample(mean, seed=7), loss.sample(mean, seed=7))
    np.testing.assert_array_equal(
        loss.sample(mean, seed=tf.constant([1, 2])), loss.sample(mean, seed=np.array([1, 2]))
    )
    assert not np.array_equal(loss.sample(mean, seed=7), loss.sample(mean, seed=8))
    np.testing.assert_array_equal(loss.sample(mean, seed=7), loss.sample(mean, seed=[7, 0]))  # documented
    gen_a, gen_b = keras.random.SeedGenerator(5), keras.random.SeedGenerator(5)
    first, second = loss.sample(mean, seed=gen_a), loss.sample(mean, seed=gen_a)
    assert not np.array_equal(first, second)  # the generator advances
    np.testing.assert_array_equal(first, loss.sample(mean, seed=gen_b))  # and is reproducible
    assert loss.sample(mean).shape == (8, 1)
    with pytest.raises(ValueError, match="seed"):
        loss.sample(mean, seed=tf.constant([1.0, 2.0]))
    with pytest.raises(ValueError, match="seed"):
        loss.sample(mean, seed=[1, 2, 3])


def test_sample_under_xla():
    learned = GaussianNLL("learned")
    categorical = CategoricalNLL()
    generator = keras.random.SeedGenerator(0)
    y_pred = _learned_y_pred(np.zeros((4, 2)), np.full((4, 2), 3.0), np.full((4, 2), 2.0))

    @tf.function(jit_compile=True)
    def draw(y_pred, seed):
        return (
            learned.sample(y_pred, seed=seed),
            learned.sample(y_pred, seed=generator),
            categorical.sample(y_pred, seed=generator),
        )

    a, b, c = draw(y_pred, tf.constant([1, 2]))
    a2, b2, _ = draw(y_pred, tf.constant([1, 2]))
    assert a.shape == (4, 2) and c.shape == (4,)
    np.testing.assert_array_equal(a, a2)
    assert not np.array_equal(b, b2)


# ------------------------------------------------------------------------------ validation, config


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), float("inf"), "fixed", True, None])
def test_bad_noise_variance(bad):
    with pytest.raises(ValueError, match="noise_variance"):
        GaussianNLL(noise_variance=bad)


def test_bad_shapes_raise_clear_errors():
    with pytest.raises(ValueError, match=r"\[mean \(d\), alpha \(d\), beta \(d\)\]"):
        GaussianNLL("learned").log_prob(np.zeros((2, 1)), np.ones((2, 4), np.float32))
    with pytest.raises(ValueError, match="does not match"):
        GaussianNLL(1.0).call(tf.zeros((2, 3)), tf.zeros((2, 2)))
    for targets in (np.zeros((1, 2)), np.zeros((1,))):          # one target, five predictions:
        with pytest.raises(ValueError, match="does not match"):  # not broadcast silently
            GaussianNLL(1.0).log_prob(targets, np.zeros((5, 2 if targets.ndim == 2 else 1)))
    unknown_width = tf.function(GaussianNLL(1.0).call, input_signature=[   # (batch,) targets
        tf.TensorSpec((None,)), tf.TensorSpec((None, None))])              # need d known to be 1
    with pytest.raises(ValueError, match="does not match"):
        unknown_width.get_concrete_function()
    for loss in (GaussianNLL(1.0), GaussianNLL("learned")):   # a (batch,) output would sum the batch
        with pytest.raises(ValueError, match=r"\(batch, d\)"):
            loss.call(tf.zeros((6,)), tf.zeros((6,)))
    with pytest.raises(ValueError, match="one-hot"):
        CategoricalNLL().log_prob(np.zeros((2, 3)), np.zeros((2, 4), np.float32))
    for loss, width in ((CategoricalNLL(), 3), (BernoulliNLL(), 1), (GaussianNLL(1.0), 2)):
        # one label row, five predictions: an error, eagerly and in a graph with unknown batch
        with pytest.raises(ValueError, match="examples|does not match"):
            loss.log_prob(np.eye(width, dtype=np.float32)[:1], np.zeros((5, width), np.float32))
        traced = tf.function(loss.log_prob, input_signature=[
            tf.TensorSpec((None, width), tf.float32), tf.TensorSpec((None, width), tf.float32)])
        with pytest.raises(tf.errors.InvalidArgumentError, match="numbers of examples"):
            traced(np.eye(width, dtype=np.float32)[:1], np.zeros((5, width), np.float32))
    with pytest.raises(ValueError, match=r"\(batch, 1\)"):
        BernoulliNLL().log_prob(np.zeros(2), np.zeros((2, 2), np.float32))


def test_inputs_that_used_to_give_silently_wrong_values_or_internal_errors_are_refused():
    """A summed loss (a plain model trained with it: posterior standard deviations 35-55% too
    small), soft labels that are not probability vectors (a negative loss), one logit for
    CategoricalNLL (every probability 1), a learned-noise output without positive alpha, beta
    (a NaN loss), and fewer class ids than examples (a GatherV2 error)."""
    with pytest.raises(ValueError, match="averaged over the batch.*reduction='sum'"):
        GaussianNLL(reduction="sum")
    per_example = GaussianNLL(1.0, reduction="none")(np.zeros((3, 1)), np.ones((3, 1), np.float32))
    np.testing.assert_allclose(per_example, 0.5 * (1 + np.log(2 * np.pi)), rtol=1e-6)
    logits = np.zeros((2, 3), np.float32)
    for bad in (-np.eye(3)[:2], 2 * np.eye(3)[:2]):
        with pytest.raises(tf.errors.InvalidArgumentError, match="probability vectors"):
            CategoricalNLL().log_prob(bad.astype(np.float32), logits)
    np.testing.assert_allclose(CategoricalNLL().log_prob(np.full((2, 3), 1 / 3, np.float32), logits),
                               -np.log(3), rtol=1e-6)
    with pytest.raises(ValueError, match="K >= 2"):
        CategoricalNLL().probabilities(np.zeros((2, 1), np.float32))
    with pytest.raises(ValueError, match="2 examples, y_pred 5"):
        CategoricalNLL().log_prob(np.array([0, 1]), np.zeros((5, 3), np.float32))
    for alpha, beta in ((-1.0, 1.0), (0.0, 1.0), (1.0, 0.0)):         # positive, not non-negative
        with pytest.raises(tf.errors.InvalidArgumentError, match="NoisePrecision"):
            GaussianNLL("learned").call(np.zeros((2, 1)),
                                        np.array([[0.0, alpha, beta], [0.0, 1.0, 1.0]], np.float32))


@pytest.mark.parametrize(
    "loss",
    [GaussianNLL(0.5), GaussianNLL("learned"), CategoricalNLL(), BernoulliNLL(reduction="none")],
)
def test_config_round_trip_through_registry(loss):
    restored = type(loss).from_config(loss.get_config())
    assert restored.get_config() == loss.get_config()
    serialized = keras.saving.serialize_keras_object(loss)
    assert serialized["registered_name"].startswith("tfnng>")
    again = keras.saving.deserialize_keras_object(serialized)
    assert type(again) is type(loss) and again.get_config() == loss.get_config()
    assert tfnng.losses.LikelihoodLoss in type(again).__mro__
