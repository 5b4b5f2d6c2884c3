"""Variational families and their linear algebra (the "posteriors" layer of docs/index.md,
Architecture)."""

from tfnng.posteriors import diagonal, kronecker

__all__ = ["diagonal", "kronecker"]
