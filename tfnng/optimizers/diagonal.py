"""Mean-field (diagonal Gaussian) noisy-natural-gradient optimizers.

Every optimizer here fits q(w) = N(mu, diag(sigma^2)) and shares the mechanism of
:class:`tfnng.optimizers.base.NoisyOptimizer`; each class is only its paper's update rule. Notation:
``g`` is the gradient of the *mean* loss over the batch at the current weight sample ``w`` (Monte Carlo
average over ``mc_samples`` samples), ``gamma_in = lambda / (N eta)`` the intrinsic damping, ``t`` the
update number. Curvature estimates from the "gradient magnitude" (GM) approximation use the square of
the averaged gradient.
"""

import logging

import keras
import tensorflow as tf

from tfnng import curvature as _curvature
from tfnng.optimizers._per_example import PerExampleOptimizer, PerExampleStatistics
from tfnng.optimizers.base import (CurvatureConsumer, NoisyOptimizer, _finite_float,
                                   _non_negative, _positive, _probability, _validate_num_examples)

_log = logging.getLogger("tfnng")


def _register(cls):
    return keras.saving.register_keras_serializable(package="tfnng")(cls)


def noisy_adam_step(mean, momentum, fisher, grad, weight, fisher_estimate, lr, t, beta_1, beta_2,
                    prior, damping):
    """NNG Alg. 1 in place, as descent on the mean loss: with ``v = g + prior * w``::

        m <- beta_1 m + (1 - beta_1) v;   f <- beta_2 f + (1 - beta_2) fisher_estimate
        mu <- mu - lr (m / (1 - beta_1^t)) / (f + damping)

    ``fisher_estimate`` is Alg. 1's squared per-example gradient, or its gradient-magnitude
    approximation ``g^2`` from the batch gradient.
    """
    momentum.assign(beta_1 * momentum + (1 - beta_1) * (grad + prior * weight))
    fisher.assign(beta_2 * fisher + (1 - beta_2) * fisher_estimate)
    mean.assign_sub(lr * momentum / (1 - beta_1 ** t) / (fisher + damping))


@_register
class NoisyAdam(PerExampleStatistics, CurvatureConsumer, NoisyOptimizer):
    """Noisy Adam, NNG-FFG — Alg. 1 of Zhang et al. 2018 (*Noisy Natural Gradient as VI*).

    Sampling ``w ~ N(mu, (lambda/N) diag(f + gamma_in)^-1)``; then with ``v = g + gamma_in w``::

        m <- beta_1 m + (1 - beta_1) v             f <- beta_2 f + (1 - beta_2) g^2
        mu <- mu - alpha (m / (1 - beta_1^t)) / (f + gamma_in + gamma_ex)

    (no square root on f, as in the paper; bias correction on the momentum only). ``1 - beta_2`` is
    the paper's beta-tilde (App. C.1 uses alpha = 0.01, beta-tilde = 0.001).

    Fisher estimate: Alg. 1 squares the gradient of one example's log-likelihood. With
    ``fisher=None`` (default, works on any Keras model) the optimizer only sees the batch-mean
    gradient and uses its square (the gradient-magnitude approximation, biased low by up to the batch
    size, Khan et al. 2018 Thm. 1). With ``fisher="true"`` (targets sampled from the model's
    predictive, NNG footnote 1) or ``"empirical"`` (observed targets) the model must be a
    :class:`tfnng.BayesianModel`: Dense and Conv2D weights then use the mean of squared per-example
    gradients (:func:`tfnng.curvature.per_example.layer_squared_gradient_means`); other layers use
    the squared batch gradient of each weight sample (averaged over the ``mc_samples`` evaluations,
    where ``fisher=None`` squares their averaged gradient; use :class:`VOGN` for per-example
    gradients of every layer).

    Args:
        extrinsic_damping: gamma_ex, added to the damping of the mean step only (NNG sec. 3.2).
        hess_init: initial value of the Fisher estimate f. Alg. 1 leaves it open; f has no bias
            correction, so with 0 the first samples come from the prior and the first mean steps
            ``alpha m / (f + gamma)`` are up to 1/gamma_in times a gradient (an MNIST-sized MLP
            reached a loss of 1e5 within 7 steps). Default 1, as VOGN's and IVON's.
        fisher: None, ``"true"`` or ``"empirical"`` (see above).

    See :class:`~tfnng.optimizers.base.NoisyOptimizer` for the common arguments.
    """

    _sample_statistic_names = ("grad", "weight")

    def __init__(self, learning_rate=1e-3, num_examples=None, beta_1=0.9, beta_2=0.999,
                 extrinsic_damping=0.0, hess_init=1.0, fisher=None, name="noisy_adam", **kwargs):
        super().__init__(learning_rate=learning_rate, num_examples=num_examples, name=name, **kwargs)
        if fisher is not None and fisher not in _curvature.FISHER_TYPES:
            raise ValueError(f"`fisher` must be None or one of {_curvature.FISHER_TYPES}, "
                             f"got {fisher!r}.")
        self.fisher = fisher
        if fisher is not None:
            self._sample_statistic_names = ("grad", "weight", "fisher")
        self.beta_1 = _probability("beta_1", beta_1)
        self.beta_2 = _probability("beta_2", beta_2)
        self.extrinsic_damping = _non_negative("extrinsic_damping", extrinsic_damping)
        self.hess_init = _non_negative("hess_init", hess_init)
        self._slots = {"momentum": 0.0, "fisher": self.hess_init}

    @property
    def curvature_requirements(self):
        """Per-layer inputs and pre-activation gradients when ``fisher`` is set (tfnng.models)."""
        if self.fisher is None:
            return None
        return _curvature.Requirements(kronecker=True, fisher=self.fisher)

    def build(self, variables):
        if self.built:
            return
        if self.fisher is not None:
            self._require_layer_specs()
        super().build(variables)
        self._map_per_example_sources()
        if self.fisher is not None:
            approximated = self._layers_without_fast_path(variables)
            if approximated:
                _log.info("NoisyAdam: no per-example gradients for %s; their Fisher uses the "
                          "squared batch gradient.", ", ".join(approximated))

    def _sample_statistics(self, index, gradient, sample):
        stats = {"grad": gradient, "weight": sample}
        if self.fisher is not None:
            stats["fisher"] = self._per_example_fisher(index, gradient)
        return stats

    def _per_example_fisher(self, index, gradient):
        if index not in self._fast_sources:
            return tf.square(gradient)
        return tf.cast(self._squared_gradient_mean(index), gradient.dtype)

    def _variance(self, index):
        return self._sampling_variance(self._slot("fisher", index), self.intrinsic_damping)

    def _update_posterior(self, index, stats, lr):
        fisher = stats["fisher"] if self.fisher is not None else tf.square(stats["grad"])
        noisy_adam_step(self._means[index], self._slot("momentum", index), self._slot("fisher", index),
                        stats["grad"], stats["weight"], fisher, lr, self._step_number(lr.dtype),
                        self.beta_1, self.beta_2, prior=self.intrinsic_damping,
                        damping=self.intrinsic_damping + self.extrinsic_damping)

    def get_config(self):
        return {**super().get_config(), "beta_1": self.beta_1, "beta_2": self.beta_2,
                "extrinsic_damping": self.extrinsic_damping, "hess_init": self.hess_init,
                "fisher": self.fisher}


@_register
class VOGN(PerExampleOptimizer):
    """Variational Online Gauss-Newton — eq. 9-10 with the natural momentum of eq. 18 (sec. 4) of
    Khan et al. 2018 (*Fast and Scalable Bayesian Deep Learning by Weight-Perturbation in Adam*).

    Sampling ``w ~ N(mu, (lambda/N) / (s + gamma_in))`` (the paper's ``sigma^2 = 1/(N (s + lambda~))``
    with ``lambda~ = gamma_in``); with ``h = (1/B) sum_n g_n^2`` the mean of squared per-example
    gradients (eq. 9, the Gauss-Newton estimate) and ``g`` the batch-mean gradient::

        s' <- (1 - beta) s + beta h                                                    (eq. 10)
        mu' <- mu - alpha (g + gamma_in mu) / (s' + gamma) + momentum (s + gamma) / (s' + gamma) (mu - mu_prev)

    (eq. 18) with ``gamma = gamma_in + gamma_ex``. The per-example gradients come from
    :class:`tfnng.BayesianModel`: Dense/Conv2D layers by the fast path, every other layer by the
    generic one (:mod:`tfnng.curvature.per_example`). The paper squares gradients of the observed
    targets (``fisher="empirical"``); tfnng's default is the true Fisher (targets sampled from the
    predictive, NNG footnote 1), whose fixed point on Bayesian linear regression is the optimal
    mean-field Gaussian.

    Args:
        momentum: the natural-momentum coefficient (gamma-bar of eq. 18), in [0, 1).

    See :class:`~tfnng.optimizers._per_example.PerExampleOptimizer` (beta, hess_init,
    extrinsic_damping, fisher; rendered on the API page of tfnng.optimizers.base) and
    :class:`~tfnng.optimizers.base.NoisyOptimizer`.
    """

    _sample_statistic_names = ("grad", "hessian")

    def __init__(self, learning_rate=1e-3, num_examples=None, beta=1e-3, momentum=0.0,
                 hess_init=1.0, extrinsic_damping=0.0, fisher="true", name="vogn", **kwargs):
        super().__init__(learning_rate=learning_rate, num_examples=num_examples, beta=beta,
                         hess_init=hess_init, extrinsic_damping=extrinsic_damping, fisher=fisher,
                         name=name, **kwargs)
        self.momentum = _probability("momentum", momentum)
        self._slots = {"hessian": self.hess_init}
        if self.momentum > 0:       # mu_prev of eq. 18: only kept when it is used
            self._slots["previous_mean"] = 0.0

    def _sample_statistics(self, index, gradient, sample):
        return {"grad": gradient,
                "hessian": tf.cast(self._squared_gradient_mean(index), gradient.dtype)}

    def _variance(self, index):
        return self._sampling_variance(self._slot("hessian", index), self.intrinsic_damping)

    def _update_posterior(self, index, stats, lr):
        mu, s = self._means[index], self._slot("hessian", index)
        beta = self._beta_now(lr.dtype)
        damping = self.intrinsic_damping + self.extrinsic_damping
        new_s = (1 - beta) * s + beta * stats["hessian"]
        step = lr * (stats["grad"] + self.intrinsic_damping * mu)
        if self.momentum > 0:
            previous = self._slot("previous_mean", index)
            # mu_prev of the first update is mu itself (no momentum yet).
            velocity = tf.where(self._update_count > 0, mu - previous, tf.zeros_like(mu))
            step -= self.momentum * (s + damping) * velocity
            previous.assign(mu)
        s.assign(new_s)
        mu.assign_sub(step / (new_s + damping))

    def get_config(self):
        return {**super().get_config(), "momentum": self.momentum}


@_register
class Vadam(NoisyOptimizer):
    """Variational Adam — Fig. 1 of Khan et al. 2018 (*Fast and Scalable Bayesian Deep Learning by
    Weight-Perturbation in Adam*), with the prior precision lambda_p = 1/eta and N -> N / kl_weight.

    Sampling ``w ~ N(mu, (lambda/N) / (s + gamma_in))`` (i.e. ``sigma = 1/sqrt(N s + lambda_p)``)::

        m <- beta_1 m + (1 - beta_1)(g + gamma_in mu)     s <- beta_2 s + (1 - beta_2) g^2
        mu <- mu - alpha m_hat / (sqrt(s_hat) + gamma_in)   (m_hat, s_hat bias-corrected)

    ``hess_init``: the initial s, default 0 as in the authors' code (``prec_init = prior_prec``): the
    first weight samples come from the prior, since sampling uses s without bias correction. With
    many examples and a wide prior these first samples can be far off; ``hess_init=1`` starts with
    small noise instead, as :class:`NoisyAdam` and :class:`Vprop` do by default.
    """

    def __init__(self, learning_rate=1e-3, num_examples=None, beta_1=0.9, beta_2=0.999,
                 hess_init=0.0, name="vadam", **kwargs):
        super().__init__(learning_rate=learning_rate, num_examples=num_examples, name=name, **kwargs)
        self.beta_1 = _probability("beta_1", beta_1)
        self.beta_2 = _probability("beta_2", beta_2)
        self.hess_init = _non_negative("hess_init", hess_init)
        self._slots = {"momentum": 0.0, "second_moment": self.hess_init}

    def _variance(self, index):
        return self._sampling_variance(self._slot("second_moment", index), self.intrinsic_damping)

    def _update_posterior(self, index, stats, lr):
        g, mu = stats["grad"], self._means[index]
        m, s = self._slot("momentum", index), self._slot("second_moment", index)
        t = self._step_number(g.dtype)
        m.assign(self.beta_1 * m + (1 - self.beta_1) * (g + self.intrinsic_damping * mu))
        s.assign(self.beta_2 * s + (1 - self.beta_2) * tf.square(g))
        m_hat = m / (1 - self.beta_1 ** t)
        s_hat = s / (1 - self.beta_2 ** t)
        mu.assign_sub(lr * m_hat / (tf.sqrt(s_hat) + self.intrinsic_damping))

    def get_config(self):
        return {**super().get_config(), "beta_1": self.beta_1, "beta_2": self.beta_2,
                "hess_init": self.hess_init}


@_register
class Vprop(NoisyOptimizer):
    """Variational RMSprop — eq. (14) of Khan et al. 2018.

    Sampling ``w ~ N(mu, (lambda/N) / (s + gamma_in))``::

        s <- beta_2 s + (1 - beta_2) g^2
        mu <- mu - alpha (g + gamma_in mu) / (sqrt(s) + gamma_in)

    (``1 - beta_2`` is the paper's beta_t). ``hess_init``: the initial s (default 1; s has no bias
    correction, so 0 starts sampling from the prior, as for :class:`NoisyAdam`).
    """

    def __init__(self, learning_rate=1e-3, num_examples=None, beta_2=0.999, hess_init=1.0,
                 name="vprop", **kwargs):
        super().__init__(learning_rate=learning_rate, num_examples=num_examples, name=name, **kwargs)
        self.beta_2 = _probability("beta_2", beta_2)
        self.hess_init = _non_negative("hess_init", hess_init)
        self._slots = {"second_moment": self.hess_init}

    def _variance(self, index):
        return self._sampling_variance(self._slot("second_moment", index), self.intrinsic_damping)

    def _update_posterior(self, index, stats, lr):
        g, mu, s = stats["grad"], self._means[index], self._slot("second_moment", index)
        s.assign(self.beta_2 * s + (1 - self.beta_2) * tf.square(g))
        mu.assign_sub(lr * (g + self.intrinsic_damping * mu) / (tf.sqrt(s) + self.intrinsic_damping))

    def get_config(self):
        return {**super().get_config(), "beta_2": self.beta_2, "hess_init": self.hess_init}


@_register
class VadaGrad(NoisyOptimizer):
    """Variational AdaGrad — sec. 5, eq. (23)-(24) of Khan et al. 2018, with the GM approximation and
    the square root of Vprop, written for the mean loss (F = N * mean loss, prior precision 1/eta).

    ``tau`` interpolates between variational optimisation (tau = 0, the paper's VadaGrad: s is a
    growing sum, so the noise only shrinks) and inference (tau = 1)::

        w ~ N(mu, (lambda/N) / (s + tau gamma_in))
        s <- (1 - tau beta) s + beta g^2
        mu <- mu - alpha (g + tau gamma_in mu) / (sqrt(s) + tau gamma_in)

    Args:
        beta: weight of each new squared gradient (the paper's beta_t). Default 1.
        tau: the paper's tau in [0, 1]. Default 0.
        hess_init: initial s; must be > 0 when tau = 0 (it sets the initial noise). Default 1.
    """

    def __init__(self, learning_rate=1e-2, num_examples=None, beta=1.0, tau=0.0, hess_init=1.0,
                 name="vadagrad", **kwargs):
        super().__init__(learning_rate=learning_rate, num_examples=num_examples, name=name, **kwargs)
        self.beta = _positive("beta", beta)
        self.tau = _finite_float(tau)
        if self.tau is None or not 0.0 <= self.tau <= 1.0:
            raise ValueError(f"`tau` must be in [0, 1], got {tau!r}.")
        if self.tau * self.beta > 1.0:
            raise ValueError("`tau * beta` must be <= 1 so that s stays non-negative.")
        self.hess_init = _non_negative("hess_init", hess_init)
        if self.tau == 0 and self.hess_init == 0:
            raise ValueError("`hess_init` must be > 0 when tau = 0 (it sets the initial weight "
                             f"noise), and >= 0 otherwise; got {hess_init!r}.")
        self._slots = {"squared_grad_sum": self.hess_init}

    def _variance(self, index):
        return self._sampling_variance(self._slot("squared_grad_sum", index),
                                     self.tau * self.intrinsic_damping)

    def _update_posterior(self, index, stats, lr):
        g, mu, s = stats["grad"], self._means[index], self._slot("squared_grad_sum", index)
        prior = self.tau * self.intrinsic_damping
        s.assign((1 - self.tau * self.beta) * s + self.beta * tf.square(g))
        mu.assign_sub(lr * (g + prior * mu) / (tf.sqrt(s) + prior))

    def get_config(self):
        return {**super().get_config(), "beta": self.beta, "tau": self.tau,
                "hess_init": self.hess_init}


def _alias(name, value, alias_name, alias_value, default):
    """The value given as ``name`` or as its alias ``alias_name`` (not both), else ``default``."""
    if value is not None and alias_value is not None:
        raise ValueError(f"Pass either `{name}` or `{alias_name}`, not both.")
    value = alias_value if value is None else value
    return default if value is None else value


@_register
class IVON(NoisyOptimizer):
    """Improved Variational Online Newton (Shen et al. 2024, *Variational Learning is Effective for
    Large Deep Networks*, Alg. 1; docs/math.md, "Mean field").

    IVON's own names are accepted as aliases: ``ess`` (effective sample size, = N / kl_weight) instead
    of ``num_examples``/``kl_weight`` (N = ess when it is an integer, else the nearest integer with
    ``kl_weight = N / ess``), and ``weight_decay`` (delta, = gamma_in = 1/(ess eta)) instead
    of ``prior_variance``. With ``hhat = g (w - mu) / sigma^2`` averaged over the MC samples::

        w ~ N(mu, 1 / (ess (h + delta)))
        gbar <- beta_1 gbar + (1 - beta_1) g
        h <- beta_2 h + (1 - beta_2) hhat + 0.5 (1 - beta_2)^2 (h - hhat)^2 / (h + delta)
        mu <- mu - alpha clip((gbar / (1 - beta_1^t) + delta mu) / (h + delta), clip_radius)

    The third term of the h update (IVON's Riemannian correction) keeps the precision's ``h + delta``
    positive: one update at most halves it. h itself can turn negative (from h < delta), and a
    weight's variance then exceeds the prior's ``1 / (ess delta)``.

    Args:
        beta_1, beta_2: the averaging constants above (defaults 0.9 and 0.99999); ``beta1`` and
            ``beta2`` are accepted as IVON's spellings (not both spellings at once).
        hess_init: initial h. clip_radius: the clip of the mean step (default: none).
    """

    _sample_statistic_names = ("grad", "hess")

    def __init__(self, learning_rate=0.1, num_examples=None, ess=None, hess_init=1.0, beta_1=None,
                 beta_2=None, weight_decay=None, clip_radius=float("inf"), name="ivon",
                 beta1=None, beta2=None, **kwargs):
        if ess is not None:
            if num_examples is not None or "kl_weight" in kwargs:
                raise ValueError("Pass either `ess` or `num_examples`/`kl_weight`, not both.")
            ess_value = _positive("ess", ess)
            # ess = N / kl_weight: N the nearest integer, kl_weight what makes the ratio exact
            num_examples = max(1, round(ess_value))
            if num_examples != ess_value:
                kwargs["kl_weight"] = num_examples / ess_value
        if weight_decay is not None:
            if kwargs.get("prior_variance") is not None or kwargs.get("prior_precision") is not None:
                raise ValueError("Pass either `weight_decay` or a prior variance/precision.")
            ess_value = (_validate_num_examples(num_examples)
                         / _positive("kl_weight", kwargs.get("kl_weight", 1.0)))
            kwargs["prior_variance"] = 1.0 / (ess_value * _positive("weight_decay", weight_decay))
        super().__init__(learning_rate=learning_rate, num_examples=num_examples, name=name, **kwargs)
        self.beta_1 = _probability("beta_1", _alias("beta_1", beta_1, "beta1", beta1, 0.9))
        self.beta_2 = _probability("beta_2", _alias("beta_2", beta_2, "beta2", beta2, 0.99999))
        self.hess_init = _positive("hess_init", hess_init)
        self.clip_radius = float("inf") if clip_radius == float("inf") else _positive(
            "clip_radius", clip_radius)
        self._slots = {"momentum": 0.0, "hess": self.hess_init}

    @property
    def ess(self):
        """Effective sample size N / kl_weight."""
        return self.num_examples / self.kl_weight

    @NoisyOptimizer.weight_decay.getter
    def weight_decay(self):
        """delta = 1 / (ess eta), the prior precision per example (= gamma_in)."""
        return self.intrinsic_damping

    def _precision(self, index):
        return self.ess * (self._slot("hess", index) + self.intrinsic_damping)

    def _variance(self, index):
        return self._sampling_variance(self._slot("hess", index), self.intrinsic_damping)

    def _sample_statistics(self, index, gradient, sample):
        hess = gradient * (sample - self._means[index]) * self._precision(index)
        return {"grad": gradient, "hess": hess}

    def _update_posterior(self, index, stats, lr):
        g, hhat, mu = stats["grad"], stats["hess"], self._means[index]
        m, h = self._slot("momentum", index), self._slot("hess", index)
        delta = self.intrinsic_damping
        t = self._step_number(g.dtype)
        m.assign(self.beta_1 * m + (1 - self.beta_1) * g)
        # The correction 0.5 (1 - beta_2)^2 (h - hhat)^2 / (h + delta) with the ratio taken
        # first: the square alone overflows float32 at |hhat| ~ 1e19 (one outlier batch), where
        # the correction is still finite (then h = Inf, sigma = 0 and NaN for good).
        gap = h - hhat
        h.assign(self.beta_2 * h + (1 - self.beta_2) * hhat
                 + 0.5 * (1 - self.beta_2) ** 2 * gap * (gap / (h + delta)))
        step = (m / (1 - self.beta_1 ** t) + delta * mu) / (h + delta)
        mu.assign_sub(lr * tf.clip_by_value(step, -self.clip_radius, self.clip_radius))

    def get_config(self):
        return {**super().get_config(), "hess_init": self.hess_init, "beta_1": self.beta_1,
                "beta_2": self.beta_2, "clip_radius": self.clip_radius}
