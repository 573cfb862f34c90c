"""gTopk: tree reduction keeping the top k at every merge, then delivery down the tree.

Any P: the tree is binomial. In round r (distance d = 2**r) rank i with
i % 2d == d sends its set to i - d and leaves the reduction; rank i with
i % 2d == 0 and i + d < P receives from i + d, sums the two sets and keeps the
top k of the sum (selection rule of ``sparsecomm.kernels.select``). After
ceil(log2 P) rounds rank 0 holds the result and sends it back down the same
tree.

Error feedback needs to know which of a rank's entries survived every merge
on its way to the root (an entry dropped at some merge is lost even if its
index reappears later through another rank). Each parent therefore sends its
child, with the result, one byte per entry the child sent: whether that entry
survived all merges above.
"""

from __future__ import annotations

import math

import torch

from .. import kernels
from ..comm.base import Communicator
from ..registry import PhaseRecorder, SparseResult, register
from ..state import CallStats, State

__all__ = ["GTopkState", "gtopk"]

_TAG_UP, _TAG_DOWN = 0x5C11, 0x5C12


class GTopkState(State):
    """State of gTopk: density and error feedback (default on)."""

    def __init__(self, density: float = 0.01, error_feedback: bool = True) -> None:
        super().__init__(density, error_feedback)


def _buffer(k: int, rb: int, device: torch.device) -> torch.Tensor:
    """k + 1 records (record 0 holds the count) followed by k mask bytes."""
    return torch.zeros((k + 1) * rb + k, dtype=torch.uint8, device=device)


def _pack(buf: torch.Tensor, k: int, idx: torch.Tensor, val: torch.Tensor, index_dtype: torch.dtype,
          value_dtype: torch.dtype, mask: torch.Tensor | None = None) -> torch.Tensor:
    rb = kernels.record_bytes(index_dtype, value_dtype)
    buf[:4] = torch.tensor([idx.numel()], dtype=torch.int32).view(torch.uint8).to(buf.device)
    buf[rb:(idx.numel() + 1) * rb] = kernels.pack_records(idx, val, index_dtype, value_dtype).reshape(-1)
    if mask is not None:
        buf[(k + 1) * rb:(k + 1) * rb + mask.numel()] = mask.to(torch.uint8)
    return buf


def _unpack(buf: torch.Tensor, k: int, index_dtype: torch.dtype, value_dtype: torch.dtype,
            mask_len: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    rb = kernels.record_bytes(index_dtype, value_dtype)
    count = int(buf[:4].clone().view(torch.int32))
    idx, val = kernels.unpack_records(buf[rb:(count + 1) * rb].reshape(-1, rb), index_dtype, value_dtype)
    mask = buf[(k + 1) * rb:(k + 1) * rb + mask_len].bool()
    return idx, val, mask


def _merge(a_idx: torch.Tensor, a_val: torch.Tensor, b_idx: torch.Tensor, b_val: torch.Tensor,
           k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top k of the sum of two sparse sets (sorted indexes in, sorted indexes out)."""
    uniq, inverse = torch.unique(torch.cat([a_idx, b_idx]), return_inverse=True)
    sums = torch.zeros(uniq.numel(), dtype=a_val.dtype, device=a_val.device)
    sums.index_add_(0, inverse, torch.cat([a_val, b_val.to(a_val.dtype)]))
    keep = kernels.topk_of_candidates(uniq, sums.abs(), k)
    return uniq[keep], sums[keep]


@register("gtopk", GTopkState)
def gtopk(acc: torch.Tensor, k: int, comm: Communicator, state: GTopkState,
          value_dtype: torch.dtype) -> SparseResult:
    """gTopk sparse allreduce (tree of top-k merges, then delivery to all).

    1. Select the exact local top-k of |acc|.
    2. Up the binomial tree: receive a child's set, sum, keep the top k. Keep,
       for this rank's own entries and for each child's, a mask of the entries
       still alive (kept by every merge so far).
    3. Down the tree: receive the result and the mask of this rank's sent
       entries that survived above; forward the result to each child with its
       mask (alive here and survived above).
    4. Contributed: own entries alive here and survived above.
    """
    P, me, n = comm.size, comm.rank, acc.numel()
    stats = CallStats(algorithm="gtopk", n=n, k=k)
    rec = PhaseRecorder(comm, stats)
    index_dtype = kernels.index_dtype_for(n)
    rb = kernels.record_bytes(index_dtype, value_dtype)
    rounds = math.ceil(math.log2(P)) if P > 1 else 0
    with rec.phase("local_select"):
        idx = kernels.topk_indexes(acc.abs(), k)
        sent = acc[idx].to(value_dtype)
    stats.local_selected = idx.numel()

    cur_idx, cur_val = idx, sent.to(acc.dtype)
    tracked = [(None, idx, torch.ones(idx.numel(), dtype=torch.bool, device=acc.device))]
    parent, up_req = None, None
    with rec.phase("reduce"):
        for r in range(rounds):
            d = 1 << r
            if me % (2 * d) == d:
                parent = me - d
                buf = _pack(_buffer(k, rb, acc.device), k, cur_idx, cur_val, index_dtype, value_dtype)
                up_req = (comm.isend(buf, parent, _TAG_UP), buf)
                break
            if me + d < P:
                buf = _buffer(k, rb, acc.device)
                comm.irecv(buf, me + d, _TAG_UP).wait()
                child_idx, child_val, _ = _unpack(buf, k, index_dtype, value_dtype)
                tracked.append((me + d, child_idx, torch.ones(child_idx.numel(), dtype=torch.bool,
                                                               device=acc.device)))
                cur_idx, cur_val = _merge(cur_idx, cur_val, child_idx, child_val, k)
                tracked = [(c, i, alive & torch.isin(i, cur_idx)) for c, i, alive in tracked]
        if up_req is not None:
            up_req[0].wait()

    with rec.phase("deliver"):
        if parent is None:  # the root: the result is what it holds, rounded as it will travel
            res_idx, res_val = cur_idx, cur_val.to(value_dtype)
            survived = res_idx
        else:
            buf = _buffer(k, rb, acc.device)
            comm.irecv(buf, parent, _TAG_DOWN).wait()
            res_idx, res_val, mask = _unpack(buf, k, index_dtype, value_dtype, cur_idx.numel())
            survived = cur_idx[mask]
        sends = []
        for child, child_idx, alive in reversed(tracked[1:]):
            mask = alive & torch.isin(child_idx, survived)
            buf = _pack(_buffer(k, rb, acc.device), k, res_idx, res_val, index_dtype, value_dtype, mask)
            sends.append((comm.isend(buf, child, _TAG_DOWN), buf))
        for req, _ in sends:
            req.wait()
    own_alive = tracked[0][2] & torch.isin(idx, survived)
    stats.global_selected = res_idx.numel()
    return SparseResult(n=n, indexes=res_idx, values=res_val, contributed=idx[own_alive],
                        sent=sent[own_alive].to(acc.dtype), stats=stats)
