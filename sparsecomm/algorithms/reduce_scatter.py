"""The sparse reduce-scatter: every rank's selection, each equal region to its owner, summed there.

What FSDP's reduce-scatter does with every entry, with each rank's largest: rank r owns the
r-th of P equal regions (its shard) and receives, from every rank, that rank's selected
entries in it. It is the split-and-reduce phase of TopkDSA and Ok-Topk with the ownership
fixed; nothing is gathered after it (each rank needs only its shard), so Ok-Topk's region
rebalancing and global selection do not apply.
"""

from __future__ import annotations

import torch

from ..comm.base import Communicator
from ..compress import Compressor
from ..result import SparseResult
from ..state import Preselection, State
from .ladder import local_select
from .oktopk import OkTopkState
from .topkdsa import TopkDSAState, topkdsa_reduce

__all__ = ["SHARD_ALGORITHMS", "shard_reduce"]

#: The algorithms whose selection the reduce-scatter runs: Ok-Topk's (a threshold estimated
#: and reused, every ``tau`` calls re-evaluated) and TopkDSA's (the exact local top-k).
SHARD_ALGORITHMS = ("oktopk", "topkdsa")


def shard_reduce(acc: torch.Tensor, k: int, comm: Communicator, state: State, codec: Compressor,
                 preselected: Preselection | None = None) -> SparseResult:
    """This rank's shard of the sum over ranks of every rank's selection of ``acc``.

    1. Select about k entries of |acc|: Ok-Topk's local selection (``ladder.local_select``,
       ``preselected`` by a fused accumulation when its threshold was reused) or TopkDSA's
       exact top-k.
    2. Split them by the P equal regions and reduce each at its owner
       (``topkdsa_reduce``: one alltoallv of packed parts, summed in step order).

    Returns:
        A SparseResult over this rank's shard (``n`` = ``acc.numel() // P``): its
        region-relative indexes (an index may repeat with a zero sum) and sums;
        ``contributed``/``sent``: this rank's selection as it travelled, for the residual.
    """
    if isinstance(state, OkTopkState):
        t = state.iteration + 1

        def select(a: torch.Tensor, kk: int, stats):  # noqa: ANN202
            return local_select(a, kk, state, t, stats, preselected)[:2]
    elif isinstance(state, TopkDSAState):
        select = None
    else:
        raise ValueError(f"the sparse reduce-scatter runs {SHARD_ALGORITHMS}, not {state.algorithm!r}")
    r = topkdsa_reduce(acc, k, comm, state, codec, preselected, select=select)
    r.stats.algorithm = f"reduce_scatter:{state.algorithm}"
    r.stats.global_selected = r.rel.numel()
    return SparseResult(n=acc.numel() // comm.size, indexes=r.rel, values=r.val, contributed=r.idx, sent=r.sent,
                        stats=r.stats)
