"""Baselines that are only baselines: DenseOvlp (dense allreduce overlapped with backward).

This folder sits at the top of the repository but is installed *inside* the
package as ``sparsecomm.baselines`` (``package-dir`` in pyproject.toml; the
link ``sparsecomm/baselines -> ../baselines`` shows type checkers and editors
the same), like ``kernels/``: import it as ``sparsecomm.baselines``, and use relative imports
(``from ..comm import ...``) inside it, as everywhere in the package. The
registered ``dense`` algorithm is in ``sparsecomm/algorithms/dense.py``.
"""

from .denseovlp import DenseOverlap

__all__ = ["DenseOverlap"]
