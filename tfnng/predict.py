"""Monte Carlo predictive distributions of a model trained with a tfnng optimizer.

``p(y | x, D) ~= (1/S) sum_s p(y | x, w_s)`` with ``w_s ~ q(w)`` drawn from the optimizer's posterior.
For regression the predictive variance splits by the law of total variance into an *epistemic* part
(the variance over weight samples of the predicted mean) and an *aleatoric* part (the mean over weight
samples of the likelihood's variance).
"""

import dataclasses
import weakref

import numpy as np
import scipy.sparse
import tensorflow as tf

from tfnng import losses as _losses
from tfnng import metrics as _metrics
from tfnng._dtypes import at_least_float32
from tfnng.models import unwrap_optimizer
from tfnng.optimizers.base import NoisyOptimizer, _positive_int


@dataclasses.dataclass
class Predictive:
    """Monte Carlo predictive distribution at a set of inputs.

    Attributes:
        outputs: raw model outputs per weight sample, shape (S, N, ...).
        likelihood: the likelihood (a tfnng loss) that interprets the outputs.
        mean: predictive mean (regression), (N, d).
        epistemic_variance: variance over weight samples of the predicted mean, (N, d).
        aleatoric_variance: mean over weight samples of the likelihood's variance, (N, d).
        variance: total predictive variance, epistemic + aleatoric.
        probs: predictive class probabilities (classification).
        samples: per-weight-sample predicted means or class probabilities, (S, N, ...), if requested.
    """

    outputs: np.ndarray
    likelihood: object
    mean: np.ndarray = None
    epistemic_variance: np.ndarray = None
    aleatoric_variance: np.ndarray = None
    variance: np.ndarray = None
    probs: np.ndarray = None
    samples: np.ndarray = None

    def log_likelihood(self, y):
        """Per-point predictive log-likelihood ``log (1/S) sum_s p(y_n | x_n, w_s)``, shape (N,)."""
        y = _targets(y, "Predictive.log_likelihood")
        per_sample = np.stack([self.likelihood.log_prob(y, out).numpy() for out in self.outputs])
        return _metrics.log_mean_exp_log_likelihood(per_sample)


def _targets(y, caller):
    """``y`` (or the one array of a one-entry dict or list) as an array, refused when it holds
    NaN or Inf (scored as probability 0, or failing inside the likelihood with a message about its
    internals), or when it is a dict of several (one output is scored)."""
    y = _losses.single_target(y)
    if isinstance(y, dict):
        raise ValueError(f"{caller} scores one output: `y` must be one array of targets, got a "
                         f"dict of {len(y)}.")
    y = np.asarray(y)
    if y.dtype.kind == "f" and not np.isfinite(y).all():
        raise ValueError(f"{caller}: the targets `y` contain NaN or Inf.")
    return y


def _likelihood_of(model, likelihood, caller="tfnng.predict"):
    if likelihood is None:
        likelihood = _losses.single_loss(getattr(model, "loss", None))
        if isinstance(likelihood, (list, tuple, dict)):
            raise ValueError(
                f"{caller} scores one output with one likelihood; the model is compiled with "
                f"{len(likelihood)} losses, one per output. Draw weight samples with "
                "`model.optimizer.sample_weights()` and call the model at each.")
    if isinstance(likelihood, type):
        raise TypeError(f"{caller} needs a likelihood instance, e.g. `{likelihood.__name__}()`; "
                        f"got the class {likelihood.__name__}.")
    if not all(hasattr(likelihood, attr) for attr in ("log_prob", "is_classification")):
        raise ValueError(
            f"{caller} needs a likelihood (a tfnng loss such as GaussianNLL or CategoricalNLL): "
            f"pass `likelihood=` or compile the model with one. Got {likelihood!r}.")
    return likelihood


def predict(model, x, num_samples=100, batch_size=None, likelihood=None, return_samples=False):
    """Monte Carlo predictive distribution of ``model`` at inputs ``x``.

    Each of the ``num_samples`` weight samples is drawn from the posterior held by ``model.optimizer``
    (a tfnng optimizer) and used for all of ``x``. A model without a tfnng optimizer (compiled with a
    plain Keras optimizer, or not compiled, e.g. the ``net`` inside a ``BayesianModel``: a point
    estimate) gives one deterministic sample. Variables the model no longer trains (frozen with
    ``trainable = False`` after training) keep their values, as in :mod:`tfnng.serving`. The model's
    variables are restored afterwards, so training can continue; the optimizer's weight-noise
    generator is not (each call draws new samples), so training after a call draws other noise than
    training without it (:class:`tfnng.callbacks.PredictiveValidation` restores the generator). The
    forward pass and the draw are traced once per model and optimizer and reused by later calls.

    Args:
        model: a built Keras model compiled with a tfnng optimizer (or any optimizer, see above).
        x: inputs, one array or tensor of shape ``(N, ...)`` (a ``tf.SparseTensor`` or a scipy
            sparse matrix is made dense).
        num_samples: number S of weight samples.
        batch_size: forward-pass batch size (default: all of ``x`` at once).
        likelihood: a tfnng loss; defaults to ``model.loss`` (or its one loss: ``loss=[l]``).
        return_samples: also return per-sample predicted means / probabilities in ``samples``.

    Returns:
        A :class:`Predictive`.
    """
    x = _inputs(x, model)
    likelihood = _likelihood_of(model, likelihood)
    num_samples = _positive_int("num_samples", num_samples)
    optimizer = unwrap_optimizer(getattr(model, "optimizer", None))   # mixed_float16 wraps it
    bayesian = isinstance(optimizer, NoisyOptimizer)
    if bayesian:
        optimizer._require_posterior_of(model)      # else an error, not one deterministic draw
    num_samples = num_samples if bayesian else 1
    batch_size = x.shape[0] if batch_size is None else _positive_int("batch_size", batch_size)
    forward = _traced_forward(model)
    draw = _traced_draw(optimizer) if bayesian else None

    # Every variable a draw writes, and those of them the model no longer trains (kept fixed).
    frozen_variables = _frozen_variables(model, optimizer) if bayesian else []
    variables = list(model.trainable_variables) + frozen_variables
    saved = [tf.identity(v) for v in variables]
    frozen = list(zip(frozen_variables, saved[len(model.trainable_variables):]))
    outputs = []
    try:
        for _ in range(num_samples):
            if bayesian:
                draw()
                for variable, value in frozen:
                    variable.assign(value)
            outputs.append(np.concatenate([
                forward(x[start:start + batch_size]).numpy()
                for start in range(0, x.shape[0], batch_size)]))
    finally:
        for variable, value in zip(variables, saved):
            variable.assign(value)
    return _summarise(np.stack(outputs), likelihood, return_samples)


def _frozen_variables(model, optimizer):
    """The variables ``optimizer`` draws that ``model`` no longer trains (frozen after training):
    :func:`predict` and :mod:`tfnng.serving` keep them at their current values."""
    trainable = {id(v) for v in model.trainable_variables}
    return [v for v in optimizer._trainable_variables if id(v) not in trainable]


def _seed_generator_states(model):
    """Indices in ``model.non_trainable_variables`` of the states of Keras ``SeedGenerator`` s (the
    variables Keras names ``seed_generator_state``: MC dropout's random numbers, for example)."""
    return [i for i, v in enumerate(model.non_trainable_variables)
            if v.name == "seed_generator_state"]


# Traced functions kept across calls (a trace costs more than a small prediction), one per model and
# one per optimizer. They hold their owner only by weak reference, so the caches free nothing early
# and keep nothing alive.
_FORWARD_PASSES = weakref.WeakKeyDictionary()
_POSTERIOR_DRAWS = weakref.WeakKeyDictionary()


def _traced(cache, owner, call, **options):
    """``tf.function(lambda *args: call(owner, *args), **options)``, made once per ``owner`` and
    kept in ``cache``; the function reaches ``owner`` through a weak reference."""
    if owner not in cache:
        reference = weakref.ref(owner)
        cache[owner] = tf.function(lambda *args: call(reference(), *args), **options)
    return cache[owner]


def _traced_forward(model):
    """The model's inference-mode forward pass, traced once per input signature."""
    return _traced(_FORWARD_PASSES, model,
                   lambda net, xb: _losses.single_output(net(xb, training=False), "tfnng.predict"),
                   reduce_retracing=True)


def _traced_draw(optimizer):
    """A posterior sample written into every variable ``optimizer`` trains, frozen or not (the trace
    is kept, a frozen set read while tracing would go stale: :func:`predict` restores the frozen
    ones itself). Its seed is a variable: each call draws anew. Python-only control flow: no
    autograph (which would re-read the optimizer's source)."""
    return _traced(_POSTERIOR_DRAWS, optimizer, lambda posterior: posterior._write_sample(),
                   autograph=False)


def _inputs(x, model, caller="tfnng.predict"):
    """``x`` as one tensor with a batch axis of at least one example, finite, of a shape ``model``
    takes where it declares one (clear errors otherwise: after a first call, the relaxed trace of
    the forward pass would fail deep in TensorFlow)."""
    several = isinstance(x, (list, tuple)) and any(isinstance(part, (np.ndarray, tf.Tensor, dict))
                                                   for part in x)
    if several or isinstance(x, (tf.data.Dataset, dict)):
        raise TypeError(
            f"{caller} takes one array or tensor of inputs, shape (N, ...); got "
            f"{type(x).__name__}{' of arrays' if several else ''}. For a tf.data pipeline, call it "
            "on the arrays (e.g. per batch); for a model with several inputs, draw weight samples "
            "with `model.optimizer.sample_weights()` and call the model at each.")
    # Sparse inputs (a bag of words, also as a scipy matrix) are taken as their dense values.
    if scipy.sparse.issparse(x):
        x = x.toarray()
    x = tf.sparse.to_dense(tf.sparse.reorder(x)) if isinstance(x, tf.SparseTensor) else (
        tf.convert_to_tensor(x))
    if x.shape.rank == 0 or x.shape[0] == 0:
        raise ValueError(f"{caller} needs at least one input example, got shape {tuple(x.shape)}.")
    if x.dtype.is_floating and not bool(tf.reduce_all(tf.math.is_finite(x))):
        raise ValueError(f"{caller}: the inputs `x` contain NaN or Inf.")
    try:
        expected = tf.TensorShape(model.input_shape)
    except (AttributeError, TypeError, ValueError):          # no declared input (subclassed model)
        return x
    if expected.rank:       # any batch size: a Sequential built by `fit` records its first batch's
        expected = tf.TensorShape([None]).concatenate(expected[1:])
    if not expected.is_compatible_with(x.shape):
        raise ValueError(f"{caller}: the model takes inputs of shape {tuple(expected)}; got `x` "
                         f"of shape {tuple(x.shape)}.")
    return x


def _per_weight_sample(fn, outputs):
    """A per-example likelihood function ``fn`` of ``(N, ...)`` outputs, applied to every weight sample
    of ``(S, N, ...)`` outputs (the sample axis is merged into the batch axis and split again)."""
    leading = tf.shape(outputs)[:2]
    merged = tf.reshape(outputs, tf.concat([[-1], tf.shape(outputs)[2:]], axis=0))
    merged = tf.ensure_shape(merged, tf.TensorShape([None]).concatenate(outputs.shape[2:]))
    return tf.nest.map_structure(
        lambda r: tf.reshape(r, tf.concat([leading, tf.shape(r)[1:]], axis=0)), fn(merged))


def predictive_moments(outputs, likelihood):
    """Monte Carlo predictive moments from raw model outputs per weight sample, as tensors.

    ``outputs`` has shape ``(S, N, ...)``; works eagerly and inside a ``tf.function`` (the graph
    exported by :mod:`tfnng.serving`). Returns a dict with, for classification, ``probs`` (mean over
    weight samples of the class probabilities), ``probs_variance`` (their variance over weight
    samples) and ``samples`` (per-sample probabilities, ``(S, N, K)``); for regression, ``mean``,
    ``epistemic_variance``, ``aleatoric_variance``, ``variance`` (law of total variance, module
    docstring) and ``samples`` (per-sample predicted means, ``(S, N, d)``). Half-precision outputs
    are summarised in float32.
    """
    outputs = at_least_float32(outputs)
    if likelihood.is_classification:
        per_sample = _per_weight_sample(likelihood.probabilities, outputs)
        return {"probs": tf.reduce_mean(per_sample, axis=0),
                "probs_variance": tf.math.reduce_variance(per_sample, axis=0),
                "samples": per_sample}
    means, variances = _per_weight_sample(likelihood.mean_and_variance, outputs)
    # Moments of the deviations from the first sample: a float32 sum of predictions far from 0
    # (1e5, say) rounds off more than their spread, and the variance about that rounded mean
    # reported a spread the samples do not have; their deviations from a nearby value are exact.
    reference = means[0]
    deviations = means - reference
    epistemic = tf.math.reduce_variance(deviations, axis=0)
    aleatoric = tf.reduce_mean(variances, axis=0)
    return {"mean": reference + tf.reduce_mean(deviations, axis=0),
            "epistemic_variance": epistemic,
            "aleatoric_variance": aleatoric, "variance": epistemic + aleatoric, "samples": means}


def _summarise(outputs, likelihood, return_samples):
    outputs = at_least_float32(outputs)        # once, for the moments and for log_likelihood
    moments = {name: value.numpy() for name, value in predictive_moments(outputs, likelihood).items()}
    result = Predictive(outputs=outputs.numpy(), likelihood=likelihood)
    for field in ("probs", "mean", "epistemic_variance", "aleatoric_variance", "variance"):
        setattr(result, field, moments.get(field))
    if return_samples:
        result.samples = moments["samples"]
    return result
