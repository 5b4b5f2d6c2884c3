"""How curvature statistics are obtained from a batch (the "curvature" layer of docs/index.md).

* :mod:`tfnng.curvature.capture` — registry of the layers the Kronecker-factored family supports
  (Dense, Conv2D) and the zero-tensor capture of their inputs and pre-activation gradients.
* :mod:`tfnng.curvature.kronecker` — Kronecker factors A, S of eq. (12) (KFC for convolutions).
* :mod:`tfnng.curvature.per_example` — per-example gradients: fast Dense/Conv2D path from the
  captured rows, generic path for any layer.

:class:`Requirements` is what an optimizer declares (``optimizer.curvature_requirements``) to be given
by :class:`tfnng.BayesianModel`; see :mod:`tfnng.models` for the protocol.
"""

import dataclasses

from tfnng.curvature import capture, kronecker, per_example

FISHER_TYPES = ("true", "empirical")


@dataclasses.dataclass(frozen=True)
class Requirements:
    """What an optimizer needs from the training step beyond the averaged gradient.

    Attributes:
        kronecker: per supported layer (see :mod:`tfnng.curvature.capture`), its input and the
            per-example gradients of the log-likelihood with respect to its pre-activations.
        per_example_gradients: per-example weight gradients of *every* Bayesian variable (VOGN,
            SLANG, NNG-full). Variables of supported layers get them from the captured rows (fast
            path, :func:`tfnng.curvature.per_example.layer_block`); the model computes the
            others with the generic path (:func:`tfnng.curvature.per_example.per_example_gradients`)
            and hands them over as :class:`~tfnng.curvature.per_example.CapturedVariable` records
            keyed by variable path. Implies ``kronecker``.
        fisher: ``"true"`` (targets sampled from the model's predictive via the loss's ``sample``,
            NNG footnote 1) or ``"empirical"`` (the observed targets).
        layer_links: which supported layer feeds which (``LayerSpec.inputs_from``, set by
            :meth:`tfnng.curvature.capture.LayerCapture.find_links` before ``build``): the chains
            of the block-tridiagonal K-FAC.
    """

    kronecker: bool = False
    per_example_gradients: bool = False
    fisher: str = "true"
    layer_links: bool = False

    def __post_init__(self):
        if self.fisher not in FISHER_TYPES:
            raise ValueError(f"`fisher` must be one of {FISHER_TYPES}, got {self.fisher!r}.")


__all__ = ["Requirements", "FISHER_TYPES", "capture", "kronecker", "per_example"]
