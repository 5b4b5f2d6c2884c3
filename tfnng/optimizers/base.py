"""The mechanism shared by every tfnng optimizer: a Keras 3 optimizer that fits a Gaussian posterior.

Noisy natural gradient (NNG paper sec. 3, eq. 9-10) evaluates each gradient at a *sample* of the
weights. tfnng keeps the posterior mean ``mu`` in the optimizer state and writes a fresh weight sample
into the model's variables after every update, so an unmodified Keras model trained with
``model.fit`` (or a hand-written ``tf.GradientTape`` loop) always runs its forward/backward pass at a
posterior sample:

    gradient at w_t  ->  update the posterior (mu, curvature)  ->  w_{t+1} ~ q  written into the model

The very first gradient is taken at the model's initial weights (``w_0 = mu_0``, a sample with
``eps = 0``); call :meth:`NoisyOptimizer.sample_weights` after ``build`` to start from a random draw.

With ``mc_samples = S > 1`` the optimizer accumulates S consecutive gradient evaluations, each at its
own weight sample, and updates the posterior once with their average (the Monte Carlo estimate of the
expected gradient); point-estimated variables (``tfnng._markers``) are updated with it, once. In
``model.fit`` these S evaluations see S consecutive batches (as with Keras's
``gradient_accumulation_steps``); in a hand-written loop you may reuse one batch.

Common vocabulary (NNG Alg. 1-2): ``num_examples`` N, ``prior_variance`` eta (or ``prior_precision``
1/eta), ``kl_weight`` lambda. The intrinsic damping is ``gamma_in = lambda / (N eta)``. Losses follow
the Keras convention (mean negative log-likelihood of the batch); the optimizers do the scaling by N.
"""

import contextlib
import functools
import inspect
import json
import logging
import math
import numbers
import threading

import keras
import numpy as np
import tensorflow as tf

from tfnng import _markers, _random
from tfnng._dtypes import at_least_float32
from tfnng._names import unique_names, variable_path
from tfnng._xla import checked, compiled_with_xla
from tfnng.posteriors import diagonal as _diagonal


def _finite_float(value):
    """``float(value)`` if it is a finite number, else None (bools, strings, None, nan, inf).

    ``float`` itself would take ``True`` as 1 and ``"0.1"`` as 0.1; tfnng's layers and losses
    refuse both, and so do the optimizers."""
    if isinstance(value, (bool, np.bool_, str, bytes)):
        return None
    try:
        value = float(value)
    except (TypeError, ValueError):
        return None
    return value if math.isfinite(value) else None


def _positive(name, value):
    number = _finite_float(value)
    if number is None or number <= 0:
        raise ValueError(f"`{name}` must be a positive finite number, got {value!r}.")
    return number


def _non_negative(name, value):
    number = _finite_float(value)
    if number is None or number < 0:
        raise ValueError(f"`{name}` must be a finite number >= 0, got {value!r}.")
    return number


def _is_integer(value):
    try:
        return not isinstance(value, bool) and int(value) == value
    except (TypeError, ValueError, OverflowError):       # None, strings, inf, nan
        return False


_INT64_MAX = np.iinfo(np.int64).max      # counts meet TensorFlow's int64 step counters


def seed_value(value):
    """A random seed as ``keras.random.SeedGenerator`` takes it: None, or a Python int (NumPy
    integers too, which Keras refuses) within int64, the dtype of the generator's state."""
    if value is not None and (not _is_integer(value) or not -_INT64_MAX - 1 <= value <= _INT64_MAX):
        raise ValueError(f"`seed` must be an integer (within int64) or None, got {value!r}.")
    return None if value is None else int(value)


def _positive_int(name, value):
    if not _is_integer(value) or not 1 <= value <= _INT64_MAX:
        raise ValueError(f"`{name}` must be an integer >= 1 (at most 2**63 - 1), got {value!r}.")
    return int(value)


def _non_negative_int(name, value):
    if not _is_integer(value) or not 0 <= value <= _INT64_MAX:
        raise ValueError(f"`{name}` must be an integer >= 0 (at most 2**63 - 1), got {value!r}.")
    return int(value)


def _unit_rate(name, value):
    """A rate in (0, 1]: an averaging weight or a decay factor."""
    number = _finite_float(value)
    if number is None or not 0.0 < number <= 1.0:
        raise ValueError(f"`{name}` must be in (0, 1], got {value!r}.")
    return number


def _probability(name, value):
    number = _finite_float(value)
    if number is None or not 0.0 <= number < 1.0:
        raise ValueError(f"`{name}` must be in [0, 1), got {value!r}.")
    return number


def _boolean(name, value):
    """A flag given as a bool (``bool("False")`` would be True)."""
    if not isinstance(value, (bool, np.bool_)):
        raise ValueError(f"`{name}` must be True or False, got {value!r}.")
    return bool(value)


def _resolve_prior_variance(prior_variance, prior_precision):
    if prior_variance is not None and prior_precision is not None:
        raise ValueError("Pass either `prior_variance` or `prior_precision`, not both.")
    if prior_precision is not None:
        return 1.0 / _positive("prior_precision", prior_precision)
    return _positive("prior_variance", 1.0 if prior_variance is None else prior_variance)


def _validate_num_examples(num_examples):
    if num_examples is None:
        raise ValueError(
            "`num_examples` (N, the number of training examples) is required: the posterior "
            "variance and the prior term scale with 1/N. Pass e.g. num_examples=len(x_train).")
    if not _is_integer(num_examples) or num_examples <= 0:
        raise ValueError(f"`num_examples` must be a positive integer, got {num_examples!r}.")
    return int(num_examples)


class _TraceScratch(threading.local):
    """Plain-Python values of the step being traced (never tracked), one set per thread.

    ``tf.distribute.MirroredStrategy`` traces each replica's step in its own thread and switches
    threads at every all-reduce; an ordinary attribute would hand one replica's tensors to another.
    """

    step_flags = None
    curvature_batch = None
    curvature_cache = None


def _per_thread(name):
    """Property stored in the optimizer's :class:`_TraceScratch` (created on first use)."""
    def scratch(optimizer):
        local = optimizer.__dict__.get("_trace_scratch")
        if local is None:
            local = _TraceScratch()
            object.__setattr__(optimizer, "_trace_scratch", local)
        return local

    return property(lambda self: getattr(scratch(self), name),
                    lambda self, value: setattr(scratch(self), name, value))


def _sum_over_replicas(grads):
    """All-reduce (sum) of the gradients over the replicas of a ``tf.distribute`` strategy.

    Keras divides each replica's loss by the number of replicas (``tf.distribute`` convention), so
    the sum is the gradient of the global batch's mean loss and every replica updates with it.
    """
    context = tf.distribute.get_replica_context()
    if context is None or context.num_replicas_in_sync == 1:
        return grads
    return context.all_reduce(tf.distribute.ReduceOp.SUM, list(grads))


def _constant(value):
    """Initializer exact in the variable's dtype (Keras's Constant rounds through float32)."""
    return lambda shape, dtype: tf.fill(shape, tf.constant(value, dtype))


_ANOTHER_OPTIMIZERS_STATE = (
    "If the file holds another optimizer's state (weights pre-trained with Keras Adam, say): the "
    "model's weights are loaded already; `load_weights(..., skip_mismatch=True)` skips the "
    "optimizer state quietly, or load the weights before compiling with the tfnng optimizer.")


class NoisyOptimizer(keras.optimizers.Optimizer):
    """Base class of tfnng's Gaussian-posterior optimizers (not used directly).

    Subclasses declare their per-variable state in ``_slots`` (name -> initial value), and implement
    ``_variance(index)`` (posterior variance from the state) and
    ``_update_posterior(index, stats, learning_rate)`` (the paper's update, given the Monte Carlo
    averages of the per-sample statistics returned by ``_sample_statistics``).

    Args:
        learning_rate: step size alpha of the mean update (a number >= 0, or a Keras schedule).
        num_examples: N, the number of training examples. Required.
        prior_variance: eta of the prior N(0, eta I). Default 1.
        prior_precision: 1/eta, accepted instead of ``prior_variance`` (never both).
        kl_weight: lambda, the weight of the KL term (lambda < 1 tempers the posterior). Default 1.
        mc_samples: number of weight samples (gradient evaluations) averaged per update (a missing
            gradient counts as zero; a variable without one at the last evaluation of the group
            is not updated for it). Default 1.
        seed: seed of the optimizer's weight-noise generator (int or None).
        nonfinite: what an update whose gradients or curvature statistics contain NaN or Inf does:
            ``"skip"`` (default) or ``"raise"`` (see below).
        **kwargs: the usual Keras optimizer arguments (``clipnorm``, ``global_clipnorm``, ``name``...).
            With ``mc_samples > 1`` the clipping applies to each gradient evaluation, before its
            statistics enter the Monte Carlo average (Keras's ``gradient_accumulation_steps`` clip
            the average instead).

    Non-finite values: the gradients and the curvature statistics handed over for the step (layer
    inputs, pre-activation and per-example gradients, see :mod:`tfnng.models`) are checked before
    any state changes, by their sums of squares (float32 or wider): a tensor fails when it holds
    NaN or Inf, or values so large that their squares overflow (float32: ``|x|`` of about 1e19),
    which would otherwise put Inf into the curvature and freeze the posterior there (optimizers
    that square per-example gradients also check a bound on their norms,
    :func:`tfnng.curvature.kronecker.example_gradient_norm_bounds`).
    ``nonfinite="skip"``: the update is skipped as a whole (mean and curvature keep
    their values, a fresh sample is drawn), counted in ``skipped_updates`` and logged as a warning on
    the ``"tfnng"`` logger naming the offending tensors (at the 1st, 2nd, 4th, 8th... skip; not from
    a step compiled with XLA, which cannot call back into Python). ``nonfinite="raise"``: the step
    fails with ``tf.errors.InvalidArgumentError`` naming the offending tensor, and nothing is
    modified; XLA drops such checks, so a step compiled with ``jit_compile=True`` raises
    ``ValueError`` when it is traced.
    """

    _slots = {}
    _sample_statistic_names = ("grad",)
    _step_flags = _per_thread("step_flags")   # (finite, apply_now) of the step being traced

    def __init__(self, learning_rate, num_examples=None, prior_variance=None, prior_precision=None,
                 kl_weight=1.0, mc_samples=1, seed=None, nonfinite="skip", name=None, **kwargs):
        if not isinstance(nonfinite, str) or nonfinite not in ("skip", "raise"):
            raise ValueError(f"`nonfinite` must be 'skip' or 'raise', got {nonfinite!r}.")
        for unsupported in ("weight_decay", "use_ema", "gradient_accumulation_steps"):
            if kwargs.get(unsupported):
                raise ValueError(
                    f"`{unsupported}` is not supported by {type(self).__name__}: the prior (for "
                    "KFAC, its `l2`) plays the role of weight decay, the posterior mean is the "
                    "weight average, and `mc_samples` accumulates gradients.")
            kwargs.pop(unsupported, None)
        # Keras drops clipping values <= 0; a loss scale of 0 or Inf makes every step skipped.
        for argument in ("clipnorm", "clipvalue", "global_clipnorm", "loss_scale_factor"):
            if kwargs.get(argument) is not None:
                kwargs[argument] = _positive(argument, kwargs[argument])
        if isinstance(learning_rate, numbers.Real):      # schedules and callables are Keras's
            learning_rate = _non_negative("learning_rate", learning_rate)
        super().__init__(learning_rate=learning_rate, name=name, **kwargs)
        self.num_examples = _validate_num_examples(num_examples)
        self.prior_variance = _resolve_prior_variance(prior_variance, prior_precision)
        self.kl_weight = _positive("kl_weight", kl_weight)
        self.mc_samples = _positive_int("mc_samples", mc_samples)
        self.seed = seed_value(seed)
        self.nonfinite = nonfinite
        self._seed_generator = keras.random.SeedGenerator(self.seed, name="weight_noise_seed")
        self._track_variable(self._seed_generator.state)
        # 1 once the means are latched (the first step): a tf.train.Checkpoint written before
        # restores 0 (see _restarts). A dependency of the checkpoint only, not one of `variables`,
        # which Keras saves and loads by count (load_own_variables sets it from the loaded state).
        with keras.name_scope(self.name, caller=self):
            started = keras.Variable(0, dtype="int64", trainable=False, aggregation="none",
                                     name="posterior_started")
        object.__setattr__(self, "_posterior_started", started)
        self._track_trackable(started, name="posterior_started")

    # ----------------------------------------------------------------------------- hyper-parameters
    @property
    def intrinsic_damping(self):
        """gamma_in = lambda / (N eta), NNG sec. 3.2 and Alg. 1-2."""
        return _intrinsic_damping(self.kl_weight, self.num_examples, self.prior_variance)

    def _sampling_variance(self, curvature, damping):
        """The NNG sampling variance ``(lambda/N) / (curvature + damping)`` (NNG eq. 9, Alg. 1)."""
        return (self.kl_weight / self.num_examples) / (curvature + damping)

    def __setattr__(self, name, value):
        """Refuses to change a tfnng hyper-parameter (a constructor argument that Keras's optimizer
        has not: ``kl_weight``, ``num_examples``, ``beta`` ...) once the optimizer is built."""
        if (not name.startswith("_") and getattr(self, "built", False)
                and name in _hyperparameter_names(type(self))):
            raise AttributeError(
                f"{type(self).__name__}.{name} cannot change once the optimizer is built: the "
                "compiled training step and tfnng.predict keep the value they were traced with, "
                "while the posterior accessors would read the new one. Construct an optimizer with "
                f"it (`type(opt).from_config({{**opt.get_config(), {name!r}: ...}})`) and compile "
                "again; to keep the trained state, save the weights first "
                "(`model.save_weights`) and load them after building the new optimizer "
                "(`model.optimizer.build(model.trainable_variables)`).")
        super().__setattr__(name, value)

    @property
    def weight_decay(self):
        """None: Keras's decoupled weight decay is not applied; the prior N(0, eta I) takes its
        role (IVON reads back its ``weight_decay``, delta)."""
        return None

    @weight_decay.setter
    def weight_decay(self, value):
        # Keras's constructor assigns None; a value would be silently ignored by the update.
        if value is not None:
            raise AttributeError(
                f"{type(self).__name__}.weight_decay cannot be set: the prior N(0, eta I) plays "
                "the role of weight decay (IVON's `weight_decay` is delta = 1 / (ess eta)). Pass "
                "`prior_variance` (IVON: `weight_decay`) when constructing the optimizer.")

    def exclude_from_weight_decay(self, var_list=None, var_names=None):
        """Not supported: the prior N(0, eta I) (IVON's ``weight_decay``) covers every Bayesian weight.
        :func:`tfnng.mark_point_estimate` takes a variable out of the posterior (no prior, no noise)."""
        raise ValueError(
            f"{type(self).__name__} has no per-variable weight decay: the prior N(0, eta I) (the "
            "weight decay of IVON's naming) applies to every Bayesian weight. Mark a variable with "
            "tfnng.mark_point_estimate to fit it without prior and noise.")

    # ---------------------------------------------------------------------------------------- state
    def build(self, variables):
        if self.built:
            return
        constrained = [variable_path(v) for v in variables if getattr(v, "constraint", None) is not None]
        if constrained:
            raise ValueError(
                f"{type(self).__name__} cannot train variables with a Keras weight constraint "
                f"({', '.join(constrained)}): Keras would project the weight sample after each "
                "update while the Gaussian posterior stays unconstrained. Remove the constraint "
                "(the prior regularises the weights).")
        half = [variable_path(v) for v in variables
                if keras.backend.standardize_dtype(v.dtype) in ("float16", "bfloat16")]
        if half:
            raise ValueError(
                f"{type(self).__name__} cannot train half-precision variables "
                f"({', '.join(half)}): the posterior and its running averages live in the "
                "variable's dtype, where the averaging constants round to 1 (bfloat16(0.999) == 1) "
                "and the posterior stops moving. Use a mixed precision policy ('mixed_bfloat16' or "
                "'mixed_float16'), which keeps float32 variables and computes in half precision.")
        super().build(variables)
        with keras.name_scope(self.name, caller=self):
            self._point = [_markers.is_point_estimate(v) for v in variables]
            # Keras may build the optimizer while tracing the train function, where reading the
            # model's variables into initial values cannot be lifted: the means are copied from
            # the model at the first update instead (_initialize_means_once).
            self._means = self.add_optimizer_variables(variables, "posterior_mean")
            self._means_ready = self.add_variable((), initializer="zeros", dtype="int64",
                                                  name="means_initialized")
            self._slot_variables = {
                name: self.add_optimizer_variables(variables, name, _constant(init))
                for name, init in self._slots.items()}
            self._natural_steps = [_markers.natural_step(v) for v in variables]
            if any(p and n is None for p, n in zip(self._point, self._natural_steps)):
                # Point-estimated variational parameters: Adam (natural parameters, e.g. q(tau) of
                # NoisePrecision, take a natural-gradient step without state). A list aligned with
                # the variables: tf.train.Checkpoint cannot save dicts with integer keys.
                self._point_moments = [
                    (self.add_variable_from_reference(v, "point_m"),
                     self.add_variable_from_reference(v, "point_v"))
                    if self._point[i] and self._natural_steps[i] is None else None
                    for i, v in enumerate(variables)]
            self._build_family_state(variables)
            if self.mc_samples > 1:
                # Monte Carlo sums, after every other list of state: tf.train.Checkpoint finds an
                # optimizer's variables by position, so that a checkpoint restores into an
                # optimizer with another mc_samples. The sample statistics of the Bayesian
                # variables and the gradients of the point estimates (lists aligned with the
                # variables, None where unused).
                self._accumulators = {
                    name: [None if self._point[i] else
                           self.add_variable_from_reference(v, f"mc_sum_{name}")
                           for i, v in enumerate(variables)]
                    for name in self._sample_statistic_names}
                self._point_gradient_sums = [
                    self.add_variable_from_reference(v, "mc_sum_point_grad") if self._point[i] else None
                    for i, v in enumerate(variables)]
                self._mc_count = self.add_variable((), initializer="zeros", dtype="int64",
                                                   name="mc_count")
            self._update_count = self.add_variable((), initializer="zeros", dtype="int64",
                                                   name="update_count")
            self._skipped = self.add_variable((), initializer="zeros", dtype="int64",
                                              name="skipped_updates")

    @property
    def _unbuilt_variable_count(self):
        """How many variables come before the built state (the state saved before any posterior):
        ``iterations``, the learning rate when it is a number (Keras stops tracking it when a
        schedule is assigned), the noise generator's state."""
        return 2 + isinstance(self._learning_rate, keras.Variable)

    def _build_family_state(self, variables):
        """Creates the family's own state (curvature factors, flat posterior), before the Monte
        Carlo sums; inside the optimizer's name scope. Nothing by default."""

    def add_variable(self, shape, initializer="zeros", dtype=None, aggregation="none", layout=None,
                     name=None):
        """Keras's ``add_variable``, keeping the initializer: :meth:`load_own_variables` restarts
        a built optimizer from it when given a state saved before the first step."""
        variable = super().add_variable(shape, initializer=initializer, dtype=dtype,
                                        aggregation=aggregation, layout=layout, name=name)
        self.__dict__.setdefault("_initializers", {})[id(variable)] = (
            keras.initializers.get(initializer))
        return variable

    def _slot(self, name, index):
        return self._slot_variables[name][index]

    @property
    def skipped_updates(self):
        """Number of steps (gradient evaluations, with ``mc_samples > 1``) skipped because their
        gradients or curvature statistics contained NaN or Inf (or overflowing squares)."""
        return int(self._skipped.numpy()) if self.built else 0

    # --------------------------------------------------------------------------------- update step
    def _get_current_learning_rate(self):
        # Schedules see completed posterior updates, not gradient evaluations. The rate is checked
        # at every step (a number was in __init__, but `optimizer.learning_rate = ...` and Keras's
        # LearningRateScheduler assign it later): negative, it would train uphill; NaN, it would
        # turn every posterior mean NaN, and the updates after would be skipped as non-finite.
        if isinstance(self._learning_rate, keras.optimizers.schedules.LearningRateSchedule):
            rate = self._learning_rate(self._update_count if self.built else self._iterations)
        else:
            rate = super()._get_current_learning_rate()
        rate = tf.convert_to_tensor(rate)
        as_float = tf.cast(rate, tf.float32)
        return checked(rate, tf.math.is_finite(as_float) & (as_float >= 0),
                       "the learning rate must be finite and >= 0 (a number assigned to "
                       "`learning_rate`, a schedule's or a callable's value).")

    def _restarts(self):
        """Whether the next step restarts the built state (:meth:`_initialize_means_once`): a
        ``tf.train.Checkpoint`` written before the first step restored ``iterations`` and
        ``posterior_started`` to 0 in an optimizer that has stepped since (its means latched).
        Neither alone: a user may assign ``iterations``, and a checkpoint written before
        ``posterior_started`` existed leaves it at 0."""
        return ((self._posterior_started == 0) & (self._means_ready > 0)
                & tf.equal(self.iterations, 0))

    def _updates_done(self):
        """``update_count`` as the next step sees it (0 when it restarts): read before the step,
        by ``curvature_due``."""
        return tf.where(self._restarts(), tf.zeros_like(self._update_count), self._update_count)

    def _restart_built_state(self):
        """Every variable ``build`` made back to its initializer (the means are copied from the
        weights at the next step): the state of an optimizer saved before its first step."""
        for variable in self.variables[self._unbuilt_variable_count:]:
            variable.assign(self._initializers[id(variable)](variable.shape, variable.dtype))
        return tf.constant(True)

    def _initialize_means_once(self, latch=True):
        """Copy the model's current weights into the posterior means until they are latched: by
        the first update, or by ``sample_weights`` (which overwrites the weights). Posterior access
        before (``latch=False``) sees the weights of the moment without fixing them as the start.

        Before that, a state restored from before the first step restarts (:meth:`_restarts`, as
        :meth:`load_own_variables` restarts it): ``tf.train.Checkpoint`` restores only what it
        saved, so a checkpoint written before the first step brings back the counters and seed but
        would leave the posterior trained since."""
        tf.cond(self._restarts(), self._restart_built_state, lambda: tf.constant(False))

        def initialize():
            self._copy_weights_to_means()
            if latch:
                self._means_ready.assign(1)
                self._posterior_started.assign(1)
            return tf.constant(True)

        tf.cond(self._means_ready > 0, lambda: tf.constant(False), initialize)

    def _copy_weights_to_means(self):
        for mean, variable in zip(self._means, self._trainable_variables):
            mean.assign(variable)

    def _checked_tensors(self, grads, trainable_variables):
        """``[(description, tensor)]`` the non-finite guard checks (class docstring): the floating
        gradients and this step's captured curvature statistics."""
        checked = [(f"the gradient of {variable_path(v)}", g)
                   for g, v in zip(grads, trainable_variables) if g is not None]
        statistics = {"inputs": "inputs", "preactivation_grads": "pre-activation gradients",
                      "gradients": "per-example gradients"}
        for layer, record in (getattr(self, "_curvature_batch", None) or {}).items():
            checked += [(f"the {what} captured for {layer}", getattr(record, field))
                        for field, what in statistics.items()
                        if getattr(record, field, None) is not None]
        return [(what, tf.convert_to_tensor(t)) for what, t in checked if t.dtype.is_floating]

    @staticmethod
    def _half_sum_of_squares(tensor):
        """``sum(t^2) / 2`` in at least float32: not finite when ``t`` holds NaN or Inf, or values
        whose squares (the curvature statistics square gradients and activations) overflow."""
        return tf.nn.l2_loss(at_least_float32(tensor))

    def apply(self, grads, trainable_variables=None):
        """Keras ``apply``, whose state changes (Keras's ``iterations`` increment, made after the
        update, included) all wait for the run-time checks of the step's settings
        (:meth:`_step_guards`) and, with ``nonfinite="raise"``, of the gradients: a step refused
        by one changes nothing."""
        self._refuse_marks_made_after_build()
        guards = self._step_guards() + self._gradient_guards(grads, trainable_variables)
        with tf.control_dependencies(guards):
            return super().apply(grads, trainable_variables)

    def _step_guards(self):
        """The step's settings checked at run time (without XLA): the learning rate."""
        return [] if compiled_with_xla() else [self._get_current_learning_rate()]

    def _gradient_guards(self, grads, trainable_variables):
        """With ``nonfinite="raise"``, one check per gradient and captured statistic (none
        otherwise)."""
        if self.nonfinite != "raise":
            return []
        if compiled_with_xla():
            raise ValueError(
                f"{type(self).__name__}(nonfinite='raise') cannot check a step compiled with "
                "XLA, which drops tf.debugging checks: compile the model with "
                "jit_compile=False, or use nonfinite='skip'.")
        variables = self._trainable_variables if trainable_variables is None else trainable_variables
        checked = self._checked_tensors(grads, variables)
        if not checked:
            return []
        # Summed over replicas (a NaN in one replica's shard reaches all): every replica raises,
        # none changes its copy of the state.
        [squares] = _sum_over_replicas([tf.stack([
            tf.cast(self._half_sum_of_squares(t), tf.float64) for _, t in checked])])
        return [tf.debugging.check_numerics(squares[i],
                                            f"{type(self).__name__}(nonfinite='raise'): NaN or "
                                            f"Inf (or an overflowing square) in {what}")
                for i, (what, _) in enumerate(checked)]

    def _refuse_marks_made_after_build(self):
        """The marks are read when the optimizer is built (a point estimate has other state than
        a posterior): a variable marked since is refused, not silently kept Bayesian. Checked
        whenever the step is traced."""
        if not self.built:
            return
        marked = [variable_path(v) for v, point in zip(self._trainable_variables, self._point)
                  if not point and _markers.is_point_estimate(v)]
        if marked:
            raise ValueError(
                f"{', '.join(marked)} {'was' if len(marked) == 1 else 'were'} marked with "
                f"tfnng.mark_point_estimate after {type(self).__name__} was built, which reads the "
                "marks when it is built. Mark variables before the first training step (in the "
                "layer's `build`, so that loading the model marks them again), or compile the "
                "model with a new optimizer after marking.")

    def _backend_apply_gradients(self, grads, trainable_variables):
        # Sparse gradients (IndexedSlices, e.g. of an Embedding) are made dense: every weight has
        # a posterior, and every weight is perturbed at every step.
        grads = _sum_over_replicas([tf.convert_to_tensor(g) for g in grads])
        # The gradients are judged before Keras's clipping (clipvalue would make an Inf finite),
        # the same tensors as nonfinite="raise" checks in ``apply``.
        checked = self._checked_tensors(grads, trainable_variables)
        flags = tf.stack([tf.math.is_finite(self._half_sum_of_squares(t)) for _, t in checked])
        finite = tf.reduce_all(flags)
        grads = self._clip_gradients(grads)
        self._initialize_means_once()
        if self.mc_samples == 1:
            apply_now = finite
        else:
            apply_now = tf.logical_and(finite, self._mc_count + 1 >= self.mc_samples)
        # Plain attribute (not tracked): read by update_step while this step is being built.
        object.__setattr__(self, "_step_flags", (finite, apply_now))
        self._backend_update_step(grads, trainable_variables, self.learning_rate)
        if self.mc_samples > 1:
            self._drop_partial_sums(trainable_variables, apply_now)
            self._mc_count.assign(tf.where(apply_now, tf.zeros_like(self._mc_count),
                                           self._mc_count + tf.cast(finite, tf.int64)))
        self._update_count.assign_add(tf.cast(apply_now, tf.int64))
        self._skipped.assign_add(1 - tf.cast(finite, tf.int64))
        if self.nonfinite == "skip" and not compiled_with_xla():
            described, name = [what for what, _ in checked], type(self).__name__

            def warn(flags, skipped):
                count = int(skipped)
                if count & (count - 1) == 0:     # 1st, 2nd, 4th, 8th...: no flood when diverging
                    bad = ", ".join(w for w, ok in zip(described, flags.numpy()) if not ok)
                    logging.getLogger("tfnng").warning(
                        "%s skipped an update: NaN or Inf (or an overflowing square) in %s (%d "
                        "updates skipped so far).",
                        name, bad, count)
                return True

            # Host callback on the (rare) skipping branch only, from one replica.
            context = tf.distribute.get_replica_context()
            primary = True if context is None else tf.equal(context.replica_id_in_sync_group, 0)
            tf.cond(tf.logical_or(finite, tf.logical_not(primary)), lambda: tf.constant(True),
                    lambda: tf.py_function(warn, [flags, self._skipped], tf.bool))

    def _drop_partial_sums(self, trainable_variables, apply_now):
        """Resets, on the last evaluation of an ``mc_samples`` group, the Monte Carlo sums of the
        variables that have no gradient at that evaluation (Keras leaves them out of the step):
        like a variable without a gradient at ``mc_samples=1``, they get no update for the group,
        and their partial sums do not carry over into the next group."""
        present = {self._get_variable_index(v) for v in trainable_variables}
        for index in range(len(self._trainable_variables)):
            if index in present:
                continue
            for total in [self._point_gradient_sums[index]] + [
                    totals[index] for totals in self._accumulators.values()]:
                if total is not None:
                    total.assign(tf.where(apply_now, tf.zeros_like(total), total))

    def _backend_update_step(self, grads, trainable_variables, learning_rate):
        """Update in the current replica context (Keras's TF backend would all-reduce again): the
        gradients are summed over replicas already, so every replica applies the same update to
        its copy of the weights and state, and draws the same sample (mirrored seed state)."""
        for gradient, variable in zip(grads, trainable_variables):
            self.update_step(gradient, variable, learning_rate)

    def update_step(self, gradient, variable, learning_rate):
        index = self._get_variable_index(variable)
        finite, apply_now = self._step_flags
        gradient = tf.cast(gradient, variable.dtype)
        lr = tf.cast(learning_rate, variable.dtype)
        if self._point[index]:
            self._point_step(index, gradient, variable, lr)
            return
        stats = self._sample_statistics(index, gradient, tf.convert_to_tensor(variable))
        if self.mc_samples > 1:
            stats = self._accumulate(index, stats, finite, apply_now)

        def update():
            self._update_posterior(index, stats, lr)
            return tf.constant(True)

        tf.cond(apply_now, update, lambda: tf.constant(False))
        variable.assign(self._draw(index))

    def _accumulate(self, index, stats, finite, apply_now):
        """Monte Carlo average over ``mc_samples`` evaluations; accumulators reset on update."""
        return {name: self._accumulate_into(self._accumulators[name][index], value, finite, apply_now)
                for name, value in stats.items()}

    def _accumulate_into(self, total, value, finite, apply_now):
        """Add a finite ``value`` to the running sum ``total`` (reset when the update is applied) and
        return the Monte Carlo average over ``mc_samples``."""
        new_total = total + value
        total.assign(tf.where(apply_now, tf.zeros_like(new_total), tf.where(finite, new_total, total)))
        return new_total / self.mc_samples

    def _point_step(self, index, gradient, variable, lr):
        """A point-estimated variable keeps the posterior's rhythm: with ``mc_samples = S`` its
        gradient is averaged over the S evaluations and it is updated once, with the posterior."""
        finite, apply_now = self._step_flags
        if self.mc_samples > 1:
            gradient = self._accumulate_into(self._point_gradient_sums[index], gradient, finite, apply_now)
        tf.cond(apply_now, lambda: self._point_update(index, gradient, variable, lr),
                lambda: tf.constant(False))

    def _point_update(self, index, gradient, variable, lr, beta_1=0.9, beta_2=0.999, eps=1e-7):
        """Point-estimated variational parameters: for natural parameters (``tfnng._markers``) their
        stochastic natural-gradient step of size ``min(lr, 1)`` (Hoffman et al. 2013, eq. 13),
        otherwise a plain bias-corrected Adam step."""
        natural_step = self._natural_steps[index]
        if natural_step is not None:
            variable.assign(natural_step(variable, gradient, tf.minimum(lr, tf.ones_like(lr))))
            self._means[index].assign(variable)
            return tf.constant(True)
        m, v = self._point_moments[index]
        t = self._step_number(variable.dtype)
        m.assign(beta_1 * m + (1 - beta_1) * gradient)
        v.assign(beta_2 * v + (1 - beta_2) * tf.square(gradient))
        m_hat = m / (1 - beta_1 ** t)
        v_hat = v / (1 - beta_2 ** t)
        variable.assign_sub(lr * m_hat / (tf.sqrt(v_hat) + eps))
        self._means[index].assign(variable)
        return tf.constant(True)

    def _step_number(self, dtype):
        """t of the update being computed (1 for the first update), for bias corrections."""
        return tf.cast(self._update_count + 1, dtype)

    def _standard_normal(self, shape, dtype):
        """Weight noise: a :func:`tfnng._random.standard_normal` draw from the next seed of the seed
        generator (Philox; ``keras.random.normal`` would leave the algorithm to TensorFlow, whose
        "auto_select" under XLA on the CPU is about 20 times slower for a step's ~10^5-10^6 draws)."""
        seed = self._seed_generator.next()
        if seed.dtype != tf.int32:                       # as keras.random: int64 state to int32 seed
            seed = tf.cast(tf.math.floormod(seed, tf.int32.max - 1), tf.int32)
        return _random.standard_normal(shape, seed, dtype)

    def _refuse_frozen(self, indices, reason):
        """Stop with a clear error if a variable of ``indices`` is no longer trainable (frozen after
        the build: Keras leaves it out of the step's lists) although the step would move it:
        ``reason`` says why, and what to do."""
        frozen = [self._trainable_variables[i].path for i in indices
                  if not self._trainable_variables[i].trainable]
        if frozen:
            raise ValueError(f"{type(self).__name__}: {', '.join(frozen)} no longer trainable "
                             f"(frozen after the optimizer was built), but {reason}.")

    def _draw(self, index):
        mean = self._means[index]
        return _diagonal.perturb(mean, self._stddev(index), self._standard_normal(mean.shape, mean.dtype))

    # --- to be provided by each method
    def _sample_statistics(self, index, gradient, sample):
        """Per-sample quantities whose Monte Carlo average drives the update (default: gradient)."""
        return {"grad": gradient}

    def _variance(self, index):
        raise NotImplementedError

    def _stddev(self, index):
        return tf.sqrt(self._variance(index))

    def _update_posterior(self, index, stats, learning_rate):
        raise NotImplementedError

    # ---------------------------------------------------------------------------- posterior access
    def _require_built(self):
        if not self.built:
            raise ValueError(f"{type(self).__name__} has no posterior yet: train first, or call "
                             "`optimizer.build(model.trainable_variables)` (an optimizer that reads "
                             "layer curvature is built by tfnng.BayesianModel).")
        if not self._trainable_variables:
            raise ValueError(
                f"{type(self).__name__} was built for no variables, so it has no posterior (its KL "
                "would read 0): Keras's legacy HDF5 loader builds the optimizer of a loaded model "
                "that way and restores none of its state. Save with model.save('m.keras'), or "
                "compile the model with a new optimizer and train it.")
        self._initialize_means_once(latch=False)

    def _require_posterior_of(self, model):
        """:meth:`_require_built`, and a posterior over some of ``model``'s variables (not
        another model's: its samples would all be the current weights)."""
        self._require_built()
        own = {id(v) for v in self._trainable_variables}
        if model.trainable_variables and not any(id(v) in own for v in model.variables):
            raise ValueError(
                f"{type(self).__name__} holds a posterior over none of the variables of model "
                f"{model.name!r} ({len(self._trainable_variables)} variables of its own): it was "
                "built for another model. Train or restore it with this model.")

    def _bayesian_indices(self):
        self._require_built()
        return [i for i, point in enumerate(self._point) if not point]

    def _posterior_index(self, variable):
        """Index of a variable this optimizer trains (a clear error for any other)."""
        self._require_built()
        if not isinstance(variable, (keras.Variable, tf.Variable)):
            raise TypeError(f"{type(self).__name__}: give the posterior's variable itself (e.g. "
                            f"`layer.kernel`); got {type(variable).__name__}.")
        try:
            return self._get_variable_index(variable)
        except KeyError:
            raise ValueError(
                f"{type(self).__name__} has no posterior for {getattr(variable, 'path', variable)}: "
                "it is not one of the variables the optimizer was built with (a non-trainable "
                "variable such as a BatchNormalization statistic, or another model's).") from None

    def posterior_mean(self, variable):
        """Posterior mean mu of a model variable; a point estimate's value is the variable's own
        (what the model computes with, also after Keras restores weights, e.g. EarlyStopping's
        ``restore_best_weights``)."""
        index = self._posterior_index(variable)       # a clear error before build
        if self._point[index]:
            return tf.convert_to_tensor(self._trainable_variables[index])
        return tf.convert_to_tensor(self._means[index])

    def posterior_stddev(self, variable):
        """Posterior standard deviation sigma of a model variable (zeros for point estimates)."""
        index = self._posterior_index(variable)
        if self._point[index]:
            return tf.zeros_like(self._means[index])
        return tf.convert_to_tensor(self._stddev(index))

    def posterior(self):
        """The posterior of all Bayesian variables as a ``tfd.JointDistributionNamed`` keyed by path
        (a repeated path gets a suffix, ``_1``, ``_2``...)."""
        indices = self._bayesian_indices()
        return _diagonal.distribution(
            [tf.convert_to_tensor(self._means[i]) for i in indices],
            [self._stddev(i) for i in indices],
            unique_names([variable_path(self._trainable_variables[i]) for i in indices]))

    def kl_divergence(self):
        """KL(q || p) to the prior N(0, eta I) in closed form (float64 scalar)."""
        indices = self._bayesian_indices()
        return _diagonal.kl_to_isotropic_prior(
            [self._means[i] for i in indices], [self._variance(i) for i in indices],
            self.prior_variance)

    def sample_weights(self):
        """Write a fresh posterior sample into the model's variables. Those of layers frozen since
        training (``trainable = False``) keep their values, as in :func:`tfnng.predict`."""
        self._require_built()
        self._initialize_means_once()      # the sample replaces the weights the means start from
        frozen = [(v, tf.identity(v)) for v in self._trainable_variables if not v.trainable]
        self._write_sample()
        for variable, value in frozen:
            variable.assign(value)

    def _write_sample(self):
        """Write a posterior sample into every variable the optimizer trains. The means are read as
        they are: before the first update, callers copy the weights into them once (each draw
        would otherwise start from the previous sample, a random walk)."""
        for i, point in enumerate(self._point):
            if not point:
                self._trainable_variables[i].assign(self._draw(i))

    @contextlib.contextmanager
    def use_mean(self):
        """Context in which the model's variables hold the posterior mean (restored on exit); those
        of layers frozen since training keep their values."""
        indices = [i for i in self._bayesian_indices() if self._trainable_variables[i].trainable]
        saved = [tf.identity(self._trainable_variables[i]) for i in indices]
        for i in indices:
            self._trainable_variables[i].assign(self._means[i])
        try:
            yield self
        finally:
            for i, value in zip(indices, saved):
                self._trainable_variables[i].assign(value)

    _STATE_KIND_KEY = "tfnng_optimizer"

    def _state_kind(self):
        """The tfnng optimizer whose state this is (a user's subclass keeps its tfnng parent's)."""
        return next(cls.__name__ for cls in type(self).__mro__
                    if cls.__module__.startswith("tfnng."))

    _STATE_SETTINGS_KEY = "tfnng_settings"

    def _settings(self):
        """The optimizer's config and whether its learning rate is a number (a variable of the
        state) or a schedule, in JSON types: saved with the state, named when one does not fit."""
        config = {key: value for key, value in self.get_config().items()
                  if key not in ("name", "learning_rate")}
        config["learning rate"] = ("a number" if isinstance(self._learning_rate, keras.Variable)
                                   else "a schedule or callable")
        return json.loads(json.dumps(config, default=repr))

    def save_own_variables(self, store):
        """Keras's (the variables by number), the name of the tfnng optimizer (the states of two
        optimizers can have the same count and shapes of variables: Vadam's and IVON's) and its
        settings (named in the error when a state does not fit)."""
        super().save_own_variables(store)
        store[self._STATE_KIND_KEY] = _encode(self._state_kind())
        store[self._STATE_SETTINGS_KEY] = _encode(json.dumps(self._settings()))

    def _saved_settings(self, store):
        """The settings a state was saved with (None in files saved before they were)."""
        if self._STATE_SETTINGS_KEY not in store:
            return None
        return json.loads(_decode(store[self._STATE_SETTINGS_KEY]))

    def _mismatch_causes(self, store):
        """What the store tells of why its state does not fit: the settings it was saved with
        that differ, or the absence of a tfnng optimizer's name."""
        if self._STATE_KIND_KEY not in store:
            return ["it holds no tfnng optimizer's name: it may be a LossScaleOptimizer's (saved "
                    "under the 'mixed_float16' policy: set the policy it was saved under before "
                    "building the model) or another optimizer's"]
        saved = self._saved_settings(store)
        if saved is None:
            return []

        def shown(name, value):
            return value if name == "learning rate" else repr(value)

        differ = [f"{name} was {shown(name, saved[name])} when saved, it is "
                  f"{shown(name, value)} here"
                  for name, value in self._settings().items()
                  if name in saved and saved[name] != value]
        return [f"it was saved by {type(self).__name__} constructed otherwise: "
                f"{'; '.join(differ)} (construct the optimizer as it was)"] if differ else []

    def load_own_variables(self, store):
        """Restore the state Keras saved (``model.save``, ``save_weights``, checkpoints callbacks).

        Keras matches optimizer variables by count alone and, on a mismatch, warns and skips them
        all. Here a saved posterior that does not fit raises instead: skipped, the model would keep
        one weight sample and a posterior restarted from it, silently. So does the state of another
        tfnng optimizer (files saved before the optimizer's name was saved are taken as they are).
        A state saved with other settings that fits (another ``kl_weight``, say) loads, and
        :meth:`_adopt_settings` re-derives what the family caches from the settings.
        """
        keys = [key for key in store.keys()
                if key not in (self._STATE_KIND_KEY, self._STATE_SETTINGS_KEY)]
        if self._STATE_KIND_KEY in store:
            kind = _decode(store[self._STATE_KIND_KEY])
            if kind != self._state_kind():
                raise ValueError(
                    f"The saved optimizer state is {kind}'s, this optimizer is "
                    f"{self._state_kind()}: its posterior and averages mean other things. "
                    f"{_ANOTHER_OPTIMIZERS_STATE}")
        saved = len(keys)
        # Saved before its first step; built since (by Keras's loading, or by training): the
        # variables made by __init__ come first, the others restart from their initializers (the
        # means are copied from the restored weights at the next step).
        restart = saved == self._unbuilt_variable_count < len(self.variables)
        if saved != len(self.variables) and not restart:
            if not self.built:
                advice = (
                    " (it is not built yet), so the saved posterior cannot be restored: call "
                    "`model.optimizer.build(model.trainable_variables)` first (e.g. before "
                    "`load_weights` into a fresh model). A trained optimizer does not copy or "
                    "pickle on its own (`copy.deepcopy`, `pickle`: Keras rebuilds it without the "
                    "model's variables): copy or pickle the model. ")
            elif causes := self._mismatch_causes(store):
                advice = f": {'; '.join(causes)}. "
            else:
                advice = (
                    ", so the saved posterior cannot be restored. If the model trains other "
                    "variables than when it was saved: layers frozen (`trainable = False`) after "
                    "the optimizer was built must be made trainable before saving, and variables "
                    "marked with `tfnng.mark_point_estimate` outside a layer's `build` lose the "
                    "mark on loading (mark them in `build`, as `tfnng.layers.NoisePrecision` "
                    "does). ")
            raise ValueError(
                f"{type(self).__name__}: the saved optimizer state has {saved} variables, this "
                f"optimizer has {len(self.variables)}{advice}{_ANOTHER_OPTIMIZERS_STATE}")
        mismatched = [f"{variable.path} {tuple(variable.shape)} (saved: {tuple(store[str(i)].shape)})"
                      for i, variable in enumerate(self.variables[:saved])
                      if tuple(store[str(i)].shape) != tuple(variable.shape)]
        if mismatched:
            # Before any assignment: Keras would assign one by one up to the first mismatch.
            causes = self._mismatch_causes(store)
            raise ValueError(
                f"{type(self).__name__}: the saved optimizer state does not fit this model's: " + (
                    f"{'; '.join(causes)}. " if causes else
                    f"{'; '.join(mismatched[:3])}{' ...' if len(mismatched) > 3 else ''}. Was it "
                    "saved from a model with other layer sizes? ") + _ANOTHER_OPTIMIZERS_STATE)
        for i in range(saved):
            self.variables[i].assign(store[str(i)])
        if restart:
            self._restart_built_state()
        elif (saved_settings := self._saved_settings(store)) not in (None, self._settings()):
            self._adopt_settings(saved_settings)
        if self.built:
            self._posterior_started.assign(self._means_ready)

    def _adopt_settings(self, saved):
        """Re-derives, after loading a state saved with other settings (``saved``, their config),
        what the state caches from the settings: a family that keeps its curvature apart from the
        damping and reads ``kl_weight / num_examples`` live (the diagonal ones, VOGN) has nothing
        to do."""

    def get_config(self):
        config = super().get_config()
        for key in ("weight_decay", "use_ema", "ema_momentum", "ema_overwrite_frequency",
                    "gradient_accumulation_steps"):
            config.pop(key, None)
        config.update({
            "num_examples": self.num_examples,
            "prior_variance": self.prior_variance,
            "kl_weight": self.kl_weight,
            "mc_samples": self.mc_samples,
            "seed": self.seed,
            "nonfinite": self.nonfinite,
        })
        return config


def _intrinsic_damping(kl_weight, num_examples, prior_variance):
    """gamma_in = lambda / (N eta) (NNG sec. 3.2), of an optimizer's settings or saved ones."""
    return kl_weight / (num_examples * prior_variance)


@functools.cache
def _hyperparameter_names(cls):
    """The constructor arguments of ``cls`` and its tfnng bases that Keras's optimizer has not."""
    def arguments(classes):
        return {name for base in classes if "__init__" in vars(base)
                for name in inspect.signature(base.__init__).parameters}

    ours = arguments(base for base in cls.__mro__ if base.__module__.startswith("tfnng."))
    return frozenset(ours - arguments(keras.optimizers.Optimizer.__mro__) - {"self", "kwargs"})


def _encode(text):
    """A string as a uint8 array, which Keras's weight stores hold."""
    return np.frombuffer(text.encode(), np.uint8)


def _decode(array):
    return bytes(np.asarray(array, np.uint8)).decode()


class CurvatureConsumer:
    """The optimizer side of :class:`tfnng.BayesianModel`'s curvature protocol (see
    :mod:`tfnng.models`), for optimizers that need layer inputs and pre-activation gradients.

    Subclasses define ``curvature_requirements`` and may override ``curvature_due``; they read the
    supported layers from ``self._layer_specs`` and the tensors of the current step from
    ``self._curvature_batch`` (layer name -> ``CapturedLayer``).
    """

    _layer_specs = None
    _joint_over_layers = False   # True: one posterior over all layers, its layer set fixed at build
    _curvature_batch = _per_thread("curvature_batch")
    _curvature_cache = _per_thread("curvature_cache")

    def prepare_curvature(self, layer_specs):
        """Receive the supported layers (:class:`tfnng.curvature.capture.LayerSpec`) before ``build``."""
        layer_specs = list(layer_specs)
        if self.built and self._layer_specs is not None:
            built_for = [spec.name for spec in self._layer_specs]
            now = [spec.name for spec in layer_specs]
            if self._joint_over_layers and now != built_for:
                raise ValueError(
                    f"{type(self).__name__} was built for the layers {built_for}, the model now "
                    f"trains {now} (a layer was frozen, unfrozen or added). Its posterior and "
                    "curvature state are tied to the layers it was built for: compile the model "
                    "with a new optimizer.")
            return
        if self.built:
            raise ValueError(f"{type(self).__name__} was built before it was given its layers; "
                             "compile a tfnng.BayesianModel with it before training.")
        self._layer_specs = layer_specs

    def _trained_layer_specs(self):
        """``(spec, kernel index, bias index or None)`` of each supported layer whose variables this
        optimizer trains (after ``build``): a layer frozen between ``compile`` and the first step
        is among the layer specs but has no optimizer variables."""
        for spec in self._layer_specs or ():
            try:
                kernel = self._get_variable_index(spec.kernel)
                bias = None if spec.bias is None else self._get_variable_index(spec.bias)
            except KeyError:
                continue
            yield spec, kernel, bias

    def _require_layer_specs(self):
        if self._layer_specs is None:
            raise ValueError(
                f"{type(self).__name__} needs the layer inputs and pre-activation gradients that "
                "the averaged gradient cannot give: wrap the model, `model = "
                "tfnng.BayesianModel(net)`, and compile that model with this optimizer (in a "
                "hand-written loop: `optimizer.prepare_curvature(capture.specs)` before "
                "`optimizer.build`, see tfnng.models).")

    def curvature_due(self):
        """Whether the next ``apply_gradients`` consumes curvature statistics (bool tensor)."""
        return tf.constant(True)

    def receive_curvature(self, captured):
        """Hand over the captured tensors (layer name -> CapturedLayer) for the next update."""
        object.__setattr__(self, "_curvature_batch", captured)
        object.__setattr__(self, "_curvature_cache", {})

    def _received_curvature(self):
        """This step's captured tensors; a clear error when ``apply_gradients`` was given none."""
        if self._curvature_batch is None:
            raise ValueError(
                f"{type(self).__name__}.apply_gradients received no curvature statistics for this "
                "step. tfnng.BayesianModel's own train_step passes them; a custom train_step or "
                "training loop (on a BayesianModel too) must compute them with "
                "tfnng.models.gradients_and_curvature and pass "
                "`optimizer.apply_gradients(grads_and_vars, curvature=curvature)`.")
        return self._curvature_batch

    def _backend_apply_gradients(self, grads, trainable_variables):
        super()._backend_apply_gradients(grads, trainable_variables)
        # The captured tensors belong to this step's graph: never reuse them.
        object.__setattr__(self, "_curvature_batch", None)
        object.__setattr__(self, "_curvature_cache", {})

    def apply_gradients(self, grads_and_vars, curvature=None):
        """Keras ``apply_gradients``; ``curvature`` (optional) as for :meth:`receive_curvature`."""
        if curvature is not None:
            self.receive_curvature(curvature)
        return super().apply_gradients(grads_and_vars)
