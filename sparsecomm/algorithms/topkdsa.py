"""TopkDSA: SparCML's dynamic sparse allreduce (sparse reduce-scatter, then allgather).

Switching rule: after the reduce-scatter, the owner of a region sends it
densely (every value of the region, no indexes) when that is no larger than
its sparse form, i.e. when ``message_bytes(count) >= region_size *
value_bytes`` (``kernels.message``; for float32 values with 16-bit offsets:
when about two thirds of the region is filled in). The reduce-scatter itself stays sparse: each part is
a subset of one rank's local top-k, at most density-filled.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from .. import kernels
from ..check import CarriedCheck
from ..comm.base import Communicator
from ..compress import Compressor
from ..registry import register
from ..result import PhaseRecorder, SparseResult
from ..state import CallStats, Preselection
from .exchange import carry_or_run, equal_starts, peak_bits, peak_of, region_sizes, split_and_reduce
from .guided import GuidedTopkState

__all__ = ["TopkDSAState", "topkdsa", "topkdsa_reduce", "topkdsa_gather"]


class TopkDSAState(GuidedTopkState):
    """State of TopkDSA: density, error feedback (default on) and the reduce-scatter's window
    (steps posted at once; ``bucket=``, its old name, still works with a DeprecationWarning)."""


    RENAMED = {"bucket": "window"}

    def __init__(self, density: float = 0.01, error_feedback: bool = True, window: int = 4,
                 bucket: int | None = None) -> None:
        super().__init__(density, error_feedback)
        window = self._renamed("bucket", bucket, window)
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"window must be an integer >= 1, got {window!r}")
        self.window = window


@dataclass
class _Reduced:
    """TopkDSA after its sparse reduce-scatter: what the allgather half needs."""

    acc: torch.Tensor
    codec: Compressor
    stats: CallStats
    idx: torch.Tensor
    sent: torch.Tensor
    rel: torch.Tensor
    val: torch.Tensor
    starts: list[int]
    index_dtype: torch.dtype
    #: This rank's largest |acc| when the host knows it (values as they are): at P = 1 a bound.
    peak: float | None = None


def topkdsa_reduce(acc: torch.Tensor, k: int, comm: Communicator, state: TopkDSAState,
                   codec: Compressor, preselected: Preselection | None = None,
                   check: CarriedCheck | None = None, select: Callable | None = None) -> _Reduced:
    """Steps 1-2 of :func:`topkdsa`: the local top-k and the sparse reduce-scatter (whose
    exchange of sizes carries the collective ``check``). ``select(acc, k, stats)``: another
    local selection, as (sorted indexes, values) (``sparsecomm.reduce_scatter``'s Ok-Topk)."""
    P, me, n = comm.size, comm.rank, acc.numel()
    stats = CallStats(algorithm="topkdsa", n=n, k=k)
    rec = PhaseRecorder(comm, stats)
    check = carry_or_run(check, codec)
    with rec.phase("local_select"):
        idx, val = state.exact_topk(acc, k, preselected, stats) if select is None else select(acc, k, stats)
    stats.local_selected = idx.numel()
    starts = equal_starts(n, P)
    index_dtype = kernels.index_dtype_for(max(region_sizes(starts)))
    with rec.phase("reduce_scatter"):
        mine = codec.encode_shared(comm, val)
        region = lambda: state.scratch("region", starts[me + 1] - starts[me], acc.dtype, acc.device)  # noqa: E731
        rel, val = split_and_reduce(idx, mine, starts, comm, index_dtype, acc.dtype, state.window, region,
                                    check=check)
    peak = preselected.peak if preselected is not None and codec.exact_for(acc.dtype) else None
    return _Reduced(acc, codec, stats, idx, mine.decoded(acc.dtype), rel, val, starts, index_dtype, peak)


def topkdsa_gather(r: _Reduced, comm: Communicator) -> SparseResult:
    """Steps 3-5 of :func:`topkdsa`: each region's representation, the allgatherv, the decode."""
    P, me = comm.size, comm.rank
    acc, codec, stats, starts, index_dtype, rel, val = (r.acc, r.codec, r.stats, r.starts, r.index_dtype,
                                                        r.rel, r.val)
    sizes = region_sizes(starts)
    rec = PhaseRecorder(comm, stats)
    with rec.phase("allgatherv"):
        vb = codec.wire_dtype.itemsize
        dense = kernels.message_bytes(rel.numel(), sizes[me], index_dtype, codec.wire_dtype) >= sizes[me] * vb
        owned = codec.encode_shared(comm, val)
        if P == 1 and not dense:  # one region, nothing to exchange: its records as they would arrive
            stats.events["dense_regions"] = 0
            stats.global_selected = rel.numel()
            delivered = owned.decoded(acc.dtype)
            return SparseResult(n=acc.numel(), indexes=rel, values=delivered, contributed=r.idx,
                                sent=r.sent, stats=stats, kept_idx=rel, kept_val=val - delivered, bound=r.peak)
        if dense:
            region = torch.zeros(sizes[me], dtype=codec.wire_dtype, device=acc.device)
            region[rel] = owned.wire
            payload = region.view(torch.uint8).reshape(-1)
        else:
            payload = kernels.pack_message(rel, owned.wire, sizes[me], index_dtype, codec.wire_dtype)
        # (with each owner's largest sum, which bounds the result: values sent as they are)
        row = torch.zeros(3, dtype=torch.int64, device=acc.device)
        row[0], row[1] = rel.numel(), int(dense)
        row[2:] = peak_bits(val.abs())
        table = comm.allgather(row.to(comm.control_device)).reshape(P, 3).tolist()
        peak = peak_of([t[2] for t in table], acc.dtype) if codec.exact_for(acc.dtype) else None
        nbytes = [sizes[j] * vb if d else kernels.message_bytes(c, sizes[j], index_dtype, codec.wire_dtype)
                  for j, (c, d, _) in enumerate(table)]
        gathered = comm.allgatherv(payload, nbytes) if P > 1 else payload
    stats.events["dense_regions"] = sum(d for _, d, _ in table)
    with rec.phase("decode"):
        gidx, gval, pos = [], [], 0
        for j, (count, is_dense, _) in enumerate(table):
            chunk = gathered[pos:pos + nbytes[j]]
            pos += nbytes[j]
            if is_dense:
                codes = chunk.clone().view(codec.wire_dtype)  # clone: the offset may be misaligned
                nz = torch.nonzero(codes).flatten()
                gidx.append(nz + starts[j])
                gval.append(codes[nz])
            else:
                rr, v = kernels.unpack_message(chunk, count, sizes[j], index_dtype, codec.wire_dtype)
                gidx.append(rr + starts[j])
                gval.append(v)
        gidx, gval = torch.cat(gidx), codec.decode(torch.cat(gval), owned.scale, acc.dtype)
    stats.global_selected = gidx.numel()
    return SparseResult(n=acc.numel(), indexes=gidx, values=gval, contributed=r.idx, sent=r.sent, stats=stats,
                        kept_idx=rel + starts[me], kept_val=val - owned.decoded(acc.dtype), bound=peak)


def topkdsa_volume(n: int, k: int, P: int) -> tuple[float, float]:
    """Words received per rank: 4k(P-1)/P to 2k(P-1)/P + n(P-1)/P.

    The lower bound when the reduced entries stay sparse, the upper when they fill their
    regions (sent dense)."""
    f = (P - 1) / P
    return 4 * k * f, 2 * k * f + n * f


@register("topkdsa", TopkDSAState, split=(topkdsa_reduce, topkdsa_gather), volume=topkdsa_volume)
def topkdsa(acc: torch.Tensor, k: int, comm: Communicator, state: TopkDSAState,
            codec: Compressor, preselected: Preselection | None = None,
            check: CarriedCheck | None = None) -> SparseResult:
    """TopkDSA (SparCML; exact: the sum of every rank's local top-k): a sparse reduce-scatter,
    an allgather switching regions to dense.

    1. Select the exact local top-k of |acc| (:meth:`GuidedTopkState.exact_topk`).
    2. Sparse reduce-scatter over P equal regions (rotated, bucketed sends).
    3. Each owner picks its region's representation by the switching rule.
    4. Allgather (count, dense flag) per rank, then allgatherv the payload bytes.
    5. Decode every region into the result.

    Steps 1-2 and 3-5 are the registered halves (:func:`topkdsa_reduce`,
    :func:`topkdsa_gather`) that DeAR runs apart.
    """
    return topkdsa_gather(topkdsa_reduce(acc, k, comm, state, codec, preselected, check), comm)
