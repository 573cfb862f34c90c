"""The one check of "nothing lost", shared by every test of error feedback.

With error feedback every bit of gradient either reached the result or stays in a rank's
residual: ``delivered + sum(residuals) == sum(fed)`` (to the rounding of the sums).
"""

from __future__ import annotations

from typing import Sequence

import torch

__all__ = ["assert_conserved"]


def assert_conserved(delivered: torch.Tensor, residuals: Sequence[torch.Tensor], fed: Sequence[torch.Tensor],
                     *, rtol: float = 1e-5, atol: float = 1e-4) -> None:
    """Raise unless what was delivered plus every rank's residual equals everything fed in.

    Args:
        delivered: the summed result the ranks agreed on (an average times the world size).
        residuals: each rank's residual (per parameter, or flat: like ``fed``).
        fed: each rank's gradients summed over the steps.
    """
    torch.testing.assert_close(delivered + sum(residuals), sum(fed), rtol=rtol, atol=atol,
                               msg=lambda m: f"gradient lost: delivered + residuals != fed\n{m}")
