"""Ok-Topk: the O(k) sparse allreduce of Li & Hoefler (PPoPP'22), Algorithm 1.

Notation: P ranks, n elements, k = ceil(density * n). Selection means the
k largest-magnitude nonzero entries, ties broken by lower index
(``sparsecomm.kernels.select``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from .. import kernels
from ..check import CarriedCheck
from ..comm.base import Communicator
from ..compress import Compressor, Encoded
from ..network import Traffic
from ..registry import INDEX_BYTES, register
from ..result import PhaseRecorder, SparseResult
from ..state import CallStats, Compensated, Preselection, State, topk_count
from .distselect import METHODS, count_dtype, global_topk_mask
from .exchange import carry_or_run, equal_boundaries, peak_bits, peak_of, region_sizes, split_and_reduce
from .ladder import (LOCAL_ABOVE, LOCAL_BELOW, SPACING_MAX, SPACING_MIN, bracket_too_wide, local_select, masked, nearest_rung,
                           rung_grid)

__all__ = ["OkTopkState", "oktopk", "oktopk_reduce", "oktopk_gather"]

_TAG_BALANCE = 0x5C02
#: Candidates the fused select keeps, in units of k (the correction needs them all).
FUSED_CAPACITY = 4


class OkTopkState(State):
    """State of Ok-Topk for one tensor.

    Args:
        density: fraction of entries selected, in (0, 1].
        tau: thresholds are re-evaluated exactly every ``tau`` calls and reused
            (with the count check below) in between. 1 = exact every call.
        tau_prime: region boundaries are recomputed every ``tau_prime`` calls.
        error_feedback: keep everything not contributed in a residual.
        balanced: balanced region boundaries (the paper); False = equal split.
        balance_factor: rebalance before the allgatherv when the largest
            rank's count exceeds this times the mean (the paper's 4).
        count_bounds: accepted range of a reused threshold's count, as
            fractions of k. Above the upper bound the threshold is corrected
            exactly from the entries it selected (cheap: they are few), so
            no rank ever sends more than ``floor(hi * k)`` entries in the
            split phase and the global result never exceeds ``floor(hi * k)``
            entries: that is the hard cap on message size. Below the lower
            bound a local selection goes on with fewer entries, and the next
            threshold is measured from this call's accumulator
            (``kernels.estimate_threshold``, see ``checked_select``); only
            when it is (almost) all zero does the next call re-evaluate
            exactly. The global result is held within the bounds on every
            call (see ``_global_select``).
        window: split-and-reduce steps whose messages are posted at once (``bucket=``, its old
            name, still works with a DeprecationWarning).
        local_select: how the local threshold is re-evaluated every ``tau``
            calls (and when none could be estimated): ``"exact"`` selects exactly
            the top-k (the paper); ``"estimate"`` uses
            ``kernels.estimate_threshold`` (a sample plus one sampled
            counting pass: 28 ms against 30-38 ms for the exact select on CPU
            at 25M, and one pass instead of a radix select's four on GPU),
            whose count is within a few percent of k; when it selects too
            few, the same call falls back to the exact select. The count bounds above still apply,
            so the hard cap holds either way.
        global_select: how the exact global threshold is found
            (``algorithms.distselect``): ``"radix"`` in 5 to 9 rounds whose
            counts grow with k (8 rounds of 4-bit digits, 480 bytes, at k = 201;
            4 rounds, 3.5 KiB, from k = 1792), ``"gather"`` in 2 rounds moving
            every candidate, ``"auto"`` (default) gather where the hard cap
            bounds the candidates to at most 16 bytes a selected entry (P up to
            3 at density 1%), radix elsewhere. All three select the same entries.

    Internal fields: ``local_threshold``, ``local_spacing`` (the local rungs' spacing,
    see ``checked_select``), ``global_threshold``,
    ``global_spacing`` (the global rungs' grid, see ``_global_select``),
    ``boundaries`` (P+1 region starts), ``residual``, ``iteration``,
    ``local_stale`` (no local threshold could be estimated: the next call
    re-evaluates exactly) and ``global_stale`` (set only in checkpoints older
    than the rungs); statistics in ``last`` and ``totals`` (see
    :class:`~sparsecomm.state.State`).
    """

    #: Default for states pickled before the setting existed (checkpoints load as they were).
    global_select = "auto"
    #: The global rungs' spacing (see ``_global_select``); also the default for older checkpoints.
    global_spacing = 1 / 80
    #: The local rungs' spacing (see ``checked_select``); also the default for older checkpoints.
    local_spacing = 1 / 80
    RENAMED = {"bucket": "window"}

    def __init__(self, density: float = 0.01, tau: int = 32, tau_prime: int = 64,
                 error_feedback: bool = True, balanced: bool = True,
                 balance_factor: float = 4.0, count_bounds: tuple[float, float] = (2 / 3, 4 / 3),
                 window: int = 4, local_select: str = "exact", global_select: str = "auto",
                 bucket: int | None = None) -> None:
        super().__init__(density, error_feedback)
        window = self._renamed("bucket", bucket, window)
        if local_select not in ("exact", "estimate"):
            raise ValueError(f"local_select must be 'exact' or 'estimate', got {local_select!r}")
        if global_select not in METHODS:
            raise ValueError(f"global_select must be one of {METHODS}, got {global_select!r}")
        for name, value in (("tau", tau), ("tau_prime", tau_prime), ("window", window)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if not isinstance(balanced, bool):
            raise ValueError(f"balanced must be True or False, got {balanced!r}")
        if not balance_factor >= 1:
            raise ValueError(f"balance_factor must be >= 1 (a max/mean ratio), got {balance_factor!r}")
        lo, hi = count_bounds
        if not (0 <= lo <= 1 <= hi):
            raise ValueError(f"count_bounds must satisfy 0 <= low <= 1 <= high, got {count_bounds!r}")
        self.tau, self.tau_prime, self.window = tau, tau_prime, window
        self.balanced, self.balance_factor = balanced, float(balance_factor)
        self.count_bounds = (float(lo), float(hi))
        self.local_select = local_select
        self.global_select = global_select
        # Internal.
        self.local_threshold: float | None = None
        self.global_threshold: float | None = None
        self.boundaries: torch.Tensor | None = None
        self.local_stale = False
        self.global_stale = False
        self.global_spacing = OkTopkState.global_spacing
        self.local_spacing = OkTopkState.local_spacing
        self.local_kth: float | None = None  # last call's k-th largest |acc| (exact or estimated)

    #: Transient: the boundaries as host integers, with the tensor they were read from.
    _TRANSIENT = (*State._TRANSIENT, "_starts")

    def region_starts(self) -> list[int]:
        """``boundaries`` as host integers, read once per new boundaries tensor (on a GPU
        every read is a synchronisation, and steady calls reuse the boundaries)."""
        cached = self.__dict__.get("_starts")
        if cached is None or cached[0] is not self.boundaries:
            cached = self._starts = (self.boundaries, self.boundaries.tolist())
        return cached[1]

    def reuse_due(self, t: int) -> bool:
        """Whether call ``t`` (1-based) reuses the local threshold rather than re-evaluating it."""
        return not (self.local_threshold is None or (t - 1) % self.tau == 0 or self.local_stale)

    def local_floor(self) -> float:
        """The lowest of the reused local threshold's rungs: a reusing call collects every
        entry above it (see ``checked_select``)."""
        return self.local_threshold * math.exp(-LOCAL_BELOW * self.local_spacing)

    def compensate(self, flat: torch.Tensor, zero_out: torch.Tensor | None = None) -> Compensated:
        """residual += flat, fused with the reused-threshold selection when one is due.

        ``kernels.ef_select`` accumulates and selects in one pass over memory
        (numba on CPU, Triton/CuPy on GPU). Up to ``FUSED_CAPACITY * k``
        candidates are kept, enough for the exact correction among them when
        the reused threshold selects too many; they go to the algorithm as
        ``Compensated.preselected``.
        """
        if not (self.error_feedback and self.reuse_due(self.iteration + 1)):
            return super().compensate(flat, zero_out)
        self.n = flat.numel()
        self.residual_on(flat)
        capacity = FUSED_CAPACITY * topk_count(self.density, self.n)
        # The ladder's counts come back with the pass's count: one read for the local selection.
        floor = self.local_floor()
        grid, rungs = rung_grid(floor, self.local_spacing, 0, LOCAL_BELOW + LOCAL_ABOVE, self.residual.dtype)
        sel = kernels.ef_select_counted(flat, self.residual, floor, capacity, zero_selected=False,
                                        zero_out=zero_out, rungs=kernels.dispatch.upload(grid, grid.dtype, self.residual.device))
        return Compensated.counted(self.residual, sel, capacity, zero_out is not None, rungs)

    def fuses_next(self) -> bool:
        return (self.error_feedback and self.reuse_due(self.iteration + 1)) or super().fuses_next()

    @classmethod
    def exact(cls, density: float) -> "OkTopkState":
        """A state for one stateless call: exact thresholds, fresh boundaries, no residual."""
        return cls(density, tau=1, tau_prime=1, error_feedback=False)


@dataclass
class _Reduced:
    """Ok-Topk after steps 1-4 (this rank's region reduced and globally selected): what step 5 needs."""

    acc: torch.Tensor
    k: int
    state: OkTopkState
    codec: Compressor
    stats: CallStats
    local_idx: torch.Tensor
    sent_local: torch.Tensor
    red_rel: torch.Tensor
    red_val: torch.Tensor
    counts: list[int]
    starts: list[int]
    index_dtype: torch.dtype
    #: The largest reduced magnitude on any rank, when the global selection read it.
    peak: float | None = None


def oktopk_reduce(acc: torch.Tensor, k: int, comm: Communicator, state: OkTopkState,
                  codec: Compressor, preselected: Preselection | None = None,
                  check: CarriedCheck | None = None) -> _Reduced:
    """Steps 1-4 of :func:`oktopk`: local selection, boundaries, split and reduce, global selection.

    ``check``: the collective input check, carried by the split's exchange of sizes when
    that is the call's first exchange (boundaries kept, values sent as they are), else run first.
    """
    P, me, n = comm.size, comm.rank, acc.numel()
    t = state.iteration + 1
    stats = CallStats(algorithm="oktopk", n=n, k=k)
    rec = PhaseRecorder(comm, stats)
    repartition = state.boundaries is None or (t - 1) % state.tau_prime == 0 or state.boundaries.numel() != P + 1
    check = carry_or_run(check, codec, carries=not repartition)
    with rec.phase("local_select"):
        local_idx, local_val, local_peak = local_select(acc, k, state, t, stats, preselected)
    stats.local_selected = local_idx.numel()

    with rec.phase("repartition"):
        if repartition:
            state.boundaries = (_balanced_boundaries(local_idx, n, comm, _cap(state, k, P)) if state.balanced
                                else equal_boundaries(n, P, acc.device))
            stats.events["repartitioned"] = 1
    starts = state.region_starts()
    index_dtype = kernels.index_dtype_for(max(region_sizes(starts)))

    with rec.phase("split_reduce"):
        local = codec.encode_shared(comm, local_val)
        sent_local = local.decoded(acc.dtype)
        region = lambda: state.scratch("region", starts[me + 1] - starts[me], acc.dtype, acc.device)  # noqa: E731
        red_rel, red_val = split_and_reduce(local_idx, local, starts, comm, index_dtype,
                                             acc.dtype, state.window, region, padded=True, check=check)
        if check is not None:
            stats.events["check_carried"] = 1

    with rec.phase("global_select"):
        # One rank sending values as they are: the host knows its reduced entries' count (every
        # selected value is nonzero) and their peak already.
        known = ((local_idx.numel(), local_peak) if P == 1 and local_peak is not None
                 and codec.exact_for(acc.dtype) else None)
        keep, counts, peak = _global_select(red_val, k, state, t, comm, stats, known)
        if keep is not None and counts[me] < red_rel.numel():  # (as many kept as there are: all true)
            red_rel, red_val = masked(keep, red_rel, red_val, count=counts[me])
    return _Reduced(acc, k, state, codec, stats, local_idx, sent_local, red_rel, red_val, counts, starts,
                    index_dtype, peak)


def oktopk_gather(r: _Reduced, comm: Communicator) -> SparseResult:
    """Steps 5-6 of :func:`oktopk`: balance and allgatherv, the contributed set."""
    acc, codec, stats, starts = r.acc, r.codec, r.stats, r.starts
    with PhaseRecorder(comm, stats).phase("allgatherv"):
        owned = codec.encode_shared(comm, r.red_val)
        gidx, gwire = _balance_and_allgatherv(r.red_rel, owned.wire, r.counts, starts, comm, r.index_dtype,
                                              codec.wire_dtype, r.state.balance_factor, stats)
        gval = codec.decode(gwire, owned.scale, acc.dtype)
    stats.global_selected = gidx.numel()

    mark = r.state.scratch("mark", acc.numel(), torch.bool, acc.device)
    hit = None
    if comm.size == 1 and gidx.numel() == r.local_idx.numel():  # a part of the selection, as large: all of it
        contributed, sent = r.local_idx, r.sent_local
    elif comm.size == 1:  # the result is a part of this rank's selection: all of it contributed
        contributed, sent = masked(kernels.isin_sorted(r.local_idx, gidx, mark=mark), r.local_idx, r.sent_local,
                                   count=gidx.numel())
    else:  # the whole selection, marked, with nothing sent where it missed (no read of its size)
        hit = kernels.isin_sorted(r.local_idx, gidx, mark=mark)
        contributed, sent = r.local_idx, torch.where(hit, r.sent_local, torch.zeros((), dtype=r.sent_local.dtype))
    # Values that travel as they are bound the result by the largest reduced magnitude.
    bound = r.peak if codec.exact_for(acc.dtype) else None
    return SparseResult(n=acc.numel(), indexes=gidx, values=gval, contributed=contributed, sent=sent,
                        stats=stats, **_kept(r, owned, starts[comm.rank]), bound=bound, reached=hit)


def _kept(r: _Reduced, owned: Encoded, start: int) -> dict[str, torch.Tensor | None]:
    """The owner's re-encoding error of its reduced sums, to keep in its residual (none when
    the encoding is exact)."""
    if r.codec.exact_for(r.acc.dtype):
        return {"kept_idx": None, "kept_val": None}
    return {"kept_idx": r.red_rel + start, "kept_val": r.red_val - owned.decoded(r.acc.dtype)}


def oktopk_volume(n: int, k: int, P: int) -> tuple[float, float]:
    """Words received per rank: 2k(P-1)/P to 6k(P-1)/P.

    The lower bound with balanced regions and no overlap between the ranks' selections."""
    f = (P - 1) / P
    return 2 * k * f, 6 * k * f


#: A steady Ok-Topk call's data bytes over 2k(P-1)/P full entries (16-bit offsets save the rest).
ENTRY_SHARE = 0.83


def oktopk_data_bytes(k: int, P: int, value_bytes: float) -> float:
    """The entries a steady call's busiest rank sends: 2 k (P - 1) / P of an index and a value,
    :data:`ENTRY_SHARE` of that (indexes travel as 16-bit offsets where they fit)."""
    return 2.0 * k * (P - 1) / P * (value_bytes + INDEX_BYTES) * ENTRY_SHARE


def control_bytes(P: int) -> float:
    """The control words of a call (counts, boundaries, the check): 800 + 50 P bytes."""
    return 800.0 + 50.0 * P


def oktopk_traffic(n: int, k: int, P: int, value_bytes: float, ranks_per_node: int = 1, grid: bool = False) -> Traffic:
    """A split-and-reduce to every other rank and a gather from every other rank, each with its
    sizes: 4 (P - 1) messages; the data and control bytes."""
    return Traffic(4.0 * (P - 1), oktopk_data_bytes(k, P, value_bytes) + control_bytes(P))


@register("oktopk", OkTopkState, split=(oktopk_reduce, oktopk_gather), volume=oktopk_volume,
          traffic=oktopk_traffic, global_k=True)
def oktopk(acc: torch.Tensor, k: int, comm: Communicator, state: OkTopkState,
           codec: Compressor, preselected: Preselection | None = None,
           check: CarriedCheck | None = None) -> SparseResult:
    """Ok-Topk (O(k) volume): a balanced split-and-reduce, a global top-k, a balanced allgatherv.

    1. Local selection: every ``tau`` calls the exact top-k of |acc|; in
       between the entries above the reused local threshold, corrected when
       the count leaves ``count_bounds`` (the entries above it come
       ``preselected`` from the fused accumulate-and-select pass).
    2. Every ``tau_prime`` calls, region boundaries: the ranks' histograms
       of their selected indexes are summed (one allreduce), and the P-1 cuts
       split that global distribution into equal counts. Rank j owns region j.
    3. Split and reduce: region j's part goes to rank j, steps rotated
       (step s: send to i+s, receive from i-s) and posted ``window`` steps at
       a time, reducing one window's parts while the next is in flight.
    4. Global selection of the reduced entries: every ``tau`` calls exactly
       (distributed radix select, ``algorithms.distselect``); in between with
       the reused global threshold or a rung near it, whichever one round of
       counts finds within the bounds, else exactly.
    5. Balance and allgatherv: if the largest rank's count exceeds
       ``balance_factor`` times the mean, the packed records are first
       redistributed evenly with point-to-point sends; one allgatherv then
       gives every rank the result (unbalanced, each region as one
       ``kernels.pack_message``: 16-bit offsets within blocks where that is
       smaller).
    6. Contributed set: local selections that are in the global result.

    Values travel through ``codec`` twice: local values in step 3, reduced
    sums in step 5; the owner of a region keeps the second encoding's error
    in its residual (``SparseResult.kept_*``). Steps 1-4 and 5-6 are the
    registered halves (:func:`oktopk_reduce`, :func:`oktopk_gather`) that
    DeAR runs apart. ``check``: see :func:`oktopk_reduce`.
    """
    return oktopk_gather(oktopk_reduce(acc, k, comm, state, codec, preselected, check), comm)


#: Bins a region in the boundaries' histogram, up to 16 ranks.
_BINS_PER_REGION = 16
#: Past 16 ranks the bins are sized by k instead (one for two entries a rank may select),
#: but never fewer than this: 134 bins at P = 256, k = 201, where 2 a region (512) were
#: 2.5x the data bound by themselves.
_BINS_AT_LEAST = 128


def _balanced_boundaries(local_idx: torch.Tensor, n: int, comm: Communicator,
                         most: int | None = None) -> torch.Tensor:
    """Region starts that split every rank's selected indexes, taken together, into P equal parts.

    1. Histogram this rank's selected indexes over B = min(n, 16 P) equal bins; with
       ``most``, a bound on all ranks' selections together, past 256 bins at most one
       for two entries one rank may select (at least 128), so that the histogram's
       words grow with k, not with P (B = 666 instead of 4096 at P = 256, k = 1000;
       134 at k = 201, fewer than the regions: cuts inside a bin are interpolated).
    2. Sum the histograms over ranks: one allreduce of B counts (int32 when ``most``
       fits: half the bytes).
    3. Cut j goes where the global cumulative count reaches j T / P, interpolated
       linearly inside its bin, in integers: every rank computes the same cuts.

    Region j then receives about T / P entries in the split phase however
    differently the ranks select (averaging each rank's own cut points, the
    paper's rule, sent one region 2.2x its share on the layered gradient at
    P = 256).
    """
    P, dev = comm.size, local_idx.device
    if P == 1:
        return torch.tensor([0, n], dtype=torch.int64, device=dev)
    B = _BINS_PER_REGION * P
    if most is not None and B > 256:
        B = min(B, max(_BINS_AT_LEAST, most // P // 2))
    B = max(1, min(n, B))
    hist = torch.bincount(local_idx * B // n, minlength=B).to(count_dtype(most))
    total = comm.allreduce(hist, "sum").to(torch.int64)
    cum = torch.cumsum(total, 0)
    T = int(cum[-1])
    if T == 0:
        return equal_boundaries(n, P, dev)
    targets = torch.arange(1, P, device=dev) * T  # j T / P, scaled by P to stay in integers
    b = torch.searchsorted(cum * P, targets)  # the bin where the cumulative count reaches it
    prev = torch.where(b > 0, cum[(b - 1).clamp(min=0)], torch.zeros_like(b))
    edges = (torch.arange(B + 1, device=dev) * n + B - 1) // B  # bin b holds [edges[b], edges[b+1])
    lo_e, width = edges[b], edges[b + 1] - edges[b]
    cuts = lo_e + (targets - prev * P) * width // (total[b] * P).clamp(min=1)
    ends = torch.tensor([0, n], dtype=torch.int64, device=dev)
    return torch.cat([ends[:1], cuts, ends[1:]])


# ---- step 4: global selection ---------------------------------------------------
#: Rungs counted either side of the reused global threshold in a reusing call's one
#: allgather: the grid is threshold * exp(spacing * j), j = -GRID_HALF..GRID_HALF.
GRID_HALF = 8
#: A reused global threshold stays while its total lies within these fractions of k: moving
#: to the rung nearest k every call makes error feedback swing the count (a call that sends
#: more leaves less for the next), staying anywhere within the bounds let the mean settle
#: at 0.88 k on the drifting gradient.
HOME_BAND = (0.95, 1.05)


def _global_select(val: torch.Tensor, k: int, st: OkTopkState, t: int, comm: Communicator,
                   stats: CallStats, known: tuple[int, float] | None = None
                   ) -> tuple[torch.Tensor | None, list[int], float | None]:
    """Mask of this rank's reduced entries ``val`` in the global result (None: all of them),
    every rank's count, and the
    largest reduced magnitude on any rank when a reusing call's read brought it (else None).

    1. Every ``tau`` calls (and the first): the exact global top-k (``global_topk_mask``).
    2. In between, one allgather of every rank's counts at each rung of a geometric grid
       around the reused threshold (one bucketing pass). While the reused threshold's
       total is within ``HOME_BAND`` of k it stays: chasing k every call makes error
       feedback swing the count from call to call (a call that sends more leaves less
       behind for the next). Otherwise the rung within the bounds whose total is nearest
       k becomes the threshold (``global_moved``), at no extra round.
    3. No rung within the bounds, but all nonzero reduced entries together are at most
       ``high * k``: take them all (``global_all``; at P = 1 the local selection always
       fits). After a call that took them all there is no threshold to reuse: the next
       call counts them (one allgather of an integer) and takes them all again if they fit.
    4. Otherwise the exact top-k, among the candidates of the rung
       with the fewest that still hold k (``global_corrected``), or among all reduced
       entries (``global_under``, then ``global_recomputed``). So every call's result
       holds between ``low * k`` and ``high * k`` entries (fewer only when fewer
       reduced entries are nonzero).
    5. The grid adapts, the same on every rank (it depends only on the totals): its
       spacing halves when the total jumps over the bounds between two neighbouring
       rungs, and doubles when k lies beyond the grid or the threshold moved to its
       outermost rung. Under error feedback the reduced magnitudes crowd just above the
       local thresholds (an entry is sent soon after it crosses), so the total can fall
       from 2k to 0.01k within 10% of the threshold, and that cluster moves every call
       while the residuals build up.

    The largest magnitude travels with the counts (float32 bits, whose order as integers
    is that of non-negative floats): it bounds the result, so its overflow check reads
    nothing more. ``known``: this rank's count of nonzero magnitudes and their largest, when
    the host holds them (one rank): then the call that takes every entry reads nothing.
    """
    lo, hi = st.count_bounds
    peak = None
    periodic = (t - 1) % st.tau == 0 or st.global_stale
    if not periodic and st.global_threshold is None and known is not None and comm.size == 1 and known[0] <= hi * k:
        # The last call took every entry, and this one's are all nonzero and fit: nothing to mask.
        stats.events["global_all"] = 1
        return None, [known[0]], known[1]
    mag = val.abs()
    if not periodic and st.global_threshold is None:  # the last call took every entry
        if known is not None and comm.size == 1:
            per_rank, peak = [known[0]], known[1]
        else:
            local = torch.cat([torch.count_nonzero(mag).reshape(1).to(torch.int64), peak_bits(mag).to(torch.int64)])
            rows = comm.allgather(local.reshape(1, 2)).reshape(comm.size, 2).tolist()
            per_rank, peak = [row[0] for row in rows], peak_of([row[-1] for row in rows], mag.dtype)
        if sum(per_rank) <= hi * k:
            stats.events["global_all"] = 1
            return mag != 0, per_rank, peak
    elif not periodic:
        s = st.global_spacing
        grid, rungs = rung_grid(st.global_threshold, s, -GRID_HALF, GRID_HALF, mag.dtype)
        edges = kernels.dispatch.upload(grid, grid.dtype, mag.device)
        # bucket > j: at or above edges[j]. Counts and masks both come from the buckets, so
        # they agree whatever mag holds (a NaN sum lands above every edge, where a comparison
        # would leave it out of the mask but not of the count), and zeros fall below every edge.
        rung, hist = kernels.bucketize(mag, edges)
        above = hist.flip(0).cumsum(0).flip(0)[1:]
        nonzero = torch.count_nonzero(mag).reshape(1).to(above.dtype)
        # int32 on the wire (the allgather is P x 18 counts, the only control traffic of a
        # reusing call); a count past 2^31 - 1 only ever meets "above the bounds".
        local = torch.cat([torch.cat([above, nonzero]).clamp_(max=2**31 - 1).to(torch.int32), peak_bits(mag)])
        # One read of the whole table: the totals, the counts of the rung chosen from them, the peak.
        rows = comm.allgather(local.reshape(1, -1)).reshape(comm.size, -1).tolist()
        per_rank, peak = [row[:-1] for row in rows], peak_of([row[-1] for row in rows], mag.dtype)
        *totals, available = [sum(column) for column in zip(*per_rank)]
        j = nearest_rung(totals, k, lo, hi, home=GRID_HALF, stay=HOME_BAND)
        if j is not None:
            if bracket_too_wide(totals, k):
                st.global_spacing = max(s / 2, SPACING_MIN)
            if j != GRID_HALF:
                # The next call's threshold goes on by half this move: under error feedback
                # the reduced magnitudes grow call after call while the residuals build up,
                # and a threshold that only followed fell below its whole grid.
                st.global_threshold = rungs[j] * math.exp(s * (j - GRID_HALF) / 2)
                stats.events["global_moved"] = 1
                if j in (0, 2 * GRID_HALF):
                    st.global_spacing = min(2 * s, SPACING_MAX)
            return rung > j, [row[j] for row in per_rank], peak
        # No rung fits: the grid is too coarse if the total jumps over the bounds between
        # two rungs (it is non-increasing along the grid), else too narrow, unless too few
        # reduced entries are nonzero for any threshold to fit.
        if totals[0] > hi * k and totals[-1] < lo * k:
            st.global_spacing = max(s / 2, SPACING_MIN)
        elif available >= lo * k:
            st.global_spacing = min(2 * s, SPACING_MAX)
        if available <= hi * k:
            # Every nonzero reduced entry fits under the cap (at P = 1 the local selection
            # always does): take them all, as an exact selection would below k, with none.
            stats.events["global_all"] = 1
            return mag != 0, [row[-1] for row in per_rank], peak
        enough = [j for j, total in enumerate(totals) if total >= k]
        if enough:  # the exact top-k are among the fewest candidates that hold k
            j = enough[-1]
            masked = torch.where(rung > j, mag, torch.zeros_like(mag))
            mask, counts, st.global_threshold = global_topk_mask(masked, k, comm, st.global_select, totals[j])
            stats.events["global_corrected"] = 1
            return mask, counts, peak
        stats.events["global_under"] = 1
    mask, counts, st.global_threshold = global_topk_mask(mag, k, comm, st.global_select, _cap(st, k, comm.size))
    st.global_stale = False
    stats.events["global_recomputed"] = 1
    return mask, counts, peak


def _cap(st: OkTopkState, k: int, P: int) -> int:
    """The most reduced entries all ranks can hold: every rank sends at most floor(hi k)."""
    return P * int(st.count_bounds[1] * k)


# ---- step 5: balance and allgatherv ---------------------------------------------
def _balance_and_allgatherv(rel: torch.Tensor, wire: torch.Tensor, counts: list[int], starts: Sequence[int],
                            comm: Communicator, index_dtype: torch.dtype, wire_dtype: torch.dtype,
                            factor: float, stats: CallStats) -> tuple[torch.Tensor, torch.Tensor]:
    """Every rank's entries of its region, concatenated in region order, as (global indexes, wire values).

    Unbalanced, each rank's region travels as one ``kernels.pack_message``
    (16-bit offsets within blocks where that is smaller; every rank knows each
    message's size from ``counts`` and the region spans). Rebalanced, slices
    of the region-ordered list move between ranks, so the fixed-size records
    of ``kernels.pack_records`` travel instead, cut at any entry.
    """
    P, me, total = comm.size, comm.rank, sum(counts)
    if P == 1:  # both fresh this call (an index_select, an encoding): nothing to copy
        return rel, wire
    span = region_sizes(starts)
    if not (total and max(counts) > factor * total / P):
        msg = kernels.pack_message(rel, wire, span[me], index_dtype, wire_dtype)
        sizes = kernels.messages_bytes(counts, span, index_dtype, wire_dtype)
        return kernels.unpack_messages(comm.allgatherv(msg, sizes), counts, span, starts[:-1], index_dtype,
                                       wire_dtype)
    records, held = _rebalance(kernels.pack_records(rel, wire, index_dtype, wire_dtype), counts, comm)
    stats.events["balanced"] = 1
    rel, vals = kernels.unpack_records(comm.allgatherv(records, held), index_dtype, wire_dtype)
    # Records come in region order, region j's at [C_j, C_j + counts[j]): one in-place add per
    # region in small worlds; past 64 one add of every record's region start, expanded from
    # host-known sizes (no read of the device), in place of a thousand small operations.
    if P > 64:
        rel += torch.repeat_interleave(torch.tensor(starts[:-1]), torch.tensor(counts),
                                       output_size=total).to(rel.device)
        return rel, vals
    at = 0
    for start, count in zip(starts[:-1], counts):
        if start and count:
            rel[at:at + count] += start
        at += count
    return rel, vals


def _rebalance(records: torch.Tensor, counts: list[int], comm: Communicator) -> tuple[torch.Tensor, list[int]]:
    """Move records so rank m holds positions [m*T//P, (m+1)*T//P) of the region-ordered list.

    Every rank derives the same plan from ``counts``: rank j's records sit at
    positions [C_j, C_j + counts[j]) of the concatenation (C = prefix sums),
    and each overlap with another rank's target range is one message.
    """
    P, me, T = comm.size, comm.rank, sum(counts)
    C = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)])
    D = np.arange(P + 1, dtype=np.int64) * T // P
    # The overlaps of this rank's records with every target range, and of every rank's
    # records with this rank's target range: O(P) array work, nothing per peer in Python.
    out_lo, out_hi = np.maximum(C[me], D[:-1]), np.minimum(C[me + 1], D[1:])
    in_lo, in_hi = np.maximum(C[:-1], D[me]), np.minimum(C[1:], D[me + 1])
    sends, pieces = [], []
    targets = np.flatnonzero(out_lo < out_hi)
    for m in targets[np.argsort((targets - me) % P, kind="stable")].tolist():  # in rotation order
        if m != me:
            a, b = int(out_lo[m]) - int(C[me]), int(out_hi[m]) - int(C[me])
            sends.append(comm.isend(records[a:b].contiguous(), m, _TAG_BALANCE))
    for j in np.flatnonzero(in_lo < in_hi).tolist():
        a, b = int(in_lo[j]), int(in_hi[j])
        if j == me:
            pieces.append((j, None, records[a - int(C[me]):b - int(C[me])]))
        else:
            buf = torch.empty((b - a, records.shape[1]), dtype=records.dtype, device=records.device)
            pieces.append((j, comm.irecv(buf, j, _TAG_BALANCE), buf))
    for _, req, _ in pieces:
        if req is not None:
            req.wait()
    for req in sends:
        req.wait()
    mine = torch.cat([buf for _, _, buf in pieces]) if pieces else records[:0]
    return mine, np.diff(D).tolist()
