"""Single-device and MirroredStrategy training runs of every tfnng optimizer (used by
tests/test_distributed.py, which runs this file in a subprocess).

Logical CPU devices must be configured before TensorFlow initialises its devices, hence the
subprocess: ``python tests/distributed_runs.py --out runs.npz [case ...]`` (from the project root,
with the package importable). Each case trains the same small net, from the same initial weights
and seeds, on the same global batches (``model.fit``, ``shuffle=False``), once on one device and
once under ``tf.distribute.MirroredStrategy`` over ``REPLICAS`` logical CPUs (each replica gets half
of every global batch). The output holds, per case and run, every optimizer variable (posterior
means, slots, Kronecker factors, inverses, counters, seed state) and every model weight (the
current weight sample), and whether all replicas hold bit-identical copies of them.

Adding an optimizer to the comparison is one entry in ``CASES``.
"""

import argparse
import typing
from pathlib import Path

import keras
import numpy as np
import tensorflow as tf

import tfnng
from tfnng import models

REPLICAS = 2
NUM_EXAMPLES = 64          # EPOCHS epochs of GLOBAL_BATCH
ONE_STEP_EXAMPLES = 1024   # one update on all of them
GLOBAL_BATCH = 16
EPOCHS = 2
SEED = 3
NOISE_VARIANCE = 0.5


class Case(typing.NamedTuple):
    """One optimizer configuration under test.

    ``factory(num_examples)`` builds the optimizer; ``bayesian``: the net is wrapped in
    tfnng.BayesianModel; ``one_step``: a single update on ``ONE_STEP_EXAMPLES`` examples (instead
    of ``EPOCHS`` epochs of ``GLOBAL_BATCH`` on ``NUM_EXAMPLES``); ``reference``: ``train``
    arguments of a second single-device run that differs only in randomness the replicas draw
    differently (what it changes is not compared with the single-device run); ``sign_ambiguous``:
    regular expressions of the recorded names whose values are defined only up to eigenvector
    signs (compared across replicas only); ``target_statistic``: ``(name regex, expectation)`` of a
    statistic estimated from sampled Fisher targets, whose distribution is known (see the test);
    ``net``: the net's middle layer and whether it has an ``Input`` (is built before ``fit``).
    """

    factory: typing.Callable
    bayesian: bool = False
    one_step: bool = False
    reference: dict = None
    sign_ambiguous: tuple = ()
    target_statistic: tuple = None
    net: tuple = ("layer_norm", True)


_opt = tfnng.optimizers
_kfac = dict(stats_every=1, inverse_every=2, seed=SEED)
# True-Fisher targets are drawn per replica (replica id folded into the seed). For the output
# layer (linear, Gaussian likelihood) the per-example log-likelihood gradient of its pre-activation
# is eps / sigma with eps ~ N(0, 1), so its squared mean estimates 1 / sigma^2.
_OTHER_TARGETS = {"fisher_seed": 1}
# Block-tridiagonal caches hold eigenvectors (sign set by round-off); the noisy sample uses them.
_CHAIN_CACHES = r"chain_\d+_\d+_(step|sample)_"
CASES = {
    "noisy_adam": Case(lambda n: _opt.NoisyAdam(5e-2, n, hess_init=1.0, seed=SEED)),
    "noisy_adam_fisher_empirical": Case(
        lambda n: _opt.NoisyAdam(5e-2, n, hess_init=1.0, fisher="empirical", seed=SEED), True),
    "noisy_adam_fisher_true": Case(   # Fisher slot after one update from 0: (1 - beta_2) / sigma^2
        lambda n: _opt.NoisyAdam(5e-2, n, beta_2=0.5, hess_init=0.0, fisher="true", seed=SEED), True,
        one_step=True, reference=_OTHER_TARGETS,
        target_statistic=(r"output_bias_fisher$", 0.5 / NOISE_VARIANCE)),
    "vadam_mc2": Case(lambda n: _opt.Vadam(5e-2, n, hess_init=1.0, mc_samples=2, seed=SEED)),
    "vprop_clipnorm": Case(
        lambda n: _opt.Vprop(5e-2, n, hess_init=1.0, global_clipnorm=0.5, seed=SEED)),
    "vadagrad": Case(lambda n: _opt.VadaGrad(5e-2, n, seed=SEED)),
    "ivon": Case(lambda n: _opt.IVON(5e-2, n, hess_init=0.5, seed=SEED)),
    "noisy_kfac_empirical": Case(
        lambda n: _opt.NoisyKFAC(5e-2, n, fisher="empirical", **_kfac), True),
    "noisy_kfac_true": Case(   # the output layer's factor S after its first (averaging) update
        lambda n: _opt.NoisyKFAC(5e-2, n, **_kfac), True, one_step=True,
        reference=_OTHER_TARGETS, target_statistic=(r"kfac_1_s$", 1.0 / NOISE_VARIANCE)),
    "noisy_kfac_blocktri": Case(
        lambda n: _opt.NoisyKFAC(5e-2, n, fisher="empirical", block_tridiagonal=True, **_kfac),
        True, one_step=True, sign_ambiguous=(_CHAIN_CACHES, r"^net:")),
    "kfac_blocktri": Case(
        lambda n: _opt.KFAC(5e-2, damping=1e-2, fisher="empirical", block_tridiagonal=True,
                            **_kfac), True, sign_ambiguous=(_CHAIN_CACHES,)),
    "vogn": Case(lambda n: _opt.VOGN(5e-2, n, fisher="empirical", seed=SEED), True),
    "slang": Case(lambda n: _opt.SLANG(5e-2, n, rank=2, fisher="empirical", seed=SEED), True),
    "noisy_natural_gradient": Case(
        lambda n: _opt.NoisyNaturalGradient(5e-2, n, fisher="empirical", seed=SEED), True),
    # Keras builds an unbuilt net, then the optimizer, before the first step under a strategy.
    "noisy_kfac_unbuilt_net": Case(
        lambda n: _opt.NoisyKFAC(5e-2, n, fisher="empirical", **_kfac), True,
        net=("layer_norm", False)),
    # A synchronized BatchNormalization all-reduces inside the forward pass: the replicas' threads
    # take turns in the middle of the curvature capture.
    "noisy_kfac_sync_batch_norm": Case(
        lambda n: _opt.NoisyKFAC(5e-2, n, fisher="empirical", **_kfac), True,
        net=("sync_batch_norm", True)),
}


def make_net(middle, with_input):
    middle = (keras.layers.LayerNormalization(name="norm") if middle == "layer_norm"
              else keras.layers.BatchNormalization(synchronized=True, name="norm"))
    return keras.Sequential(([keras.Input((3,))] if with_input else []) + [
        keras.layers.Dense(5, activation="tanh", name="hidden"),
        middle,                                          # no Kronecker factors: diagonal
        keras.layers.Dense(1, name="output"),
    ])


def make_data(num_examples):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(num_examples, 3)).astype("float32")
    y = np.sin(x @ np.array([[1.0], [-2.0], [0.5]])) + 0.1 * rng.normal(size=(num_examples, 1))
    return x, y.astype("float32")


def train(case, strategy, fisher_seed=None):
    """Train ``case`` under ``strategy``; returns the net, the optimizer and the loss history.

    Single-device runs build the optimizer before ``fit`` (one trace of the train step instead of
    two); under a strategy Keras traces once anyway and the optimizer builds inside the step.
    """
    spec = CASES[case]
    num_examples = ONE_STEP_EXAMPLES if spec.one_step else NUM_EXAMPLES
    x, y = make_data(num_examples)
    with strategy.scope():
        keras.utils.set_random_seed(0)
        net = make_net(*spec.net)
        model = tfnng.BayesianModel(net) if spec.bayesian else net
        optimizer = spec.factory(num_examples)
        model.compile(optimizer=optimizer, loss=tfnng.losses.GaussianNLL(NOISE_VARIANCE))
        if fisher_seed is not None:
            model._fisher_seed.state.assign([fisher_seed, 0])
        if strategy.num_replicas_in_sync == 1 and net.built:
            optimizer.build(model.trainable_variables)
    batch, epochs = (num_examples, 1) if spec.one_step else (GLOBAL_BATCH, EPOCHS)
    history = model.fit(x, y, batch_size=batch, epochs=epochs, shuffle=False, verbose=0)
    return net, optimizer, history.history["loss"]


def snapshot(net, optimizer):
    """``{"opt:i" | "net:i" | "std:i": value}`` of the optimizer's variables, the net's weights and
    the posterior standard deviations of the trainable weights (primary copy; keyed by position, as
    layer names differ between runs), their names, and whether every replica holds a bit-identical
    copy of each variable."""
    values, names, identical = {}, [], True
    variables = [("opt", i, v) for i, v in enumerate(optimizer.variables)]
    variables += [("net", i, v) for i, v in enumerate(net.weights)]
    for owner, i, variable in variables:
        copies = [np.asarray(c) for c in getattr(variable.value, "values", (variable.value,))]
        identical &= all(np.array_equal(copies[0], c) for c in copies[1:])
        values[f"{owner}:{i}"] = copies[0]
        names.append(f"{owner}:{i} {variable.path}")
    for i, variable in enumerate(net.trainable_weights):
        values[f"std:{i}"] = np.asarray(optimizer.posterior_stddev(variable))
        names.append(f"std:{i} {variable.path}")
    return values, names, identical


def replica_fisher_targets(strategy, fisher):
    """Output-layer pre-activation gradients of one curvature pass in which every replica gets the
    same 8 examples, gathered over the replicas: ``(REPLICAS, 8)``."""
    x, y = make_data(8)
    with strategy.scope():
        keras.utils.set_random_seed(0)
        net = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1, name="output")])
        capture = tfnng.curvature.capture.LayerCapture(net)
        optimizer = tfnng.optimizers.NoisyKFAC(1e-2, 8, fisher=fisher)
        optimizer.prepare_curvature(capture.specs)
        loss, seed = tfnng.losses.GaussianNLL(NOISE_VARIANCE), keras.random.SeedGenerator(7)

    def step():
        records = models.gradients_and_curvature(net, capture, optimizer, loss, x, y, seed=seed)[3]
        return records[capture.specs[0].name].preactivation_grads

    gathered = strategy.run(tf.function(step))
    return np.asarray(strategy.experimental_local_results(gathered)[0]).reshape(REPLICAS, -1)


def raise_on_a_nan_in_one_replica(strategy):
    """``nonfinite="raise"`` with a NaN target in the second replica's half of the batch: whether
    every replica raised, and whether their copies of every variable are still identical."""
    x, y = make_data(GLOBAL_BATCH)
    y[-1] = np.nan
    with strategy.scope():
        keras.utils.set_random_seed(0)
        net = make_net("layer_norm", True)
        optimizer = _opt.NoisyAdam(5e-2, GLOBAL_BATCH, seed=SEED, nonfinite="raise")
        net.compile(optimizer=optimizer, loss=tfnng.losses.GaussianNLL(NOISE_VARIANCE))
    try:
        net.fit(x, y, batch_size=GLOBAL_BATCH, epochs=1, shuffle=False, verbose=0)
        raised = False
    except tf.errors.InvalidArgumentError:
        raised = True
    return raised, snapshot(net, optimizer)[2]


def uneven_hand_written_step(strategy):
    """One empirical-Fisher noisy K-FAC step of docs/distributed.md's hand-written loop on a batch
    of 5 (3 and 2 examples on the replicas): the output layer's S, and its brute-force value."""
    x, y = make_data(5)
    with strategy.scope():
        keras.utils.set_random_seed(0)
        net = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4, activation="tanh"),
                                keras.layers.Dense(1)])
        residuals = (y - net(x).numpy()) / NOISE_VARIANCE
        optimizer = _opt.NoisyKFAC(0.0, 5, fisher="empirical", stats_every=1, stat_decay=1.0,
                                   factor_prior_count=0, seed=SEED)
        capture = tfnng.curvature.capture.LayerCapture(net)
        optimizer.prepare_curvature(capture.specs)
        optimizer.build(net.trainable_variables)
        loss_fn = tfnng.losses.GaussianNLL(NOISE_VARIANCE)

    @tf.function
    def train_step(x, y):
        def step(x, y):
            loss, _, grads, curvature = models.gradients_and_curvature(
                net, capture, optimizer, loss_fn, x, y)
            optimizer.apply_gradients(zip(grads, net.trainable_variables), curvature=curvature)
            return loss
        return strategy.reduce("SUM", strategy.run(step, args=(x, y)), axis=None)

    for xb, yb in strategy.experimental_distribute_dataset(
            tf.data.Dataset.from_tensor_slices((x, y)).batch(8)):
        train_step(xb, yb)
    return np.asarray(optimizer._blocks[1].state["s"]), np.mean(residuals ** 2, keepdims=True)


def tensorboard_tags(strategy, logdir):
    """The tags PosteriorTensorBoard wrote in one epoch under the strategy (it stopped at the first
    epoch: int() of the optimizer's MirroredVariable iterations)."""
    x, y = make_data(GLOBAL_BATCH)
    with strategy.scope():
        keras.utils.set_random_seed(0)
        net = make_net("layer_norm", True)
        net.compile(optimizer=_opt.NoisyAdam(5e-2, GLOBAL_BATCH, seed=SEED),
                    loss=tfnng.losses.GaussianNLL(NOISE_VARIANCE))
    net.fit(x, y, batch_size=GLOBAL_BATCH, epochs=1, verbose=0,
            callbacks=[tfnng.callbacks.PosteriorTensorBoard(logdir)])
    return sorted({value.tag for path in Path(logdir).rglob("events*")
                   for event in tf.compat.v1.train.summary_iterator(str(path))
                   for value in event.summary.value})


def mixed_precision_runs(strategy):
    """Curvature optimizers under the strategy with each half-precision policy: the finite losses
    of one epoch ("mixed_bfloat16"), or the error ``compile`` raises ("mixed_float16")."""
    x, y = make_data(2 * GLOBAL_BATCH)
    out = {}
    for policy in ("mixed_bfloat16", "mixed_float16"):
        keras.mixed_precision.set_global_policy(policy)
        try:
            for name, make in (("noisy_kfac", lambda: _opt.NoisyKFAC(1e-2, len(x), seed=SEED)),
                               ("vogn", lambda: _opt.VOGN(1e-2, len(x), seed=SEED))):
                with strategy.scope():
                    keras.utils.set_random_seed(0)
                    net = keras.Sequential([keras.Input((3,)),
                                            keras.layers.Dense(5, activation="tanh"),
                                            keras.layers.Dense(1, dtype="float32")])
                    model = tfnng.BayesianModel(net)
                    try:
                        model.compile(optimizer=make(), loss=tfnng.losses.GaussianNLL(NOISE_VARIANCE))
                    except ValueError as error:
                        out[f"{policy}|{name}"] = np.asarray(str(error))
                        continue
                history = model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=1, verbose=0)
                out[f"{policy}|{name}"] = np.asarray(history.history["loss"])
        finally:
            keras.mixed_precision.set_global_policy("float32")
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="output .npz")
    parser.add_argument("cases", nargs="*", default=list(CASES))
    args = parser.parse_args(argv)

    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration() for _ in range(REPLICAS)])
    # No Grappler graph rewrites (for both runs alike): they cost ~20% of this script's time.
    tf.config.optimizer.set_experimental_options({"disable_meta_optimizer": True})

    out = {}
    single = tf.distribute.get_strategy()
    mirrored = tf.distribute.MirroredStrategy([f"/cpu:{i}" for i in range(REPLICAS)])
    for case in args.cases:
        runs = [("single", single, {}), ("mirrored", mirrored, {})]
        if CASES[case].reference is not None:
            runs.append(("reference", single, CASES[case].reference))
        for run, strategy, options in runs:
            net, optimizer, losses = train(case, strategy, **options)
            values, names, identical = snapshot(net, optimizer)
            for key, value in values.items():
                out[f"{case}|{run}|{key}"] = value
            out[f"{case}|{run}|names"] = np.asarray(names)
            out[f"{case}|{run}|replicas_identical"] = np.asarray(identical)
            out[f"{case}|{run}|history_loss"] = np.asarray(losses)
    for fisher in tfnng.curvature.FISHER_TYPES:
        out[f"targets|{fisher}"] = replica_fisher_targets(mirrored, fisher)
    out["raise|raised"], out["raise|replicas_identical"] = raise_on_a_nan_in_one_replica(mirrored)
    for key, value in mixed_precision_runs(mirrored).items():
        out[f"mixed|{key}"] = value
    out["uneven|s"], out["uneven|brute_force"] = uneven_hand_written_step(mirrored)
    out["tensorboard|tags"] = np.asarray(tensorboard_tags(mirrored, f"{args.out}.logs"))
    np.savez(args.out, **out)


if __name__ == "__main__":
    main()
