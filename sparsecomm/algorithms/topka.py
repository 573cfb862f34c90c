"""TopkA: every rank allgathers every rank's local top-k, then sums locally.

Simple and exact, but each rank receives 2k(P-1) words: the volume grows with P.
"""

from __future__ import annotations

import torch

from .. import kernels
from ..check import CarriedCheck, carried_words
from ..comm.base import Communicator
from ..compress import Compressor
from ..network import Traffic
from ..registry import register
from ..result import PhaseRecorder, SparseResult
from ..state import CallStats, Preselection, State
from .exchange import carry_or_run, merges, peak_bits, peak_of
from .guided import GuidedTopkState

__all__ = ["TopkAState", "topka", "allgather_and_sum"]


class TopkAState(GuidedTopkState):
    """State of TopkA: density and error feedback (default on, as in training)."""


    def __init__(self, density: float = 0.01, error_feedback: bool = True) -> None:
        super().__init__(density, error_feedback)


def topka_volume(n: int, k: int, P: int) -> tuple[float, float]:
    """Words received per rank: 2k(P-1).

    Every peer's k entries, 2 words each."""
    return 2 * k * (P - 1), 2 * k * (P - 1)


def topka_traffic(n: int, k: int, P: int, value_bytes: float, ranks_per_node: int = 1, grid: bool = False) -> Traffic:
    """An allgather of every rank's k entries (16-bit offsets) and of the counts: 2 (P - 1)
    messages, 6k + 24 bytes from each peer with float32 values."""
    return Traffic(2.0 * (P - 1), (P - 1) * (k * (value_bytes + 2) + 24.0))


@register("topka", TopkAState, volume=topka_volume, traffic=topka_traffic)
def topka(acc: torch.Tensor, k: int, comm: Communicator, state: TopkAState,
          codec: Compressor, preselected: Preselection | None = None,
          check: CarriedCheck | None = None) -> SparseResult:
    """TopkA: an allgather of every rank's top-k, summed locally.

    1. Select the exact local top-k of |acc| (:meth:`GuidedTopkState.exact_topk`).
    2. Allgather the counts (with the collective check, when ``check`` is given, and each
       rank's largest magnitude), then allgatherv each rank's (index, value) list as one
       ``kernels.pack_message`` (16-bit offsets within 65536-wide blocks where
       that is smaller).
    3. Sum duplicates locally, in rank order (so every rank gets the same bits).
    """
    stats = CallStats(algorithm="topka", n=acc.numel(), k=k)
    rec = PhaseRecorder(comm, stats)
    check = carry_or_run(check, codec)
    with rec.phase("local_select"):
        idx, val = state.exact_topk(acc, k, preselected, stats)
    peak = preselected.peak if preselected is not None else None
    return allgather_and_sum(acc, idx, comm, codec, stats, rec, state, val, check, peak)


def allgather_and_sum(acc: torch.Tensor, idx: torch.Tensor, comm: Communicator,
                      codec: Compressor, stats: CallStats, rec: PhaseRecorder,
                      state: State, val: torch.Tensor | None = None,
                      check: CarriedCheck | None = None, peak: float | None = None) -> SparseResult:
    """Steps 2-3 of TopkA for any sorted local selection ``idx`` (shared with Gaussiank).

    ``check``: the collective check, carried by the exchange of counts. Each rank's largest
    magnitude travels with its count: values sent as they are, P times the largest bounds
    the sums (one rounding a term), so the overflow check reads nothing more.
    ``peak``: this rank's largest |acc| when the host knows it (``Preselection.peak``): at
    P = 1 it bounds the result.
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
        return SparseResult(n=n, indexes=idx, values=sent + 0, contributed=idx, sent=sent, stats=stats,
                            bound=peak if codec.exact_for(acc.dtype) else None)
    with rec.phase("allgatherv"):
        val = acc[idx] if val is None else val
        mine = codec.encode_shared(comm, val)
        P = comm.size
        row = torch.zeros(carried_words(P) if check is not None else 2, dtype=torch.int64, device=acc.device)
        row[0] = idx.numel()
        row[1:2] = peak_bits(val.abs())
        rows = check(row) if check is not None else comm.allgather(row.to(comm.control_device)).reshape(P, -1).tolist()
        counts = [r[0] for r in rows]
        peak = peak_of([r[1] for r in rows], acc.dtype) if codec.exact_for(acc.dtype) else None
        # Each rank's list as one message (16-bit offsets within blocks where that is smaller);
        # its size follows from its count, which every rank now knows.
        msg = kernels.pack_message(idx, mine.wire, n, index_dtype, codec.wire_dtype)
        sizes = kernels.messages_bytes(counts, [n] * P, index_dtype, codec.wire_dtype)
        gathered = comm.allgatherv(msg, sizes)
    with rec.phase("sum"):
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
    return SparseResult(n=n, indexes=uniq, values=values, contributed=idx, sent=mine.decoded(acc.dtype),
                        stats=stats, bound=None if peak is None else P * peak * (1 + 2**-10))
