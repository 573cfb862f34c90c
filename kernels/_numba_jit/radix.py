"""Radix select over float bit patterns: the exact k-th largest and the entries above it."""

from __future__ import annotations

import numpy as np
from numba import njit


__all__ = ["radix_kth", "keep_above"]


@njit(nogil=True, cache=True, inline="always")
def _key(b, absolute, low_mask):
    """Order-preserving signed key of a float's bit pattern ``b`` (int32/int64 view), as int64.

    Non-negative floats order as their bits; for negative ones the bits below
    the sign are flipped so that larger magnitudes come lower. ``absolute``:
    the key of |x| (the sign bit cleared).
    """
    if absolute:
        return np.int64(b & low_mask)
    return np.int64(b ^ low_mask) if b < 0 else np.int64(b)


@njit(nogil=True, cache=True)
def radix_kth(bits, k, absolute, low_mask, shift, inf_bits):
    """Radix select over float bit patterns: (key of the k-th largest, #keys above it,
    #keys <= +0, #NaN).

    ``bits``: the floats viewed as int32/int64; ``shift``: key bits below the
    top 16 (16 for float32, 48 for float64); ``inf_bits``: +inf's pattern
    (a NaN's magnitude bits lie above it). 1 <= k <= bits.size. The keys rank
    NaN beyond +-inf, unlike numpy and torch: a caller that finds NaN takes
    its reference instead.

    1. A histogram of the keys' top 16 bits (one pass); walking it from the top
       finds the digit holding rank k and how many keys lie above it.
    2. The keys with that digit are collected (a few thousand for float32 at
       the densities used; float64's top 16 bits hold only 4 mantissa bits,
       so up to ~n/16), and 16 bits at a time the same walk narrows them to
       one key: O(n), no sort, exact whatever the ties.
    """
    hist = np.zeros(1 << 16, dtype=np.int64)
    top_off = np.int64(1 << 15)  # signed top digits [-2^15, 2^15) -> [0, 2^16)
    nonpos = 0
    nans = 0
    for i in range(bits.size):
        key = _key(bits[i], absolute, low_mask)
        hist[(key >> shift) + top_off] += 1
        nonpos += key <= 0
        nans += (bits[i] & low_mask) > inf_bits
    above = 0
    d = hist.size - 1
    while above + hist[d] < k:
        above += hist[d]
        d -= 1
    digit = np.int64(d) - top_off
    cand = np.empty(hist[d], dtype=np.int64)
    c = 0
    for i in range(bits.size):
        key = _key(bits[i], absolute, low_mask)
        if (key >> shift) == digit:
            cand[c] = key
            c += 1
    rank = k - above  # 1-based, from the top, among cand
    level = shift
    while level > 0:
        width = min(16, level)
        level -= width
        mask = np.int64((1 << width) - 1)
        sub = np.zeros(1 << width, dtype=np.int64)
        for t in range(c):
            sub[(cand[t] >> level) & mask] += 1
        d = sub.size - 1
        while sub[d] < rank:
            rank -= sub[d]
            above += sub[d]
            d -= 1
        kept = 0
        for t in range(c):
            if ((cand[t] >> level) & mask) == d:
                cand[kept] = cand[t]
                kept += 1
        c = kept
    return cand[0], above, nonpos, nans


@njit(nogil=True, cache=True)
def keep_above(bits, absolute, low_mask, kth, ties, out):
    """Positions whose key exceeds ``kth``, plus the first ``ties`` equal to it, in order; their count.

    Branch-free: every position is written at the current count, and the count
    moves on only when it is kept, so ``out`` needs one spare entry.
    """
    cnt = 0
    for i in range(bits.size):
        key = _key(bits[i], absolute, low_mask)
        tie = key == kth
        take = (key > kth) | (tie & (ties > 0))
        ties -= tie & take
        out[cnt] = i
        cnt += take
    return cnt
