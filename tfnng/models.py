"""``BayesianModel``: a Keras model whose training step gives the optimizer the curvature it needs.

Optimizers of the diagonal family need nothing but the averaged gradient and work with any Keras
model. K-FAC-type optimizers need per-layer quantities the averaged gradient cannot give, and
VOGN/SLANG/NNG-full need per-example gradients. ``BayesianModel(net)`` wraps any built Sequential
or functional Keras model and overrides ``train_step`` (the documented Keras 3 way) to provide them::

    model = tfnng.BayesianModel(net)
    model.compile(optimizer=tfnng.optimizers.NoisyKFAC(learning_rate=1e-3, num_examples=N),
                  loss=tfnng.losses.CategoricalNLL())
    model.fit(x, y, epochs=10, validation_data=(x_val, y_val))   # reports loss, nll, kl
    pred = tfnng.predict(model, x_test, num_samples=100)

Metrics: ``nll`` is the compiled loss (mean negative log-likelihood per example, plus any
``add_loss`` terms of the net), ``kl`` is ``kl_weight * KL(q || p) / N`` from the optimizer's
closed form (0 for point-estimate optimizers), and ``loss = nll + kl`` is the negative ELBO per
training example.

The curvature protocol
----------------------
An optimizer that needs more than the averaged gradient implements:

``curvature_requirements``
    property returning a :class:`tfnng.curvature.Requirements` (what, and which Fisher).
``prepare_curvature(layer_specs)``
    called once by the model, before the optimizer is built, with the supported layers
    (:class:`tfnng.curvature.capture.LayerSpec`: layer, kind, kernel, bias, name).
``curvature_due()``
    bool tensor: whether the next ``apply_gradients`` will consume statistics. The model computes the
    expensive parts (the true-Fisher backward pass) only when it is true, under ``tf.cond``; on
    other steps the tensors it hands over are zeros and must be ignored.
``receive_curvature(captured)``
    called right before ``apply_gradients`` with a dict ``layer name -> CapturedLayer``.

For ``Requirements.kronecker`` each ``CapturedLayer`` holds ``inputs`` (the layer's input) and
``preactivation_grads``: per-example gradients of the log-likelihood with respect to the layer's
pre-activations (true Fisher: of ``log p(y~ | x, w)`` with ``y~`` drawn by ``loss.sample`` from the
model's predictive; empirical Fisher: of minus the compiled loss (a mean over the batch, see
:func:`check_mean_reduction`) times the batch size, i.e. of the observed targets' log-likelihood when
the loss is a negative log-likelihood; the net's own losses, ``add_loss`` terms and activity
regularisers, are left out). With Keras's ``sample_weight`` or ``class_weight``, example n's
gradients are scaled by ``sqrt(w_n)`` (the curvature of the weighted log-likelihood; the layer
inputs, and so K-FAC's factor A, are not weighted). A Keras mask on the output (one flag per
example) weighs the examples as the mean-reduced loss does: 0 for a masked example, ``B / valid``
for a kept one, so that both Fisher types average over the kept examples.

For ``Requirements.per_example_gradients`` the dict also holds, keyed by variable path, a
:class:`tfnng.curvature.per_example.CapturedVariable` for every Bayesian variable that no captured
layer owns: its per-example log-likelihood gradients from the generic path (``tf.vectorized_map``,
forward pass with ``training=False``), computed only when ``curvature_due()``. Fast-path variables
(Dense/Conv2D) get theirs from the layer records (:func:`tfnng.curvature.per_example.layer_block`),
so the selection of the path is automatic.

Hand-written loops use the same pieces through :func:`gradients_and_curvature`::

    capture = tfnng.curvature.capture.LayerCapture(net)
    optimizer.prepare_curvature(capture.specs)
    loss, y_pred, grads, curvature = tfnng.models.gradients_and_curvature(
        net, capture, optimizer, loss_fn, x, y)
    optimizer.apply_gradients(zip(grads, net.trainable_variables), curvature=curvature)
"""

import math
import numbers

import keras
import tensorflow as tf
from keras.src.backend import compute_output_spec
from keras.src.trainers import data_adapters

from tfnng import _markers
from tfnng import losses as _losses
from tfnng._dtypes import at_least_float32
from tfnng._names import layer_paths, unique_names
from tfnng._xla import checked
from tfnng.curvature import capture as _capture
from tfnng.curvature import per_example as _per_example
from tfnng.optimizers.base import NoisyOptimizer, seed_value


def unwrap_optimizer(optimizer):
    """The optimizer that does the updates: the ``inner_optimizer`` of a
    ``keras.optimizers.LossScaleOptimizer`` (Keras wraps the compiled optimizer in one under the
    ``"mixed_float16"`` policy), else ``optimizer`` itself."""
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        return optimizer.inner_optimizer
    return optimizer


def _requirements(optimizer):
    return getattr(unwrap_optimizer(optimizer), "curvature_requirements", None)


def _check_same_model(optimizer, capture):
    """A clear error when ``optimizer`` was handed the layers of another model (one optimizer
    compiled with two models: it keeps the layers of the last ``compile``)."""
    specs = getattr(optimizer, "_layer_specs", None)
    if not specs or not capture.specs:
        return
    if not {id(spec.layer) for spec in specs} & {id(spec.layer) for spec in capture.specs}:
        raise ValueError(
            f"{type(optimizer).__name__} holds the curvature of another model's layers "
            f"({[spec.name for spec in specs]}), not of this one's "
            f"({[spec.name for spec in capture.specs]}): was it compiled with two models? An "
            "optimizer holds one posterior: give each model its own optimizer.")


def _num_replicas():
    """Replicas of the current ``tf.distribute`` strategy (Keras divides each one's loss by it)."""
    return tf.distribute.get_strategy().num_replicas_in_sync


def _multi_replica_context():
    """The replica context when tracing one of several replicas, else None."""
    context = tf.distribute.get_replica_context()
    return context if context is not None and context.num_replicas_in_sync > 1 else None


# Folded into the seed of the true Fisher's targets: a model and an optimizer given the same seed
# do not draw the targets and the weight noise from the same Philox stream.
_TARGET_STREAM = 0x54415247


def _target_seed(seed):
    """The stateless seed (``int32[2]``) of one step's true-Fisher targets, drawn once from ``seed``
    (a ``keras.random.SeedGenerator``; a random one for None) and shared by the Dense/Conv2D path
    and the generic path, so that both differentiate each example's log-likelihood at the same
    draw and the cross terms between their blocks (SLANG, full covariance) are the Fisher's. The
    replica id is folded in: the generator's state is mirrored, so its plain draw would give every
    replica the same noise for its examples."""
    if seed is not None and not isinstance(seed, keras.random.SeedGenerator):
        raise ValueError(
            "`seed` of the true Fisher's targets must be a keras.random.SeedGenerator (created "
            "once, before the training loop) or None: a fixed seed would draw the same targets "
            f"at every step; got {seed!r}.")
    stateless = (_losses._stateless_seed(seed) if seed is not None
                 else tf.random.uniform([2], maxval=tf.int32.max, dtype=tf.int32))
    stateless = tf.random.experimental.stateless_fold_in(stateless, _TARGET_STREAM)
    context = _multi_replica_context()
    if context is None:
        return stateless
    return tf.random.experimental.stateless_fold_in(stateless, context.replica_id_in_sync_group)


def _example_weights(sample_weight):
    """Keras's ``sample_weight`` (also ``class_weight``'s) as one weight per example, shape (B,).
    Keras hands a multi-output model its one array once per output: weights equal for every
    output are one weight per example; weights that differ between outputs are refused."""
    if sample_weight is None:
        return None
    if isinstance(sample_weight, (list, tuple)) and all(
            isinstance(w, numbers.Real) for w in sample_weight):
        sample_weight = tf.convert_to_tensor(sample_weight)      # a list of numbers, not outputs
    leaves = tf.nest.flatten(sample_weight)
    if any(leaf is None for leaf in leaves):
        raise ValueError("Curvature statistics take one weight per example; got sample weights for "
                         "some outputs of a multi-output model only.")
    weights = [_one_weight_per_example(leaf) for leaf in leaves]
    return _same_for_every_output(
        weights, "Curvature statistics take one weight per example: the sample weights of the "
        "outputs of a multi-output model must be equal.")


def _one_weight_per_example(sample_weight):
    weights = tf.convert_to_tensor(sample_weight)
    if weights.shape.rank is not None and any(d != 1 for d in weights.shape[1:]):
        raise ValueError("Curvature statistics take one weight per example, shape (B,) or (B, 1); "
                         f"got sample weights of shape {tuple(weights.shape)}.")
    if not weights.dtype.is_floating:
        weights = tf.cast(weights, tf.float32)
    weights = tf.reshape(weights, [-1])
    return checked(weights, weights >= 0, "sample weights must be non-negative.")


def _same_for_every_output(values, message):
    """``values[0]``, after checking that every one of ``values`` (one per output) equals it."""
    first = values[0]
    if len(values) == 1:
        return first
    same = [tf.reduce_all(tf.equal(first, tf.cast(other, first.dtype))) for other in values[1:]]
    return checked(first, tf.reduce_all(tf.stack(same)), message)


def _masked_example_weights(weights, y_pred):
    """The per-example weights the compiled loss gives the examples: ``weights`` (or 1) times the
    weight Keras gives an output mask in a mean-reduced loss (``keras.losses.loss.apply_mask``:
    ``B / valid`` for a kept example, 0 for a masked one). None without weights and mask. The
    outputs of a multi-output model must carry the same mask, or none."""
    masks = [getattr(output, "_keras_mask", None) for output in tf.nest.flatten(y_pred)]
    present = [mask for mask in masks if mask is not None]
    if not present:
        return weights
    if len(present) < len(masks):
        raise ValueError("Curvature statistics take one weight per example; some outputs of the "
                         "model carry a Keras mask and others do not, so the loss weighs the "
                         "examples differently per output.")
    for mask in present:
        if mask.shape.rank is not None and mask.shape.rank > 1 and any(
                d != 1 for d in mask.shape[1:]):
            raise ValueError(
                "Curvature statistics take one weight per example; the model's output carries a "
                f"Keras mask of shape {tuple(mask.shape)} (per position). Mask whole examples "
                "only, or train the model with a diagonal optimizer (IVON, NoisyAdam), which "
                "needs no per-example curvature and no BayesianModel.")
    dtype = tf.float32 if weights is None else weights.dtype
    mask = _same_for_every_output([tf.cast(tf.reshape(m, [-1]), dtype) for m in present],
                                  "Curvature statistics take one weight per example: the outputs "
                                  "of the model carry different Keras masks.")
    mask_weights = mask * tf.math.divide_no_nan(tf.cast(tf.size(mask), dtype), tf.reduce_sum(mask))
    return mask_weights if weights is None else weights * mask_weights


def _statistic(gradient, loss_dtype):
    """A captured pre-activation gradient in the wider of its own dtype and the loss's, half
    precision widened to float32: a float16 layer's in the float32 of a mixed-precision loss, a
    float64 layer's in float64 under Keras's float32 compiled loss."""
    gradient = at_least_float32(gradient)
    wider = gradient.dtype.size >= tf.as_dtype(loss_dtype).size
    return gradient if wider else tf.cast(gradient, loss_dtype)


def _inverse_roots(weights, dtype):
    """``1 / sqrt(weights)`` in ``dtype``, 0 for a weight of 0."""
    roots = tf.sqrt(tf.cast(weights, dtype))
    return tf.math.divide_no_nan(tf.ones_like(roots), roots)


def _scale_examples(tensor, scale):
    """``tensor`` (B, ...) with example n multiplied by ``scale[n]``."""
    return tensor * tf.reshape(tf.cast(scale, tensor.dtype), [-1] + [1] * (tensor.shape.rank - 1))


def check_mean_reduction(loss):
    """Stop with a clear error unless every loss in ``loss`` (one, or a list/dict per output) is a mean
    over the batch (:func:`tfnng.losses.require_mean_reduction`). Losses without a ``reduction``
    attribute (plain functions, Keras names) are means. A Keras loss's ``ignore_class`` is refused:
    its mean is over the examples it keeps, a mask the curvature statistics do not see."""
    for single in tf.nest.flatten(loss):
        name = type(single).__name__
        _losses.require_mean_reduction(name, getattr(single, "reduction",
                                                     _losses.MEAN_REDUCTIONS[0]))
        if getattr(single, "ignore_class", None) is not None:
            raise ValueError(
                f"{name}(ignore_class={single.ignore_class}) averages over the examples it keeps, "
                "a mask the curvature statistics do not see (each kept example's would be "
                "B/kept times too large). Give the ignored examples sample_weight 0 instead (the "
                "loss is then a mean over the batch).")


def _single_likelihood(loss_fn, purpose, alternative):
    """The tfnng likelihood (``sample`` and ``log_prob``) ``loss_fn`` is, or holds as the one loss of
    a one-output model (:func:`tfnng.losses.single_loss`), else a clear error suggesting
    ``alternative``."""
    loss_fn = _losses.single_loss(loss_fn)
    if loss_fn is None:
        raise ValueError(f"{purpose} needs a tfnng likelihood loss, and the model was compiled "
                         "without one: pass it to compile, e.g. `model.compile(optimizer, "
                         "loss=tfnng.losses.GaussianNLL())` (the model's add_loss terms are added "
                         "to it).")
    if isinstance(loss_fn, (list, tuple, dict)):
        raise ValueError(f"{purpose} needs one tfnng likelihood loss; a model compiled with one "
                         f"loss per output is supported only {alternative}.")
    if not hasattr(loss_fn, "sample") or not hasattr(loss_fn, "log_prob"):
        raise ValueError(f"{purpose} needs a tfnng likelihood loss (GaussianNLL, CategoricalNLL, "
                         f"BernoulliNLL); another loss is supported only {alternative}.")
    return loss_fn


def _sampled_targets(likelihood, output, seed):
    """Targets drawn from the predictive ``likelihood`` of ``output`` (the true Fisher's) with the
    stateless ``seed`` of :func:`_target_seed`. Non-finite outputs would make the sampler return
    invalid targets (class ids out of range): they are drawn from a finite stand-in, NaN as 0 (a
    diverging step, whose statistics are non-finite and skipped) and +-inf as the largest finite
    values, so that a class masked out by a -inf logit keeps probability 0."""
    largest = output.dtype.max
    finite = tf.clip_by_value(tf.where(tf.math.is_nan(output), tf.zeros_like(output), output),
                              -largest, largest)
    return tf.stop_gradient(likelihood.sample(tf.stop_gradient(finite), seed=seed))


def _true_fisher_likelihood(loss_fn):
    return _single_likelihood(
        loss_fn, "The true Fisher, which samples targets from the model's predictive,",
        "with fisher='empirical' and Dense/Conv2D layers")


_PER_EXAMPLE_FIELDS = ("inputs", "preactivation_grads", "gradients")


def _gather_over_replicas(records):
    """Concatenate the replicas' per-example tensors along the batch axis (``tf.distribute``), so
    that every statistic an optimizer computes from the records (Kronecker factors, squared or raw
    per-example gradients) is that of the global batch, identical on every replica."""
    context = _multi_replica_context()
    if context is None or not records:
        return records
    parts = [(name, field) for name, record in records.items()
             for field in _PER_EXAMPLE_FIELDS if getattr(record, field, None) is not None]
    # Half precision in float32: TensorFlow's collective gather refuses bfloat16 (the statistics
    # are computed in float32 anyway).
    local = [at_least_float32(getattr(records[name], field)) for name, field in parts]
    gathered = context.all_gather(local, axis=0)
    for (name, field), value, mine in zip(parts, gathered, local):
        # all_gather forgets the static shape; the replicas' batches may differ in size (a batch
        # that does not split evenly), the other axes do not.
        setattr(records[name], field, tf.ensure_shape(value, [None] + list(mine.shape[1:])))
    return records


def gradients_and_curvature(net, capture, optimizer, loss_fn, x, y, sample_weight=None,
                            seed=None, compute_loss=None, compute_likelihood_loss=None,
                            loss_adds_terms=False):
    """One forward/backward pass of ``net`` with curvature capture.

    Args:
        net: the Keras model.
        capture: a :class:`tfnng.curvature.capture.LayerCapture` of ``net``.
        optimizer: the optimizer (its ``curvature_requirements`` and ``curvature_due`` are read;
            a ``LossScaleOptimizer`` is looked through).
        loss_fn: the likelihood (a tfnng loss: ``sample`` and ``log_prob`` for the true Fisher).
        x, y, sample_weight: the batch. ``sample_weight`` (one non-negative weight per example)
            weighs the log-likelihood ``sum_n w_n log p(y_n | x_n, w)``: each example's
            pre-activation (and per-example) gradients are scaled by ``sqrt(w_n)``, so that the
            curvature is ``sum_n w_n`` times its contribution (the layer inputs are not weighted).
        seed: a ``keras.random.SeedGenerator`` for the true Fisher's target samples, created once
            before the loop (each step draws its next seed), or None (a random seed per step).
        compute_loss: optional ``f(y_pred) -> scalar`` training loss (default: ``loss_fn(y, y_pred,
            sample_weight)`` alone, without the net's own losses ``net.losses``, regularisers and
            ``add_loss`` terms: pass a ``compute_loss`` that adds them to train on them);
            BayesianModel passes Keras's compiled loss, which includes them.
        compute_likelihood_loss: optional ``f(y_pred) -> scalar``, the training loss without the
            net's own losses (``add_loss`` terms, activity regularisers); the empirical Fisher
            differentiates it when one of those depends on a captured pre-activation, so that the
            curvature is the likelihood's (default: ``loss_fn(y, y_pred, sample_weight)``).
            BayesianModel passes Keras's compiled loss alone.
        loss_adds_terms: ``compute_loss`` may hold terms of its own besides the likelihood and the
            net's losses (a model overriding ``keras.Model.compute_loss``): the empirical Fisher
            then always differentiates ``compute_likelihood_loss`` (if given).

    Returns:
        ``(loss, y_pred, grads, captured)`` with ``grads`` aligned with ``net.trainable_variables``.
        ``grads`` are those of ``optimizer.scale_loss(loss)``, as in Keras's ``train_step`` (the
        same as those of ``loss`` unless the optimizer scales the loss, like the
        ``LossScaleOptimizer`` of mixed precision, whose ``apply_gradients`` unscales them); the
        captured statistics are unscaled.
    """
    requirements = _requirements(optimizer)
    if requirements is None:
        raise ValueError(
            "gradients_and_curvature needs an optimizer that consumes curvature statistics (the "
            "noisy K-FAC family, VOGN, SLANG, NoisyNaturalGradient, or NoisyAdam with `fisher=`); "
            f"got {type(unwrap_optimizer(optimizer)).__name__}.")
    _check_same_model(unwrap_optimizer(optimizer), capture)
    check_mean_reduction(loss_fn)
    variables = list(net.trainable_variables)
    generic = _generic_variables(capture, variables) if requirements.per_example_gradients else []
    if generic:
        _refuse_stateful_layers(net)
    weights = _example_weights(sample_weight)
    with tf.GradientTape(persistent=True) as tape:
        with capture.recording(tape):
            y_pred = net(x, training=True)
        # The loss weighs the examples by the sample weights and by the output's Keras mask.
        weights = _masked_example_weights(weights, y_pred)
        loss = (compute_loss(y_pred) if compute_loss is not None
                else loss_fn(y, y_pred, sample_weight=sample_weight))
        # The net's own losses (add_loss, activity and weight regularisers) are in the training
        # loss, not in the likelihood whose curvature the empirical Fisher estimates.
        penalties = list(net.losses) if compute_loss is not None else []
        likelihood_loss = penalty = None
        if ((penalties or (loss_adds_terms and compute_likelihood_loss is not None))
                and requirements.fisher == "empirical" and capture.specs):
            likelihood_loss = (compute_likelihood_loss(y_pred) if compute_likelihood_loss is not None
                               else loss_fn(y, y_pred, sample_weight=sample_weight))
            if not loss_adds_terms:
                # Summed on the tape: its gradients tell whether a penalty reaches a pre-activation.
                penalty = tf.add_n([tf.cast(term, loss.dtype) for term in penalties])
        # Keras optimizers scale the loss under mixed precision; protocol stand-ins need not.
        scale_loss = getattr(optimizer, "scale_loss", None)
        loss_scale = tf.ones((), loss.dtype) if scale_loss is None else scale_loss(
            tf.ones((), loss.dtype))
        scaled_loss = loss * loss_scale
        if likelihood_loss is not None:
            likelihood_loss = likelihood_loss * loss_scale
        # The loss is reduced over the global batch (local batch x replicas, Keras's scaling).
        batch_size = tf.shape(tf.nest.flatten(y_pred)[0])[0]
        batch = tf.cast(batch_size * _num_replicas(), loss.dtype)
        # Under a LossScaleOptimizer the log-likelihoods (true Fisher, generic path) are
        # differentiated at about the scale each example's gradient has in the scaled loss's
        # backward pass, so that float16 gradients do not underflow where the loss's do not: the
        # power of two nearest loss_scale / B (exact), unscaled in the loss's dtype. Their
        # overflow counts as the step's (below). Otherwise at scale 1.
        adaptive = isinstance(optimizer, keras.optimizers.LossScaleOptimizer)
        example_scale = (_power_of_two_near(loss_scale / batch) if adaptive
                         else tf.ones((), loss.dtype))
        fisher_ll = None
        target_seed = _target_seed(seed) if requirements.fisher == "true" else None
        if requirements.fisher == "true" and capture.specs:
            likelihood = _true_fisher_likelihood(loss_fn)
            output = _losses.single_output(y_pred, "The true Fisher")
            targets = _sampled_targets(likelihood, output, target_seed)
            log_probs = likelihood.log_prob(targets, output)
            if weights is not None:
                log_probs = log_probs * tf.sqrt(tf.cast(weights, log_probs.dtype))
            fisher_ll = tf.reduce_sum(log_probs) * tf.cast(example_scale, log_probs.dtype)
    records = capture.captured() if capture.specs else {}
    _check_batch_axes(records, tf.nest.flatten(x)[0].shape[0], batch_size)
    zeros = [r.zero for r in records.values()]
    if penalty is not None and zeros:
        # A penalty that reaches a pre-activation (activity regulariser, add_loss on activations)
        # needs a backward pass of the likelihood alone; weight penalties do not. (Unused, the
        # penalty's gradients are pruned from the traced graph.)
        if all(g is None for g in tape.gradient(penalty, zeros)):
            likelihood_loss = None
    all_grads = tape.gradient(scaled_loss, variables + zeros)
    grads = all_grads[:len(variables)]          # None for unconnected variables, as in Keras
    all_grads = all_grads[:len(variables)] + [
        tf.zeros_like(z) if g is None else g for z, g in zip(zeros, all_grads[len(variables):])]
    due = unwrap_optimizer(optimizer).curvature_due()
    if zeros:
        if requirements.fisher == "true":
            pre_grads = [_statistic(g, loss.dtype)
                         for g in _gradients_when_due(tape, fisher_ll, zeros, due)]
            pre_grads = [g / tf.cast(example_scale, g.dtype) for g in pre_grads]
        else:
            # Gradients of the log-likelihood (minus the mean loss, times B), as for the true Fisher.
            # Unscaled, in float32 at least (also when the activations are float16).
            factor = -batch / loss_scale
            if likelihood_loss is not None:
                likelihood_grads = _gradients_when_due(tape, likelihood_loss, zeros, due)
            else:
                likelihood_grads = all_grads[len(variables):]
            pre_grads = [_statistic(g, loss.dtype) for g in likelihood_grads]
            pre_grads = [g * tf.cast(factor, g.dtype) for g in pre_grads]
            if weights is not None:     # the loss weighs example n by w_n; the statistics sqrt(w_n)
                pre_grads = [_scale_examples(g, _inverse_roots(weights, g.dtype))
                             for g in pre_grads]
        for record, g in zip(records.values(), pre_grads):
            record.preactivation_grads = g
    scaled_statistics = list(pre_grads) if zeros and requirements.fisher == "true" else []
    if generic:
        generic_records = _generic_records(net, loss_fn, x, y, generic, due, weights, example_scale,
                                           taken=list(records), fisher=requirements.fisher,
                                           seed=target_seed)
        scaled_statistics += [r.gradients for r in generic_records.values()]
        records.update(generic_records)
    if adaptive and scaled_statistics:
        grads = _overflow_reported(grads, scaled_statistics)
    return loss, y_pred, grads, _gather_over_replicas(records)


def _overflow_reported(grads, statistics):
    """``grads``, made NaN when a statistic differentiated at the loss scale is not finite: the
    LossScaleOptimizer, which checks the gradients only, then lowers its scale and skips the step,
    as for an overflow of the loss's own gradients (it would otherwise raise its scale for ever,
    and the inner optimizer skip every step)."""
    finite = tf.reduce_all(tf.stack([tf.reduce_all(tf.math.is_finite(t)) for t in statistics]))

    def flagged(g):
        flag = tf.where(finite, tf.ones((), g.dtype), tf.constant(float("nan"), g.dtype))
        if isinstance(g, tf.IndexedSlices):
            return tf.IndexedSlices(g.values * flag, g.indices, g.dense_shape)
        return g * flag

    return [None if g is None else flagged(g) for g in grads]


def _power_of_two_near(scale):
    """``2^round(log2(scale))``: multiplying by it is exact, so a log-likelihood differentiated at
    this scale and unscaled gives the same bits as unscaled, wherever nothing underflows."""
    exponent = tf.round(tf.math.log(tf.cast(scale, tf.float64)) / math.log(2.0))
    return tf.cast(tf.pow(tf.constant(2.0, tf.float64), exponent), scale.dtype)


def _check_batch_axes(records, static_batch, batch_size=None):
    """Stop unless every captured layer's input has the batch on its first axis (``batch_size``
    rows, checked at run time unless None; ``static_batch``, the input's, when known at tracing): a
    layer applied to a reshape that folds another axis into the batch, or to a tensor without a
    batch axis, would mix examples in the curvature statistics. Traced with an unknown batch size,
    an input with a known number of rows has no batch axis (a learned table), whatever the batch
    size it runs with."""
    for name, record in records.items():
        def message(problem):
            return (f"Layer {name!r}: the curvature statistics (K-FAC factors, per-example "
                    "gradients) need the batch on the first axis of each Dense/Conv2D input, and "
                    f"this layer's input has {problem}. Keep the batch axis first (Dense takes "
                    "(batch, ..., features) inputs; do not fold other axes into the batch), or use "
                    "an optimizer that needs no curvature capture.")
        rows = record.zero.shape[0]
        if rows is not None and static_batch is not None:
            if rows != static_batch:
                raise ValueError(message("another number of rows than the model's input")
                                 + f" (Rows: {rows}, batch: {static_batch}.)")
        elif rows is not None:
            raise ValueError(message(f"{rows} rows whatever the batch size: it has no batch axis "
                                     "(a learned table, a constant)"))
        elif batch_size is not None:
            tf.debugging.assert_equal(tf.shape(record.zero)[0], batch_size,
                                      message=message("another number of rows than the model's"))


def _gradients_when_due(tape, target, zeros, due):
    """Gradients of ``target`` with respect to the captured zero tensors, a second backward pass
    run only when the statistics are ``due`` (zeros otherwise)."""
    return tf.cond(due,
                   lambda: tape.gradient(target, zeros,
                                         unconnected_gradients=tf.UnconnectedGradients.ZERO),
                   lambda: [tf.zeros_like(z) for z in zeros])


def _require_known_variables(optimizer, variables):
    """A clear error for trainable variables the optimizer was not built for (Keras's own says
    "Unknown variable" and advises a new optimizer instance, which does not help here: a curvature
    optimizer is built before the step's forward pass)."""
    known = {id(v) for v in optimizer._trainable_variables}
    unknown = [v.path for v in variables if id(v) not in known]
    if unknown:
        raise ValueError(
            f"{type(optimizer).__name__} was built for the net's variables before this step, "
            f"without {', '.join(unknown)}: created by the model's first forward pass (a Keras "
            "layer used as an activation, say; call the model on a batch, `model(x[:1])`, before "
            "compiling), or made trainable after the optimizer was built (compile with a new "
            "optimizer).")


def _refuse_stateful_layers(net):
    """The generic per-example path runs the net a second time, which would advance the state of a
    stateful recurrent layer twice per step (and differentiate from the advanced state)."""
    stateful = [layer.name for layer in _capture._leaf_layers(net) if getattr(layer, "stateful", False)]
    if stateful:
        raise ValueError(
            f"Stateful layers ({', '.join(stateful)}) cannot take the generic per-example path, "
            "which runs the net once more per step and would advance their state twice. Train "
            "the model with a diagonal optimizer (IVON, NoisyAdam) or with K-FAC, whose other "
            "layers take a diagonal posterior, or make the layers stateless.")


def _generic_variables(capture, variables):
    """Bayesian variables that no captured layer owns: they take the generic per-example path."""
    owned = {id(v) for spec in capture.specs for v in spec.variables}
    return [v for v in variables if id(v) not in owned and not _markers.is_point_estimate(v)]


def _generic_records(net, loss_fn, x, y, variables, due, weights, example_scale, taken, fisher,
                     seed):
    """Per-example log-likelihood gradients of ``variables`` by the generic path (only when ``due``),
    scaled by the square roots of the example ``weights`` (if any), under names not in ``taken``;
    differentiated at ``example_scale`` (a loss scale over the batch size) and unscaled.

    The passes run in inference mode (per_example_gradients), so the true Fisher's targets are
    sampled from the inference-mode outputs (the training pass's differ under dropout or batch
    statistics), with the stateless ``seed`` the Dense/Conv2D path uses: where the two passes agree,
    both paths differentiate the same targets. The empirical Fisher differentiates minus the
    training loss of each example (for a learned noise precision, eq. 23, not the Student-t
    predictive), as the Dense/Conv2D path does.
    """
    likelihood = _single_likelihood(
        loss_fn, f"The per-example gradients of {', '.join(layer_paths(variables))} (no Dense/Conv2D fast path: "
                 "each example's log-likelihood is differentiated)",
        "for Dense/Conv2D layers (with fisher='empirical'): mark these layers' variables as point "
        "estimates with tfnng.mark_point_estimate")

    def log_likelihood(y_true, y_pred):
        output = _losses.single_output(y_pred, "The per-example gradients")
        log_probs = (likelihood.log_prob(y_true, output) if fisher == "true"
                     else -likelihood.call(y_true, output))
        return log_probs * tf.cast(example_scale, log_probs.dtype)

    def compute():
        targets = _losses.single_target(y)       # {"output": y} for a named output
        if fisher == "true":
            targets = _sampled_targets(
                likelihood, _losses.single_output(net(x, training=False), "The true Fisher"), seed)
        return [g / tf.cast(example_scale, g.dtype) for g in _per_example.per_example_gradients(
            net, log_likelihood, x, targets, variables)]

    batch = tf.shape(tf.nest.flatten(x)[0])[0]
    gradients = tf.cond(due, compute,
                        lambda: [tf.zeros((batch,) + tuple(v.shape), v.dtype) for v in variables])
    if weights is not None:
        gradients = [_scale_examples(g, tf.sqrt(tf.cast(weights, g.dtype))) for g in gradients]
    names = unique_names(taken + [v.path for v in variables])[len(taken):]
    return {name: _per_example.CapturedVariable(v, g)
            for name, v, g in zip(names, variables, gradients)}


def _input_specs(net):
    """``tf.TensorSpec`` (or a structure of them) of the net's inputs, unknown dimensions left unknown
    (a functional model's input tensors, else the shape a subclassed model was built with), for
    tracing :meth:`tfnng.curvature.capture.LayerCapture.find_links`; None if unknown."""
    if not net.built:
        return None
    tensors = getattr(net, "inputs", None)
    if tensors:
        try:
            structure = net.input     # a functional model's inputs as it takes them (a dict stays one)
        except AttributeError:        # a Sequential never called
            structure = tensors if len(tensors) > 1 else tensors[0]
        return tf.nest.map_structure(lambda t: tf.TensorSpec(t.shape, t.dtype), structure)
    shape = (net.get_build_config() or {}).get("input_shape")
    if not isinstance(shape, (tuple, list)) or not all(
            d is None or isinstance(d, int) for d in shape):
        return None                                 # not built from one input shape
    return tf.TensorSpec([None] + list(shape[1:]), keras.backend.floatx())


@keras.saving.register_keras_serializable(package="tfnng")
class BayesianModel(keras.Model):
    """Wraps a Keras model so that curvature-hungry tfnng optimizers can train it.

    See the module docstring for the metrics and the optimizer protocol. With an optimizer that
    declares no ``curvature_requirements`` (the diagonal family, Keras optimizers) the training step
    is Keras's own plus the ``nll``/``kl`` metrics. A net without trainable weights is an error
    (Keras's step warns and skips the update).

    Args:
        net: a Keras model (Sequential, functional or subclassed; if unbuilt, its first training
            batch builds it). Supported layers for the Kronecker family: Dense and Conv2D (see
            :mod:`tfnng.curvature.capture`); others fall back to a diagonal posterior, stated once
            in a log line.
        seed: seed of the true Fisher's sampled targets (an int, or None: drawn from Python's
            random state, which ``keras.utils.set_random_seed`` fixes, as for Keras's own
            generators).
    """

    def __init__(self, net, seed=None, **kwargs):
        super().__init__(**kwargs)
        if not isinstance(net, keras.Model):
            raise TypeError(f"BayesianModel wraps a keras.Model, got {type(net).__name__}.")
        if type(net).compute_loss is not keras.Model.compute_loss:
            raise ValueError(
                f"The net {net.name!r} overrides compute_loss, which BayesianModel does not call "
                "(it trains on its own compiled loss and the net's add_loss terms). Move the extra "
                "term into a BayesianModel subclass's compute_loss, or add it in the net with "
                "add_loss.")
        self.net = net
        self._nll_tracker = keras.metrics.Mean(name="nll")
        self._kl_tracker = keras.metrics.Mean(name="kl")
        self._layer_capture = None
        self._kl_traced_without_posterior = False
        self.seed = seed_value(seed)
        self._fisher_seed = keras.random.SeedGenerator(self.seed, name="fisher_targets_seed")
        # Keras saves no SeedGenerator state: tracked as a non-trainable variable of the model, it
        # is saved (.keras, .weights.h5, tf.train.Checkpoint) and resumed training draws the same
        # targets as uninterrupted training.
        self._fisher_seed_state = self._fisher_seed.state
        # A subclass with weights of its own is built later, once its __init__ has run (compile,
        # or Keras at the first call), as Keras builds a model.
        if net.built and not self._extends_the_forward_pass():
            self.built = True

    @classmethod
    def _extends_the_forward_pass(cls):
        """Whether a subclass overrides ``call`` or ``build`` (layers or weights of its own)."""
        return cls.call is not BayesianModel.call or cls.build is not BayesianModel.build

    def call(self, inputs, training=None):
        return self.net(inputs, training=training)

    def build(self, input_shape=None):
        if not self.net.built and input_shape is not None:
            self.net.build(input_shape)
        self.built = True
        if self.net.built and type(self).call is not BayesianModel.call:
            # Layers a subclass's `call` adds (a learned noise precision head) get their variables
            # from a symbolic forward pass, before an optimizer is built for the model's variables
            # (keras.models.load_model builds, then compiles). If it cannot be traced from the
            # shapes, the first batch builds them (train_step runs the forward pass first).
            specs = _input_specs(self.net)
            if specs is not None:
                try:
                    compute_output_spec(self.call, tf.nest.map_structure(
                        lambda spec: keras.KerasTensor(spec.shape, spec.dtype), specs))
                except Exception:    # noqa: BLE001 -- the real forward pass reports it
                    pass
        if self.net.built and getattr(self, "optimizer", None) is not None:
            # Keras may build the optimizer right after the model, outside train_step (under a
            # distribution strategy): it needs its layers first.
            self._prepare_curvature()

    @property
    def input_shape(self):
        return self.net.input_shape

    @property
    def output_names(self):
        """The net's output names (an AttributeError if it has none, as for a Sequential): Keras
        matches a loss or metrics given per output name against them."""
        return self.net.output_names

    @property
    def output_shape(self):
        return self.net.output_shape

    # ------------------------------------------------------------------------------ curvature
    def compile(self, *args, **kwargs):
        if self.net.built and not self.built:
            # A subclass with weights of its own (see __init__) is built once its own __init__ has
            # run: its optimizer can then be built for all its variables before the first step
            # (restoring into a fresh model; Keras builds it here under a strategy).
            specs = _input_specs(self.net)
            if specs is not None:
                self.build(tf.nest.map_structure(lambda spec: tuple(spec.shape), specs))
        super().compile(*args, **kwargs)
        if isinstance(unwrap_optimizer(self.optimizer), NoisyOptimizer):
            check_mean_reduction(self.loss)
        requirements = _requirements(self.optimizer)
        distributed = (getattr(self, "_distribute_strategy", None) is not None
                       or tf.distribute.has_strategy())
        if (requirements is not None and distributed
                and isinstance(self.optimizer, keras.optimizers.LossScaleOptimizer)):
            raise ValueError(
                f"{type(unwrap_optimizer(self.optimizer)).__name__} reads layer curvature, which "
                "cannot pass through Keras's LossScaleOptimizer ('mixed_float16' policy) under a "
                "tf.distribute strategy: the wrapper applies the update in other threads. Use the "
                "'mixed_bfloat16' policy (no loss scaling), or train on one device.")
        if requirements is not None and requirements.fisher == "true" and self.loss is not None:
            # Here rather than in the first step: a loss without a likelihood is refused when
            # it is given, before any data.
            _true_fisher_likelihood(self.loss)
        self._layer_capture = None
        if self.net.built:
            self._prepare_curvature()

    def compile_from_config(self, config):
        """Keras's ``compile_from_config`` (used by ``keras.models.load_model``), routed through this
        class's ``compile`` so that the optimizer is given its layers before it is built."""
        self.compile(**keras.saving.deserialize_keras_object(config))
        if self.built:
            self.optimizer.build(self.trainable_variables)

    def fit(self, *args, **kwargs):
        self._refresh_stale_capture()
        return super().fit(*args, **kwargs)

    def train_on_batch(self, *args, **kwargs):
        self._refresh_stale_capture()
        return super().train_on_batch(*args, **kwargs)

    def _refresh_stale_capture(self):
        """Layers frozen or unfrozen between ``compile`` and the first step: an optimizer not
        built yet gets the supported layers as they are now (Keras reads ``trainable`` then too)."""
        optimizer = unwrap_optimizer(getattr(self, "optimizer", None))
        if self._layer_capture is None or getattr(optimizer, "built", True):
            return
        now = [id(spec.layer) for spec in _capture.find_layers(self.net)[0]]
        if now != [id(spec.layer) for spec in self._layer_capture.specs]:
            self._layer_capture = None
            self._prepare_curvature()

    def _prepare_curvature(self):
        requirements = _requirements(self.optimizer)
        if requirements is None or self._layer_capture is not None:
            return
        capture = _capture.LayerCapture(self.net)
        specs = _input_specs(self.net)
        if specs is not None and capture.specs:
            # One forward pass, traced, not run: no example data needed, unknown image and batch
            # sizes stay unknown, so that a layer input without a batch axis shows (the steps may
            # be traced with a batch size that equals its number of rows).
            recorded = {}

            def survey(inputs):
                if requirements.layer_links:
                    capture.find_links(inputs)
                else:
                    with tf.GradientTape() as tape, capture.recording(tape):
                        self.net(inputs, training=False)
                recorded.update(capture.records)

            try:
                tf.function(survey).get_concrete_function(specs)
            except (ValueError, TypeError, tf.errors.OpError):
                pass        # the net cannot be traced from its input specs: the first batch decides
            _check_batch_axes(recorded, tf.nest.flatten(specs)[0].shape[0])
        if requirements.kronecker or requirements.per_example_gradients:
            # The optimizer logs the layers that fall back to a diagonal posterior when it builds.
            unwrap_optimizer(self.optimizer).prepare_curvature(capture.specs)
        self._layer_capture = capture

    def _kl_term(self, dtype):
        optimizer = unwrap_optimizer(self.optimizer)
        kl = getattr(optimizer, "kl_divergence", None)
        if kl is None:
            return tf.zeros((), dtype)
        if not getattr(optimizer, "built", False):
            self._kl_traced_without_posterior = True       # see make_test_function
            return tf.zeros((), dtype)
        weight = optimizer.kl_weight / optimizer.num_examples
        return tf.cast(weight * kl(), dtype)

    def _record(self, x, nll, kl):
        batch = tf.shape(tf.nest.flatten(x)[0])[0]
        nll = nll * tf.cast(_num_replicas(), nll.dtype)   # undo Keras's per-replica loss scaling
        self._nll_tracker.update_state(nll, sample_weight=batch)
        self._kl_tracker.update_state(kl, sample_weight=batch)   # epoch values: loss = nll + kl
        self._loss_tracker.update_state(nll + kl, sample_weight=batch)

    # ------------------------------------------------------------------------------ steps
    def train_step(self, data):
        x, y, sample_weight = data_adapters.data_adapter_utils.unpack_x_y_sample_weight(data)
        optimizer = self.optimizer
        requirements = _requirements(optimizer)
        if requirements is None:
            with tf.GradientTape() as tape:
                y_pred = self(x, training=True)
                nll = self._compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight,
                                         training=True)
                scaled_nll = optimizer.scale_loss(nll)     # mixed precision, as Keras's train_step
            self._require_trainable_variables()
            grads = tape.gradient(scaled_nll, self.trainable_variables)
            optimizer.apply_gradients(zip(grads, self.trainable_variables))
        else:
            # Keras defers building to the first trace of the train step; the captured layers and
            # the optimizer's state need the variables a forward pass creates first (an unbuilt
            # net's, by its own call on the batch; those of layers a subclass's `call` adds).
            # Traced once, unused.
            if not self.net.built:
                self.net(x, training=False)
            if not optimizer.built:
                self(x, training=False)
            if not self.built:
                # Keras records the input shapes of `build` for saving (and for save_weights, which
                # needs a built model).
                self.build(tf.nest.map_structure(lambda tensor: tuple(tensor.shape), x))
            self._require_trainable_variables()
            if self._layer_capture is None:
                self._prepare_curvature()
            if requirements.layer_links and any(
                    spec.inputs_from is None for spec in self._layer_capture.specs):
                self._layer_capture.find_links(x)      # traced: static, pruned from the step
            _check_same_model(unwrap_optimizer(optimizer), self._layer_capture)
            if not optimizer.built:
                # Outside the traced step: state made while tracing is initialised only when the
                # step first runs, so a step that failed to trace (targets of the wrong shape)
                # left the optimizer built with uninitialised state, unusable by the next fit.
                with tf.init_scope(), keras.name_scope(optimizer.name, caller=optimizer):
                    optimizer.build(self.trainable_variables)

            def compute_loss(y_pred):
                return self._compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight,
                                          training=True)

            def compute_likelihood_loss(y_pred):     # the compiled loss without the net's losses
                return self._compile_loss(y, y_pred, sample_weight)

            # The wrapper's own forward pass and loss: a subclass may override `call` or
            # `compute_loss` (Keras's way to add a loss term), which the curvature must follow.
            nll, y_pred, grads, captured = gradients_and_curvature(
                self, self._layer_capture, optimizer, self.loss, x, y, sample_weight,
                seed=self._fisher_seed, compute_loss=compute_loss,
                compute_likelihood_loss=(compute_likelihood_loss if self._compile_loss is not None
                                         else None),
                loss_adds_terms=type(self).compute_loss is not keras.Model.compute_loss)
            variables = self.trainable_variables
            _require_known_variables(unwrap_optimizer(optimizer), variables)
            unwrap_optimizer(optimizer).receive_curvature(captured)
            optimizer.apply_gradients(zip(grads, variables))
        self._record(x, nll, self._kl_term(nll.dtype))
        return self.compute_metrics(x, y, y_pred, sample_weight=sample_weight)

    def _require_trainable_variables(self):
        """A clear error for a net without trainable weights (Keras's own step would warn and skip
        the update; here the curvature steps failed on an empty list)."""
        if not self.trainable_variables:
            raise ValueError(f"BayesianModel {self.name!r} has no trainable weights, so there is "
                             f"no posterior to fit (are all the layers of its net "
                             f"{self.net.name!r} frozen?).")

    def make_test_function(self, force=False):
        """Keras's, retraced once the optimizer has a posterior if the cached test step was traced
        before (``evaluate`` before ``fit``): that trace holds kl = 0 as a constant."""
        if self._kl_traced_without_posterior and getattr(unwrap_optimizer(self.optimizer), "built", False):
            self._kl_traced_without_posterior = False
            force = True
        return super().make_test_function(force=force)

    def test_step(self, data):
        x, y, sample_weight = data_adapters.data_adapter_utils.unpack_x_y_sample_weight(data)
        y_pred = self(x, training=False)
        nll = self._compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight,
                                 training=False)
        self._record(x, nll, self._kl_term(nll.dtype))
        return self.compute_metrics(x, y, y_pred, sample_weight=sample_weight)

    def get_config(self):
        return {**super().get_config(), "net": keras.saving.serialize_keras_object(self.net),
                "seed": self.seed}

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        net = keras.saving.deserialize_keras_object(config.pop("net"), custom_objects=custom_objects)
        return cls(net, **config)


# Keras's legacy HDF5 format saves a model's bare class name, which the registration above
# ("tfnng>BayesianModel") does not match: registered under it too, so that such a file loads
# (with an optimizer that has no posterior, as docs/saving.md says).
keras.saving.get_custom_objects().setdefault("BayesianModel", BayesianModel)
