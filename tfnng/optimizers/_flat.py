"""The mechanism of the families whose covariance couples all weights (SLANG, NNG-full).

Their posterior ``q(w) = N(mu, (lambda/N) P^-1)`` lives on one flat vector of length D: the Bayesian
variables of the model, flattened and concatenated in the order of ``model.trainable_variables``, in
the widest of their dtypes (a float64 layer keeps its precision next to float32 ones)
(point-estimated variables, e.g. ``NoisePrecision``'s, keep the base class's step). ``P`` is the
damped curvature ``F_bar + gamma_in I`` in per-example units (NNG eq. 9; SLANG eq. 2 divided by N):
each family stores it in its own structure. Per step the family gets the batch-mean gradient ``g``,
the current sample ``w`` and the (B, D) per-example log-likelihood gradients ``G`` from
:class:`tfnng.BayesianModel` (fast path for Dense/Conv2D, generic path for every other layer), as an
operator that forms them only where needed (:class:`tfnng.curvature.per_example.ExampleGradients`).
"""

import numpy as np
import tensorflow as tf

from tfnng._names import unique_names
from tfnng.optimizers._per_example import PerExampleOptimizer
from tfnng.posteriors import _linalg


class FlatPosteriorOptimizer(PerExampleOptimizer):
    """Base class of :class:`~tfnng.optimizers.SLANG` and :class:`~tfnng.optimizers.NoisyNaturalGradient`.

    Subclasses implement ``_build_posterior(dimension, dtype)``, ``_curvature_statistic(F)`` (the
    per-step curvature estimate from the per-example gradients, the columns of
    ``F = G^T``: a :class:`~tfnng.curvature.per_example.ExampleGradients`; averaged over
    ``mc_samples`` when it has a fixed shape),
    ``_update_flat(mean, grad, weight, curvature, lr, beta, eps)`` (returns the new mean and
    ``perturb`` of the updated state applied to ``eps``, the next step's weight noise, so that the
    two can share a factorisation), ``sampling_state()`` and ``perturb(state, eps)`` (a draw of
    ``N(0, P^-1)`` from ``eps ~ N(0, I)``), ``_marginal_variances()`` (``diag(P^-1)``), ``_kl(mean)`` and
    ``_distribution(mean)``.

    See :class:`~tfnng.optimizers._per_example.PerExampleOptimizer` for ``beta``, ``hess_init``
    (``P_0 = (hess_init + gamma_in) I``), ``extrinsic_damping`` and ``fisher``.
    """

    _sample_statistic_names = ()
    _joint_over_layers = True

    # ---------------------------------------------------------------------------------------- state
    def build(self, variables):
        if self.built:
            return
        super().build(variables)
        if self.mc_samples > 1:
            dtype = self._flat_dtype
            self._mc_sums = {
                "grad": self.add_variable((self.dimension,), "zeros", dtype, name="mc_sum_grad"),
                "weight": self.add_variable((self.dimension,), "zeros", dtype, name="mc_sum_weight"),
                "curvature": self.add_variable(*self._curvature_spec(self.dimension, dtype),
                                               name="mc_sum_curvature")}

    def _build_family_state(self, variables):
        self._flat_indices = [i for i, point in enumerate(self._point) if not point]
        if not self._flat_indices:
            raise ValueError(f"{type(self).__name__}: the model has no Bayesian variables.")
        self._sizes = [int(np.prod(variables[i].shape)) for i in self._flat_indices]
        self.dimension = sum(self._sizes)
        self._flat_dtype = max((tf.as_dtype(variables[i].dtype) for i in self._flat_indices),
                               key=lambda dtype: dtype.size)
        self._build_posterior(self.dimension, self._flat_dtype)

    def _curvature_spec(self, dimension, dtype):
        """``(shape, initializer, dtype)`` of the curvature statistic's Monte Carlo sum."""
        raise ValueError(f"{type(self).__name__} does not support mc_samples > 1.")

    @property
    def _covariance_scale(self):
        """lambda / N: the covariance is ``(lambda/N) P^-1`` (NNG eq. 9)."""
        return self.kl_weight / self.num_examples

    def _covariance_scale_as(self, dtype):
        """``_covariance_scale`` as a ``dtype`` tensor (in float64 without float32 rounding)."""
        return _linalg.cast(self._covariance_scale, dtype)

    def _flatten(self, tensors, dtype):
        return tf.concat([tf.reshape(tf.cast(t, dtype), [-1]) for t in tensors], axis=0)

    def _unflatten(self, vector):
        """The parts of a flat vector, each in its variable's shape and dtype."""
        parts = tf.split(vector, self._sizes)
        return {i: tf.cast(tf.reshape(p, self._trainable_variables[i].shape),
                           self._trainable_variables[i].dtype)
                for i, p in zip(self._flat_indices, parts)}

    def _flat_mean(self):
        return self._flatten([self._means[i] for i in self._flat_indices], self._flat_dtype)

    # --------------------------------------------------------------------------------- update step
    def _backend_update_step(self, grads, trainable_variables, learning_rate):
        self._refuse_frozen(self._flat_indices, "the posterior covers the variables it was built "
                            "for jointly; compile the model with a new optimizer")
        finite, apply_now = self._step_flags
        dtype = self._flat_dtype
        lr = tf.cast(learning_rate, dtype)
        # Keras drops variables without gradient from the lists: align by variable index.
        given = {self._get_variable_index(v): g for g, v in zip(grads, trainable_variables)}
        for i, gradient in given.items():
            if self._point[i]:
                variable = self._trainable_variables[i]
                self._point_step(i, tf.cast(gradient, variable.dtype), variable,
                                 tf.cast(learning_rate, variable.dtype))
        flat_grads = [given[i] if i in given else tf.zeros_like(self._means[i])
                      for i in self._flat_indices]
        stats = {
            "grad": self._flatten(flat_grads, dtype),
            "weight": self._flatten([self._trainable_variables[i] for i in self._flat_indices], dtype),
            "curvature": self._curvature_statistic(
                self._example_gradient_columns(self._flat_indices, dtype))}
        if self.mc_samples > 1:
            stats = self._accumulate_flat(stats, finite, apply_now)

        # The next step's weight noise, drawn first: the update can then share its factorisation
        # of the new posterior with the sample (SLANG's Woodbury terms).
        standard_normal = self._standard_normal((self.dimension,), dtype)

        def update():
            mean, noise = self._update_flat(self._flat_mean(), stats["grad"], stats["weight"],
                                            stats["curvature"], lr, self._beta_now(dtype),
                                            standard_normal)
            for i, value in self._unflatten(mean).items():
                self._means[i].assign(value)
            return noise

        self._assign_sample(tf.cond(
            apply_now, update, lambda: self.perturb(self.sampling_state(), standard_normal)))

    def _accumulate_flat(self, stats, finite, apply_now):
        return {name: self._accumulate_into(self._mc_sums[name], value, finite, apply_now)
                for name, value in stats.items()}

    def sampling_state(self):
        """The tensors that determine the sampler ``perturb`` (what tfnng.serving exports)."""
        raise NotImplementedError

    @staticmethod
    def perturb(state, standard_normal):
        """A draw of ``N(0, P^-1)`` from ``standard_normal`` given ``sampling_state()``."""
        raise NotImplementedError

    def _write_sample(self):
        eps = self._standard_normal((self.dimension,), self._flat_dtype)
        self._assign_sample(self.perturb(self.sampling_state(), eps))

    def _assign_sample(self, noise):
        """Write ``mu + sqrt(lambda/N) noise`` into the variables (``noise`` a draw of N(0, P^-1))."""
        mean = self._flat_mean()
        sample = mean + tf.sqrt(self._covariance_scale_as(mean.dtype)) * noise
        for i, value in self._unflatten(sample).items():
            self._trainable_variables[i].assign(value)

    # ---------------------------------------------------------------------------- posterior access
    def _variance(self, index):
        return self._unflatten(self._covariance_scale * self._marginal_variances())[index]

    def kl_divergence(self):
        """KL(q || N(0, eta I)) of the whole flat posterior in closed form (a scalar in the
        posterior's dtype, float32 for a float32 model; the diagonal and K-FAC families give
        float64)."""
        self._require_built()
        return self._kl(self._flat_mean())

    def posterior(self):
        """The posterior over the flat vector of Bayesian variables (``posterior_layout`` orders it)."""
        self._require_built()
        return self._distribution(self._flat_mean())

    def posterior_layout(self):
        """``[(variable path, shape), ...]``: how the flat posterior vector maps onto the model (a
        repeated path gets a suffix, ``_1``, ``_2``...)."""
        self._require_built()
        names = unique_names([self._trainable_variables[i].path for i in self._flat_indices])
        return [(name, tuple(self._trainable_variables[i].shape))
                for name, i in zip(names, self._flat_indices)]
