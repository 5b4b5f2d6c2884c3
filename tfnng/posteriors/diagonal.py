"""Diagonal (mean-field) Gaussian posteriors q(w) = N(mu, diag(sigma^2)).

The linear algebra of the fully factorised family used by NNG-FFG / noisy Adam (NNG paper sec. 3.3,
eq. 11), Vadam, Vprop, VadaGrad (weight-perturbation paper eq. 14, Fig. 1, sec. 5) and IVON.
Framework-light functions on lists of tensors, unit tested against dense formulas.
"""

import tensorflow as tf
import tensorflow_probability as tfp

tfd = tfp.distributions


def perturb(mean, stddev, standard_normal):
    """Reparameterised sample ``w = mu + sigma * eps`` with ``eps ~ N(0, I)`` supplied by the caller."""
    return mean + stddev * standard_normal


def kl_to_isotropic_prior(means, stddevs, prior_variance):
    """KL( N(mu, diag sigma^2) || N(0, eta I) ) in closed form, summed over all tensors.

    ``0.5 * sum(sigma^2/eta + mu^2/eta - 1 - log(sigma^2/eta))`` — the KL term of the ELBO (NNG eq. 1)
    for the spherical Gaussian prior assumed throughout the NNG paper (sec. 3). Each tensor's terms
    are computed and summed in float32, or float64 when its mean or standard deviation is float64,
    and the per-tensor sums are added in float64 (float64 throughout took twice the time of a step's
    KL for an MLP of 478k weights, which ``BayesianModel`` reports at every step).
    """
    total = tf.constant(0.0, tf.float64)
    for mu, sigma in zip(means, stddevs):
        dtype = tf.float64 if tf.float64 in (mu.dtype, sigma.dtype) else tf.float32
        eta = tf.constant(prior_variance, dtype)
        var_ratio = tf.square(tf.cast(sigma, dtype)) / eta
        terms = var_ratio + tf.square(tf.cast(mu, dtype)) / eta - 1.0 - tf.math.log(var_ratio)
        total += tf.cast(0.5 * tf.reduce_sum(terms), tf.float64)
    return total


def distribution(means, stddevs, names):
    """The whole posterior as a ``tfd.JointDistributionNamed`` of independent Normals keyed by name."""
    return tfd.JointDistributionNamed({
        name: tfd.Independent(tfd.Normal(mu, sigma), reinterpreted_batch_ndims=len(mu.shape))
        for name, mu, sigma in zip(names, means, stddevs)
    })

