"""Keras callbacks for models trained with a tfnng optimizer.

``PredictiveValidation`` scores validation data with the Monte Carlo predictive (not at the
posterior mean) and puts the scores into ``logs``, where ``History``, the progress bar and later
callbacks (``EarlyStopping``, ``keras.callbacks.TensorBoard``...) see them. ``PosteriorTensorBoard``
writes TensorBoard summaries of the variational posterior: the ELBO terms, histograms of the
posterior standard deviations and the optimizer's step-size and damping quantities::

    model.fit(x, y, epochs=20, callbacks=[
        tfnng.callbacks.PredictiveValidation(x_val, y_val, num_samples=20),
        tfnng.callbacks.PosteriorTensorBoard("logs/run_1"),
    ])

Both accept a plain Keras model compiled with a tfnng optimizer and a :class:`tfnng.BayesianModel`,
also when Keras has wrapped the optimizer in a ``LossScaleOptimizer`` (``"mixed_float16"``).
"""

import contextlib
import os

import keras
import numpy as np
import tensorflow as tf
from tensorflow.core.framework import summary_pb2

from tfnng import _markers
from tfnng import losses as _losses
from tfnng import metrics as _metrics
from tfnng._names import unique_names
from tfnng.models import unwrap_optimizer
from tfnng.optimizers.base import NoisyOptimizer, _non_negative_int, _positive_int
from tfnng.predict import _inputs, _likelihood_of, _seed_generator_states, _targets, predict

_NEEDS_LABELS = ("PredictiveValidation scores accuracy and calibration, which need class ids or "
                 "one-hot labels (not soft labels)")


def _tfnng_optimizer(model, caller):
    optimizer = unwrap_optimizer(getattr(model, "optimizer", None))
    if not isinstance(optimizer, NoisyOptimizer):
        raise ValueError(f"{caller} needs a model compiled with a tfnng optimizer, got "
                         f"{type(optimizer).__name__}.")
    return optimizer


# ---------------------------------------------------------------------------- predictive validation
class PredictiveValidation(keras.callbacks.Callback):
    """Scores validation data with the Monte Carlo predictive of the posterior at the end of epochs.

    At the end of every ``every``-th epoch it runs :func:`tfnng.predict` on ``(x, y)`` and adds to
    ``logs`` (keys start with ``prefix``):

    * ``val_pred_nll``: minus the mean predictive log-likelihood ``log (1/S) sum_s p(y_n | x_n, w_s)``
      per example (the "test log-likelihood" of NNG Tables 1, 5 with the sign flipped);
    * regression: ``val_pred_rmse`` of the predictive mean;
    * classification: ``val_pred_accuracy`` and ``val_pred_ece`` (expected calibration error,
      :func:`tfnng.metrics.expected_calibration_error`) of the predictive class probabilities.

    Epochs in between have no such keys (as Keras's ``validation_freq``). Put the callback before
    the callbacks that read its keys. The weight samples are drawn with the optimizer's noise
    generator, whose state is restored afterwards, as are the model's weights: training continues
    exactly as without the callback.

    Args:
        x, y: validation inputs and targets.
        num_samples: number S of posterior weight samples.
        every: evaluate at the end of every ``every``-th epoch.
        batch_size: forward-pass batch size of :func:`tfnng.predict` (default: all of ``x``).
        likelihood: a tfnng loss; defaults to the model's compiled loss.
        num_bins: confidence bins of the ECE.
        prefix: prefix of the keys added to ``logs``.
    """

    def __init__(self, x, y, num_samples=20, every=1, batch_size=None, likelihood=None,
                 num_bins=15, prefix="val_pred_"):
        super().__init__()
        if x is None or y is None:
            raise ValueError("PredictiveValidation needs validation inputs `x` and targets `y`; got "
                             f"{'x' if x is None else 'y'} = None.")
        self.x, self.y = x, _losses.single_target(y)      # {"output": y} for a named output
        self.num_samples = _positive_int("num_samples", num_samples)
        self.every = _positive_int("every", every)
        self.batch_size = None if batch_size is None else _positive_int("batch_size", batch_size)
        self.likelihood = likelihood
        self.num_bins = _positive_int("num_bins", num_bins)
        if not isinstance(prefix, str):
            raise ValueError(f"PredictiveValidation: `prefix` must be a string, got {prefix!r}.")
        self.prefix = prefix

    def on_train_begin(self, logs=None):
        # Fail now rather than at the end of the first scored epoch.
        _tfnng_optimizer(self.model, type(self).__name__)
        self._check_data(_likelihood_of(self.model, self.likelihood))

    def _check_data(self, likelihood):
        """The validation inputs' type, the number of targets, classification labels that accuracy
        and ECE can score (class ids or one-hot rows), and, for a built model, that the model and
        the likelihood score the first example (its shapes and types; a forward pass at the current
        weights with ``training=False``; random-number states are restored)."""
        x = _inputs(self.x, self.model, caller="PredictiveValidation")
        num_inputs = x.shape[0]
        y = _targets(self.y, "PredictiveValidation")
        if y.ndim == 0 or len(y) != num_inputs:
            raise ValueError(f"PredictiveValidation: `y` has {len(y) if y.ndim else 0} targets for "
                             f"{num_inputs} inputs `x`.")
        if likelihood.is_classification and y.ndim == 2 and y.shape[1] > 1:
            self._check_labels(y, y.shape[1])
        elif likelihood.is_classification and np.any(y != np.round(y)):
            raise ValueError(f"{_NEEDS_LABELS}: `y` holds values that are not class ids.")
        if self.model.built:
            try:
                with self._random_states_kept():        # an MC dropout layer draws even here
                    output = _losses.single_output(self.model(x[:1], training=False),
                                                   "PredictiveValidation")
                    likelihood.log_prob(y[:1], output)
            except (ValueError, TypeError, tf.errors.OpError) as error:
                raise ValueError("PredictiveValidation: the model and its likelihood cannot score "
                                 f"the validation data `x`, `y`: {error}") from error
            if likelihood.is_classification:       # (N, 1) binary probabilities: two classes
                self._check_labels(y, max(2, likelihood.probabilities(output).shape[-1]))

    @staticmethod
    def _check_labels(y, num_classes):
        try:
            _metrics._class_labels(y, len(y), num_classes)
        except ValueError as error:
            raise ValueError(f"{_NEEDS_LABELS}: {error}") from None

    @contextlib.contextmanager
    def _random_states_kept(self):
        """Restores the optimizer's weight-noise generator and the model's own random-number
        states (MC dropout) on exit, so that training continues as without the callback."""
        states = [_tfnng_optimizer(self.model, type(self).__name__)._seed_generator.state] + [
            self.model.non_trainable_variables[i] for i in _seed_generator_states(self.model)]
        saved = [state.numpy() for state in states]
        try:
            yield
        finally:
            for state, value in zip(states, saved):
                state.assign(value)

    def on_epoch_end(self, epoch, logs=None):
        if logs is None or (epoch + 1) % self.every:
            return
        logs.update({self.prefix + name: value for name, value in self.evaluate().items()})

    def evaluate(self):
        """The scores (without the prefix) of the current posterior, as a dict of floats."""
        if self.model is None:
            raise ValueError("PredictiveValidation.evaluate() needs a model: pass the callback to "
                             "`model.fit`, or call `callback.set_model(model)` first.")
        with self._random_states_kept():
            prediction = predict(self.model, self.x, num_samples=self.num_samples,
                                 batch_size=self.batch_size, likelihood=self.likelihood)
        scores = {"nll": -float(np.mean(prediction.log_likelihood(self.y)))}
        if prediction.likelihood.is_classification:
            scores["accuracy"] = _metrics.accuracy(self.y, prediction.probs)
            scores["ece"] = _metrics.expected_calibration_error(self.y, prediction.probs,
                                                                self.num_bins)
        else:
            scores["rmse"] = _metrics.rmse(self.y, prediction.mean)
        return scores


# ---------------------------------------------------------------------------------- TensorBoard
def _metadata(plugin):
    """Summary metadata of a TensorBoard plugin (``"scalars"``, ``"histograms"``)."""
    metadata = summary_pb2.SummaryMetadata()
    metadata.plugin_data.plugin_name = plugin
    return metadata


_SCALAR = _metadata("scalars")
_HISTOGRAM = _metadata("histograms")


def histogram_buckets(values, bucket_count=30):
    """TensorBoard's histogram tensor: ``(k, 3)`` float64 rows ``[left edge, right edge, count]``
    of ``bucket_count`` equal-width buckets over the finite values (``numpy.histogram``). Values
    too close together for that many buckets (a constant array, or float64 standard deviations a
    few ulps apart) get buckets spanning one unit of their magnitude around them."""
    values = np.asarray(values, np.float64).ravel()
    finite = values[np.isfinite(values)]
    low, high = (finite.min(), finite.max()) if finite.size else (0.0, 1.0)
    if not np.all(np.diff(np.linspace(low, high, bucket_count + 1)) > 0):
        half_width = 0.5 * max(1.0, abs(low), abs(high))
        low, high = low - half_width, high + half_width
    counts, edges = np.histogram(finite, bins=bucket_count, range=(low, high))
    return np.stack([edges[:-1], edges[1:], counts], axis=1)


def optimizer_scalars(optimizer):
    """The step-size and damping quantities a tfnng optimizer exposes, as floats keyed by name.

    ``learning_rate`` (a schedule's value for the next update: tfnng schedules count posterior
    updates, ``schedule(update_count)``, which differs from Keras's ``iterations`` when
    ``mc_samples > 1``),
    ``skipped_updates``; the intrinsic damping ``lambda / (N eta)`` of the diagonal and per-example
    families, or the sampling and mean-step dampings of the K-FAC family with its
    ``kl_clip_threshold`` ``c_k`` for the next update (NNG App. C.2, eq. 26) and
    ``inverse_failures``, where they exist.
    """
    values = {"learning_rate": optimizer.learning_rate,
              "skipped_updates": optimizer.skipped_updates}
    damping = (("sampling_damping", "step_damping") if hasattr(optimizer, "sampling_damping")
               else ("intrinsic_damping",))
    for name in damping + ("kl_clip_threshold", "inverse_failures"):
        value = getattr(optimizer, name, None)
        if value is not None:
            values[name] = value
    return {name: float(np.asarray(value)) for name, value in values.items()}


class PosteriorTensorBoard(keras.callbacks.Callback):
    """TensorBoard summaries of the variational posterior while a model trains.

    Scalars (written with ``tf.summary``; TensorBoard itself is needed only to view them):

    * ``elbo/nll``: the training loss of the epoch so far (``nll`` of a :class:`tfnng.BayesianModel`,
      ``loss`` of a plain model), ``elbo/kl``: ``kl_weight * KL(q || p) / N`` of the posterior at the
      time of writing (the optimizer's closed form), ``elbo/neg_elbo``: their sum, the negative
      ELBO per training example; ``elbo/val_nll`` when validation data is given;
    * ``optimizer/...``: :func:`optimizer_scalars` (learning rate, damping, KL-clip threshold,
      skipped updates, failed factorisations).

    Histograms ``posterior_stddev/<variable path>`` of the posterior standard deviations of every
    Bayesian variable (point estimates excluded), every ``histogram_freq`` epochs.

    The step of a summary is the epoch with ``update_freq="epoch"`` and the number of training
    batches seen otherwise, counted on from the optimizer's ``iterations`` when the callback first
    sees the model (so a run resumed by ``BackupAndRestore``, or a second callback, continues the
    count instead of restarting at 0). Summaries are written whatever recording condition another
    callback (``keras.callbacks.TensorBoard(update_freq=k)``) left set.

    Args:
        log_dir: directory of the event files (may be shared with ``keras.callbacks.TensorBoard``).
        histogram_freq: epochs between histograms (0: none).
        update_freq: ``"epoch"`` (scalars at the end of each epoch) or an integer k (also every k
            training batches; with ``steps_per_execution > 1``, after the execution that
            completes each k-th batch).
        bucket_count: buckets of each histogram.
    """

    def __init__(self, log_dir, histogram_freq=1, update_freq="epoch", bucket_count=30):
        super().__init__()
        self.log_dir = os.fspath(log_dir)
        self.histogram_freq = _non_negative_int("histogram_freq", histogram_freq)
        if update_freq != "epoch":
            update_freq = _positive_int("update_freq", update_freq)
        self.update_freq = update_freq
        self.bucket_count = _positive_int("bucket_count", bucket_count)
        self._writer = None
        self._batches_seen, self._batches_before_epoch = None, 0

    def on_train_begin(self, logs=None):
        self._optimizer = _tfnng_optimizer(self.model, type(self).__name__)
        self._writer = tf.summary.create_file_writer(self.log_dir)

    def on_epoch_begin(self, epoch, logs=None):
        iterations = int(np.asarray(self.model.optimizer.iterations))   # (also a MirroredVariable)
        if self._batches_seen is None:      # here: BackupAndRestore restores at train begin
            self._batches_seen = iterations
        self._batches_before_epoch = self._batches_seen
        self._iterations_before_epoch = iterations

    def on_train_batch_end(self, batch, logs=None):
        # The optimizer's iterations count the batches trained. ``batch`` does not: with
        # ``steps_per_execution`` s > 1 Keras calls this once per s batches, and the epoch's last
        # call says a whole execution ran, whether it covered fewer batches (the data ran out) or
        # more than ``steps_per_epoch`` (a repeating dataset).
        done = int(np.asarray(self.model.optimizer.iterations)) - self._iterations_before_epoch
        previous, self._batches_seen = self._batches_seen, self._batches_before_epoch + done
        if self.update_freq != "epoch" and (self._batches_seen // self.update_freq
                                            > previous // self.update_freq):
            self._write_scalars(logs or {}, self._batches_seen)

    def on_epoch_end(self, epoch, logs=None):
        step = epoch if self.update_freq == "epoch" else self._batches_seen
        self._write_scalars(logs or {}, step)
        if self.histogram_freq and (epoch + 1) % self.histogram_freq == 0:
            self._write_histograms(step)
        self._writer.flush()

    def on_train_end(self, logs=None):
        self._writer.close()

    def _write_scalars(self, logs, step):
        optimizer = self._optimizer
        kl = optimizer.kl_weight * float(optimizer.kl_divergence()) / optimizer.num_examples
        scalars = {"elbo/kl": kl}
        nll = logs.get("nll", logs.get("loss"))
        if nll is not None:
            scalars.update({"elbo/nll": nll, "elbo/neg_elbo": nll + kl})
        val_nll = logs.get("val_nll", logs.get("val_loss"))
        if val_nll is not None:
            scalars["elbo/val_nll"] = val_nll
        scalars.update({f"optimizer/{name}": value
                        for name, value in optimizer_scalars(optimizer).items()})
        with self._writer.as_default(), tf.summary.record_if(True):
            for tag, value in scalars.items():
                tf.summary.write(tag, tf.constant(float(value), tf.float32), step=step,
                                 metadata=_SCALAR)

    def _write_histograms(self, step):
        variables = [v for v in self.model.trainable_variables if not _markers.is_point_estimate(v)]
        with self._writer.as_default(), tf.summary.record_if(True):
            for name, variable in zip(unique_names([v.path for v in variables]), variables):
                stddev = self._optimizer.posterior_stddev(variable).numpy()
                tf.summary.write(f"posterior_stddev/{name}",
                                 histogram_buckets(stddev, self.bucket_count), step=step,
                                 metadata=_HISTOGRAM)
