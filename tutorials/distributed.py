"""Tutorial: data-parallel training with tf.distribute.MirroredStrategy.

A tfnng model trains under ``tf.distribute.MirroredStrategy`` exactly as a Keras model does: build
and compile it inside ``strategy.scope()`` and call ``fit``; ``batch_size`` is the *global* batch,
split evenly over the replicas. Each replica computes the gradient (and the curvature statistics)
of its share of the batch; tfnng then sums the gradients over the replicas and concatenates the
per-example curvature tensors (layer inputs, pre-activation gradients) of all replicas, so every
replica applies the same posterior update — that of the global batch — and draws the same weight
sample: one sample per global step, shared by all replicas. The run is therefore the single-device
run on the same global batches, up to floating-point reduction order (docs/distributed.md).

This script demonstrates it on scikit-learn's bundled diabetes regression data, with noisy Adam on a
plain Keras model and noisy K-FAC through ``tfnng.BayesianModel``: each is trained on one device
and on ``--replicas`` logical CPU devices (a single CPU split in several, so the example runs on
any machine; with GPUs, ``tf.distribute.MirroredStrategy()`` uses all of them). It prints, per
optimizer, whether the replicas hold identical weights, how far the distributed posterior is from
the single-device one, and the test RMSE and log-likelihood of the Monte Carlo predictive.

Several machines (not run here): ``tf.distribute.MultiWorkerMirroredStrategy`` works the same way.
Every worker runs the same training program, with ``MultiWorkerMirroredStrategy()`` in place of the
``MirroredStrategy`` below and its own ``TF_CONFIG`` environment variable, e.g. on the first of two
workers::

    TF_CONFIG='{"cluster": {"worker": ["host1:12345", "host2:12345"]},
                "task": {"type": "worker", "index": 0}}'

and builds the model inside that strategy's ``scope()``; the global batch is split over all
replicas of all workers, and the all-reduce and all-gather run over the network
(docs/distributed.md lists what is exchanged). Only worker 0 should write checkpoints and results.

Run: ``python tutorials/distributed.py [--replicas 2] [--epochs 40] [--smoke]`` (``--smoke`` trains
for two epochs on 128 examples; tests/test_distributed.py runs it so the tutorial cannot rot).
Logical devices can only be configured before TensorFlow initialises its devices: run it as a
script, in a fresh process.
"""

import argparse

import keras
import numpy as np
import tensorflow as tf
from sklearn.datasets import load_diabetes
from sklearn.model_selection import train_test_split
from sklearn.preprocessing import StandardScaler

import tfnng

NOISE_VARIANCE = 0.5


def configure_logical_cpus(count):
    """Split the first physical CPU into ``count`` logical devices (before TF initialises them)."""
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration() for _ in range(count)])
    return [device.name for device in tf.config.list_logical_devices("CPU")]


def load_data(smoke):
    """Standardised diabetes data (442 patients, 10 features): 352 for training (11 global batches
    of 32: a last, partial batch would be split unevenly over the replicas, and Keras weighs the
    replicas' gradients equally, see docs/distributed.md), 90 for testing."""
    x, y = load_diabetes(return_X_y=True)
    x_train, x_test, y_train, y_test = train_test_split(x, y, train_size=352, random_state=0)
    scaler, y_mean, y_std = StandardScaler().fit(x_train), y_train.mean(), y_train.std()
    x_train, x_test = scaler.transform(x_train), scaler.transform(x_test)
    y_train, y_test = (y_train - y_mean) / y_std, (y_test - y_mean) / y_std
    if smoke:
        x_train, y_train = x_train[:128], y_train[:128]
    return [a.astype("float32") for a in (x_train, y_train[:, None], x_test, y_test[:, None])]


def make_optimizer(name, num_examples):
    if name == "noisy_adam":
        return tfnng.optimizers.NoisyAdam(learning_rate=1e-2, num_examples=num_examples,
                                          hess_init=1.0, seed=0)
    return tfnng.optimizers.NoisyKFAC(learning_rate=1e-2, num_examples=num_examples,
                                      fisher="empirical", stats_every=1, inverse_every=5, seed=0)


def train(strategy, name, x, y, epochs, global_batch):
    """Build, compile and fit inside ``strategy.scope()``; the optimizer holds the posterior."""
    with strategy.scope():
        keras.utils.set_random_seed(0)
        net = keras.Sequential([keras.Input((x.shape[1],)),
                                keras.layers.Dense(50, activation="relu"),
                                keras.layers.Dense(1)])
        # Noisy K-FAC needs the layer inputs and pre-activation gradients: wrap the net.
        model = tfnng.BayesianModel(net) if name == "noisy_kfac" else net
        model.compile(optimizer=make_optimizer(name, len(x)),
                      loss=tfnng.losses.GaussianNLL(NOISE_VARIANCE))
    model.fit(x, y, batch_size=global_batch, epochs=epochs, shuffle=False, verbose=0)
    return model


def replicas_identical(model):
    """Whether every replica holds a bit-identical copy of every weight and optimizer variable."""
    for variable in model.weights + model.optimizer.variables:
        copies = [np.asarray(c) for c in getattr(variable.value, "values", (variable.value,))]
        if not all(np.array_equal(copies[0], c) for c in copies[1:]):
            return False
    return True


def posterior_deviation(model_a, model_b):
    """max |mu_a - mu_b| / max |mu_a| over the posterior means of all trainable weights."""
    means = [[np.asarray(m.optimizer.posterior_mean(v)) for v in m.trainable_weights]
             for m in (model_a, model_b)]
    return max(np.max(np.abs(a - b)) / np.max(np.abs(a)) for a, b in zip(*means))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=40)
    parser.add_argument("--batch-size", type=int, default=32, help="global batch size")
    parser.add_argument("--smoke", action="store_true", help="two epochs on 128 examples")
    args = parser.parse_args(argv)
    if min(args.replicas, args.epochs, args.batch_size) < 1:
        parser.error("--replicas, --epochs and --batch-size must be at least 1")
    if args.batch_size % args.replicas:
        parser.error("--batch-size must be a multiple of --replicas (Keras splits each global "
                     "batch into equal shares)")
    x_train, y_train, x_test, y_test = load_data(args.smoke)
    if len(x_train) % args.batch_size % args.replicas:
        parser.error(f"the last, partial batch of the {len(x_train)} training examples "
                     f"({len(x_train) % args.batch_size}) must split evenly over the replicas too: "
                     "Keras weighs the replicas' gradients equally (docs/distributed.md)")
    devices = configure_logical_cpus(args.replicas)
    mirrored = tf.distribute.MirroredStrategy(devices)
    print(f"MirroredStrategy over {mirrored.num_replicas_in_sync} replicas: {devices}")
    epochs = 2 if args.smoke else args.epochs
    results = {}
    for name in ("noisy_adam", "noisy_kfac"):
        single = train(tf.distribute.get_strategy(), name, x_train, y_train, epochs,
                       args.batch_size)
        distributed = train(mirrored, name, x_train, y_train, epochs, args.batch_size)
        prediction = tfnng.predict(distributed, x_test, num_samples=20 if args.smoke else 100)
        results[name] = {
            "replicas_identical": replicas_identical(distributed),
            "deviation_from_single_device": float(posterior_deviation(single, distributed)),
            "rmse": float(np.sqrt(np.mean((prediction.mean - y_test) ** 2))),
            "test_log_likelihood": float(np.mean(prediction.log_likelihood(y_test))),
        }
        r = results[name]
        print(f"{name}: replicas identical: {r['replicas_identical']}; posterior means vs "
              f"single device: max relative difference {r['deviation_from_single_device']:.1e}; "
              f"test RMSE {r['rmse']:.3f}, test log-likelihood {r['test_log_likelihood']:.3f} "
              "(standardised targets)")
    return results


if __name__ == "__main__":
    main()
