"""Tutorial: regression with uncertainty on a 1-D toy problem.

A small Keras net is trained by noisy natural gradient (IVON, a mean-field Gaussian posterior over all
weights) on noisy samples of a sine with a gap in the inputs. ``tfnng.predict`` then gives the Monte
Carlo predictive: its epistemic variance (disagreement between weight samples) grows outside the
data (about 10x at |x| > 5), while the aleatoric variance (the learned noise level of
``NoisePrecision``, one number for all inputs) stays flat, near the data's noise standard deviation
of 0.1 (about 0.2). In the gap the epistemic variance does not grow (0.6-0.8x of its level near the
data with seeds 0 and 1): a mean-field posterior cannot express "in-between" uncertainty well (Foong
et al. 2019, *'In-Between' Uncertainty in Bayesian Neural Networks*). The script prints both ratios
and the aleatoric standard deviation; the plot shows both bands.

The settings matter: with 160 points, tanh units, or a constant learning rate the posterior
explained the data as noise (aleatoric sd above 1); so did seeds 0 and 1 without ``clip_radius``
(IVON's step ``m / (h + delta)`` is large wherever ``h`` is small).

Run: ``python tutorials/regression_uncertainty.py [--out bands.png] [--smoke]``
(``--smoke`` trains for a few epochs only; the test suite runs it so the tutorial cannot rot.)
"""

import argparse

import keras
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

import tfnng  # noqa: E402
from tfnng.bench import _results  # noqa: E402


def make_data(n=1000, seed=0):
    """Noisy sine on [-4, -1] U [1, 4]: no data in the gap (-1, 1)."""
    rng = np.random.default_rng(seed)
    x = np.concatenate([rng.uniform(-4, -1, n // 2), rng.uniform(1, 4, n // 2)])
    y = np.sin(x) + 0.1 * rng.normal(size=n)
    return x[:, None].astype("float32"), y[:, None].astype("float32")


def train(x, y, epochs):
    """IVON on a 1-50-50-1 ReLU net with a learned Gamma noise precision (NNG App. C.1), its
    learning rate decayed to 0 by a cosine schedule and its steps clipped, as in the IVON paper."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input((1,)),
        keras.layers.Dense(50, activation="relu"),
        keras.layers.Dense(50, activation="relu"),
        keras.layers.Dense(1),
        tfnng.layers.NoisePrecision(num_examples=len(x)),
    ])
    batch_size = 16
    steps = epochs * -(-len(x) // batch_size)
    learning_rate = keras.optimizers.schedules.CosineDecay(0.05, decay_steps=steps)
    model.compile(optimizer=tfnng.optimizers.IVON(learning_rate=learning_rate, num_examples=len(x),
                                                  hess_init=0.5, beta_2=0.999, clip_radius=0.01,
                                                  seed=0),
                  loss=tfnng.losses.GaussianNLL("learned"))
    model.fit(x, y, batch_size=batch_size, epochs=epochs, verbose=2)
    return model


def plot(x, y, grid, prediction, path):
    mean = prediction.mean[:, 0]
    epistemic = np.sqrt(prediction.epistemic_variance[:, 0])
    total = np.sqrt(prediction.variance[:, 0])
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.fill_between(grid[:, 0], mean - 2 * total, mean + 2 * total, alpha=0.2, label="±2 sd, total")
    ax.fill_between(grid[:, 0], mean - 2 * epistemic, mean + 2 * epistemic, alpha=0.4,
                    label="±2 sd, epistemic")
    ax.plot(grid[:, 0], mean, label="predictive mean")
    ax.scatter(x[:, 0], y[:, 0], s=6, c="k", label="training data")
    ax.set(xlabel="x", ylabel="y", title="IVON mean-field posterior: predictive bands")
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="regression_bands.png")
    parser.add_argument("--smoke", action="store_true", help="a few epochs only")
    args = parser.parse_args(argv)
    x, y = make_data()
    _results.check_figure_path(args.out, "--out")         # before training, not after
    model = train(x, y, epochs=3 if args.smoke else 100)
    grid = np.linspace(-6, 6, 241)[:, None].astype("float32")
    prediction = tfnng.predict(model, grid, num_samples=20 if args.smoke else 200)
    plot(x, y, grid, prediction, args.out)
    epistemic = prediction.epistemic_variance[:, 0]
    near_data = epistemic[(np.abs(grid[:, 0]) > 1.5) & (np.abs(grid[:, 0]) < 3.5)].mean()
    ratios = {"gap": epistemic[np.abs(grid[:, 0]) < 0.5].mean() / near_data,
              "outside": epistemic[np.abs(grid[:, 0]) > 5].mean() / near_data}
    aleatoric_sd = float(np.sqrt(prediction.aleatoric_variance.mean()))
    print(f"epistemic variance / its mean near the data: in the gap {ratios['gap']:.1f}, at |x| > 5 "
          f"{ratios['outside']:.1f}; aleatoric sd {aleatoric_sd:.3f}; plot written to {args.out}")
    return prediction, ratios, aleatoric_sd


if __name__ == "__main__":
    main()
