"""tfnng: Bayesian deep learning in Keras 3 by noisy natural gradient.

Natural-gradient optimizers with adaptive weight noise that fit Gaussian posteriors over the weights
of an ordinary Keras model (Zhang et al. 2018; Khan et al. 2018; Shen et al. 2024)::

    model.compile(optimizer=tfnng.optimizers.NoisyAdam(num_examples=N), loss=tfnng.losses.GaussianNLL())
    model.fit(x, y)
    pred = tfnng.predict(model, x_test, num_samples=100)
"""

from tfnng import curvature, layers, losses, metrics, models, optimizers, posteriors
from tfnng import callbacks, serving
from tfnng.models import BayesianModel
from tfnng._markers import is_point_estimate, mark_natural_parameter, mark_point_estimate
from tfnng.predict import Predictive, predict

__version__ = "0.1.0"

__all__ = [
    "callbacks", "curvature", "layers", "losses", "metrics", "models", "optimizers", "posteriors",
    "serving", "BayesianModel",
    "predict", "Predictive", "mark_point_estimate", "is_point_estimate",
    "mark_natural_parameter", "__version__",
]
