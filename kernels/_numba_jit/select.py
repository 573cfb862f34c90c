"""Threshold passes: selection above a threshold, bracketing, counts above several thresholds, bucketing."""

from __future__ import annotations

import numpy as np
from numba import njit

from ._base import BLOCK, _lowest_bit

__all__ = ["select_span", "bracket_span", "count_above_span", "bucket_span"]


@njit(nogil=True, cache=True, inline="always")
def _select_blocks(x, th, offset, out_idx, use_abs):
    n = x.size
    cnt = 0
    nb = n // BLOCK
    for b in range(nb):
        b0 = b * BLOCK
        m = np.uint32(0)
        for j in range(BLOCK):
            v = abs(x[b0 + j]) if use_abs else x[b0 + j]
            m |= np.uint32(v >= th) << np.uint32(j)
        while m:
            j, low = _lowest_bit(m)
            out_idx[cnt] = offset + b0 + j
            cnt += 1
            m ^= low
    for i in range(nb * BLOCK, n):
        v = abs(x[i]) if use_abs else x[i]
        if v >= th:
            out_idx[cnt] = offset + i
            cnt += 1
    return cnt


@njit(nogil=True, cache=True)
def select_span(x, th, offset, out_idx, use_abs):
    """Indexes (+ ``offset``) of x >= th (|x| >= th with ``use_abs``) over one span; the count.

    ``th`` > 0. ``out_idx`` must hold the whole span. Same two-level loop as
    :func:`ef_select_span`: a vectorised bit mask per block, then its set
    bits. The two variants are compiled separately so the inner loop has no
    branch on ``use_abs``.
    """
    if use_abs:
        return _select_blocks(x, th, offset, out_idx, True)
    return _select_blocks(x, th, offset, out_idx, False)


@njit(nogil=True, cache=True)
def bracket_span(x, use_abs, lo, hi, cand, cap):
    """One pass over a span: count x > hi and collect x in [lo, hi].

    The candidates go to ``cand`` while fewer than ``cap`` were found.
    Returns (count above hi, TRUE candidate count). ``use_abs`` compares |x|.
    """
    gt = 0
    nc = 0
    for i in range(x.size):
        v = x[i]
        if use_abs:
            v = abs(v)
        if v >= lo:  # rare: the bracket holds about k entries of n
            if v > hi:
                gt += 1
            else:
                if nc < cap:
                    cand[nc] = v
                nc += 1
    return gt, nc


@njit(nogil=True, cache=True)
def count_above_span(x, thresholds, counts, every, tile):
    """counts[j] += #{i : |x_i| >= thresholds[j]} over a span, for descending thresholds.

    Reads every ``every``-th tile of ``tile`` entries (``every`` = 1: all of
    the span). Most entries are below the last (smallest) threshold and cost
    one compare; the rest find their bucket by a short scan. Counts are
    cumulative on return.
    """
    nt = thresholds.size
    last = thresholds[nt - 1]
    buckets = np.zeros(nt, dtype=np.int64)
    for t0 in range(0, x.size, tile * every):
        for i in range(t0, min(t0 + tile, x.size)):
            v = abs(x[i])
            if v >= last:
                j = 0
                while v < thresholds[j]:
                    j += 1
                buckets[j] += 1
    run = 0
    for j in range(nt):  # >= thresholds[j] includes every bucket <= j
        run += buckets[j]
        counts[j] += run


@njit(nogil=True, cache=True)
def bucket_span(x, edges, out, hist):
    """out[i] = #{j : not x[i] < edges[j]} (NaN: every edge), hist[out[i]] += 1.

    A fixed-trip, branch-free count per entry: with 17 edges 4x faster than a
    binary search, whose branches follow the data.
    """
    m = edges.size
    for i in range(x.size):
        v = x[i]
        b = 0
        for j in range(m):
            b += not (v < edges[j])
        out[i] = b
        hist[b] += 1
