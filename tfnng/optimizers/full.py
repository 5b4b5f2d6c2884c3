"""Full-covariance noisy natural gradient (NNG-full) for small models."""

import keras
import tensorflow as tf
import tensorflow_probability as tfp

from tfnng.optimizers._flat import FlatPosteriorOptimizer
from tfnng.optimizers.base import _positive_int
from tfnng.posteriors import full as _full


@keras.saving.register_keras_serializable(package="tfnng")
class NoisyNaturalGradient(FlatPosteriorOptimizer):
    """Noisy natural gradient with a full-covariance Gaussian — NNG paper eq. 9-10 (NNG-full).

    ``q(w) = N(mu, (lambda/N) (F_bar + gamma_in I)^-1)`` over all Bayesian weights. With ``G`` the
    (B, D) per-example log-likelihood gradients, ``g`` the batch-mean gradient and ``w`` the sample::

        F_bar <- (1 - beta) F_bar + beta G^T G / B                                (eq. 9)
        mu <- mu - alpha (F_bar + (gamma_in + gamma_ex) I)^-1 (g + gamma_in w)    (eq. 10)

    The dense D x D precision is refactorised (Cholesky) at every update, O(D^3): meant for models up
    to ``max_parameters`` weights (default 10^4, a clear error above). With the true Fisher and
    lambda = 1 its fixed point on Bayesian linear regression is the exact posterior.

    ``F_bar``, ``G^T G`` and the factorisations are float64 whatever the model's dtype (the stored
    Cholesky factor of the sampling precision is cast to it): the damping gamma_in = lambda/(N eta)
    is tiny next to ``F_bar``'s largest eigenvalues for large N, and a float32 average drifted to
    negative eigenvalues below -gamma_in in directions without gradient (collinear inputs, N = 6e4),
    where the Cholesky factorisation fails (TensorFlow fills it with NaN).

    Args:
        max_parameters: the largest D accepted.

    See :class:`~tfnng.optimizers._per_example.PerExampleOptimizer` (beta, hess_init,
    extrinsic_damping, fisher; rendered on the API page of tfnng.optimizers.base) and
    :class:`~tfnng.optimizers.base.NoisyOptimizer`.
    """

    def __init__(self, learning_rate=1e-3, num_examples=None, beta=1e-3, hess_init=1.0,
                 extrinsic_damping=0.0, fisher="true", max_parameters=_full.DEFAULT_MAX_PARAMETERS,
                 name="noisy_natural_gradient", **kwargs):
        super().__init__(learning_rate=learning_rate, num_examples=num_examples, beta=beta,
                         hess_init=hess_init, extrinsic_damping=extrinsic_damping, fisher=fisher,
                         name=name, **kwargs)
        self.max_parameters = _positive_int("max_parameters", max_parameters)

    def _build_posterior(self, dimension, dtype):
        _full.check_parameter_count(dimension, self.max_parameters)
        fisher0 = self.hess_init
        root0 = (self.hess_init + self.intrinsic_damping) ** 0.5
        self._fisher = self.add_variable(
            (dimension, dimension), lambda shape, dtype: fisher0 * tf.eye(shape[0], dtype=dtype),
            tf.float64, name="fisher")
        # Cholesky factor of the sampling precision F_bar + gamma_in I, refreshed at each update.
        self._chol = self.add_variable(
            (dimension, dimension), lambda shape, dtype: root0 * tf.eye(shape[0], dtype=dtype),
            dtype, name="precision_cholesky")

    def _adopt_settings(self, saved):
        """The cached Cholesky factor of F_bar + gamma_in I, refactorised with this optimizer's
        gamma_in (the loaded Fisher holds no damping)."""
        self._chol.assign(tf.cast(_full.cholesky(_full.damped_precision(
            self._fisher, 1.0, self.intrinsic_damping)), self._chol.dtype))

    def _curvature_spec(self, dimension, dtype):
        return (dimension, dimension), "zeros", tf.float64

    def _curvature_statistic(self, gradients):
        """``G^T G / B`` (D x D, float64) from the per-example gradients (columns of ``F = G^T``)."""
        columns = tf.cast(gradients.to_dense(), tf.float64)
        return (tf.matmul(columns, columns, transpose_b=True)
                / tf.cast(gradients.num_columns, tf.float64))

    def _update_flat(self, mean, grad, weight, curvature, lr, beta, standard_normal):
        beta = tf.cast(beta, tf.float64)
        fisher = (1 - beta) * self._fisher + beta * curvature
        self._fisher.assign(fisher)
        chol = _full.cholesky(_full.damped_precision(fisher, 1.0, self.intrinsic_damping))
        self._chol.assign(tf.cast(chol, self._chol.dtype))
        if self.extrinsic_damping > 0:
            chol = _full.cholesky(_full.damped_precision(
                fisher, 1.0, self.intrinsic_damping + self.extrinsic_damping))
        direction = _full.precondition(chol, tf.cast(grad, tf.float64)
                                       + self.intrinsic_damping * tf.cast(weight, tf.float64))
        return (mean - lr * tf.cast(direction, mean.dtype),
                self.perturb(self.sampling_state(), standard_normal))

    def sampling_state(self):
        return {"cholesky": tf.convert_to_tensor(self._chol)}

    @staticmethod
    def perturb(state, standard_normal):
        return _full.sample(state["cholesky"], standard_normal)

    def _marginal_variances(self):
        return _full.marginal_variances(self._chol)

    def _scaled_cholesky(self):
        """Cholesky factor of the posterior precision (N/lambda) (F_bar + gamma_in I)."""
        return self._chol / tf.sqrt(self._covariance_scale_as(self._chol.dtype))

    def _kl(self, mean):
        return _full.kl_to_isotropic_prior(mean, self._scaled_cholesky(), self.prior_variance)

    def _distribution(self, mean):
        # Scale C^-T from the precision's factor C: the covariance's own Cholesky factorisation
        # fails in float32 when gamma_in is tiny next to F_bar (the case of the class docstring).
        precision_root = tf.linalg.LinearOperatorLowerTriangular(
            self._scaled_cholesky(), is_non_singular=True)
        return tfp.distributions.MultivariateNormalLinearOperator(
            mean, tf.linalg.LinearOperatorInversion(precision_root.adjoint()))

    def covariance(self):
        """The dense posterior covariance ``(lambda/N) (F_bar + gamma_in I)^-1`` (D x D)."""
        self._require_built()
        return _full.covariance(self._scaled_cholesky())

    def get_config(self):
        return {**super().get_config(), "max_parameters": self.max_parameters}
