"""The optimizer side of per-example statistics (:class:`tfnng.curvature.Requirements`).

Optimizers whose curvature is built from per-example gradients (NoisyAdam's per-example Fisher,
VOGN, SLANG, NNG-full) read them from the records :class:`tfnng.BayesianModel` hands over each step
(:meth:`~tfnng.optimizers.base.CurvatureConsumer.receive_curvature`). :class:`PerExampleStatistics`
finds, for each model variable, where its per-example gradients come from — the fast path of its
Dense/Conv2D layer, or the generic path's record — so the selection is automatic.
"""

import logging

import keras
import tensorflow as tf

from tfnng import curvature as _curvature
from tfnng._names import layer_paths
from tfnng._xla import checked
from tfnng.curvature import kronecker as _rows
from tfnng.curvature import per_example as _per_example
from tfnng.optimizers.base import CurvatureConsumer, NoisyOptimizer, _finite_float, _non_negative

_log = logging.getLogger("tfnng")


class PerExampleStatistics:
    """Mixin for :class:`~tfnng.optimizers.base.CurvatureConsumer` optimizers (call
    :meth:`_map_per_example_sources` at the end of ``build``)."""

    def _map_per_example_sources(self):
        """Index -> (layer spec, "kernel" | "bias") for every variable of a captured layer."""
        self._fast_sources = {}
        for spec, kernel, bias in self._trained_layer_specs():
            for part, index in (("kernel", kernel), ("bias", bias)):
                if index is not None:
                    self._fast_sources[index] = (spec, part)

    def _checked_tensors(self, grads, trainable_variables):
        """The non-finite guard's tensors, and for each captured layer a bound on its per-example
        gradient norms (:func:`tfnng.curvature.kronecker.example_gradient_norm_bounds`): the
        squared per-example gradients and their Gram matrices overflow where the inputs and
        pre-activation gradients they multiply do not (an input of 1e10 in one example)."""
        tensors = super()._checked_tensors(grads, trainable_variables)
        records = self._curvature_batch or {}
        specs = ([spec for spec, _, _ in self._trained_layer_specs()] if self.built
                 else self._layer_specs or ())
        for spec in specs:
            record = records.get(spec.name)
            if getattr(record, "preactivation_grads", None) is not None:
                tensors.append((
                    f"the per-example gradients of {spec.name} (its captured inputs times its "
                    "pre-activation gradients)",
                    _rows.example_gradient_norm_bounds(spec, record.inputs,
                                                       record.preactivation_grads)))
        return tensors

    def _layers_without_fast_path(self, variables):
        """Sorted paths of the layers holding Bayesian variables that no fast path covers."""
        return layer_paths(v for i, v in enumerate(variables)
                           if i not in self._fast_sources and not self._point[i])

    def _from_layer(self, index, compute):
        """One part of a captured layer's per-example quantity, computed once per layer and step."""
        spec, part = self._fast_sources[index]
        key = (compute.__name__, spec.name)
        records = self._received_curvature()      # a clear error first when there are none
        if key not in self._curvature_cache:
            self._curvature_cache[key] = compute(spec, records[spec.name])
        kernel, bias = self._curvature_cache[key]
        return kernel if part == "kernel" else bias

    def _squared_gradient_mean(self, index):
        """``(1/B) sum_n g_n^2`` for variable ``index`` (VOGN eq. 9, NNG Alg. 1's Fisher)."""
        if index in self._fast_sources:
            return self._from_layer(index, _per_example.layer_squared_gradient_means)
        gradients = self._generic_gradients(index)
        return tf.reduce_mean(tf.square(gradients), axis=0)

    def _example_gradient_columns(self, indices, dtype):
        """The per-example gradients of the variables ``indices``, flattened and concatenated in that
        order, as a :class:`~tfnng.curvature.per_example.ExampleGradients` (SLANG Alg. 1, line 6)."""
        layer_blocks, layout = {}, []
        for index in indices:
            if index in self._fast_sources:
                spec, part = self._fast_sources[index]
                if spec.name not in layer_blocks:
                    layer_blocks[spec.name] = _per_example.layer_block(
                        spec, self._received_curvature()[spec.name], dtype)
                layout.append((layer_blocks[spec.name], part))
            else:
                layout.append((_per_example.variable_block(self._generic_gradients(index), dtype),
                               None))
        return _per_example.ExampleGradients(layout)

    def _generic_gradients(self, index):
        variable = self._trainable_variables[index]
        # By identity: paths need not be unique.
        for record in self._received_curvature().values():
            if getattr(record, "variable", None) is variable:
                return record.gradients
        raise ValueError(
            f"{type(self).__name__}: no per-example gradients for {variable.path}"
            + ("" if variable.trainable else ", which is no longer trainable (frozen after the "
               "optimizer was built: its posterior covers the variables it was built for; "
               "compile the model with a new optimizer)") + ".")


class PerExampleOptimizer(PerExampleStatistics, CurvatureConsumer, NoisyOptimizer):
    """Base of the optimizers whose curvature is an average of per-example gradient products (VOGN,
    SLANG, NNG-full): their common hyper-parameters and requirements.

    Args:
        beta: step size of the curvature (VOGN eq. 10's beta, NNG eq. 9's beta-tilde, SLANG Alg. 1's
            beta), in (0, 1]: a float or a Keras schedule of the update number.
        hess_init: initial value of the curvature's diagonal. The default 1 bounds the first mean
            steps by plain gradient steps; with 0, directions the first batches' curvature does not
            reach are stepped by ``alpha g / gamma_in``, up to N times larger, which diverges for usual
            step sizes on a large data set.
        extrinsic_damping: gamma_ex, added to the damping of the mean step only (NNG sec. 3.2).
        fisher: ``"true"`` (targets sampled from the predictive, NNG footnote 1) or
            ``"empirical"`` (the observed targets: the papers' "EF" variants).
    """

    def __init__(self, learning_rate, num_examples=None, beta=1e-3, hess_init=1.0,
                 extrinsic_damping=0.0, fisher="true", **kwargs):
        super().__init__(learning_rate=learning_rate, num_examples=num_examples, **kwargs)
        self.curvature_requirements = _curvature.Requirements(
            kronecker=True, per_example_gradients=True, fisher=fisher)
        self.fisher = fisher
        self.beta = resolve_rate("beta", beta)
        self.hess_init = _non_negative("hess_init", hess_init)
        self.extrinsic_damping = _non_negative("extrinsic_damping", extrinsic_damping)

    def build(self, variables):
        if self.built:
            return
        self._require_layer_specs()
        super().build(variables)
        self._map_per_example_sources()
        generic = self._layers_without_fast_path(variables)
        if generic:
            _log.info("%s: per-example gradients of %s by the generic path (slower than the "
                      "Dense/Conv2D fast path).", type(self).__name__, ", ".join(generic))

    def _beta_now(self, dtype):
        return rate_at("beta", self.beta, self._update_count, dtype)

    def _step_guards(self):
        guards = super()._step_guards()
        return guards + [self._beta_now(tf.float64)] if guards and self.built else guards

    @classmethod
    def from_config(cls, config, custom_objects=None):
        """Keras's, with a serialized ``beta`` schedule deserialized with ``custom_objects`` as
        the learning rate's is."""
        if isinstance(config.get("beta"), dict):
            config = {**config, "beta": keras.optimizers.schedules.deserialize(
                config["beta"], custom_objects=custom_objects)}
        return super().from_config(config, custom_objects=custom_objects)

    def get_config(self):
        return {**super().get_config(), "beta": serialize_rate(self.beta),
                "hess_init": self.hess_init, "extrinsic_damping": self.extrinsic_damping,
                "fisher": self.fisher}


def resolve_rate(name, value):
    """Validate a rate in (0, 1] given as a float or a ``keras.optimizers.schedules`` schedule."""
    if isinstance(value, dict):
        value = keras.optimizers.schedules.deserialize(value)
    if isinstance(value, keras.optimizers.schedules.LearningRateSchedule):
        return value
    number = _finite_float(value)
    if number is None or not 0.0 < number <= 1.0:
        raise ValueError(f"`{name}` must be in (0, 1] or a keras.optimizers.schedules schedule, "
                         f"got {value!r}.")
    return number


def rate_at(name, rate, step, dtype):
    """The value of a :func:`resolve_rate` rate at update number ``step`` (a schedule's value is
    checked to lie in (0, 1], as :func:`tfnng._xla.checked` can)."""
    if isinstance(rate, keras.optimizers.schedules.LearningRateSchedule):
        value = tf.cast(rate(step), dtype)
        return checked(value, (value > 0) & (value <= 1),
                       f"the `{name}` schedule must give values in (0, 1].")
    return tf.constant(rate, dtype)


def serialize_rate(rate):
    if isinstance(rate, keras.optimizers.schedules.LearningRateSchedule):
        return keras.optimizers.schedules.serialize(rate)
    return rate
