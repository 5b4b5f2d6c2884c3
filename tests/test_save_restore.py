"""Save / restore / resume with nothing lost (docs/saving.md).

For every tfnng optimizer: ``model.save`` + ``keras.models.load_model`` (no ``custom_objects``; also in
a fresh Python process) and ``tf.train.Checkpoint`` restore the optimizer config and every optimizer
variable (posterior means, curvature statistics, Kronecker factors and inverses, counters, the
weight-noise RNG state) bit for bit, and one more training step from the original and from each
restored model gives identical weights. ``keras.callbacks.BackupAndRestore``: training interrupted
mid-epoch and resumed reproduces the uninterrupted posterior bit for bit (NoisyAdam with the true
Fisher and NoisyKFAC, through ``tfnng.BayesianModel``, whose true-Fisher target sampler is restored
too).

To cover a new optimizer, add one line to ``OPTIMIZERS`` (factory of ``num_examples``, compiled loss):
it is trained inside ``tfnng.BayesianModel`` when it declares ``curvature_requirements``.

Speed: most runs are eager (``run_eagerly=True``): tracing a training function costs far more than
the few steps taken here, and what is saved does not depend on it. The resume of noisy K-FAC from
epoch backups runs compiled, the way users train.
"""

import copy
import json
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path

import keras
import numpy as np
import pytest
import tensorflow as tf
import tensorflow_probability as tfp

import tfnng

PROJECT_ROOT = Path(__file__).parents[1]
opt = tfnng.optimizers
decay = keras.optimizers.schedules.ExponentialDecay(1e-2, decay_steps=2, decay_rate=0.5)

OPTIMIZERS = [
    pytest.param(lambda n: opt.NoisyAdam(1e-2, num_examples=n, seed=1), "gaussian_learned",
                 id="noisy_adam"),
    pytest.param(lambda n: opt.NoisyAdam(1e-2, num_examples=n, fisher="true", seed=1), "bernoulli",
                 id="noisy_adam_true_fisher"),
    pytest.param(lambda n: opt.Vadam(decay, num_examples=n, seed=1), "categorical",
                 id="vadam_schedule"),
    pytest.param(lambda n: opt.Vprop(1e-2, num_examples=n), "gaussian_fixed", id="vprop_unseeded"),
    pytest.param(lambda n: opt.VadaGrad(1e-2, num_examples=n, seed=1), "gaussian_learned",
                 id="vadagrad"),
    pytest.param(lambda n: opt.IVON(1e-2, num_examples=n, mc_samples=2, seed=1), "gaussian_learned",
                 id="ivon_mc2"),
    pytest.param(lambda n: opt.NoisyKFAC(1e-2, num_examples=n, stats_every=1, inverse_every=2,
                                         momentum=0.5, seed=1), "categorical", id="noisy_kfac"),
    pytest.param(lambda n: opt.NoisyKFAC(1e-2, num_examples=n, stats_every=1, inverse_every=2,
                                         block_tridiagonal=True, mc_samples=2, seed=1),
                 "gaussian_learned", id="noisy_kfac_blocktri_mc2"),
    pytest.param(lambda n: opt.KFAC(1e-2, stats_every=1, inverse_every=2), "gaussian_fixed",
                 id="kfac"),
    pytest.param(lambda n: opt.VOGN(1e-2, num_examples=n, momentum=0.5, seed=1), "gaussian_learned",
                 id="vogn"),
    pytest.param(lambda n: opt.SLANG(1e-2, num_examples=n, rank=2, seed=1), "categorical",
                 id="slang"),
    pytest.param(lambda n: opt.NoisyNaturalGradient(1e-2, num_examples=n, seed=1), "bernoulli",
                 id="noisy_natural_gradient"),
]

CASES = {param.id: param.values for param in OPTIMIZERS}

LOSSES = {
    "gaussian_fixed": lambda: tfnng.losses.GaussianNLL(noise_variance=0.5),
    "gaussian_learned": lambda: tfnng.losses.GaussianNLL("learned"),
    "categorical": tfnng.losses.CategoricalNLL,
    "bernoulli": tfnng.losses.BernoulliNLL,
}

BATCH = 8


def dataset(loss_name, n=24):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, 3)).astype("float32")
    score = x @ np.array([1.0, -2.0, 0.5], "float32")
    if loss_name == "categorical":
        return x, np.digitize(score, [-1.0, 1.0]).astype("int32")
    if loss_name == "bernoulli":
        return x, (score > 0).astype("float32")[:, None]
    return x, (score + 0.3 * rng.normal(size=n)).astype("float32")[:, None]


def build_model(optimizer, loss_name, num_examples, run_eagerly=True):
    """A compiled tiny model, wrapped in ``tfnng.BayesianModel`` when the optimizer needs curvature.

    Its BatchNormalization layer (moving statistics; K-FAC's diagonal fallback) is left out for
    optimizers that need per-example gradients of every layer: its generic per-example path
    (``tf.vectorized_map``, retraced at every eager step) would dominate the test time.
    """
    keras.utils.set_random_seed(0)
    requirements = getattr(optimizer, "curvature_requirements", None)
    outputs = {"categorical": 3}.get(loss_name, 1)
    layers = [keras.Input((3,)), keras.layers.Dense(4, activation="tanh"),
              keras.layers.BatchNormalization(), keras.layers.Dense(outputs)]
    if getattr(requirements, "per_example_gradients", False):
        del layers[2]
    if loss_name == "gaussian_learned":
        layers.append(tfnng.layers.NoisePrecision(num_examples))
    model = keras.Sequential(layers)
    if requirements is not None:
        model = tfnng.BayesianModel(model)
    model.compile(optimizer=optimizer, loss=LOSSES[loss_name](), run_eagerly=run_eagerly,
                  jit_compile=False)
    return model


def train(model, x, y, epochs=1, **kwargs):
    model.fit(x, y, batch_size=BATCH, epochs=epochs, shuffle=False, verbose=0, **kwargs)


def trained(make_optimizer, loss_name, run_eagerly=True):
    x, y = dataset(loss_name)
    model = build_model(make_optimizer(len(x)), loss_name, len(x), run_eagerly)
    train(model, x, y)          # 3 steps: mid Monte Carlo group for mc_samples=2
    if not isinstance(model.optimizer, opt.KFAC):     # K-FAC draws no weight noise
        assert model.optimizer._seed_generator.state.numpy()[1] > 0, "no weight noise drawn"
    requirements = getattr(model.optimizer, "curvature_requirements", None)
    if getattr(requirements, "fisher", None) == "true":
        assert fisher_seed_state(model)[1] > 0, "no true-Fisher targets drawn"
    return model, x, y


def fisher_seed_state(model):
    seed = getattr(model, "_fisher_seed", None)
    return None if seed is None else seed.state.numpy()


def assert_same_state(model, restored):
    """Optimizer variables, model weights and the true-Fisher seed are equal bit for bit."""
    original_vars, restored_vars = model.optimizer.variables, restored.optimizer.variables
    assert len(restored_vars) == len(original_vars)
    for a, b in zip(original_vars, restored_vars):
        assert (a.shape, a.dtype) == (b.shape, b.dtype), (a.path, b.path)
        np.testing.assert_array_equal(b.numpy(), a.numpy(), err_msg=a.path)
    assert len(restored.weights) == len(model.weights)
    for a, b in zip(model.weights, restored.weights):
        np.testing.assert_array_equal(b.numpy(), a.numpy(), err_msg=a.path)
    np.testing.assert_array_equal(fisher_seed_state(restored), fisher_seed_state(model))


def assert_same_posterior(model, restored):
    optimizer, other = model.optimizer, restored.optimizer
    for a, b in zip(model.trainable_variables, restored.trainable_variables):
        np.testing.assert_array_equal(other.posterior_mean(b).numpy(),
                                      optimizer.posterior_mean(a).numpy(), err_msg=a.path)
        np.testing.assert_array_equal(other.posterior_stddev(b).numpy(),
                                      optimizer.posterior_stddev(a).numpy(), err_msg=a.path)
    np.testing.assert_array_equal(other.kl_divergence().numpy(), optimizer.kl_divergence().numpy())


def assert_round_trip(model, restored_models, x, y):
    """Same classes, configs, state and posterior; then one more step from the original and from
    every restored model gives identical state (so the RNG states were restored too)."""
    for restored in restored_models:
        assert type(restored) is type(model)
        assert type(restored.optimizer) is type(model.optimizer)
        assert restored.optimizer.get_config() == model.optimizer.get_config()
        assert type(restored.loss) is type(model.loss)
        assert {**restored.loss.get_config(), "name": None} == {**model.loss.get_config(),
                                                                 "name": None}
        assert_same_state(model, restored)
        assert_same_posterior(model, restored)
    before = [w.numpy() for w in model.trainable_weights]
    for each in [model, *restored_models]:
        train(each, x[:BATCH], y[:BATCH])
    assert any(not np.array_equal(a, w.numpy()) for a, w in zip(before, model.trainable_weights))
    for restored in restored_models:
        assert_same_state(model, restored)


@pytest.mark.parametrize("make_optimizer, loss_name", OPTIMIZERS)
def test_keras_file_and_tf_checkpoint_round_trips(make_optimizer, loss_name, tmp_path):
    model, x, y = trained(make_optimizer, loss_name)
    model.save(tmp_path / "m.keras")
    from_file = keras.models.load_model(tmp_path / "m.keras")      # no custom_objects
    assert from_file.loss.get_config() == model.loss.get_config()
    path = tf.train.Checkpoint(model=model, optimizer=model.optimizer).save(tmp_path / "ckpt")
    from_checkpoint = build_model(make_optimizer(len(x)), loss_name, len(x))
    from_checkpoint.optimizer.build(from_checkpoint.trainable_variables)   # variables must exist
    status = tf.train.Checkpoint(model=from_checkpoint,
                                 optimizer=from_checkpoint.optimizer).restore(path)
    status.assert_existing_objects_matched()
    assert_round_trip(model, [from_file, from_checkpoint], x, y)


def test_a_saved_posterior_that_does_not_fit_is_an_error_not_a_silent_reset(tmp_path):
    """Keras matches optimizer variables by count and, on a mismatch, only warns and skips them:
    the posterior would restart from the weight sample. tfnng raises instead (optimizer not built
    before ``load_weights``; a layer frozen, or a variable marked, outside what was saved; the state
    of another tfnng optimizer with the same shapes, which loaded silently), and a model saved
    before its first step resumes exactly (counters and noise generator restored)."""
    make = lambda n: opt.NoisyAdam(1e-2, num_examples=n, seed=1)
    model, x, y = trained(make, "gaussian_fixed")
    model.save_weights(tmp_path / "m.weights.h5")
    fresh = build_model(make(len(x)), "gaussian_fixed", len(x))
    with pytest.raises(ValueError, match=r"not built yet.*model.optimizer.build"):
        fresh.load_weights(tmp_path / "m.weights.h5")
    fresh.optimizer.build(fresh.trainable_variables)
    fresh.load_weights(tmp_path / "m.weights.h5")
    assert_same_state(model, fresh)

    marked = build_model(make(len(x)), "gaussian_fixed", len(x))
    tfnng.mark_point_estimate(marked.layers[-1].bias)           # not in a layer's build: not saved
    train(marked, x, y)
    marked.save(tmp_path / "marked.keras")
    with pytest.raises(ValueError, match="mark_point_estimate"):
        keras.models.load_model(tmp_path / "marked.keras")

    model.layers[0].trainable = False                            # frozen after the optimizer's build
    model.save(tmp_path / "frozen.keras")
    with pytest.raises(ValueError, match="made trainable before saving"):
        keras.models.load_model(tmp_path / "frozen.keras")

    pretrained = keras.models.clone_model(model)                # same layers, Keras Adam
    pretrained.compile(optimizer="adam", loss="mse")
    pretrained.fit(x, y, batch_size=16, epochs=1, verbose=0)
    pretrained.save_weights(tmp_path / "adam.weights.h5")     # another optimizer's state
    fresh = build_model(make(len(x)), "gaussian_fixed", len(x))
    with pytest.raises(ValueError, match="another optimizer's state.*skip_mismatch=True"):
        fresh.load_weights(tmp_path / "adam.weights.h5")
    fresh.load_weights(tmp_path / "adam.weights.h5", skip_mismatch=True)   # the advice works
    for loaded, saved in zip(fresh.get_weights(), pretrained.get_weights()):
        np.testing.assert_array_equal(loaded, saved)
    # Keras SGD keeps two variables, fewer than a built tfnng optimizer (a KeyError '2'), as many
    # as an unbuilt one with a schedule (taken for a state saved before the first step, its
    # learning rate assigned to the noise seed).
    pretrained.compile(optimizer="sgd", loss="mse")
    pretrained.fit(x, y, batch_size=16, epochs=1, verbose=0)
    pretrained.save_weights(tmp_path / "sgd.weights.h5")
    for optimizer in (make(len(x)), opt.Vadam(decay, num_examples=len(x), seed=1)):
        fresh = build_model(optimizer, "gaussian_fixed", len(x))
        train(fresh, x, y)
        state = [v.numpy() for v in fresh.optimizer.variables]
        with pytest.raises(ValueError, match="another optimizer's state.*skip_mismatch=True"):
            fresh.load_weights(tmp_path / "sgd.weights.h5")
        for variable, value in zip(fresh.optimizer.variables, state):   # nothing half-restored
            np.testing.assert_array_equal(variable, value)

    vadam = build_model(opt.Vadam(1e-2, num_examples=len(x), seed=1), "gaussian_fixed", len(x))
    train(vadam, x, y)                           # the same count and shapes of variables as IVON's
    vadam.save_weights(tmp_path / "vadam.weights.h5")
    ivon = build_model(opt.IVON(1e-2, num_examples=len(x), seed=1), "gaussian_fixed", len(x))
    train(ivon, x, y)
    shapes = [[v.shape for v in m.optimizer.variables] for m in (ivon, vadam)]
    assert shapes[0] == shapes[1]
    state = [v.numpy() for v in ivon.optimizer.variables]
    with pytest.raises(ValueError, match="state is Vadam's, this optimizer is IVON"):
        ivon.load_weights(tmp_path / "vadam.weights.h5")
    for variable, value in zip(ivon.optimizer.variables, state):
        np.testing.assert_array_equal(variable, value)

    wider = keras.Sequential([keras.Input(x.shape[1:]), keras.layers.Dense(5, activation="tanh"),
                              keras.layers.BatchNormalization(), keras.layers.Dense(1)])
    wider.compile(optimizer=make(len(x)), loss=LOSSES["gaussian_fixed"]())
    train(wider, x, y)
    wider.save_weights(tmp_path / "wider.weights.h5")             # as many variables, other shapes
    for skip_mismatch in (False, True):
        fresh = build_model(make(len(x)), "gaussian_fixed", len(x))
        train(fresh, x, y)
        state = [v.numpy() for v in fresh.optimizer.variables]
        with (pytest.warns(UserWarning, match="could not be loaded") if skip_mismatch
              else pytest.raises(ValueError, match="could not be loaded")):
            fresh.load_weights(tmp_path / "wider.weights.h5", skip_mismatch=skip_mismatch)
        for variable, value in zip(fresh.optimizer.variables, state):   # nothing half-restored
            np.testing.assert_array_equal(variable, value)

    untrained = build_model(make(len(x)), "gaussian_fixed", len(x))
    untrained.save(tmp_path / "untrained.keras")
    loaded = keras.models.load_model(tmp_path / "untrained.keras")
    for each in (untrained, loaded):
        train(each, x, y)
    assert_same_state(untrained, loaded)


@pytest.mark.parametrize("make, saved, cause", [
    (opt.NoisyAdam, dict(mc_samples=2), r"has 37 variables, this optimizer has 24: it was saved by "
                                        r"NoisyAdam constructed otherwise: mc_samples was 2 when "
                                        r"saved, it is 1 here \(construct the optimizer as it was"),
    (opt.NoisyAdam, dict(learning_rate=decay), r"learning rate was a schedule or callable when "
                                               r"saved, it is a number here"),
    (opt.NoisyAdam, dict(policy="mixed_float16"), r"it holds no tfnng optimizer's name: it may be "
                                                  r"a LossScaleOptimizer's \(saved under the "
                                                  r"'mixed_float16'"),
    (opt.VOGN, dict(momentum=0.5), r"momentum was 0.5 when saved, it is 0.0 here"),
    (opt.SLANG, dict(rank=3), r"does not fit this model's: it was saved by SLANG constructed "
                              r"otherwise: rank was 3 when saved, it is 2 here"),    # shapes differ
])
def test_a_state_saved_with_other_settings_names_them(make, saved, cause, tmp_path):
    """A state that does not fit because the optimizer was constructed otherwise is refused with
    the settings that differ (the message used to suggest frozen layers and marks, or other layer
    sizes); so is the state of a LossScaleOptimizer loaded without it."""
    def trained_with(policy="float32", **settings):
        previous = keras.mixed_precision.global_policy()
        keras.mixed_precision.set_global_policy(policy)
        try:
            settings = {"learning_rate": 1e-2, "num_examples": len(x), "seed": 1,
                        **({"rank": 2} if make is opt.SLANG else {}), **settings}
            model = build_model(make(**settings), "gaussian_fixed", len(x))
            train(model, x, y)
        finally:
            keras.mixed_precision.set_global_policy(previous)
        return model

    x, y = dataset("gaussian_fixed")
    trained_with(**saved).save_weights(tmp_path / "m.weights.h5")
    model = trained_with()
    state = [v.numpy() for v in model.optimizer.variables]
    with pytest.raises(ValueError, match=cause):
        model.load_weights(tmp_path / "m.weights.h5")
    for variable, value in zip(model.optimizer.variables, state):        # nothing half-restored
        np.testing.assert_array_equal(variable, value)


def test_a_trained_optimizer_copied_alone_says_to_copy_the_model():
    """copy.deepcopy and pickle of an optimizer go through Keras's saving, which rebuilds it
    without the model's variables: refused with that said (the message gave load_weights advice);
    the model copies with its posterior."""
    model, x, y = trained(*CASES["noisy_adam"])
    for copy_of in (copy.deepcopy, lambda each: pickle.loads(pickle.dumps(each))):
        with pytest.raises(ValueError, match=r"not built yet.*does not copy or pickle on its own.*"
                                             r"copy or pickle the model"):
            copy_of(model.optimizer)
    copied = pickle.loads(pickle.dumps(model))
    assert_same_state(model, copied)
    assert_same_posterior(model, copied)


@pytest.mark.parametrize("name, settings", [
    ("noisy_kfac", ["stats_every", "inverse_every", "momentum", "block_tridiagonal", "kl_weight"]),
    ("slang", ["rank", "beta", "extrinsic_damping"]),
    ("vogn", ["momentum", "fisher"])])
def test_hyper_parameters_of_a_built_curvature_optimizer_are_fixed(name, settings):
    """As for the diagonal optimizers (test_optimizer_api): a compiled step keeps the values it
    was traced with, so assigning them after the build is refused."""
    model, _, _ = trained(*CASES[name])
    for setting in settings:
        value = getattr(model.optimizer, setting)
        with pytest.raises(AttributeError, match=f"{setting} cannot change once the optimizer is "
                                                 "built.*from_config.*save_weights"):
            setattr(model.optimizer, setting, value)
        assert getattr(model.optimizer, setting) is value


def dense_posterior(optimizer):
    """Mean and dense covariance (float64) of ``optimizer.posterior()``, one pair per part."""
    posterior = optimizer.posterior()
    parts = posterior.model.values() if hasattr(posterior, "model") else [posterior]
    pairs = []
    for part in parts:
        mean = np.ravel(part.mean().numpy()).astype(np.float64)
        if isinstance(part, tfp.distributions.Independent):
            covariance = np.diag(np.ravel(part.stddev().numpy()).astype(np.float64) ** 2)
        else:
            covariance = part.covariance().numpy().astype(np.float64)
        pairs.append((mean, covariance))
    return pairs


def dense_kl(pairs, prior_variance):
    """KL(N(m, C) || N(0, eta I)) summed over the parts, from dense matrices."""
    return sum(0.5 * (np.trace(c) / prior_variance + m @ m / prior_variance - len(m)
                      - np.linalg.slogdet(c)[1] + len(m) * np.log(prior_variance))
               for m, c in pairs)


@pytest.mark.parametrize("name", ["noisy_kfac", "slang", "noisy_natural_gradient", "vogn"])
def test_the_state_loaded_into_other_settings_is_the_posterior_of_those_settings(name, tmp_path):
    """The recipe of docs/which_optimizer.md (save, a new optimizer with another kl_weight, build,
    load) gives the posterior of the loaded curvature under the new settings, and kl_divergence()
    is its KL: K-FAC's cached inverses and KL constant, SLANG's diagonal (it holds gamma_in) and
    NNG-full's Cholesky factor kept the old settings' damping until their next recomputation (up
    to inverse_every steps for K-FAC, thousands of beta-averaged updates for SLANG)."""
    model, x, y = trained(*CASES[name])
    old = model.optimizer
    old_pairs = dense_posterior(old)
    model.save_weights(tmp_path / "trained.weights.h5")
    new = type(old).from_config({**old.get_config(), "kl_weight": 0.1})
    model.compile(optimizer=new, loss=model.loss, run_eagerly=True, jit_compile=False)
    new.build(model.trainable_variables)
    model.load_weights(tmp_path / "trained.weights.h5")

    new_pairs = dense_posterior(new)
    np.testing.assert_allclose(float(new.kl_divergence()), dense_kl(new_pairs, new.prior_variance),
                               rtol=1e-5)
    assert not np.isclose(float(new.kl_divergence()), float(old.kl_divergence()), rtol=1e-2)
    if name == "noisy_kfac":                          # eq. 13 from the loaded factors A and S
        gamma = new.intrinsic_damping
        for block in new._blocks:
            a, s = (block.state[k].numpy().astype(np.float64) for k in ("a", "s"))
            pi = np.sqrt((np.trace(a) / len(a)) / (np.trace(s) / len(s)))
            sigma_1 = np.linalg.inv(a + pi * np.sqrt(gamma) * np.eye(len(a)))
            sigma_2 = np.linalg.inv(s + np.sqrt(gamma) / pi * np.eye(len(s)))
            want = new.kl_weight / new.num_examples * np.outer(np.diag(sigma_1), np.diag(sigma_2))
            got = new.layer_posterior(block.spec.layer)["marginal_variance"].numpy()
            np.testing.assert_allclose(got, want, rtol=1e-5)
        return
    # The flat and diagonal families: precision (lambda / N) C^-1 = F_bar + gamma_in I, with the
    # loaded F_bar, so the new precision is the old one with gamma_in swapped.
    shift = new.intrinsic_damping - old.intrinsic_damping
    for (old_mean, old_cov), (new_mean, new_cov) in zip(old_pairs, new_pairs):
        np.testing.assert_array_equal(new_mean, old_mean)
        precision = old.kl_weight / old.num_examples * np.linalg.inv(old_cov)
        want = new.kl_weight / new.num_examples * np.linalg.inv(
            precision + shift * np.eye(len(precision)))
        np.testing.assert_allclose(new_cov, want, rtol=1e-4, atol=1e-10)


def schedule_assigned_after_construction(n):
    optimizer = opt.NoisyAdam(1e-2, num_examples=n, seed=1)
    optimizer.learning_rate = decay       # Keras stops tracking the learning-rate variable
    return optimizer


RESTARTED = dict(
    CASES,
    schedule_assigned=(schedule_assigned_after_construction, "gaussian_fixed"),
    noisy_kfac_stats_every_2=(
        lambda n: opt.NoisyKFAC(1e-2, num_examples=n, stats_every=2, inverse_every=2, seed=1),
        "categorical"),
    vadam_mc2_one_step=(lambda n: opt.Vadam(1e-2, num_examples=n, mc_samples=2, seed=1),
                        "categorical"))


# A schedule assigned after construction: Keras removes its learning-rate variable from the list
# tf.train.Checkpoint saves, which then refuses to save the list (Keras's, not tfnng's).
@pytest.mark.parametrize("name, saver", [
    *((name, saver) for name in ["noisy_adam", "noisy_kfac_blocktri_mc2", "slang",
                                 "noisy_kfac_stats_every_2", "vadam_mc2_one_step"]
      for saver in ["save_weights", "tf.train.Checkpoint"]),
    ("schedule_assigned", "save_weights")])
def test_weights_saved_before_training_restart_a_trained_optimizer(name, saver, tmp_path):
    """Save before the first step, train, load that save, train again: the second run repeats the
    first (the trained posterior, Fisher and factors used to survive the load, with the counters
    and noise generator restarted, and the second run differed in every mean; through
    tf.train.Checkpoint, which restores only what it saved, they survived after the Keras paths
    were fixed, and then K-FAC's first statistics step after the restart read the trained run's
    update count and averaged zeros into S, and a run of half a Monte Carlo group, no update yet,
    was not restarted at all; a schedule assigned after construction made the load an error)."""
    make_optimizer, loss_name = RESTARTED[name]
    x, y = dataset(loss_name)
    if name.endswith("_one_step"):
        x, y = x[:BATCH], y[:BATCH]
    model = build_model(make_optimizer(len(x)), loss_name, len(x))
    if saver == "save_weights":
        model.save_weights(tmp_path / "initial.weights.h5")
    else:
        checkpoint = tf.train.Checkpoint(model=model, optimizer=model.optimizer)
        path = checkpoint.write(str(tmp_path / "initial"))
    train(model, x, y)
    first_run = [v.numpy() for v in model.optimizer.variables + model.weights]
    if saver == "save_weights":
        model.load_weights(tmp_path / "initial.weights.h5")
    else:
        checkpoint.read(path)
    train(model, x, y)
    for a, b in zip(first_run, model.optimizer.variables + model.weights):
        np.testing.assert_array_equal(b.numpy(), a, err_msg=b.path)


@pytest.mark.parametrize("name", ["noisy_adam", "noisy_kfac"])
def test_a_trained_posterior_survives_another_mc_samples_and_an_assigned_iteration_count(
        name, tmp_path):
    """Only a state written before the first step restarts a trained optimizer: a trained
    tf.train.Checkpoint restored into an optimizer with ``mc_samples=2``, and ``iterations``
    assigned 0 by the user, keep the posterior (both used to restart it: the restart was inferred
    from counters that disagreed with ``iterations``)."""
    make_optimizer, loss_name = CASES[name]
    model, x, y = trained(make_optimizer, loss_name)

    def posterior(of):
        optimizer = of.optimizer
        return [(optimizer.posterior_mean(v).numpy(), optimizer.posterior_stddev(v).numpy())
                for v in of.trainable_variables]

    def assert_posterior(expected, of):
        for (mean, stddev), (got_mean, got_stddev) in zip(expected, posterior(of)):
            np.testing.assert_array_equal(got_mean, mean)
            np.testing.assert_array_equal(got_stddev, stddev)

    trained_posterior = posterior(model)
    optimizer = make_optimizer(len(x))
    config = {**optimizer.get_config(), "mc_samples": 2}
    restored = build_model(type(optimizer).from_config(config), loss_name, len(x))
    restored.optimizer.build(restored.trainable_variables)
    path = tf.train.Checkpoint(model=model, optimizer=model.optimizer).write(
        str(tmp_path / "trained"))
    tf.train.Checkpoint(model=restored, optimizer=restored.optimizer).read(path)   # no MC sums
    assert_posterior(trained_posterior, restored)
    train(restored, x[:BATCH], y[:BATCH])            # half a Monte Carlo group: no update yet
    assert_posterior(trained_posterior, restored)

    model.optimizer.iterations.assign(0)
    assert_posterior(trained_posterior, model)
    train(model, x[:BATCH], y[:BATCH])
    stepped_posterior = posterior(model)
    assert not np.array_equal(stepped_posterior[0][0], trained_posterior[0][0]), "no update"
    model.optimizer.iterations.assign(0)
    assert_posterior(stepped_posterior, model)


def test_the_compared_state_covers_curvature_inverses_counters_and_rng():
    """What the round trips compare (optimizer.variables) holds every piece of state named in the
    issue, including a Monte Carlo group left half accumulated."""
    model, _, _ = trained(CASES["noisy_kfac_blocktri_mc2"][0], "gaussian_learned")
    names = " ".join(v.path for v in model.optimizer.variables)
    for part in ("posterior_mean", "means_initialized", "update_count", "skipped_updates",
                 "seed_generator_state", "stats_count", "inverse_failures", "chain_0_0_a_off",
                 "chain_0_0_step_k_a", "chain_0_0_sample_psi_a", "chain_0_kl_offset",
                 "diag_fisher", "mc_sum_grad", "mc_sum_weight", "mc_sum_point_grad"):
        assert part in names, part
    assert int(model.optimizer._mc_count.numpy()) == 1
    kfac, _, _ = trained(CASES["noisy_kfac"][0], "categorical")
    names = " ".join(v.path for v in kfac.optimizer.variables)
    for part in ("kfac_0_a", "kfac_0_s", "kfac_0_a_inv", "kfac_0_s_root", "kfac_1_momentum"):
        assert part in names, part
    ivon, _, _ = trained(CASES["ivon_mc2"][0], "gaussian_learned")
    assert int(ivon.optimizer._mc_count.numpy()) == 1


_LOAD_IN_FRESH_PROCESS = textwrap.dedent("""
    import json, sys
    import keras, numpy as np
    model_path, data_path, out_path = sys.argv[1:]
    try:
        keras.models.load_model(model_path)
        without_tfnng = "loaded"
    except Exception as error:
        without_tfnng = type(error).__name__
    import tfnng
    model = keras.models.load_model(model_path)
    loaded = [v.numpy() for v in model.optimizer.variables + model.weights]
    data = np.load(data_path)
    model.fit(data["x"], data["y"], batch_size=len(data["x"]), epochs=1, shuffle=False, verbose=0)
    stepped = [v.numpy() for v in model.optimizer.variables + model.weights]
    np.savez(out_path, *loaded, *stepped)
    print(json.dumps({"without_tfnng": without_tfnng, "count": len(loaded),
                      "optimizer": type(model.optimizer).__name__}))
""")


def test_load_in_a_fresh_process_needs_only_import_tfnng(tmp_path):
    """No custom_objects: the registered classes are found once ``tfnng`` is imported (and only
    then: the fresh process first shows that loading fails without the import). Training continues
    in that process exactly as in this one."""
    model, x, y = trained(CASES["noisy_kfac"][0], "categorical")
    model.save(tmp_path / "m.keras")
    np.savez(tmp_path / "batch.npz", x=x[:BATCH], y=y[:BATCH])
    process = subprocess.run(
        [sys.executable, "-c", _LOAD_IN_FRESH_PROCESS, str(tmp_path / "m.keras"),
         str(tmp_path / "batch.npz"), str(tmp_path / "out.npz")],
        cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=300)
    assert process.returncode == 0, process.stderr[-4000:]
    report = json.loads(process.stdout.strip().splitlines()[-1])
    assert report["without_tfnng"] != "loaded"
    assert report["optimizer"] == "NoisyKFAC"
    arrays = np.load(tmp_path / "out.npz")
    arrays = [arrays[f"arr_{i}"] for i in range(len(arrays.files))]
    state = model.optimizer.variables + model.weights
    assert report["count"] == len(state)
    for variable, value in zip(state, arrays[:len(state)]):
        np.testing.assert_array_equal(value, variable.numpy(), err_msg=variable.path)
    train(model, x[:BATCH], y[:BATCH])
    for variable, value in zip(state, arrays[len(state):]):
        np.testing.assert_array_equal(value, variable.numpy(), err_msg=variable.path)


# ----------------------------------------------------------------- BackupAndRestore (resume)
RESUMABLE = {
    "noisy_adam_true_fisher": lambda n: opt.NoisyAdam(1e-2, num_examples=n, fisher="true", seed=1),
    "noisy_kfac": lambda n: opt.NoisyKFAC(1e-2, num_examples=n, stats_every=1, inverse_every=3,
                                          seed=1),
}
EPOCHS, STEPS_PER_EPOCH = 2, 4


class Crash(Exception):
    """Stands for whatever stops a training run (preemption, out of memory, Ctrl-C)."""


class CrashAt(keras.callbacks.Callback):
    """Raises before batch ``batch`` of epoch ``epoch``: a crash in the middle of an epoch."""

    def __init__(self, epoch, batch):
        super().__init__()
        self.at, self.epoch = (epoch, batch), None

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        if (self.epoch, batch) == self.at:
            raise Crash(f"crashed before batch {batch} of epoch {self.epoch}")


def crash_then_resume(make_optimizer, x, y, backup_dir, save_freq, crash_at, run_eagerly):
    """Run 1 crashes at ``crash_at``; run 2, a fresh model built the same way, resumes from the
    backup with the same ``fit`` call."""
    model = build_model(make_optimizer(len(x)), "categorical", len(x), run_eagerly)
    with pytest.raises(Crash):
        train(model, x, y, epochs=EPOCHS, callbacks=[
            keras.callbacks.BackupAndRestore(backup_dir, save_freq=save_freq), CrashAt(*crash_at)])
    assert int(model.optimizer.iterations.numpy()) == crash_at[0] * STEPS_PER_EPOCH + crash_at[1]
    resumed = build_model(make_optimizer(len(x)), "categorical", len(x), run_eagerly)
    train(resumed, x, y, epochs=EPOCHS,
          callbacks=[keras.callbacks.BackupAndRestore(backup_dir, save_freq=save_freq)])
    return resumed


@pytest.mark.parametrize("name, run_eagerly", [("noisy_adam_true_fisher", True),
                                               ("noisy_kfac", False)])
def test_resume_from_epoch_backups_equals_uninterrupted_training(name, run_eagerly, tmp_path):
    """Backups at epoch ends: a crash in epoch 1 loses that epoch's partial work; the resumed run
    redoes it from the restored state and ends with the uninterrupted posterior, bit for bit (noisy
    K-FAC compiled: the uninterrupted run builds its optimizer while tracing, the resumed one before
    ``fit``, from the backup)."""
    make_optimizer = RESUMABLE[name]
    x, y = dataset("categorical", n=STEPS_PER_EPOCH * BATCH)
    uninterrupted = build_model(make_optimizer(len(x)), "categorical", len(x), run_eagerly)
    train(uninterrupted, x, y, epochs=EPOCHS)
    resumed = crash_then_resume(make_optimizer, x, y, tmp_path / "backup", "epoch", (1, 2),
                                run_eagerly)
    assert_same_state(uninterrupted, resumed)
    assert_same_posterior(uninterrupted, resumed)


@pytest.mark.parametrize("name", sorted(RESUMABLE))
def test_resume_from_batch_backups_restores_the_state_exactly(name, tmp_path):
    """Backups every 3 batches, crash before batch 3 of epoch 1: the last backup holds the state
    after 6 steps (epoch 1, batch 1). Keras 3 restores the *epoch* counter only, so the resumed run
    starts epoch 1 again from its first batch: batches 0-1 of epoch 1 are seen twice. The result
    equals, bit for bit, one uninterrupted run over exactly that sequence of batches."""
    make_optimizer = RESUMABLE[name]
    x, y = dataset("categorical", n=STEPS_PER_EPOCH * BATCH)
    resumed = crash_then_resume(make_optimizer, x, y, tmp_path / "backup", 3, (1, 3),
                                run_eagerly=True)
    seen = np.concatenate([np.arange(len(x)), np.arange(2 * BATCH), np.arange(len(x))])
    reference = build_model(make_optimizer(len(x)), "categorical", len(x))
    train(reference, x[seen], y[seen])
    assert int(resumed.optimizer.iterations.numpy()) == len(seen) // BATCH
    assert_same_state(reference, resumed)
    assert_same_posterior(reference, resumed)
