"""Dense: the plain allreduce of all n values (the reference for results and time)."""

from __future__ import annotations

import torch

from sparsecomm.comm.base import Communicator
from sparsecomm.registry import PhaseRecorder, SparseResult, register
from sparsecomm.state import CallStats, State

__all__ = ["DenseState", "dense"]


class DenseState(State):
    """State of the dense allreduce: only error feedback of the wire rounding.

    ``density`` is accepted for a uniform interface and ignored (k = n).
    """

    def __init__(self, density: float = 1.0, error_feedback: bool = False) -> None:
        super().__init__(density, error_feedback)


@register("dense", DenseState)
def dense(acc: torch.Tensor, k: int, comm: Communicator, state: DenseState,
          value_dtype: torch.dtype) -> SparseResult:
    """Dense allreduce of every value through the communicator.

    1. Cast the input to the wire dtype (the input's dtype).
    2. Allreduce (sum) it; the backend's algorithm (ring, Rabenseifner) decides
       the schedule, accounted as 2n(P-1)/P values per rank.
    """
    n = acc.numel()
    stats = CallStats(algorithm="dense", n=n, k=n, local_selected=n, global_selected=n)
    with PhaseRecorder(comm, stats).phase("allreduce"):
        sent = acc.to(value_dtype)
        total = comm.allreduce(sent, "sum")
    return SparseResult(n=n, indexes=None, values=total, contributed=None,
                        sent=sent.to(acc.dtype), stats=stats)
