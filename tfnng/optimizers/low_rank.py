"""SLANG: low-rank-plus-diagonal Gaussian posteriors by natural gradient."""

import keras
import tensorflow as tf
import tensorflow_probability as tfp

from tfnng.optimizers._flat import FlatPosteriorOptimizer
from tfnng.optimizers.base import _intrinsic_damping, _non_negative_int, _positive_int
from tfnng.posteriors import low_rank as _low_rank


@keras.saving.register_keras_serializable(package="tfnng")
class SLANG(FlatPosteriorOptimizer):
    """SLANG — Alg. 1 of Mishkin et al. 2018 (*SLANG: Fast Structured Covariance Approximations for
    Bayesian Deep Learning with Natural Gradient*), in tfnng's per-example units.

    ``q(w) = N(mu, (lambda/N) (U U^T + diag d)^-1)``, ``U`` of shape (D, L). With ``G`` the (B, D)
    per-example log-likelihood gradients and ``g`` their batch mean, each update approximates the
    full-Gaussian VOGN step (SLANG eq. 2) ``P <- (1 - beta) P + beta (G^T G / B + gamma_in I)``:

        U, d <- top-L eigenpairs of (1 - beta) U U^T + beta G^T G / B, with the diagonal correction
                that keeps diag(P) exact                               (Alg. 1, lines 7-10; eq. 8-10)
        mu <- mu - alpha (U U^T + diag(d) + gamma_ex I)^-1 (g + gamma_in mu)      (lines 11-13)

    and samples ``w = mu + sqrt(lambda/N) fast_sample(U, d)`` (Alg. 3). SLANG's own scale (sums over
    the data set, prior precision lambda_p) is this one multiplied by N; ``gamma_in = lambda_p / N``.
    Everything costs O(D L^2 + D L B) per step, never a D x D matrix (:mod:`tfnng.posteriors.low_rank`),
    and the per-example gradients of Dense layers are never formed: the eigendecomposition only needs
    products with them (:class:`tfnng.curvature.per_example.ExampleGradients`). With L = D the update
    is exact: SLANG equals full-Gaussian VOGN.

    Args:
        rank: L, the number of low-rank columns (1 <= L <= D).
        eig_method: ``"auto"``, ``"exact"`` or ``"randomized"``: how fast_eig (Alg. 1, line 7) finds
            the top-L eigenpairs (:func:`tfnng.posteriors.low_rank.fast_eig`). ``"auto"`` solves the
            (L + B) x (L + B) Gram eigenproblem exactly for batches up to about 1000 examples.
        oversampling, power_iterations: of the randomised eigendecomposition.

    See :class:`~tfnng.optimizers._per_example.PerExampleOptimizer` (beta, hess_init,
    extrinsic_damping, fisher: the paper uses the empirical Fisher; rendered on the API page of
    tfnng.optimizers.base) and
    :class:`~tfnng.optimizers.base.NoisyOptimizer`. ``mc_samples`` must be 1.
    """

    def __init__(self, learning_rate=1e-3, num_examples=None, rank=1, beta=1e-3, hess_init=1.0,
                 extrinsic_damping=0.0, fisher="true", eig_method="auto",
                 oversampling=_low_rank.DEFAULT_OVERSAMPLING,
                 power_iterations=_low_rank.DEFAULT_POWER_ITERATIONS, name="slang", **kwargs):
        super().__init__(learning_rate=learning_rate, num_examples=num_examples, beta=beta,
                         hess_init=hess_init, extrinsic_damping=extrinsic_damping, fisher=fisher,
                         name=name, **kwargs)
        if self.mc_samples != 1:
            raise ValueError(
                "SLANG updates its low-rank factor from the per-example gradients of one weight "
                f"sample per step; mc_samples must be 1, got {self.mc_samples}.")
        self.rank = _positive_int("rank", rank)
        if eig_method not in _low_rank.EIG_METHODS:
            raise ValueError(f"`eig_method` must be one of {_low_rank.EIG_METHODS}, got {eig_method!r}.")
        self.eig_method = eig_method
        self.oversampling = _non_negative_int("oversampling", oversampling)
        self.power_iterations = _non_negative_int("power_iterations", power_iterations)

    def _build_posterior(self, dimension, dtype):
        if self.rank > dimension:
            raise ValueError(f"SLANG: `rank` ({self.rank}) exceeds the number of Bayesian weights "
                             f"({dimension}).")
        self._low_rank = self.add_variable((dimension, self.rank), "zeros", dtype, name="low_rank")
        d0 = self.hess_init + self.intrinsic_damping
        self._diagonal = self.add_variable(
            (dimension,), lambda shape, dtype: tf.fill(shape, tf.constant(d0, dtype)), dtype,
            name="diagonal")

    def _adopt_settings(self, saved):
        """The diagonal holds gamma_in (P = U U^T + diag(d) = F_bar + gamma_in I, whose averaging
        keeps gamma_in's share exact): the saved settings' is swapped for this optimizer's."""
        shift = self.intrinsic_damping - _intrinsic_damping(
            saved["kl_weight"], saved["num_examples"], saved["prior_variance"])
        self._diagonal.assign(self._diagonal + tf.cast(shift, self._diagonal.dtype))

    def _curvature_statistic(self, gradients):
        """The per-example gradients themselves: ``update`` weighs their outer products by 1/B."""
        return gradients

    def _update_flat(self, mean, grad, weight, curvature, lr, beta, standard_normal):
        low_rank, diagonal = _low_rank.update(
            self._low_rank, self._diagonal, curvature, beta, self.intrinsic_damping,
            oversampling=self.oversampling, power_iterations=self.power_iterations,
            seed=self._seed_generator, method=self.eig_method,
            curvature_weight=1.0 / tf.cast(curvature.num_columns, mean.dtype))
        self._low_rank.assign(low_rank)
        self._diagonal.assign(diagonal)
        target = grad + self.intrinsic_damping * mean
        if self.extrinsic_damping > 0:
            direction = _low_rank.fast_inverse(low_rank, diagonal + self.extrinsic_damping, target)
            noise = _low_rank.fast_sample(low_rank, diagonal, standard_normal)
        else:       # one float64 factorisation for the step and the next sample (Alg. 2 and 3)
            direction, noise = _low_rank.inverse_and_sample(low_rank, diagonal, target,
                                                            standard_normal)
        return mean - lr * direction, noise

    def sampling_state(self):
        return {"low_rank": tf.convert_to_tensor(self._low_rank),
                "diagonal": tf.convert_to_tensor(self._diagonal)}

    @staticmethod
    def perturb(state, standard_normal):
        return _low_rank.fast_sample(state["low_rank"], state["diagonal"], standard_normal)

    def _marginal_variances(self):
        return _low_rank.marginal_variances(self._low_rank, self._diagonal)

    def _scaled_factors(self):
        """The posterior precision ``(N/lambda) (U U^T + diag d)`` of the state ``U, d`` as
        ``(sqrt(N/lambda) U, (N/lambda) d)``: the precision is ``U' U'^T + diag d'`` of these."""
        scale = self._covariance_scale_as(self._diagonal.dtype)
        return self._low_rank / tf.sqrt(scale), self._diagonal / scale

    def _kl(self, mean):
        diagonal = tf.convert_to_tensor(self._diagonal)
        return _low_rank.kl_to_isotropic_prior(mean, tf.convert_to_tensor(self._low_rank), diagonal,
                                               self.prior_variance,
                                               self._covariance_scale_as(diagonal.dtype))

    def _distribution(self, mean):
        low_rank, diagonal = self._scaled_factors()
        return tfp.distributions.MultivariateNormalLinearOperator(
            loc=mean, scale=_low_rank.covariance_root(low_rank, diagonal))

    def precision_factors(self):
        """``(U, d)`` with posterior precision ``U U^T + diag(d)`` (flat layout: ``posterior_layout``)."""
        self._require_built()
        return self._scaled_factors()

    def get_config(self):
        return {**super().get_config(), "rank": self.rank, "eig_method": self.eig_method,
                "oversampling": self.oversampling,
                "power_iterations": self.power_iterations}
