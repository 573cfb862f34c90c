"""Baseline allreduces to compare sparse ones against; installed as ``sparsecomm.baselines``.

Importing this package registers them.
"""

from .dense import DenseState, dense
from .denseovlp import DenseOverlap

__all__ = ["DenseState", "dense", "DenseOverlap"]
