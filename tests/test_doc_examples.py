"""The ```python examples of README.md and docs/*.md run.

Every ```python block of a page runs, in the order of the page, in ONE namespace per page (later
snippets continue earlier ones, e.g. ``model`` from the first block), after a small per-page
prelude (``PRELUDES`` below) that provides the free names the page's snippets assume (``x, y,
x_train, ..., model, net, optimizer, N, B, dataset, seed_generator``): tiny synthetic data with
the shapes the page's examples need, and models compiled with a tfnng optimizer (with a posterior
where a page predicts from the model it is given). The preludes provide no modules: a page's
snippets import what they use. One test per page, so a failure names the page and the block's line
(tracebacks give the page's line numbers).

To keep the runs fast, exactly two rewrites are applied to the snippet text (``_fast``), nothing
else: ``epochs=<int>`` becomes ``epochs=min(<int>, cap)`` with ``cap`` the page's ``epochs`` entry
in ``PRELUDES`` (1 unless stated there, with the reason), and ``num_samples=<int>`` becomes
``num_samples=min(<int>, NUM_SAMPLES)``.

A block that cannot run in a test (e.g. it needs a multi-machine cluster, or has ``...``
placeholders) is skipped only when the line directly above its fence is
``<!-- doctest: skip (reason) -->`` with a non-empty reason; each such block is reported by pytest
as a skipped test with that reason. Each page runs in its own ``tmp_path`` as the working directory
(the examples write ``model.keras``, ``logs/``, ``export/``, ``backup/``), from a cleared Keras
session and a fixed seed; the global mixed-precision policy is restored afterwards.
"""

import linecache
import re
import traceback
from pathlib import Path

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfnng

ROOT = Path(__file__).parents[1]
NUM_SAMPLES = 3
FENCE = re.compile(r"^(?P<indent>[ \t]*)```python[ \t]*$")
SKIP = re.compile(r"^[ \t]*<!--\s*doctest:\s*skip\s*\((?P<reason>.*)\)\s*-->[ \t]*$")
ANY_MARKER = re.compile(r"<!--\s*doctest")
EPOCHS = re.compile(r"\bepochs=(\d+)")
SAMPLES = re.compile(r"\bnum_samples=(\d+)")


def _pages():
    return [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))


def _name(page):
    return page.relative_to(ROOT).as_posix()


def parse_blocks(text):
    """``[(line, source, skip_reason)]`` of the ```python blocks of a Markdown text.

    ``line`` is the 1-based line of the opening fence; ``source`` is dedented by the fence's
    indentation (blocks inside list items); ``skip_reason`` is None unless the line directly above
    the fence is a ``<!-- doctest: skip (reason) -->`` marker. A marker anywhere else, or with an
    empty reason, is an error (it would silently not do what it says).
    """
    lines = text.splitlines()
    blocks, i, used_markers = [], 0, set()
    while i < len(lines):
        match = FENCE.match(lines[i])
        if not match:
            i += 1
            continue
        indent, start = match["indent"], i
        close = re.compile(rf"^{re.escape(indent)}```[ \t]*$")
        body = []
        i += 1
        while i < len(lines) and not close.match(lines[i]):
            line = lines[i]
            if line.strip() and not line.startswith(indent):
                raise ValueError(f"line {i + 1}: less indented than its fence at line {start + 1}")
            body.append(line[len(indent):])
            i += 1
        if i == len(lines):
            raise ValueError(f"unclosed ```python fence at line {start + 1}")
        reason = None
        if start > 0:
            marker = SKIP.match(lines[start - 1])
            if marker:
                reason = marker["reason"].strip()
                if not reason:
                    raise ValueError(f"line {start}: a doctest skip marker needs a reason")
                used_markers.add(start - 1)
        blocks.append((start + 1, "\n".join(body) + "\n", reason))
        i += 1
    stray = [n + 1 for n, line in enumerate(lines)
             if ANY_MARKER.search(line) and n not in used_markers]
    if stray:
        raise ValueError(f"doctest markers not directly above a ```python fence: lines {stray}")
    return blocks


def _fast(source, epochs):
    """The two documented rewrites: fewer epochs and fewer Monte Carlo samples."""
    source = EPOCHS.sub(lambda m: f"epochs={min(int(m[1]), epochs)}", source)
    return SAMPLES.sub(lambda m: f"num_samples={min(int(m[1]), NUM_SAMPLES)}", source)


# ----------------------------------------------------------------------------------------------
# Per-page preludes: the free names of each page's snippets, with tiny data.

def _regression(n, features, seed=0):
    """``n`` examples of a linear-plus-noise regression problem: float32 (n, features), (n,)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, features)).astype("float32")
    w = rng.standard_normal(features).astype("float32")
    return x, (x @ w / np.sqrt(features) + 0.3 * rng.standard_normal(n)).astype("float32")


def _classification(n, features, classes, seed=0):
    """``n`` examples of a ``classes``-class problem: float32 (n, features), int labels (n,)."""
    rng = np.random.default_rng(seed)
    centres = 2.0 * rng.standard_normal((classes, features))
    labels = rng.integers(0, classes, n)
    return (centres[labels] + rng.standard_normal((n, features))).astype("float32"), labels


def _digits(n):
    """The first ``n`` of scikit-learn's 8x8 digits, float32 (n, 8, 8, 1) in [0, 1], labels (n,)."""
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    return (x[:n] / 16.0).reshape(-1, 8, 8, 1).astype("float32"), y[:n]


def _splits(x, y, n_train, n_val):
    """Train / validation / test names of ``(x, y)``."""
    return dict(x_train=x[:n_train], y_train=y[:n_train],
                x_val=x[n_train:n_train + n_val], y_val=y[n_train:n_train + n_val],
                x_test=x[n_train + n_val:], y_test=y[n_train + n_val:])


def _classifier(x, classes):
    """A small classifier compiled with NoisyAdam whose optimizer is built, so that it has a
    posterior to predict from (centred at the initial weights; cheaper than training)."""
    model = keras.Sequential([keras.Input(x.shape[1:]), keras.layers.Dense(classes)])
    model.compile(optimizer=tfnng.optimizers.NoisyAdam(learning_rate=1e-2, num_examples=len(x)),
                  loss=tfnng.losses.CategoricalNLL())
    model.optimizer.build(model.trainable_variables)
    return model


def _readme():
    return {}                        # self-contained: loads scikit-learn's diabetes data itself


def _callbacks():
    # Regression with 13 features; ``model``, an uncompiled plain Keras net (the page compiles it).
    x, y = _regression(96, 13)
    names = _splits(x, y, 64, 32)
    names["model"] = keras.Sequential([keras.Input((13,)), keras.layers.Dense(8, activation="relu"),
                                       keras.layers.Dense(1)])
    return names


def _diagonal():
    x, y = _regression(96, 13)
    return dict(x=x[:64], y=y[:64], x_test=x[64:], y_test=y[64:])


def _distributed():
    # Regression with 10 features (the page's diabetes-sized net); the hand-written loop's
    # dataset of (x, y) pairs, its size N and global batch size B.
    x, y = _regression(96, 10)
    return dict(x=x[:64], y=y[:64], x_test=x[64:], N=64, B=32,
                dataset=tf.data.Dataset.from_tensor_slices((x[:64], y[:64])))


def _index():
    # Classification (the block ends with the ECE of ``labels``).
    x, y = _classification(64, 4, 3)
    return dict(x=x, y=y, labels=y, model=_classifier(x, 3))


def _kfac():
    # 8x8x1 images, 10 classes; the hand-written loop's fresh ``optimizer`` and the
    # ``keras.random.SeedGenerator`` of its true-Fisher targets.
    x, y = _digits(160)
    names = _splits(x, y, 96, 32)
    names["optimizer"] = tfnng.optimizers.NoisyKFAC(learning_rate=0.01, num_examples=96)
    names["seed_generator"] = keras.random.SeedGenerator(0)
    return names


def _per_example():
    x, y = _regression(96, 13)
    return dict(x=x[:64], y=y[:64], x_test=x[64:])


def _predictive():
    # Classification (the reliability diagram needs class probabilities); the regression fields
    # of the listing are then None, and the listing still checks their names.
    x, y = _classification(96, 4, 3)
    return dict(x_test=x[64:], y_test=y[64:], model=_classifier(x[:64], 3))


def _noisy_adam_regressor(x, y=None):
    """A 13-feature regression net compiled with NoisyAdam and GaussianNLL, trained for one epoch
    on ``(x, y)`` when ``y`` is given (else only built and compiled)."""
    model = keras.Sequential([keras.Input((13,)), keras.layers.Dense(8, activation="relu"),
                              keras.layers.Dense(1)])
    model.compile(optimizer=tfnng.optimizers.NoisyAdam(learning_rate=1e-2, num_examples=len(x)),
                  loss=tfnng.losses.GaussianNLL(0.5))
    if y is not None:
        model.fit(x, y, batch_size=32, epochs=1, verbose=0)
    return model


def _saving():
    # Regression with 13 features: ``model`` trained for one epoch; ``fresh``, the same model
    # built and compiled the same way; ``path``, a tf.train.Checkpoint of ``model``.
    x, y = _regression(64, 13)
    model = _noisy_adam_regressor(x, y)
    path = tf.train.Checkpoint(model=model, optimizer=model.optimizer).save("checkpoint/model")
    return dict(x=x, y=y, model=model, fresh=_noisy_adam_regressor(x), path=path)


def _serving():
    # Regression with 10 features (as the page's REST requests); ``model`` compiled with NoisyAdam
    # and GaussianNLL; ``x_new`` float32, the exported signatures' input type.
    x, y = _regression(80, 10)
    model = keras.Sequential([keras.Input((10,)), keras.layers.Dense(8, activation="relu"),
                              keras.layers.Dense(1)])
    model.compile(optimizer=tfnng.optimizers.NoisyAdam(learning_rate=1e-2, num_examples=64),
                  loss=tfnng.losses.GaussianNLL(0.5))
    return dict(x=x[:64], y=y[:64], x_new=x[64:], model=model)


def _which_optimizer():
    # Regression with 13 features: ``model`` trained for one epoch with NoisyAdam, and its ``loss``.
    x, y = _regression(64, 13)
    model = _noisy_adam_regressor(x, y)
    return dict(x=x, y=y, model=model, loss=model.loss)


# page -> (prelude, epochs cap)
PRELUDES = {
    "README.md": (_readme, 1),
    # PredictiveValidation(every=5) first scores at the end of epoch 5, and the block reads
    # history.history["val_pred_nll"].
    "docs/callbacks.md": (_callbacks, 5),
    "docs/diagonal.md": (_diagonal, 1),
    "docs/distributed.md": (_distributed, 1),
    "docs/index.md": (_index, 1),
    "docs/kfac.md": (_kfac, 1),
    "docs/per_example.md": (_per_example, 1),
    "docs/predictive.md": (_predictive, 1),
    "docs/saving.md": (_saving, 1),
    "docs/serving.md": (_serving, 1),
    "docs/which_optimizer.md": (_which_optimizer, 1),
}
EXAMPLE_PAGES = [page for page in _pages() if "```python" in page.read_text(encoding="utf-8")]


def test_parser_finds_indented_and_marked_blocks_and_rejects_bad_markers():
    text = ("# Page\n\n```python\na = 1\n```\n\n- item:\n\n  ```python\n  b = a\n    c = 2\n"
            "  ```\n\n<!-- doctest: skip (needs a cluster) -->\n```python\nmodel = ...\n```\n\n"
            "```bash\nls\n```\n")
    assert parse_blocks(text) == [(3, "a = 1\n", None), (9, "b = a\n  c = 2\n", None),
                                  (15, "model = ...\n", "needs a cluster")]
    with pytest.raises(ValueError, match="needs a reason"):
        parse_blocks("<!-- doctest: skip ( ) -->\n```python\npass\n```\n")
    with pytest.raises(ValueError, match="not directly above"):
        parse_blocks("<!-- doctest: skip (why) -->\n\n```python\npass\n```\n")
    with pytest.raises(ValueError, match="unclosed"):
        parse_blocks("```python\npass\n")
    assert _fast("fit(x, epochs=40); predict(m, x, num_samples=100)", 5) == \
        f"fit(x, epochs=5); predict(m, x, num_samples={NUM_SAMPLES})"


def test_every_page_with_examples_has_a_prelude():
    assert EXAMPLE_PAGES, "no ```python blocks found at all"
    assert {_name(page) for page in EXAMPLE_PAGES} == set(PRELUDES)


@pytest.fixture
def fresh_keras_state():
    """A cleared Keras session and fixed seeds before; the global dtype policy restored after."""
    policy = keras.mixed_precision.global_policy().name
    keras.backend.clear_session(free_memory=False)      # no gc.collect(): seconds on a busy CPU
    keras.utils.set_random_seed(0)
    try:
        yield
    finally:
        keras.mixed_precision.set_global_policy(policy)


@pytest.mark.parametrize("page", EXAMPLE_PAGES, ids=_name)
def test_examples_run(page, tmp_path, monkeypatch, fresh_keras_state):
    name = _name(page)
    text = page.read_text(encoding="utf-8")
    blocks = parse_blocks(text)
    skipped = [line for line, _, reason in blocks if reason is not None]
    # The parser against a plain count: no block may go missing.
    assert len(blocks) == text.count("```python"), f"{name}: the parser missed a ```python block"

    monkeypatch.chdir(tmp_path)
    prelude, epochs = PRELUDES[name]
    namespace = {"__name__": f"doc_examples_{page.stem}", **prelude()}
    executed = 0
    for line, source, reason in blocks:
        if reason is not None:
            continue
        filename = f"{name}, block at line {line}"
        # Blank lines in front: line numbers in tracebacks are the page's. Registered in linecache
        # so that tracebacks, inspect.getsource and autograph see the snippet's text.
        source = "\n" * line + _fast(source, epochs)
        linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
        try:
            exec(compile(source, filename, "exec"), namespace)
        except Exception:
            error = traceback.format_exc()
        else:
            error = None
        if error:
            pytest.fail(f"{name}: the block at line {line} failed:\n{error}", pytrace=False)
        executed += 1

    assert executed == len(blocks) - len(skipped)


SKIPPED = [(page, line, reason) for page in EXAMPLE_PAGES
           for line, _, reason in parse_blocks(page.read_text(encoding="utf-8"))
           if reason is not None]


@pytest.mark.parametrize("page, line, reason", SKIPPED,
                         ids=[f"{_name(page)}:{line}" for page, line, _ in SKIPPED])
def test_marked_blocks_are_reported_as_skipped(page, line, reason):
    """One visible skip per block marked ``<!-- doctest: skip (reason) -->``, with its reason."""
    pytest.skip(f"{_name(page)}, block at line {line}: {reason}")
