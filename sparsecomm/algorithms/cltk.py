"""CLT-k, shared-index top-k (ScaleCom): one rank picks the indexes, every rank sums its values there.

What users who want top-k on NCCL pick today: the indexes are one rank's
choice (a leader, rotating from call to call), so the values travel in one
dense allreduce of exactly k numbers. Volume O(k) with the collective's
latency, fixed sizes, no counts to agree on and no host read of any. It
converges differently from a global top-k: the leader's largest entries need
not be the sum's (section 2 of ``../shared/papers/README.md`` lists it among
the baselines).
"""

from __future__ import annotations

import torch

from .. import kernels
from ..comm.base import Communicator
from ..compress import Compressor
from ..network import Traffic
from ..registry import register, tree_levels
from ..result import PhaseRecorder, SparseResult
from ..state import CallStats, Preselection, State
from .dense import DenseState, dense

__all__ = ["CltkState", "cltk"]


class CltkState(State):
    """State of CLT-k: density, error feedback (default on), and whose turn it is to lead.

    The leader of a call is ``iteration mod P``: every rank holds the same
    iteration (the collective check compares it), so every rank agrees without
    a message. The leader's selection is an exact top-k over n (no guide: a
    rank leads once every P calls, so a guide would be P calls old).
    """

    #: The inner dense state of the k values (its buffers) is rebuilt, never saved.
    _TRANSIENT = State._TRANSIENT + ("_values_state",)

    def __init__(self, density: float = 0.01, error_feedback: bool = True) -> None:
        super().__init__(density, error_feedback)

    def values_state(self) -> DenseState:
        """The dense state the k shared values are reduced with (buffers of size k, kept)."""
        inner = self.__dict__.get("_values_state")
        if inner is None:
            inner = self._values_state = DenseState()
        return inner


def cltk_volume(n: int, k: int, P: int) -> tuple[float, float]:
    """Words received per rank: 2k(P-1)/P to 2k ceil(log2 P) + 2k(P-1)/P.

    Not in Table 1: the leader's k int64 indexes (2 words each) go down a binomial tree (the leader sends them ceil(log2 P) times, every other rank
    receives them once), then a ring allreduce of the k values: at least the ring's, at
    most the leader's traffic."""
    f = (P - 1) / P
    return 2 * k * f, 2 * k * max(tree_levels(P), 1 if P > 1 else 0) + 2 * k * f


def cltk_traffic(n: int, k: int, P: int, value_bytes: float, ranks_per_node: int = 1, grid: bool = False) -> Traffic:
    """The leader's k indexes broadcast and an allreduce of k values: 2.5 log2 P + 0.5 messages
    on average over a period of two calls, (log2 P + 1) 4k + 2k (P - 1) / P value bytes."""
    levels = tree_levels(P)
    return Traffic(2.5 * levels + 0.5, (levels + 1) * 4.0 * k + 2.0 * k * (P - 1) / P * value_bytes)


@register("cltk", CltkState, volume=cltk_volume, traffic=cltk_traffic, global_k=True)
def cltk(acc: torch.Tensor, k: int, comm: Communicator, state: CltkState,
         codec: Compressor, preselected: Preselection | None = None) -> SparseResult:
    """CLT-k (ScaleCom's shared-index top-k): a rotating leader's indexes, one dense allreduce
    of k values.

    1. The leader (``state.iteration mod P``) selects the exact top-k of its
       |acc|, ties to the lower index (sorted indexes): always k of them, so
       where fewer than k entries are nonzero the lowest-index zeros fill up
       (every size is known in advance; the others' values there still count).
    2. It broadcasts the k indexes; every rank takes its acc at them.
    3. One dense allreduce of those k values (:func:`dense`, so every
       compressor works: the backend's own sum for a cast that sums on the
       wire, the hand-made reduce-scatter and allgather of encoded chunks for
       a quantiser, whose re-encoding error comes back at its indexes).
    4. Every rank contributed its values at the shared indexes: with error
       feedback those leave its residual, everything else stays.
    """
    n, P = acc.numel(), comm.size
    stats = CallStats(algorithm="cltk", n=n, k=k)
    rec = PhaseRecorder(comm, stats)
    leader = state.iteration % P
    with rec.phase("local_select"):
        if comm.rank == leader:
            idx = _top_k_exactly(acc, k)
        else:
            idx = torch.empty(k, dtype=torch.int64, device=acc.device)
    if P > 1:
        with rec.phase("broadcast"):
            idx = comm.broadcast(idx, leader)
    values = acc.index_select(0, idx)
    inner = dense(values, k, comm, state.values_state(), codec)
    for name, phase in inner.stats.phases.items():  # the dense call's phases are this call's
        stats.phases[name] = phase
    stats.local_selected = stats.global_selected = k
    kept_idx = kept_val = None
    if inner.kept_val is not None:  # a quantiser's re-encoding error, at this owner's share of idx
        kept_val = inner.kept_val
        kept_idx = idx[inner.kept_at:inner.kept_at + kept_val.numel()]
    return SparseResult(n=n, indexes=idx, values=inner.values, contributed=idx, sent=inner.sent, stats=stats,
                        kept_idx=kept_idx, kept_val=kept_val, bound=inner.bound)


def _top_k_exactly(acc: torch.Tensor, k: int) -> torch.Tensor:
    """Sorted indexes of the k largest |acc|, ties to the lower index, zeros included when
    fewer than k entries are nonzero (``kernels.topk_indexes`` returns only nonzero ones).

    On a GPU's path (:func:`_top_k_on_device`) without a read of the device."""
    if not kernels.dispatch.in_host_memory(acc):
        return _top_k_on_device(acc, k)
    idx = kernels.topk_indexes(acc, k, use_abs=True)
    missing = k - idx.numel()
    if missing > 0:
        zeros = (acc == 0).nonzero().flatten()[:missing]
        idx = torch.sort(torch.cat([idx, zeros])).values
    return idx


def _top_k_on_device(acc: torch.Tensor, k: int) -> torch.Tensor:
    """:func:`_top_k_exactly` in sizes known in advance, so nothing is read from the device.

    1. ``kth``: the k-th largest |acc| (``torch.topk``'s values, whose order among ties
       does not matter here).
    2. Every entry above ``kth`` (fewer than k), and the first k entries equal to it, by
       index (``nonzero_static``: k places each, the spare ones filled with n).
    3. Of the ties, only the first k minus the count above: then the k smallest
       indexes of both lists, sorted, are the answer (zeros tie at 0 when fewer than k
       entries are nonzero, so the lowest-index zeros fill up).
    """
    n = acc.numel()
    mag = acc.abs()
    kth = torch.topk(mag, k, sorted=False).values.min()
    above = torch.nonzero_static(mag > kth, size=k, fill_value=n).flatten()
    ties = torch.nonzero_static(mag == kth, size=k, fill_value=n).flatten()
    room = k - (above < n).sum()
    ties = torch.where(torch.arange(k, device=acc.device) < room, ties, torch.full_like(ties, n))
    return torch.sort(torch.cat([above, ties])).values[:k]
