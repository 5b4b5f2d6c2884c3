"""kfac_digits: --test-fraction accepts any value strictly between 0 and 1 (argparse type
`open_fraction`), but values that leave fewer than 10 examples (one per class) on either side of
the stratified split crash with a scikit-learn ValueError traceback instead of a usage error.

Expected: a usage error (exit code 2, 'error: argument --test-fraction ...' or a clear SystemExit
message) before any work.  Actual: Traceback ... ValueError: The test_size = 2 should be greater
or equal to the number of classes = 10 (exit code 1).
Fix: tfnng/bench/kfac_digits.py run()/load(): check that round(f * 1797) and the train part hold
at least NUM_CLASSES examples (or catch the ValueError and raise SystemExit).
"""
import os, subprocess, sys
HERE = os.path.dirname(os.path.abspath(__file__))
env = dict(os.environ, PYTHONPATH="/tmp/s23/snap", TF_CPP_MIN_LOG_LEVEL="2")
bad = False
for frac in ("0.001", "0.999"):
    p = subprocess.run([sys.executable, "-m", "tfnng.bench", "kfac_digits", "--methods", "adam", "--epochs", "1",
                        "--test-fraction", frac, "--out", os.path.join(HERE, "out", "bug01.json")],
                       cwd=HERE, env=env, capture_output=True, text=True, timeout=300)
    tb = "Traceback" in p.stderr
    print(f"--test-fraction {frac}: exit {p.returncode}, traceback: {tb}; last line: {p.stderr.strip().splitlines()[-1]}")
    bad |= tb
sys.exit(1 if bad else 0)
