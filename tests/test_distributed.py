"""Training under tf.distribute.MirroredStrategy matches the single-device run (see
docs/distributed.md).

Logical CPU devices can only be configured before TensorFlow initialises its devices, so the runs
happen in a subprocess (tests/distributed_runs.py): every optimizer of ``distributed_runs.CASES``
trains the same net from the same weights and seeds on the same global batches, on one device and
on 2 logical CPUs. Checked here:

* every replica holds a bit-identical copy of every weight and optimizer variable (the replicas
  apply the same update and draw the same weight sample);
* the distributed run follows the single-device run on the global batch: every optimizer variable
  (posterior means, slots, Kronecker factors and inverses, counters, seed state), the posterior
  standard deviations, the final weight sample and the reported losses agree to ``RTOL`` relative
  to each variable's scale. The two runs differ only in the order of floating-point reductions
  (two half-batch sums added by the all-reduce versus one full-batch sum): float32 round-off,
  ~1e-7, amplified over 8 updates and the eigendecompositions of the K-FAC factors; measured
  <= 6e-6. Each semantic error tried (no gradient all-reduce, no curvature all-gather, empirical
  Fisher not rescaled by the replica count, metrics not unscaled) moved some value by >= 5e-3;
* with the true Fisher, replicas sample their targets with their own seeds. One update on 1024
  examples: what does not depend on those targets (found by a single-device run with other
  targets: Kronecker factor A, momentum, counters...) agrees to ``RTOL``, and the output layer's
  statistic has the distribution the sampled targets imply.

The tutorial tutorials/distributed.py also runs here (smoke mode, its own subprocess).
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import distributed_runs

ROOT = Path(__file__).parents[1]
RTOL = 1e-4


def _run_script(args, tmp_path, returncode=0):
    paths = [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", "PYTHONPATH": os.pathsep.join(paths)}
    done = subprocess.run([sys.executable, *args], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=900)
    assert done.returncode == returncode, done.stderr[-5000:]
    return done


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("distributed") / "runs.npz"
    _run_script([str(ROOT / "tests" / "distributed_runs.py"), "--out", str(out)], out.parent)
    return dict(np.load(out))


def _recorded(runs, case, run):
    """{name: value} of one run (names as 'opt:3 noisy_adam/..._posterior_mean')."""
    names = runs[f"{case}|single|names"]
    return {name: runs[f"{case}|{run}|{name.split()[0]}"] for name in names}


def _deviation(a, b):
    """max |a - b| relative to max |a| (0 for two zero arrays)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b), initial=0.0) / max(np.max(np.abs(a), initial=0.0), 1e-30))


@pytest.mark.parametrize("case", list(distributed_runs.CASES))
def test_replicas_hold_identical_copies(runs, case):
    assert runs[f"{case}|mirrored|replicas_identical"]


@pytest.mark.parametrize("case", list(distributed_runs.CASES))
def test_posterior_matches_single_device(runs, case):
    spec = distributed_runs.CASES[case]
    single, mirrored = _recorded(runs, case, "single"), _recorded(runs, case, "mirrored")
    reference = _recorded(runs, case, "reference") if spec.reference else None
    compared, differing = 0, []
    for name, value in single.items():
        if any(re.search(pattern, name) for pattern in spec.sign_ambiguous):
            continue
        if reference is not None and not np.array_equal(value, reference[name]):
            continue        # depends on the sampled Fisher targets
        compared += 1
        if _deviation(value, mirrored[name]) > RTOL:
            differing.append((name, _deviation(value, mirrored[name])))
    assert compared >= 10
    assert not differing, f"distributed run differs from the single-device run: {differing}"
    if reference is None:    # BayesianModel's loss, nll and kl metrics: those of the global batch
        losses = runs[f"{case}|single|history_loss"], runs[f"{case}|mirrored|history_loss"]
        assert _deviation(*losses) <= RTOL


@pytest.mark.parametrize("case", [name for name, spec in distributed_runs.CASES.items()
                                  if spec.target_statistic])
def test_true_fisher_statistic_has_its_distribution(runs, case):
    """One update on B examples: the output layer's statistic is (1/B) sum_n eps_n^2 / sigma^2
    (times ``1 - beta_2`` for NoisyAdam), its expectation times chi2_B / B (sd sqrt(2/B)) when every
    example's target has its own noise; 4 sd (0.18 for B = 1024) excludes a statistic off by the
    replica count (x2, x1/2) or its square."""
    pattern, expectation = distributed_runs.CASES[case].target_statistic
    batch = distributed_runs.ONE_STEP_EXAMPLES
    for run in ("single", "mirrored", "reference"):
        recorded = _recorded(runs, case, run)
        [name] = [name for name in recorded if re.search(pattern, name)]
        ratio = float(np.squeeze(recorded[name])) / expectation
        assert abs(ratio - 1) <= 4 * np.sqrt(2 / batch), (run, name, ratio)


def test_replicas_draw_their_own_fisher_targets(runs):
    """Both replicas get the same examples: the true Fisher's sampled targets (replica id folded
    into the seed) must still differ, while the empirical Fisher's gradients coincide."""
    true, empirical = runs["targets|true"], runs["targets|empirical"]
    assert true.shape == empirical.shape == (distributed_runs.REPLICAS, 8)
    np.testing.assert_array_equal(empirical[0], empirical[1])
    assert np.all(true[0] != true[1])


def test_nonfinite_raise_on_one_replicas_nan_leaves_identical_replicas(runs):
    """A NaN in one replica's shard: every replica raises, and none advanced its copy of the
    state (the finite replica used to draw its next weight noise: replicas drifted apart)."""
    assert runs["raise|raised"] and runs["raise|replicas_identical"]


def test_the_hand_written_loop_takes_a_batch_the_replicas_share_unevenly(runs):
    """A batch of 5 on 2 replicas (3 + 2) failed in the all-gather ("[5,3] is not compatible with
    expected shape [4,3]"); the output layer's empirical S is the brute-force mean."""
    np.testing.assert_allclose(runs["uneven|s"], runs["uneven|brute_force"], rtol=1e-5)


def test_posterior_tensorboard_logs_under_the_strategy(runs):
    assert {"elbo/kl", "elbo/nll"} <= set(runs["tensorboard|tags"])


@pytest.mark.parametrize("name", ["noisy_kfac", "vogn"])
def test_curvature_optimizers_under_mixed_precision(runs, name):
    """"mixed_bfloat16" trains (the all-gather refused bfloat16 curvature tensors); "mixed_float16",
    whose LossScaleOptimizer applies the update in threads that never see the curvature, is refused
    at compile (it failed in the first step with "received no curvature statistics")."""
    losses = runs[f"mixed|mixed_bfloat16|{name}"]
    assert losses.dtype.kind == "f" and np.isfinite(losses).all()
    assert "mixed_bfloat16" in str(runs[f"mixed|mixed_float16|{name}"])


def test_tutorial_smoke(tmp_path):
    """tutorials/distributed.py --smoke in a fresh process (it configures logical devices)."""
    code = ("import json, runpy; "
            f"main = runpy.run_path({str(ROOT / 'tutorials' / 'distributed.py')!r})['main']; "
            "print(json.dumps(main(['--smoke'])))")
    results = json.loads(_run_script(["-c", code], tmp_path).stdout.splitlines()[-1])
    assert set(results) == {"noisy_adam", "noisy_kfac"}
    for r in results.values():
        assert r["replicas_identical"]
        assert r["deviation_from_single_device"] <= RTOL
        assert np.isfinite(r["rmse"]) and np.isfinite(r["test_log_likelihood"])


@pytest.mark.parametrize("args", [["--replicas", "3", "--batch-size", "33"],     # 352 = 10 * 33 + 22
                                  ["--replicas", "3", "--batch-size", "12"]])          # + 4
def test_tutorial_refuses_a_last_batch_the_replicas_cannot_share(args, tmp_path):
    """Such a run drifted from the single-device one by 1e-1 (relative) in two epochs, unremarked."""
    done = _run_script([str(ROOT / "tutorials" / "distributed.py"), *args], tmp_path, returncode=2)
    assert "last, partial batch" in done.stderr
