"""numba-compiled CPU loops behind ``kernels.cpu`` (imports numba at import time).

Only ``kernels.cpu`` imports this module, inside its functions, so that
``sparsecomm.kernels`` itself never needs numba.

Why numba: the CPU fast paths are single passes over memory with a rare,
data-dependent branch (select, collect a candidate, bump a count). torch and
numpy can only express these as chains of full-size temporaries (abs, compare,
nonzero, gather), each its own pass; a compiled loop reads each element once
and runs on both cores with ``prange``. numba is a pure pip install (llvmlite
wheels), needs no compiler on the machine, and caches the compiled code on
disk (``cache=True``) so only the first process pays the compile.
"""

from __future__ import annotations

import numpy as np
from .dispatch import import_numba

import_numba()  # thread pool sized to torch's budget, before numba starts it

from numba import njit, prange  # noqa: E402

__all__ = ["ef_select_chunks", "bracket_pass", "count_above"]


@njit(parallel=True, cache=True, nogil=True)
def ef_select_chunks(g, r, scale, th, capacity, zero, out_idx, out_val,
                     scratch_idx, scratch_val, bounds, counts):
    """Fused error-feedback select, one chunk per thread, then a merge.

    1. Chunk c (in parallel) walks its elements once: acc = r + scale * g,
       selected when acc != 0 and |acc| >= th. Chunk 0 writes its selections
       straight into the output, chunk c > 0 into its own scratch slice of
       ``capacity`` entries; selected-and-written entries become 0 in ``r``
       when ``zero`` (the others get acc). ``counts[c]`` is the true count.
    2. Merge (serial, O(capacity)): chunk c's entries go to output offset
       sum(counts[:c]); entries that land past ``capacity`` are dropped and
       their residual is restored to acc, so nothing is lost on overflow.
    """
    nch = bounds.size - 1
    for c in prange(nch):
        lo = bounds[c]
        hi = bounds[c + 1]
        cnt = 0
        base = (c - 1) * capacity
        for i in range(lo, hi):
            a = r[i] + scale * g[i]
            # Selection is rare (about the density), so this branch predicts well.
            if a != 0 and abs(a) >= th:
                if cnt < capacity:
                    if c == 0:
                        out_idx[cnt] = i
                        out_val[cnt] = a
                    else:
                        scratch_idx[base + cnt] = i
                        scratch_val[base + cnt] = a
                    if zero:
                        r[i] = 0
                    else:
                        r[i] = a
                else:
                    r[i] = a
                cnt += 1
            else:
                r[i] = a
        counts[c] = cnt
    off = counts[0]
    for c in range(1, nch):
        base = (c - 1) * capacity
        written = min(counts[c], capacity)
        for p in range(written):
            if off + p < capacity:
                out_idx[off + p] = scratch_idx[base + p]
                out_val[off + p] = scratch_val[base + p]
            elif zero:
                r[scratch_idx[base + p]] = scratch_val[base + p]
        off += counts[c]
    return off


@njit(parallel=True, cache=True, nogil=True)
def bracket_pass(x, use_abs, lo, hi, bounds, cand, cap, n_gt, n_cand):
    """One pass: per chunk, count x > hi and collect x in [lo, hi].

    Chunk c writes its candidates into ``cand[c*cap:(c+1)*cap]`` and its
    counts into ``n_gt[c]``, ``n_cand[c]`` (true counts, even past ``cap``).
    ``use_abs`` compares |x| instead of x.
    """
    nch = bounds.size - 1
    for c in prange(nch):
        gt = 0
        nc = 0
        base = c * cap
        for i in range(bounds[c], bounds[c + 1]):
            v = x[i]
            if use_abs:
                v = abs(v)
            if v >= lo:
                if v > hi:
                    gt += 1
                else:
                    if nc < cap:
                        cand[base + nc] = v
                    nc += 1
        n_gt[c] = gt
        n_cand[c] = nc


@njit(parallel=True, cache=True, nogil=True)
def count_above(x, thresholds, bounds, counts, every, tile):
    """counts[c, j] = #{i counted in chunk c : |x_i| >= thresholds[j]} for descending thresholds.

    One pass over every ``every``-th tile of ``tile`` entries (``every`` = 1:
    all of x). Most entries are below the last (smallest) threshold and cost
    one compare; the rest find their bucket by a short scan.
    """
    nch = bounds.size - 1
    nt = thresholds.size
    last = thresholds[nt - 1]
    for c in prange(nch):
        for t0 in range(bounds[c], bounds[c + 1], tile * every):
            for i in range(t0, min(t0 + tile, bounds[c + 1])):
                v = abs(x[i])
                if v >= last:
                    j = 0
                    while v < thresholds[j]:
                        j += 1
                    counts[c, j] += 1
    # Buckets to cumulative counts: >= thresholds[j] includes every bucket <= j.
    for c in range(nch):
        for j in range(1, nt):
            counts[c, j] += counts[c, j - 1]


def chunk_bounds(n: int, chunks: int, align: int = 64) -> np.ndarray:
    """``chunks + 1`` boundaries cutting ``[0, n)`` into near-equal aligned chunks."""
    step = -(-n // chunks)
    step = -(-step // align) * align
    return np.minimum(np.arange(chunks + 1, dtype=np.int64) * step, n)
