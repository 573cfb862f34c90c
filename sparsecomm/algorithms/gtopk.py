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
import struct

import torch

from .. import kernels
from ..comm.base import Communicator
from ..compress import Compressor, Encoded
from ..network import Traffic
from ..registry import INDEX_BYTES, register, tree_levels
from ..result import PhaseRecorder, SparseResult
from ..state import CallStats, Preselection

from .guided import GuidedTopkState

__all__ = ["GTopkState", "gtopk"]

_TAG_UP, _TAG_DOWN = 0x5C11, 0x5C12


class GTopkState(GuidedTopkState):
    """State of gTopk: density and error feedback (default on)."""


    def __init__(self, density: float = 0.01, error_feedback: bool = True) -> None:
        super().__init__(density, error_feedback)


_HEADER = 16  # bytes: int64 count, float64 scale


def _merge(a_idx: torch.Tensor, a_val: torch.Tensor, b_idx: torch.Tensor, b_val: torch.Tensor,
           k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top k of the sum of two sparse sets (sorted indexes in, sorted indexes out)."""
    # Both lists ascend: merge them, summing 0 + a, then + b (a sort cost 25 ms at k = 250k).
    uniq, sums = kernels.sum_sorted_runs(torch.cat([a_idx, b_idx]), torch.cat([a_val, b_val.to(a_val.dtype)]),
                                         [0, a_idx.numel(), a_idx.numel() + b_idx.numel()])
    keep = kernels.topk_of_candidates(uniq, sums.abs(), k)
    return uniq.index_select(0, keep), sums.index_select(0, keep)


def gtopk_volume(n: int, k: int, P: int) -> tuple[float, float]:
    """Words received per rank: 4k ceil(log2 P).

    k entries up and down each of the ceil(log2 P) tree levels."""
    return 4 * k * tree_levels(P), 4 * k * tree_levels(P)


def gtopk_traffic(n: int, k: int, P: int, value_bytes: float, ranks_per_node: int = 1, grid: bool = False) -> Traffic:
    """A tree up and down: 2 log2 P messages of k entries (an index, a value and a byte each)
    and a 16-byte header."""
    levels = tree_levels(P)
    return Traffic(2.0 * levels, 2.0 * levels * (k * (value_bytes + INDEX_BYTES + 1) + 16))


@register("gtopk", GTopkState, volume=gtopk_volume, traffic=gtopk_traffic, global_k=True)
def gtopk(acc: torch.Tensor, k: int, comm: Communicator, state: GTopkState,
          codec: Compressor, preselected: Preselection | None = None) -> SparseResult:
    """gTopk: a binomial tree keeping the top k at each merge, then back down.

    1. Select the exact local top-k of |acc| (:meth:`GuidedTopkState.exact_topk`).
    2. Up the binomial tree (:func:`_reduce_up`): receive a child's set, sum,
       keep the top k. Keep, for this rank's own entries and for each
       child's, a mask of the entries still alive (kept by every merge so
       far). Send the result up encoded.
    3. Down the tree (:func:`_deliver_down`): receive the result and the mask
       of this rank's sent entries that survived above; forward the result to
       each child with its mask (alive here and survived above).
    4. Contributed: own entries alive here and survived above. The encoding
       error of sums this rank sent up (or, at the root, delivered) is kept in
       its residual for the entries that survived.
    """
    n = acc.numel()
    stats = CallStats(algorithm="gtopk", n=n, k=k)
    rec = PhaseRecorder(comm, stats)
    layout = _Layout(k, kernels.index_dtype_for(n), codec, acc.dtype, acc.device)
    with rec.phase("local_select"):
        idx, val = state.exact_topk(acc, k, preselected, stats)
        sent = codec.encode_own(val).decoded(acc.dtype)
    stats.local_selected = idx.numel()
    if comm.size == 1:  # the root of a one-rank tree: its set, encoded as it would deliver it
        res_val = codec.encode_own(sent).decoded(acc.dtype)
        stats.global_selected = idx.numel()
        # Values that travel as they are: the largest |acc| the pass saw bounds them.
        peak = preselected.peak if preselected is not None and codec.exact_for(acc.dtype) else None
        return SparseResult(n=n, indexes=idx, values=res_val, contributed=idx, sent=sent, stats=stats,
                            kept_idx=idx, kept_val=sent - res_val, bound=peak)
    with rec.phase("reduce"):
        up = _reduce_up(idx, sent, comm, layout)
    with rec.phase("deliver"):
        res_idx, res_val, survived_mask, up_error = _deliver_down(up, comm, layout)
    survivors = kernels.nonzero(survived_mask)  # positions: gathers, not boolean indexing (4x)
    kept_idx, kept_val = up.idx.index_select(0, survivors), up_error.index_select(0, survivors)
    own = kernels.nonzero(up.tracked[0][2] & kernels.isin_sorted(idx, kept_idx))
    stats.global_selected = res_idx.numel()
    return SparseResult(n=n, indexes=res_idx, values=res_val, contributed=idx.index_select(0, own),
                        sent=sent.index_select(0, own), stats=stats, kept_idx=kept_idx, kept_val=kept_val)


class _Layout:
    """Message layout of one call: a header, k records, then k mask bytes (the largest message)."""

    def __init__(self, k: int, index_dtype: torch.dtype, codec: Compressor, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.k, self.index_dtype, self.codec, self.dtype, self.device = k, index_dtype, codec, dtype, device
        self.rb = kernels.record_bytes(index_dtype, codec.wire_dtype)
        self.mask_at = _HEADER + k * self.rb

    def buffer(self) -> torch.Tensor:
        return torch.zeros(self.mask_at + self.k, dtype=torch.uint8, device=self.device)

    def pack(self, idx: torch.Tensor, enc: Encoded) -> torch.Tensor:
        buf = self.buffer()
        buf[:8] = torch.tensor([idx.numel()], dtype=torch.int64).view(torch.uint8).to(buf.device)
        buf[8:16] = torch.tensor([enc.scale], dtype=torch.float64).view(torch.uint8).to(buf.device)
        records = kernels.pack_records(idx, enc.wire, self.index_dtype, self.codec.wire_dtype)
        buf[_HEADER:_HEADER + idx.numel() * self.rb] = records.reshape(-1)
        return buf

    def unpack(self, buf: torch.Tensor, mask_len: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(indexes, decoded values, mask) of a received buffer."""
        # One read of the header (count, then scale), reinterpreted on the host.
        count, scale = struct.unpack("=qd", bytes(buf[:_HEADER].tolist()))
        idx, wire = kernels.unpack_records(buf[_HEADER:_HEADER + count * self.rb].reshape(-1, self.rb),
                                           self.index_dtype, self.codec.wire_dtype)
        mask = buf[self.mask_at:self.mask_at + mask_len].bool()
        return idx, self.codec.decode(wire, scale, self.dtype), mask


class _Up:
    """Where a rank stands after the reduction: its partial sum, what it sent up, and to whom."""

    def __init__(self, idx: torch.Tensor, val: torch.Tensor, tracked: list, parent: int | None,
                 error: torch.Tensor | None) -> None:
        self.idx, self.val, self.tracked, self.parent, self.error = idx, val, tracked, parent, error


def _reduce_up(idx: torch.Tensor, sent: torch.Tensor, comm: Communicator, layout: _Layout) -> _Up:
    """Step 2: merge children's sets round by round, then send the partial sum to the parent.

    ``tracked`` holds (child or None for this rank, its indexes, alive mask).
    """
    P, me = comm.size, comm.rank
    cur_idx, cur_val = idx, sent  # as the receivers will see it once it is sent
    alive = torch.ones(idx.numel(), dtype=torch.bool, device=layout.device)
    tracked: list = [(None, idx, alive)]
    rounds = math.ceil(math.log2(P)) if P > 1 else 0
    for r in range(rounds):
        d = 1 << r
        if me % (2 * d) == d:  # this rank leaves the reduction: send up and stop
            enc = layout.codec.encode_own(cur_val)
            req = comm.isend(layout.pack(cur_idx, enc), me - d, _TAG_UP)
            req.wait()
            return _Up(cur_idx, cur_val, tracked, me - d, cur_val - enc.decoded(layout.dtype))
        if me + d < P:
            buf = layout.buffer()
            comm.irecv(buf, me + d, _TAG_UP).wait()
            child_idx, child_val, _ = layout.unpack(buf)
            tracked.append((me + d, child_idx, torch.ones(child_idx.numel(), dtype=torch.bool,
                                                           device=layout.device)))
            cur_idx, cur_val = _merge(cur_idx, cur_val, child_idx, child_val, layout.k)
            tracked = [(c, i, a & kernels.isin_sorted(i, cur_idx)) for c, i, a in tracked]
    return _Up(cur_idx, cur_val, tracked, None, None)


def _deliver_down(up: _Up, comm: Communicator, layout: _Layout) -> tuple[torch.Tensor, ...]:
    """Step 3: the result from the parent (or, at the root, the root's own sum), forwarded to children.

    Returns (result indexes, result values, mask of ``up.idx`` that survived
    above, encoding error of what this rank sent up or delivered).
    """
    children = up.tracked[1:]
    if up.parent is None:  # the root: the result is what it holds, as it will travel
        enc = layout.codec.encode_own(up.val)
        res_idx, res_val = up.idx, enc.decoded(layout.dtype)
        error = up.val - res_val
        survived_mask = torch.ones(up.idx.numel(), dtype=torch.bool, device=layout.device)
        template = layout.pack(res_idx, enc) if children else None  # P = 1: nothing to send
    else:  # forward the parent's encoding as it is, so every rank decodes the same bits
        template = layout.buffer()
        comm.irecv(template, up.parent, _TAG_DOWN).wait()
        res_idx, res_val, survived_mask = layout.unpack(template, up.idx.numel())
        error = up.error
    survived = up.idx[survived_mask] if children else None
    sends = []
    for child, child_idx, alive in reversed(children):
        mask = alive & kernels.isin_sorted(child_idx, survived)
        buf = template.clone()
        buf[layout.mask_at:] = 0
        buf[layout.mask_at:layout.mask_at + mask.numel()] = mask.to(torch.uint8)
        sends.append((comm.isend(buf, child, _TAG_DOWN), buf))
    for req, _ in sends:
        req.wait()
    return res_idx, res_val, survived_mask, error
