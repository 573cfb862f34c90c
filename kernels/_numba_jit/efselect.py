"""The error-feedback passes: fused accumulate-and-select and its tally, plain accumulate, accumulate with the finite check and block maxima."""

from __future__ import annotations

import numpy as np
from numba import njit

from ._base import BLOCK, _lowest_bit, _store_fence, _stream_zero_block

__all__ = ["ef_select_span", "ef_add_span", "ef_accumulate_span", "tally_span"]


@njit(nogil=True, cache=True, inline="always")
def _compact_bits(g, r, scale, b0, m, bad, capacity, zero, offset, out_idx, out_val, cnt):
    """Append the entries of block ``b0`` whose bits are set in ``m``; returns the new count.

    Entries whose bit is set in ``bad`` kept their old residual: their non-finite
    acc is recomputed for the output (the same operation, so the same bits).
    """
    z = r.dtype.type(0)
    while m:
        j, low = _lowest_bit(m)
        i = b0 + j
        if cnt < capacity:
            out_idx[cnt] = offset + i
            if bad & low:
                out_val[cnt] = r[i] + scale * g[i]
            else:
                out_val[cnt] = r[i]
                if zero:
                    r[i] = z
        cnt += 1
        m ^= low
    return cnt


@njit(nogil=True, cache=True, inline="always")
def _accumulate_block(g, r, scale, th, top, b0, width):
    """r[b0:b0+width] += scale * g where the sum is finite; (selection mask, non-finite mask)."""
    m = np.uint32(0)
    bad = np.uint32(0)
    for j in range(width):
        old = r[b0 + j]
        a = old + scale * g[b0 + j]
        finite = abs(a) <= top  # False for NaN and +-Inf
        r[b0 + j] = a if finite else old
        m |= np.uint32(not (abs(a) < th)) << np.uint32(j)  # NaN compares False: selected
        bad |= np.uint32(not finite) << np.uint32(j)
    return m, bad


@njit(nogil=True, cache=True)
def ef_select_span(g, r, scale, th, capacity, zero, offset, out_idx, out_val, zero_out):
    """Fused error-feedback select over one span; returns the TRUE count.

    ``th`` must be > 0 (``ef_select``'s table sends "every nonzero", th <= 0,
    to the torch reference), so |acc| >= th alone decides and excludes zeros.

    1. For each block of BLOCK entries: acc = r + scale * g is written to r
       where it is finite (a non-finite acc leaves r as it was), and bit j of
       a 32-bit mask says whether entry j is selected: |acc| >= th, or acc
       not finite. This loop has no data-dependent branch and a fixed trip
       count, so LLVM vectorises it: memory speed.
    2. Only the set bits are visited (lowest bit first, so in index order):
       those entries go to ``out_idx``/``out_val`` (index + ``offset``) while
       fewer than ``capacity`` have been written, and become 0 in r when
       ``zero`` (non-finite ones keep their old residual). Entries past the
       capacity are counted and keep acc in r.
       At density 1% a third of the blocks hold a selection; walking all 32
       entries of each of them (and mispredicting a branch per selection)
       made the pass 1.3x slower than visiting its one or two bits.
    3. ``zero_out`` (an array of r's length whose start is 32-byte aligned,
       or None): each block of it is written 0 right after step 1, with
       non-temporal stores. A sparse call's dense output is zeros but for
       O(k) entries. Its own zero pass, after this one has left r's lines
       dirty, cost 0.85 of an add; zeros stored here through the cache ~0.2
       of one (each line is read before it is written); streamed past the
       cache ~0.02.
    """
    n = r.size
    cnt = 0
    top = r.dtype.type(np.finfo(r.dtype).max)
    nb = n // BLOCK
    for b in range(nb):
        m, bad = _accumulate_block(g, r, scale, th, top, b * BLOCK, BLOCK)
        if zero_out is not None:  # pruned at compile time when None: two specialisations
            _stream_zero_block(zero_out, b * BLOCK)
        if m:
            cnt = _compact_bits(g, r, scale, b * BLOCK, m, bad, capacity, zero, offset, out_idx, out_val, cnt)
    if zero_out is not None:
        zero_out[nb * BLOCK:] = 0
        _store_fence()
    m, bad = _accumulate_block(g, r, scale, th, top, nb * BLOCK, n - nb * BLOCK)
    if m:
        cnt = _compact_bits(g, r, scale, nb * BLOCK, m, bad, capacity, zero, offset, out_idx, out_val, cnt)
    return cnt


@njit(nogil=True, cache=True)
def ef_add_span(g, r):
    """``kernels.ef_accumulate`` without maxima over one span: r += g where the sum is
    finite; returns the count of the others. (Its own function: the same loop inside
    ``ef_accumulate_span`` ran 1.5x slower, not vectorised.)"""
    top = r.dtype.type(np.finfo(r.dtype).max)
    bad = 0
    for i in range(r.size):
        old = r[i]
        a = old + g[i]
        ok = abs(a) <= top  # False for NaN and +-Inf
        r[i] = a if ok else old
        bad += not ok
    return bad


@njit(nogil=True, cache=True)
def ef_accumulate_span(g, r, bits, mask, block, maxima_bits):
    """``kernels.ef_accumulate`` over one span that starts on a block boundary; returns the
    count of non-finite sums. ``bits`` is ``r`` viewed as same-width integers, ``mask``
    clears their sign bit, ``maxima_bits`` the span's block maxima, viewed likewise.

    Per block, two loops from 0: the add (kept where finite), then the maximum of
    the written magnitudes as integers, while the block is in L1. A float max
    reduction does not vectorise without fast-math (NaN ordering), and fast-math
    would fold the finite test away; finite non-negative floats order as their bit
    patterns do. One loop doing both ran 4x slower (a store, then a load of it
    through the other view).
    """
    bad = 0
    for b in range(maxima_bits.size):
        lo = b * block
        hi = min(lo + block, r.size)
        bad += ef_add_span(g[lo:hi], r[lo:hi])
        bs = bits[lo:hi]
        m = mask & 0
        for i in range(bs.size):
            x = bs[i] & mask
            m = x if x > m else m
        maxima_bits[b] = m
    return bad


@njit(nogil=True, cache=True)
def tally_span(values, bits, mask, kept, rungs, count_bad, bucket, words):
    """``kernels.tally`` over a fused select's buffer; fills ``words[1:]``.

    1. One pass over the first ``kept`` values: the largest magnitude as an integer
       (``bits`` is ``values`` viewed as same-width integers, ``mask`` clears their sign
       bit: finite non-negative floats, then NaN, order as their bit patterns do) and,
       when ``count_bad``, the count of values that are not finite.
    2. One pass per rung j: the values not below it (NaN is below none) are counted into
       words[2 + j] and add 1 to their ``bucket`` (when that has entries). Rung by rung,
       each loop is a compare and an add over a contiguous array, which vectorises; the
       per-value walk over the rungs with a histogram it replaced (a scatter per value)
       took 1.6-2x as long (0.25-0.44 against 0.14-0.23 ms, 51k kept values, 11 rungs).
    3. The rest of ``bucket`` holds zeros' bucket; they count at the rungs they are not
       below. words[2 + len(rungs)] = the peak's bits.
    """
    fmax = values.dtype.type(np.finfo(values.dtype).max)
    nr = rungs.size
    bad = 0
    peak = mask & 0
    for i in range(kept):
        bad += not (abs(values[i]) <= fmax)
        x = bits[i] & mask
        peak = x if x > peak else peak
    mark = bucket.size > 0
    if mark:
        bucket[:kept] = 0
    for j in range(nr):
        rung = rungs[j]
        c = 0
        if mark:
            for i in range(kept):
                a = not (abs(values[i]) < rung)
                c += a
                bucket[i] += a
        else:
            for i in range(kept):
                c += not (abs(values[i]) < rung)
        words[2 + j] = c
    z = values.dtype.type(0)
    b0 = 0
    for j in range(nr):
        zero_counts = not (z < rungs[j])
        b0 += zero_counts
        if zero_counts and mark:
            words[2 + j] += bucket.size - kept
    bucket[kept:] = b0
    if count_bad:
        words[1] = bad
    words[2 + nr] = peak
