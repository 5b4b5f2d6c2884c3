"""NoisyAdam with Alg. 1's per-example Fisher, through BayesianModel: exact checks."""

import numpy as np
import pytest
import tensorflow as tf
import keras

import tfnng


def test_one_step_fisher_equals_brute_force_mean_of_squared_per_example_gradients():
    """With beta_2 = 0 and f_0 = 0, f after one step is the estimate itself: (1/B) sum_n g_n^2."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(6, 3))
    y = rng.normal(size=(6, 2))
    keras.utils.set_random_seed(0)
    net = keras.Sequential([keras.Input((3,), dtype="float64"),
                            keras.layers.Dense(4, activation="tanh", dtype="float64"),
                            keras.layers.Dense(2, dtype="float64")])
    loss = tfnng.losses.GaussianNLL(noise_variance=0.5)
    brute = [np.zeros(v.shape) for v in net.trainable_variables]
    for n in range(len(x)):                                  # a Python loop over single examples
        with tf.GradientTape() as tape:
            nll = tf.reduce_sum(loss.call(y[n:n + 1], net(x[n:n + 1])))
        for acc, g in zip(brute, tape.gradient(nll, net.trainable_variables)):
            acc += g.numpy() ** 2 / len(x)
    model = tfnng.BayesianModel(net)
    optimizer = tfnng.optimizers.NoisyAdam(learning_rate=0.0, num_examples=100, beta_2=0.0,
                                           fisher="empirical")
    model.compile(optimizer=optimizer, loss=loss)
    model.fit(x, y, batch_size=6, epochs=1, verbose=0, shuffle=False)
    for i, want in enumerate(brute):
        # Keras's data adapter feeds the batch in float32: agreement to float32 rounding.
        np.testing.assert_allclose(optimizer._slot("fisher", i).numpy(), want, rtol=2e-6)
    gm = optimizer._slot("fisher", 0).numpy()
    assert not np.allclose(gm, np.square(np.mean(brute[0])))   # not the squared batch gradient


def test_true_fisher_stddev_converges_to_the_exact_mean_field_stddev():
    """Gaussian likelihood, known noise: E[g_n^2] under sampled targets is x_n^2 / s2, so Alg. 1's
    fixed point is sigma^2 = 1 / (diag(X^T X)/s2 + 1/eta), the optimal mean-field variance."""
    n, d, noise_var = 100, 3, 0.25
    rng = np.random.default_rng(1)
    x = (rng.normal(size=(n, d)) * np.array([1.0, 0.5, 2.0])).astype("float32")
    y = (x @ np.array([0.5, -1.0, 2.0]) + 0.5 * rng.normal(size=n)).astype("float32")[:, None]
    precision = x.T.astype(float) @ x / noise_var + np.eye(d)
    exact_mean = np.linalg.solve(precision, x.T.astype(float) @ y[:, 0] / noise_var)
    keras.utils.set_random_seed(0)
    net = keras.Sequential([keras.Input((d,)), keras.layers.Dense(1, use_bias=False)])
    model = tfnng.BayesianModel(net)
    steps = 3000
    optimizer = tfnng.optimizers.NoisyAdam(
        learning_rate=keras.optimizers.schedules.PolynomialDecay(0.01, steps, 1e-5, power=2.0),
        num_examples=n, beta_2=0.999, hess_init=1.0, fisher="true", seed=0)
    model.compile(optimizer=optimizer, loss=tfnng.losses.GaussianNLL(noise_variance=noise_var))
    # One epoch of `steps` full-batch steps: 3000 one-step epochs cost ~40x more in Keras's loop.
    model.fit(tf.data.Dataset.from_tensors((x, y)).repeat(steps), epochs=1, verbose=0)
    kernel = net.layers[0].kernel
    mf_sd = 1 / np.sqrt(np.diag(precision))
    np.testing.assert_allclose(optimizer.posterior_stddev(kernel).numpy()[:, 0], mf_sd, rtol=0.1)
    error_in_sds = np.abs(optimizer.posterior_mean(kernel).numpy()[:, 0] - exact_mean) / mf_sd
    assert error_in_sds.max() < 0.25, error_in_sds


def test_fisher_requires_bayesian_model_and_valid_type():
    with pytest.raises(ValueError, match="fisher"):
        tfnng.optimizers.NoisyAdam(num_examples=10, fisher="exact")
    net = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    net.compile(optimizer=tfnng.optimizers.NoisyAdam(num_examples=10, fisher="true"),
                loss=tfnng.losses.GaussianNLL())
    with pytest.raises(ValueError, match="BayesianModel"):
        net.fit(np.zeros((4, 2)), np.zeros((4, 1)), verbose=0)


def test_layer_without_per_example_path_falls_back_to_the_squared_batch_gradient():
    """BatchNormalization's gamma has no fast per-example path: f = beta_2 f_0 + (1 - beta_2) g^2, g the tape gradient."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(16, 3))
    y = rng.normal(size=(16, 1))
    keras.utils.set_random_seed(0)
    net = keras.Sequential([keras.Input((3,), dtype="float64"),
                            keras.layers.Dense(4, activation="tanh", dtype="float64"),
                            keras.layers.BatchNormalization(dtype="float64"),
                            keras.layers.Dense(1, dtype="float64")])
    loss = tfnng.losses.GaussianNLL(noise_variance=0.5)
    gamma = net.layers[1].gamma
    with tf.GradientTape() as tape:
        mean_nll = tf.reduce_mean(loss.call(y, net(x, training=True)))
    g = tape.gradient(mean_nll, gamma).numpy()
    model = tfnng.BayesianModel(net)
    optimizer = tfnng.optimizers.NoisyAdam(learning_rate=0.0, num_examples=100, beta_2=0.9,
                                           hess_init=1.0, fisher="true", seed=0)
    model.compile(optimizer=optimizer, loss=loss)
    model.fit(x, y, batch_size=16, epochs=1, verbose=0, shuffle=False)
    fisher = optimizer._slot("fisher", optimizer._get_variable_index(gamma)).numpy()
    np.testing.assert_allclose(fisher - 0.9 * 1.0, 0.1 * g ** 2, rtol=1e-4, atol=1e-9)
