"""TopkA: every rank allgathers every rank's local top-k, then sums locally.

Simple and exact, but each rank receives 2k(P-1) words: the volume grows with P.
"""

from __future__ import annotations

import torch

from .. import kernels
from ..comm.base import Communicator
from ..compress import Compressor
from ..registry import register
from ..result import PhaseRecorder, SparseResult
from ..state import CallStats, Preselection, State
from .exchange import merges

__all__ = ["TopkAState", "topka", "allgather_and_sum"]


class TopkAState(State):
    """State of TopkA: density and error feedback (default on, as in training)."""

    guided_topk = True  # error-feedback calls collect the top-k's candidates while accumulating

    def __init__(self, density: float = 0.01, error_feedback: bool = True) -> None:
        super().__init__(density, error_feedback)


def topka_volume(n: int, k: int, P: int) -> tuple[float, float]:
    """Words received per rank: every peer's k entries (2 words each), 2k(P-1)."""
    return 2 * k * (P - 1), 2 * k * (P - 1)


@register("topka", TopkAState, volume=topka_volume)
def topka(acc: torch.Tensor, k: int, comm: Communicator, state: TopkAState,
          codec: Compressor, preselected: Preselection | None = None) -> SparseResult:
    """TopkA sparse allreduce (allgather of local top-k).

    1. Select the exact local top-k of |acc| (:meth:`State.exact_topk`).
    2. Allgather the counts, then allgatherv each rank's (index, value) list as one
       ``kernels.pack_message`` (16-bit offsets within 65536-wide blocks where
       that is smaller).
    3. Sum duplicates locally, in rank order (so every rank gets the same bits).
    """
    stats = CallStats(algorithm="topka", n=acc.numel(), k=k)
    rec = PhaseRecorder(comm, stats)
    with rec.phase("local_select"):
        idx, val = state.exact_topk(acc, k, preselected, stats)
    return allgather_and_sum(acc, idx, comm, codec, stats, rec, state, val)


def allgather_and_sum(acc: torch.Tensor, idx: torch.Tensor, comm: Communicator,
                      codec: Compressor, stats: CallStats, rec: PhaseRecorder,
                      state: State, val: torch.Tensor | None = None) -> SparseResult:
    """Steps 2-3 of TopkA for any sorted local selection ``idx`` (shared with Gaussiank).

    ``val``: ``acc[idx]`` when the caller has it. For few ranks on CPU
    (``exchange.merges``) the ranks' sorted lists are merged, summing in rank order; beyond,
    the sum goes into the state's all-zero scratch buffer and the touched
    indexes (the lists' union, merged, not sorted) are read out and reset in
    O(P k). Both give the same bits on every rank.
    """
    n = acc.numel()
    stats.local_selected = idx.numel()
    index_dtype = kernels.index_dtype_for(n)
    if comm.size == 1:  # nothing to exchange: the values as they would travel, summed into zeros
        sent = codec.encode_shared(comm, acc[idx] if val is None else val).decoded(acc.dtype)
        stats.global_selected = idx.numel()
        return SparseResult(n=n, indexes=idx, values=sent + 0, contributed=idx, sent=sent, stats=stats)
    with rec.phase("allgatherv"):
        mine = codec.encode_shared(comm, acc[idx] if val is None else val)
        counts = comm.allgather(torch.tensor([idx.numel()], dtype=torch.int64,
                                             device=comm.control_device)).flatten().tolist()
        # Each rank's list as one message (16-bit offsets within blocks where that is smaller);
        # its size follows from its count, which every rank now knows.
        msg = kernels.pack_message(idx, mine.wire, n, index_dtype, codec.wire_dtype)
        sizes = [kernels.message_bytes(c, n, index_dtype, codec.wire_dtype) for c in counts]
        gathered = comm.allgatherv(msg, sizes)
    with rec.phase("sum"):
        P = comm.size
        gidx, gwire = kernels.unpack_messages(gathered, counts, [n] * P, [0] * P, index_dtype, codec.wire_dtype)
        decoded = codec.decode(gwire, mine.scale, acc.dtype)
        runs = [0]
        for c in counts:
            runs.append(runs[-1] + c)
        if merges(comm.size, acc.device):
            # A few sorted runs: merged in rank order, the accumulator's sums bit for bit.
            uniq, values = kernels.sum_sorted_runs(gidx, decoded, runs)
        else:
            total = kernels.scatter_add(state.scratch("sum", n, acc.dtype, acc.device), gidx, decoded)
            uniq = kernels.union_sorted_runs(gidx, runs)
            values = kernels.take_and_zero(total, uniq)
    stats.global_selected = uniq.numel()
    return SparseResult(n=n, indexes=uniq, values=values, contributed=idx,
                        sent=mine.decoded(acc.dtype), stats=stats)
