"""Tutorial: image classification with calibration (noisy K-FAC vs Adam on 8x8 digits).

A small CNN (Conv2D + Dense) classifies scikit-learn's bundled 8x8 digit images. It is trained twice:
by noisy K-FAC, which fits a matrix-variate Gaussian posterior over each layer's weights (NNG paper
sec. 3.4, Alg. 2) through ``tfnng.BayesianModel``, and by Keras Adam (a MAP point estimate with the
same Gaussian prior as L2). For both, the script reports test accuracy, negative log-likelihood and
expected calibration error (ECE), and draws their reliability diagrams
(``tfnng.metrics.reliability_diagram_data``): accuracy against confidence per bin; bars on the
diagonal are perfectly calibrated, bars above it under-confident, below it over-confident.

At ``kl_weight = 1`` (the ELBO) noisy K-FAC on these 1257 training images is under-confident: its
bars lie above the diagonal. Tempering the KL term (``--kl-weight 0.1``, NNG App. C.2) moves them
onto the diagonal and lowers the NLL and ECE.

The data split, the network and the plot are those of ``python -m tfnng.bench kfac_digits``
(``tfnng/bench/kfac_digits.py``); docs/benchmarks.md has that benchmark's measured figures.

Run: ``python tutorials/classification_calibration.py [--out reliability.png] [--epochs 30]
[--kl-weight 1.0] [--smoke]`` (``--smoke`` trains for one epoch only; the test suite runs it so the
tutorial cannot rot).
"""

import argparse
import math

import keras
import numpy as np

import tfnng
from tfnng.bench import _results, kfac_digits

PRIOR_VARIANCE = 1.0


def train_noisy_kfac(x_train, y_train, epochs, kl_weight, batch_size=32, seed=0):
    """Noisy K-FAC (NNG-MVG) with the KL-clipped step size of NNG App. C.2 (eq. 26)."""
    keras.utils.set_random_seed(seed)
    model = tfnng.BayesianModel(kfac_digits.make_net())   # captures Dense/Conv2D inputs and gradients
    model.compile(
        optimizer=tfnng.optimizers.NoisyKFAC(
            learning_rate=0.01, num_examples=len(x_train), prior_variance=PRIOR_VARIANCE,
            kl_weight=kl_weight, stat_decay=0.01, stats_every=10, inverse_every=200,
            kl_clip=1e-3, kl_clip_decay=0.95,
            kl_clip_decay_steps=math.ceil(len(x_train) / batch_size), seed=seed),
        loss=tfnng.losses.CategoricalNLL())
    model.fit(x_train, y_train, batch_size=batch_size, epochs=epochs, verbose=2)
    return model


def train_adam(x_train, y_train, epochs, batch_size=32, seed=0):
    """MAP baseline: Keras Adam with the prior N(0, PRIOR_VARIANCE I) as an L2 penalty on the mean loss."""
    keras.utils.set_random_seed(seed)
    l2 = 1.0 / (2.0 * len(x_train) * PRIOR_VARIANCE)
    model = kfac_digits.make_net(keras.regularizers.L2(l2))
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss=tfnng.losses.CategoricalNLL())
    model.fit(x_train, y_train, batch_size=batch_size, epochs=epochs, verbose=2)
    return model


def evaluate(method, model, x_test, y_test, num_samples):
    """Accuracy, NLL and ECE of the Monte Carlo predictive (one sample for the point estimate)."""
    prediction = tfnng.predict(model, x_test, num_samples=num_samples)
    return {
        "method": method,
        "probs": prediction.probs,
        "accuracy": tfnng.metrics.accuracy(y_test, prediction.probs),
        "nll": -float(np.mean(prediction.log_likelihood(y_test))),
        "ece": tfnng.metrics.expected_calibration_error(y_test, prediction.probs),
        "reliability": tfnng.metrics.reliability_diagram_data(y_test, prediction.probs)._asdict(),
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="classification_reliability.png")
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--kl-weight", type=float, default=1.0,
                        help="lambda of the ELBO; < 1 tempers the posterior (NNG App. C.2)")
    parser.add_argument("--smoke", action="store_true", help="one epoch, few predictive samples")
    args = parser.parse_args(argv)
    if args.epochs < 1:
        parser.error("--epochs must be at least 1")
    if not (math.isfinite(args.kl_weight) and args.kl_weight > 0):
        parser.error("--kl-weight must be a positive number")
    _results.check_figure_path(args.out, "--out")         # before training, not after
    epochs = 1 if args.smoke else args.epochs
    num_samples = 5 if args.smoke else 50

    x_train, x_test, y_train, y_test = kfac_digits.load()
    models = {"noisy_kfac": train_noisy_kfac(x_train, y_train, epochs, args.kl_weight),
              "adam": train_adam(x_train, y_train, epochs)}
    results = [evaluate(method, model, x_test, y_test, num_samples)
               for method, model in models.items()]

    print(f"\n{'method':<12}{'accuracy':>10}{'NLL':>10}{'ECE':>10}")
    for r in results:
        print(f"{r['method']:<12}{r['accuracy']:>10.3f}{r['nll']:>10.3f}{r['ece']:>10.3f}")
    kfac_digits.plot_reliability(results, args.out)
    print(f"reliability diagrams written to {args.out}")
    return results, y_test


if __name__ == "__main__":
    main()
