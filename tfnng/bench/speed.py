"""Training-step time and optimizer-state memory of each tfnng optimizer, as ratios to Keras Adam.

All optimizers are measured in one process on the same models (an MLP 784-400-400-10 and a small CNN on
28x28x1 inputs, both ending in 10 logits with ``CategoricalNLL``), the same random in-memory batch of
128 (``--batch-size``) and the same ``jit_compile`` setting. After a warm-up (tracing) each optimizer
trains for ``--steps`` steps with ``model.fit`` on that batch repeated; this is repeated ``--repeats``
times with the optimizers interleaved (their order rotated from repeat to repeat) so that drift of the
machine hits all of them alike, and the median time per step is reported, both wall-clock and process
CPU time (all threads). On a machine shared with other work the wall-clock time is distorted by waiting
for the CPU; the CPU time is not, so its ratio is the steadier one there. Memory is the total size in
bytes of ``optimizer.variables``, all of them: the per-weight slots (moments, curvature, posterior mean)
and the few scalars (iteration and update counters, learning rate, random-seed state). Targets
(reported, not asserted): for the diagonal family step time at most 1.15x and state memory at most 2.5x
that of Adam; noisy K-FAC at most 1.6x; VOGN at most 2x and SLANG (L = 8) at most 4x. The "-generic"
rows train the same optimizer on a copy of the model whose layers the fast per-example path does not
recognise, measuring the generic (``tf.vectorized_map``) path.
"""

import math
import statistics
import time

import keras
import numpy as np
import tensorflow as tf

import tfnng
from tfnng.bench import _results

OPTIMIZERS = ("Adam", "NoisyAdam", "Vadam", "Vprop", "VadaGrad", "IVON", "NoisyKFAC", "KFAC", "VOGN",
              "VOGN-empirical", "SLANG", "VOGN-generic")
# Trained through tfnng.BayesianModel (they need layer inputs and pre-activation gradients, or
# per-example gradients).
CURVATURE_OPTIMIZERS = ("NoisyKFAC", "KFAC", "VOGN", "VOGN-empirical", "SLANG", "VOGN-generic")
# SLANG's rank in this benchmark (the target is stated for L = 8).
SLANG_RANK = 8
BATCH_SIZE = 128
NUM_CLASSES = 10
# num_examples given to the tfnng optimizers: the size of MNIST's training set, which these models fit.
NUM_EXAMPLES = 60000
LEARNING_RATE = 1e-3
TARGETS = {"step_time_ratio": 1.15, "state_bytes_ratio": 2.5}


class _OpaqueDense(keras.layers.Dense):
    """A Dense layer that tfnng's capture does not recognise (its ``call`` is overridden), so its
    per-example gradients take the generic path: the "-generic" rows measure that path."""

    def call(self, inputs, training=None):
        return super().call(inputs, training=training)


class _OpaqueConv2D(keras.layers.Conv2D):
    """Conv2D counterpart of :class:`_OpaqueDense`."""

    def call(self, inputs):
        return super().call(inputs)


def _mlp(dense=keras.layers.Dense, conv=None):
    return keras.Sequential([
        keras.Input((784,)),
        dense(400, activation="relu"),
        dense(400, activation="relu"),
        dense(NUM_CLASSES),
    ], name="mlp_784_400_400_10")


def _cnn(dense=keras.layers.Dense, conv=keras.layers.Conv2D):
    return keras.Sequential([
        keras.Input((28, 28, 1)),
        conv(32, 3, activation="relu"),
        keras.layers.MaxPooling2D(),
        conv(64, 3, activation="relu"),
        keras.layers.MaxPooling2D(),
        keras.layers.Flatten(),
        dense(128, activation="relu"),
        dense(NUM_CLASSES),
    ], name="cnn_c32_c64_d128_10")


MODELS = {"mlp": _mlp, "cnn": _cnn}


def _make_optimizer(name):
    if name == "Adam":
        return keras.optimizers.Adam(learning_rate=LEARNING_RATE)
    # NNG App. C.2: T_stats = 10, T_inv = 200 and the KL-clipped step (c_0 = 1e-3).
    if name == "NoisyKFAC":
        return tfnng.optimizers.NoisyKFAC(learning_rate=LEARNING_RATE, num_examples=NUM_EXAMPLES,
                                          stats_every=10, inverse_every=200, kl_clip=1e-3, seed=0)
    if name == "KFAC":
        return tfnng.optimizers.KFAC(learning_rate=LEARNING_RATE, damping=1e-3, stats_every=10,
                                     inverse_every=200, kl_clip=1e-3)
    if name == "SLANG":
        return tfnng.optimizers.SLANG(learning_rate=LEARNING_RATE, num_examples=NUM_EXAMPLES,
                                      rank=SLANG_RANK, seed=0)
    if name == "VOGN-empirical":      # the paper's VOGN (eq. 9): squared gradients of the observed targets
        return tfnng.optimizers.VOGN(learning_rate=LEARNING_RATE, num_examples=NUM_EXAMPLES,
                                     fisher="empirical", seed=0)
    name = name.removesuffix("-generic")
    return getattr(tfnng.optimizers, name)(learning_rate=LEARNING_RATE, num_examples=NUM_EXAMPLES, seed=0)


def state_bytes(optimizer):
    """Total bytes of ``optimizer.variables``."""
    return sum(math.prod(v.shape) * np.dtype(v.dtype).itemsize for v in optimizer.variables)


def _batch(model, batch_size):
    """One random batch for ``model``: standard normal inputs and uniformly drawn class labels."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((batch_size,) + tuple(model.input_shape[1:])).astype(np.float32)
    y = rng.integers(0, NUM_CLASSES, size=batch_size)
    return tf.data.Dataset.from_tensors((x, y)).repeat()


def _compiled_models(model_name, optimizers, jit_compile):
    """One freshly initialised copy of the model per optimizer, all with the same initial weights."""
    models = {}
    for name in optimizers:
        keras.utils.set_random_seed(0)
        if name.endswith("-generic"):
            model = MODELS[model_name](dense=_OpaqueDense, conv=_OpaqueConv2D)
        else:
            model = MODELS[model_name]()
        if name in CURVATURE_OPTIMIZERS:
            model = tfnng.BayesianModel(model)
        model.compile(optimizer=_make_optimizer(name), loss=tfnng.losses.CategoricalNLL(),
                      jit_compile=jit_compile)
        models[name] = model
    return models


def _guard_counts(optimizer):
    """Updates skipped by tfnng's non-finite guard and K-FAC factorisations that failed so far (0 for
    optimizers without them)."""
    return (getattr(optimizer, "skipped_updates", 0), getattr(optimizer, "inverse_failures", 0))


def _ms_per_step(model, dataset, steps):
    """Wall-clock and process CPU milliseconds per training step of ``steps`` steps of ``model.fit``,
    the mean training loss of those steps, and the updates skipped and factorisations failed in
    them."""
    before = _guard_counts(model.optimizer)
    wall, cpu = time.perf_counter(), time.process_time()
    history = model.fit(dataset, steps_per_epoch=steps, epochs=1, verbose=0)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    skipped, failed = (after - start for after, start in zip(_guard_counts(model.optimizer), before))
    return 1000.0 * wall / steps, 1000.0 * cpu / steps, history.history["loss"][-1], skipped, failed


def _cpu_ms_per_call(fn, calls=1, repeats=3):
    """Process CPU milliseconds per call of the ``tf.function`` ``fn``: median over ``repeats`` runs
    of ``calls`` calls, after a tracing call."""
    fn()
    times = []
    for _ in range(repeats):
        cpu = time.process_time()
        for _ in range(calls):
            fn()
        times.append(1000.0 * (time.process_time() - cpu) / calls)
    return statistics.median(times)


def _num_parameters(model):
    """Trainable weights (count_params would add a BayesianModel's target-sampling seed state)."""
    return int(sum(np.prod(v.shape) for v in model.trainable_variables))


def _inverse_update_cpu_ms(optimizer, jit_compile=False):
    """Process CPU milliseconds of one K-FAC inverse update alone (eq. 13: one eigendecomposition per
    Kronecker factor and the cached inverses), compiled as the timed steps were."""
    return _cpu_ms_per_call(tf.function(optimizer._update_inverses, jit_compile=jit_compile))


def _update_cpu_ms(optimizer, variables, jit_compile=False):
    """Process CPU milliseconds of the optimizer's own update alone: ``apply_gradients`` with fixed
    gradients, no forward/backward pass, compiled as the timed steps were. For the optimizers that
    need no curvature statistics; it moves their state on."""
    grads = [tf.fill(v.shape, tf.constant(1e-3, v.dtype)) for v in variables]
    return _cpu_ms_per_call(tf.function(lambda: optimizer.apply_gradients(zip(grads, variables)),
                                        jit_compile=jit_compile), calls=50)


def measure(model_name, optimizers=OPTIMIZERS, steps=200, repeats=5, warmup_steps=200, jit_compile=False,
            batch_size=BATCH_SIZE):
    """Median wall/CPU ms per step and state bytes of each optimizer on one model.

    Ratios are to the first optimizer of ``optimizers``.
    """
    models = _compiled_models(model_name, optimizers, jit_compile)
    dataset = _batch(next(iter(models.values())), batch_size)
    for model in models.values():
        if warmup_steps:                      # (steps_per_epoch=0 would run the endless dataset)
            model.fit(dataset, steps_per_epoch=warmup_steps, epochs=1, verbose=0)
    times = {name: [] for name in optimizers}
    for repeat in range(repeats):
        order = optimizers[repeat % len(optimizers):] + optimizers[:repeat % len(optimizers)]
        for name in order:
            times[name].append(_ms_per_step(models[name], dataset, steps))
    rows = []
    for name in optimizers:
        wall, cpu, loss, skipped, failed = zip(*times[name])
        optimizer = models[name].optimizer
        rows.append({
            "model": model_name, "optimizer": name, "num_parameters": _num_parameters(models[name]),
            "ms_per_step": statistics.median(wall), "cpu_ms_per_step": statistics.median(cpu),
            "ms_per_step_repeats": list(wall), "cpu_ms_per_step_repeats": list(cpu),
            "state_bytes": state_bytes(optimizer),
            # A diverged run skips its updates (tfnng's non-finite guard), possibly with a finite
            # loss (overflowing squared gradients): its time is not a step's.
            "final_loss": loss[-1], "skipped_updates": sum(skipped), "inverse_failures": sum(failed),
            "trained": bool(np.all(np.isfinite(loss))) and sum(skipped) + sum(failed) == 0,
            # The timed steps hold one inverse update per T_inv steps only after K-FAC's inverse
            # warm-up (an inverse update at every statistics update of the first T_inv updates).
            "inverse_warmup_timed": bool(getattr(optimizer, "inverse_warmup", False)
                                         and warmup_steps < optimizer.inverse_every),
        })
    for row in rows:
        for key, ratio in [("ms_per_step", "step_time_ratio"), ("cpu_ms_per_step", "cpu_time_ratio"),
                           ("state_bytes", "state_bytes_ratio")]:
            row[ratio] = row[key] / rows[0][key]
        optimizer = models[row["optimizer"]].optimizer
        if row["optimizer"] not in CURVATURE_OPTIMIZERS:        # after the timed steps: moves the state
            row["update_cpu_ms"] = _update_cpu_ms(optimizer, models[row["optimizer"]].trainable_variables,
                                                  jit_compile)
            row["update_cpu_ms_over_reference_step"] = row["update_cpu_ms"] / rows[0]["cpu_ms_per_step"]
        if isinstance(optimizer, tfnng.optimizers.NoisyKFAC):   # its step times include one per T_inv steps
            row["inverse_update_cpu_ms"] = _inverse_update_cpu_ms(optimizer, jit_compile)
            row["inverse_every"] = optimizer.inverse_every
            row["amortised_inverse_update_ratio"] = (
                row["inverse_update_cpu_ms"] / optimizer.inverse_every / rows[0]["cpu_ms_per_step"])
    return rows


def add_arguments(parser):
    """Command-line options of ``python -m tfnng.bench speed``."""
    parser.add_argument("--steps", type=_results.positive_int, default=200,
                        help="training steps per timed run (default: %(default)s)")
    parser.add_argument("--repeats", type=_results.positive_int, default=5,
                        help="timed runs per optimizer (default: %(default)s)")
    parser.add_argument("--warmup-steps", type=_results.non_negative_int, default=200,
                        help="untimed steps first; >= T_inv = 200 so that K-FAC's inverse warm-up is over "
                             "and each timed run of 200 steps holds one inverse update (default: %(default)s)")
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated models (default: %(default)s)")
    parser.add_argument("--optimizers", default=",".join(OPTIMIZERS),
                        help="comma-separated optimizers; the first is the reference of the ratios "
                             "(default: %(default)s)")
    parser.add_argument("--jit-compile", action="store_true", help="compile every model with XLA (default: off)")
    parser.add_argument("--batch-size", type=_results.positive_int, default=BATCH_SIZE,
                        help="examples per step; the targets are stated for %(default)s (default: %(default)s)")
    parser.add_argument("--out", default="results/speed.json", help="JSON file (default: %(default)s)")


def _training_flags(row):
    flags = "" if row["trained"] else (
        f" DIVERGED ({row['skipped_updates']} updates skipped, "
        f"{row['inverse_failures']} factorisations failed)")
    return flags + (" (timed during the inverse warm-up)" if row["inverse_warmup_timed"] else "")


def run(args):
    """Run the speed/memory benchmark described by the parsed ``args``; print the table, write the JSON."""
    model_names = _results.parse_names(args.models, MODELS, "model(s)")
    optimizers = tuple(_results.parse_names(args.optimizers, OPTIMIZERS, "optimizer(s)"))
    _results.check_writable(args.out, "--out")
    rows = [row for name in model_names
            for row in measure(name, optimizers, args.steps, args.repeats, args.warmup_steps, args.jit_compile,
                               args.batch_size)]
    reference = f"x {optimizers[0]}"      # the ratios are to the first optimizer (Adam by default)
    _results.print_table(
        ["model", "optimizer", "ms/step", reference, "CPU ms/step", reference, "state bytes", reference,
         "final loss"],
        [[r["model"], r["optimizer"], f"{r['ms_per_step']:.3f}", f"{r['step_time_ratio']:.2f}",
          f"{r['cpu_ms_per_step']:.3f}", f"{r['cpu_time_ratio']:.2f}", r["state_bytes"],
          f"{r['state_bytes_ratio']:.2f}", f"{r['final_loss']:.4g}" + _training_flags(r)]
         for r in rows],
        title=f"\nTraining step time and optimizer state (batch {args.batch_size}, jit_compile={args.jit_compile}, "
              f"median of {args.repeats} x {args.steps} steps; targets: <= {TARGETS['step_time_ratio']}x time, "
              f"<= {TARGETS['state_bytes_ratio']}x state)")
    update_rows = [r for r in rows if "update_cpu_ms" in r]
    if update_rows:
        _results.print_table(
            ["model", "optimizer", "CPU ms per update", f"x {optimizers[0]} step"],
            [[r["model"], r["optimizer"], f"{r['update_cpu_ms']:.2f}",
              f"{r['update_cpu_ms_over_reference_step']:.2f}"] for r in update_rows],
            title="\nThe optimizer's update alone (apply_gradients with fixed gradients; the rest of a "
                  "step is the forward/backward pass)")
    inverse_rows = [r for r in rows if "inverse_update_cpu_ms" in r]
    if inverse_rows:
        _results.print_table(
            ["model", "optimizer", "CPU ms per inverse update", "T_inv", f"amortised, x {optimizers[0]} step"],
            [[r["model"], r["optimizer"], f"{r['inverse_update_cpu_ms']:.1f}", r["inverse_every"],
              f"{r['amortised_inverse_update_ratio']:.3f}"] for r in inverse_rows],
            title="\nK-FAC inverse update alone (already included in the step times above)")
    settings = {
        "models": model_names, "optimizers": list(optimizers), "slang_rank": SLANG_RANK,
        "batch_size": args.batch_size, "steps": args.steps,
        "repeats": args.repeats, "warmup_steps": args.warmup_steps, "jit_compile": args.jit_compile,
        "steps_per_execution": 1, "num_examples": NUM_EXAMPLES, "learning_rate": LEARNING_RATE,
        "targets": TARGETS,
        "state_bytes_counts": "all optimizer.variables: per-weight slots and scalar counters/seed state",
    }
    _results.write_json(args.out, "speed", args.command, settings, {"rows": rows}, code=args.code)
