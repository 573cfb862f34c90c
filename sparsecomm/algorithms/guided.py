"""The guided exact top-k: the local selection of TopkA, gTopk and TopkDSA.

These algorithms contribute each rank's exact top-k of |acc|. A selection over all n
entries every call would cost as much as the rest of the call, so under error feedback the
accumulating pass also collects every entry above a *guide* (about the (2k)-th largest |acc|
of the last call) and counts them at a few rungs above it; the top-k is then found among those
few candidates, and the next guide from the counts. :class:`GuidedTopkState` is the state of
such an algorithm; Ok-Topk's threshold selection has its own (``ladder.py``).
"""

from __future__ import annotations

import math

import torch

from .. import kernels
from ..state import CallStats, Compensated, Preselection, State, topk_count

__all__ = ["GuidedTopkState"]


class GuidedTopkState(State):
    """A State whose algorithm selects the exact top-k of |acc| on each rank, guided.

    With error feedback, :meth:`compensate` also collects every entry above ``topk_guide``
    and :meth:`exact_topk` finds the top-k among those few candidates.
    """

    #: The guidance is on (a test switches it off on an instance to compare with a selection
    #: over all n every call: the results must be the same).
    guided_topk = True
    #: Where the next call starts collecting candidates (None: select over all n next call).
    topk_guide: float | None = None
    #: The guide is the last call's (GUIDE_RANK k)-th largest |acc|, found among its
    #: candidates; the fused pass keeps up to GUIDE_CAPACITY k of them.
    GUIDE_RANK = 2
    GUIDE_CAPACITY = 4
    #: The fused pass also counts its candidates at GUIDE_RUNGS rungs, guide * GUIDE_STEP ** j
    #: (read with its count): the next guide comes from those counts, with no read of its own.
    GUIDE_RUNGS, GUIDE_STEP = 16, 2 ** 0.0625

    def compensate(self, flat: torch.Tensor, zero_out: torch.Tensor | None = None) -> Compensated:
        """:meth:`State.compensate`, fused with the collection of the candidates once a guide exists:
        one pass does residual += flat and collects and counts every entry above the guide
        at the guide's rungs; one read of the counts."""
        if not (self.guided_topk and self.error_feedback and self.topk_guide is not None):
            return super().compensate(flat, zero_out)
        self.n = flat.numel()
        residual = self.residual_on(flat)
        capacity = self.GUIDE_CAPACITY * topk_count(self.density, self.n)
        grid, rungs = self._guide_rungs(residual.dtype)
        sel = kernels.ef_select_counted(flat, residual, self.topk_guide, capacity, zero_selected=False,
                                        zero_out=zero_out, rungs=kernels.dispatch.upload(grid, grid.dtype, residual.device))
        return Compensated.counted(residual, sel, capacity, zero_out is not None, rungs, self.topk_guide)

    def fuses_next(self) -> bool:
        return (self.guided_topk and self.error_feedback and self.topk_guide is not None) or super().fuses_next()

    def _guide_rungs(self, dtype: torch.dtype) -> tuple[torch.Tensor, list[float]]:
        """The guide's rungs in ``dtype``, on the host: as a tensor (to upload) and as floats."""
        with kernels.dispatch.host_side():
            info = torch.finfo(dtype)
            steps = torch.arange(self.GUIDE_RUNGS, dtype=torch.float64)
            grid = (self.topk_guide * self.GUIDE_STEP ** steps).clamp_(info.tiny, info.max).to(dtype)
            return grid, grid.tolist()

    def _guide_from_rungs(self, pre: Preselection, k: int, rank: int) -> float:
        """The next guide from the candidates' counts at the rungs (step 3 of :meth:`exact_topk`).

        1. Between the highest rung with at least ``rank`` candidates at or above it and
           the next, where a power law through their counts gives ``rank``.
        2. Fewer candidates than ``rank`` in all: the log count's slope at the lowest
           rungs, extended down to ``rank`` linearly in the magnitude; never below half the
           lowest rung, and one step down when there is nothing to fit.
        """
        rungs, above = pre.rungs, pre.above
        enough = [j for j, c in enumerate(above) if c >= rank]
        if enough:
            j = enough[-1]
            if j + 1 == len(rungs) or above[j] == rank or above[j + 1] == 0:
                return rungs[j]
            # Between rungs j and j + 1: the count falls as a power of the magnitude.
            f = math.log(above[j] / rank) / math.log(above[j] / above[j + 1])
            return rungs[j] * (rungs[j + 1] / rungs[j]) ** f
        low, count = rungs[0], above[0]
        nxt = next((j for j, c in enumerate(above) if c < count), None)
        if count == 0 or nxt is None or above[nxt] == 0:
            return low / self.GUIDE_STEP
        # The log count's slope at the lowest rungs, extended below them linearly in the
        # magnitude: a light tail's slope flattens downwards, and a power law would overshoot.
        power = math.log(count / above[nxt]) / math.log(rungs[nxt] / low)
        return max(0.5 * low, low * (1 - math.log(rank / count) / power))

    def exact_topk(self, acc: torch.Tensor, k: int, preselected: Preselection | None,
                   stats: CallStats) -> tuple[torch.Tensor, torch.Tensor]:
        """The exact top-k of |acc| (sorted indexes, their values), ties to the lower index.

        1. When the fused pass's candidates (every entry with |acc| >= the
           guide) number at least k and all were kept, the top-k are among
           them: :func:`kernels.topk_of_candidates` over those few.
        2. Else a selection over all n (``kernels.topk_indexes``); with
           candidates at hand that is a miss, counted as ``local_recomputed``.
        3. The next guide: about the (2k)-th largest |acc| of this call: from the
           candidates' counts at the guide's rungs, which the pass read with its count
           (:meth:`_guide_from_rungs`); else among the candidates (linearly
           extrapolated from ranks k and count when fewer); over all n after a miss.
           Under error feedback entries pile up just below the threshold (they
           grow until they cross it), so a fixed fraction of the k-th largest
           catches anywhere from 2k to 20k entries. A rank instead: the k
           entries between ranks k and 2k stay, and in a steady state about k
           more cross from below per call (as many as leave), so about 2k
           are above the guide next call: room for drift either way.
        Either way the result is the same: that of ``kernels.topk_indexes``.
        """
        n = acc.numel()
        cand = None
        if preselected is not None and preselected.values is not None \
                and k <= preselected.count <= preselected.indexes.numel():
            cand = preselected.values.abs()
            # (the candidates lie at or above the guide, which is positive)
            keep = kernels.topk_of_candidates(preselected.indexes, cand, k, positive=True)
            # index_select: half the time of advanced indexing (0.27 against 0.54 ms at 250k)
            idx, val = preselected.indexes.index_select(0, keep), preselected.values.index_select(0, keep)
        else:
            if preselected is not None:
                stats.events["local_recomputed"] = 1
            idx = kernels.topk_indexes(acc, k, use_abs=True)
            val = acc[idx]
        if self.guided_topk and self.error_feedback and k < n and idx.numel() == k:
            rank = min(n, math.ceil(self.GUIDE_RANK * k))
            if cand is not None and preselected.above is not None:  # counted by the pass: no read
                guide = self._guide_from_rungs(preselected, k, rank)
            elif cand is not None and cand.numel() >= rank:
                guide = kernels.kth_largest(cand, rank)
            elif cand is not None:  # fewer: extend the line through ranks k and count to 2k
                kth, low = torch.stack([val.abs().min(), cand.min()]).tolist()  # one read
                slope = (kth - low) / max(1, cand.numel() - k)
                guide = max(0.5 * low, low - slope * (rank - cand.numel()))
            else:  # after a full selection (a miss, or the first call): one more pass over n
                guide = kernels.kth_largest(acc, rank, use_abs=True)
            self.topk_guide = guide if guide > 0 else None
        return idx, val
