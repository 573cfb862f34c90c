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
from ..compress import Compressor
from ..registry import PhaseRecorder, SparseResult, register
from ..state import CallStats, State

__all__ = ["GTopkState", "gtopk"]

_TAG_UP, _TAG_DOWN = 0x5C11, 0x5C12


class GTopkState(State):
    """State of gTopk: density and error feedback (default on)."""

    def __init__(self, density: float = 0.01, error_feedback: bool = True) -> None:
        super().__init__(density, error_feedback)


_HEADER = 16  # bytes: int64 count, float64 scale


def _buffer(k: int, rb: int, device: torch.device) -> torch.Tensor:
    """A header, k records, then k mask bytes (the largest message of the tree)."""
    return torch.zeros(_HEADER + k * rb + k, dtype=torch.uint8, device=device)


def _pack(buf: torch.Tensor, k: int, idx: torch.Tensor, wire: torch.Tensor, scale: float,
          index_dtype: torch.dtype, wire_dtype: torch.dtype) -> torch.Tensor:
    rb = kernels.record_bytes(index_dtype, wire_dtype)
    buf[:8] = torch.tensor([idx.numel()], dtype=torch.int64).view(torch.uint8).to(buf.device)
    buf[8:16] = torch.tensor([scale], dtype=torch.float64).view(torch.uint8).to(buf.device)
    buf[_HEADER:_HEADER + idx.numel() * rb] = kernels.pack_records(idx, wire, index_dtype, wire_dtype).reshape(-1)
    return buf


def _unpack(buf: torch.Tensor, k: int, index_dtype: torch.dtype, codec: Compressor,
            dtype: torch.dtype, mask_len: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(indexes, decoded values, mask) of a received buffer."""
    rb = kernels.record_bytes(index_dtype, codec.wire_dtype)
    count = int(buf[:8].clone().view(torch.int64))
    scale = float(buf[8:16].clone().view(torch.float64))
    idx, wire = kernels.unpack_records(buf[_HEADER:_HEADER + count * rb].reshape(-1, rb), index_dtype,
                                       codec.wire_dtype)
    mask = buf[_HEADER + k * rb:_HEADER + k * rb + mask_len].bool()
    return idx, codec.decode(wire, scale, dtype), mask


def _merge(a_idx: torch.Tensor, a_val: torch.Tensor, b_idx: torch.Tensor, b_val: torch.Tensor,
           k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top k of the sum of two sparse sets (sorted indexes in, sorted indexes out)."""
    uniq, inverse = torch.unique(torch.cat([a_idx, b_idx]), return_inverse=True)
    sums = torch.zeros(uniq.numel(), dtype=a_val.dtype, device=a_val.device)
    sums.index_add_(0, inverse, torch.cat([a_val, b_val.to(a_val.dtype)]))
    keep = kernels.topk_of_candidates(uniq, sums.abs(), k)
    return uniq[keep], sums[keep]


def _scale_of(codec: Compressor, values: torch.Tensor) -> float:
    """A per-message scale (a tree has no moment when all ranks could agree on one)."""
    if not codec.needs_scale or values.numel() == 0:
        return 1.0
    return float(values.abs().max())


@register("gtopk", GTopkState)
def gtopk(acc: torch.Tensor, k: int, comm: Communicator, state: GTopkState,
          codec: Compressor) -> SparseResult:
    """gTopk sparse allreduce (tree of top-k merges, then delivery to all).

    1. Select the exact local top-k of |acc|.
    2. Up the binomial tree: receive a child's set, sum, keep the top k. Keep,
       for this rank's own entries and for each child's, a mask of the entries
       still alive (kept by every merge so far). Send the result up encoded.
    3. Down the tree: receive the result and the mask of this rank's sent
       entries that survived above; forward the result to each child with its
       mask (alive here and survived above).
    4. Contributed: own entries alive here and survived above. The encoding
       error of sums this rank sent up (or, at the root, delivered) is kept in
       its residual for the entries that survived.
    """
    P, me, n = comm.size, comm.rank, acc.numel()
    stats = CallStats(algorithm="gtopk", n=n, k=k)
    rec = PhaseRecorder(comm, stats)
    index_dtype = kernels.index_dtype_for(n)
    rb = kernels.record_bytes(index_dtype, codec.wire_dtype)
    rounds = math.ceil(math.log2(P)) if P > 1 else 0
    with rec.phase("local_select"):
        idx = kernels.topk_indexes(acc, k, use_abs=True)
        values = acc[idx]
        scale = _scale_of(codec, values)
        sent = codec.roundtrip(values, scale)
    stats.local_selected = idx.numel()

    # cur = this rank's partial sum as the receivers will see it once it is sent.
    cur_idx, cur_val = idx, sent
    tracked = [(None, idx, torch.ones(idx.numel(), dtype=torch.bool, device=acc.device))]
    parent, up_req, up_error = None, None, None
    with rec.phase("reduce"):
        for r in range(rounds):
            d = 1 << r
            if me % (2 * d) == d:
                parent = me - d
                s = _scale_of(codec, cur_val)
                wire = codec.encode(cur_val, s)
                up_error = cur_val - codec.decode(wire, s, acc.dtype)
                buf = _pack(_buffer(k, rb, acc.device), k, cur_idx, wire, s, index_dtype, codec.wire_dtype)
                up_req = (comm.isend(buf, parent, _TAG_UP), buf)
                break
            if me + d < P:
                buf = _buffer(k, rb, acc.device)
                comm.irecv(buf, me + d, _TAG_UP).wait()
                child_idx, child_val, _ = _unpack(buf, k, index_dtype, codec, acc.dtype)
                tracked.append((me + d, child_idx, torch.ones(child_idx.numel(), dtype=torch.bool,
                                                               device=acc.device)))
                cur_idx, cur_val = _merge(cur_idx, cur_val, child_idx, child_val, k)
                tracked = [(c, i, alive & kernels.isin_sorted(i, cur_idx)) for c, i, alive in tracked]
        if up_req is not None:
            up_req[0].wait()

    with rec.phase("deliver"):
        if parent is None:  # the root: the result is what it holds, as it will travel
            s = _scale_of(codec, cur_val)
            res_wire = codec.encode(cur_val, s)
            res_idx, res_val = cur_idx, codec.decode(res_wire, s, acc.dtype)
            up_error = cur_val - res_val
            survived_mask = torch.ones(cur_idx.numel(), dtype=torch.bool, device=acc.device)
            template = _pack(_buffer(k, rb, acc.device), k, res_idx, res_wire, s, index_dtype,
                             codec.wire_dtype)
        else:  # forward the parent's encoding as it is, so every rank decodes the same bits
            template = _buffer(k, rb, acc.device)
            comm.irecv(template, parent, _TAG_DOWN).wait()
            res_idx, res_val, survived_mask = _unpack(template, k, index_dtype, codec, acc.dtype,
                                                      cur_idx.numel())
        survived = cur_idx[survived_mask]
        sends = []
        mask_at = _HEADER + k * rb
        for child, child_idx, alive in reversed(tracked[1:]):
            mask = alive & kernels.isin_sorted(child_idx, survived)
            buf = template.clone()
            buf[mask_at:] = 0
            buf[mask_at:mask_at + mask.numel()] = mask.to(torch.uint8)
            sends.append((comm.isend(buf, child, _TAG_DOWN), buf))
        for req, _ in sends:
            req.wait()
    own_alive = tracked[0][2] & kernels.isin_sorted(idx, survived)
    stats.global_selected = res_idx.numel()
    kept_idx = kept_val = None
    if up_error is not None:
        kept_idx, kept_val = cur_idx[survived_mask], up_error[survived_mask]
    return SparseResult(n=n, indexes=res_idx, values=res_val, contributed=idx[own_alive],
                        sent=sent[own_alive], stats=stats, kept_idx=kept_idx, kept_val=kept_val)
