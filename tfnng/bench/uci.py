"""UCI regression on the standard splits: test RMSE and log-likelihood, mean ± standard error.

Protocol (datasets/uci/README.md; NNG paper App. C.1): for each train/test split, inputs and targets
are normalised with the training split's mean and standard deviation (a zero std becomes 1: two input
columns of naval-propulsion-plant are constant); the net has one hidden layer of ``n_hidden.txt`` ReLU
units (50, or 100 for protein) and ends in a ``NoisePrecision`` layer, the Gamma posterior of the noise
precision of App. C.1, trained with ``GaussianNLL("learned")``. Test RMSE and the per-point test
log-likelihood (log-mean-exp over 100 weight samples, ``--predictive-samples``, of the Student-t
densities that integrate q(tau) out) are reported in the
original target units, then averaged over splits (± standard error). Reference numbers of the NNG
paper (Table 1) and of MC dropout (datasets/uci/README.md) are printed alongside. ``--mc-samples S``
trains on S weight samples per mini-batch (each batch is fed S times to an optimizer with
``mc_samples=S``: the same number of posterior updates, each with the average of S gradients).
``--set NAME=VALUE`` changes one of the method's constructor arguments (e.g. ``--set momentum=0.9``,
``--set kl_clip=None``); the protocol's shared settings stay fixed.

Example: ``python -m tfnng.bench uci --data-dir ../shared/datasets/uci --dataset yacht --method noisy_adam``
"""

import argparse
import ast
import dataclasses
import math
import time
from pathlib import Path

import keras
import numpy as np
import tensorflow as tf

import tfnng
from tfnng.bench import _results

DATASETS = (
    "bostonHousing",
    "concrete",
    "energy",
    "kin8nm",
    "naval-propulsion-plant",
    "power-plant",
    "protein-tertiary-structure",
    "wine-quality-red",
    "yacht",
)
ALIASES = {"boston": "bostonHousing"}

# NNG paper (000), Table 1, columns NNG-FFG (noisy Adam) and NNG-MVG (noisy K-FAC):
# (test RMSE, se, test log-likelihood, se). The paper drew its own random 90/10 splits (App. C.1) and
# used a single split for protein, so these are a reference, not a paired comparison.
NNG_TABLE_1 = {
    "bostonHousing": {"NNG-FFG": (3.031, 0.155, -2.558, 0.032), "NNG-MVG": (2.742, 0.125, -2.446, 0.029)},
    "concrete": {"NNG-FFG": (5.613, 0.113, -3.145, 0.023), "NNG-MVG": (5.019, 0.127, -3.039, 0.025)},
    "energy": {"NNG-FFG": (0.839, 0.046, -1.629, 0.020), "NNG-MVG": (0.485, 0.023, -1.421, 0.005)},
    "kin8nm": {"NNG-FFG": (0.079, 0.001, 1.112, 0.008), "NNG-MVG": (0.076, 0.001, 1.148, 0.007)},
    "naval-propulsion-plant": {"NNG-FFG": (0.001, 0.000, 6.231, 0.041),
                               "NNG-MVG": (0.000, 0.000, 7.079, 0.034)},
    "power-plant": {"NNG-FFG": (4.002, 0.039, -2.803, 0.010), "NNG-MVG": (3.886, 0.041, -2.776, 0.011)},
    "protein-tertiary-structure": {"NNG-FFG": (4.380, 0.016, -2.896, 0.004),
                                   "NNG-MVG": (4.097, 0.009, -2.836, 0.002)},
    "wine-quality-red": {"NNG-FFG": (0.644, 0.011, -0.976, 0.016), "NNG-MVG": (0.637, 0.011, -0.969, 0.014)},
    "yacht": {"NNG-FFG": (1.289, 0.069, -2.412, 0.006), "NNG-MVG": (0.979, 0.077, -2.316, 0.006)},
}

# MC dropout re-run with grid search on these same standard splits (datasets/uci/README.md):
# (test RMSE, se, test log-likelihood, se).
MC_DROPOUT = {
    "bostonHousing": (2.90, 0.18, -2.40, 0.04),
    "concrete": (4.82, 0.16, -2.93, 0.02),
    "energy": (0.54, 0.06, -1.21, 0.01),
    "kin8nm": (0.08, 0.00, 1.14, 0.01),
    "naval-propulsion-plant": (0.00, 0.00, 4.45, 0.00),
    "power-plant": (4.01, 0.04, -2.80, 0.01),
    "protein-tertiary-structure": (4.27, 0.02, -2.87, 0.00),
    "wine-quality-red": (0.62, 0.01, -0.93, 0.01),
    "yacht": (0.67, 0.05, -1.25, 0.01),
}

# Settings shared by every method (NNG App. C.1 unless noted): learning rate alpha~ = 0.01, decayed by
# 0.1 for the second half of training; batch size 10 for the data sets with fewer than 2000 points and
# 100 for the others; prior N(0, 1) (prior variance 1) with KL weight 1; one weight sample per step
# (``--mc-samples``: more).
LEARNING_RATE = 0.01
LEARNING_RATE_DECAY = 0.1
SMALL_DATASET_ROWS = 2000
SMALL_BATCH_SIZE, LARGE_BATCH_SIZE = 10, 100
PRIOR_VARIANCE = 1.0
KL_WEIGHT = 1.0
# Training length: the papers do not state it (MC dropout's n_epochs.txt says 40, too few for the
# variational methods at these step sizes). The NNG authors' cleaned-up noisy K-FAC code
# (github.com/pomonam/NoisyNaturalGradient, config/regression/kfac_*.json) trains 1000 epochs with
# 10 weight samples per batch (``--epochs 1000 --mc-samples 10``). EPOCHS is our choice, the same for every
# method and data set; it keeps the small-set runs within minutes on 2 CPU cores (see
# docs/benchmarks.md).
EPOCHS = 200
QUICK_SPLITS, QUICK_EPOCHS = 2, 5
NUM_PREDICTIVE_SAMPLES = 100


@dataclasses.dataclass(frozen=True)
class Method:
    """How to build one method's optimizer: class name, extra constructor arguments, their source.

    ``bayesian`` methods use ``tfnng.optimizers.<optimizer>``, the others ``keras.optimizers.<optimizer>``
    with the prior as an L2 penalty (MAP).
    """

    optimizer: str
    hyper_parameters: dict
    source: str
    bayesian: bool = True


# One row per method. Every tfnng optimizer also gets learning_rate (with the decay above),
# num_examples, prior_variance, kl_weight and seed; arguments not listed keep tfnng's defaults.
METHODS = {
    "adam": Method("Adam", {"beta_1": 0.9, "beta_2": 0.999},
                   "MAP baseline: Keras Adam (Kingma & Ba decay rates); the Gaussian prior enters as an "
                   "L2 penalty kl_weight/(2*prior_variance*N) per weight on the mean loss",
                   bayesian=False),
    "noisy_adam": Method("NoisyAdam", {"beta_1": 0.9, "beta_2": 0.999, "hess_init": 1.0},
                         "NNG Alg. 1's update on the plain model (the squared batch gradient for "
                         "its per-example Fisher: noisy_adam_fisher is Alg. 1 as published) and "
                         "App. C.1: beta~ = 0.001 (beta_2 = 1 - beta~), momentum beta_1 "
                         "= 0.9 as in Adam. hess_init = 1 (tfnng's default; Alg. 1 leaves f's start open): "
                         "with f = 0 and no bias correction the first mean steps alpha*m/(f + gamma_in) "
                         "blew up in our runs (concrete split 0: test RMSE > 100)"),
    "vadam": Method("Vadam", {"beta_1": 0.9, "beta_2": 0.999},
                    "Vadam paper Fig. 1 (Adam with weight perturbation): Adam's decay rates, which "
                    "match beta~ = 0.001 of NNG App. C.1"),
    "vprop": Method("Vprop", {"beta_2": 0.999},
                    "Vadam paper eq. 14 (no momentum); averaging rate 1 - beta_2 = beta~ = 0.001 of "
                    "NNG App. C.1"),
    "vadagrad": Method("VadaGrad", {},
                       "Vadam paper sec. 5 with tfnng's defaults (tau = 0: the paper's VadaGrad, a "
                       "growing sum of squared gradients; initial sum 1)"),
    "noisy_adam_fisher": Method("NoisyAdam", {"beta_1": 0.9, "beta_2": 0.999, "hess_init": 1.0,
                                              "fisher": "true"},
                                "NNG Alg. 1 with its per-example true Fisher (squared per-example "
                                "gradients, targets sampled from the predictive: NNG footnote 1), "
                                "trained through tfnng.BayesianModel; other settings as noisy_adam"),
    "noisy_kfac": Method("NoisyKFAC", {"stat_decay": 0.001, "stats_every": 1, "inverse_every": 1,
                                       "extrinsic_damping": 1e-3, "kl_clip": 1e-2},
                         "NNG Alg. 2 and App. C.1: beta~ = 0.001, no momentum, true Fisher; ours: "
                         "extrinsic damping 1e-3 and the KL-clipped step c = 0.01 of App. C.2 (without "
                         "them naval split 1 and protein split 0 diverged); T_stats = T_inv = 1 (C.1 "
                         "states none); trained through tfnng.BayesianModel"),
    "ivon": Method("IVON", {},
                   "Shen et al. 2024 with tfnng's defaults (beta_1 = 0.9, beta_2 = 0.99999, initial "
                   "Hessian 1); only the step size is the shared one above"),
}


@dataclasses.dataclass
class Split:
    """One normalised train/test split; ``y_mean``/``y_std`` undo the target normalisation."""

    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    y_mean: float
    y_std: float


def _read_ints(path):
    return np.loadtxt(path, dtype=np.int64, ndmin=1)


def resolve_dataset(name):
    """Canonical folder name of ``name`` (``boston`` is an alias of ``bostonHousing``)."""
    name = ALIASES.get(name, name)
    if name not in DATASETS:
        raise ValueError(f"unknown UCI data set {name!r}; choose from {', '.join(DATASETS)} or 'all'")
    return name


def dataset_info(data_dir, dataset):
    """Number of rows, of standard splits and of hidden units of ``dataset`` in ``data_dir``."""
    folder = Path(data_dir) / dataset
    with open(folder / "data.txt") as f:
        rows = sum(1 for line in f if line.strip())
    n_splits = int(_read_ints(folder / "n_splits.txt")[0])
    n_hidden = int(_read_ints(folder / "n_hidden.txt")[0])
    return rows, n_splits, n_hidden


def _split_ids(n_splits, first_split, splits):
    return range(first_split, n_splits if splits is None else min(first_split + splits, n_splits))


def check_dataset(data_dir, dataset, first_split, splits):
    """Stop the command before any training unless ``dataset``'s files are all in ``data_dir`` and
    ``first_split`` is one of its splits."""
    folder = Path(data_dir) / dataset
    common = ["data.txt", "n_splits.txt", "n_hidden.txt", "index_features.txt", "index_target.txt"]
    missing = [name for name in common if not (folder / name).is_file()]
    if not missing:
        n_splits = int(_read_ints(folder / "n_splits.txt")[0])      # not data.txt: no full read
        if not 0 <= first_split < n_splits:
            raise SystemExit(f"--first-split {first_split}: {dataset} has splits 0 to {n_splits - 1}")
        missing = [name for split in _split_ids(n_splits, first_split, splits)
                   for name in (f"index_train_{split}.txt", f"index_test_{split}.txt")
                   if not (folder / name).is_file()]
    if missing:
        raise SystemExit(f"UCI data set {dataset} in {folder} is incomplete (missing: "
                         f"{', '.join(missing)}); see ../shared/datasets/uci/README.md")


def _standardise(train, test):
    """Normalise both arrays with the mean/std of ``train`` (columns with zero std get std 1; a
    column constant up to rounding, std ~1e-16 as one of naval's, becomes a constant, as in the
    reference code of the MC-dropout numbers)."""
    mean = train.mean(axis=0)
    std = train.std(axis=0)
    std = np.where(std > 0, std, 1.0)
    return (train - mean) / std, (test - mean) / std, mean, std


def load_split(data_dir, dataset, split):
    """Split ``split`` of ``dataset``, normalised with training statistics only, as float32 arrays."""
    folder = Path(data_dir) / dataset
    data = np.loadtxt(folder / "data.txt", ndmin=2)
    features = _read_ints(folder / "index_features.txt")
    target = _read_ints(folder / "index_target.txt")[0]
    train = _read_ints(folder / f"index_train_{split}.txt")
    test = _read_ints(folder / f"index_test_{split}.txt")
    return normalised_split(data[np.ix_(train, features)], data[train, target][:, None],
                            data[np.ix_(test, features)], data[test, target][:, None])


def normalised_split(x_train, y_train, x_test, y_test):
    """A :class:`Split` of raw arrays (targets of shape (n, 1)), normalised with training statistics."""
    x_train, x_test, _, _ = _standardise(x_train, x_test)
    y_train, y_test, y_mean, y_std = _standardise(y_train, y_test)
    return Split(x_train.astype(np.float32), y_train.astype(np.float32), x_test.astype(np.float32),
                 y_test.astype(np.float32), float(y_mean[0]), float(y_std[0]))


def _learning_rate(total_steps):
    """NNG App. C.1: ``LEARNING_RATE``, multiplied by ``LEARNING_RATE_DECAY`` for the second half:
    the first ``total_steps // 2`` updates (schedule steps 0, 1, ...) take the full rate."""
    return keras.optimizers.schedules.PiecewiseConstantDecay(
        [max(total_steps // 2 - 1, 0)], [LEARNING_RATE, LEARNING_RATE * LEARNING_RATE_DECAY])


# Constructor arguments the protocol fixes for every method (``--mc-samples`` sets mc_samples);
# ``--set`` may not change them.
SHARED_ARGUMENTS = ("learning_rate", "num_examples", "prior_variance", "prior_precision", "kl_weight",
                    "seed", "mc_samples")


def hyper_parameters(method, overrides=None):
    """``method``'s constructor arguments: its ``METHODS`` entry updated with ``overrides``."""
    return {**METHODS[method].hyper_parameters, **(overrides or {})}


def _make_optimizer(method, num_examples, total_steps, seed, mc_samples=1, overrides=None):
    spec = METHODS[method]
    arguments = hyper_parameters(method, overrides)
    if not spec.bayesian:
        if mc_samples != 1:
            raise ValueError(f"{method} is a MAP method: it draws no weight samples (mc_samples=1 only).")
        optimizer_class = getattr(keras.optimizers, spec.optimizer)
        return optimizer_class(learning_rate=_learning_rate(total_steps), **arguments)
    optimizer_class = getattr(tfnng.optimizers, spec.optimizer)
    return optimizer_class(learning_rate=_learning_rate(total_steps), num_examples=num_examples,
                           prior_variance=PRIOR_VARIANCE, kl_weight=KL_WEIGHT, seed=seed,
                           mc_samples=mc_samples, **arguments)


def _make_model(method, num_inputs, num_hidden, num_examples):
    """``Input -> Dense(H, relu) -> Dense(1) -> NoisePrecision(N)``.

    For a MAP method the prior N(0, PRIOR_VARIANCE) becomes the L2 penalty
    ``KL_WEIGHT / (2 PRIOR_VARIANCE N)`` per weight, the prior's share of the per-example mean loss.
    """
    regularizer = None
    if not METHODS[method].bayesian:
        regularizer = keras.regularizers.L2(KL_WEIGHT / (2.0 * PRIOR_VARIANCE * num_examples))
    dense = dict(kernel_regularizer=regularizer, bias_regularizer=regularizer)
    net = keras.Sequential([
        keras.Input((num_inputs,)),
        keras.layers.Dense(num_hidden, activation="relu", **dense),
        keras.layers.Dense(1, **dense),
        tfnng.layers.NoisePrecision(num_examples, kl_weight=KL_WEIGHT),
    ])
    return net


def _training_batches(data, batch_size, epochs, seed, mc_samples=1):
    """All ``epochs`` of shuffled mini-batches as one ``tf.data`` pipeline (reshuffled every epoch),
    each batch ``mc_samples`` times in a row (one evaluation per weight sample).

    One ``model.fit`` epoch over this pipeline avoids Keras' per-epoch overhead, which dominates on
    these small data sets.
    """
    batches = (tf.data.Dataset.from_tensor_slices((data.x_train, data.y_train))
               .shuffle(len(data.x_train), seed=seed, reshuffle_each_iteration=True)
               .batch(batch_size))
    if mc_samples > 1:
        # flat_map hides the length, and Keras then warns that the input "ran out of data".
        length = math.ceil(len(data.x_train) / batch_size) * mc_samples
        batches = (batches.flat_map(lambda x, y: tf.data.Dataset.from_tensors((x, y)).repeat(mc_samples))
                   .apply(tf.data.experimental.assert_cardinality(length)))
    return batches.repeat(epochs).prefetch(tf.data.AUTOTUNE)


def train_and_evaluate(data, method, epochs, batch_size, num_hidden, seed, verbose=0,
                       num_predictive_samples=NUM_PREDICTIVE_SAMPLES, mc_samples=1, overrides=None):
    """Train ``method`` on a normalised :class:`Split`; test metrics in original units and timings.

    Returns test RMSE, per-point test log-likelihood, the coverage of the central 95% predictive
    interval (Gaussian interval with the total predictive variance), a divergence flag, timings and
    the optimizer's configuration.
    """
    num_examples, num_inputs = data.x_train.shape
    keras.utils.set_random_seed(seed)
    steps_per_epoch = math.ceil(num_examples / batch_size)
    model = _make_model(method, num_inputs, num_hidden, num_examples)
    # Learning-rate schedules of tfnng optimizers count posterior updates, not evaluations.
    optimizer = _make_optimizer(method, num_examples, epochs * steps_per_epoch, seed=seed,
                                mc_samples=mc_samples, overrides=overrides)
    if getattr(optimizer, "curvature_requirements", None) is not None:
        # Layer inputs and per-example pre-activation gradients come from BayesianModel.
        model = tfnng.BayesianModel(model)
    model.compile(optimizer=optimizer, loss=tfnng.losses.GaussianNLL("learned"),
                  steps_per_execution=steps_per_epoch * mc_samples)
    start = time.perf_counter()
    model.fit(_training_batches(data, batch_size, epochs, seed=seed, mc_samples=mc_samples), epochs=1,
              shuffle=False, verbose=verbose)
    train_seconds = time.perf_counter() - start

    start = time.perf_counter()
    # A model compiled with a plain Keras optimizer (MAP) gets one deterministic sample.
    prediction = tfnng.predict(model, data.x_test, num_samples=num_predictive_samples)
    mean = np.asarray(prediction.mean, dtype=np.float64)
    diverged = not np.all(np.isfinite(prediction.outputs))
    # A diverged run (non-finite outputs) is recorded as NaN rather than stopping the benchmark.
    test_ll = math.nan if diverged else float(np.mean(prediction.log_likelihood(data.y_test)))
    coverage = math.nan if diverged else tfnng.metrics.coverage(
        data.y_test, mean, np.sqrt(prediction.variance), level=0.95)
    predict_seconds = time.perf_counter() - start
    return {
        "n_train": num_examples,
        "n_test": len(data.x_test),
        "rmse": data.y_std * float(np.sqrt(np.mean((mean - data.y_test) ** 2))),
        "test_ll": test_ll - math.log(data.y_std),
        "coverage_95": float(coverage),
        "diverged": diverged,
        "train_seconds": train_seconds,
        "predict_seconds": predict_seconds,
        "optimizer_config": keras.optimizers.serialize(optimizer),
    }


def run_split(data_dir, dataset, split, method, epochs, batch_size, num_hidden,
              num_predictive_samples=NUM_PREDICTIVE_SAMPLES, mc_samples=1, overrides=None):
    """Train ``method`` on standard split ``split`` of ``dataset`` (seeded by the split number)."""
    data = load_split(data_dir, dataset, split)
    return {"split": split,
            **train_and_evaluate(data, method, epochs, batch_size, num_hidden, seed=split,
                                 num_predictive_samples=num_predictive_samples, mc_samples=mc_samples,
                                 overrides=overrides)}


def parse_setting(text):
    """argparse type of ``--set``: ``NAME=VALUE`` as ``(NAME, value)``; the value is read as a Python
    literal (``0.9``, ``None``, ``True``), else kept as a string (``fisher=empirical``)."""
    name, equals, value = text.partition("=")
    name = name.strip()
    if not equals or not name.isidentifier():
        raise argparse.ArgumentTypeError(f"{text!r} is not NAME=VALUE")
    if name in SHARED_ARGUMENTS:
        raise argparse.ArgumentTypeError(
            f"{name} is a protocol setting shared by every method ({', '.join(SHARED_ARGUMENTS)}); "
            "--mc-samples sets mc_samples")
    try:
        return name, ast.literal_eval(value.strip())
    except (ValueError, SyntaxError):
        return name, value.strip()


def check_optimizer(method, mc_samples=1, overrides=None):
    """Exit with a clear message unless ``method``'s optimizer accepts ``mc_samples`` weight samples per
    batch (the MAP baseline draws none) and the ``overrides`` of ``--set``."""
    try:
        _make_optimizer(method, num_examples=1, total_steps=1, seed=0, mc_samples=mc_samples,
                        overrides=overrides)
    except (TypeError, ValueError) as error:
        given = [f"--mc-samples {mc_samples}"] + [f"--set {k}={v!r}" for k, v in (overrides or {}).items()]
        raise SystemExit(f"{method} with {' '.join(given)}: {error}") from None


def run_benchmark(data_dir, dataset, method, splits=None, epochs=EPOCHS, batch_size=None, first_split=0,
                  num_predictive_samples=NUM_PREDICTIVE_SAMPLES, mc_samples=1, overrides=None):
    """Standard splits ``first_split, first_split + 1, ...`` (all, or ``splits`` of them) of one data set
    for one method (its constructor arguments updated with ``overrides``), with a summary."""
    check_dataset(data_dir, dataset, first_split, splits)
    rows, n_splits, num_hidden = dataset_info(data_dir, dataset)
    if splits is not None and splits < 1:
        raise SystemExit(f"--splits {splits}: run at least one split")
    if num_predictive_samples < 1:
        raise SystemExit(f"--predictive-samples {num_predictive_samples}: use at least one sample")
    check_optimizer(method, mc_samples, overrides)
    split_ids = _split_ids(n_splits, first_split, splits)
    if splits is not None and len(split_ids) < splits:
        print(f"{dataset} has splits 0 to {n_splits - 1}: running {len(split_ids)} of the {splits} "
              f"asked for, from split {first_split}", flush=True)
    if batch_size is None:
        batch_size = SMALL_BATCH_SIZE if rows < SMALL_DATASET_ROWS else LARGE_BATCH_SIZE
    per_split = []
    for split in split_ids:
        result = run_split(data_dir, dataset, split, method, epochs, batch_size, num_hidden,
                           num_predictive_samples, mc_samples, overrides)
        optimizer_config = result.pop("optimizer_config")  # the same for all splits but N, seed, decay step
        per_split.append(result)
        print(f"{dataset} {method} split {split}: RMSE {result['rmse']:.4f}  test LL {result['test_ll']:.4f}  "
              f"({result['train_seconds']:.1f} s train, {result['predict_seconds']:.1f} s predict)", flush=True)
    rmse, rmse_se = _results.mean_and_standard_error([r["rmse"] for r in per_split])
    ll, ll_se = _results.mean_and_standard_error([r["test_ll"] for r in per_split])
    return {
        "dataset": dataset, "method": method,
        "hyper_parameters": hyper_parameters(method, overrides), "overrides": dict(overrides or {}),
        "source": METHODS[method].source,
        "optimizer_config": optimizer_config,
        "n_splits": len(per_split), "n_hidden": num_hidden, "epochs": epochs, "batch_size": batch_size,
        "mc_samples": mc_samples, "rmse": rmse, "rmse_se": rmse_se, "test_ll": ll, "test_ll_se": ll_se,
        "diverged_splits": sum(r["diverged"] for r in per_split),
        "seconds": sum(r["train_seconds"] + r["predict_seconds"] for r in per_split),
        "splits": per_split,
    }


def _references(dataset):
    """Published (RMSE, se, LL, se) tuples for ``dataset``, keyed by a short label with its source."""
    refs = {f"{name} (NNG Table 1)": values for name, values in NNG_TABLE_1[dataset].items()}
    refs["MC dropout (uci/README)"] = MC_DROPOUT[dataset]
    return refs


def _table_rows(summaries):
    rows = []
    for dataset in dict.fromkeys(s["dataset"] for s in summaries):
        for s in (s for s in summaries if s["dataset"] == dataset):
            settings = ", ".join([f"{k}={v!r}" for k, v in s["overrides"].items()]
                                 + ([f"mc_samples={s['mc_samples']}"] if s["mc_samples"] > 1 else []))
            label = s["method"] + (f" ({settings})" if settings else "")
            rows.append([dataset, label, s["n_splits"], s["epochs"], s["batch_size"],
                         _results.format_mean_se(s["rmse"], s["rmse_se"]),
                         _results.format_mean_se(s["test_ll"], s["test_ll_se"]), f"{s['seconds']:.0f}"])
        for label, (rmse, rmse_se, ll, ll_se) in _references(dataset).items():
            digits = 2 if label.startswith("MC dropout") else 3     # as published
            rows.append([dataset, label, "", "", "", _results.format_mean_se(rmse, rmse_se, digits),
                         _results.format_mean_se(ll, ll_se, digits), ""])
    return rows


def _parse_list(text, all_values, resolve):
    """Names in the comma-separated ``text`` checked by ``resolve``; ``all`` gives ``all_values``."""
    if text == "all":
        return list(all_values)
    return [resolve(name) for name in text.split(",")]


def _resolve_method(name):
    if name not in METHODS:
        raise ValueError(f"unknown method {name!r}; choose from {', '.join(METHODS)} or 'all'")
    return name


def add_arguments(parser):
    """Command-line options of ``python -m tfnng.bench uci``."""
    parser.add_argument("--data-dir", default="../shared/datasets/uci",
                        help="folder holding one sub-folder per data set (default: %(default)s)")
    parser.add_argument("--dataset", required=True,
                        help=f"comma-separated data set names ({', '.join(DATASETS)}; 'boston' works) or 'all'")
    parser.add_argument("--method", default="noisy_adam",
                        help=f"comma-separated methods ({', '.join(METHODS)}) or 'all' (default: %(default)s)")
    parser.add_argument("--splits", type=_results.positive_int, default=None,
                        help="use only K standard splits")
    parser.add_argument("--first-split", type=_results.non_negative_int, default=0,
                        help="index of the first split to run (default: 0); with --splits K, runs K splits from it")
    parser.add_argument("--epochs", type=_results.positive_int, default=None,
                        help=f"training epochs (default: {EPOCHS})")
    parser.add_argument("--batch-size", type=_results.positive_int, default=None,
                        help=f"default: {SMALL_BATCH_SIZE} below {SMALL_DATASET_ROWS} rows, else {LARGE_BATCH_SIZE}")
    parser.add_argument("--predictive-samples", type=_results.positive_int, default=NUM_PREDICTIVE_SAMPLES,
                        help="weight samples of the test predictive (default: %(default)s)")
    parser.add_argument("--mc-samples", type=_results.positive_int, default=1,
                        help="weight samples per mini-batch in training (default: %(default)s; "
                             "not for the MAP baseline)")
    parser.add_argument("--set", dest="overrides", metavar="NAME=VALUE", type=parse_setting,
                        action="append", default=[],
                        help="change one constructor argument of the methods' optimizers (repeatable; "
                             "e.g. momentum=0.9, kl_clip=None; not the shared " + ", ".join(SHARED_ARGUMENTS)
                             + ")")
    parser.add_argument("--quick", action="store_true",
                        help=f"smoke test: {QUICK_SPLITS} splits, {QUICK_EPOCHS} epochs (unless given)")
    parser.add_argument("--out", default=None,
                        help="JSON file (default: results/uci_[<data folder>_]<dataset>_<method>"
                             "_from<first split>[x<splits>]_e<epochs>.json, the data folder named "
                             "unless it is `uci`)")


def run(args):
    """Run the UCI benchmark described by the parsed ``args``; print the table and write the JSON."""
    try:
        datasets = _parse_list(args.dataset, DATASETS, resolve_dataset)
        methods = _parse_list(args.method, METHODS, _resolve_method)
    except ValueError as error:
        raise SystemExit(str(error)) from None
    _results.check_unique(datasets, "data set")
    _results.check_unique(methods, "method")
    _results.check_unique([name for name, _ in args.overrides], "--set")
    overrides = dict(args.overrides)
    splits = args.splits if args.splits is not None or not args.quick else QUICK_SPLITS
    epochs = args.epochs if args.epochs is not None else (QUICK_EPOCHS if args.quick else EPOCHS)
    # The default name says which splits and epochs it holds: "splits 0-9, then --first-split 10"
    # writes two files; and which data folder, unless the standard one (`datasets/uci`): another
    # folder's copy of a data set may hold another task (docs/benchmarks.md, naval_turbine).
    folder = Path(args.data_dir).resolve().name
    folder_tag = "" if folder == "uci" else f"{folder}_"
    split_range = f"from{args.first_split}" + ("" if splits is None else f"x{splits}")
    settings_tag = "".join(f"_{name}={value}" for name, value in overrides.items()) + "".join(
        f"_{tag}{value}" for tag, value, default in (
            ("mc", args.mc_samples, 1), ("b", args.batch_size, None),
            ("ps", args.predictive_samples, NUM_PREDICTIVE_SAMPLES)) if value != default)
    out = args.out or (f"results/uci_{folder_tag}{args.dataset.replace(',', '+')}_"
                       f"{args.method.replace(',', '+')}{settings_tag}_{split_range}"
                       f"_e{epochs}.json")
    _results.check_writable(out, "--out")
    missing = [d for d in datasets if not (Path(args.data_dir) / d).is_dir()]
    if missing:
        raise SystemExit(f"UCI data not found in {args.data_dir!r} (missing: {', '.join(missing)})")
    for dataset in datasets:           # every data set and method is checked before the first trains
        check_dataset(args.data_dir, dataset, args.first_split, splits)
    for method in methods:
        check_optimizer(method, args.mc_samples, overrides)
    summaries = [run_benchmark(args.data_dir, dataset, method, splits, epochs, args.batch_size, args.first_split,
                               args.predictive_samples, args.mc_samples, overrides)
                 for dataset in datasets for method in methods]
    _results.print_table(["dataset", "method", "splits", "epochs", "batch", "test RMSE", "test LL", "time [s]"],
                         _table_rows(summaries), title="\nUCI regression (original units, mean ± standard error)")
    settings = {
        "data_dir": str(Path(args.data_dir).resolve()), "datasets": datasets, "methods": methods,
        "splits": splits, "first_split": args.first_split, "epochs": epochs, "batch_size": args.batch_size,
        "quick": args.quick,
        "learning_rate": LEARNING_RATE, "learning_rate_decay_second_half": LEARNING_RATE_DECAY,
        "prior_variance": PRIOR_VARIANCE, "kl_weight": KL_WEIGHT,
        "num_predictive_samples": args.predictive_samples, "mc_samples": args.mc_samples,
        "overrides": overrides,
    }
    references = {d: _references(d) for d in datasets}
    _results.write_json(out, "uci", args.command, settings,
                        {"summaries": summaries, "references": references}, code=args.code)
