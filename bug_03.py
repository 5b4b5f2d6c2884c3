"""tutorials/regression_uncertainty.py (and classification_calibration.py, same code path):
`--out` with an extension matplotlib cannot write (e.g. bands.txt, or no-typo 'bands.PNG.old')
is accepted, the model trains, and the script then dies with a matplotlib ValueError traceback
after all the work. The other arguments of the tutorials are validated up front (--epochs,
--kl-weight give usage errors).

Expected: a usage error before training (or a default format).  Actual: Traceback ...
ValueError: Format 'txt' is not supported.
Fix: tutorials/regression_uncertainty.py / classification_calibration.py main(): check
Path(args.out).suffix against matplotlib's supported formats (plt.gcf().canvas.get_supported_filetypes())
with parser.error before training. Severity: low.
"""
import os, subprocess, sys
HERE = os.path.dirname(os.path.abspath(__file__))
env = dict(os.environ, PYTHONPATH="/tmp/s23/snap", TF_CPP_MIN_LOG_LEVEL="2", TF_NUM_INTRAOP_THREADS="1")
p = subprocess.run([sys.executable, "/tmp/s23/snap/tutorials/regression_uncertainty.py", "--smoke",
                    "--out", os.path.join(HERE, "out", "bug03_bands.txt")],
                   cwd=HERE, env=env, capture_output=True, text=True, timeout=300)
tb = "Traceback" in p.stderr
print(f"exit {p.returncode}; traceback: {tb}; trained first: {'Epoch 1/' in p.stdout + p.stderr}")
print("last line:", p.stderr.strip().splitlines()[-1] if p.stderr.strip() else "")
sys.exit(1 if tb else 0)
