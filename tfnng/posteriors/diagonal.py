"""Diagonal (mean-field) Gaussian posteriors q(w) = N(mu, diag(sigma^2)).

The linear algebra of the fully factorised family used by NNG-FFG / noisy Adam (NNG paper sec. 3.3,
eq. 11), Vadam, Vprop, VadaGrad (weight-perturbation paper eq. 14, Fig. 1, sec. 5) and IVON.
Framework-light functions on lists of tensors, unit tested against dense formulas.
"""

import math

import numpy as np
import tensorflow as tf
import tensorflow_probability as tfp

tfd = tfp.distributions


def perturb(mean, stddev, standard_normal):
    """Reparameterised sample ``w = mu + sigma * eps`` with ``eps ~ N(0, I)`` supplied by the caller."""
    return mean + stddev * standard_normal


def kl_to_isotropic_prior(means, variances, prior_variance):
    """KL( N(mu, diag sigma^2) || N(0, eta I) ) in closed form, summed over all tensors.

    ``0.5 * sum((r - 1 - log r) + mu^2/eta)`` with ``r = sigma^2/eta``: the KL term of the ELBO (NNG
    eq. 1) for the spherical Gaussian prior assumed throughout the NNG paper (sec. 3). Each tensor's
    two sums are taken in float32, or float64 when its mean or variance is float64, and added in
    float64 (float64 throughout took twice the time of a step's KL for an MLP of 478k weights, which
    ``BayesianModel`` reports at every step). ``r - 1 - log r >= 0`` is summed as such, not as
    ``sum(r) - D - sum(log r)``, which would lose a small KL to rounding; ``log r`` is
    ``log sigma^2 - log eta`` where ``r`` is too small for a normal float.
    """
    total = tf.constant(0.0, tf.float64)
    for mu, variance in zip(means, variances):
        dtype = tf.float64 if tf.float64 in (mu.dtype, variance.dtype) else tf.float32
        variance = tf.cast(variance, dtype)
        ratio = variance * tf.constant(1.0 / prior_variance, dtype)
        # A ratio below the smallest normal number flushes to 0 (log 0 = -inf) where the variance
        # itself does not: its log is then taken as a difference of logs.
        log_ratio = tf.where(ratio > np.finfo(dtype.as_numpy_dtype).tiny, tf.math.log(ratio),
                             tf.math.log(variance) - tf.constant(math.log(prior_variance), dtype))
        divergence = tf.reduce_sum((ratio - 1.0) - log_ratio)
        squared_mean = tf.reduce_sum(tf.square(tf.cast(mu, dtype)))
        total += 0.5 * (tf.cast(divergence, tf.float64) + tf.cast(squared_mean, tf.float64) / prior_variance)
    return total


def distribution(means, stddevs, names):
    """The whole posterior as a ``tfd.JointDistributionNamed`` of independent Normals keyed by name."""
    return tfd.JointDistributionNamed({
        name: tfd.Independent(tfd.Normal(mu, sigma), reinterpreted_batch_ndims=len(mu.shape))
        for name, mu, sigma in zip(names, means, stddevs)
    })

