"""tfnng.callbacks: PosteriorTensorBoard's event files read back against the optimizer's state at
the time of writing, PredictiveValidation against a direct tfnng.predict + tfnng.metrics, and the
progress bar of BayesianModel (loss, nll, kl)."""

import glob
import math
import os

import numpy as np
import pytest
import tensorflow as tf
import keras

import tfnng
from tfnng import callbacks


def read_events(log_dir):
    """``{tag: [(step, plugin, value)]}`` from the event files of ``log_dir``."""
    events = {}
    for path in sorted(glob.glob(os.path.join(log_dir, "events.out.tfevents.*"))):
        for event in tf.compat.v1.train.summary_iterator(path):
            for value in event.summary.value:
                events.setdefault(value.tag, []).append(
                    (event.step, value.metadata.plugin_data.plugin_name,
                     tf.make_ndarray(value.tensor)))
    return events


def scalar_series(events, tag):
    assert all(plugin == "scalars" for _, plugin, _ in events[tag]), tag
    return {step: float(value) for step, _, value in events[tag]}


class Recorder(keras.callbacks.Callback):
    """What the optimizer holds when the callbacks run (ground truth for the event files)."""

    def __init__(self):
        super().__init__()
        self.epochs, self.batches = [], []

    def _snapshot(self, logs):
        optimizer = self.model.optimizer
        return {"logs": dict(logs), "kl": float(optimizer.kl_divergence()),
                "updates": int(optimizer._update_count.numpy()),
                "stddev": {v.path: optimizer.posterior_stddev(v).numpy()
                           for v in self.model.trainable_variables},
                "mean": {v.path: optimizer.posterior_mean(v).numpy()
                         for v in self.model.trainable_variables}}

    def on_train_batch_end(self, batch, logs=None):
        self.batches.append(self._snapshot(logs))

    def on_epoch_end(self, epoch, logs=None):
        self.epochs.append(self._snapshot(logs))


def regression_data(n=48, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 3)).astype("float32")
    y = (np.sin(x[:, :1]) + 0.3 * x[:, 1:2] + 0.1 * rng.normal(size=(n, 1))).astype("float32")
    return x, y


def classification_data(n=64, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 4)).astype("float32")
    return x, (x[:, 0] + x[:, 1] > 0).astype("int32")


def regression_net():
    return keras.Sequential([keras.Input((3,)), keras.layers.Dense(6, activation="tanh"),
                             keras.layers.Dense(1)])


def classification_net():
    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(6, activation="tanh"),
                             keras.layers.Dense(2)])


def test_tensorboard_logs_elbo_terms_schedule_damping_and_stddev_histograms(tmp_path):
    keras.utils.set_random_seed(0)
    x, y = regression_data()
    schedule = keras.optimizers.schedules.ExponentialDecay(0.05, decay_steps=1, decay_rate=0.9)
    optimizer = tfnng.optimizers.NoisyAdam(learning_rate=schedule, num_examples=len(x),
                                           kl_weight=0.5, prior_variance=2.0, seed=0)
    model = regression_net()
    model.compile(optimizer=optimizer, loss=tfnng.losses.GaussianNLL(noise_variance=0.5))
    recorder = Recorder()
    model.fit(x, y, batch_size=16, epochs=2, verbose=0, validation_data=(x[:8], y[:8]),
              callbacks=[callbacks.PosteriorTensorBoard(tmp_path), recorder])
    events = read_events(tmp_path)
    paths = [v.path for v in model.trainable_variables]
    assert set(events) == {"elbo/kl", "elbo/nll", "elbo/neg_elbo", "elbo/val_nll",
                           "optimizer/learning_rate", "optimizer/skipped_updates",
                           "optimizer/intrinsic_damping"} | {f"posterior_stddev/{p}" for p in paths}
    kl, nll = scalar_series(events, "elbo/kl"), scalar_series(events, "elbo/nll")
    for epoch, row in enumerate(recorder.epochs):
        # KL(q || N(0, eta I)) of the mean-field posterior at that time, computed independently.
        mean = np.concatenate([m.ravel() for m in row["mean"].values()]).astype(np.float64)
        var = np.concatenate([s.ravel() for s in row["stddev"].values()]).astype(np.float64) ** 2
        exact = 0.5 * np.sum(var / 2.0 + mean ** 2 / 2.0 - 1.0 - np.log(var / 2.0))
        np.testing.assert_allclose(row["kl"], exact, rtol=1e-4)
        np.testing.assert_allclose(kl[epoch], 0.5 * row["kl"] / len(x), rtol=1e-6)
        np.testing.assert_allclose(nll[epoch], row["logs"]["loss"], rtol=1e-6)
        np.testing.assert_allclose(scalar_series(events, "elbo/neg_elbo")[epoch],
                                   nll[epoch] + kl[epoch], rtol=1e-6)
        np.testing.assert_allclose(scalar_series(events, "elbo/val_nll")[epoch],
                                   row["logs"]["val_loss"], rtol=1e-6)
        assert row["updates"] == 3 * (epoch + 1)
        np.testing.assert_allclose(scalar_series(events, "optimizer/learning_rate")[epoch],
                                   0.05 * 0.9 ** row["updates"], rtol=1e-5)
        for path in paths:
            [(step, plugin, histogram)] = [e for e in events[f"posterior_stddev/{path}"]
                                           if e[0] == epoch]
            stddev = row["stddev"][path]
            assert plugin == "histograms" and histogram.shape == (30, 3)
            assert histogram[:, 2].sum() == stddev.size
            if stddev.min() < stddev.max():
                np.testing.assert_allclose([histogram[0, 0], histogram[-1, 1]],
                                           [stddev.min(), stddev.max()], rtol=1e-6)
            else:                                  # one value (the output bias): a unit bucket
                assert histogram[0, 0] < stddev.min() < histogram[-1, 1]
    assert scalar_series(events, "optimizer/intrinsic_damping") == {
        0: pytest.approx(0.5 / (len(x) * 2.0)), 1: pytest.approx(0.5 / (len(x) * 2.0))}
    assert scalar_series(events, "optimizer/skipped_updates") == {0: 0.0, 1: 0.0}


def test_tensorboard_draws_no_histogram_for_a_point_estimate(tmp_path):
    """NoisePrecision's q(tau) parameters are fitted without weight noise: their "stddev" would be
    a histogram of zeros."""
    x, y = regression_data(n=16)
    net = keras.Sequential(regression_net().layers + [tfnng.layers.NoisePrecision(len(x))])
    net.compile(optimizer=tfnng.optimizers.NoisyAdam(num_examples=len(x), seed=0),
                loss=tfnng.losses.GaussianNLL("learned"))
    net.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=[callbacks.PosteriorTensorBoard(tmp_path)])
    histograms = {tag for tag in read_events(tmp_path) if tag.startswith("posterior_stddev/")}
    assert histograms == {f"posterior_stddev/{v.path}" for v in net.trainable_variables[:-1]}
    assert "log_parameters" in net.trainable_variables[-1].path


def test_tensorboard_with_bayesian_model_kfac_every_k_batches(tmp_path):
    keras.utils.set_random_seed(1)
    x, y = classification_data()
    optimizer = tfnng.optimizers.NoisyKFAC(learning_rate=0.05, num_examples=len(x), stats_every=1,
                                           inverse_every=2, kl_clip=0.1, kl_clip_decay=0.5,
                                           kl_clip_decay_steps=2, seed=1)
    model = tfnng.BayesianModel(classification_net())
    model.compile(optimizer=optimizer, loss=tfnng.losses.CategoricalNLL())
    recorder = Recorder()
    board = callbacks.PosteriorTensorBoard(tmp_path, histogram_freq=2, update_freq=3)
    model.fit(x, y, batch_size=16, epochs=2, verbose=0, callbacks=[board, recorder])
    events = read_events(tmp_path)
    scalars = {"elbo/kl", "elbo/nll", "elbo/neg_elbo", "optimizer/learning_rate",
               "optimizer/skipped_updates", "optimizer/sampling_damping",
               "optimizer/step_damping", "optimizer/kl_clip_threshold",
               "optimizer/inverse_failures"}
    histograms = {f"posterior_stddev/{v.path}" for v in model.trainable_variables}
    assert set(events) == scalars | histograms
    # batch summaries every 3 batches (3, 6), epoch summaries at the batches seen (4, 8)
    for tag in scalars:
        assert sorted(scalar_series(events, tag)) == [3, 4, 6, 8], tag
    for tag in histograms:
        assert [step for step, _, _ in events[tag]] == [8]          # histogram_freq=2: epoch 2
    rows = {3: recorder.batches[2], 6: recorder.batches[5], 4: recorder.epochs[0],
            8: recorder.epochs[1]}
    kl, nll = scalar_series(events, "elbo/kl"), scalar_series(events, "elbo/nll")
    clip = scalar_series(events, "optimizer/kl_clip_threshold")
    for step, row in rows.items():
        np.testing.assert_allclose(kl[step], row["kl"] / len(x), rtol=1e-6)
        np.testing.assert_allclose(nll[step], row["logs"]["nll"], rtol=1e-6)
        assert row["updates"] == step
        np.testing.assert_allclose(clip[step], 0.1 * 0.5 ** (step // 2), rtol=1e-6)
    assert scalar_series(events, "optimizer/sampling_damping")[8] == pytest.approx(1 / len(x))
    assert scalar_series(events, "optimizer/inverse_failures")[8] == 0.0
    [(_, _, histogram)] = events[f"posterior_stddev/{model.net.layers[0].kernel.path}"]
    stddev = recorder.epochs[1]["stddev"][model.net.layers[0].kernel.path]
    np.testing.assert_array_equal(histogram[:, 2],
                                  np.histogram(stddev.astype(np.float64), bins=30)[0])


def test_tensorboard_and_validation_reject_bad_setups(tmp_path):
    x, y = regression_data(n=16)
    model = regression_net()
    model.compile(optimizer="adam", loss=tfnng.losses.GaussianNLL())
    for callback in (callbacks.PosteriorTensorBoard(tmp_path), callbacks.PredictiveValidation(x, y)):
        with pytest.raises(ValueError, match="tfnng optimizer"):
            model.fit(x, y, epochs=1, verbose=0, callbacks=[callback])
    model.compile(optimizer=tfnng.optimizers.Vadam(num_examples=16), loss="mse")
    with pytest.raises(ValueError, match="likelihood"):
        model.fit(x, y, epochs=1, verbose=0, callbacks=[callbacks.PredictiveValidation(x, y)])
    for kwargs in ({"histogram_freq": -1}, {"update_freq": "batch"}, {"update_freq": 0},
                   {"bucket_count": 0}):
        with pytest.raises(ValueError):
            callbacks.PosteriorTensorBoard(tmp_path, **kwargs)
    for kwargs in ({"num_samples": 0}, {"every": 0}, {"every": 1.5}, {"prefix": None}):
        with pytest.raises(ValueError):
            callbacks.PredictiveValidation(x, y, **kwargs)
    with pytest.raises(ValueError, match=r"evaluate\(\) needs a model: pass the callback"):
        callbacks.PredictiveValidation(x, y).evaluate()
    for args in ((None, y), (x, None)):        # a TensorFlow conversion error before
        with pytest.raises(ValueError, match="needs validation inputs `x` and targets `y`"):
            callbacks.PredictiveValidation(*args)


class EpochCounter(keras.callbacks.Callback):
    epochs = 0

    def on_epoch_end(self, epoch, logs=None):
        self.epochs += 1


@pytest.mark.parametrize("bad, error, match", [
    ("dataset", TypeError, "one array"),
    ("dict", TypeError, "one array"),
    ("short_y", ValueError, "10 targets for 16 inputs"),
    ("soft_labels", ValueError, "not soft labels"),
    ("soft_binary_labels", ValueError, "not soft labels"),       # (N,): bare metrics error later
    ("soft_binary_column", ValueError, "not soft labels"),
    ("wrong_features", ValueError, r"takes inputs of shape \(None, 3\)"),
    ("nan_x", ValueError, "inputs `x` contain NaN"),
    ("nan_y", ValueError, "targets `y` contain NaN"),
    ("wrong_target_width", ValueError, "cannot score the validation data"),
])
def test_predictive_validation_rejects_unusable_data_before_training(bad, error, match):
    """These used to fail only when the first scored epoch ended (after ``every`` epochs)."""
    x, y = regression_data(n=16)
    loss, units = tfnng.losses.GaussianNLL(), 1
    x_val, y_val = x, y
    if bad == "dataset":
        x_val = tf.data.Dataset.from_tensor_slices(x).batch(8)
    elif bad == "dict":
        x_val = {"x": x}
    elif bad == "short_y":
        y_val = y[:10]
    elif bad == "wrong_features":
        x_val = np.concatenate([x, x[:, :2]], axis=1)
    elif bad == "nan_x":
        x_val = np.where(x > 1, np.nan, x)
    elif bad == "nan_y":
        y_val = np.where(y > 0, np.inf, y)
    elif bad == "wrong_target_width":
        y_val = np.concatenate([y, y], axis=1)
    elif bad == "soft_labels":
        y = y_val = np.eye(2, dtype="float32")[(x[:, 0] > 0).astype(int)] * 0.9 + 0.05
        loss, units = tfnng.losses.CategoricalNLL(), 2
    else:          # BernoulliNLL trains on probabilities of shape (N,) or (N, 1)
        y = y_val = 1 / (1 + np.exp(-3 * x[:, :1]))
        y = y_val = y[:, 0] if bad == "soft_binary_labels" else y
        loss = tfnng.losses.BernoulliNLL()
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(units)])
    model.compile(optimizer=tfnng.optimizers.NoisyAdam(num_examples=16), loss=loss)
    counter = EpochCounter()
    with pytest.raises(error, match=match):
        model.fit(x, y, epochs=3, verbose=0, callbacks=[
            counter, callbacks.PredictiveValidation(x_val, y_val, every=3)])
    assert counter.epochs == 0


@pytest.mark.parametrize("column", [False, True])
def test_predictive_validation_scores_binary_labels(column):
    """Class ids 0/1 of a BernoulliNLL model, shape (N,) or (N, 1), pass the check of the labels
    (its (N, 1) probabilities stand for two classes)."""
    x, _ = regression_data(n=16)
    y = (x[:, 0] > 0).astype("int32")
    y = y[:, None] if column else y
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile(optimizer=tfnng.optimizers.NoisyAdam(num_examples=16), loss=tfnng.losses.BernoulliNLL())
    validation = callbacks.PredictiveValidation(x, y, num_samples=4)
    history = model.fit(x, y, epochs=1, verbose=0, callbacks=[validation]).history
    assert 0 <= history["val_pred_accuracy"][0] <= 1 and 0 <= history["val_pred_ece"][0] <= 1


@pytest.mark.parametrize("unknown_length", [False, True])
@pytest.mark.parametrize("steps_per_execution, batch_steps", [
    (1, [4, 8, 12, 16, 20, 24]), (4, [4, 8, 12, 16, 20, 24]), (5, [5, 10, 12, 17, 22, 24])])
def test_tensorboard_every_k_batches_counts_batches_with_steps_per_execution(
        tmp_path, steps_per_execution, batch_steps, unknown_length):
    """Batch summaries follow the batches seen, not the executions (12 batches per epoch), also
    for a pipeline of unknown length, whose last execution Keras reports as whole (the steps
    used to run ahead: 5, 10, 15, 15, 20, ...)."""
    x, y = regression_data(n=24)
    model = regression_net()
    model.compile(optimizer=tfnng.optimizers.NoisyAdam(num_examples=len(x)), loss="mse",
                  steps_per_execution=steps_per_execution)
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(2)
    if unknown_length:
        data = data.filter(lambda inputs, targets: True)
        assert data.cardinality() == tf.data.UNKNOWN_CARDINALITY
    model.fit(data, epochs=2, verbose=0, callbacks=[
        callbacks.PosteriorTensorBoard(tmp_path, histogram_freq=0, update_freq=4)])
    steps = [step for step, _, _ in read_events(tmp_path)["elbo/kl"]]
    assert steps == sorted(batch_steps + [12, 24])           # and the two epoch summaries


def test_tensorboard_steps_follow_the_batches_keras_runs_past_steps_per_epoch(tmp_path):
    """A repeating dataset with steps_per_epoch=3 and steps_per_execution=2: Keras runs two whole
    executions, 4 batches, per epoch. The summaries counted 3 per epoch (steps 2, 3, 5, 6), while
    the values written at step 6 were those after 8 updates."""
    x, y = regression_data(n=24)
    model = regression_net()
    model.compile(optimizer=tfnng.optimizers.NoisyAdam(num_examples=len(x)), loss="mse",
                  steps_per_execution=2)
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(2).repeat()
    model.fit(data, epochs=2, steps_per_epoch=3, verbose=0, callbacks=[
        callbacks.PosteriorTensorBoard(tmp_path, histogram_freq=0, update_freq=2)])
    assert int(model.optimizer.iterations) == 8
    steps = [step for step, _, _ in read_events(tmp_path)["elbo/kl"]]
    assert steps == [2, 4, 4, 6, 8, 8]              # batch summaries and the two epoch summaries


def test_histogram_buckets():
    histogram = callbacks.histogram_buckets([1.0, 2.0, 2.0, 4.0, np.nan, np.inf], bucket_count=3)
    np.testing.assert_allclose(histogram, [[1, 2, 1], [2, 3, 2], [3, 4, 1]])
    constant = callbacks.histogram_buckets(np.full((4, 2), 0.25), bucket_count=2)
    assert constant[:, 2].sum() == 8 and constant[0, 0] < 0.25 < constant[-1, 1]
    for value in (0.1, 1e20):       # a few ulps apart: too close for 30 numpy buckets of their own
        close = callbacks.histogram_buckets([value, np.nextafter(value, 2 * value)],
                                            bucket_count=30)
        assert close[:, 2].sum() == 2 and close[0, 0] < value < close[-1, 1]
        assert np.all(close[:, 0] < close[:, 1])


def fit_regression(with_callback, every=2):
    keras.utils.set_random_seed(2)
    x, y = regression_data(seed=2)
    x_val, y_val = regression_data(n=20, seed=3)
    model = regression_net()
    model.compile(optimizer=tfnng.optimizers.IVON(learning_rate=0.1, num_examples=len(x), seed=2),
                  loss=tfnng.losses.GaussianNLL(noise_variance=0.2))
    validation = callbacks.PredictiveValidation(x_val, y_val, num_samples=7, every=every)
    history = model.fit(x, y, batch_size=16, epochs=4, verbose=0,
                        callbacks=[validation] if with_callback else [])
    return model, history.history, (x_val, y_val)


def test_predictive_validation_regression_matches_predict_and_leaves_training_unchanged():
    model, history, (x_val, y_val) = fit_regression(with_callback=True)
    assert len(history["loss"]) == 4
    assert len(history["val_pred_nll"]) == len(history["val_pred_rmse"]) == 2   # epochs 2 and 4
    # Nothing drew noise since the last epoch's end, and the callback restored the generator:
    # a direct prediction repeats the callback's exactly.
    optimizer = model.optimizer
    prediction = tfnng.predict(model, x_val, num_samples=7)
    np.testing.assert_allclose(history["val_pred_nll"][-1],
                               -np.mean(prediction.log_likelihood(y_val)), rtol=1e-6)
    np.testing.assert_allclose(history["val_pred_rmse"][-1],
                               tfnng.metrics.rmse(y_val, prediction.mean), rtol=1e-6)
    assert prediction.epistemic_variance.min() > 0         # a real Monte Carlo predictive
    reference, reference_history, _ = fit_regression(with_callback=False)
    np.testing.assert_array_equal(history["loss"], reference_history["loss"])
    for variable, other in zip(model.trainable_variables, reference.trainable_variables):
        np.testing.assert_array_equal(optimizer.posterior_mean(variable).numpy(),
                                      reference.optimizer.posterior_mean(other).numpy())


def test_predictive_validation_classification_and_the_progress_bar(capsys):
    keras.utils.set_random_seed(4)
    x, y = classification_data(n=48, seed=4)
    x_val, y_val = classification_data(n=30, seed=5)
    model = tfnng.BayesianModel(classification_net())
    model.compile(optimizer=tfnng.optimizers.NoisyKFAC(learning_rate=0.05, num_examples=len(x),
                                                       stats_every=1, inverse_every=3, seed=4),
                  loss=tfnng.losses.CategoricalNLL())
    history = model.fit(x, y, batch_size=16, epochs=2, verbose=2,
                        callbacks=[callbacks.PredictiveValidation(x_val, y_val, num_samples=5,
                                                                  num_bins=5)]).history
    keys = {"loss", "nll", "kl", "val_pred_nll", "val_pred_accuracy", "val_pred_ece"}
    assert set(history) == keys
    for key in keys:
        assert len(history[key]) == 2 and all(math.isfinite(v) for v in history[key])
    # verbose=2 prints one line per epoch: "3/3 - 1s - 300ms/step - kl: 0.01 - loss: ... - nll: ..."
    lines = [line for line in capsys.readouterr().out.splitlines() if "/step" in line]
    assert len(lines) == 2
    for line in lines:
        assert {part.split(":")[0] for part in line.split(" - ") if ": " in part} == keys
    prediction = tfnng.predict(model, x_val, num_samples=5)
    np.testing.assert_allclose(history["val_pred_nll"][-1],
                               -np.mean(prediction.log_likelihood(y_val)), rtol=1e-6)
    assert history["val_pred_accuracy"][-1] == tfnng.metrics.accuracy(y_val, prediction.probs)
    np.testing.assert_allclose(
        history["val_pred_ece"][-1],
        tfnng.metrics.expected_calibration_error(y_val, prediction.probs, num_bins=5), rtol=1e-6)


class MCDropout(keras.layers.Dropout):
    """Dropout at prediction time too (MC dropout): it draws random numbers in every forward pass."""

    def call(self, inputs, training=None):
        return super().call(inputs, training=True)


def test_predictive_validation_leaves_mc_dropout_training_unchanged():
    """The dropout layer's random-number state is restored too: without that, the callback's
    forward passes changed every later dropout mask, and so the whole run."""
    def run(with_callback):
        keras.utils.set_random_seed(0)
        x, y = regression_data()
        net = keras.Sequential([keras.Input((3,)), keras.layers.Dense(8, activation="tanh"),
                                MCDropout(0.2, seed=1), keras.layers.Dense(1)])
        net.compile(optimizer=tfnng.optimizers.NoisyAdam(learning_rate=0.05, num_examples=48,
                                                         seed=0),
                    loss=tfnng.losses.GaussianNLL(0.5))
        extra = [callbacks.PredictiveValidation(x[:16], y[:16], num_samples=3)] if with_callback else []
        history = net.fit(x, y, batch_size=16, epochs=3, verbose=0, shuffle=False, callbacks=extra)
        return [v.numpy() for v in net.variables + net.optimizer.variables], history.history["loss"]

    (state_with, loss_with), (state_without, loss_without) = run(True), run(False)
    assert loss_with == loss_without
    for a, b in zip(state_with, state_without):
        np.testing.assert_array_equal(a, b)


def test_tensorboard_writes_whatever_recording_condition_is_set_and_counts_on(tmp_path):
    """``keras.callbacks.TensorBoard(update_freq=k)`` leaves a recording condition set for the whole
    fit (here set by hand): the posterior summaries are written regardless (they were dropped
    except at multiples of k). A second callback instance continues the batch count of the
    optimizer (it restarted at 0, writing over the first run's steps)."""
    x, y = regression_data(n=24)
    model = regression_net()
    model.compile(optimizer=tfnng.optimizers.NoisyAdam(num_examples=len(x)), loss="mse")
    with tf.summary.record_if(False):
        model.fit(x, y, batch_size=8, epochs=2, verbose=0, callbacks=[
            callbacks.PosteriorTensorBoard(tmp_path / "a", histogram_freq=1)])
    events = read_events(tmp_path / "a")
    assert [step for step, _, _ in events["elbo/kl"]] == [0, 1]
    assert len(events[f"posterior_stddev/{model.layers[0].kernel.path}"]) == 2
    model.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=[
        callbacks.PosteriorTensorBoard(tmp_path / "b", histogram_freq=0, update_freq=2)])
    assert [step for step, _, _ in read_events(tmp_path / "b")["elbo/kl"]] == [8, 9]
