"""Layer registry and capture of layer inputs and pre-activation gradients (tfnng.curvature).

K-FAC needs, for every supported layer, what the averaged gradient cannot give: the layer's input
activations ``a`` and the gradients ``Ds`` of the log-likelihood with respect to its pre-activations
``s = a W + b`` (NNG sec. 2.4, eq. 3). They are captured in the training step with the *zero-tensor*
technique (as in kfac-jax): while the forward pass is recorded by a ``tf.GradientTape``, each
supported layer computes ``activation(s + z)`` with ``z = zeros_like(s)`` watched by the tape; the
gradient of any scalar with respect to ``z`` is then its gradient with respect to ``s``, and it is
obtained from the same forward pass, alongside the weight gradients, at no extra forward cost.

No Keras code is patched globally. :meth:`LayerCapture.recording` installs, *on the instances of
the supported layers only* and only for the duration of one forward pass (normally: while the
training step is being traced), a wrapper of the instance's ``call`` that records its input and a
wrapper of its ``activation`` that adds the watched zero tensor. Both are removed when the last
recording that uses the layer ends, also on error.

Supported layers (:func:`layer_kind`): ``keras.layers.Dense`` (any rank: leading axes beyond the batch
are treated as weight-sharing *positions*, like the spatial positions of a convolution) and
``keras.layers.Conv2D`` (``groups=1``; any padding, strides, dilation, data format), with or without
bias, any activation, not quantized and without LoRA, whose ``call`` is not overridden by a
subclass. Every other layer that owns trainable variables is reported by
:func:`find_layers` as a *fallback* layer: the optimizer gives its variables a diagonal posterior.
"""

import collections
import contextlib
import dataclasses
import threading

import keras
import tensorflow as tf

from tfnng._names import unique_names

DENSE = "dense"
CONV2D = "conv2d"
# Wrappers that call their inner layers several times per forward pass.
_REPEATING_WRAPPERS = (keras.layers.TimeDistributed, keras.layers.RNN)


@dataclasses.dataclass(eq=False)
class LayerSpec:
    """One supported layer: its kind, its variables and the shape of its (homogeneous) weight matrix.

    ``weight_shape`` is ``(p, q)``: ``p`` input features (``kh*kw*c_in`` for Conv2D) plus one for the
    homogeneous coordinate when the layer has a bias, ``q`` outputs. The weight matrix is
    ``W = [reshape(kernel, (p - 1, q)); bias]`` (bias as the last row), or ``reshape(kernel, (p, q))``.
    ``inputs_from``: names of the supported layers whose outputs reach this layer's input without
    passing another supported layer (its predecessors in the forward pass), or None until
    :meth:`LayerCapture.find_links` has traced a forward pass. ``input_from_net`` and
    ``output_to_net``: whether the net's inputs reach this layer's input, and this layer's output
    the net's outputs, by such a path (a skip connection around a layer, or to the output).
    """

    layer: object
    kind: str
    kernel: object
    bias: object
    name: str
    inputs_from: tuple = None
    input_from_net: bool = False
    output_to_net: bool = False

    @property
    def has_bias(self):
        return self.bias is not None

    @property
    def weight_shape(self):
        kernel_shape = tuple(self.kernel.shape)
        rows = 1
        for d in kernel_shape[:-1]:
            rows *= int(d)
        return rows + int(self.has_bias), int(kernel_shape[-1])

    @property
    def variables(self):
        return [v for v in (self.kernel, self.bias) if v is not None]


def layer_kind(layer):
    """``"dense"``, ``"conv2d"`` or ``None`` (not supported by the Kronecker-factored family)."""
    if getattr(layer, "quantization_mode", None) or getattr(layer, "lora_enabled", False):
        return None
    if isinstance(layer, keras.layers.Dense) and type(layer).call is keras.layers.Dense.call:
        kind = DENSE
    elif (isinstance(layer, keras.layers.Conv2D)
          and type(layer).call is keras.layers.Conv2D.call
          # (a subclass standardising its kernel in convolution_op computes with another weight)
          and type(layer).convolution_op is keras.layers.Conv2D.convolution_op
          and getattr(layer, "groups", 1) == 1):
        kind = CONV2D
    else:
        return None
    if not layer.built or not getattr(layer.kernel, "trainable", False):
        return None
    if layer.bias is not None and not layer.bias.trainable:
        return None
    return kind


def _leaf_layers(model):
    """All layers of ``model`` (nested models expanded), in a deterministic order, without repeats."""
    seen, ordered = set(), []
    for layer in model._flatten_layers(include_self=False, recursive=True):
        if id(layer) not in seen:
            seen.add(id(layer))
            ordered.append(layer)
    return ordered


def find_layers(model):
    """Split the layers of ``model`` into supported ones and fallbacks.

    Returns ``(specs, fallback)``: a list of :class:`LayerSpec` (in the order of
    ``model._flatten_layers``: the forward pass for a flat Sequential or functional model, not for
    nested ones, whose layers it lists last first; :meth:`LayerCapture.find_links` gives the
    connectivity) and a list of the other layers owning trainable variables that are not held by a
    sub-layer (their variables will get a diagonal posterior). A Dense or Conv2D layer whose kernel
    or bias another layer also holds (tied weights) is a fallback: its inputs and pre-activation
    gradients would miss the other use of the weight. Only a weight held as an attribute of the
    other layer is seen; one reached through another layer object (``self.encoder.kernel``) is not.
    So is a layer inside ``TimeDistributed`` or a recurrent layer, which call it once per time
    step (a Dense applied to the whole ``(batch, time, features)`` input is supported).
    """
    layers = _leaf_layers(model)
    holders = collections.Counter(id(v) for layer in layers for v in layer._trainable_variables)
    repeated = {id(inner) for layer in layers if isinstance(layer, _REPEATING_WRAPPERS)
                for inner in layer._flatten_layers(include_self=False, recursive=True)}
    supported, fallback = [], []
    for layer in layers:
        kind = None if id(layer) in repeated else layer_kind(layer)
        if kind is not None and any(holders[id(v)] > 1 for v in (layer.kernel, layer.bias)
                                    if v is not None):
            kind = None
        if kind is not None:
            supported.append((layer, kind))
        elif layer._trainable_variables and layer.trainable:
            fallback.append(layer)
    # Named among all layers, so that freezing one does not rename the others (a shared name gets
    # a suffix; an optimizer built before the freeze looks its layers' records up by these names).
    names = dict(zip(map(id, layers), unique_names([getattr(layer, "path", layer.name)
                                                    for layer in layers])))
    specs = [LayerSpec(layer, kind, layer.kernel, layer.bias, names[id(layer)])
             for layer, kind in supported]
    return specs, fallback


@dataclasses.dataclass
class CapturedLayer:
    """What one forward pass recorded for one layer.

    ``inputs``: the layer's input, shape ``(B, ..., c_in)`` (or ``(B, c_in, H, W)`` for a
    channels-first Conv2D). ``zero``: the watched zero tensor added to the pre-activations, shape of
    the layer's pre-activation output. ``preactivation_grads``: per-example gradients of the
    log-likelihood with respect to the pre-activations (set by the model after the backward pass).
    """

    inputs: tf.Tensor
    zero: tf.Tensor
    preactivation_grads: tf.Tensor = None


class _LayerHook:
    """The per-instance wrappers of one layer's ``call`` and ``activation``, installed once while
    any recording (of any :class:`LayerCapture`, in any thread) uses the layer, removed when the
    last one ends. Each call is served by the recording of the calling thread, if it has one
    (thread-local state: two models sharing a layer, or the replicas of a ``tf.distribute``
    strategy, record side by side); calls from other threads pass through."""

    _lock = threading.Lock()
    _installed = {}                    # id(layer) -> [hook, number of recordings using it]

    def __init__(self, layer):
        self.layer = layer
        self.thread = threading.local()    # .recording: (name, tape, records, cut_inputs); .pending
        self.had_call = "call" in layer.__dict__
        self.had_activation = "activation" in layer.__dict__
        self.call = layer.call
        self.activation = getattr(layer, "activation", None)
        object.__setattr__(layer, "call", self._capturing_call)
        object.__setattr__(layer, "activation", self._capturing_activation)

    @classmethod
    def acquire(cls, layer):
        with cls._lock:
            entry = cls._installed.setdefault(id(layer), [None, 0])
            if entry[0] is None:
                entry[0] = cls(layer)
            entry[1] += 1
            return entry[0]

    @classmethod
    def release(cls, layer):
        with cls._lock:
            entry = cls._installed[id(layer)]
            entry[1] -= 1
            if entry[1] == 0:
                del cls._installed[id(layer)]
                entry[0]._uninstall()

    def _uninstall(self):
        for name, had, original in (("call", self.had_call, self.call),
                                    ("activation", self.had_activation, self.activation)):
            if had:
                object.__setattr__(self.layer, name, original)
            else:
                self.layer.__dict__.pop(name, None)

    def _capturing_call(self, inputs, *args, **kwargs):
        recording = getattr(self.thread, "recording", None)
        if recording is None:
            return self.call(inputs, *args, **kwargs)
        name, tape, records, cut_inputs = recording
        if name in records:
            raise ValueError(
                f"Layer {name!r} was called more than once in one forward pass; the curvature "
                "capture of Dense/Conv2D layers (K-FAC factors, per-example gradients) does not "
                "support shared layers.")
        graph = type(tf.compat.v1.get_default_graph()).__name__
        if graph in ("WhileBodyFuncGraph", "WhileCondFuncGraph", "CondBranchFuncGraph"):
            # Its tensors would live in the loop's or branch's graph, out of the step's reach.
            raise ValueError(
                f"Layer {name!r} is called inside a symbolic loop or conditional (keras.ops."
                "fori_loop, while_loop, scan, cond); the curvature capture of Dense/Conv2D layers "
                "(K-FAC factors, per-example gradients) does not support it. Use a diagonal-family "
                "optimizer for such models.")
        sparse = isinstance(inputs, tf.SparseTensor)        # (a Dense takes them: bag of words)
        called = inputs
        if cut_inputs:
            called = (tf.SparseTensor(inputs.indices, tf.stop_gradient(inputs.values),
                                      inputs.dense_shape) if sparse else tf.stop_gradient(inputs))
        self.thread.pending, self.thread.zero = tape, None
        try:
            outputs = self.call(called, *args, **kwargs)
        finally:
            zero, self.thread.pending = self.thread.zero, None
        if zero is None:
            raise RuntimeError(f"Could not capture the pre-activations of layer {name!r}.")
        # The statistics (K-FAC's A, per-example rows) need the input's dense values, in the
        # floating dtype the layer computes with (integer counts or codes: bag of words).
        values = tf.sparse.to_dense(inputs) if sparse else tf.convert_to_tensor(inputs)
        if not values.dtype.is_floating:
            values = tf.cast(values, self.layer.compute_dtype)
        records[name] = CapturedLayer(inputs=values, zero=zero)
        return outputs

    def _capturing_activation(self, pre_activation):
        tape = getattr(self.thread, "pending", None)
        if tape is not None:               # the first activation of a recorded call
            self.thread.pending = None
            zero = tf.zeros_like(pre_activation)
            tape.watch(zero)
            self.thread.zero = zero
            pre_activation = pre_activation + zero
        return pre_activation if self.activation is None else self.activation(pre_activation)


class LayerCapture:
    """Records inputs and pre-activations (via zero tensors) of the supported layers of a model."""

    def __init__(self, model):
        if not model.built:           # its layers have no variables yet: none would be found
            raise ValueError(
                f"LayerCapture needs a built model, {model.name!r} is not: build it first "
                "(`net.build(input_shape)`, or call it on a batch).")
        self.model = model
        self.specs, self.fallback_layers = find_layers(model)
        # Per thread: replicas of a tf.distribute strategy trace their forward passes in their own
        # threads, which take turns at each all-reduce (e.g. a synchronized BatchNormalization).
        self._thread = threading.local()

    @property
    def records(self):
        """This thread's records of its last forward pass (layer name -> CapturedLayer)."""
        return getattr(self._thread, "records", {})

    def find_links(self, inputs):
        """Sets each spec's ``inputs_from`` from one forward pass of ``inputs`` (``training=False``;
        traced inside a ``tf.function``, the pass and the connectivity tests are static and pruned):
        layer i feeds layer j when j's input depends on i's pre-activations by a path that passes
        no other supported layer (whatever the order in which the layers were created or nested;
        a skip connection around a layer feeds the layer after it too). The pass cuts each
        supported layer's input from the gradient, so that only such paths remain. A layer the
        pass does not call (a head used in training only) gets no links. The same paths from the
        net's floating inputs and to its outputs set ``input_from_net`` and ``output_to_net``."""
        inputs = tf.nest.map_structure(
            lambda t: t if isinstance(t, (tf.SparseTensor, tf.RaggedTensor))
            else tf.convert_to_tensor(t), inputs)
        watched = [t for t in tf.nest.flatten(inputs)
                   if isinstance(t, tf.Tensor) and t.dtype.is_floating]
        with tf.GradientTape(persistent=True) as tape:
            tape.watch(watched)
            with self.recording(tape, cut_inputs=True):
                outputs = self.model(inputs, training=False)
        outputs = [t for t in tf.nest.flatten(outputs)
                   if isinstance(t, tf.Tensor) and t.dtype.is_floating]
        records = self.records
        for spec in self.specs:
            spec.inputs_from = () if spec.name not in records else tuple(
                i for i in records if i != spec.name and tape.gradient(
                    records[spec.name].inputs, records[i].zero) is not None)
            if spec.name in records:
                spec.input_from_net = any(
                    g is not None for g in tape.gradient(records[spec.name].inputs, watched))
                spec.output_to_net = tape.gradient(outputs, records[spec.name].zero) is not None

    @contextlib.contextmanager
    def recording(self, tape, cut_inputs=False):
        """Context in which each call of a supported layer is recorded (per-instance wrappers).

        ``tape`` is the ``tf.GradientTape`` recording the forward pass: it watches the zero tensors.
        Each supported layer must be called exactly once inside the context (weight sharing across
        calls is not supported by this capture and raises). Threads record independently: the
        wrappers are installed while any thread records and serve each thread its own tape and
        records; calls from a thread that is not recording pass through. ``cut_inputs``: each
        supported layer computes from a ``tf.stop_gradient`` of its (recorded) input.
        """
        records = self._thread.records = {}
        hooks, previous = [], []
        try:
            for spec in self.specs:
                hook = _LayerHook.acquire(spec.layer)
                hooks.append(hook)
                previous.append(getattr(hook.thread, "recording", None))
                hook.thread.recording = (spec.name, tape, records, cut_inputs)
            yield self
        finally:
            for hook, before in zip(reversed(hooks), reversed(previous)):
                hook.thread.recording = before
                _LayerHook.release(hook.layer)

    def captured(self):
        """The records of the last forward pass, keyed by layer name, in the order of ``specs``."""
        missing = [spec.name for spec in self.specs if spec.name not in self.records]
        if missing:
            raise ValueError(
                f"Layers {missing} were not called in the forward pass. Optimizers that read layer "
                "curvature need every trainable Dense/Conv2D layer in each training step: freeze a "
                "layer the step does not use (`layer.trainable = False`).")
        return {spec.name: self.records[spec.name] for spec in self.specs}
