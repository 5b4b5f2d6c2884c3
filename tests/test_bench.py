"""Tests of the benchmark runner ``python -m tfnng.bench``: UCI data loading and normalisation on a
synthetic folder, and quick end-to-end runs of the ``uci`` and ``speed`` tasks."""

import argparse
import json
import math
import re
import shutil
import subprocess
import sys
import types
import warnings
from pathlib import Path

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfnng
from tfnng.bench import _results, kfac_digits, speed, uci
from tfnng.bench.__main__ import main

PROJECT_ROOT = Path(__file__).parents[1]
UCI_DIR = PROJECT_ROOT.parent / "shared" / "datasets" / "uci"
RECORD_KEYS = {"task", "command", "date", "code", "machine", "settings", "results"}


def _run_bench(*args):
    """Run ``python -m tfnng.bench ARGS`` from the project root; fail with its output on error.

    The timeout only guards against a hang: the quick UCI and speed runs took 2 minutes together on
    the 2-core development machine with one other job, and the speed run over 5 minutes when four
    benchmark processes shared it."""
    process = subprocess.run([sys.executable, "-m", "tfnng.bench", *args], cwd=PROJECT_ROOT,
                             capture_output=True, text=True, timeout=1200)
    assert process.returncode == 0, process.stdout[-2000:] + process.stderr[-4000:]
    return process.stdout


def _write_uci_folder(root, data, features, target, train, test, n_hidden=50):
    folder = root / "toy"
    folder.mkdir()
    np.savetxt(folder / "data.txt", data)
    for name, values in [("index_features", features), ("index_target", [target]),
                         ("index_train_0", train), ("index_test_0", test),
                         ("n_splits", [1]), ("n_hidden", [n_hidden])]:
        np.savetxt(folder / f"{name}.txt", np.asarray(values), fmt="%d")
    return folder


def _toy_uci_folder(root, data, name="toy", n_splits=1):
    """``root / name``: the 12 rows of ``data`` (features 0-1, target 2, 4 hidden units) in
    ``n_splits`` identical splits that train on rows 0-7 and test on rows 8-11."""
    folder = _write_uci_folder(root, data, features=[0, 1], target=2, train=np.arange(8),
                               test=np.arange(8, 12), n_hidden=4)
    for split in range(1, n_splits):
        for kind in ("train", "test"):
            shutil.copy(folder / f"index_{kind}_0.txt", folder / f"index_{kind}_{split}.txt")
    np.savetxt(folder / "n_splits.txt", [n_splits], fmt="%d")
    return folder if name == "toy" else folder.rename(root / name)


def _recorded_predictions(monkeypatch):
    """Patch ``tfnng.predict`` (which the benchmarks call) to record ``(num_samples, predictive)`` of
    each call; returns the list."""
    calls, predict = [], tfnng.predict

    def spy(model, x, num_samples):
        calls.append((num_samples, predict(model, x, num_samples=num_samples)))
        return calls[-1][1]

    monkeypatch.setattr(tfnng, "predict", spy)
    return calls


def test_load_split_normalises_with_training_statistics_only(tmp_path):
    rng = np.random.default_rng(0)
    data = np.column_stack([rng.normal(3.0, 2.0, 12), np.full(12, 7.0), rng.normal(size=12),
                            rng.normal(-5.0, 4.0, 12)])
    train, test = np.arange(0, 12, 2), np.arange(1, 12, 2)
    _write_uci_folder(tmp_path, data, features=[0, 1, 2], target=3, train=train, test=test, n_hidden=7)

    split = uci.load_split(tmp_path, "toy", 0)

    x_train, x_test = data[train][:, :3], data[test][:, :3]
    mean, std = x_train.mean(axis=0), x_train.std(axis=0)
    std[1] = 1.0  # constant column: std 0 is replaced by 1
    np.testing.assert_allclose(split.x_train, (x_train - mean) / std, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(split.x_test, (x_test - mean) / std, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(split.x_train[:, 1], 0.0)
    assert split.y_mean == pytest.approx(data[train, 3].mean())
    assert split.y_std == pytest.approx(data[train, 3].std())
    np.testing.assert_allclose(split.y_test[:, 0], (data[test, 3] - split.y_mean) / split.y_std, rtol=1e-5)
    assert split.x_train.dtype == np.float32 and split.y_train.shape == (6, 1)
    assert np.all(np.isfinite(split.x_test))
    assert uci.dataset_info(tmp_path, "toy") == (12, 1, 7)


def test_first_split_selects_a_range_of_splits(tmp_path):
    rng = np.random.default_rng(1)
    folder = _toy_uci_folder(tmp_path, rng.normal(size=(12, 3)))
    for split in (1, 2):  # three splits, the later two with other test rows
        np.savetxt(folder / f"index_train_{split}.txt", np.arange(split, split + 8), fmt="%d")
        np.savetxt(folder / f"index_test_{split}.txt", np.r_[np.arange(split), np.arange(split + 8, 12)], fmt="%d")
    np.savetxt(folder / "n_splits.txt", [3], fmt="%d")

    summary = uci.run_benchmark(tmp_path, "toy", "adam", splits=5, epochs=1, first_split=1)

    assert [s["split"] for s in summary["splits"]] == [1, 2] and summary["n_splits"] == 2
    with pytest.raises(SystemExit, match="toy has splits 0 to 2"):
        uci.run_benchmark(tmp_path, "toy", "adam", epochs=1, first_split=3)
    with pytest.raises(SystemExit, match="at least one split"):
        uci.run_benchmark(tmp_path, "toy", "adam", splits=0, epochs=1)


def test_uci_checks_every_data_set_before_training_any(tmp_path, monkeypatch):
    rng = np.random.default_rng(2)
    for name, n_splits in (("yacht", 3), ("energy", 1)):
        _toy_uci_folder(tmp_path, rng.normal(size=(12, 3)), name, n_splits)
    monkeypatch.setattr(uci, "run_split", lambda *a, **k: pytest.fail("trained before the checks"))
    argv = ["uci", "--data-dir", str(tmp_path), "--dataset", "yacht,energy", "--epochs", "1",
            "--out", str(tmp_path / "r.json")]
    with pytest.raises(SystemExit, match="--first-split 2: energy has splits 0 to 0"):
        main(argv + ["--first-split", "2"])
    with pytest.raises(SystemExit, match="--mc-samples 2: adam is a MAP method"):
        main(argv + ["--method", "noisy_adam,adam", "--mc-samples", "2"])   # noisy_adam used to train
    (tmp_path / "energy" / "index_test_0.txt").unlink()
    with pytest.raises(SystemExit, match=r"energy in .* is incomplete \(missing: index_test_0.txt\)"):
        main(argv)
    (tmp_path / "energy" / "data.txt").unlink()
    with pytest.raises(SystemExit, match=r"missing: data.txt\)"):
        main(argv)


def test_mc_samples_feed_each_batch_once_per_weight_sample(tmp_path):
    rng = np.random.default_rng(3)
    shapes = ((7, 2), (7, 1), (3, 2), (3, 1))          # x_train, y_train, x_test, y_test
    data = uci.Split(*(rng.normal(size=s).astype(np.float32) for s in shapes), y_mean=0.0, y_std=1.0)
    pipeline = uci._training_batches(data, batch_size=3, epochs=2, seed=0, mc_samples=3)
    batches = [x.numpy() for x, _ in pipeline]
    assert len(batches) == 2 * 3 * 3                     # epochs x ceil(7 / 3) batches x samples
    for group in range(0, len(batches), 3):              # three copies in a row, then the next batch
        for copy in batches[group + 1:group + 3]:
            np.testing.assert_array_equal(copy, batches[group])
    first_epoch = np.concatenate(batches[:9:3])
    np.testing.assert_array_equal(np.sort(first_epoch, axis=0), np.sort(data.x_train, axis=0))

    _toy_uci_folder(tmp_path, rng.normal(size=(12, 3)))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        summary = uci.run_benchmark(tmp_path, "toy", "noisy_adam", epochs=2, batch_size=4, mc_samples=3)
    assert not [w for w in caught if "ran out of data" in str(w.message)]
    assert summary["mc_samples"] == 3 and np.isfinite(summary["test_ll"])
    assert uci._table_rows([{**summary, "dataset": "yacht"}])[0][1] == "noisy_adam (mc_samples=3)"
    assert summary["optimizer_config"]["config"]["mc_samples"] == 3
    with pytest.raises(SystemExit, match="--mc-samples 2: adam is a MAP method"):
        uci.run_benchmark(tmp_path, "toy", "adam", epochs=1, mc_samples=2)
    with pytest.raises(SystemExit, match="--mc-samples 0"):
        uci.run_benchmark(tmp_path, "toy", "noisy_kfac", epochs=1, mc_samples=0)


def test_predictive_samples_reach_the_predictive(tmp_path, monkeypatch):
    rng = np.random.default_rng(2)
    _toy_uci_folder(tmp_path, rng.normal(size=(12, 3)))
    predictions = _recorded_predictions(monkeypatch)
    summary = uci.run_benchmark(tmp_path, "toy", "noisy_adam", epochs=1, num_predictive_samples=7)
    assert [n for n, _ in predictions] == [7] and np.isfinite(summary["test_ll"])
    with pytest.raises(SystemExit, match="at least one sample"):
        uci.run_benchmark(tmp_path, "toy", "noisy_adam", epochs=1, num_predictive_samples=0)


@pytest.mark.parametrize("total_steps", [1, 2, 7, 10])
def test_learning_rate_decays_for_the_second_half_of_the_updates(total_steps):
    """NNG App. C.1: the first total_steps // 2 updates (schedule steps from 0) at the full rate."""
    rates = [float(uci._learning_rate(total_steps)(step)) for step in range(total_steps)]
    full, decayed = uci.LEARNING_RATE, uci.LEARNING_RATE * uci.LEARNING_RATE_DECAY
    first_half = max(total_steps // 2, 1)
    np.testing.assert_allclose(rates, [full] * first_half + [decayed] * (total_steps - first_half))


def test_dataset_names_and_aliases():
    assert uci.resolve_dataset("boston") == "bostonHousing"
    assert uci.resolve_dataset("yacht") == "yacht"
    with pytest.raises(ValueError, match="unknown UCI data set"):
        uci.resolve_dataset("year")
    assert set(uci.NNG_TABLE_1) == set(uci.MC_DROPOUT) == set(uci.DATASETS)


def test_default_uci_out_names_the_splits_epochs_and_data_folder(tmp_path, monkeypatch):
    """Two runs over different splits used to write the same default file, the second over the
    first; so did a run on another folder's copy of a data set (docs/benchmarks.md's naval_turbine,
    another target) and the standard run."""
    def stop(path, option):
        raise SystemExit(f"would write {path}")
    monkeypatch.setattr(_results, "check_writable", stop)
    with pytest.raises(SystemExit, match=r"would write results/uci_naval_turbine_yacht_ivon_from0_e"):
        main(["uci", "--data-dir", str(tmp_path / "naval_turbine"), "--dataset", "yacht",
              "--method", "ivon"])
    argv = ["uci", "--data-dir", str(tmp_path / "uci"), "--dataset", "yacht", "--method", "ivon"]
    with pytest.raises(SystemExit, match=r"would write results/uci_yacht_ivon_from0_e200\.json"):
        main(argv)
    with pytest.raises(SystemExit, match=r"results/uci_yacht_ivon_from10x10_e1000\.json"):
        main(argv + ["--first-split", "10", "--splits", "10", "--epochs", "1000"])
    # Runs that differ in Monte Carlo samples, batch size or predictive samples also overwrote.
    with pytest.raises(SystemExit, match=r"results/uci_yacht_ivon_mc3_b50_ps1000_from0_e200\.json"):
        main(argv + ["--mc-samples", "3", "--batch-size", "50", "--predictive-samples", "1000"])


def test_set_changes_a_method_argument_and_is_recorded(tmp_path, monkeypatch):
    rng = np.random.default_rng(4)
    _toy_uci_folder(tmp_path, rng.normal(size=(12, 3)))
    overrides = {"momentum": 0.5, "kl_clip": None}
    summary = uci.run_benchmark(tmp_path, "toy", "noisy_kfac", epochs=1, batch_size=4, overrides=overrides)
    config = summary["optimizer_config"]["config"]
    assert config["momentum"] == 0.5 and config["kl_clip"] is None
    assert config["extrinsic_damping"] == uci.METHODS["noisy_kfac"].hyper_parameters["extrinsic_damping"]
    assert summary["overrides"] == overrides and summary["hyper_parameters"]["momentum"] == 0.5
    row = uci._table_rows([{**summary, "dataset": "yacht"}])[0]
    assert row[1] == "noisy_kfac (momentum=0.5, kl_clip=None)"

    def stop(path, option):
        raise SystemExit(f"would write {path}")
    monkeypatch.setattr(_results, "check_writable", stop)
    argv = ["uci", "--data-dir", str(tmp_path / "uci"), "--dataset", "yacht", "--method", "noisy_kfac"]
    with pytest.raises(SystemExit, match=r"uci_yacht_noisy_kfac_momentum=0\.9_kl_clip=None_from0_e200"):
        main(argv + ["--set", "momentum=0.9", "--set", "kl_clip=None"])
    assert uci.parse_setting("fisher=empirical") == ("fisher", "empirical")


def test_set_rejects_what_the_optimizer_does_not_take_before_training(tmp_path, monkeypatch, capsys):
    _toy_uci_folder(tmp_path, np.random.default_rng(5).normal(size=(12, 3)), "yacht")
    monkeypatch.setattr(uci, "run_split", lambda *a, **k: pytest.fail("trained before the checks"))
    argv = ["uci", "--data-dir", str(tmp_path), "--dataset", "yacht", "--epochs", "1",
            "--out", str(tmp_path / "r.json")]
    with pytest.raises(SystemExit, match="ivon with --mc-samples 1 --set momentum=0.9: .*momentum"):
        main(argv + ["--method", "noisy_kfac,ivon", "--set", "momentum=0.9"])
    with pytest.raises(SystemExit, match="noisy_kfac with .*--set kl_clip=-1"):
        main(argv + ["--method", "noisy_kfac", "--set", "kl_clip=-1"])
    with pytest.raises(SystemExit, match="--set momentum given more than once"):
        main(argv + ["--method", "noisy_kfac", "--set", "momentum=0.9", "--set", "momentum=0.5"])
    for bad in ("momentum", "=1", "learning_rate=0.1", "mc_samples=2"):
        with pytest.raises(SystemExit) as stop:
            main(argv + ["--set", bad])
        assert stop.value.code == 2 and "argument --set:" in capsys.readouterr().err


def test_unknown_names_stop_with_a_message(tmp_path):
    with pytest.raises(SystemExit, match="unknown method"):
        main(["uci", "--data-dir", str(tmp_path), "--dataset", "yacht", "--method", "sgd"])
    with pytest.raises(SystemExit, match="method adam given more than once"):
        main(["uci", "--data-dir", str(tmp_path), "--dataset", "yacht", "--method", "adam,adam"])
    with pytest.raises(SystemExit, match="Adam given more than once"):
        main(["speed", "--optimizers", "Adam,NoisyAdam,Adam", "--out", str(tmp_path / "s.json")])
    with pytest.raises(SystemExit, match="UCI data not found"):
        main(["uci", "--data-dir", str(tmp_path), "--dataset", "yacht"])


@pytest.mark.parametrize("argv", [
    ["uci", "--dataset", "yacht", "--epochs", "-1"],        # used to repeat the data forever
    ["uci", "--dataset", "yacht", "--epochs", "0"],         # used to record an untrained model
    ["uci", "--dataset", "yacht", "--batch-size", "0"],
    ["uci", "--dataset", "yacht", "--splits", "0"],
    ["uci", "--dataset", "yacht", "--first-split", "-1"],
    ["uci", "--dataset", "yacht", "--predictive-samples", "zero"],
    ["speed", "--steps", "0"],                              # used to hang
    ["speed", "--repeats", "0"],
    ["speed", "--warmup-steps", "-1"],
    ["speed", "--batch-size", "0"],
    ["logreg", "--splits", "0"],
    ["kfac_digits", "--epochs", "-1"],
    ["kfac_digits", "--num-samples", "0"],
    ["kfac_digits", "--test-fraction", "1.5"],
    ["kfac_digits", "--seed", "-1"],                        # used to end in a traceback
    ["logreg", "--seed", "-1"],
])
def test_out_of_range_numbers_are_usage_errors(argv, capsys):
    with pytest.raises(SystemExit) as stop:
        main(argv)
    assert stop.value.code == 2
    assert f"argument {argv[-2]}:" in capsys.readouterr().err


def test_an_unwritable_out_stops_before_any_training(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    out = str(blocker / "result.json")                      # its parent cannot be created
    for argv in (["uci", "--data-dir", str(tmp_path), "--dataset", "yacht", "--out", out],
                 ["logreg", "--data-dir", str(tmp_path), "--out", out],
                 ["speed", "--out", out],
                 ["kfac_digits", "--out", out],
                 ["kfac_digits", "--out", str(tmp_path / "ok.json"), "--png", str(tmp_path)]):
        with pytest.raises(SystemExit, match="--(out|png) "):
            main(argv)


def test_kfac_digits_refuses_what_would_fail_after_training(tmp_path, monkeypatch):
    """A figure suffix matplotlib cannot save, a --png that is the --out, and a test fraction that
    leaves fewer than one image per class on a side of the split ended in tracebacks (the first two
    after training, and without the JSON record)."""
    monkeypatch.setattr(kfac_digits, "run_method", lambda *a, **k: pytest.fail("trained first"))
    out = str(tmp_path / "r.json")
    with pytest.raises(SystemExit, match=r"--png .*\.txt: matplotlib saves figures as .*\.png"):
        main(["kfac_digits", "--out", out, "--png", str(tmp_path / "r.txt")])
    with pytest.raises(SystemExit, match="--png and --out name the same file"):
        main(["kfac_digits", "--out", out, "--png", out])
    for fraction, side in (("0.001", "2 of the 1797 images for testing"), ("0.999", "1 for training")):
        with pytest.raises(SystemExit, match=f"--test-fraction {fraction}: .*{side}.*one per class"):
            main(["kfac_digits", "--out", out, "--test-fraction", fraction])


def test_out_paths_are_opened_before_any_work(tmp_path):
    """os.access says yes to root for read-only places (/proc), and long names used to raise a bare
    OSError: the check opens the file, and removes it again if it was new."""
    for out in ("/proc/tfnng_result.json", str(tmp_path / ("x" * 300 + ".json")),
                str(tmp_path)):
        with pytest.raises(SystemExit, match="--out .*: cannot write this file"):
            main(["speed", "--out", out])
    _results.check_writable(str(tmp_path / "new.json"), "--out")
    assert not (tmp_path / "new.json").exists()


def test_speed_table_names_the_reference_of_its_ratios(tmp_path, monkeypatch, capsys):
    row = dict(model="mlp", ms_per_step=2.0, step_time_ratio=1.0, cpu_ms_per_step=2.0,
               cpu_time_ratio=1.0, state_bytes=8, state_bytes_ratio=1.0, final_loss=0.5, trained=True,
               skipped_updates=0, inverse_failures=0, inverse_warmup_timed=False)
    monkeypatch.setattr(speed, "measure", lambda name, optimizers, *args: [
        {**row, "optimizer": o} for o in optimizers])
    main(["speed", "--models", "mlp", "--optimizers", "NoisyAdam,Adam", "--out",
          str(tmp_path / "s.json")])
    header = next(line for line in capsys.readouterr().out.splitlines() if "ms/step" in line)
    assert header.count("x NoisyAdam") == 3 and "x Adam" not in header


def test_speed_counts_updates_the_guard_skipped_and_flags_the_row():
    """A run whose loss stays finite while tfnng's non-finite guard skips every update (the squared
    gradients overflow float32) did not train: its time is not a step's."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    model.compile(optimizer=tfnng.optimizers.NoisyAdam(1e-3, num_examples=100),
                  loss=tfnng.losses.CategoricalNLL())
    batch = (np.full((8, 4), 1e20, np.float32), np.zeros(8, np.int64))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _, _, loss, skipped, failed = speed._ms_per_step(
            model, tf.data.Dataset.from_tensors(batch).repeat(), 3)
    assert math.isfinite(loss) and skipped == 3 and failed == 0
    row = dict(trained=False, skipped_updates=3, inverse_failures=0, inverse_warmup_timed=False)
    assert speed._training_flags(row) == " DIVERGED (3 updates skipped, 0 factorisations failed)"


def test_speed_runs_without_warm_up_steps():
    rows = speed.measure("mlp", ("Adam",), steps=2, repeats=1, warmup_steps=0, batch_size=8)
    assert rows[0]["trained"] and rows[0]["ms_per_step"] > 0


def test_logreg_references_agree_with_slang_table_1():
    """Australian's full-Gaussian exact log-loss was copied as 0.339, the "Full Hess." column."""
    from tfnng.bench import logreg
    for dataset, columns in logreg.README_PUBLISHED.items():
        for column, (log_loss, _) in columns.items():
            assert log_loss == logreg.SLANG_TABLE_1[dataset][column][1], (dataset, column)


def test_result_helpers():
    mean, se = _results.mean_and_standard_error([1.0, 2.0, 3.0])
    assert mean == pytest.approx(2.0) and se == pytest.approx(1.0 / math.sqrt(3.0))
    assert _results.mean_and_standard_error([4.0]) == (4.0, None)
    assert _results.format_mean_se(1.23456, None) == "1.235 ± n/a"
    assert _results.parse_names("b,a", ["a", "b"], "x") == ["b", "a"]
    assert _results.parse_names("all", ["a", "b"], "x", allow_all=True) == ["a", "b"]
    with pytest.raises(SystemExit, match="unknown x c; choose from a, b$"):
        _results.parse_names("a,c", ["a", "b"], "x")
    with pytest.raises(SystemExit, match="unknown x all"):
        _results.parse_names("all", ["a", "b"], "x")
    lines = _results.format_table(["a", "long header"], [["xyz", 1]]).splitlines()
    assert len(lines) == 3 and lines[0].index("long") == lines[2].index("1")


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_records_count_an_untracked_module_of_the_package_as_a_change(tmp_path, monkeypatch):
    """An untracked file inside tfnng/ (new code) was not reported; one elsewhere (results) is not
    code. The record also names the CPU model and the thread settings the timings depend on."""
    package = tmp_path / "tfnng"
    package.mkdir()
    (package / "__init__.py").write_text("")

    def git(*args):
        subprocess.run(["git", "-C", str(tmp_path), *args], check=True, capture_output=True)

    git("init", "-q")
    git("add", ".")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "c")
    monkeypatch.setattr(tfnng, "__file__", str(package / "__init__.py"))
    assert _results.code_version()["uncommitted_changes"] is False
    (tmp_path / "results.json").write_text("{}")
    assert _results.code_version()["uncommitted_changes"] is False
    (package / "new_method.py").write_text("")
    assert _results.code_version()["uncommitted_changes"] is True
    machine = _results.machine_info()
    assert set(machine["threads"]) == {"TF_NUM_INTRAOP_THREADS", "TF_NUM_INTEROP_THREADS"}
    if Path("/proc/cpuinfo").exists():
        assert machine["processor"]


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_records_name_no_commit_for_a_copy_installed_inside_another_repository(tmp_path,
                                                                                monkeypatch):
    """pip-installed into a project's virtualenv, git found the project's repository above
    site-packages: the records named the project's commit as tfnng's."""
    package = tmp_path / ".venv" / "site-packages" / "tfnng"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (tmp_path / "project.py").write_text("")
    for args in (["init", "-q"], ["add", "project.py"],
                 ["-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "c"]):
        subprocess.run(["git", "-C", str(tmp_path), *args], check=True, capture_output=True)
    monkeypatch.setattr(tfnng, "__file__", str(package / "__init__.py"))
    code = _results.code_version()
    assert code["commit"] is None and code["uncommitted_changes"] is None


def test_records_name_the_code_the_run_started_with(tmp_path, monkeypatch):
    """The commit was read when the record was written: a commit made during a long run was
    recorded as the code that ran."""
    versions = iter([{"commit": "at the start"}, {"commit": "at the end"}])
    monkeypatch.setattr(_results, "code_version", lambda: next(versions))
    monkeypatch.setattr(uci, "run", lambda args: _results.write_json(
        tmp_path / "r.json", "uci", args.command, {}, {}, code=args.code))
    main(["uci", "--data-dir", str(tmp_path), "--dataset", "yacht", "--method", "ivon"])
    assert json.loads((tmp_path / "r.json").read_text())["code"] == {"commit": "at the start"}


def test_uci_quick_run_on_yacht(tmp_path):
    if not (UCI_DIR / "yacht").is_dir():
        pytest.skip(f"UCI benchmark data not found at {UCI_DIR}")
    out = tmp_path / "uci.json"
    stdout = _run_bench("uci", "--quick", "--data-dir", str(UCI_DIR), "--dataset", "yacht",
                        "--method", "adam,noisy_adam", "--out", str(out))

    assert "NNG-FFG (NNG Table 1)" in stdout and "MC dropout" in stdout
    assert "0.67 ± 0.05" in stdout and "0.670 ± 0.050" not in stdout   # published to 2 decimals
    record = json.loads(out.read_text())
    assert RECORD_KEYS <= set(record) and record["task"] == "uci"
    assert record["machine"]["cpu_count"] >= 1 and record["settings"]["quick"] is True
    assert record["code"]["tfnng"] == tfnng.__version__
    if (PROJECT_ROOT / ".git").exists():            # the record names the commit that produced it
        assert re.fullmatch("[0-9a-f]{40}", record["code"]["commit"])
        assert isinstance(record["code"]["uncommitted_changes"], bool)
    folder = UCI_DIR / "yacht"
    targets = np.loadtxt(folder / "data.txt")[:, int(np.loadtxt(folder / "index_target.txt"))]
    summaries = record["results"]["summaries"]
    assert [s["method"] for s in summaries] == ["adam", "noisy_adam"]
    for summary in summaries:
        assert summary["n_splits"] == uci.QUICK_SPLITS == len(summary["splits"])
        assert summary["epochs"] == uci.QUICK_EPOCHS and summary["batch_size"] == uci.SMALL_BATCH_SIZE
        for split in summary["splits"]:
            assert math.isfinite(split["test_ll"]) and not split["diverged"]
            assert 0.0 < split["rmse"] < targets.std()  # original units: better than predicting the mean
            assert split["train_seconds"] > 0.0
    assert set(record["results"]["references"]["yacht"]) == {
        "NNG-FFG (NNG Table 1)", "NNG-MVG (NNG Table 1)", "MC dropout (uci/README)"}


def test_speed_run_writes_ratios(tmp_path):
    out = tmp_path / "speed.json"
    # The MLP alone: the CNN builds the same way and would double the run.
    stdout = _run_bench("speed", "--steps", "3", "--repeats", "2", "--warmup-steps", "1", "--batch-size", "32",
                        "--models", "mlp", "--out", str(out))

    assert "ms/step" in stdout and "DIVERGED" not in stdout
    record = json.loads(out.read_text())
    assert RECORD_KEYS <= set(record) and record["task"] == "speed"
    assert record["settings"]["jit_compile"] is False and record["settings"]["batch_size"] == 32
    rows = record["results"]["rows"]
    assert {(r["model"], r["optimizer"]) for r in rows} == {("mlp", o) for o in speed.OPTIMIZERS}
    for row in rows:
        for key in ("ms_per_step", "step_time_ratio", "cpu_ms_per_step", "cpu_time_ratio", "state_bytes",
                    "state_bytes_ratio"):
            assert math.isfinite(row[key]) and row[key] > 0, (row["optimizer"], key)
        assert row["trained"] and math.isfinite(row["final_loss"]), row["optimizer"]
        if row["optimizer"] == "Adam":
            assert row["step_time_ratio"] == row["cpu_time_ratio"] == row["state_bytes_ratio"] == 1.0
        else:  # a tfnng optimizer holds at least the posterior mean (float32)
            assert row["state_bytes"] >= 4 * row["num_parameters"]
        timed_update = "update_cpu_ms" in row
        assert timed_update == (row["optimizer"] not in speed.CURVATURE_OPTIMIZERS), row["optimizer"]
        if timed_update:
            assert row["update_cpu_ms"] > 0 and math.isfinite(row["update_cpu_ms_over_reference_step"])
        timed_inverse = "inverse_update_cpu_ms" in row
        assert timed_inverse == (row["optimizer"] in ("NoisyKFAC", "KFAC")), row["optimizer"]
        if timed_inverse:
            assert row["inverse_update_cpu_ms"] > 0 and row["inverse_every"] == 200
    assert "K-FAC inverse update alone" in stdout and "The optimizer's update alone" in stdout


def test_reliability_plot_draws_no_bar_for_an_empty_bin(tmp_path, monkeypatch):
    """An empty bin has accuracy NaN (null in the JSON): it used to be drawn as a zero-height bar, an
    accuracy of 0 that no point had."""
    import matplotlib.axes

    drawn = []
    original_bar = matplotlib.axes.Axes.bar
    monkeypatch.setattr(matplotlib.axes.Axes, "bar",
                        lambda ax, x, height, **kwargs: drawn.append((list(x), list(height)))
                        or original_bar(ax, x, height, **kwargs))
    diagram = tfnng.metrics.reliability_diagram_data([0, 1, 0], [[0.9, 0.1], [0.2, 0.8], [0.3, 0.7]],
                                               num_bins=5)
    row = dict(method="m", accuracy=2 / 3, ece=0.1,
               reliability=json.loads(json.dumps({k: np.asarray(v).tolist()
                                                  for k, v in diagram._asdict().items()})))
    kfac_digits.plot_reliability([row], str(tmp_path / "sub" / "r.png"))
    assert drawn == [([0.6, 0.8], [0.5, 1.0])]           # bins (0.6, 0.8] and (0.8, 1]; 3 empty
    assert (tmp_path / "sub" / "r.png").stat().st_size > 0

def _toy_split(y_scale=1.0, y_shift=0.0, repeat_test=1):
    """A raw 16-row regression problem (12 train, 4 test) as a normalised Split and its raw test targets;
    the targets are ``y_scale * y + y_shift`` and the test rows are repeated ``repeat_test`` times."""
    rng = np.random.default_rng(11)
    x = rng.normal(size=(16, 2))
    y = (x @ [1.5, -0.5] + 0.3 * rng.normal(size=16))[:, None] * y_scale + y_shift
    x_test, y_test = np.tile(x[12:], (repeat_test, 1)), np.tile(y[12:], (repeat_test, 1))
    return uci.normalised_split(x[:12], y[:12], x_test, y_test), y_test


def test_uci_metrics_are_reported_in_original_target_units(monkeypatch):
    """RMSE and coverage from the predictive in original units (computed here with NumPy); under
    y -> a y + b the RMSE scales by a and the per-point log-likelihood (a density of y) drops by log a;
    repeating the test points changes no per-point average."""
    predictions = _recorded_predictions(monkeypatch)
    results = []
    for scale, shift, repeat in ((1.0, 0.0, 1), (10.0, 3.0, 1), (1.0, 0.0, 2)):
        data, y_raw = _toy_split(scale, shift, repeat)
        result = uci.train_and_evaluate(data, "adam", epochs=3, batch_size=4, num_hidden=8, seed=0)
        mean = np.asarray(predictions[-1][1].mean, np.float64) * data.y_std + data.y_mean
        std = np.sqrt(np.asarray(predictions[-1][1].variance, np.float64)) * data.y_std
        assert result["n_test"] == len(y_raw) == 4 * repeat and result["n_train"] == 12
        assert result["rmse"] == pytest.approx(np.sqrt(np.mean((mean - y_raw) ** 2)), rel=1e-4)
        z = 1.959963984540054                                # Phi^-1(0.975)
        assert result["coverage_95"] == pytest.approx(np.mean(np.abs(y_raw - mean) <= z * std))
        results.append(result)
    base, scaled, repeated = results
    assert scaled["rmse"] == pytest.approx(10.0 * base["rmse"], rel=1e-4)
    assert scaled["test_ll"] == pytest.approx(base["test_ll"] - math.log(10.0), abs=1e-4)
    assert repeated["rmse"] == pytest.approx(base["rmse"], rel=1e-4)
    assert repeated["test_ll"] == pytest.approx(base["test_ll"], abs=1e-4)


def test_map_baseline_penalty_is_the_gaussian_prior_per_training_example():
    """-log N(w; 0, v) / N = w^2 / (2 v N) + const per weight (the prior's share of the mean loss)."""
    num_examples = 50
    model = uci._make_model("adam", num_inputs=3, num_hidden=4, num_examples=num_examples)
    rng = np.random.default_rng(0)
    dense = [layer for layer in model.layers if isinstance(layer, keras.layers.Dense)]
    for layer in dense:
        layer.set_weights([rng.normal(size=w.shape) for w in layer.get_weights()])
    model(np.zeros((1, 3), np.float32))
    squares = sum(np.sum(np.square(w)) for layer in dense for w in layer.get_weights())
    expected = uci.KL_WEIGHT * squares / (2.0 * uci.PRIOR_VARIANCE * num_examples)
    assert float(sum(loss for layer in dense for loss in layer.losses)) == pytest.approx(expected, rel=1e-5)
    bayesian = uci._make_model("noisy_adam", 3, 4, num_examples)
    assert not [loss for layer in bayesian.layers if isinstance(layer, keras.layers.Dense) for loss in layer.losses]


def test_learning_rate_schedule_counts_posterior_updates(tmp_path):
    """8 rows, batches of 3: ceil(8 / 3) = 3 updates per epoch whatever --mc-samples; 2 epochs = 6
    updates, so the rate drops after schedule step 2 (the first 3 updates at the full rate)."""
    _toy_uci_folder(tmp_path, np.random.default_rng(6).normal(size=(12, 3)))
    for method, mc_samples in (("noisy_adam", 3), ("adam", 1)):
        summary = uci.run_benchmark(tmp_path, "toy", method, epochs=2, batch_size=3, mc_samples=mc_samples)
        schedule = summary["optimizer_config"]["config"]["learning_rate"]["config"]
        assert schedule["boundaries"] == [6 // 2 - 1]
        assert schedule["values"] == pytest.approx([uci.LEARNING_RATE, uci.LEARNING_RATE * uci.LEARNING_RATE_DECAY])


def test_each_split_is_seeded_by_its_number(tmp_path):
    _toy_uci_folder(tmp_path, np.random.default_rng(7).normal(size=(12, 3)), n_splits=4)
    summary = uci.run_benchmark(tmp_path, "toy", "noisy_adam", splits=1, epochs=1, first_split=3)
    assert [s["split"] for s in summary["splits"]] == [3]
    assert summary["optimizer_config"]["config"]["seed"] == 3


def test_training_batches_are_reshuffled_every_epoch():
    rng = np.random.default_rng(8)
    shapes = ((20, 2), (20, 1), (3, 2), (3, 1))
    data = uci.Split(*(rng.normal(size=s).astype(np.float32) for s in shapes), y_mean=0.0, y_std=1.0)
    epochs = [x.numpy() for x, _ in uci._training_batches(data, batch_size=20, epochs=2, seed=0)]
    assert len(epochs) == 2
    for epoch in epochs:
        np.testing.assert_array_equal(np.sort(epoch, axis=0), np.sort(data.x_train, axis=0))
    assert not np.array_equal(epochs[0], epochs[1])       # 20! orders: equal only by a bug


@pytest.mark.parametrize("name", ["learning_rate", "num_examples", "prior_variance", "prior_precision",
                                  "kl_weight", "seed", "mc_samples"])
def test_set_refuses_every_protocol_setting(name):
    with pytest.raises(argparse.ArgumentTypeError, match="protocol setting"):
        uci.parse_setting(f"{name}=2")


@pytest.mark.parametrize("rows, batch_size", [(1999, uci.SMALL_BATCH_SIZE), (2000, uci.LARGE_BATCH_SIZE)])
def test_default_batch_size_is_10_below_2000_rows_else_100(tmp_path, monkeypatch, rows, batch_size):
    """NNG App. C.1: batch size 10 for the data sets with fewer than 2000 points, 100 for the others."""
    _write_uci_folder(tmp_path, np.zeros((rows, 2)), features=[0], target=1, train=np.arange(rows - 10),
                      test=np.arange(rows - 10, rows), n_hidden=4)
    calls = _fake_uci_results(monkeypatch, {0: (1.0, 0.0, False, 0.0, 0.0)})
    summary = uci.run_benchmark(tmp_path, "toy", "adam", epochs=1)
    assert [c["batch_size"] for c in calls] == [batch_size] and summary["batch_size"] == batch_size
    assert (uci.SMALL_BATCH_SIZE, uci.LARGE_BATCH_SIZE, uci.SMALL_DATASET_ROWS) == (10, 100, 2000)


def _fake_uci_results(monkeypatch, per_split):
    """Replace training by ``per_split[split]`` (rmse, test_ll, diverged, train s, predict s); returns
    the list of the keyword arguments each call received."""
    calls = []

    def fake(data, method, epochs, batch_size, num_hidden, seed, **kwargs):
        calls.append(dict(method=method, epochs=epochs, batch_size=batch_size, num_hidden=num_hidden,
                          seed=seed, **kwargs))
        rmse, test_ll, diverged, train_s, predict_s = per_split[seed]
        return dict(n_train=len(data.x_train), n_test=len(data.x_test), rmse=rmse, test_ll=test_ll,
                    coverage_95=0.9, diverged=diverged, train_seconds=train_s, predict_seconds=predict_s,
                    optimizer_config={"seed": seed})

    monkeypatch.setattr(uci, "train_and_evaluate", fake)
    return calls


def test_uci_summary_averages_the_splits(tmp_path, monkeypatch, capsys):
    per_split = {0: (3.0, -2.5, False, 1.0, 0.5), 1: (2.0, -1.0, True, 2.0, 0.25),
                 2: (4.5, -3.25, False, 4.0, 0.125), 3: (9.0, 9.0, False, 8.0, 8.0)}
    _fake_uci_results(monkeypatch, per_split)
    _toy_uci_folder(tmp_path, np.random.default_rng(9).normal(size=(12, 3)), "toy", 4)
    summary = uci.run_benchmark(tmp_path, "toy", "adam", splits=3, epochs=1)
    rmse, ll = np.array([3.0, 2.0, 4.5]), np.array([-2.5, -1.0, -3.25])
    assert summary["n_splits"] == 3 and [s["split"] for s in summary["splits"]] == [0, 1, 2]
    assert summary["rmse"] == pytest.approx(rmse.mean())
    assert summary["rmse_se"] == pytest.approx(rmse.std(ddof=1) / np.sqrt(3))
    assert summary["test_ll"] == pytest.approx(ll.mean())
    assert summary["test_ll_se"] == pytest.approx(ll.std(ddof=1) / np.sqrt(3))
    assert summary["diverged_splits"] == 1
    assert summary["seconds"] == pytest.approx(1.0 + 0.5 + 2.0 + 0.25 + 4.0 + 0.125)
    # --first-split 1 --splits 1 runs split 1 alone; --splits 5 from split 2 runs the 2 left, and says so.
    assert [s["split"] for s in uci.run_benchmark(tmp_path, "toy", "adam", splits=1, epochs=1,
                                                  first_split=1)["splits"]] == [1]
    capsys.readouterr()
    summary = uci.run_benchmark(tmp_path, "toy", "adam", splits=5, epochs=1, first_split=2)
    assert [s["split"] for s in summary["splits"]] == [2, 3]
    assert "running 2 of the 5 asked for, from split 2" in capsys.readouterr().out


def test_uci_command_passes_its_options_and_records_them(tmp_path, monkeypatch):
    calls = _fake_uci_results(monkeypatch, {s: (1.0 + s, -1.0 - s, False, 1.0, 1.0) for s in range(4)})
    _toy_uci_folder(tmp_path, np.random.default_rng(9).normal(size=(12, 3)), "yacht", 4)
    out = tmp_path / "r.json"
    argv = ["uci", "--data-dir", str(tmp_path), "--dataset", "yacht", "--method", "noisy_kfac",
            "--first-split", "1", "--splits", "2", "--epochs", "3", "--mc-samples", "2",
            "--predictive-samples", "7", "--set", "momentum=0.5", "--out", str(out)]
    main(argv)
    assert [c["seed"] for c in calls] == [1, 2]
    for call in calls:
        assert call["num_predictive_samples"] == 7 and call["mc_samples"] == 2 and call["epochs"] == 3
        assert call["overrides"] == {"momentum": 0.5} and call["num_hidden"] == 4
    record = json.loads(out.read_text())
    assert RECORD_KEYS <= set(record)
    assert record["command"] == ["python", "-m", "tfnng.bench"] + argv
    assert record["date"].endswith("+00:00")                 # UTC
    settings = record["settings"]
    assert settings["first_split"] == 1 and settings["splits"] == 2 and settings["epochs"] == 3
    assert settings["mc_samples"] == 2 and settings["num_predictive_samples"] == 7
    assert settings["overrides"] == {"momentum": 0.5} and settings["quick"] is False
    (summary,) = record["results"]["summaries"]
    assert [s["split"] for s in summary["splits"]] == [1, 2] and summary["mc_samples"] == 2
    assert record["results"]["references"]["yacht"]["MC dropout (uci/README)"] == [0.67, 0.05, -1.25, 0.01]


def test_mc_dropout_references_match_the_data_readme():
    readme = UCI_DIR / "README.md"
    if not readme.is_file():
        pytest.skip(f"UCI README not found at {readme}")
    table = {}
    for line in readme.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0] in uci.DATASETS:
            table[cells[0]] = tuple(float(v) for cell in cells[1:] for v in cell.split("±"))
    assert table == uci.MC_DROPOUT


def test_only_constant_columns_keep_their_scale(tmp_path):
    """A column with a small but non-zero spread (std 1e-4) is standardised like any other."""
    rng = np.random.default_rng(10)
    data = np.column_stack([1e-4 * rng.normal(size=12), rng.normal(size=12)])
    _write_uci_folder(tmp_path, data, features=[0], target=1, train=np.arange(8), test=np.arange(8, 12))
    split = uci.load_split(tmp_path, "toy", 0)
    column = data[:8, 0]
    np.testing.assert_allclose(split.x_train[:, 0], (column - column.mean()) / column.std(), rtol=1e-4)


def test_count_arguments_and_fractions_check_their_bounds():
    assert _results.non_negative_int("0") == 0 and _results.positive_int("1") == 1
    assert _results.open_fraction("0.5") == 0.5
    for bad in ("0", "1", "0.0", "1.0", "-0.1"):
        with pytest.raises(argparse.ArgumentTypeError):
            _results.open_fraction(bad)


def test_records_hold_json_values_only(tmp_path):
    """NumPy scalars become numbers and every non-finite float (also inf, also inside tuples and
    nested dicts) becomes null."""
    results = {"a": np.float32(1.5), "b": float("inf"), "c": (1.0, float("nan")),
               "d": {"e": np.float64(-np.inf), "f": np.int64(3)}, "g": np.array([1.0, np.nan])}
    _results.write_json(tmp_path / "r.json", "t", ["x"], {}, results)
    record = json.loads((tmp_path / "r.json").read_text())
    assert record["results"] == {"a": 1.5, "b": None, "c": [1.0, None], "d": {"e": None, "f": 3},
                                 "g": [1.0, None]}


def test_check_writable_keeps_an_existing_file(tmp_path):
    existing = tmp_path / "old.json"
    existing.write_text("keep me")
    _results.check_writable(str(existing), "--out")
    assert existing.read_text() == "keep me"


def test_format_mean_se_uses_the_same_digits_for_the_error():
    assert _results.format_mean_se(1.0, 0.12345, 2) == "1.00 ± 0.12"
    assert _results.format_mean_se(-2.0, 0.5) == "-2.000 ± 0.500"


def test_demo_split_is_80_20_of_diabetes_normalised_with_training_statistics():
    from sklearn.datasets import load_diabetes
    from sklearn.model_selection import train_test_split
    from tfnng import demo
    x, y = load_diabetes(return_X_y=True)
    for seed in (0, 1):
        split = demo.diabetes_split(seed)
        assert len(split.x_test) == math.ceil(0.2 * len(x)) and len(split.x_train) == len(x) - len(split.x_test)
        _, _, y_train, y_test = train_test_split(x, y, test_size=0.2, random_state=seed)
        assert split.y_mean == pytest.approx(y_train.mean()) and split.y_std == pytest.approx(y_train.std())
        np.testing.assert_allclose(split.y_test[:, 0], (y_test - y_train.mean()) / y_train.std(), rtol=1e-5)


def test_demo_trains_the_documented_net_and_refuses_unknown_methods(monkeypatch, capsys):
    """The demo's docstring: one hidden layer of 50 units; batch size 10 as the small UCI sets."""
    from tfnng import demo
    calls = _fake_uci_results(monkeypatch, {0: (1.0, -1.0, False, 0.0, 0.0)})
    demo.main(["--epochs", "3", "--methods", "ivon"])
    assert calls == [dict(method="ivon", epochs=3, batch_size=10, num_hidden=50, seed=0, verbose=1)]
    with pytest.raises(SystemExit) as stop:
        demo.main(["--methods", "adam,sgd"])
    assert stop.value.code == 2 and "unknown method(s) sgd" in capsys.readouterr().err


def test_uci_metrics_of_a_known_predictive(monkeypatch):
    """A fixed Gaussian predictive N(0, 2^2) in normalised units, targets normalised with mean 5 and
    std 2: in original units N(5, 4^2). Coverage counts |y - 5| <= 1.96 * 4; a non-finite output (also
    inf, not only NaN) marks the run as diverged."""
    from scipy import stats

    y_norm = np.array([[1.0], [3.0], [3.5], [5.0], [-4.5]])
    rng = np.random.default_rng(12)
    data = uci.Split(rng.normal(size=(8, 2)).astype(np.float32), rng.normal(size=(8, 1)).astype(np.float32),
                     rng.normal(size=(5, 2)).astype(np.float32), y_norm.astype(np.float32), y_mean=5.0, y_std=2.0)
    y_raw = 5.0 + 2.0 * y_norm[:, 0]

    class Known:
        def __init__(self, outputs):
            self.outputs, self.mean, self.variance = outputs, np.zeros((5, 1)), np.full((5, 1), 4.0)

        def log_likelihood(self, y):
            return stats.norm.logpdf(np.asarray(y, np.float64)[:, 0], 0.0, 2.0)

    outputs = np.zeros((1, 5, 2))
    monkeypatch.setattr(uci.tfnng, "predict", lambda model, x, num_samples: Known(outputs))
    result = uci.train_and_evaluate(data, "adam", epochs=1, batch_size=4, num_hidden=3, seed=0)
    assert result["rmse"] == pytest.approx(np.sqrt(np.mean((y_raw - 5.0) ** 2)))
    assert result["test_ll"] == pytest.approx(np.mean(stats.norm.logpdf(y_raw, 5.0, 4.0)))
    assert result["coverage_95"] == pytest.approx(np.mean(np.abs(y_raw - 5.0) <= stats.norm.ppf(0.975) * 4.0))
    assert result["coverage_95"] == pytest.approx(3 / 5) and result["diverged"] is False
    outputs = np.array([[[0.0, 0.0]] * 4 + [[np.inf, 0.0]]])
    result = uci.train_and_evaluate(data, "adam", epochs=1, batch_size=4, num_hidden=3, seed=0)
    assert result["diverged"] is True and math.isnan(result["test_ll"]) and math.isnan(result["coverage_95"])


def test_each_split_trains_on_its_own_rows(tmp_path, monkeypatch):
    calls = _fake_uci_results(monkeypatch, {s: (1.0, -1.0, False, 0.0, 0.0) for s in range(2)})
    folder = _toy_uci_folder(tmp_path, np.random.default_rng(13).normal(size=(12, 3)), n_splits=2)
    np.savetxt(folder / "index_train_1.txt", np.arange(5), fmt="%d")          # split 1: 5 / 7 rows
    np.savetxt(folder / "index_test_1.txt", np.arange(5, 12), fmt="%d")
    summary = uci.run_benchmark(tmp_path, "toy", "adam", epochs=1)
    assert [(s["split"], s["n_train"], s["n_test"]) for s in summary["splits"]] == [(0, 8, 4), (1, 5, 7)]
    assert [c["seed"] for c in calls] == [0, 1]


def test_quick_uci_command_records_the_splits_and_epochs_it_ran(tmp_path, monkeypatch):
    _fake_uci_results(monkeypatch, {s: (1.0 + s, -1.0, False, 0.0, 0.0) for s in range(3)})
    _toy_uci_folder(tmp_path, np.random.default_rng(9).normal(size=(12, 3)), "yacht", 3)
    out = tmp_path / "q.json"
    main(["uci", "--quick", "--data-dir", str(tmp_path), "--dataset", "yacht", "--method", "adam",
          "--out", str(out)])
    record = json.loads(out.read_text())
    assert record["settings"]["splits"] == uci.QUICK_SPLITS and record["settings"]["epochs"] == uci.QUICK_EPOCHS
    (summary,) = record["results"]["summaries"]
    assert summary["n_splits"] == uci.QUICK_SPLITS and summary["epochs"] == uci.QUICK_EPOCHS


def test_an_incomplete_uci_folder_names_each_missing_file(tmp_path):
    """Every file the loader reads is checked before training (a missing one would otherwise surface
    as a traceback from np.loadtxt, after the other data sets had trained)."""
    common = ["data.txt", "n_splits.txt", "n_hidden.txt", "index_features.txt", "index_target.txt"]
    for name in common + ["index_train_0.txt"]:
        root = tmp_path / name
        root.mkdir()
        folder = _toy_uci_folder(root, np.random.default_rng(14).normal(size=(12, 3)))
        (folder / name).unlink()
        with pytest.raises(SystemExit, match=rf"incomplete \(missing: {re.escape(name)}\)"):
            uci.check_dataset(root, "toy", 0, None)


def _tiny(dense=keras.layers.Dense, conv=None):
    return keras.Sequential([keras.Input((6,)), dense(8, activation="relu"), dense(speed.NUM_CLASSES)],
                            name="tiny")


def test_state_bytes_count_every_variable_at_its_own_width():
    """Against the byte sizes of the variables' values: Adam's iteration counter is int64, a float64
    model's moments take 8 bytes each."""
    for dtype in ("float32", "float64"):
        variables = [keras.Variable(np.zeros((3, 4)), dtype=dtype), keras.Variable(np.zeros(5), dtype=dtype)]
        optimizer = keras.optimizers.Adam()
        optimizer.build(variables)
        expected = sum(np.asarray(v.numpy()).nbytes for v in optimizer.variables)
        assert expected >= 2 * 17 * np.dtype(dtype).itemsize + 8
        assert speed.state_bytes(optimizer) == expected


def test_speed_measure_takes_medians_rotates_the_order_and_divides_by_the_first_row(monkeypatch):
    """The timings are stubbed: rows hold the median of the repeats, ratios to the first optimizer, the
    optimizers are interleaved with their order rotated, and skipped updates flag the row."""
    monkeypatch.setitem(speed.MODELS, "tiny", _tiny)
    walls = {"Adam": [4.0, 1.0, 10.0], "NoisyAdam": [6.0, 8.0, 7.0], "Vadam": [3.0, 30.0, 5.0]}
    cpus = {"Adam": [2.0, 6.0, 5.0], "NoisyAdam": [9.0, 1.0, 5.0], "Vadam": [12.0, 10.0, 11.0]}
    losses = {"Adam": [3.0, 2.0, 1.0], "NoisyAdam": [3.5, 2.5, 1.5], "Vadam": [4.0, 3.0, 2.0]}
    skipped = {"Adam": [0, 0, 0], "NoisyAdam": [0, 0, 0], "Vadam": [1, 0, 2]}
    calls = []

    def fake_ms_per_step(model, dataset, steps):
        name = type(model.optimizer).__name__
        k = calls.count(name)
        calls.append(name)
        return walls[name][k], cpus[name][k], losses[name][k], skipped[name][k], 0

    monkeypatch.setattr(speed, "_ms_per_step", fake_ms_per_step)
    monkeypatch.setattr(speed, "_update_cpu_ms", lambda optimizer, variables, jit_compile=False: 3.0)
    rows = speed.measure("tiny", ("Adam", "NoisyAdam", "Vadam"), steps=1, repeats=3, warmup_steps=0)

    assert calls == ["Adam", "NoisyAdam", "Vadam", "NoisyAdam", "Vadam", "Adam", "Vadam", "Adam", "NoisyAdam"]
    assert [r["optimizer"] for r in rows] == ["Adam", "NoisyAdam", "Vadam"]
    for row in rows:
        name = row["optimizer"]
        assert row["ms_per_step"] == float(np.median(walls[name]))
        assert row["cpu_ms_per_step"] == float(np.median(cpus[name]))
        assert row["step_time_ratio"] == pytest.approx(np.median(walls[name]) / np.median(walls["Adam"]))
        assert row["cpu_time_ratio"] == pytest.approx(np.median(cpus[name]) / np.median(cpus["Adam"]))
        assert row["state_bytes_ratio"] == pytest.approx(row["state_bytes"] / rows[0]["state_bytes"])
        assert row["final_loss"] == losses[name][-1]
        assert row["skipped_updates"] == sum(skipped[name])
        assert row["trained"] == (name != "Vadam")
        assert row["update_cpu_ms_over_reference_step"] == pytest.approx(3.0 / np.median(cpus["Adam"]))
    assert rows[1]["state_bytes_ratio"] > 1.0          # NoisyAdam holds more state than Adam


def test_speed_amortises_the_kfac_inverse_update_over_t_inv(monkeypatch):
    """amortised ratio = inverse-update CPU ms / T_inv / reference CPU ms per step; the warm-up flag is
    off once the untimed steps reach T_inv."""
    monkeypatch.setitem(speed.MODELS, "tiny", _tiny)
    make_optimizer = speed._make_optimizer
    monkeypatch.setattr(speed, "_make_optimizer", lambda name: tfnng.optimizers.NoisyKFAC(
        learning_rate=1e-3, num_examples=100, stats_every=1, inverse_every=2, seed=0)
        if name == "NoisyKFAC" else make_optimizer(name))
    monkeypatch.setattr(speed, "_ms_per_step", lambda model, dataset, steps: (2.0, 5.0, 1.0, 0, 0))
    monkeypatch.setattr(speed, "_update_cpu_ms", lambda optimizer, variables, jit_compile=False: 1.0)
    monkeypatch.setattr(speed, "_inverse_update_cpu_ms", lambda optimizer, jit_compile=False: 40.0)
    for warmup_steps, timed_during_warmup in ((2, False), (1, True)):
        rows = speed.measure("tiny", ("Adam", "NoisyKFAC"), steps=1, repeats=1, warmup_steps=warmup_steps,
                             batch_size=4)
        kfac = rows[1]
        assert kfac["inverse_every"] == 2
        assert kfac["amortised_inverse_update_ratio"] == pytest.approx(40.0 / 2 / 5.0)
        assert kfac["inverse_warmup_timed"] is timed_during_warmup


def test_speed_milliseconds_per_step_from_the_clocks(monkeypatch):
    """A fake clock (no wall-clock assertion): 0.5 s wall and 1 s CPU over 5 steps are 100 and 200 ms."""
    walls, cpus = iter([10.0, 10.5]), iter([1.0, 2.0])
    monkeypatch.setattr(speed, "time", types.SimpleNamespace(perf_counter=lambda: next(walls),
                                                             process_time=lambda: next(cpus)))
    keras.utils.set_random_seed(0)
    model = _tiny()
    model.compile(optimizer=keras.optimizers.Adam(), loss=tfnng.losses.CategoricalNLL())
    wall, cpu, loss, skipped, failed = speed._ms_per_step(model, speed._batch(model, 4), 5)
    assert (wall, cpu) == pytest.approx((100.0, 200.0)) and math.isfinite(loss)
    assert skipped == failed == 0


def test_speed_optimizers_are_the_ones_the_rows_name():
    assert speed._make_optimizer("SLANG").rank == speed.SLANG_RANK
    assert speed._make_optimizer("VOGN-empirical").fisher == "empirical"
    assert speed._make_optimizer("VOGN").fisher != "empirical"


def test_speed_models_of_all_optimizers_start_from_the_same_weights(monkeypatch):
    monkeypatch.setitem(speed.MODELS, "tiny", _tiny)
    models = speed._compiled_models("tiny", ("Adam", "NoisyAdam", "VOGN"), jit_compile=False)
    weights = [[np.asarray(v) for v in m.trainable_variables] for m in models.values()]
    for other in weights[1:]:
        for a, b in zip(weights[0], other):
            np.testing.assert_array_equal(a, b)


def test_digits_load_scales_pixels_to_the_unit_interval_and_stratifies():
    from sklearn.datasets import load_digits
    digits = load_digits()
    x_train, x_test, y_train, y_test = kfac_digits.load(test_fraction=0.3, seed=0)
    assert x_train.shape[1:] == (8, 8, 1) and x_train.min() == 0.0 and x_train.max() == 1.0
    assert len(x_test) == math.ceil(0.3 * len(digits.target)) and len(x_train) + len(x_test) == 1797
    for label in range(10):                            # stratified: each class split 70/30 to +-1
        total = np.sum(digits.target == label)
        assert abs(np.sum(y_test == label) - 0.3 * total) <= 1.0


def test_digits_map_and_kfac_penalties_are_the_gaussian_prior():
    """-log N(w; 0, s^2) / N = |w|^2 / (2 N s^2): Keras's L2(l) adds l |w|^2 (l = 1 / (2 N s^2)), KFAC's
    l2 adds (l2 / 2) |w|^2 (l2 = 1 / (N s^2))."""
    n = 250
    expected = 1.0 / (n * kfac_digits.PRIOR_VARIANCE)
    adam = kfac_digits.make_model("adam", n, 1e-3, seed=0)
    for layer in adam.layers:
        if layer.weights:
            assert layer.kernel_regularizer.l2 == pytest.approx(expected / 2)
    kfac = kfac_digits.make_model("kfac", n, 1e-2, seed=0)
    assert kfac.optimizer.l2 == pytest.approx(expected)


def test_digits_kfac_methods_use_the_documented_schedule():
    """Module docstring / NNG App. C.2: T_stats = 10, T_inv = 200, beta~ = 0.01, kl_clip 1e-3 decayed
    every epoch."""
    for method in ("noisy_kfac", "kfac"):
        optimizer = kfac_digits.make_model(method, 300, 1e-2, seed=0, steps_per_epoch=7).optimizer
        config = optimizer.get_config()
        assert (config["stats_every"], config["inverse_every"], config["stat_decay"]) == (10, 200, 0.01)
        assert config["kl_clip"] == 1e-3 and config["kl_clip_decay_steps"] == 7


def test_digits_run_method_reports_the_metrics_of_its_predictive(monkeypatch):
    """accuracy, NLL and 15-bin ECE recomputed with NumPy from the predictive the method produced; the
    requested number of samples reaches tfnng.predict; the kl-clip decays once per (partial) epoch."""
    x_train, x_test, y_train, y_test = kfac_digits.load(0.3, 0)
    data = (x_train[:200], x_test[:120], y_train[:200], y_test[:120])
    predictions, steps_per_epoch = _recorded_predictions(monkeypatch), []
    make_model = kfac_digits.make_model

    def record_make_model(*args, **kwargs):
        steps_per_epoch.append(kwargs.get("steps_per_epoch"))
        return make_model(*args, **kwargs)

    monkeypatch.setattr(kfac_digits, "make_model", record_make_model)
    monkeypatch.setitem(kfac_digits.DEFAULT_LEARNING_RATES, "adam", 0.01)   # over- and underconfident bins after 15 short epochs
    row = kfac_digits.run_method("adam", data, epochs=15, batch_size=32, num_samples=3, seed=0)
    again = kfac_digits.run_method("adam", data, epochs=15, batch_size=32, num_samples=3, seed=0)

    assert [n for n, _ in predictions] == [3, 3] and steps_per_epoch == [7, 7]   # ceil(200 / 32)
    assert np.ptp(np.max(predictions[0][1].probs, axis=1)) > 0.3           # confidences spread over bins
    probs = np.asarray(predictions[0][1].probs, np.float64)
    labels = data[3]
    assert row["accuracy"] == pytest.approx(np.mean(np.argmax(probs, axis=1) == labels))
    assert row["nll"] == pytest.approx(-np.mean(np.log(probs[np.arange(len(labels)), labels])), rel=1e-4)
    confidence, correct = probs.max(axis=1), np.argmax(probs, axis=1) == labels
    ece = 0.0
    for lo, hi in zip(np.arange(15) / 15, np.arange(1, 16) / 15):
        members = (confidence > lo) & (confidence <= hi) if lo > 0 else confidence <= hi
        if members.any():
            ece += members.mean() * abs(correct[members].mean() - confidence[members].mean())
    assert row["ece"] == pytest.approx(ece, abs=1e-9)
    assert len(row["reliability"]["counts"]) == 15
    assert (again["accuracy"], again["nll"]) == (row["accuracy"], row["nll"])     # seeded


def test_digits_run_writes_the_reliability_png_beside_the_json(tmp_path, monkeypatch):
    row = {"method": "adam", "accuracy": 0.5, "nll": 1.0, "ece": 0.1, "train_seconds": 0.0,
           "reliability": {k: np.asarray(v).tolist() for k, v in tfnng.metrics.reliability_diagram_data(
               [0, 1], [[0.9, 0.1], [0.4, 0.6]])._asdict().items()}}
    monkeypatch.setattr(kfac_digits, "run_method", lambda *args: row)
    main(["kfac_digits", "--methods", "adam", "--epochs", "1", "--out", str(tmp_path / "d.json")])
    assert (tmp_path / "d_reliability.png").stat().st_size > 0
    record = json.loads((tmp_path / "d.json").read_text())
    assert record["settings"]["png"] == str(tmp_path / "d_reliability.png")
    assert record["settings"]["learning_rates"]["adam"] > 0 and record["results"]["rows"][0]["method"] == "adam"
