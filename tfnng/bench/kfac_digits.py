"""Image classification on scikit-learn's digits: noisy K-FAC vs baselines (accuracy, NLL, ECE, reliability).

Protocol: the 1797 8x8 images of ``sklearn.datasets.load_digits`` (pixel values / 16), a stratified
train/test split (``--test-fraction``, seeded), a small CNN (Conv2D 16 3x3 same ReLU, MaxPool 2,
Conv2D 32 3x3 ReLU, Flatten, Dense 64 ReLU, Dense 10 logits) trained with ``CategoricalNLL`` for
``--epochs`` epochs at batch size ``--batch-size``. Methods (``METHODS``): ``noisy_kfac`` (NNG-MVG,
``tfnng.BayesianModel`` + ``NoisyKFAC``, T_stats = 10, T_inv = 200, beta~ = 0.01 and the KL-clipped
step size as NNG App. C.2),
``kfac`` (point estimate, the same machinery without noise, L2 equal to noisy K-FAC's intrinsic
damping as in NNG sec. 5.2), ``noisy_adam`` (NoisyAdam with ``fisher=None``, in a
``tfnng.BayesianModel`` like the others, so its reported loss includes the KL term: the squared batch
gradient stands in for Alg. 1's per-example Fisher, so not NNG-FFG as published) and ``adam`` (MAP,
L2 from the same prior).
The Bayesian methods predict with ``--num-samples`` weight samples (``tfnng.predict``). Reported per
method: test accuracy, test NLL per example (of the Monte Carlo predictive), expected calibration
error (15 bins, Guo et al. 2017) and training time; a reliability diagram of every method is written to
``--png``, the numbers to ``--out`` (JSON).

Example: ``python -m tfnng.bench kfac_digits --epochs 30``
"""

import math
import time
from pathlib import Path

import keras
import numpy as np

import tfnng
from tfnng import metrics as _metrics
from tfnng.bench import _results

METHODS = ("noisy_kfac", "kfac", "noisy_adam", "adam")
NUM_CLASSES = 10
PRIOR_VARIANCE = 1.0
KL_WEIGHT = 1.0


def load(test_fraction=0.3, seed=0):
    """Digits as ``(x_train, x_test, y_train, y_test)`` (scikit-learn's order): images
    ``(n, 8, 8, 1)`` in [0, 1], int labels."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    x = (digits.images / 16.0).astype("float32")[..., None]
    test_size = math.ceil(test_fraction * len(x))           # scikit-learn's rounding
    if min(test_size, len(x) - test_size) < NUM_CLASSES:
        raise ValueError(f"a test fraction of {test_fraction} leaves {test_size} of the {len(x)} "
                         f"images for testing, {len(x) - test_size} for training: the stratified "
                         f"split needs at least {NUM_CLASSES} (one per class) on each side.")
    return train_test_split(x, digits.target.astype("int32"), test_size=test_fraction,
                            stratify=digits.target, random_state=seed)


def make_net(regularizer=None):
    """The CNN of the module docstring (optionally with an L2 regularizer on every kernel/bias)."""
    reg = dict(kernel_regularizer=regularizer, bias_regularizer=regularizer)
    return keras.Sequential([
        keras.Input((8, 8, 1)),
        keras.layers.Conv2D(16, 3, padding="same", activation="relu", **reg),
        keras.layers.MaxPooling2D(),
        keras.layers.Conv2D(32, 3, activation="relu", **reg),
        keras.layers.Flatten(),
        keras.layers.Dense(64, activation="relu", **reg),
        keras.layers.Dense(NUM_CLASSES, **reg),
    ], name="digits_cnn")


def make_model(method, num_examples, learning_rate, seed, steps_per_epoch=1):
    """The compiled model of one method.

    The K-FAC methods use the KL-clipped step size of NNG App. C.2 (eq. 26) with the paper's
    CIFAR-10 settings without batch norm: c_0 = 0.001 decayed by zeta = 0.95 every epoch, maximum
    step size = the learning rate (0.01). Without it the first natural-gradient steps, damped only by
    gamma_in = 1/N, diverge.
    """
    gamma_in = KL_WEIGHT / (num_examples * PRIOR_VARIANCE)
    clip = dict(kl_clip=1e-3, kl_clip_decay=0.95, kl_clip_decay_steps=steps_per_epoch)
    if method == "noisy_kfac":
        model = tfnng.BayesianModel(make_net())
        optimizer = tfnng.optimizers.NoisyKFAC(
            learning_rate=learning_rate, num_examples=num_examples, prior_variance=PRIOR_VARIANCE,
            kl_weight=KL_WEIGHT, stat_decay=0.01, stats_every=10, inverse_every=200, seed=seed,
            **clip)
    elif method == "kfac":
        model = tfnng.BayesianModel(make_net())
        optimizer = tfnng.optimizers.KFAC(learning_rate=learning_rate, damping=1e-3, l2=gamma_in,
                                          stat_decay=0.01, stats_every=10, inverse_every=200, **clip)
    elif method == "noisy_adam":
        model = tfnng.BayesianModel(make_net())
        optimizer = tfnng.optimizers.NoisyAdam(learning_rate=learning_rate, num_examples=num_examples,
                                               prior_variance=PRIOR_VARIANCE, kl_weight=KL_WEIGHT,
                                               seed=seed)
    elif method == "adam":
        model = make_net(keras.regularizers.L2(gamma_in / 2.0))
        optimizer = keras.optimizers.Adam(learning_rate=learning_rate)
    else:
        raise ValueError(f"unknown method {method!r}; choose from {', '.join(METHODS)}")
    model.compile(optimizer=optimizer, loss=tfnng.losses.CategoricalNLL())
    return model


DEFAULT_LEARNING_RATES = {"noisy_kfac": 0.01, "kfac": 0.01, "noisy_adam": 0.01, "adam": 1e-3}


def run_method(method, data, epochs, batch_size, num_samples, seed):
    x_train, x_test, y_train, y_test = data
    keras.utils.set_random_seed(seed)
    model = make_model(method, len(x_train), DEFAULT_LEARNING_RATES[method], seed,
                       steps_per_epoch=math.ceil(len(x_train) / batch_size))
    start = time.perf_counter()
    model.fit(x_train, y_train, batch_size=batch_size, epochs=epochs, verbose=0)
    seconds = time.perf_counter() - start
    prediction = tfnng.predict(model, x_test, num_samples=num_samples)
    probs = prediction.probs
    nll = -float(np.mean(prediction.log_likelihood(y_test)))
    return {
        "method": method,
        "accuracy": _metrics.accuracy(y_test, probs),
        "nll": nll,
        "ece": _metrics.expected_calibration_error(y_test, probs),
        "train_seconds": seconds,
        "reliability": _metrics.reliability_diagram_data(y_test, probs)._asdict(),
    }


def plot_reliability(rows, path):
    """One reliability diagram per method (accuracy vs confidence per bin) in a PNG; empty bins have
    no bar."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(rows), figsize=(3.2 * len(rows), 3.4), squeeze=False)
    for ax, row in zip(axes[0], rows):
        diagram = row["reliability"]
        edges = np.asarray(diagram["bin_edges"])
        filled = np.asarray(diagram["counts"]) > 0
        ax.bar(edges[:-1][filled], np.asarray(diagram["accuracy"], dtype=float)[filled],
               width=np.diff(edges)[filled], align="edge", edgecolor="k", alpha=0.7, label="accuracy")
        ax.plot([0, 1], [0, 1], "r--", label="perfect calibration")
        ax.set_title(f"{row['method']}\nacc {row['accuracy']:.3f}  ECE {row['ece']:.3f}", fontsize=9)
        ax.set_xlabel("confidence")
        ax.set_xlim(0, 1)
        ax.set_ylim(0, 1)
    axes[0][0].set_ylabel("accuracy")
    axes[0][0].legend(loc="upper left", fontsize=7)
    fig.tight_layout()
    Path(path).resolve().parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def add_arguments(parser):
    """Command-line options of ``python -m tfnng.bench kfac_digits``."""
    parser.add_argument("--methods", default=",".join(METHODS),
                        help="comma-separated methods (default: %(default)s)")
    parser.add_argument("--epochs", type=_results.positive_int, default=30,
                        help="training epochs (default: %(default)s)")
    parser.add_argument("--batch-size", type=_results.positive_int, default=32,
                        help="batch size (default: %(default)s)")
    parser.add_argument("--num-samples", type=_results.positive_int, default=50,
                        help="predictive weight samples (default: %(default)s)")
    parser.add_argument("--test-fraction", type=_results.open_fraction, default=0.3,
                        help="(default: %(default)s)")
    parser.add_argument("--seed", type=_results.non_negative_int, default=0, help="(default: %(default)s)")
    parser.add_argument("--png", default=None,
                        help="reliability diagram PNG (default: beside --out, <out>_reliability.png)")
    parser.add_argument("--out", default="results/kfac_digits.json", help="JSON (default: %(default)s)")


def run(args):
    """Train every method, print the table, write the JSON and the reliability diagram PNG."""
    methods = _results.parse_names(args.methods, METHODS, "method(s)")
    if args.png is None:
        args.png = str(Path(args.out).with_name(Path(args.out).stem + "_reliability.png"))
    if Path(args.png).resolve() == Path(args.out).resolve():
        raise SystemExit(f"--png and --out name the same file, {args.out}.")
    _results.check_writable(args.out, "--out")
    _results.check_figure_path(args.png, "--png")
    try:
        data = load(args.test_fraction, args.seed)
    except ValueError as error:
        raise SystemExit(f"--test-fraction {args.test_fraction}: {error}") from None
    rows = [run_method(m, data, args.epochs, args.batch_size, args.num_samples, args.seed)
            for m in methods]
    _results.print_table(
        ["method", "accuracy", "NLL", "ECE", "train [s]"],
        [[r["method"], f"{r['accuracy']:.4f}", f"{r['nll']:.4f}", f"{r['ece']:.4f}",
          f"{r['train_seconds']:.1f}"] for r in rows],
        title=f"\nsklearn digits, CNN, {args.epochs} epochs, batch {args.batch_size}, "
              f"{args.num_samples} predictive samples")
    settings = {key: getattr(args, key) for key in ("methods", "epochs", "batch_size", "num_samples",
                                                    "test_fraction", "seed", "png")}
    settings["methods"] = methods
    settings["learning_rates"] = DEFAULT_LEARNING_RATES
    _results.write_json(args.out, "kfac_digits", args.command, settings, {"rows": rows},
                        code=args.code)
    plot_reliability(rows, args.png)
    return rows

