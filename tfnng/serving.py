"""SavedModel export of a model's Monte Carlo predictive, with the posterior sampled inside the graph.

``tfnng.serving.export(model, path, num_samples=S)`` writes a TensorFlow SavedModel that needs neither
tfnng nor the Python model at serving time (TF Serving, ``tf.saved_model.load``). The posterior held
by the model's tfnng optimizer is stored as a snapshot in ``tf.Variable`` s (means and standard
deviations of the diagonal family; mean matrices and sampling factors of noisy K-FAC; the flat mean and
sampling state of SLANG and NoisyNaturalGradient), and every call

1. draws S weight samples with stateless RNG (:func:`tfnng._random.standard_normal`) from a seed,
2. runs the network functionally at each sample (Keras 3 ``model.stateless_call`` under
   ``tf.map_fn``, whose default in a graph keeps up to 10 samples in flight),
3. summarises the S outputs with ``predictive_moments`` of the ``tfnng.predict`` module, the same Monte Carlo
   predictive as :func:`tfnng.predict`.

Signatures. TF Serving requires every input of a signature in every request, so the optional seed is
a second signature rather than an optional input:

* ``serving_default(inputs)``: fresh weight samples on every call (the seed comes from a stateful
  random op that seeds itself non-deterministically, also when a global seed was set at export);
* ``seeded(inputs, seed)``: ``seed`` int64 of shape ``[2]``; the same seed gives identical outputs.

Output names (the ``outputs`` argument selects some; shapes for inputs of batch size N):

* regression (``GaussianNLL``, fixed or learned noise): ``mean`` (N, d), ``variance`` (N, d) =
  ``epistemic_variance`` + ``aleatoric_variance``, and ``samples`` (N, S, d), the predicted mean of
  each weight sample;
* classification (``CategoricalNLL``, ``BernoulliNLL``): ``probabilities`` (N, K), the mean over
  weight samples of the class probabilities, also available as ``mean`` (the predictive mean of the
  one-hot label); ``variance`` (N, K), the variance over weight samples of the class probabilities;
  ``samples`` (N, S, K), the class probabilities of each weight sample.

``samples`` is batch-major (unlike ``tfnng.Predictive.samples``) so that every output's first axis
is the batch, as TF Serving's row ("instances") format requires.
"""

import os

import keras
import numpy as np
import tensorflow as tf

from tfnng import _random
from tfnng import losses as _losses
from tfnng.models import BayesianModel, _input_specs, unwrap_optimizer
from tfnng.optimizers._flat import FlatPosteriorOptimizer
from tfnng.optimizers.base import NoisyOptimizer, _positive_int
from tfnng.optimizers.kfac import NoisyKFAC
from tfnng.posteriors import diagonal as _diagonal
from tfnng.posteriors import kronecker as _kron
from tfnng.predict import (_frozen_variables, _likelihood_of, _seed_generator_states,
                           predictive_moments)

#: Output names -> key of ``predictive_moments`` (module ``tfnng.predict``), per kind of likelihood.
REGRESSION_OUTPUTS = {"mean": "mean", "variance": "variance",
                      "epistemic_variance": "epistemic_variance",
                      "aleatoric_variance": "aleatoric_variance", "samples": "samples"}
CLASSIFICATION_OUTPUTS = {"mean": "probs", "probabilities": "probs", "variance": "probs_variance",
                          "samples": "samples"}


# ------------------------------------------------------------------------------ posterior snapshot
def _snapshot(value):
    return tf.Variable(tf.convert_to_tensor(value), trainable=False)


class _Fixed(tf.Module):
    """A variable without weight noise (point estimate, noiseless optimizer, not in the optimizer)."""

    def __init__(self, position, value):
        super().__init__()
        self.positions = [position]
        self.value = _snapshot(value)
        self.noise_specs = []

    def draw(self, noise):
        return {self.positions[0]: tf.convert_to_tensor(self.value)}


class _Diagonal(tf.Module):
    """``w = mu + sigma * eps`` of a mean-field Gaussian (:func:`tfnng.posteriors.diagonal.perturb`)."""

    def __init__(self, position, mean, stddev):
        super().__init__()
        self.positions = [position]
        self.mean, self.stddev = _snapshot(mean), _snapshot(stddev)
        self.noise_specs = [tf.TensorSpec(self.mean.shape, self.mean.dtype)]

    def draw(self, noise):
        return {self.positions[0]: _diagonal.perturb(self.mean, self.stddev, noise[0])}


class _Homogeneous:
    """Where a Kronecker-factored layer's homogeneous matrix ``[kernel; bias]`` goes in the model."""

    def __init__(self, kernel_position, bias_position, kernel_shape):
        self.kernel_position = kernel_position
        self.bias_position = bias_position
        self.kernel_shape = tuple(kernel_shape)

    @property
    def positions(self):
        return [p for p in (self.kernel_position, self.bias_position) if p is not None]

    def split(self, matrix):
        if self.bias_position is None:
            return {self.kernel_position: tf.reshape(matrix, self.kernel_shape)}
        return {self.kernel_position: tf.reshape(matrix[:-1], self.kernel_shape),
                self.bias_position: matrix[-1]}


class _MatrixVariate(tf.Module):
    """``W = M + sqrt(lambda/N) A^-1/2 E S^-1/2`` of one layer (NNG eq. 13,
    :func:`tfnng.posteriors.kronecker.mvg_sample`)."""

    def __init__(self, layer, mean, a_root, s_root, scale):
        super().__init__()
        self.layer = layer
        self.positions = layer.positions
        self.mean, self.a_root, self.s_root = _snapshot(mean), _snapshot(a_root), _snapshot(s_root)
        self.scale = scale
        self.noise_specs = [tf.TensorSpec(self.mean.shape, self.mean.dtype)]

    def draw(self, noise):
        return self.layer.split(_kron.mvg_sample(self.mean, self.a_root, self.s_root, noise[0],
                                                 self.scale))


class _BlockTridiagonal(tf.Module):
    """A chain of layers with ``W_l = M_l + sqrt(lambda/N) (Xi^T Lambda^1/2 eps)_l`` (NNG sec. 3.5,
    :func:`tfnng.posteriors.kronecker.blktri_sample_noise`)."""

    def __init__(self, layers, means, caches, scale):
        super().__init__()
        self.layers = layers
        self.positions = [p for layer in layers for p in layer.positions]
        self.means = [_snapshot(mean) for mean in means]
        self.caches = [{key: _snapshot(value) for key, value in cache.items()} for cache in caches]
        self.scale = scale
        self.noise_specs = [tf.TensorSpec(mean.shape, mean.dtype) for mean in self.means]

    def draw(self, noise):
        caches = [{key: tf.convert_to_tensor(v) for key, v in cache.items()} for cache in self.caches]
        values = {}
        for layer, mean, deviation in zip(self.layers, self.means,
                                          _kron.blktri_sample_noise(caches, noise)):
            values.update(layer.split(mean + self.scale * deviation))
        return values


class _Flat(tf.Module):
    """``w = mu + sqrt(lambda/N) perturb(state, eps)`` of the families that couple all weights
    (SLANG, NoisyNaturalGradient: :class:`tfnng.optimizers._flat.FlatPosteriorOptimizer`)."""

    def __init__(self, positions, shapes, dtypes, mean, state, perturb, scale):
        super().__init__()
        self.positions, self.shapes, self.dtypes = positions, shapes, dtypes
        self.mean = _snapshot(mean)
        self.state = {key: _snapshot(value) for key, value in state.items()}
        self.perturb, self.scale = perturb, scale
        self.noise_specs = [tf.TensorSpec(self.mean.shape, self.mean.dtype)]

    def draw(self, noise):
        state = {key: tf.convert_to_tensor(value) for key, value in self.state.items()}
        sample = self.mean + self.scale * self.perturb(state, noise[0])
        parts = tf.split(sample, [int(np.prod(shape)) for shape in self.shapes])
        return {p: tf.cast(tf.reshape(part, shape), dtype)
                for p, part, shape, dtype in zip(self.positions, parts, self.shapes, self.dtypes)}


def _flat_sampler(optimizer, positions):
    variables = [optimizer._trainable_variables[i] for i in optimizer._flat_indices]
    return _Flat([positions[id(v)] for v in variables], [tuple(v.shape) for v in variables],
                 [v.dtype for v in variables], optimizer._flat_mean(), optimizer.sampling_state(),
                 optimizer.perturb, float(np.sqrt(optimizer._covariance_scale)))


# The families whose sampler the SavedModel reproduces, with the methods that sample: a subclass that
# overrides one of them samples differently, and its posterior cannot be exported.
_FAMILY_SAMPLERS = ((NoisyKFAC, ("_write_sample", "_draw", "_draw_blocks", "_sample_blocks")),
                    (FlatPosteriorOptimizer, ("_write_sample", "_assign_sample")),
                    (NoisyOptimizer, ("_write_sample", "_draw")))


def _exportable_optimizer(model):
    optimizer = unwrap_optimizer(getattr(model, "optimizer", None))   # mixed_float16 wraps it
    if not isinstance(optimizer, NoisyOptimizer):
        got = ("a model without an optimizer (not compiled; the net inside a tfnng.BayesianModel "
               "is exported through the BayesianModel)" if optimizer is None
               else f"optimizer {type(optimizer).__name__}")
        raise ValueError(
            "tfnng.serving.export needs a model compiled with a tfnng optimizer (its posterior is "
            f"what gets exported); got {got}.")
    family, methods = next((family, methods) for family, methods in _FAMILY_SAMPLERS
                           if isinstance(optimizer, family))
    overridden = [m for m in methods if getattr(type(optimizer), m) is not getattr(family, m)]
    if overridden:
        raise ValueError(
            f"tfnng.serving cannot export the posterior of {type(optimizer).__name__}: it overrides "
            f"{', '.join(overridden)} of {family.__name__}, and the SavedModel can only reproduce "
            "the samplers of the diagonal family (NoisyAdam, Vadam, Vprop, VadaGrad, IVON, VOGN), "
            "the noisy K-FAC family (NoisyKFAC, KFAC), SLANG and NoisyNaturalGradient.")
    optimizer._require_posterior_of(model)   # also copies the weights into never-updated means
    return optimizer


def _kronecker_samplers(optimizer, positions):
    """Samplers of noisy K-FAC's matrix-variate layers and block-tridiagonal chains, from the
    sampling factors the optimizer caches at its inverse updates."""
    if not optimizer._noisy:
        return []
    variables = optimizer._trainable_variables

    def placement(block):
        kernel = variables[block.kernel_index]
        bias = None if block.bias_index is None else positions[id(variables[block.bias_index])]
        return _Homogeneous(positions[id(kernel)], bias, kernel.shape)

    scale = optimizer.noise_scale
    samplers = [_MatrixVariate(placement(block), optimizer._mean_matrix(block),
                               block.state["a_root"], block.state["s_root"], scale)
                for block in optimizer._blocks if block.chain is None]
    samplers += [_BlockTridiagonal([placement(block) for block in chain],
                                   [optimizer._mean_matrix(block) for block in chain],
                                   optimizer._chain_cache(chain, "sample"), scale)
                 for chain in optimizer._chains]
    return samplers


def _posterior_samplers(model, optimizer):
    """Samplers that together draw every trainable variable of ``model``, from a posterior snapshot.

    Variables the optimizer trains but the model no longer does (frozen after training) get positions
    after the model's trainable ones: the joint draws that include them discard their part, and the
    model keeps their current values with its non-trainable state, as in :func:`tfnng.predict`."""
    variables = list(model.trainable_variables)
    samplers = []
    positions = {id(v): k for k, v in enumerate(variables + _frozen_variables(model, optimizer))}
    if isinstance(optimizer, NoisyKFAC):
        samplers = _kronecker_samplers(optimizer, positions)
    elif isinstance(optimizer, FlatPosteriorOptimizer):
        samplers = [_flat_sampler(optimizer, positions)]
    covered = {p for sampler in samplers for p in sampler.positions}
    for k, variable in enumerate(variables):
        if k in covered:
            continue
        try:
            index = optimizer._get_variable_index(variable)
        except KeyError:
            index = None
        if index is None or optimizer._point[index]:
            # not trained by the optimizer, or a point estimate: its current value, as in predict
            samplers.append(_Fixed(k, variable.value))
            continue
        mean = optimizer.posterior_mean(variable)
        stddev = optimizer.posterior_stddev(variable)
        samplers.append(_Diagonal(k, mean, stddev) if np.any(stddev.numpy()) else _Fixed(k, mean))
    return samplers


# ---------------------------------------------------------------------------------- exported graph
def _fresh_seed():
    """An int64[2] seed from a stateful op with ``seed = seed2 = 0``, which seeds itself from the
    operating system when its kernel is created (a global seed set at export is not consulted)."""
    return tf.raw_ops.RandomUniformInt(
        shape=tf.constant([2]), minval=tf.constant(np.iinfo(np.int64).min, tf.int64),
        maxval=tf.constant(np.iinfo(np.int64).max, tf.int64), seed=0, seed2=0)


def _input_dtype(model):
    """The dtype the model declares for its one input (``keras.Input(dtype=...)``, of the net in a
    ``tfnng.BayesianModel``): integer ids and float64 inputs pass unrounded. A model without a
    declared input gets Keras's float type, as its data adapter feeds."""
    specs = _input_specs(model.net if isinstance(model, BayesianModel) else model)
    leaves = [] if specs is None else tf.nest.flatten(specs)
    return leaves[0].dtype if len(leaves) == 1 else keras.config.floatx()


def _tensor_specs(model):
    """The ``inputs`` spec and the output spec of ``model``."""
    try:
        shape = (None,) + tuple(model.input_shape[1:])
        dtype = _input_dtype(model)
        output = model.compute_output_spec(keras.KerasTensor(shape, dtype))
    except (AttributeError, TypeError, ValueError) as error:
        raise ValueError("tfnng.serving.export supports built models with one input tensor of known "
                         f"shape (`model.input_shape`): {error}") from error
    output = _losses.single_output(output, "tfnng.serving.export")
    return (tf.TensorSpec(shape, dtype, name="inputs"),
            tf.TensorSpec(output.shape, output.dtype))


def _untracked_resources(model):
    """TensorFlow state the model's layers hold outside Keras variables (the hash table of a
    ``keras.layers.IntegerLookup``, a plain ``tf.Variable``): the exported functions read it, so the
    SavedModel must keep it."""
    return [value for layer in model._flatten_layers() for value in vars(layer).values()
            if isinstance(value, (tf.saved_model.experimental.TrackableResource, tf.Variable))]


# Folded into each sample's seed for the states of the model's Keras seed generators (a stream
# apart from the weight noise's).
_GENERATOR_STREAM = 1


def _batch_major(samples):
    """``(S, N, ...)`` -> ``(N, S, ...)``."""
    return tf.transpose(samples, [1, 0] + list(range(2, samples.shape.rank)))


class _Predictive(tf.Module):
    """The exported object: the posterior snapshot, the model's non-trainable state and the serving
    functions ``seeded(inputs, seed)`` and ``serving_default(inputs)``."""

    def __init__(self, model, optimizer, likelihood, num_samples, outputs, input_spec, output_spec):
        super().__init__()
        self.samplers = _posterior_samplers(model, optimizer)
        self.non_trainable = [_snapshot(v.value) for v in model.non_trainable_variables]
        self.model_resources = _untracked_resources(model)
        # The Keras model and the likelihood are captured by closure: needed only while tracing.
        num_trainable = len(model.trainable_variables)
        num_noise = sum(len(sampler.noise_specs) for sampler in self.samplers)
        generator_states = _seed_generator_states(model)

        def forward_at_sample(inputs, seed):
            """Network outputs at one weight sample drawn with the stateless ``seed``."""
            seeds = iter(tf.unstack(tf.random.experimental.stateless_split(seed, max(num_noise, 1))))
            values = {}
            for sampler in self.samplers:
                values.update(sampler.draw([
                    _random.standard_normal(spec.shape, next(seeds), spec.dtype)
                    for spec in sampler.noise_specs]))
            trainable = [values[k] for k in range(num_trainable)]
            non_trainable = [tf.convert_to_tensor(v) for v in self.non_trainable]
            if generator_states:
                # Layers drawing random numbers at inference (an MC-dropout layer) start from a
                # state derived from the sample's seed: fresh per sample and per request.
                states = tf.random.experimental.stateless_split(
                    tf.random.experimental.stateless_fold_in(seed, _GENERATOR_STREAM),
                    len(generator_states))
                for k, index in enumerate(generator_states):
                    non_trainable[index] = tf.cast(states[k], non_trainable[index].dtype)
            return _losses.single_output(model.stateless_call(
                trainable, non_trainable, inputs, training=False)[0], "tfnng.serving.export")

        def predictive(inputs, seed):
            per_sample = tf.map_fn(lambda s: forward_at_sample(inputs, s),
                                   tf.random.experimental.stateless_split(seed, num_samples),
                                   fn_output_signature=output_spec)
            moments = predictive_moments(per_sample, likelihood)
            moments["samples"] = _batch_major(moments["samples"])
            return {name: moments[key] for name, key in outputs.items()}

        self.seeded = tf.function(
            predictive, input_signature=[input_spec, tf.TensorSpec([2], tf.int64, name="seed")])
        self.serving_default = tf.function(lambda inputs: predictive(inputs, _fresh_seed()),
                                           input_signature=[input_spec])


def _validate_outputs(outputs, likelihood):
    available = CLASSIFICATION_OUTPUTS if likelihood.is_classification else REGRESSION_OUTPUTS
    if isinstance(outputs, str):
        outputs = (outputs,)
    unknown = ["?"] if not isinstance(outputs, (list, tuple)) else [
        name for name in outputs if not isinstance(name, str) or name not in available]
    if not outputs or unknown or len(set(outputs)) != len(outputs):
        kind = "classification" if likelihood.is_classification else "regression"
        raise ValueError(
            f"`outputs` must be distinct names among {sorted(available)} ({kind} with "
            f"{type(likelihood).__name__}); got {outputs!r}.")
    return {name: available[name] for name in outputs}


def _export_directory(path):
    """``path`` as a string, if it names a new or empty directory or a SavedModel to replace:
    TensorFlow would write into the working directory (``""``), a folder named ``None``, or merge
    into an unrelated folder."""
    if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
        raise ValueError(f"tfnng.serving.export: `path` must name a directory; got {path!r}.")
    path = os.fspath(path)
    if os.path.isfile(path) or (os.path.isdir(path) and os.listdir(path) and not os.path.isfile(
            os.path.join(path, "saved_model.pb"))):
        raise ValueError(f"tfnng.serving.export: {path!r} is a file or a folder that holds other "
                         "things than a SavedModel; give a new or empty directory.")
    return path


def _create_directory(path):
    """A clear error where TensorFlow's saver would raise a bare ``NotFoundError``."""
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as error:
        raise ValueError(f"tfnng.serving.export: cannot create the directory {path!r}: "
                         f"{error.strerror or error}.") from None


def export(model, path, num_samples=100, outputs=("mean", "variance", "samples"), likelihood=None):
    """Write a SavedModel of ``model``'s Monte Carlo predictive with in-graph posterior sampling.

    The posterior is copied now (later training does not change the export). The SavedModel has the
    signatures ``serving_default(inputs)`` (fresh samples) and ``seeded(inputs, seed)``
    (reproducible); see the module docstring for the output names and shapes.

    Args:
        model: a trained Keras model with one input tensor of known shape, compiled with a tfnng
            optimizer: the diagonal family, the noisy K-FAC family, SLANG or NoisyNaturalGradient
            (the last three in a ``tfnng.BayesianModel``).
        path: directory to write (for TF Serving: ``<model_base_path>/<version>``): new, empty,
            or an earlier SavedModel to replace.
        num_samples: number S of weight samples per call.
        outputs: names of the signature outputs (module docstring).
        likelihood: a tfnng loss interpreting the outputs; defaults to ``model.loss`` (or its one
            loss: ``loss=[l]``).

    Raises:
        ValueError: bad ``path``, ``num_samples`` or ``outputs``, no likelihood, or an optimizer
            whose posterior cannot be sampled in the graph (not a tfnng optimizer, not built, built for
            none of the model's variables, or a subclass that overrides its family's sampling
            methods).
    """
    path = _export_directory(path)
    likelihood = _likelihood_of(model, likelihood, caller="tfnng.serving.export")
    num_samples = _positive_int("num_samples", num_samples)      # as tfnng.predict
    outputs = _validate_outputs(outputs, likelihood)
    optimizer = _exportable_optimizer(model)
    module = _Predictive(model, optimizer, likelihood, num_samples, outputs, *_tensor_specs(model))
    signatures = {"serving_default": module.serving_default.get_concrete_function(),
                  "seeded": module.seeded.get_concrete_function()}
    _create_directory(path)
    tf.saved_model.save(module, path, signatures=signatures)
