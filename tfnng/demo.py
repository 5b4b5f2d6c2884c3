"""Quick demo: Bayesian regression on scikit-learn's bundled diabetes data (no network needed).

Trains one net (one hidden layer of 50 ReLU units and the Gamma noise-precision posterior of NNG
App. C.1) with Keras Adam (a MAP point estimate) and with tfnng's noisy-natural-gradient optimizers,
with Keras progress bars, then compares test RMSE, per-point test log-likelihood and the coverage of
the central 95% predictive interval (a calibrated model covers about 95% of the test targets).
Training and evaluation are the UCI benchmark's (``tfnng.bench.uci.train_and_evaluate``).

Run: ``python -m tfnng.demo [--epochs 100] [--methods adam,noisy_adam,vadam,ivon]``
"""

import argparse

from sklearn.datasets import load_diabetes
from sklearn.model_selection import train_test_split

from tfnng.bench import _results, uci


def diabetes_split(seed=0):
    """80/20 split of scikit-learn's diabetes data (442 x 10), normalised with training statistics."""
    x, y = load_diabetes(return_X_y=True)
    x_train, x_test, y_train, y_test = train_test_split(x, y[:, None], test_size=0.2,
                                                        random_state=seed)
    return uci.normalised_split(x_train, y_train, x_test, y_test)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m tfnng.demo",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=_results.positive_int, default=100)
    parser.add_argument("--methods", default="adam,noisy_adam,vadam,ivon",
                        help=f"comma-separated, from {', '.join(uci.METHODS)}")
    args = parser.parse_args(argv)
    methods = args.methods.split(",")
    unknown = sorted(set(methods) - set(uci.METHODS))
    if unknown:
        parser.error(f"unknown method(s) {', '.join(unknown)}")
    repeated = sorted({m for m in methods if methods.count(m) > 1})
    if repeated:
        parser.error(f"method(s) {', '.join(repeated)} given more than once")
    data = diabetes_split()
    results = {}
    for method in methods:
        print(f"\n{method}: {uci.METHODS[method].optimizer}, {args.epochs} epochs")
        results[method] = uci.train_and_evaluate(data, method, epochs=args.epochs, batch_size=10,
                                                 num_hidden=50, seed=0, verbose=1)
    print(f"\nDiabetes, {len(data.x_train)} training / {len(data.x_test)} test points "
          "(test metrics in original units)")
    print(f"{'method':<12}{'test RMSE':>11}{'test LL':>10}{'95% coverage':>14}{'train [s]':>11}")
    for method, r in results.items():
        print(f"{method:<12}{r['rmse']:>11.2f}{r['test_ll']:>10.3f}{r['coverage_95']:>14.1%}"
              f"{r['train_seconds']:>11.1f}")
    return results


if __name__ == "__main__":
    main()
