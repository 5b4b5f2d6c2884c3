"""Likelihood-aware Keras losses.

Every loss here is a ``keras.losses.Loss`` whose ``call(y_true, y_pred)`` returns the per-example
negative log-likelihood (Keras then averages it over the batch, so a compiled model minimises the
expected negative log-likelihood per example, the data term of the ELBO divided by N). On top of the
Keras protocol each class implements the *likelihood interface* used by ``tfnng.predict``, the
benchmarks and the "true Fisher" curvature of the noisy K-FAC family (NNG footnote 1):

* ``log_prob(y_true, y_pred)`` - per-example log density of the predictive of one weight sample,
  shape ``(batch,)``;
* ``distribution(y_pred)`` - that predictive as a ``tfp.distributions.Distribution`` with batch
  shape ``(batch,)``;
* ``sample(y_pred, seed=None)`` - targets drawn from ``distribution(y_pred)``;
* ``is_classification`` - class attribute;
* regression: ``mean_and_variance(y_pred)``; classification: ``probabilities(y_pred)``.

Seeds (``sample``): ``None`` draws fresh randomness from TensorFlow's global stateful generator
(fine inside ``tf.function(jit_compile=True)``, not reproducible); an ``int`` is the stateless seed
``[seed, 0]`` (same samples on every call, as for Keras' integer seeds); an integer tensor of shape
``(2,)`` is used as a stateless seed; a ``keras.random.SeedGenerator`` is advanced once per call
(``generator.next()``), which is the convention to use for fresh, reproducible samples inside a
compiled training step, because its state is a variable.

The Gamma noise-precision model of NNG App. C.1 (eq. 23-24) is ``GaussianNLL("learned")`` together
with ``tfnng.layers.NoisePrecision`` as the network's last layer.
"""

import math
import numbers

import keras
import numpy as np
import tensorflow as tf
import tensorflow_probability as tfp

from tfnng._dtypes import at_least_float32
from tfnng._xla import checked

tfd = tfp.distributions

_LOG_2PI = math.log(2.0 * math.pi)


def _float_tensor(x, dtype):
    """``x`` as a tensor; non-floating inputs are cast to ``dtype``, half-precision ones to float32
    (a ``mixed_bfloat16`` head's Bernoulli sampler drew rate 1.0 at logit 6 instead of 0.9975)."""
    x = at_least_float32(x)
    if not x.dtype.is_floating:
        x = tf.cast(x, dtype)
    return x


def _known_rank(tensor, what):
    """``tensor``, refused when its rank is unknown (a ``tf.function`` traced with its shape left
    open): the losses tell the batch axis from the output axes by the static rank, and an unknown
    one broadcast (batch,) targets against a (batch, 1) mean."""
    if tensor.shape.rank is None:
        raise ValueError(
            f"{what} has an unknown rank (a tf.function traced with its shape left open, e.g. "
            "tf.TensorSpec(None) or reduce_retracing=True): give the function's input signature a "
            "rank, e.g. tf.TensorSpec([None, 1]).")
    return tensor


def _stateless_seed(seed):
    """Map the seed conventions of the module docstring to an ``int32[2]`` tensor (or ``None``)."""
    if seed is None:
        return None
    if isinstance(seed, keras.random.SeedGenerator):
        seed = seed.next()
    elif isinstance(seed, numbers.Integral) and not isinstance(seed, bool):
        # Reinterpret the low 32 bits as int32, as Keras does for integer seeds.
        return tf.constant(np.array([int(seed) & 0xFFFFFFFF, 0], np.uint32).astype(np.int32))
    seed = tf.convert_to_tensor(seed)
    if not seed.dtype.is_integer or seed.shape.rank != 1 or seed.shape[0] not in (None, 2):
        raise ValueError(
            "`seed` must be None, a Python int, an integer tensor of shape (2,) or a "
            f"keras.random.SeedGenerator; got {seed!r}."
        )
    return tf.cast(seed, tf.int32)


MEAN_REDUCTIONS = ("sum_over_batch_size", "mean")


def single_loss(loss):
    """``loss``, or the one loss of a one-element list, tuple or dict (Keras accepts ``loss=[l]``
    or ``{"output": l}`` for a model with one output); a structure of several is returned as is.
    A Keras loss class stands for its instance with default arguments, as in Keras's ``compile``."""
    if isinstance(loss, dict):
        losses = list(loss.values())
    elif isinstance(loss, (list, tuple)):
        losses = list(loss)
    else:
        losses = [loss]
    if len(losses) != 1:
        return loss
    (loss,) = losses
    return loss() if isinstance(loss, type) and issubclass(loss, keras.losses.Loss) else loss


def single_output(output, caller):
    """The one output tensor of a model, also when it comes in a one-entry dict or list (Keras
    accepts ``{"output": tensor}`` as a model's one output); a clear error for several."""
    leaves = tf.nest.flatten(output)
    if len(leaves) != 1:
        raise ValueError(
            f"{caller} needs a model with one output tensor (the likelihood's parameters), got "
            f"{len(leaves)} in a {type(output).__name__}. For several outputs, draw weight samples "
            "with `model.optimizer.sample_weights()` and call the model at each.")
    return leaves[0]


def single_target(y):
    """``y``, or the one array of a one-entry dict or list of targets (Keras's ``fit`` takes
    ``{"output": y}`` for a model whose one output is named); anything else is returned as is."""
    if isinstance(y, dict) and len(y) == 1:
        return next(iter(y.values()))
    if isinstance(y, (list, tuple)) and len(y) == 1 and isinstance(y[0], (np.ndarray, tf.Tensor)):
        return y[0]
    return y


def require_mean_reduction(loss_name, reduction):
    """Stop with a clear error unless ``reduction`` averages over the batch: tfnng optimizers
    multiply the mean loss by N (a sum would weaken the prior and lengthen the step by the batch
    size), and the empirical Fisher multiplies its gradients by B."""
    if reduction not in MEAN_REDUCTIONS:
        raise ValueError(
            f"tfnng optimizers need a loss averaged over the batch (reduction "
            f"'sum_over_batch_size', Keras's default): they scale the mean loss by num_examples. "
            f"Got {loss_name} with reduction={reduction!r}.")


class LikelihoodLoss(keras.losses.Loss):
    """Base class: a Keras loss that is also an observation model p(y | network output).

    Subclasses implement ``call``, ``log_prob`` and ``distribution``; ``sample`` is shared.
    ``reduction`` is a mean over the batch (Keras's default; a sum is refused, since tfnng
    optimizers scale the mean loss by N) or ``"none"`` (per-example values, for custom loops).
    Do not compile a model with ``"none"``: Keras then trains on the batch *sum*, and a tfnng
    optimizer, which cannot see the loss of a plain model, fits a posterior about B times too
    narrow (``tfnng.BayesianModel.compile`` refuses it).
    """

    is_classification = False

    def __init__(self, name=None, reduction="sum_over_batch_size", dtype=None):
        if reduction not in ("none", None):     # per-example losses, for custom loops
            require_mean_reduction(type(self).__name__, reduction)
        super().__init__(name=name, reduction=reduction, dtype=dtype)
        self._follows_output = dtype is None
        if not self._follows_output and self.dtype in ("float16", "bfloat16"):
            # Keras casts y_true and y_pred to this dtype before ``call``: class ids above 2048
            # (float16) or 256 (bfloat16) and large regression targets would be rounded silently.
            raise ValueError(
                f"{type(self).__name__} computes in float32 or float64: dtype {dtype!r} would round "
                "the targets (class ids, regression values) before the loss sees them. Leave the "
                "loss's dtype unset (it then computes in float32 for a half-precision output).")

    def __call__(self, y_true, y_pred, sample_weight=None):
        """Keras's (inputs cast to the loss's dtype, ``call``, the weighted mean). With the dtype
        left unset, the loss computes in the wider of the output's precision and ``floatx`` (at
        least float32): a float64 model's loss and gradients stay float64 under a float32
        ``floatx``, and a half-precision output is scored in float32."""
        if self._follows_output:
            output = tf.nest.flatten(y_pred)[0]
            wide = "float64" in (keras.backend.standardize_dtype(getattr(output, "dtype", None)
                                                                 or "float32"),
                                 keras.config.floatx())
            self._dtype = "float64" if wide else "float32"
        return super().__call__(y_true, y_pred, sample_weight)

    def _y_pred(self, y_pred):
        return _known_rank(_float_tensor(y_pred, self.dtype), f"{type(self).__name__}: y_pred")

    def log_prob(self, y_true, y_pred):
        """Per-example log-likelihood log p(y_true | y_pred), shape ``(batch,)``."""
        raise NotImplementedError

    def distribution(self, y_pred):
        """The predictive distribution of one weight sample, batch shape ``(batch,)``."""
        raise NotImplementedError

    def sample(self, y_pred, seed=None):
        """Targets drawn from ``distribution(y_pred)``; see the module docstring for ``seed``."""
        return self.distribution(y_pred).sample(seed=_stateless_seed(seed))

    def get_config(self):
        config = super().get_config()
        config["dtype"] = None if self._follows_output else self._dtype_policy.name
        return config


@keras.saving.register_keras_serializable(package="tfnng")
class GaussianNLL(LikelihoodLoss):
    """Gaussian likelihood with fixed or learned (Gamma-distributed) noise precision.

    ``noise_variance`` a positive float: ``y_pred`` is the mean, shape ``(batch, d)``, and
    p(y | y_pred) = prod_j N(y_j | y_pred_j, noise_variance).

    ``noise_variance="learned"`` (NNG App. C.1): ``y_pred`` is the output of
    ``tfnng.layers.NoisePrecision``, the concatenation ``[mean (d), alpha (d), beta (d)]`` along the
    last axis, where q(tau_j) = Gamma(alpha_j, beta_j) (rate parameterisation) is the posterior of
    the noise precision of output j. ``call`` is then minus the expected log-likelihood of eq. (23),

        -E_q(tau)[log N(y | mean, 1/tau)] = 1/2 [E[tau] (y - mean)^2 - E[log tau] + log 2 pi],

    with E[tau] = alpha / beta and E[log tau] = digamma(alpha) - log(beta). Eq. (23) as printed
    drops the factor 1/2 in its last line; the expression above follows from the line before it
    (the 1/2 multiplies all three terms). ``log_prob`` and ``distribution`` are the predictive of
    one weight sample with tau integrated out,
    Student-t(df=2 alpha, loc=mean, scale=sqrt(beta / alpha)). The true Fisher
    (``tfnng.BayesianModel``) samples its targets from this Student-t, whose Fisher information
    for the mean is (2 alpha + 1) / (2 alpha + 3) * alpha / beta per example: the factor
    1 - 2 / (2 alpha + 3) times the E[tau] = alpha / beta that weights the training loss's residuals.

    With several outputs the per-example value is the sum over outputs (independent noise).
    ``y_true`` has shape ``(batch, d)``; ``(batch,)`` is accepted when ``d == 1``.
    """

    def __init__(self, noise_variance=1.0, name=None, reduction="sum_over_batch_size", dtype=None):
        super().__init__(name=name, reduction=reduction, dtype=dtype)
        if isinstance(noise_variance, str):
            if noise_variance != "learned":
                raise ValueError(
                    'GaussianNLL: `noise_variance` must be a positive float or "learned"; '
                    f"got {noise_variance!r}."
                )
        elif (
            isinstance(noise_variance, bool)
            or not isinstance(noise_variance, numbers.Real)
            or not math.isfinite(noise_variance)
            or noise_variance <= 0
        ):
            raise ValueError(
                "GaussianNLL: `noise_variance` must be a finite positive float or \"learned\"; "
                f"got {noise_variance!r}."
            )
        else:
            noise_variance = float(noise_variance)
        self.noise_variance = noise_variance

    @property
    def learned(self):
        """Whether the noise precision is learned (``y_pred`` is ``[mean, alpha, beta]``)."""
        return self.noise_variance == "learned"

    def _split(self, y_pred):
        """``y_pred`` -> (mean, alpha, beta); alpha and beta are ``None`` for fixed noise."""
        y_pred = self._y_pred(y_pred)
        if y_pred.shape.rank != 2:
            raise ValueError(
                "GaussianNLL expects y_pred of shape (batch, d) (the network's last layer, e.g. "
                f"Dense(d)); got shape {tuple(y_pred.shape)}. A (batch,) output would be read as one "
                "example with `batch` outputs: keep the trailing axis.")
        if not self.learned:
            return y_pred, None, None
        width = y_pred.shape[-1]
        if width is None or width % 3 != 0:
            raise ValueError(
                'GaussianNLL("learned") expects y_pred of shape (batch, 3*d) laid out as '
                "[mean (d), alpha (d), beta (d)], the output of tfnng.layers.NoisePrecision; "
                f"got y_pred with shape {tuple(y_pred.shape)}."
            )
        mean, alpha, beta = tf.split(y_pred, 3, axis=-1)
        alpha, beta = tf.unstack(checked(
            tf.stack([alpha, beta]), tf.stack([alpha, beta]) > 0,
            'GaussianNLL("learned"): alpha and beta (the last two thirds of y_pred) must be '
            "positive: y_pred is the output of tfnng.layers.NoisePrecision."))
        return mean, alpha, beta

    @staticmethod
    def _targets(y_true, mean):
        """``y_true`` in ``mean``'s dtype and rank; ``(batch,)`` targets expand when ``d == 1``."""
        y_true = _known_rank(tf.cast(tf.convert_to_tensor(y_true), mean.dtype),
                             "GaussianNLL: y_true")
        if y_true.shape.rank == mean.shape.rank - 1 and mean.shape[-1] == 1:
            y_true = y_true[..., tf.newaxis]
        if not y_true.shape.is_compatible_with(mean.shape):     # no silent broadcasting
            raise ValueError(
                f"GaussianNLL: y_true with shape {tuple(y_true.shape)} does not match the "
                f"predicted mean with shape {tuple(mean.shape)}."
            )
        return _same_batch(y_true, mean, "GaussianNLL")

    def call(self, y_true, y_pred):
        """Per-example negative log-likelihood (fixed noise) or minus eq. (23) (learned noise)."""
        mean, alpha, beta = self._split(y_pred)
        sq_err = tf.square(self._targets(y_true, mean) - mean)
        if not self.learned:
            var = tf.constant(self.noise_variance, mean.dtype)
            return 0.5 * tf.reduce_sum(sq_err / var + tf.math.log(var) + _LOG_2PI, axis=-1)
        e_tau = alpha / beta
        e_log_tau = tf.math.digamma(alpha) - tf.math.log(beta)
        return 0.5 * tf.reduce_sum(e_tau * sq_err - e_log_tau + _LOG_2PI, axis=-1)

    def distribution(self, y_pred):
        """Normal(mean, noise_variance); learned: Student-t(2 alpha, mean, sqrt(beta / alpha))."""
        mean, alpha, beta = self._split(y_pred)
        if not self.learned:
            scale = tf.fill(tf.shape(mean), tf.constant(math.sqrt(self.noise_variance), mean.dtype))
            base = tfd.Normal(loc=mean, scale=scale)
        else:
            base = tfd.StudentT(df=2.0 * alpha, loc=mean, scale=tf.sqrt(beta / alpha))
        return tfd.Independent(base, reinterpreted_batch_ndims=1)

    def log_prob(self, y_true, y_pred):
        """Log density of ``distribution(y_pred)`` at ``y_true``, shape ``(batch,)``."""
        mean = self._split(y_pred)[0]
        return self.distribution(y_pred).log_prob(self._targets(y_true, mean))

    def mean_and_variance(self, y_pred):
        """Predictive mean and aleatoric variance per output, each ``(batch, d)``.

        Learned noise: the Student-t variance beta / (alpha - 1); it is infinite for alpha <= 1
        (df <= 2), and ``inf`` is returned there.
        """
        mean, alpha, beta = self._split(y_pred)
        if not self.learned:
            return mean, tf.fill(tf.shape(mean), tf.constant(self.noise_variance, mean.dtype))
        finite = alpha > 1.0
        variance = beta / tf.where(finite, alpha - 1.0, tf.ones_like(alpha))
        return mean, tf.where(finite, variance, tf.constant(np.inf, alpha.dtype))

    def get_config(self):
        config = super().get_config()
        config["noise_variance"] = self.noise_variance
        return config


def _same_batch(y_true, y_pred, name):
    """``y_true`` after checking that it has as many examples as ``y_pred`` (statically when both
    sizes are known, else at run time): a single label row must not broadcast over a batch."""
    if not y_true.shape[:1].is_compatible_with(y_pred.shape[:1]):
        raise ValueError(f"{name}: y_true has {y_true.shape[0]} examples, y_pred "
                         f"{y_pred.shape[0]}.")
    if y_true.shape[0] is not None and y_pred.shape[0] is not None:
        return y_true
    return checked(y_true, tf.equal(tf.shape(y_true)[0], tf.shape(y_pred)[0]),
                   f"{name}: y_true and y_pred have different numbers of examples.")


@keras.saving.register_keras_serializable(package="tfnng")
class CategoricalNLL(LikelihoodLoss):
    """Categorical likelihood on logits: -log softmax(y_pred)[y].

    ``y_pred``: logits ``(batch, K)``. ``y_true`` is detected from its static shape: rank 1
    ``(batch,)`` or ``(batch, 1)`` -> integer class ids in [0, K) (ints or integral floats; other
    values raise ``InvalidArgumentError``, except under XLA, which has no run-time checks); rank 2
    ``(batch, K)`` with ``K > 1`` -> one-hot (or soft) label vectors, for which
    log p = sum_k y_k log softmax(y_pred)_k (entries >= 0, rows summing to 1 within 1e-3;
    checked at run time like the ids).
    """

    is_classification = True

    def _labels(self, y_true, logits):
        """``("ids", int32 (batch,))`` or ``("probs", float (batch, K))``."""
        y_true = _known_rank(tf.convert_to_tensor(y_true), "CategoricalNLL: y_true")
        num_classes = logits.shape[-1]
        rank = y_true.shape.rank
        if rank == 2 and y_true.shape[-1] == 1:
            y_true = tf.squeeze(y_true, axis=-1)
            rank = 1
        if rank == 1:
            if y_true.dtype.is_floating:
                y_true = checked(y_true, tf.equal(y_true, tf.round(y_true)),
                                 "CategoricalNLL: class ids given as floats must be integral (soft "
                                 "labels are (batch, K) probability vectors).")
            ids = _same_batch(tf.cast(y_true, tf.int32), logits, "CategoricalNLL")
            return "ids", checked(
                ids, (ids >= 0) & (ids < tf.shape(logits)[-1]),
                f"CategoricalNLL: class ids must lie in [0, K), K = {num_classes} classes.")
        if rank == 2 and y_true.shape[-1] == num_classes and num_classes is not None:
            probs = _same_batch(tf.cast(y_true, logits.dtype), logits, "CategoricalNLL")
            return "probs", checked(
                probs, (probs >= 0) & (tf.abs(tf.reduce_sum(probs, -1, keepdims=True) - 1) <= 1e-3),
                "CategoricalNLL: one-hot or soft labels must be probability vectors (entries >= 0, "
                "each row summing to 1).")
        raise ValueError(
            "CategoricalNLL: y_true must be integer labels of shape (batch,) or (batch, 1), or "
            f"one-hot labels of shape (batch, K={num_classes}); got shape {tuple(y_true.shape)}."
        )

    def _logits(self, y_pred):
        logits = self._y_pred(y_pred)
        if logits.shape.rank != 2 or logits.shape[-1] == 1:
            raise ValueError(
                "CategoricalNLL: y_pred must be logits of shape (batch, K), K >= 2 classes (one "
                f"logit per example is BernoulliNLL's); got {tuple(logits.shape)}."
            )
        return logits

    def log_prob(self, y_true, y_pred):
        """log softmax(y_pred)[y_true] (expected under one-hot/soft labels), ``(batch,)``."""
        logits = self._logits(y_pred)
        kind, labels = self._labels(y_true, logits)
        log_p = tf.nn.log_softmax(logits, axis=-1)
        if kind == "ids":
            return tf.gather(log_p, labels, axis=-1, batch_dims=1)
        return tf.reduce_sum(tf.math.multiply_no_nan(log_p, labels), axis=-1)   # 0 log 0 = 0

    def call(self, y_true, y_pred):
        """Per-example cross-entropy, -``log_prob``."""
        return -self.log_prob(y_true, y_pred)

    def distribution(self, y_pred):
        """``tfd.Categorical(logits=y_pred)``; its samples are int32 class ids ``(batch,)``."""
        return tfd.Categorical(logits=self._logits(y_pred))

    def probabilities(self, y_pred):
        """Class probabilities softmax(y_pred), ``(batch, K)``."""
        return tf.nn.softmax(self._logits(y_pred), axis=-1)


@keras.saving.register_keras_serializable(package="tfnng")
class BernoulliNLL(LikelihoodLoss):
    """Bernoulli likelihood on a logit: log p(y) = y * l - softplus(l).

    ``y_pred``: logits ``(batch, 1)``; ``y_true`` in {0, 1} (or a probability in [0, 1], giving the
    cross-entropy), shape ``(batch,)`` or ``(batch, 1)``.
    Samples have shape ``(batch, 1)`` (int32). ``probabilities`` returns ``(batch, 1)``: the
    probability of class 1 (``tfnng.metrics`` treats an ``(N, 1)`` array as two classes).
    """

    is_classification = True

    def _logits(self, y_pred):
        logits = self._y_pred(y_pred)
        if logits.shape.rank != 2 or logits.shape[-1] != 1:
            raise ValueError(
                "BernoulliNLL: y_pred must be logits of shape (batch, 1); "
                f"got {tuple(logits.shape)}."
            )
        return logits

    def log_prob(self, y_true, y_pred):
        """log Bernoulli(y_true | sigmoid(y_pred)), shape ``(batch,)``."""
        logits = self._logits(y_pred)
        y_true = _known_rank(tf.cast(tf.convert_to_tensor(y_true), logits.dtype),
                             "BernoulliNLL: y_true")
        if y_true.shape.rank == 1:
            y_true = y_true[:, tf.newaxis]
        if y_true.shape.rank != 2 or not y_true.shape[-1:].is_compatible_with([1]):
            raise ValueError(
                "BernoulliNLL: y_true must have shape (batch,) or (batch, 1); "
                f"got {tuple(y_true.shape)}."
            )
        y_true = _same_batch(y_true, logits, "BernoulliNLL")
        y_true = checked(y_true, (y_true >= 0) & (y_true <= 1),
                         "BernoulliNLL: y_true must lie in [0, 1] (labels 0 and 1, or probabilities).")
        # y softplus(-l) + (1 - y) softplus(l), each term 0 where its weight is 0: a logit of +-inf
        # scores its own label 0 (sigmoid_cross_entropy_with_logits gives inf - inf there).
        ce = (tf.math.multiply_no_nan(tf.math.softplus(-logits), y_true)
              + tf.math.multiply_no_nan(tf.math.softplus(logits), 1.0 - y_true))
        return -tf.squeeze(ce, axis=-1)

    def call(self, y_true, y_pred):
        """Per-example binary cross-entropy, -``log_prob``."""
        return -self.log_prob(y_true, y_pred)

    def distribution(self, y_pred):
        """``Independent(Bernoulli(logits=y_pred), 1)``: batch ``(batch,)``, event ``(1,)``."""
        return tfd.Independent(tfd.Bernoulli(logits=self._logits(y_pred)), 1)

    def probabilities(self, y_pred):
        """Probability of class 1, sigmoid(y_pred), shape ``(batch, 1)``."""
        return tf.sigmoid(self._logits(y_pred))
