"""Helpers shared by the benchmark tasks: command-line values, fixed-width tables, JSON records."""

import argparse
import datetime
import json
import math
import os
import platform
import subprocess
import sys
from pathlib import Path

import numpy as np


def parse_names(text, known, kind, allow_all=False):
    """The names in the comma-separated ``text``, all in ``known`` (``"all"`` gives every known name
    when ``allow_all``); stops the command with a message naming the unknown ones."""
    if allow_all and text == "all":
        return list(known)
    names = text.split(",")
    unknown = [n for n in names if n not in known]
    if unknown:
        choices = ", ".join(known) + (" or 'all'" if allow_all else "")
        raise SystemExit(f"unknown {kind} {', '.join(unknown)}; choose from {choices}")
    return check_unique(names, kind)


def check_unique(names, kind):
    """``names``, after stopping the command if one of them is given more than once."""
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise SystemExit(f"{kind} {', '.join(repeated)} given more than once")
    return names


def _int_at_least(minimum, text):
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < minimum:
        raise argparse.ArgumentTypeError(f"{value} is less than {minimum}")
    return value


def positive_int(text):
    """argparse type: an integer >= 1 (a count of epochs, steps, splits, samples, examples)."""
    return _int_at_least(1, text)


def non_negative_int(text):
    """argparse type: an integer >= 0 (an index, or a count that may be zero)."""
    return _int_at_least(0, text)


def open_fraction(text):
    """argparse type: a float strictly between 0 and 1."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0.0 < value < 1.0:
        raise argparse.ArgumentTypeError(f"{value} is not strictly between 0 and 1")
    return value


def check_writable(path, option):
    """Stop the command at once (not after the benchmark ran) unless a file can be written at
    ``path``; creates its parent folders, as :func:`write_json` would."""
    parent = Path(path).parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise SystemExit(f"{option} {path}: cannot create {parent}: {error.strerror}") from None
    # Opening the file is the only reliable test (os.access says yes to root on read-only file
    # systems such as /proc); a file that did not exist is removed again.
    try:
        existed = Path(path).exists()
        with open(path, "a"):
            pass
    except OSError as error:
        raise SystemExit(f"{option} {path}: cannot write this file: {error.strerror}") from None
    if not existed:
        os.remove(path)


def check_figure_path(path, option):
    """:func:`check_writable`, and a suffix matplotlib can save a figure as (it tells the format):
    a figure that cannot be saved failed after the whole run."""
    from matplotlib.backend_bases import FigureCanvasBase

    formats = FigureCanvasBase.get_supported_filetypes()
    if Path(path).suffix.lstrip(".").lower() not in formats:
        raise SystemExit(f"{option} {path}: matplotlib saves figures as "
                         f"{', '.join('.' + f for f in sorted(formats))}; give one of these suffixes.")
    check_writable(path, option)


def format_table(headers, rows):
    """Return ``rows`` (sequences of already formatted cells) as a fixed-width text table."""
    cells = [[str(c) for c in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def print_table(headers, rows, title=None):
    """Print :func:`format_table` to stdout, optionally under a title line."""
    if title:
        print(title)
    print(format_table(headers, rows), flush=True)


def mean_and_standard_error(values):
    """Mean and standard error (sample std with ddof=1 over sqrt(n); None for n < 2) of ``values``."""
    values = np.asarray(values, dtype=np.float64)
    se = float(values.std(ddof=1) / math.sqrt(values.size)) if values.size > 1 else None
    return float(values.mean()), se


def format_mean_se(mean, se, digits=3):
    """``"mean ± se"`` with ``digits`` decimals (``"mean ± n/a"`` when se is None)."""
    se_text = "n/a" if se is None else f"{se:.{digits}f}"
    return f"{mean:.{digits}f} ± {se_text}"


def code_version():
    """tfnng's version and, when it runs from a git checkout, the commit and whether the code differs
    from it: a tracked file changed, or an untracked file in the package (None where git or the
    checkout is not available, and for a copy installed inside another repository, e.g. a project's
    virtualenv)."""
    import tfnng

    root = Path(tfnng.__file__).resolve().parents[1]

    def git(*args):
        try:
            done = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True,
                                  timeout=10)
        except (OSError, subprocess.SubprocessError):
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    top = git("rev-parse", "--show-toplevel")
    commit = git("rev-parse", "HEAD") if top and Path(top).resolve() == root else None
    changes = None
    if commit:
        tracked = git("status", "--porcelain", "--untracked-files=no")
        untracked = git("ls-files", "--others", "--exclude-standard", "--", "tfnng")
        if tracked is not None and untracked is not None:
            changes = bool(tracked or untracked)
    return {"tfnng": tfnng.__version__, "commit": commit, "uncommitted_changes": changes}


def machine_info():
    """Platform, CPU model and count, Python, TensorFlow/Keras versions and TensorFlow's thread
    settings of this process."""
    import keras
    import tensorflow as tf

    return {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "processor": platform.processor() or _cpu_model(),
        "python": sys.version.split()[0],
        "cpu_count": os.cpu_count(),
        "tensorflow": tf.__version__,
        "keras": keras.__version__,
        "gpus": [d.name for d in tf.config.list_physical_devices("GPU")],
        "threads": {name: os.environ.get(name)
                    for name in ("TF_NUM_INTRAOP_THREADS", "TF_NUM_INTEROP_THREADS")},
    }


def _cpu_model():
    """The CPU's model name from /proc/cpuinfo (Linux, where ``platform.processor()`` is empty)."""
    try:
        with open("/proc/cpuinfo") as info:
            return next((line.split(":", 1)[1].strip() for line in info
                         if line.startswith("model name")), "")
    except OSError:
        return ""


def _jsonable(value):
    """Recursively convert numpy scalars/arrays to Python values and non-finite floats to None."""
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, np.ndarray):
        return _jsonable(value.tolist())
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def write_json(path, task, command, settings, results, code=None):
    """Write a benchmark record to ``path`` (parent folders are created) and return the record.

    The record holds the task name, the ``command`` line (list of strings), the date (UTC, ISO 8601),
    ``code`` (:func:`code_version` taken when the run started, as the command line does: a commit
    made during a run is not the code that ran; None: taken now), :func:`machine_info`, the task's
    ``settings`` and its ``results``; NaN/inf become ``null``.
    """
    record = {
        "task": task,
        "command": list(command),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "code": code_version() if code is None else code,
        "machine": machine_info(),
        "settings": settings,
        "results": results,
    }
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_jsonable(record), indent=2, allow_nan=False) + "\n")
    print(f"wrote {path}", flush=True)
    return record
