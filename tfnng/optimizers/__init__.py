"""Keras 3 optimizers that fit Gaussian posteriors by noisy natural gradient (the "optimizers"
layer of docs/index.md, Architecture)."""

from tfnng.optimizers.base import NoisyOptimizer
from tfnng.optimizers.diagonal import IVON, VOGN, NoisyAdam, VadaGrad, Vadam, Vprop
from tfnng.optimizers.full import NoisyNaturalGradient
from tfnng.optimizers.kfac import KFAC, NoisyKFAC
from tfnng.optimizers.low_rank import SLANG

__all__ = ["NoisyOptimizer", "NoisyAdam", "Vadam", "Vprop", "VadaGrad", "IVON", "VOGN", "NoisyKFAC",
           "KFAC", "SLANG", "NoisyNaturalGradient"]
