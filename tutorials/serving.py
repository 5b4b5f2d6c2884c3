"""Tutorial: serve a Bayesian network's predictive distribution with TensorFlow Serving.

A small Keras net is trained by noisy Adam on scikit-learn's diabetes data (bundled, no download)
with a learned Gamma noise precision, and exported with ``tfnng.serving.export``: a SavedModel whose
signatures draw weight samples from the posterior *inside the graph* and return the predictive mean,
its epistemic and aleatoric variance and the per-sample predictions. The script loads the SavedModel
back with plain TensorFlow, calls both signatures (fresh samples, and reproducible samples from a
seed), compares the served mean with ``tfnng.predict``, and prints what serving it takes:

* the TF Serving ``docker run`` command line (TF Serving wants ``<model_base_path>/<version>``, so
  the model is written to ``<out>/diabetes/1``);
* ``<out>/request.json``, a REST request body built from three real test rows, and the ``curl``
  command that posts it, plus the body of a seeded request.

Docker is not available where this tutorial was written and tested: the printed commands were not
run here. What is checked is the SavedModel itself (loaded and called with TensorFlow).

Run: ``python tutorials/serving.py [--out serving_demo] [--smoke]``
(``--smoke`` trains for a few epochs only; the test suite runs it so the tutorial cannot rot.)
"""

import argparse
import json
import shlex
from pathlib import Path

import keras
import numpy as np
import tensorflow as tf
from sklearn.datasets import load_diabetes
from sklearn.model_selection import train_test_split
from sklearn.preprocessing import StandardScaler

import tfnng
from tfnng import serving

MODEL_NAME = "diabetes"
OUTPUTS = ("mean", "variance", "epistemic_variance", "aleatoric_variance", "samples")


def make_data(seed=0):
    """Standardised diabetes features and targets, split 80/20."""
    x, y = load_diabetes(return_X_y=True)
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.2, random_state=seed)
    scaler = StandardScaler().fit(x_train)
    y_mean, y_std = y_train.mean(), y_train.std()
    return (scaler.transform(x_train).astype("float32"),
            ((y_train - y_mean) / y_std)[:, None].astype("float32"),
            scaler.transform(x_test).astype("float32"),
            ((y_test - y_mean) / y_std)[:, None].astype("float32"))


def train(x, y, epochs):
    """Noisy Adam (NNG Alg. 1) on a 10-50-1 ReLU net with a learned noise precision (NNG App. C.1).

    ``hess_init=1`` starts the Fisher estimate away from zero: with ``f = 0`` the first steps,
    divided by ``f + gamma_in`` alone, are large enough to throw this net far off.
    """
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((x.shape[1],)), keras.layers.Dense(50, activation="relu"),
                              keras.layers.Dense(1), tfnng.layers.NoisePrecision(len(x))])
    model.compile(optimizer=tfnng.optimizers.NoisyAdam(learning_rate=1e-2, num_examples=len(x),
                                                       hess_init=1.0, seed=0),
                  loss=tfnng.losses.GaussianNLL("learned"))
    model.fit(x, y, batch_size=16, epochs=epochs, verbose=0)
    return model


def rest_request(x, signature="serving_default", seed=None):
    """A TF Serving REST predict body in the columnar ("inputs") format."""
    inputs = {"inputs": np.round(x.astype(float), 6).tolist()}
    if seed is not None:
        inputs["seed"] = list(seed)
    return {"signature_name": signature, "inputs": inputs}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="serving_demo")
    parser.add_argument("--smoke", action="store_true", help="a few epochs only")
    args = parser.parse_args(argv)
    out = Path(args.out).resolve()
    x_train, y_train, x_test, y_test = make_data()
    model = train(x_train, y_train, epochs=3 if args.smoke else 40)

    export_dir = out / MODEL_NAME / "1"
    num_samples = 16 if args.smoke else 100
    serving.export(model, export_dir, num_samples=num_samples, outputs=OUTPUTS)
    print(f"SavedModel written to {export_dir} ({num_samples} weight samples per request)")

    # Load it back as TF Serving would: plain TensorFlow, no tfnng, no Keras model.
    loaded = tf.saved_model.load(str(export_dir))
    x = x_test[:3]
    request = rest_request(x)
    x_sent = np.asarray(request["inputs"]["inputs"], np.float32)   # exactly what the body carries
    served = {k: v.numpy() for k, v in loaded.signatures["serving_default"](inputs=x_sent).items()}
    seed = [20, 24]
    seeded = [{k: v.numpy() for k, v in loaded.signatures["seeded"](
        inputs=x_sent, seed=tf.constant(seed, tf.int64)).items()} for _ in range(2)]
    reference = tfnng.predict(model, x_sent, num_samples=num_samples)
    for n in range(len(x)):
        print(f"test point {n}: target {y_test[n, 0]:+.2f}  served mean {served['mean'][n, 0]:+.2f} "
              f"(tfnng.predict {reference.mean[n, 0]:+.2f})  sd {np.sqrt(served['variance'][n, 0]):.2f} "
              f"= sqrt(epistemic {served['epistemic_variance'][n, 0]:.3f} "
              f"+ aleatoric {served['aleatoric_variance'][n, 0]:.3f})")
    same = np.array_equal(seeded[0]["samples"], seeded[1]["samples"])
    print(f"seeded signature, seed {seed} twice: identical samples = {same}")

    request_path = out / "request.json"
    request_path.write_text(json.dumps(request, indent=1))
    docker = ("docker run -p 8501:8501 "
              f"--mount {shlex.quote(f'type=bind,source={out / MODEL_NAME},target=/models/{MODEL_NAME}')} "
              f"-e MODEL_NAME={MODEL_NAME} -t tensorflow/serving")
    url = f"http://localhost:8501/v1/models/{MODEL_NAME}:predict"
    curl = (f"curl -X POST -H 'Content-Type: application/json' "
            f"-d @{shlex.quote(str(request_path))} {url}")
    print("\nServe it (not run here: needs Docker):\n  " + docker)
    print(f"\nREST request body, written to {request_path}:\n{json.dumps(request)}")
    print("\nSend it:\n  " + curl)
    print("\nA reproducible request uses the 'seeded' signature:\n"
          + json.dumps(rest_request(x, "seeded", seed)))
    print('\nThe response is {"outputs": {"mean": [...], "variance": [...], ...}} with the '
          "signature's output names.")
    return {"x": x_sent, "served": served, "seeded": seeded, "request": request,
            "docker": docker, "curl": curl}


if __name__ == "__main__":
    main()
