"""Keras layers of tfnng.

``NoisePrecision`` implements the Gamma noise-precision posterior of NNG App. C.1: appended as the
last layer of a regression network and paired with ``tfnng.losses.GaussianNLL("learned")``, Keras'
total training loss becomes the negative ELBO of eq. (24) per training example (the KL term of the
weights is the optimizer's business).
"""

import functools
import math
import numbers

import keras
import tensorflow as tf
import tensorflow_probability as tfp

from tfnng._markers import mark_natural_parameter

tfd = tfp.distributions


def _gamma_natural_step(value, gradient, step_size, num_examples, kl_weight=1.0):
    """The stochastic natural-gradient step of q(tau) = Gam(alpha, beta) on ``[log alpha; log beta]``.

    ``value`` and ``gradient`` (the ordinary gradient of the per-example loss L = -ELBO / N, N =
    ``num_examples``) have shape (2, d). With scale = step_size * N, in the natural parameters
    theta = (alpha - 1, -beta) the step is theta <- theta - scale * dL/dm, with
    the mean parameters m = (digamma(alpha) - log beta, alpha / beta) and dL/dm = J^-T dL/d(alpha,
    beta), J = dm/d(alpha, beta) = [[psi'(alpha), -1/beta], [1/beta, -alpha/beta^2]]. Written with the
    log-space gradients g_a = alpha dL/dalpha, g_b = beta dL/dbeta it reads
    ``alpha -= scale (g_a + g_b) / c`` and ``beta -= scale beta (g_a / alpha + psi'(alpha) g_b) / c``,
    ``c = alpha psi'(alpha) - 1 > 0``. The step is computed in float64 (c ~ 1/(2 alpha) cancels
    badly in float32), but a float32 gradient limits it: its rounding error is amplified about
    alpha^2 times, so with N ~ 1e5 or more one step of size 1 can be off by 10% or more in alpha
    (not in alpha / beta, the expected precision); small steps average this out (step 0.05 settled
    within 1% of the optimum at N = 463,715). A confident prior does the same: with a0 = b0 = 1e8
    alpha ended 86% off the exact value after 20 steps of size 0.1, and with a0 = 1e12 every step
    was rejected (below). A float64 model has no such limit.

    With the KL term weighted by ``kl_weight`` = w the step is theta <- (1 - rho w) theta +
    rho (w theta_prior + data statistics), a convex combination only for rho w <= 1: the step size
    is capped at 1 / w (rho = 1 / w reaches the fixed point of the batch's statistics at once).
    In exact arithmetic a step size <= 1 / w then keeps alpha and beta positive, but the data terms
    of g_a and g_b cancel in the alpha step: when the network diverges (squared residuals ~1e17),
    float32 gradients made alpha negative and log alpha NaN. A step that would leave alpha or beta
    non-positive or non-finite keeps the old values.
    """
    u = tf.cast(tf.convert_to_tensor(value), tf.float64)
    g = tf.cast(gradient, tf.float64)
    rho = tf.cast(tf.convert_to_tensor(step_size, dtype_hint=tf.float64), tf.float64)
    if kl_weight > 1:
        rho = tf.minimum(rho, tf.constant(1.0 / kl_weight, tf.float64))
    scale = rho * num_examples
    alpha, beta = tf.exp(u[0]), tf.exp(u[1])
    trigamma = tf.math.polygamma(tf.constant(1.0, tf.float64), alpha)
    c = alpha * trigamma - 1.0
    new_alpha = alpha - scale * (g[0] + g[1]) / c
    new_beta = beta - scale * beta * (g[0] / alpha + trigamma * g[1]) / c
    new = tf.stack([new_alpha, new_beta])
    valid = tf.reduce_all(tf.math.is_finite(new) & (new > 0), axis=0)     # per output j
    return tf.cast(tf.where(valid, tf.math.log(tf.where(valid, new, 1.0)), u), value.dtype)


def _check_positive(name, value):
    if (
        isinstance(value, bool)
        or not isinstance(value, numbers.Real)
        or not math.isfinite(value)
        or value <= 0
    ):
        raise ValueError(
            f"NoisePrecision: `{name}` must be a finite positive number; got {value!r}."
        )
    return float(value)


@keras.saving.register_keras_serializable(package="tfnng")
class NoisePrecision(keras.layers.Layer):
    """Variational Gamma posterior q(tau) = Gamma(alpha, beta) of the Gaussian noise precision.

    NNG App. C.1: prior p(tau_j) = Gamma(prior_shape, prior_rate) (the paper uses a0 = b0 = 6),
    posterior q(tau_j) = Gamma(alpha_j, beta_j) (rate parameterisation), one per output j. The input
    is the network's predicted mean, shape ``(batch, d)``; the output is
    ``concat([mean, alpha, beta], -1)``, shape ``(batch, 3d)``, the layout expected by
    ``tfnng.losses.GaussianNLL("learned")``, which evaluates minus eq. (23). Each call adds
    ``kl_weight * sum_j KL(q(tau_j) || p(tau_j)) / num_examples`` with ``add_loss``, so the compiled
    loss plus this term is -(eq. 24) / N without the weights' KL.

    ``log_parameters``, a trainable variable of shape ``(2, d)``, holds ``[log alpha; log beta]``,
    marked with ``tfnng.mark_natural_parameter``: tfnng optimizers fit q(tau) by the stochastic
    natural-gradient step of conjugate variational inference (Hoffman et al. 2013; Khan & Lin 2017),
    which with step size rho reads ``alpha <- (1 - rho) alpha + rho (a0 + N/2)`` and
    ``beta <- (1 - rho) beta + rho (b0 + N/2 * E_q(w)[(y - y_hat)^2])`` for the batch at hand (KL
    weight 1; with ``kl_weight`` w > 1 the step size is capped at 1 / w, see
    ``_gamma_natural_step``). N is this layer's ``num_examples`` (the N its KL term is
    divided by), whatever the optimizer's. Euclidean gradients crawl along the ridge alpha / beta =
    const, where the ELBO is nearly flat: an Adam step on softplus-parameterised alpha, beta reached
    alpha = 10 instead of the optimum 233.5 in 200 epochs of Boston housing. Keras optimizers see the
    ordinary gradient in log space. The defaults ``initial_shape=6, initial_rate=2`` start q at
    E[tau] = 3 (noise standard deviation about 0.58 for standardised targets), somewhat more
    confident than the prior mean E[tau] = 1 so that early fits are not drowned in noise.
    Standardise the targets: residuals far above the noise scale (unnormalised targets) make
    float32 gradients cancel badly in the alpha step (docs/math.md, "Standardise the targets").

    Args:
        num_examples: training-set size N (positive int).
        prior_shape, prior_rate: a0 and b0 of the Gamma prior.
        kl_weight: non-negative multiplier of the KL term (1 gives the ELBO).
        initial_shape, initial_rate: initial alpha and beta.

    ``num_examples``, ``prior_shape``, ``prior_rate`` and ``kl_weight`` are fixed once the layer is
    built (a ``Sequential`` with an ``Input`` builds it at once): the natural-gradient step is made
    with them then, and compiled steps keep them. For other values make a new layer from
    ``get_config()`` and copy the weights with ``set_weights``.
    """

    _FIXED_ONCE_BUILT = ("num_examples", "prior_shape", "prior_rate", "kl_weight")

    def __setattr__(self, name, value):
        if name in self._FIXED_ONCE_BUILT and getattr(self, "built", False):
            raise AttributeError(
                f"NoisePrecision.{name} is fixed once the layer is built: its natural-gradient "
                "step and KL term were made with the old value, and a compiled training step "
                f"keeps it. Pass {name} to the constructor, or build a new layer with "
                f"`NoisePrecision.from_config({{**layer.get_config(), '{name}': ...}})` and copy "
                "the weights with `new_layer.set_weights(layer.get_weights())`.")
        super().__setattr__(name, value)

    def __init__(
        self,
        num_examples,
        prior_shape=6.0,
        prior_rate=6.0,
        kl_weight=1.0,
        initial_shape=6.0,
        initial_rate=2.0,
        **kwargs,
    ):
        if kwargs.get("dtype") is None:
            # Under a mixed precision policy q(tau) stays in the variables' precision: alpha is
            # about a0 + N/2, beyond float16 for N > 131000 and to 3 digits in bfloat16.
            kwargs["dtype"] = keras.config.dtype_policy().variable_dtype
        super().__init__(**kwargs)
        if (
            isinstance(num_examples, bool)
            or not isinstance(num_examples, numbers.Integral)
            or num_examples <= 0
        ):
            raise ValueError(
                "NoisePrecision: `num_examples` must be a positive int (the training-set size N); "
                f"got {num_examples!r}."
            )
        if (
            isinstance(kl_weight, bool)
            or not isinstance(kl_weight, numbers.Real)
            or not math.isfinite(kl_weight)
            or kl_weight < 0
        ):
            raise ValueError(
                "NoisePrecision: `kl_weight` must be a finite non-negative number; "
                f"got {kl_weight!r}."
            )
        self.num_examples = int(num_examples)
        self.prior_shape = _check_positive("prior_shape", prior_shape)
        self.prior_rate = _check_positive("prior_rate", prior_rate)
        self.kl_weight = float(kl_weight)
        self.initial_shape = _check_positive("initial_shape", initial_shape)
        self.initial_rate = _check_positive("initial_rate", initial_rate)

    def build(self, input_shape):
        num_outputs = input_shape[-1]
        if len(input_shape) < 2 or num_outputs is None:
            raise ValueError(
                "NoisePrecision expects the predicted mean with shape (batch, d) and a known d; "
                f"got input shape {tuple(input_shape)}."
            )
        initial = [[math.log(self.initial_shape)] * num_outputs,
                   [math.log(self.initial_rate)] * num_outputs]
        self.log_parameters = mark_natural_parameter(self.add_weight(
            name="log_parameters", shape=(2, num_outputs), trainable=True,
            initializer=lambda shape, dtype: tf.constant(initial, dtype),
            autocast=False),      # q(tau) in the variable's precision under a mixed dtype too
            functools.partial(_gamma_natural_step, num_examples=self.num_examples,
                              kl_weight=self.kl_weight))

    @property
    def alpha(self):
        """Shape parameters alpha of q(tau), shape ``(d,)``."""
        return tf.exp(self.log_parameters[0])

    @property
    def beta(self):
        """Rate parameters beta of q(tau), shape ``(d,)``."""
        return tf.exp(self.log_parameters[1])

    def posterior(self):
        """q(tau) = ``tfd.Gamma(alpha, beta)`` with batch shape ``(d,)``."""
        return tfd.Gamma(concentration=self.alpha, rate=self.beta)

    def prior(self):
        """p(tau) = ``tfd.Gamma(prior_shape, prior_rate)`` (scalar, shared by all outputs)."""
        return tfd.Gamma(
            concentration=tf.constant(self.prior_shape, self.variable_dtype),
            rate=tf.constant(self.prior_rate, self.variable_dtype),
        )

    def kl_divergence(self, posterior=None):
        """sum_j KL(q(tau_j) || p(tau_j)), the last term of eq. (24) (closed form, via tfp)."""
        posterior = self.posterior() if posterior is None else posterior
        return tf.reduce_sum(tfd.kl_divergence(posterior, self.prior()))

    def call(self, inputs):
        q = self.posterior()
        self.add_loss(self.kl_weight * self.kl_divergence(q) / self.num_examples)
        alpha = tf.cast(q.concentration, inputs.dtype)
        beta = tf.cast(q.rate, inputs.dtype)
        ones = tf.ones_like(inputs)
        return tf.concat([inputs, alpha * ones, beta * ones], axis=-1)

    def compute_output_shape(self, input_shape):
        num_outputs = input_shape[-1]
        return tuple(input_shape[:-1]) + (None if num_outputs is None else 3 * num_outputs,)

    def get_config(self):
        config = super().get_config()
        config.update(
            num_examples=self.num_examples,
            prior_shape=self.prior_shape,
            prior_rate=self.prior_rate,
            kl_weight=self.kl_weight,
            initial_shape=self.initial_shape,
            initial_rate=self.initial_rate,
        )
        return config
