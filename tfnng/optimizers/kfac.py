"""Noisy K-FAC (NNG-MVG), block-tridiagonal noisy K-FAC (NNG-BlkTri) and plain K-FAC.

Noisy K-FAC — NNG paper sec. 3.4, Alg. 2. For every supported layer l (Dense, Conv2D; see
:mod:`tfnng.curvature.capture`) with homogeneous weight matrix ``W_l`` (bias as last row), the
posterior is the matrix-variate Gaussian

    q(W_l) = MN(M_l, (lambda/N) [A_l^gamma_in]^-1, [S_l^gamma_in]^-1)             (eq. 13)

and each update ``k`` (counted from 0) does, in this order:

1. if ``k % stats_every == 0``: update the EMA factors (eq. 12) with rate ``stat_decay`` (beta~)
   from the layer inputs and pre-activation gradients given by the training step (KFC for Conv2D).
   A batch of B examples gives factors of rank at most B (times a convolution's positions), and in
   every direction the data have not reached the posterior of eq. 13 would be as wide as the prior.
   Alg. 2 leaves the start of the averages open: tfnng starts them, at the first statistics update,
   at the isotropic part ``(tr F / dim) I`` of that update's factor ``F`` (the cross factors of
   block-tridiagonal chains at 0), counted as ``c = factor_prior_count`` batches; the n-th update
   has rate ``max(beta~, 1/(n + c))``, a running average of that prior and the batches seen until it
   reaches beta~ (a shrinkage of the first estimates towards a multiple of the identity, like
   Ledoit & Wolf's). With ``c = 0`` the first batch's factors are used alone (the n-th rate is
   ``max(beta~, 1/n)``);
2. if ``k % inverse_every == 0`` (and, with ``inverse_warmup``, at every statistics update of the
   first ``inverse_every`` updates, so that the first ``T_inv`` steps do not sample from and
   precondition with factors estimated from a single batch — a departure from Alg. 2, which can be
   switched off): recompute the damped inverses from one eigendecomposition per
   factor (:func:`tfnng.posteriors.kronecker.mvg_cache`): ``[A^gamma]^-1``, ``[S^gamma]^-1`` with
   ``gamma = gamma_in + gamma_ex`` for the mean step and ``[A^gamma_in]^-1/2``, ``[S^gamma_in]^-1/2``
   for sampling (Alg. 2 uses gamma_in only for sampling);
3. mean step with ``V_l = G_l + gamma_in W_l`` (``G_l`` the gradient of the mean loss at the sample
   ``W_l``; Alg. 2's ``V_l``, in the paper's ascent form with the batch mean of the log-likelihood
   gradients, is minus that):
   ``m_l <- beta_1 m_l + (1 - beta_1) V_l`` (only with ``momentum = beta_1 > 0``; Alg. 2 has none),
   ``M_l <- M_l - alpha [A^gamma]^-1 (m_l / (1 - beta_1^t)) [S^gamma]^-1``;
4. a fresh sample ``W_l = M_l + sqrt(lambda/N) [A^gamma_in]^-1/2 E_l [S^gamma_in]^-1/2`` is written
   into the model.

The statistics of step 1 and the inverses of step 2 are computed only on their steps (under
``tf.cond``), so the amortised cost of a step is a forward/backward pass plus four small matmuls per
layer. The true Fisher (default) needs a second backward pass, done by the training step only on
statistics steps.

KL-clipped step size (NNG App. C.2, eq. 25-26), when ``kl_clip`` (c_0) is given: with the
preconditioned direction ``v`` of all Kronecker blocks, the squared norm ``v^T F_gamma v`` under the
same damped approximate Fisher is ``sum_l <v_l, m_l>`` and the step size becomes
``min(alpha, sqrt(c_k / v^T F_gamma v))`` with ``c_k = c_0 zeta^j``, ``j`` incremented every
``kl_clip_decay_steps`` updates (every epoch in the paper; ``zeta = kl_clip_decay``).

Layers that the Kronecker family does not support (BatchNormalization, Embedding, ...) keep a
diagonal posterior updated by the noisy Adam rule (Alg. 1) with ``beta_1 = momentum`` and
``beta_2 = 1 - stat_decay``; variables marked as point estimates get the base class's step (Adam,
or the natural-gradient step for natural parameters).

Block-tridiagonal (``block_tridiagonal=True``, NNG sec. 3.5): Dense layers with rank-2 inputs, each
feeding the next in the forward pass (see ``_find_chains``), form chains whose posterior covariance
``(lambda/N) F_hat^-1`` is block tridiagonal (Martens & Grosse 2015 sec. 4.3; derivation in
:mod:`tfnng.posteriors.kronecker`). The chain's
cross factors ``E[a_l a_l+1^T]``, ``E[Ds_l Ds_l+1^T]`` are EMAs like eq. (12); off-diagonal blocks are
not damped. Other layers keep the MVG posterior.
"""

import logging
import math

import keras
import tensorflow as tf
import tensorflow_probability as tfp

from tfnng import curvature as _curvature
from tfnng._names import layer_paths, unique_names
from tfnng._xla import compiled_with_xla
from tfnng.curvature import kronecker as _factors
from tfnng.optimizers.base import (CurvatureConsumer, NoisyOptimizer, _boolean, _non_negative,
                                   _positive, _positive_int, _probability, _unit_rate)
from tfnng.optimizers.diagonal import noisy_adam_step
from tfnng.posteriors import diagonal as _diagonal
from tfnng.posteriors import kronecker as _kron

tfd = tfp.distributions
_logger = logging.getLogger("tfnng")


def _register(cls):
    return keras.saving.register_keras_serializable(package="tfnng")(cls)


def _input_rank(layer):
    """Rank of a built layer's input: from its graph node (Sequential, functional) or, in a
    subclassed model, from the shape it was built with."""
    try:
        return len(layer.input.shape)
    except (AttributeError, ValueError):
        shape = (layer.get_build_config() or {}).get("input_shape")
        return None if shape is None else len(shape)


def _eye_initializer(value):
    return lambda shape, dtype: tf.eye(shape[0], dtype=dtype) * tf.constant(value, dtype)


def _fill_initializer(value):
    return lambda shape, dtype: tf.fill(shape, tf.constant(value, dtype))


class _Block:
    """Book-keeping of one Kronecker-factored layer inside the optimizer (plain Python object)."""

    def __init__(self, spec, kernel_index, bias_index):
        self.spec = spec
        self.kernel_index = kernel_index
        self.bias_index = bias_index
        self.p, self.q = spec.weight_shape
        self.chain = None          # (chain id, position) for block-tridiagonal chains
        self.state = {}


@_register
class NoisyKFAC(CurvatureConsumer, NoisyOptimizer):
    """Noisy K-FAC: matrix-variate Gaussian posteriors per layer (NNG Alg. 2, eq. 12-13).

    Use with :class:`tfnng.BayesianModel`, which provides the layer inputs and pre-activation
    gradients (see :mod:`tfnng.models` for the protocol)::

        model = tfnng.BayesianModel(net)
        model.compile(optimizer=tfnng.optimizers.NoisyKFAC(learning_rate=1e-3, num_examples=N),
                      loss=tfnng.losses.CategoricalNLL())

    Args:
        learning_rate: alpha (float or schedule); with ``kl_clip`` the maximum step size.
        num_examples: N. Required.
        stat_decay: beta~ of the factor EMAs (eq. 12). NNG App. C.2 uses 0.01, App. C.1 0.001.
        momentum: beta_1 of the momentum of ``V`` (0: none, as in Alg. 2).
        extrinsic_damping: gamma_ex, added to gamma_in for the mean step only. Default 1e-3:
            with gamma_in = lambda / (N eta) alone (1.7e-5 for N = 60000) the step amplifies
            poorly estimated directions up to 1/gamma_in times: with the factors of the first
            batch alone (``factor_prior_count=0``) and learning rate 1e-3, an MNIST-sized MLP
            diverged within 25 steps, and so did a 100-64-64-10 MLP with gamma_ex 0 or 1e-4
            (``tests/test_bayesian_model.py``; docs/kfac.md, "Default damping").
        stats_every: T_stats, factor update interval in updates.
        inverse_every: T_inv, inverse update interval in updates.
        fisher: ``"true"`` (targets sampled from the model's predictive, NNG footnote 1) or
            ``"empirical"`` (observed targets).
        block_tridiagonal: NNG-BlkTri for chains of Dense layers (sec. 3.5).
        kl_clip: c_0 of the KL-clipped step size (App. C.2, eq. 26); None disables it.
        kl_clip_decay: zeta of ``c_k = c_0 zeta^j``, in (0, 1] (with ``kl_clip`` only).
        kl_clip_decay_steps: updates between increments of j (default: never; with ``kl_clip``
            only).
        inverse_warmup: also refresh the inverses at every statistics update during the first
            ``inverse_every`` updates (default True; False follows Alg. 2 literally).
        factor_prior_count: weight, in batches, of the isotropic start of the factor averages
            (step 1 above; >= 0, default 4). With 0 the speed benchmark's CNN (N = 60000, learning
            rate 1e-3) diverged within 6 steps unless the step was KL-clipped
            (``tests/test_bayesian_model.py``).
        hess_init: initial f of the diagonal fallback's noisy Adam rule (> 0, default 1, as
            :class:`~tfnng.optimizers.NoisyAdam`'s): from f = 0 a BatchNormalization scale's first
            steps were 100-150 times the learning rate (N = 60000), unbounded by ``kl_clip``.

    See :class:`~tfnng.optimizers.base.NoisyOptimizer` for ``prior_variance``, ``kl_weight``,
    ``seed`` and ``mc_samples``: with ``mc_samples = S`` the gradient and the sample in ``V``
    are averaged over S evaluations, one mean step follows; every evaluation's statistics enter
    the factor averages, and a due inverse update waits for the last evaluation of the group.
    """

    _noisy = True
    _joint_over_layers = True
    _sample_statistic_names = ("grad", "weight")

    def __init__(self, learning_rate=1e-3, num_examples=None, stat_decay=0.01, momentum=0.0,
                 extrinsic_damping=1e-3, stats_every=10, inverse_every=200, fisher="true",
                 block_tridiagonal=False, kl_clip=None, kl_clip_decay=1.0, kl_clip_decay_steps=None,
                 inverse_warmup=True, factor_prior_count=4, hess_init=1.0, name="noisy_kfac", **kwargs):
        super().__init__(learning_rate=learning_rate, num_examples=num_examples, name=name, **kwargs)
        self.stat_decay = _unit_rate("stat_decay", stat_decay)
        self.momentum = _probability("momentum", momentum)
        self.extrinsic_damping = _non_negative("extrinsic_damping", extrinsic_damping)
        self.stats_every = _positive_int("stats_every", stats_every)
        self.inverse_every = _positive_int("inverse_every", inverse_every)
        self.fisher = _curvature.Requirements(kronecker=True, fisher=fisher).fisher
        self.block_tridiagonal = _boolean("block_tridiagonal", block_tridiagonal)
        self.kl_clip = None if kl_clip is None else _positive("kl_clip", kl_clip)
        self.kl_clip_decay = _unit_rate("kl_clip_decay", kl_clip_decay)
        self.kl_clip_decay_steps = (None if kl_clip_decay_steps is None
                                    else _positive_int("kl_clip_decay_steps", kl_clip_decay_steps))
        if self.kl_clip is None and (self.kl_clip_decay != 1.0 or kl_clip_decay_steps is not None):
            raise ValueError("`kl_clip_decay` and `kl_clip_decay_steps` decay the KL clip: they "
                             "need `kl_clip`.")
        self.inverse_warmup = _boolean("inverse_warmup", inverse_warmup)
        self.factor_prior_count = _non_negative("factor_prior_count", factor_prior_count)
        self.hess_init = _positive("hess_init", hess_init)

    # ------------------------------------------------------------------------ curvature protocol
    @property
    def curvature_requirements(self):
        """What the training step must provide (:class:`tfnng.curvature.Requirements`)."""
        return _curvature.Requirements(kronecker=True, fisher=self.fisher,
                                       layer_links=self.block_tridiagonal)

    def curvature_due(self):
        """Whether the next ``apply_gradients`` consumes curvature statistics (bool tensor)."""
        if not self.built:
            return tf.constant(True)
        return tf.equal(self._updates_done() % self.stats_every, 0)

    # -------------------------------------------------------------------------------- damping
    @property
    def sampling_damping(self):
        """gamma_in: the damping of the sampling covariance (Alg. 2)."""
        return self.intrinsic_damping

    @property
    def step_damping(self):
        """gamma_in + gamma_ex: the damping of the mean step (Alg. 2)."""
        return self.intrinsic_damping + self.extrinsic_damping

    @property
    def weight_decay_coefficient(self):
        """Coefficient of ``W`` in ``V = G + c W`` (gamma_in: the prior's gradient)."""
        return self.intrinsic_damping

    @property
    def noise_scale(self):
        """sqrt(lambda / N) of eq. (13)."""
        return math.sqrt(self.kl_weight / self.num_examples) if self._noisy else 0.0

    @property
    def kl_clip_threshold(self):
        """``c_k = c_0 zeta^j`` of the KL-clipped step size (App. C.2, eq. 26) for the next update,
        ``j = update_count // kl_clip_decay_steps`` (float64 tensor); None without ``kl_clip``."""
        if self.kl_clip is None:
            return None
        exponent = (tf.constant(0.0, tf.float64) if self.kl_clip_decay_steps is None or not self.built
                    else tf.cast(self._update_count // self.kl_clip_decay_steps, tf.float64))
        return self.kl_clip * tf.pow(tf.constant(self.kl_clip_decay, tf.float64), exponent)

    # ---------------------------------------------------------------------------------- state
    def build(self, variables):
        if self.built:
            return
        self._require_layer_specs()
        super().build(variables)

    def _build_family_state(self, variables):
        self._blocks = []
        taken = set()
        for spec, k, b in self._trained_layer_specs():
            if self._point[k] or (b is not None and self._point[b]):
                continue
            self._blocks.append(_Block(spec, k, b))
            taken.update(i for i in (k, b) if i is not None)
        self._fallback = [i for i in range(len(variables)) if i not in taken and not self._point[i]]
        self._chains = self._find_chains() if self.block_tridiagonal else []
        for n, block in enumerate(self._blocks):
            self._build_block_state(n, block, variables[block.kernel_index].dtype)
        for c, chain in enumerate(self._chains):
            self._build_chain_state(c, chain, variables[chain[0].kernel_index].dtype)
        # Lists aligned with the variables (None off the fallback): tf.train.Checkpoint cannot
        # save dicts with integer keys.
        self._diag_momentum, self._diag_fisher = (
            [self.add_variable_from_reference(v, name, initializer) if i in self._fallback else None
             for i, v in enumerate(variables)]
            for name, initializer in (("diag_momentum", "zeros"),
                                      ("diag_fisher", _fill_initializer(self.hess_init))))
        self._stats_count = self.add_variable((), initializer="zeros", dtype="int64",
                                              name="stats_count")
        self._inverse_failures = self.add_variable((), initializer="zeros", dtype="int64",
                                                   name="inverse_failures")
        if self._fallback:
            names = layer_paths(variables[i] for i in self._fallback)
            kind = ("a diagonal (noisy Adam) posterior" if self._noisy
                    else "a diagonal (Adam-like, no square root) preconditioner")
            _logger.warning("%s: no Kronecker-factored curvature for %s; their weights get %s.",
                            type(self).__name__, ", ".join(names), kind)

    def _find_chains(self):
        """Block-tridiagonal chains: maximal paths of Dense blocks with rank-2 inputs in which each
        block's output reaches the next block, and only it (not the net's output), and that
        block's input comes from it alone (not from the net's input; ``LayerSpec.inputs_from``,
        ``output_to_net``, ``input_from_net``, found from the forward pass). Layers without a
        Kronecker block in between (activations, normalisation, dropout, frozen layers) do not
        break a chain; a branch, a merge, a layer with a block of another kind, or a change of the
        kernels' dtype (the chain's state has one) does."""
        unknown = [block.spec.name for block in self._blocks if block.spec.inputs_from is None]
        if unknown:
            raise ValueError(
                f"{type(self).__name__}(block_tridiagonal=True) needs to know which layers feed "
                f"which, unknown for {unknown}. tfnng.BayesianModel finds it from the net's build "
                "shape or its first training batch; in a hand-written loop call "
                "`capture.find_links(x)` before `optimizer.build`.")
        dense = {block.spec.name: block for block in self._blocks
                 if block.spec.kind == "dense" and _input_rank(block.spec.layer) == 2}
        following = {}
        for name in dense:
            fed = [block for block in self._blocks if name in block.spec.inputs_from]
            if (len(fed) == 1 and fed[0].spec.name in dense and fed[0].spec.inputs_from == (name,)
                    and not fed[0].spec.input_from_net and not dense[name].spec.output_to_net
                    and fed[0].spec.layer.kernel.dtype == dense[name].spec.layer.kernel.dtype):
                following[name] = fed[0]
        followers = {id(block) for block in following.values()}
        chains = []
        for name, block in dense.items():
            if name in following and id(block) not in followers:     # the head of a chain
                chain = [block]
                while chain[-1].spec.name in following:
                    chain.append(following[chain[-1].spec.name])
                chains.append(chain)
        for c, chain in enumerate(chains):
            for position, block in enumerate(chain):
                block.chain = (c, position)
        return chains

    def _var(self, shape, name, dtype, initializer="zeros"):
        return self.add_variable(tuple(int(d) for d in shape), initializer=initializer, dtype=dtype,
                                 name=name)

    def _build_block_state(self, n, block, dtype):
        p, q = block.p, block.q
        prefix = f"kfac_{n}"
        gin, gall = self.sampling_damping, self.step_damping
        st = block.state
        st["a"] = self._var((p, p), f"{prefix}_a", dtype)
        st["s"] = self._var((q, q), f"{prefix}_s", dtype)
        if self.momentum > 0:
            st["momentum"] = self._var((p, q), f"{prefix}_momentum", dtype)
        if block.chain is not None:
            return
        # Inverses before the first inverse update: the factors are zero, pi = 1.
        st["a_inv"] = self._var((p, p), f"{prefix}_a_inv", dtype, _eye_initializer(gall ** -0.5))
        st["s_inv"] = self._var((q, q), f"{prefix}_s_inv", dtype, _eye_initializer(gall ** -0.5))
        if self._noisy:
            root = gin ** -0.25
            st["a_root"] = self._var((p, p), f"{prefix}_a_root", dtype, _eye_initializer(root))
            st["s_root"] = self._var((q, q), f"{prefix}_s_root", dtype, _eye_initializer(root))
            st["kl_offset"] = self._var((), f"{prefix}_kl_offset", "float64")

    def _build_chain_state(self, c, chain, dtype):
        for position, block in enumerate(chain[:-1]):
            nxt = chain[position + 1]
            block.state["a_off"] = self._var((block.p, nxt.p), f"chain_{c}_{position}_a_off", dtype)
            block.state["s_off"] = self._var((block.q, nxt.q), f"chain_{c}_{position}_s_off", dtype)
        kinds = [("step", self.step_damping)] + ([("sample", self.sampling_damping)]
                                                 if self._noisy else [])
        for kind, gamma in kinds:
            for position, block in enumerate(chain):
                prefix = f"chain_{c}_{position}_{kind}"
                p, q = block.p, block.q
                last = position == len(chain) - 1
                cache = {
                    "k_a": self._var((p, p), f"{prefix}_k_a", dtype, _eye_initializer(gamma ** -0.25)),
                    "k_s": self._var((q, q), f"{prefix}_k_s", dtype, _eye_initializer(gamma ** -0.25)),
                    "d": self._var((p, q), f"{prefix}_d", dtype, _fill_initializer(1.0)),
                }
                if not last:
                    nxt = chain[position + 1]
                    cache["psi_a"] = self._var((p, nxt.p), f"{prefix}_psi_a", dtype)
                    cache["psi_s"] = self._var((q, nxt.q), f"{prefix}_psi_s", dtype)
                block.state[kind] = cache
        if self._noisy:
            chain[0].state["kl_offset"] = self._var((), f"chain_{c}_kl_offset", "float64")

    # --------------------------------------------------------------------- weight matrices
    def _to_matrix(self, block, kernel, bias):
        """Homogeneous ``(p, q)`` matrix from kernel (any shape) and bias."""
        w = tf.reshape(kernel, [-1, block.q])
        if bias is not None:
            w = tf.concat([w, tf.reshape(bias, [1, block.q])], axis=0)
        return w

    def _from_matrix(self, block, w):
        kernel_shape = self._trainable_variables[block.kernel_index].shape
        if block.bias_index is None:
            return tf.reshape(w, kernel_shape), None
        return tf.reshape(w[:-1], kernel_shape), w[-1]

    def _mean_matrix(self, block):
        bias = None if block.bias_index is None else self._means[block.bias_index]
        return self._to_matrix(block, self._means[block.kernel_index], bias)

    # ------------------------------------------------------------------------------- update
    def _backend_update_step(self, grads, trainable_variables, learning_rate):
        finite, apply_now = self._step_flags
        by_index = {self._get_variable_index(v): (g, v) for g, v in zip(grads, trainable_variables)}
        step = self._update_count
        if self._blocks:
            captured = self._received_curvature()
            self._warn_if_eigh_under_xla_on_cpu()
            stats_due = finite & tf.equal(step % self.stats_every, 0)
            tf.cond(stats_due, lambda: self._update_factors(captured), lambda: tf.constant(False))
            inverse_due = tf.equal(step % self.inverse_every, 0)
            if self.inverse_warmup:
                inverse_due |= (step < self.inverse_every) & tf.equal(step % self.stats_every, 0)
            # At the last evaluation of an mc_samples group; in the first group at every one, so
            # that its later evaluations are not drawn from the initial cache (the prior).
            inverse_due &= apply_now | tf.equal(step, 0)
            tf.cond(inverse_due, self._update_inverses, lambda: tf.constant(False))
        active = [b for b in self._blocks if by_index.keys() & {b.kernel_index, b.bias_index}]
        self._refuse_frozen([i for b in active for i in (b.kernel_index, b.bias_index)
                             if i is not None],
                            "a Kronecker block's posterior covers its layer's kernel and bias "
                            "together; freeze the whole layer")
        stats = self._block_statistics(active, by_index)
        if self.mc_samples > 1:
            stats = {i: self._accumulate(i, s, finite, apply_now) for i, s in stats.items()}

        def update_means():
            self._kronecker_mean_step(active, stats, learning_rate)
            return tf.constant(True)

        if active:
            tf.cond(apply_now, update_means, lambda: tf.constant(False))
            self._draw_blocks(active)
        # Diagonal fallback and point estimates: the base class's per-variable step.
        for index, (gradient, variable) in by_index.items():
            if any(index in (b.kernel_index, b.bias_index) for b in active):
                continue
            self.update_step(gradient, variable, learning_rate)

    def _update_factors(self, captured):
        decay = tf.maximum(tf.constant(self.stat_decay, tf.float64),
                           1.0 / (tf.cast(self._stats_count + 1, tf.float64)
                                  + self.factor_prior_count))
        first = tf.equal(self._stats_count, 0)

        def start(average, value):
            """The average before this update: the isotropic prior at the first one (step 1)."""
            if self.factor_prior_count == 0:     # rate 1 at the first update: the start is unused
                return average
            return tf.cond(first, lambda: _factors.isotropic_part(value),
                           lambda: tf.convert_to_tensor(average))
        new = {}
        for block in self._blocks:
            record = captured[block.spec.name]
            new[id(block)] = _factors.factors(block.spec, record.inputs, record.preactivation_grads)
        cross = {}
        for chain in self._chains:
            for block, nxt in zip(chain[:-1], chain[1:]):
                r1, r2 = captured[block.spec.name], captured[nxt.spec.name]
                cross[id(block)] = _factors.cross_factors(
                    block.spec, r1.inputs, r1.preactivation_grads,
                    nxt.spec, r2.inputs, r2.preactivation_grads)
        values = [t for pair in list(new.values()) + list(cross.values()) for t in pair]
        ok = tf.reduce_all([tf.reduce_all(tf.math.is_finite(t)) for t in values])

        def assign():
            for block in self._blocks:
                a_new, s_new = new[id(block)]
                w = tf.cast(decay, a_new.dtype)
                for key, value in (("a", a_new), ("s", s_new)):
                    block.state[key].assign((1 - w) * start(block.state[key], value) + w * value)
                if id(block) in cross:
                    a_off, s_off = cross[id(block)]
                    block.state["a_off"].assign((1 - w) * block.state["a_off"] + w * a_off)
                    block.state["s_off"].assign((1 - w) * block.state["s_off"] + w * s_off)
            self._stats_count.assign_add(1)
            return tf.constant(True)

        return tf.cond(ok, assign, lambda: tf.constant(False))

    def _update_inverses(self):
        """Recompute the cached inverses (eq. 13); a failed factorisation keeps the old ones."""
        for block in self._blocks:
            if block.chain is not None:
                continue
            st = block.state
            cache = _kron.mvg_cache(st["a"], st["s"], self.sampling_damping, self.step_damping)

            def assign(st=st, cache=cache):
                dtype = st["a"].dtype
                st["a_inv"].assign(tf.cast(cache["a_inv"], dtype))
                st["s_inv"].assign(tf.cast(cache["s_inv"], dtype))
                if self._noisy:
                    st["a_root"].assign(tf.cast(cache["a_root"], dtype))
                    st["s_root"].assign(tf.cast(cache["s_root"], dtype))
                    st["kl_offset"].assign(_kron.mvg_kl_to_isotropic_prior(
                        tf.zeros([1, 1], tf.float64), cache["a_values"], cache["s_values"],
                        self.noise_scale, self.prior_variance))
                return tf.constant(True)

            self._assign_or_count_failure(cache["ok"], assign)
        for chain in self._chains:
            self._update_chain_inverses(chain)
        return tf.constant(True)

    def _adopt_settings(self, saved):
        """The cached inverses, roots and KL constants hold the saved settings' dampings and noise
        scale (eq. 13): recomputed from the loaded factors with this optimizer's when those differ
        (KFAC's from ``damping`` and ``l2``)."""
        current = self._settings()
        if any(saved.get(key) != current.get(key) for key in (
                "kl_weight", "num_examples", "prior_variance", "extrinsic_damping", "damping", "l2")):
            self._update_inverses()

    def _warn_if_eigh_under_xla_on_cpu(self):
        """The inverse updates factorise with ``tf.linalg.eigh``. XLA's CPU eigensolver is about 80
        times slower than LAPACK's (13 s against 0.17 s for a 785 x 785 float64 factor, measured on
        the 2-core benchmark machine), so each inverse update of a step compiled with XLA stalls."""
        if compiled_with_xla() and not tf.config.list_logical_devices("GPU"):
            _logger.warning(
                "%s: this step is compiled with XLA on the CPU, where tf.linalg.eigh is about 80x "
                "slower than without XLA (seconds per inverse update for factors of a few hundred "
                "rows); compile the model with jit_compile=False for K-FAC on the CPU.",
                type(self).__name__)

    def _assign_or_count_failure(self, ok, assign):
        def failed():
            self._inverse_failures.assign_add(1)
            return tf.constant(False)
        tf.cond(ok, assign, failed)

    def _update_chain_inverses(self, chain):
        a_diag = [b.state["a"] for b in chain]
        s_diag = [b.state["s"] for b in chain]
        a_off = [b.state["a_off"] for b in chain[:-1]]
        s_off = [b.state["s_off"] for b in chain[:-1]]
        kinds = [("step", self.step_damping)] + ([("sample", self.sampling_damping)]
                                                 if self._noisy else [])
        for kind, gamma in kinds:
            blocks, ok = _kron.blktri_cache(a_diag, s_diag, a_off, s_off, gamma)

            def assign(kind=kind, blocks=blocks):
                for block, cache in zip(chain, blocks):
                    for key, value in cache.items():
                        block.state[kind][key].assign(tf.cast(value, block.state[kind][key].dtype))
                if kind == "sample":
                    zero_means = [tf.zeros([b.p, b.q], tf.float64) for b in chain]
                    chain[0].state["kl_offset"].assign(_kron.blktri_kl_to_isotropic_prior(
                        zero_means, blocks, self.noise_scale, self.prior_variance))
                return tf.constant(True)

            self._assign_or_count_failure(ok, assign)

    def _chain_cache(self, chain, kind):
        return [{key: tf.convert_to_tensor(v) for key, v in b.state[kind].items()} for b in chain]

    def _block_statistics(self, blocks, by_index):
        """Gradient and sample of each block variable (``{index: {"grad", "weight"}}``; a kernel
        or bias without a gradient gets zeros)."""
        stats = {}
        for block in blocks:
            for index in (block.kernel_index, block.bias_index):
                if index is None:
                    continue
                sample = tf.convert_to_tensor(self._trainable_variables[index])
                gradient = by_index.get(index, (None, None))[0]
                gradient = tf.zeros_like(sample) if gradient is None else tf.cast(gradient, sample.dtype)
                stats[index] = {"grad": gradient, "weight": sample}
        return stats

    def _kronecker_mean_step(self, blocks, stats, learning_rate):
        """The mean step of Alg. 2 from the blocks' (Monte Carlo averaged) loss gradients G and
        samples W: ``V = G + c W`` (c = ``weight_decay_coefficient``), ``M <- M - lr A^-1 V S^-1``
        with the step-damped factors (eq. 13; block-tridiagonal for chains)."""
        directions, moments = {}, {}
        t = None
        for block in blocks:
            def matrix(name):
                bias = None if block.bias_index is None else stats[block.bias_index][name]
                return self._to_matrix(block, stats[block.kernel_index][name], bias)

            g, w = matrix("grad"), matrix("weight")
            dtype = w.dtype
            v = g + self.weight_decay_coefficient * w
            if self.momentum > 0:
                t = self._step_number(dtype)
                m = block.state["momentum"]
                m.assign(self.momentum * m + (1 - self.momentum) * v)
                v = m / (1 - self.momentum ** t)
            moments[id(block)] = v
        for block in blocks:
            if block.chain is None:
                st = block.state
                directions[id(block)] = _kron.mvg_precondition(st["a_inv"], st["s_inv"],
                                                               moments[id(block)])
        for chain in self._chains:
            members = [b for b in chain if id(b) in moments]
            if len(members) != len(chain):
                raise ValueError("Every layer of a block-tridiagonal chain needs a gradient.")
            out = _kron.blktri_precondition(self._chain_cache(chain, "step"),
                                            [moments[id(b)] for b in chain])
            directions.update({id(b): d for b, d in zip(chain, out)})
        # The step size in float64: a float32 alpha = 0.1 is off by 1.5e-8, which a float64 model sees.
        lr = tf.cast(learning_rate, tf.float64)
        if self.kl_clip is not None:
            fisher_norm = tf.add_n([tf.cast(tf.reduce_sum(directions[id(b)] * moments[id(b)]),
                                            tf.float64) for b in blocks])
            c = self.kl_clip_threshold
            lr = tf.minimum(lr, tf.sqrt(c / tf.maximum(fisher_norm, 1e-30)))
        for block in blocks:
            mean = self._mean_matrix(block)
            new_mean = mean - tf.cast(lr, mean.dtype) * directions[id(block)]
            kernel_mean, bias_mean = self._from_matrix(block, new_mean)
            self._means[block.kernel_index].assign(kernel_mean)
            if block.bias_index is not None:
                self._means[block.bias_index].assign(bias_mean)

    def _sample_blocks(self, blocks):
        """Fresh weight matrices (mean + noise) of ``blocks``: a dict id(block) -> (p, q) tensor."""
        out = {}
        scale = self.noise_scale
        for block in blocks:
            mean = self._mean_matrix(block)
            if not self._noisy:
                out[id(block)] = tf.convert_to_tensor(mean)
            elif block.chain is None:
                noise = self._standard_normal((block.p, block.q), mean.dtype)
                out[id(block)] = _kron.mvg_sample(mean, block.state["a_root"],
                                                  block.state["s_root"], noise, scale)
        if self._noisy:
            for chain in self._chains:
                if not any(id(b) in {id(x) for x in blocks} for b in chain):
                    continue
                noise = [self._standard_normal((b.p, b.q), b.state["a"].dtype) for b in chain]
                draws = _kron.blktri_sample_noise(self._chain_cache(chain, "sample"), noise)
                for b, d in zip(chain, draws):
                    out[id(b)] = self._mean_matrix(b) + scale * d
        return out

    def _draw_blocks(self, blocks):
        samples = self._sample_blocks(blocks)
        for block in blocks:
            kernel, bias = self._from_matrix(block, samples[id(block)])
            self._trainable_variables[block.kernel_index].assign(kernel)
            if block.bias_index is not None:
                self._trainable_variables[block.bias_index].assign(bias)

    # ------------------------------------------------------------- diagonal fallback (Alg. 1)
    def _sample_statistics(self, index, gradient, sample):
        return {"grad": gradient, "weight": sample}

    def _variance(self, index):
        block, row = self._block_of(index)
        if block is not None:
            var = self._block_marginal_variances(block)
            if row == "bias":
                var = var[-1]
            elif block.bias_index is not None:
                var = var[:-1]
            return tf.reshape(var, self._trainable_variables[index].shape)
        if not self._noisy:
            return tf.zeros_like(self._means[index])
        return self._sampling_variance(self._diag_fisher[index], self.sampling_damping)

    def _update_posterior(self, index, stats, lr):
        noisy_adam_step(self._means[index], self._diag_momentum[index], self._diag_fisher[index],
                        stats["grad"], stats["weight"], tf.square(stats["grad"]), lr,
                        self._step_number(lr.dtype),
                        self.momentum, 1.0 - self.stat_decay, prior=self.weight_decay_coefficient,
                        damping=self.step_damping)

    def _draw(self, index):
        if not self._noisy:
            return tf.convert_to_tensor(self._means[index])
        return super()._draw(index)

    # -------------------------------------------------------------------------- posterior access
    def _block_of(self, index):
        for block in self._blocks:
            if index == block.kernel_index:
                return block, "kernel"
            if index == block.bias_index:
                return block, "bias"
        return None, None

    def _block_marginal_variances(self, block):
        if not self._noisy:
            return tf.zeros([block.p, block.q], self._means[block.kernel_index].dtype)
        if block.chain is None:
            return _kron.mvg_marginal_variances(block.state["a_root"], block.state["s_root"],
                                                self.noise_scale)
        chain = self._chains[block.chain[0]]
        variances = _kron.blktri_marginal_variances(self._chain_cache(chain, "sample"),
                                                    self.noise_scale)
        return variances[block.chain[1]]

    def layer_posterior(self, layer):
        """The posterior of a Kronecker-factored layer's homogeneous weight matrix ``[kernel; bias]``.

        Returns a dict with ``mean`` ``(p, q)``, ``marginal_variance`` ``(p, q)`` and, for MVG
        layers (not in a block-tridiagonal chain), the two covariance factors ``sigma_1``
        (``(lambda/N) [A^gamma_in]^-1``, ``p x p``) and ``sigma_2`` (``[S^gamma_in]^-1``, ``q x q``)
        and ``covariance``, a ``tf.linalg.LinearOperatorKronecker`` acting on the row-major
        flattening of the matrix (the paper's ``Sigma_2 (x) Sigma_1`` on ``vec``).
        """
        self._require_built()
        for block in self._blocks:
            if block.spec.layer is layer:
                out = {"mean": self._mean_matrix(block),
                       "marginal_variance": self._block_marginal_variances(block)}
                if block.chain is None and self._noisy:
                    a_root, s_root = block.state["a_root"], block.state["s_root"]
                    out["sigma_1"] = self.noise_scale ** 2 * tf.matmul(a_root, a_root)
                    out["sigma_2"] = tf.matmul(s_root, s_root)
                    out["covariance"] = _kron.mvg_covariance_operator(
                        tf.convert_to_tensor(a_root), tf.convert_to_tensor(s_root), self.noise_scale)
                return out
        raise ValueError(f"{layer!r} has no Kronecker-factored posterior in this optimizer.")

    def posterior(self):
        """The posterior as a ``tfd.JointDistributionNamed``.

        MVG layers: a ``tfd.MultivariateNormalLinearOperator`` over the row-major flattening of the
        homogeneous weight matrix (key: the layer's path), with a Kronecker-factored scale. Diagonal
        fallback variables: independent Normals (key: the variable's path; a repeated key gets a
        suffix ``_1``, ``_2``...). Block-tridiagonal chains have no such compact form: use
        :meth:`layer_posterior` or samples.
        """
        self._require_built()
        if not self._noisy:
            raise ValueError(f"{type(self).__name__} is a point estimate: it has no posterior "
                             "distribution (use posterior_mean, or NoisyKFAC for one).")
        if self._chains:
            raise NotImplementedError("posterior() is not available for block-tridiagonal chains.")
        parts = []
        for block in self._blocks:
            mean = self._mean_matrix(block)
            parts.append(tfd.MultivariateNormalLinearOperator(
                loc=tf.reshape(mean, [-1]),
                scale=_kron.mvg_scale_operator(tf.convert_to_tensor(block.state["a_root"]),
                                               tf.convert_to_tensor(block.state["s_root"]),
                                               self.noise_scale)))
        for i in self._fallback:
            mean = tf.convert_to_tensor(self._means[i])
            parts.append(tfd.Independent(tfd.Normal(mean, self._stddev(i)),
                                         reinterpreted_batch_ndims=len(mean.shape)))
        names = unique_names([block.spec.name for block in self._blocks]
                             + [self._trainable_variables[i].path for i in self._fallback])
        return tfd.JointDistributionNamed(dict(zip(names, parts)))

    def kl_divergence(self):
        """KL(q || p) to the prior N(0, eta I) in closed form (float64 scalar): MVG blocks (eq. 13
        vs spherical Gaussian), block-tridiagonal chains and the diagonal fallback."""
        self._require_built()
        if not self._noisy:
            return tf.constant(0.0, tf.float64)
        eta = tf.constant(self.prior_variance, tf.float64)
        total = tf.constant(0.0, tf.float64)
        for block in self._blocks:
            squared = tf.reduce_sum(tf.square(tf.cast(self._mean_matrix(block), tf.float64)))
            total += 0.5 * squared / eta
            if "kl_offset" in block.state:
                total += block.state["kl_offset"]
        if self._fallback:
            total += _diagonal.kl_to_isotropic_prior(
                [self._means[i] for i in self._fallback], [self._variance(i) for i in self._fallback],
                self.prior_variance)
        return total

    def _write_sample(self):
        self._draw_blocks(self._blocks)
        for i in self._fallback:
            self._trainable_variables[i].assign(self._draw(i))

    @property
    def inverse_failures(self):
        """Number of factorisations that failed even after raising the damping."""
        return int(self._inverse_failures.numpy()) if self.built else 0

    def get_config(self):
        return {**super().get_config(), "stat_decay": self.stat_decay, "momentum": self.momentum,
                "extrinsic_damping": self.extrinsic_damping, "stats_every": self.stats_every,
                "inverse_every": self.inverse_every, "fisher": self.fisher,
                "block_tridiagonal": self.block_tridiagonal, "kl_clip": self.kl_clip,
                "kl_clip_decay": self.kl_clip_decay, "kl_clip_decay_steps": self.kl_clip_decay_steps,
                "inverse_warmup": self.inverse_warmup,
                "factor_prior_count": self.factor_prior_count, "hess_init": self.hess_init}


@_register
class KFAC(NoisyKFAC):
    """Plain K-FAC (Martens & Grosse 2015; Grosse & Martens 2016 for Conv2D): no weight noise.

    The same machinery as :class:`NoisyKFAC` with the model's variables holding the mean:
    ``M <- M - alpha [A^gamma]^-1 (G + c M) [S^gamma]^-1`` with ``c = l2`` (an optional L2 penalty
    on the mean loss, which also enters the damping, ``gamma = damping + l2``, as the prior does in
    noisy K-FAC), factored damping as eq. (13).

    Args:
        learning_rate: step size.
        damping: gamma (> 0 unless ``l2 > 0``).
        l2: coefficient of the L2 penalty ``(l2 / 2) |W|^2`` added to the mean loss's gradient.

    Other arguments as :class:`NoisyKFAC` (``stat_decay``, ``momentum``, ``stats_every``,
    ``inverse_every``, ``fisher``, ``block_tridiagonal``, ``kl_clip``...).
    """

    _noisy = False

    def __init__(self, learning_rate=1e-3, damping=1e-3, l2=0.0, name="kfac", **kwargs):
        for key in ("num_examples", "prior_variance", "prior_precision", "kl_weight",
                    "extrinsic_damping"):
            if kwargs.pop(key, None) is not None:
                raise ValueError(f"KFAC has no `{key}` (it is not Bayesian); use `damping`/`l2`.")
        if _non_negative("damping", damping) + _non_negative("l2", l2) <= 0:
            raise ValueError("KFAC needs `damping + l2 > 0`, got "
                             f"damping={damping!r}, l2={l2!r}.")
        if kwargs.get("mc_samples", 1) != 1:
            raise ValueError("KFAC draws no weight samples: `mc_samples` must be 1.")
        super().__init__(learning_rate=learning_rate, num_examples=1, name=name, **kwargs)
        self.damping = float(damping)
        self.l2 = float(l2)

    @property
    def sampling_damping(self):
        return self.damping + self.l2

    def _initialize_means_once(self, latch=True):
        """Without weight noise the model's variables hold the mean: it is read from them before
        each step and each posterior access, so weights Keras restores (EarlyStopping's
        ``restore_best_weights``) or a user assigns are where the next step starts."""
        super()._initialize_means_once(latch)
        self._copy_weights_to_means()

    @property
    def step_damping(self):
        return self.damping + self.l2

    @property
    def weight_decay_coefficient(self):
        return self.l2

    def get_config(self):
        config = super().get_config()
        for key in ("num_examples", "prior_variance", "kl_weight", "extrinsic_damping", "mc_samples"):
            config.pop(key, None)
        return {**config, "damping": self.damping, "l2": self.l2}
