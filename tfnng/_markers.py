"""Markers that tell tfnng optimizers how to treat a variable.

A variable marked as a *point estimate* is a variational parameter itself (for example the Gamma
posterior q(tau) of the noise precision, NNG App. C.1) rather than a network weight with a Gaussian
posterior: tfnng optimizers fit it by a plain (bias-corrected, square-root) Adam step, without weight
noise and without a prior term.

A variable marked as a *natural parameter* is a point estimate whose layer hands the optimizer the
natural gradient: the variable is an affine image, with Jacobian +-1 per entry, of the natural
parameters theta of a conjugate exponential-family factor, and the layer routes its gradient through
the mean parameters m, so that the gradient of the per-example loss is ``+-dL/dm``, the natural
gradient in theta (Khan & Lin 2017, "Conjugate-computation variational inference", eq. 4). tfnng
optimizers then take the stochastic natural-gradient step of Hoffman et al. (2013, eq. 13),
``v <- v - rho * N * g`` with ``rho = min(learning_rate, 1)``: with ``rho = 1`` and the full data set
it moves the factor to its conjugate optimum in one step.
"""

_POINT_ESTIMATE_ATTR = "_tfnng_point_estimate"
_NATURAL_PARAMETER_ATTR = "_tfnng_natural_parameter"


def mark_point_estimate(variable):
    """Mark ``variable`` to be point-estimated (no weight noise, no prior) by tfnng optimizers."""
    setattr(variable, _POINT_ESTIMATE_ATTR, True)
    return variable


def is_point_estimate(variable):
    """Whether ``variable`` was marked with :func:`mark_point_estimate` (or as a natural parameter)."""
    return bool(getattr(variable, _POINT_ESTIMATE_ATTR, False))


def mark_natural_parameter(variable):
    """Mark ``variable`` as a natural parameter whose gradient is the natural gradient (see the module
    docstring): tfnng optimizers point-estimate it by the step ``v <- v - min(lr, 1) * N * g``."""
    setattr(variable, _NATURAL_PARAMETER_ATTR, True)
    return mark_point_estimate(variable)


def is_natural_parameter(variable):
    """Whether ``variable`` was marked with :func:`mark_natural_parameter`."""
    return bool(getattr(variable, _NATURAL_PARAMETER_ATTR, False))
