"""Shared pytest configuration and fixtures."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402  (after the log level is set)
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402


@pytest.fixture
def wide_mlp_and_one_batch():
    """A freshly seeded 100-64-64-10 ReLU MLP and one batch of 32 standard-normal inputs with random
    labels out of 10, repeated: the setting in which the default damping / initial curvature of the
    noisy optimizers is tested with a large ``num_examples``."""
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((32, 100)).astype("float32")
    y = rng.integers(0, 10, 32)
    net = keras.Sequential([keras.Input((100,)), keras.layers.Dense(64, activation="relu"),
                            keras.layers.Dense(64, activation="relu"), keras.layers.Dense(10)])
    return net, tf.data.Dataset.from_tensors((x, y)).repeat()


@pytest.fixture
def float64_keras():
    """Keras's floatx and dtype policy set to float64 for the test (Keras adds the regularisation
    losses in floatx; a policy set by an earlier test would override floatx)."""
    floatx, policy = keras.backend.floatx(), keras.config.dtype_policy()
    keras.backend.set_floatx("float64")
    keras.config.set_dtype_policy("float64")
    yield
    keras.backend.set_floatx(floatx)
    keras.config.set_dtype_policy(policy)
