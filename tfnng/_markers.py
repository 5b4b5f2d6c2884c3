"""Markers that tell tfnng optimizers how to treat a variable.

A variable marked as a *point estimate* is a variational parameter itself (for example a learned
temperature) rather than a network weight with a Gaussian posterior: tfnng optimizers fit it by a
plain (bias-corrected, square-root) Adam step, without weight noise and without a prior term.

A variable marked as a *natural parameter* is a point estimate that parameterises a conjugate
exponential-family factor of the variational posterior (``NoisePrecision``'s Gamma q(tau)) and
carries a ``natural_step(value, gradient, step_size)`` function: given the variable's value and the
ordinary gradient of the per-example loss L = -ELBO / N, it returns the value after the stochastic
natural-gradient step ``theta <- theta - step_size * N * dL/dm`` in the factor's natural parameters
theta (Khan & Lin 2017: the natural gradient in theta is the gradient in the mean parameters m). The
function owns N (the training-set size its loss term was divided by), so the step stays the
factor's own natural gradient whatever the optimizer was told. tfnng optimizers apply it with
``step_size = min(learning_rate, 1)``, the conjugate step of stochastic variational inference
(Hoffman et al. 2013, eq. 13): with step 1 and the full data set it lands on the factor's optimum.
Keras optimizers ignore the markers and see the ordinary gradient.
"""

import keras
import tensorflow as tf

_POINT_ESTIMATE_ATTR = "_tfnng_point_estimate"
_NATURAL_STEP_ATTR = "_tfnng_natural_step"


def _require_variable(function, variable):
    """The markers are read from variables only: on a layer or tensor the mark would do nothing."""
    if not isinstance(variable, (keras.Variable, tf.Variable)):
        raise TypeError(f"{function} marks one variable (e.g. `layer.kernel`); got "
                        f"{type(variable).__name__}. To mark a layer's weights, mark each of "
                        "`layer.trainable_weights`.")


def mark_point_estimate(variable):
    """Mark ``variable`` to be point-estimated (no weight noise, no prior) by tfnng optimizers.

    The mark is a Python attribute of the variable, not saved with the model: mark in the layer's
    ``build`` so that a model rebuilt by ``keras.models.load_model`` has it again. tfnng optimizers
    read the marks when they are built; a variable marked later is refused with an error when the
    training step is next traced (compile the model with a new optimizer after marking).
    """
    _require_variable("mark_point_estimate", variable)
    setattr(variable, _POINT_ESTIMATE_ATTR, True)
    return variable


def is_point_estimate(variable):
    """Whether ``variable`` was marked with :func:`mark_point_estimate` (or as a natural parameter)."""
    return bool(getattr(variable, _POINT_ESTIMATE_ATTR, False))


def mark_natural_parameter(variable, natural_step):
    """Mark ``variable`` as parameterising a conjugate factor that tfnng optimizers update by
    ``variable.assign(natural_step(variable, gradient, min(lr, 1)))`` (see the module docstring)."""
    _require_variable("mark_natural_parameter", variable)
    if not callable(natural_step):
        raise TypeError("mark_natural_parameter: `natural_step` must be a function "
                        f"(value, gradient, step_size) -> new value; got {natural_step!r}.")
    setattr(variable, _NATURAL_STEP_ATTR, natural_step)
    return mark_point_estimate(variable)


def natural_step(variable):
    """The ``natural_step`` function ``variable`` was marked with, or None."""
    return getattr(variable, _NATURAL_STEP_ATTR, None)
