"""tfnng.serving.export: SavedModels with in-graph posterior sampling, loaded in a fresh Python process
(without tfnng), inspected with saved_model_cli, checked against tfnng.predict within Monte Carlo
error, seeds, bad arguments and the tutorial's smoke run."""

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfnng
from tfnng import serving

NUM_SAMPLES = 200
SEED_A, SEED_B = [3, 14], [15, 92]
REGRESSION_OUTPUTS = ("mean", "variance", "epistemic_variance", "aleatoric_variance", "samples")
CLASSIFIER_OUTPUTS = ("probabilities", "mean", "variance", "samples")


def regression_model():
    """NoisyAdam on a 3-8-1 tanh net with a learned Gamma noise precision (point-estimated)."""
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 3)).astype("float32")
    y = (np.sin(x[:, :1]) + x[:, 1:2] + 0.1 * rng.normal(size=(64, 1))).astype("float32")
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(8, activation="tanh"),
                              keras.layers.Dense(1), tfnng.layers.NoisePrecision(len(x))])
    model.compile(optimizer=tfnng.optimizers.NoisyAdam(learning_rate=1e-2, num_examples=len(x),
                                                       seed=0),
                  loss=tfnng.losses.GaussianNLL("learned"))
    model.fit(x, y, batch_size=16, epochs=5, verbose=0)
    return model, x[:6]


def classifier_model():
    """NoisyKFAC through BayesianModel, covering every sampler: a Dense on rank-3 inputs (matrix-
    variate), a block-tridiagonal chain of two Dense layers, BatchNormalization (diagonal fallback,
    and non-trainable moving statistics)."""
    keras.utils.set_random_seed(1)
    rng = np.random.default_rng(1)
    x = rng.normal(size=(64, 2, 3)).astype("float32")
    flat = x.reshape(len(x), -1)
    y = (flat[:, 0] + flat[:, 1] - flat[:, 2] > 0).astype("int32") + (flat[:, 3] > 1)
    net = keras.Sequential([keras.Input((2, 3)), keras.layers.Dense(4, activation="relu"),
                            keras.layers.Flatten(), keras.layers.BatchNormalization(),
                            keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(3)])
    model = tfnng.BayesianModel(net)
    optimizer = tfnng.optimizers.NoisyKFAC(learning_rate=0.05, num_examples=len(x), stats_every=1,
                                           inverse_every=3, block_tridiagonal=True, seed=1)
    model.compile(optimizer=optimizer, loss=tfnng.losses.CategoricalNLL(), jit_compile=False)
    model.fit(x, y, batch_size=16, epochs=3, verbose=0)
    assert [len(chain) for chain in optimizer._chains] == [2] and len(optimizer._blocks) == 3
    assert optimizer._fallback                                     # BatchNormalization's gamma, beta
    return model, x[:6]


def _state(model):
    """Values of the model's and its optimizer's variables."""
    return [v.numpy().copy() for v in model.variables + model.optimizer.variables]


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """Both models exported (under a global seed, which must not make fresh samples repeat), and
    whether exporting left the model and its optimizer untouched."""
    root = tmp_path_factory.mktemp("exports")
    models = {"regression": (regression_model(), {"outputs": REGRESSION_OUTPUTS}),
              "classifier": (classifier_model(), {"outputs": CLASSIFIER_OUTPUTS})}
    result = {}
    for name, ((model, x), options) in models.items():
        before = _state(model)
        serving.export(model, root / name, num_samples=NUM_SAMPLES, **options)
        untouched = all(np.array_equal(a, b) for a, b in zip(before, _state(model)))
        result[name] = SimpleNamespace(model=model, x=x, path=root / name, untouched=untouched)
    return result


_CHILD = textwrap.dedent("""
    import json, sys
    import numpy as np
    import tensorflow as tf
    spec = json.loads(sys.argv[1])
    results = {}
    for name, (path, x) in spec["models"].items():
        x = np.asarray(x, np.float32)
        model, reloaded = tf.saved_model.load(path), tf.saved_model.load(path)
        seeded, fresh = model.signatures["seeded"], model.signatures["serving_default"]
        run = lambda fn, **kw: {k: v.numpy() for k, v in fn(inputs=tf.constant(x), **kw).items()}
        seed_a, seed_b = (tf.constant(s, tf.int64) for s in (spec["seed_a"], spec["seed_b"]))
        calls = {"a1": run(seeded, seed=seed_a), "a2": run(seeded, seed=seed_a),
                 "b": run(seeded, seed=seed_b), "fresh1": run(fresh), "fresh2": run(fresh),
                 "fresh_reloaded": run(reloaded.signatures["serving_default"])}
        for call, outputs in calls.items():
            for key, value in outputs.items():
                results[f"{name}/{call}/{key}"] = value
    assert "tfnng" not in sys.modules, "the SavedModel needs tfnng"
    np.savez(spec["out"], **results)
""")


@pytest.fixture(scope="module")
def served(exported, tmp_path_factory):
    """Outputs of the exported signatures, called in a fresh Python process that must not need tfnng."""
    work = tmp_path_factory.mktemp("child")
    spec = {"models": {name: [str(e.path), e.x.tolist()] for name, e in exported.items()},
            "seed_a": SEED_A, "seed_b": SEED_B, "out": str(work / "served.npz")}
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["TF_CPP_MIN_LOG_LEVEL"] = "3"
    done = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(spec)], cwd=work, env=env,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    with np.load(work / "served.npz") as data:
        return dict(data)


def _outputs(served, name, call):
    prefix = f"{name}/{call}/"
    return {k[len(prefix):]: v for k, v in served.items() if k.startswith(prefix)}


# ------------------------------------------------------------------------------- saved_model_cli
def _saved_model_cli():
    beside = Path(sys.executable).parent / "saved_model_cli"
    return str(beside) if beside.exists() else shutil.which("saved_model_cli")


def _signature_defs(text):
    """``{signature: {"inputs"|"outputs": {name: (dtype, shape)}}}`` from ``saved_model_cli show --all``."""
    signatures = {}
    for block in re.split(r"\nsignature_def\['", text)[1:]:
        name = block.split("'", 1)[0]
        signatures[name] = {"inputs": {}, "outputs": {}}
        for kind, key, dtype, shape in re.findall(
                r"(inputs|outputs)\['(\w+)'\] tensor_info:\s+dtype: (\w+)\s+shape: ([^\n]+)", block):
            signatures[name][kind][key] = (dtype, shape.strip())
    return signatures


@pytest.mark.parametrize("name", ["regression", "classifier"])
def test_saved_model_cli_lists_both_signatures_with_names_dtypes_and_shapes(exported, name):
    model, path = exported[name].model, exported[name].path
    cli = _saved_model_cli()
    assert cli, "saved_model_cli (installed with tensorflow) not found beside the interpreter"
    done = subprocess.run([cli, "show", "--all", "--dir", str(path)], capture_output=True,
                          text=True, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"})
    assert done.returncode == 0, done.stderr[-3000:]
    signatures = _signature_defs(done.stdout)
    features = ", ".join(str(d) for d in model.input_shape[1:])
    width = 1 if name == "regression" else 3                      # d outputs or K classes
    names = REGRESSION_OUTPUTS if name == "regression" else CLASSIFIER_OUTPUTS
    expected_outputs = {key: ("DT_FLOAT", f"(-1, {NUM_SAMPLES}, {width})" if key == "samples"
                              else f"(-1, {width})") for key in names}
    inputs = {"inputs": ("DT_FLOAT", f"(-1, {features})")}
    assert signatures["serving_default"] == {"inputs": inputs, "outputs": expected_outputs}
    assert signatures["seeded"] == {"inputs": {**inputs, "seed": ("DT_INT64", "(2)")},
                                    "outputs": expected_outputs}


# ------------------------------------------------------------------------------------- seeds
@pytest.mark.parametrize("name", ["regression", "classifier"])
def test_same_seed_reproduces_and_other_or_no_seed_draws_fresh_samples(served, name):
    a1, a2, b = (_outputs(served, name, call) for call in ("a1", "a2", "b"))
    fresh = [_outputs(served, name, call)["samples"] for call in ("fresh1", "fresh2",
                                                                  "fresh_reloaded")]
    for key in a1:
        np.testing.assert_array_equal(a1[key], a2[key])
    draws = [a1["samples"], b["samples"]] + fresh
    for i in range(len(draws)):
        for j in range(i):
            # every weight sample differs (not only some): the seeds are really independent
            assert np.all(np.any(draws[i] != draws[j], axis=(0, 2))), (i, j)


# ------------------------------------------------------------------------ moments vs tfnng.predict
def _mean_tolerance(samples_a, samples_b, axis_a, axis_b, z=5.0):
    """z standard errors of the difference of two independent Monte Carlo means."""
    return z * np.sqrt(samples_a.var(axis=axis_a) / samples_a.shape[axis_a]
                       + samples_b.var(axis=axis_b) / samples_b.shape[axis_b])


def _variance_standard_error(samples, axis):
    """Standard error of the sample variance, sqrt((m4 - m2^2) / S) with central moments m."""
    centred = samples - samples.mean(axis=axis, keepdims=True)
    m2, m4 = (np.mean(centred ** k, axis=axis) for k in (2, 4))
    return np.sqrt((m4 - m2 ** 2) / samples.shape[axis])


def _check_against_predict(served_mean, served_variance, served_samples, prediction_samples,
                           prediction_mean):
    """Served (N, S, d) samples vs tfnng.predict's (S', N, d) samples (independent draws)."""
    np.testing.assert_allclose(served_mean, served_samples.mean(axis=1), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(served_variance, served_samples.var(axis=1), rtol=1e-4, atol=1e-7)
    tolerance = _mean_tolerance(served_samples, prediction_samples, 1, 0)
    assert np.all(np.abs(served_mean - prediction_mean) <= tolerance)
    variance_tolerance = 5.0 * np.hypot(_variance_standard_error(served_samples, 1),
                                        _variance_standard_error(prediction_samples, 0))
    assert np.all(np.abs(served_variance - prediction_samples.var(axis=0)) <= variance_tolerance)
    assert np.all(served_variance > 0)


def test_regression_moments_match_predict_within_monte_carlo_error(exported, served):
    model, x = exported["regression"].model, exported["regression"].x
    out = _outputs(served, "regression", "a1")
    prediction = tfnng.predict(model, x, num_samples=NUM_SAMPLES, return_samples=True)
    _check_against_predict(out["mean"], out["epistemic_variance"], out["samples"],
                           prediction.samples, prediction.mean)
    # aleatoric part: the Student-t variance beta / (alpha - 1) of the point-estimated q(tau)
    q = model.layers[-1].posterior()
    aleatoric = (q.rate / (q.concentration - 1.0)).numpy()
    np.testing.assert_allclose(out["aleatoric_variance"], np.broadcast_to(aleatoric, (len(x), 1)),
                               rtol=1e-5)
    np.testing.assert_allclose(out["variance"], out["epistemic_variance"] + out["aleatoric_variance"],
                               rtol=1e-6)


def test_classifier_moments_match_predict_within_monte_carlo_error(exported, served):
    model, x = exported["classifier"].model, exported["classifier"].x
    out = _outputs(served, "classifier", "a1")
    np.testing.assert_array_equal(out["mean"], out["probabilities"])
    np.testing.assert_allclose(out["mean"].sum(axis=1), 1.0, rtol=1e-5)
    prediction = tfnng.predict(model, x, num_samples=NUM_SAMPLES, return_samples=True)
    _check_against_predict(out["mean"], out["variance"], out["samples"], prediction.samples,
                           prediction.probs)


@pytest.mark.parametrize("name", ["regression", "classifier"])
def test_export_leaves_the_model_and_its_optimizer_untouched(exported, name):
    assert exported[name].untouched


def test_kronecker_family_at_its_initial_posterior_matches_the_closed_form(tmp_path):
    """Before any update noisy K-FAC's factors are zero, so W = M + sqrt(lambda/N) gamma_in^-1/2 E
    = M + sqrt(eta) E: a linear layer's output has mean [x, 1] M and variance eta (|x|^2 + 1).
    Plain K-FAC exports its mean: every sample is the deterministic output."""
    x = np.array([[0.5, -1.0, 2.0], [0.0, 0.3, -0.2]], np.float32)
    num_samples, eta, noise_variance = 2000, 0.25, 0.1
    for optimizer in (tfnng.optimizers.NoisyKFAC(num_examples=50, prior_variance=eta),
                      tfnng.optimizers.KFAC(damping=0.1)):
        keras.utils.set_random_seed(2)
        model = tfnng.BayesianModel(keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)]))
        model.compile(optimizer=optimizer, loss=tfnng.losses.GaussianNLL(noise_variance))
        optimizer.build(model.trainable_variables)
        path = tmp_path / optimizer.name
        serving.export(model, path, num_samples=num_samples)     # outputs mean, variance, samples
        loaded = tf.saved_model.load(str(path))                  # referenced while it is called
        out = loaded.seeded(tf.constant(x), tf.constant(SEED_A, tf.int64))
        samples = out["samples"].numpy()                         # (N, S, 2)
        exact_mean = model.predict(x, verbose=0)
        if optimizer.noise_scale == 0:
            assert np.all(samples == samples[:, :1])                 # one weight value
            np.testing.assert_allclose(samples[:, 0], exact_mean, rtol=1e-6, atol=1e-6)
            np.testing.assert_allclose(out["variance"].numpy(), noise_variance, rtol=1e-4)
            continue
        exact_variance = eta * (np.sum(x ** 2, axis=1, keepdims=True) + 1.0) * np.ones((1, 2))
        tolerance = 5.0 * np.sqrt(exact_variance / num_samples)
        assert np.all(np.abs(out["mean"].numpy() - exact_mean) <= tolerance)
        variance_tolerance = 5.0 * exact_variance * np.sqrt(2.0 / num_samples)  # Gaussian outputs
        epistemic = out["variance"].numpy() - noise_variance
        assert np.all(np.abs(epistemic - exact_variance) <= variance_tolerance)


class _MCDropout(keras.layers.Dropout):
    """Dropout kept on at inference (MC dropout)."""

    def call(self, inputs, training=None):
        return super().call(inputs, training=True)


def test_layers_drawing_random_numbers_at_inference_draw_afresh_for_every_sample(tmp_path):
    """An MC-dropout layer before a linear layer, row i of the inputs the unit vector e_i: sample s of
    output i is m_i w_i + b with a fresh mask m_i in {0, 2} (rate 0.5) per sample, so the predictive
    mean is mu_i + mu_b and its variance mu_i^2 + 2 sigma_i^2 + sigma_b^2 (one mask for every sample
    would give mean 2 mu_i + mu_b or mu_b and variance 4 sigma_i^2 + sigma_b^2 or sigma_b^2)."""
    keras.utils.set_random_seed(4)
    dim, num_samples = 6, 2000
    net = keras.Sequential([keras.Input((dim,)), _MCDropout(0.5),
                            keras.layers.Dense(1, kernel_initializer="ones")])
    optimizer = tfnng.optimizers.NoisyAdam(num_examples=50, prior_variance=0.5)
    net.compile(optimizer=optimizer, loss=tfnng.losses.GaussianNLL(0.1))
    optimizer.build(net.trainable_variables)
    serving.export(net, tmp_path / "mc_dropout", num_samples=num_samples,
                   outputs=("mean", "epistemic_variance"))
    loaded = tf.saved_model.load(str(tmp_path / "mc_dropout"))
    dense = net.layers[-1]
    access = (optimizer.posterior_mean, optimizer.posterior_stddev)
    mu, sigma = (f(dense.kernel).numpy()[:, 0] for f in access)
    mu_b, sigma_b = (f(dense.bias).numpy()[0] for f in access)
    exact_mean, exact_variance = mu + mu_b, mu ** 2 + 2 * sigma ** 2 + sigma_b ** 2
    for seed in (SEED_A, SEED_B):
        out = loaded.seeded(tf.constant(np.eye(dim, dtype=np.float32)), tf.constant(seed, tf.int64))
        mean, variance = out["mean"].numpy()[:, 0], out["epistemic_variance"].numpy()[:, 0]
        assert np.all(np.abs(mean - exact_mean) <= 5.0 * np.sqrt(exact_variance / num_samples))
        np.testing.assert_allclose(variance, exact_variance, rtol=0.2)


# ----------------------------------------------------------------------------------- bad input
def test_bad_arguments_raise_value_error_before_writing(exported, tmp_path):
    regression, classifier = exported["regression"].model, exported["classifier"].model
    path = tmp_path / "never"
    bad = [
        (regression, {"outputs": ("mean", "quantiles")}, "quantiles"),
        (regression, {"outputs": ()}, "outputs"),
        (regression, {"outputs": ("mean", "mean")}, "distinct"),
        (regression, {"outputs": ("probabilities",)}, "regression"),
        (classifier, {"outputs": ("epistemic_variance",)}, "classification"),
        (regression, {"num_samples": 0}, "num_samples"),
        (regression, {"num_samples": -3}, "num_samples"),
        (regression, {"num_samples": 2.5}, "num_samples"),
        (regression, {"num_samples": True}, "num_samples"),
        (regression, {"outputs": None}, "outputs"),                  # TypeError
    ]
    for model, kwargs, message in bad:
        with pytest.raises(ValueError, match=message):
            serving.export(model, path, **kwargs)
    # These wrote into ./None, into the working directory, or merged into an unrelated folder.
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("keep")
    (tmp_path / "file").write_text("keep")
    for bad_path, message in ((None, "must name a directory"), ("", "must name a directory"),
                              (tmp_path / "notes", "other things than a SavedModel"),
                              (tmp_path / "file", "other things than a SavedModel")):
        with pytest.raises(ValueError, match=message):
            serving.export(regression, bad_path)
    assert sorted(p.name for p in (tmp_path / "notes").iterdir()) == ["todo.txt"]
    with pytest.raises(ValueError, match="cannot create the directory"):   # a bare NotFoundError
        serving.export(regression, tmp_path / "file" / "1")

    def net():
        return keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])

    plain = net()
    plain.compile(optimizer="adam", loss=tfnng.losses.GaussianNLL())
    with pytest.raises(ValueError, match="tfnng optimizer.*Adam"):
        serving.export(plain, path)
    with pytest.raises(ValueError, match="serving.export needs a likelihood"):
        serving.export(net(), path)                              # not compiled at all
    inner = net()
    tfnng.BayesianModel(inner).compile(optimizer=tfnng.optimizers.VOGN(num_examples=10),
                                       loss=tfnng.losses.GaussianNLL())
    with pytest.raises(ValueError, match="without an optimizer.*through the BayesianModel"):
        serving.export(inner, path, likelihood=tfnng.losses.GaussianNLL())
    untrained = net()
    untrained.compile(optimizer=tfnng.optimizers.IVON(num_examples=10),
                      loss=tfnng.losses.GaussianNLL())
    with pytest.raises(ValueError, match="IVON has no posterior yet"):
        serving.export(untrained, path)

    class OwnSampler(tfnng.optimizers.NoisyAdam):
        """A posterior whose sampler serving does not know."""

        def _write_sample(self):
            super()._write_sample()

    custom = net()
    custom.compile(optimizer=OwnSampler(num_examples=10), loss=tfnng.losses.GaussianNLL())
    custom.optimizer.build(custom.trainable_variables)
    with pytest.raises(ValueError, match="cannot export the posterior of OwnSampler"):
        serving.export(custom, path)
    assert not path.exists()


@pytest.mark.parametrize("wrapped", [False, True])
def test_an_optimizer_built_for_none_of_the_models_variables_is_refused(wrapped, tmp_path):
    """Keras's legacy HDF5 loader builds the optimizer for no variables: predict and export gave
    every weight sample equal to the current weights (epistemic variance 3e-14) without an error,
    and the KL read 0. A BayesianModel did not load at all ("Unknown layer: 'BayesianModel'": the
    format keeps the bare class name)."""
    x = np.random.default_rng(0).normal(size=(8, 3)).astype("float32")
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    optimizer = tfnng.optimizers.NoisyAdam(1e-2, num_examples=8)
    if wrapped:
        model = tfnng.BayesianModel(model)
        optimizer = tfnng.optimizers.NoisyKFAC(1e-2, num_examples=8)
    model.compile(optimizer=optimizer, loss=tfnng.losses.GaussianNLL())
    model.fit(x, x[:, :1], batch_size=4, epochs=1, verbose=0)
    model.save(tmp_path / "m.h5")
    legacy = keras.models.load_model(tmp_path / "m.h5")
    assert type(legacy) is type(model) and type(legacy.optimizer) is type(optimizer)
    assert legacy.optimizer.built and not legacy.optimizer._trainable_variables
    for use in (lambda: tfnng.predict(legacy, x, num_samples=4),
                lambda: serving.export(legacy, tmp_path / "served"),
                legacy.optimizer.kl_divergence, legacy.optimizer.posterior,
                legacy.optimizer.sample_weights):
        with pytest.raises(ValueError, match="built for no variables.*legacy HDF5"):
            use()
    assert tfnng.predict(model, x, num_samples=4).epistemic_variance.min() > 1e-8


def test_an_optimizer_built_for_another_model_is_refused():
    x = np.random.default_rng(0).normal(size=(8, 3)).astype("float32")
    first, second = (keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)], name=name)
                     for name in ("first", "second"))
    first.compile(optimizer=tfnng.optimizers.Vadam(1e-2, num_examples=8),
                  loss=tfnng.losses.GaussianNLL())
    first.optimizer.build(first.trainable_variables)
    second.compile(optimizer=first.optimizer, loss=tfnng.losses.GaussianNLL())
    with pytest.raises(ValueError, match="none of the variables of model 'second'.*another model"):
        tfnng.predict(second, x, num_samples=4)


@pytest.mark.parametrize("make_optimizer", [
    lambda n: tfnng.optimizers.SLANG(learning_rate=1e-2, num_examples=n, rank=3, seed=2),
    lambda n: tfnng.optimizers.NoisyNaturalGradient(learning_rate=1e-2, num_examples=n, seed=2)])
def test_flat_families_serve_their_correlated_posterior(make_optimizer, tmp_path):
    """SLANG and NNG-full: served moments match tfnng.predict within Monte Carlo error."""
    rng = np.random.default_rng(3)
    x = rng.normal(size=(40, 3)).astype("float32")
    y = (x @ np.array([[1.0], [-1.0], [0.5]]) + 0.3 * rng.normal(size=(40, 1))).astype("float32")
    net = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4, activation="tanh"),
                            keras.layers.Dense(1)])
    model = tfnng.BayesianModel(net)
    model.compile(optimizer=make_optimizer(len(x)), loss=tfnng.losses.GaussianNLL(0.1))
    model.fit(x, y, batch_size=10, epochs=2, verbose=0)
    serving.export(model, tmp_path / "flat", num_samples=NUM_SAMPLES,
                   outputs=("mean", "epistemic_variance", "samples"))
    out = {k: v.numpy() for k, v in tf.saved_model.load(str(tmp_path / "flat")).signatures[
        "seeded"](inputs=tf.constant(x[:6]), seed=tf.constant([1, 2], tf.int64)).items()}
    prediction = tfnng.predict(model, x[:6], num_samples=NUM_SAMPLES, return_samples=True)
    _check_against_predict(out["mean"], out["epistemic_variance"], out["samples"],
                           prediction.samples, prediction.mean)


FAMILIES = {
    "kfac": lambda n: tfnng.optimizers.NoisyKFAC(learning_rate=1e-2, num_examples=n, stats_every=1,
                                                 inverse_every=2, seed=2),
    "blktri": lambda n: tfnng.optimizers.NoisyKFAC(learning_rate=1e-2, num_examples=n,
                                                   stats_every=1, inverse_every=2,
                                                   block_tridiagonal=True, seed=2),
    "slang": lambda n: tfnng.optimizers.SLANG(learning_rate=1e-2, num_examples=n, rank=3, seed=2),
    "nng_full": lambda n: tfnng.optimizers.NoisyNaturalGradient(learning_rate=1e-2, num_examples=n,
                                                                seed=2),
}


def test_a_point_estimate_is_served_at_its_current_value(tmp_path):
    """As in tfnng.predict: q(tau) set by hand after training (alpha 50, beta 5) is served, not the
    optimizer's copy of the value it had at the last step."""
    model, x = regression_model()
    model.layers[-1].log_parameters.assign(np.log([[50.0], [5.0]]))
    serving.export(model, tmp_path / "m", num_samples=NUM_SAMPLES, outputs=("aleatoric_variance",))
    served = tf.saved_model.load(str(tmp_path / "m")).signatures["seeded"](
        inputs=tf.constant(x), seed=tf.constant(SEED_A, tf.int64))["aleatoric_variance"].numpy()
    np.testing.assert_allclose(served, 5.0 / 49.0, rtol=1e-5)
    np.testing.assert_allclose(tfnng.predict(model, x, num_samples=4).aleatoric_variance, 5.0 / 49.0,
                               rtol=1e-5)


def test_an_output_in_a_one_entry_dict_is_served(tmp_path):
    """A functional model whose one output is named in a dict (export said "needs a model with one
    output tensor"); its served moments are those of the same model with a bare output."""
    x = np.random.default_rng(0).normal(size=(5, 3)).astype("float32")
    served = []
    for named in (False, True):
        keras.utils.set_random_seed(0)
        inputs = keras.Input((3,))
        outputs = keras.layers.Dense(1, name="out")(inputs)
        model = keras.Model(inputs, {"out": outputs} if named else outputs)
        model.compile(optimizer=tfnng.optimizers.NoisyAdam(num_examples=10),
                      loss=tfnng.losses.GaussianNLL(0.1))
        model.optimizer.build(model.trainable_variables)
        path = tmp_path / f"named_{named}"
        serving.export(model, path, num_samples=NUM_SAMPLES, outputs=("mean", "variance"))
        served.append(tf.saved_model.load(str(path)).signatures["seeded"](
            inputs=tf.constant(x), seed=tf.constant(SEED_A, tf.int64)))
    for name in ("mean", "variance"):
        np.testing.assert_array_equal(served[0][name].numpy(), served[1][name].numpy())


def _trained_bayesian_model(optimizer):
    """A 3-4-4-1 tanh net in a BayesianModel, trained two epochs with ``optimizer``."""
    keras.utils.set_random_seed(3)
    rng = np.random.default_rng(3)
    x = rng.normal(size=(40, 3)).astype("float32")
    y = (x @ np.array([[1.0], [-1.0], [0.5]]) + 0.3 * rng.normal(size=(40, 1))).astype("float32")
    net = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4, activation="tanh"),
                            keras.layers.Dense(4, activation="tanh"), keras.layers.Dense(1)])
    model = tfnng.BayesianModel(net)
    model.compile(optimizer=optimizer, loss=tfnng.losses.GaussianNLL(0.1))
    model.fit(x, y, batch_size=10, epochs=2, verbose=0)
    return model, net, x


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_layer_frozen_after_training_is_served_at_its_value(family, tmp_path):
    """The joint samplers used to look the frozen layer's variables up among the model's trainable
    ones (KeyError at export); now its part of each draw is discarded, as in tfnng.predict."""
    model, net, x = _trained_bayesian_model(FAMILIES[family](40))
    net.layers[1].trainable = False
    serving.export(model, tmp_path / family, num_samples=NUM_SAMPLES,
                   outputs=("mean", "epistemic_variance", "samples"))
    out = {k: v.numpy() for k, v in tf.saved_model.load(str(tmp_path / family)).signatures[
        "seeded"](inputs=tf.constant(x[:6]), seed=tf.constant([1, 2], tf.int64)).items()}
    prediction = tfnng.predict(model, x[:6], num_samples=NUM_SAMPLES, return_samples=True)
    _check_against_predict(out["mean"], out["epistemic_variance"], out["samples"],
                           prediction.samples, prediction.mean)


@pytest.mark.parametrize("family", sorted(FAMILIES) + ["vogn"])
def test_sample_weights_and_use_mean_leave_a_layer_frozen_after_training_alone(family):
    """They used to write a draw, and the mean, into the frozen layer too."""
    make = FAMILIES.get(family) or (lambda n: tfnng.optimizers.VOGN(learning_rate=1e-2,
                                                                     num_examples=n, seed=2))
    model, net, x = _trained_bayesian_model(make(40))
    optimizer = model.optimizer
    net.layers[1].trainable = False
    frozen = [v.numpy() for v in net.layers[1].weights]
    others = [v.numpy() for v in net.layers[0].weights + net.layers[2].weights]
    optimizer.sample_weights()
    for variable, value in zip(net.layers[1].weights, frozen):
        np.testing.assert_array_equal(variable.numpy(), value)
    assert all(not np.array_equal(v.numpy(), value)
               for v, value in zip(net.layers[0].weights + net.layers[2].weights, others))
    with optimizer.use_mean():
        for variable, value in zip(net.layers[1].weights, frozen):
            np.testing.assert_array_equal(variable.numpy(), value)
        np.testing.assert_array_equal(net.layers[0].kernel.numpy(),
                                      optimizer.posterior_mean(net.layers[0].kernel).numpy())


@pytest.mark.parametrize("family", ["kfac", "slang"])
def test_subclasses_with_their_own_sampler_are_refused_in_every_family(family, tmp_path):
    """Only diagonal-family subclasses used to be checked: a NoisyKFAC or SLANG subclass with its
    own sampler was exported with its base class's sampler, serving another predictive."""
    base = type(FAMILIES[family](40))

    class OwnSampler(base):
        def _write_sample(self):
            super()._write_sample()

    model, _, _ = _trained_bayesian_model(
        OwnSampler(learning_rate=1e-2, num_examples=40, seed=2))
    with pytest.raises(ValueError, match="OwnSampler: it overrides _write_sample of "):
        serving.export(model, tmp_path / "never")
    assert not (tmp_path / "never").exists()


# ------------------------------------------------------------------------------------- tutorial
def test_tutorial_smoke(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location(
        "serving_tutorial", Path(__file__).parents[1] / "tutorials" / "serving.py")
    tutorial = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tutorial)
    result = tutorial.main(["--smoke", "--out", str(tmp_path)])
    printed = capsys.readouterr().out
    request = json.loads((tmp_path / "request.json").read_text())
    rows = np.asarray(request["inputs"]["inputs"])
    assert request["signature_name"] == "serving_default" and rows.shape == (3, 10)
    np.testing.assert_allclose(rows, tutorial.make_data()[2][:3], rtol=1e-5, atol=1e-6)  # real data
    np.testing.assert_array_equal(result["x"], rows.astype("float32"))
    for key in ("mean", "variance", "samples"):
        assert np.all(np.isfinite(result["served"][key])), key
    assert result["served"]["mean"].shape == (3, 1)
    np.testing.assert_array_equal(result["seeded"][0]["samples"], result["seeded"][1]["samples"])
    export_base = str(tmp_path.resolve() / "diabetes")
    assert (tmp_path / "diabetes" / "1" / "saved_model.pb").exists()
    assert "docker run -p 8501:8501" in printed and f"source={export_base}" in printed
    assert "tensorflow/serving" in printed and "curl" in printed and "request.json" in printed


def test_inputs_are_served_in_keras_float_type(float64_keras, tmp_path):
    """Under floatx float64 Keras feeds the model float64 inputs; the signature took float32 and
    rounded them (1e8 + 1, 1e8 + 2 and 1e8 + 3 were served one output)."""
    x = np.random.default_rng(0).normal(size=(32, 1))
    model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1)])
    model.compile(optimizer=tfnng.optimizers.NoisyAdam(1e-2, num_examples=32, seed=1),
                  loss=tfnng.losses.GaussianNLL(noise_variance=0.5))
    model.fit(x, 2 * x, batch_size=8, epochs=1, verbose=0)
    serving.export(model, tmp_path / "f64", num_samples=2, outputs=("samples",))
    seeded = tf.saved_model.load(str(tmp_path / "f64")).signatures["seeded"]
    inputs = np.array([[1e8 + 1.0], [1e8 + 2.0], [1e8 + 3.0]])
    samples = seeded(inputs=tf.constant(inputs), seed=tf.constant([1, 2], tf.int64))["samples"]
    steps = np.diff(samples.numpy()[:, 0, 0])        # one weight sample: w (x + 1) - w x = w
    assert steps.dtype == np.float64 and np.all(np.abs(steps) > 0)
    np.testing.assert_allclose(steps[0], steps[1], rtol=1e-6)


class Offset(keras.layers.Layer):
    """Adds a constant held in a plain ``tf.Variable`` (state outside Keras's variables)."""

    def build(self, input_shape):
        self.offset = tf.Variable(2.0, trainable=False)

    def call(self, x):
        return x + self.offset


def test_the_signature_takes_the_models_declared_input_dtype_and_keeps_its_lookup_tables(tmp_path):
    """Integer ids were served as float32 (1e8 + 1, + 2 and + 3 all became 1e8), and a model
    holding TensorFlow state outside Keras variables (IntegerLookup's hash table, a plain
    tf.Variable) failed to export ("Tried to export a function which references an 'untracked'
    resource")."""
    ids = np.array([[100_000_001], [100_000_002], [100_000_003]], np.int64)
    targets = np.array([[-2.0], [0.0], [2.0]], np.float32)
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((1,), dtype="int64"),
                              keras.layers.IntegerLookup(vocabulary=ids.ravel()),
                              keras.layers.Embedding(4, 4), keras.layers.Flatten(),
                              keras.layers.Dense(1), Offset()])
    model.compile(optimizer=tfnng.optimizers.NoisyAdam(learning_rate=0.05, num_examples=48, seed=0),
                  loss=tfnng.losses.GaussianNLL(0.01))
    model.fit(np.repeat(ids, 16, axis=0), np.repeat(targets, 16, axis=0), batch_size=16,
              epochs=60, verbose=0)
    serving.export(model, tmp_path / "ids", num_samples=NUM_SAMPLES, outputs=("mean",))
    seeded = tf.saved_model.load(str(tmp_path / "ids")).signatures["seeded"]
    assert seeded.structured_input_signature[1]["inputs"].dtype == tf.int64
    served = seeded(inputs=tf.constant(ids), seed=tf.constant(SEED_A, tf.int64))["mean"].numpy()
    np.testing.assert_allclose(served, targets, atol=0.3)
    np.testing.assert_allclose(served, tfnng.predict(model, ids, num_samples=NUM_SAMPLES).mean,
                               atol=0.1)


def test_a_declared_float64_input_is_served_in_float64_under_a_float32_floatx(tmp_path):
    """A model declared with keras.Input(dtype="float64") and float64 layers was served float32."""
    x = np.random.default_rng(0).normal(size=(32, 1))
    model = keras.Sequential([keras.Input((1,), dtype="float64"),
                              keras.layers.Dense(1, dtype="float64")])
    model.compile(optimizer=tfnng.optimizers.NoisyAdam(1e-2, num_examples=32, seed=1),
                  loss=tfnng.losses.GaussianNLL(noise_variance=0.5))
    model.fit(x, 2 * x, batch_size=8, epochs=1, verbose=0)
    serving.export(model, tmp_path / "f64", num_samples=1, outputs=("samples",))
    seeded = tf.saved_model.load(str(tmp_path / "f64")).signatures["seeded"]
    inputs = tf.constant([[1e8 + 1.0], [1e8 + 2.0], [1e8 + 3.0]], tf.float64)
    samples = seeded(inputs=inputs, seed=tf.constant([1, 2], tf.int64))["samples"].numpy()
    steps = np.diff(samples[:, 0, 0])                 # w (x + 1) - w x = w
    assert np.all(np.abs(steps) > 0)
    np.testing.assert_allclose(steps[0], steps[1], rtol=1e-6)
