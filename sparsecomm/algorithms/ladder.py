"""The rung ladder: counts of candidates at rungs around a predicted threshold, and the
threshold chosen from them; Ok-Topk's local selection, built on it.

A ladder is a few magnitudes ``base * exp(spacing * j)`` (:func:`rung_grid`) at which the
candidates are counted in one pass; the rung whose count is nearest k is the threshold
(:func:`nearest_rung`), and the spacing follows how well the last prediction did. Ok-Topk's
local selection (:func:`local_select`) is exact every tau calls, else a reusing call's fused
accumulate-and-select pass collects every entry above the lowest rung and
:func:`checked_select` keeps those above the chosen rung, corrects above the bounds and
selects again below them, and moves the prediction for the next call (docs/design.md,
Ok-Topk, step 1). The global selection (``oktopk.py``) counts its reduced values on the same
kind of ladder.
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Protocol

import torch

from .. import kernels
from ..state import CallStats, Preselection



class LocalState(Protocol):
    """What the local selection reads and moves in its state (an ``OkTopkState``)."""

    count_bounds: tuple[float, float]
    local_select: str
    local_threshold: float | None
    local_spacing: float
    local_kth: float | None
    local_stale: bool

    def reuse_due(self, t: int) -> bool: ...

    def local_floor(self) -> float: ...

__all__ = ["LocalState", "local_select", "checked_select", "masked", "bracket_too_wide", "nearest_rung", "tail_threshold",
           "rung_grid",
           "LOCAL_BELOW", "LOCAL_ABOVE", "LOCAL_SPACING_MAX", "BRACKET", "SPACING_MIN", "SPACING_MAX"]

#: Magnitudes the tail fit of :func:`tail_threshold` looks at, at most.
_TAIL_SAMPLE = 1 << 16
#: The local rungs of a reusing call: the reused threshold times exp(spacing * j),
#: j = -LOCAL_BELOW..LOCAL_ABOVE (see ``checked_select``).
LOCAL_BELOW, LOCAL_ABOVE = 2, 8
#: The local rungs' widest spacing: the lowest rung then lies 18% below the threshold (a
#: wider one collected more candidates than the fused pass keeps on every call).
LOCAL_SPACING_MAX = 0.1
#: Neighbouring rungs whose totals bracket k and differ by more than this ratio halve the
#: spacing: the reduced magnitudes crowd so that 1.25% in the threshold moved the global
#: total from 1.6 k to 0.85 k, and the mean settled at 0.89 k.
BRACKET = 1.5
#: Range of a ladder's or grid's spacing (a log-ratio): it halves when the count jumps over the
#: bounds between two rungs and doubles when k lies beyond the grid.
SPACING_MIN, SPACING_MAX = 2.0 ** -9, 0.5


def masked(mask: torch.Tensor, *tensors: torch.Tensor, count: int | None = None) -> tuple[torch.Tensor, ...]:
    """``t[mask]`` for each tensor, with one ``nonzero`` for all of them: on a GPU one sync,
    none when the caller knows the ``count`` of True entries already (``kernels.nonzero``).

    ``index_select`` rather than ``t[pos]``: 4x faster on CPU (0.27 against 1.05 ms for 250k).
    """
    pos = kernels.nonzero(mask, count)
    return tuple(t.index_select(0, pos) for t in tensors)


# ---- step 1: local selection -------------------------------------------------
def local_select(acc: torch.Tensor, k: int, st: LocalState, t: int, stats: CallStats,
                  preselected: Preselection | None) -> tuple[torch.Tensor, torch.Tensor, float | None]:
    """The sorted local selection, its values in ``acc``, and their largest magnitude when the
    host holds it already (else None)."""
    if not st.reuse_due(t):
        st.local_stale = False
        stats.events["local_recomputed"] = 1
        if st.local_select == "estimate" and k < acc.numel():
            # A threshold from a sample and sampled counts, then the same
            # checks as a reused one (the hard cap included).
            got = _estimated_select(acc, k, st, stats)
            if got is not None:
                return got
            # Too few (ties, or a sample in step with a periodic layout would
            # give the same estimate every time): select exactly instead.
            stats.events["local_estimate_fallback"] = 1
        return _exact_local(acc, k, st)
    th = st.local_floor()
    if preselected is not None:  # selected while accumulating the residual (fused, one pass)
        idx, count = preselected.indexes, preselected.count
        if count > idx.numel():  # more candidates than the buffer held (the gradient jumped)
            # The ladder reached too low: narrow it, and select above a threshold measured
            # from acc (a sample, a sampled count and one read), not exactly (four passes).
            stats.events["local_overflowed"] = 1
            st.local_spacing = max(st.local_spacing / 2, SPACING_MIN)
            return _reselect(acc, k, st, stats)
        val = preselected.values if preselected.values is not None else acc[idx]
    else:
        idx = kernels.select_above(acc, th, use_abs=True)
        count = idx.numel()
        val = acc[idx]
    if count == 0 and bool((acc != 0).any()):
        # The threshold overshot (the top entries of the last call left with its residual):
        # sending nothing would waste the call, so select exactly, as a re-evaluation would.
        stats.events["local_recomputed"] = 1
        return _exact_local(acc, k, st)
    ladder = preselected if preselected is not None and preselected.above is not None else None
    return checked_select(acc, idx, val, count, th, k, st, stats, rungs=True, ladder=ladder)


def _exact_local(acc: torch.Tensor, k: int, st: LocalState) -> tuple[torch.Tensor, torch.Tensor, None]:
    """The exact local top-k (sorted indexes, values); its k-th largest guides the next threshold."""
    idx = kernels.topk_indexes(acc, k, use_abs=True)
    val = acc[idx]
    _set_local_threshold(st, float(val.abs().min()) if idx.numel() else None)
    return idx, val, None


def checked_select(acc: torch.Tensor, idx: torch.Tensor, val: torch.Tensor, count: int, th: float, k: int,
                    st: LocalState, stats: CallStats, rungs: bool = False,
                    ladder: Preselection | None = None) -> tuple[torch.Tensor, torch.Tensor, float | None]:
    """Apply the count bounds to the selection ``idx`` above ``th``, and re-estimate the threshold.

    ``ladder``: the fused pass's counts at the rungs of step 1, read with its count.

    1. A reusing call (``rungs``; ``th`` is the lowest rung, ``OkTopkState.local_floor``)
       counts its candidates above each rung th * exp(spacing * j), j = 0..LOCAL_BELOW +
       LOCAL_ABOVE (one bucketing pass over the few candidates), and keeps those above the
       rung within the bounds whose count is nearest k. Under error feedback the
       accumulated magnitudes crowd just above the last threshold (an entry is sent soon
       after it crosses), so a threshold 3% low selected 1.7 k on a repeating gradient:
       no single reused threshold holds the bounds, a ladder of them does. The spacing
       doubles (to at most ``LOCAL_SPACING_MAX``) when the chosen rung is an outer one or
       k lies beyond the ladder, and halves when the counts of two neighbouring rungs
       bracket k more than ``BRACKET`` apart (or jump over the bounds) and when the fused
       pass's buffer overflowed.
    2. Above the upper bound at every rung (or at ``th`` without rungs): keep the exact
       top-k of these few candidates (``local_corrected``).
    3. Below the lower bound: the threshold is ``kernels.estimate_threshold`` of ``acc``
       (a sample and a sampled count, ~6 ms at 25M on one CPU thread), with no trend,
       for the next call and, in a reusing call, for this one too (one more read of acc,
       ``local_reselected``; 2 then applies to it); else the call goes on with fewer.
    4. Otherwise the next threshold is where this call would have selected k (between
       the two rungs whose counts bracket k, interpolated in log-log; its exact k-th
       largest without rungs; :func:`tail_threshold` of the magnitudes above ``th`` or
       the top rung where k lies beyond them), moved on by the trend of those thresholds
       over the last two calls, so that a count drifting with error feedback stays
       centred on the ladder.
    """
    lo, hi = st.count_bounds
    mag = val.abs()
    under = idx.numel() < lo * k
    est = top = None
    if rungs and not under:
        # (the largest candidate survives the rung's cut and the correction: it is the ceiling)
        idx, val, mag, est, top = _ladder_select(idx, val, mag, count, th, k, st, stats, ladder)
    elif under and k < acc.numel():
        # Measure rather than extrapolate: error feedback crowds the exceedances just
        # above th, so a tail fitted to them is too steep and the next count fell
        # short again (or, after a swing, overflowed the fused buffer).
        est = kernels.estimate_threshold(acc, k)
        if not est > torch.finfo(torch.float32).tiny:  # (almost) all zero: select exactly next call
            est = None
        elif rungs:
            # A reusing call's gradient fell below the whole ladder (a real model's gradient
            # norm moves by half from one step to the next): one more read of acc above the
            # estimate, rather than a short call.
            return _reselect(acc, k, st, stats, est)
    elif k <= idx.numel() == count:  # every exceedance is at hand: this call's exact k-th largest
        est = kernels.kth_largest(mag, k)  # numpy's introselect on CPU: 8x torch.kthvalue
    else:  # fewer than k: extrapolate the tail downwards
        est = tail_threshold(mag, count, th, k)
    if idx.numel() > hi * k:
        # Too many: the exact top-k are among these few candidates.
        keep = kernels.topk_of_candidates(idx, mag, k)
        idx, val = idx[keep], val[keep]
        stats.events["local_corrected"] = 1
    if under:
        stats.events["local_under"] = 1
    if est is None:  # nothing above th, or all of it at th: re-evaluate exactly next call
        st.local_stale = True
    else:  # never above this call's largest magnitude: the next call selects something
        if top is None and mag.numel():
            top = float(mag.max())
        _set_local_threshold(st, est, ceiling=top if mag.numel() else None, trusted=not under)
    return idx, val, top


def _reselect(acc: torch.Tensor, k: int, st: LocalState, stats: CallStats,
              est: float | None = None) -> tuple[torch.Tensor, torch.Tensor, float | None]:
    """A reusing call whose candidates missed the ladder: select above a threshold measured
    from ``acc`` (``kernels.estimate_threshold``, unless given), checked like any selection
    (step 2 of :func:`checked_select` applies); exactly when that selects too few."""
    stats.events["local_reselected"] = 1
    got = _estimated_select(acc, k, st, stats, est)
    if got is None:
        stats.events["local_recomputed"] = 1
        got = _exact_local(acc, k, st)
    return got


def _estimated_select(acc: torch.Tensor, k: int, st: LocalState, stats: CallStats,
                      th: float | None = None) -> tuple[torch.Tensor, torch.Tensor, float | None] | None:
    """The entries above ``th`` (default: ``kernels.estimate_threshold`` of ``acc``: a sample
    plus one sampled counting pass), checked by :func:`checked_select` (the hard cap
    included); None when they are fewer than the lower bound."""
    th = kernels.estimate_threshold(acc, k) if th is None else th
    if not th > torch.finfo(torch.float32).tiny:
        return None
    idx = kernels.select_above(acc, th, use_abs=True)
    if idx.numel() < st.count_bounds[0] * k:
        return None
    return checked_select(acc, idx, acc[idx], idx.numel(), th, k, st, stats)


def _ladder_select(idx: torch.Tensor, val: torch.Tensor, mag: torch.Tensor, count: int, floor: float, k: int,
                   st: LocalState, stats: CallStats, ladder: Preselection | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float | None, float]:
    """Step 1 of :func:`checked_select`: the candidates above the chosen local rung, where
    this call's k-th largest lies (None when nothing could tell), and the largest candidate."""
    lo, hi = st.count_bounds
    s = st.local_spacing
    if ladder is not None:  # counted by the fused pass, at these same rungs
        rungs, above, top, rung = ladder.rungs, list(ladder.above), ladder.top, ladder.rung
    else:
        grid, rungs = rung_grid(floor, s, 0, LOCAL_BELOW + LOCAL_ABOVE, mag.dtype)
        rung, hist = kernels.bucketize(mag, kernels.dispatch.upload(grid, grid.dtype, mag.device))
        # One read for the counts (above[j]: candidates at or above rung j) and the largest
        # candidate (the ceiling of the next threshold): float64 holds both exactly.
        *above, top = torch.cat([hist.flip(0).cumsum(0).flip(0)[1:].to(torch.float64),
                                 (mag.max().reshape(1) if mag.numel() else mag.new_zeros(1)).to(torch.float64)
                                 ]).tolist()
        above = [int(a) for a in above]
    above[0] = count  # the pass's own count (the float64 floor may lie below grid[0], cast to mag's dtype)
    est = _kth_from_rungs(mag, above, rungs, k)
    j = nearest_rung(above, k, lo, hi, home=LOCAL_BELOW)
    if j is None:
        if above[0] > hi * k and above[-1] < lo * k:
            st.local_spacing = max(s / 2, SPACING_MIN)
        else:
            st.local_spacing = min(2 * s, LOCAL_SPACING_MAX)
    else:
        if j in (0, len(above) - 1):
            st.local_spacing = min(2 * s, LOCAL_SPACING_MAX)
        elif bracket_too_wide(above, k):
            st.local_spacing = max(s / 2, SPACING_MIN)
        if j:  # above the floor: keep the candidates at or above rung j (above[j] of them)
            idx, val, mag = masked(rung > j, idx, val, mag, count=above[j])
        if j != LOCAL_BELOW:  # not the predicted threshold's rung
            stats.events["local_moved"] = 1
    return idx, val, mag, est, top


def _kth_from_rungs(mag: torch.Tensor, above: list[int], rungs: list[float], k: int) -> float | None:
    """Where this call's k-th largest of the candidates ``mag`` lies, from their counts
    ``above`` at the ascending ``rungs``: between the two rungs that bracket k (log-log
    interpolation; at a cliff, where their counts differ by more than ``BRACKET``, the exact
    k-th largest, O(candidates)), else by a tail fit beyond the ladder."""
    if above[0] < k:  # fewer than k candidates: the tail below the floor
        return tail_threshold(mag, above[0], rungs[0], k)
    for i in range(len(above) - 1):
        if above[i] >= k > above[i + 1]:
            if above[i] > BRACKET * above[i + 1]:
                return kernels.kth_largest(mag, k)
            frac = math.log(above[i] / k) / math.log(above[i] / above[i + 1])
            return rungs[i] * (rungs[i + 1] / rungs[i]) ** frac
    return tail_threshold(mag[mag >= rungs[-1]], above[-1], rungs[-1], k)  # k beyond the top rung


def rung_grid(base: float, spacing: float, first: int, last: int,
              dtype: torch.dtype) -> tuple[torch.Tensor, list[float]]:
    """The rungs ``base * exp(spacing * j)``, j = first..last, in ``dtype``, on the host: as a
    tensor (to upload) and as floats.

    Ascending (a cast to a narrow dtype may merge neighbours, which keeps them sorted),
    positive and finite. Host work by design (``kernels.dispatch.host_side``): reading
    them costs no synchronisation on a GPU.
    """
    with kernels.dispatch.host_side():
        steps = torch.arange(first, last + 1, dtype=torch.float64)
        info = torch.finfo(dtype)
        grid = (base * torch.exp(spacing * steps)).clamp_(info.tiny, info.max).to(dtype)
        return grid, grid.tolist()


def bracket_too_wide(totals: list[int], k: int) -> bool:
    """Whether the two neighbouring rungs whose totals bracket k differ by more than
    ``BRACKET`` (then no rung can land near k, and the spacing halves)."""
    return any(totals[i] >= k > totals[i + 1] and totals[i] > BRACKET * totals[i + 1]
               for i in range(len(totals) - 1))


def nearest_rung(totals: list[int], k: int, lo: float, hi: float, home: int | None = None,
                  stay: tuple[float, float] = (1.0, 1.0)) -> int | None:
    """The rung whose total lies within [lo k, hi k] nearest k (as a ratio), or None.

    ``home`` (the reused threshold's rung) is kept while its total lies within ``stay``
    (fractions of k), and wins ties. Compared exactly: the ranks must agree on the rung.
    """
    fits = [j for j, total in enumerate(totals) if lo * k <= total <= hi * k and total > 0]
    if not fits:
        return None
    if home is not None and home in fits and stay[0] * k <= totals[home] <= stay[1] * k:
        return home
    near = 0 if home is None else home
    return min(fits, key=lambda i: (Fraction(max(totals[i], k), min(totals[i], k)), abs(i - near)))


def _set_local_threshold(st: LocalState, kth: float | None, ceiling: float | None = None,
                         trusted: bool = True) -> None:
    """Next call's threshold from this call's k-th largest magnitude ``kth`` (exact or estimated),
    at most ``ceiling``.

    An estimate extrapolated from too few exceedances (``trusted=False``) takes no part
    in a trend, neither now nor at the next call: on a shrinking gradient the trend from
    it to the next call's k-th largest overshot, the next count fell below the bounds
    again, and so on (every other call selected 0.003-0.08 k; now 0.25-0.48 k at worst).
    Dropping the trend after a call above the bounds as well did better on that gradient
    but lengthened error feedback's build-up of corrections on every other one.
    """
    prev, st.local_kth = st.local_kth, (kth if trusted else None)
    if not trusted:
        prev = None
    if kth is None or not kth > 0:
        st.local_threshold = kth
        return
    # The k-th largest moves steadily under error feedback (residuals grow on what is not
    # sent), and its growth slows as it settles: follow half its trend (in log terms)
    # for one call, at most 25% either way, so a jump is not amplified.
    trend = 1.0 if prev is None or not prev > 0 else min(1.25, max(0.8, (kth / prev) ** 0.5))
    st.local_threshold = kth * trend if ceiling is None else min(kth * trend, ceiling)


def tail_threshold(mags: torch.Tensor, count: int, th: float, k: int) -> float | None:
    """Where about k of this call's magnitudes would have been above, from those above ``th``.

    1. Fit a power-law tail to the magnitudes above ``th`` (the Hill estimator,
       alpha = m / sum(ln(mag / th)), over at most ``_TAIL_SAMPLE`` of the
       ``count`` magnitudes, strided).
    2. Return ``th * (count / k) ** (1 / alpha)``: that tail's k-th largest.

    O(m), no selection. None when nothing was above ``th`` or everything sat at it.
    """
    if count <= 0 or mags.numel() == 0 or not th > 0:
        return None
    sample = mags[::max(1, mags.numel() // _TAIL_SAMPLE)]  # plenty for one exponent
    # float64: a ratio to th past float32's range (1e10 over 1e-30) must not make alpha 0
    logs = float(torch.log(sample.to(torch.float64) / th).clamp_(min=0).sum())
    if not 0 < logs < math.inf:
        return None
    alpha = sample.numel() / logs
    estimate = th * (count / k) ** (1.0 / alpha)
    return estimate if 0 < estimate < math.inf else None


# ---- step 2: region boundaries ---------------------------------------------------
#: Histogram bins per region for the boundaries: a cut lands within one bin's count.
