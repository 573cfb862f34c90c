"""The ``cpu`` backend (numba): fused select, threshold selection, exact k-th largest,
threshold counts, quantise-and-pack (the wire formats' records and messages: ``kernels.numba_wire_backend``).

Each function implements the operation of its name with that operation's
signature (the ``cpu`` entries of the ``KernelOp`` tables). numba is optional
(the ``cpu`` extra: ``pip install numba``); the compiled loops are in
``kernels/_numba_jit.py``, imported inside :func:`_jit`, never when
``sparsecomm.kernels`` is imported; the dispatchers only pick these paths
when numba imports (``kernels.dispatch``). Why numba rather than numpy: see
``kernels/_numba_jit.py``.

Threads: every operation cuts its tensor into spans (a few per thread) and
runs them on the calling thread plus a shared pool. The thread budget is the
calling thread's ``torch.get_num_threads()`` (torch keeps it per thread).
"""

from __future__ import annotations

import itertools
import math
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from .coo import scatter_dense_torch
from .payload import decode_buffers, decode_factor, encode_buffers
from .select import topk_of_candidates_torch

__all__ = ["ef_select", "ef_accumulate", "select_above", "kth_largest", "count_above", "encode_codes", "decode_codes",
           "union_sorted_runs", "isin_sorted", "take_and_zero", "scatter_dense", "nonzero", "sum_sorted_runs",
           "topk_of_candidates", "scatter_add", "bucketize", "tally"]

_SMALL = 1 << 16  # below this, one span on the caller's thread
#: From ``_SMALL`` to this many entries ``kth_largest`` is one thread's radix select (two
#: passes and a small tail), not a sampled bracket spread over threads: at 475k entries 0.75 ms
#: against 1.0 ms (k = n/100) to 4 ms (k = n/2, where the bracket is widest).
_RADIX_MAX = 1 << 20
#: Entries of a 16-bit gradient widened at a time by ``ef_accumulate`` (4 MB of float32).
_WIDEN_PIECE = 1 << 20
_POOLS: dict[int, ThreadPoolExecutor] = {}  # by worker count; never shut down while in use
_POOL_LOCK = threading.Lock()


def _forget_pools() -> None:
    # A forked child inherits the executors but not their threads: start afresh.
    _POOLS.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pools)


def _jit():
    try:
        from . import _numba_jit  # start-up cost: compiles on first use, and needs numba
    except ImportError as e:  # numba missing: say how to get it
        raise ImportError("the fast CPU kernels need numba: pip install numba "
                          "(or pip install 'sparsecomm[cpu]')") from e
    return _numba_jit


def _threads() -> int:
    return max(1, torch.get_num_threads())


def _spans(n: int) -> int:
    """Spans to cut n entries into: a few per thread, so that the threads balance.

    Right after a torch op, torch's OpenMP workers keep spinning for several
    milliseconds and take part of a core; with a few spans per thread the
    thread on the free core simply takes more of them (measured: 22 ms with one
    span per thread against 16 ms at 25M on 2 cores).
    """
    threads = _threads()
    if n < _SMALL or threads == 1:
        return 1
    return max(1, min(4 * threads, n // _SMALL))


def _pool(workers: int) -> ThreadPoolExecutor:
    """The process-wide pool of ``workers`` threads (one per size ever asked for).

    Pools are never resized or shut down: rank threads of one process may
    have different budgets, and a pool another thread is submitting to must
    stay alive.
    """
    with _POOL_LOCK:
        pool = _POOLS.get(workers)
        if pool is None:
            pool = _POOLS[workers] = ThreadPoolExecutor(workers, thread_name_prefix="sparsecomm-cpu")
        return pool


def _map(fn, spans: list) -> list:
    """``[fn(*args) for args in spans]``; the caller and up to threads-1 helpers take spans in turn.

    The kernels release the GIL, so the spans run in parallel. Every helper
    submitted is waited for (or cancelled before it starts) before this
    returns or raises, so no span runs after the caller has moved on.
    """
    helpers_wanted = min(_threads(), len(spans)) - 1
    if helpers_wanted <= 0:
        return [fn(*args) for args in spans]
    out: list = [None] * len(spans)
    ticket = itertools.count()  # next() on it is atomic under the GIL

    def work() -> None:
        while (c := next(ticket)) < len(spans):
            out[c] = fn(*spans[c])

    pool = _pool(helpers_wanted)
    helpers = []
    try:
        for _ in range(helpers_wanted):
            helpers.append(pool.submit(work))
        work()
    finally:
        errors = []
        for h in helpers:
            # A helper still queued (behind other ranks' work) has nothing left to do.
            if not h.cancel():
                try:
                    h.result()
                except BaseException as e:  # noqa: BLE001 - re-raised below
                    errors.append(e)
    if errors:
        raise errors[0]
    return out


def ef_select(grad: torch.Tensor, residual: torch.Tensor, threshold: float, capacity: int,
              scale: float, zero_selected: bool, out_idx: torch.Tensor,
              out_val: torch.Tensor, zero_out: torch.Tensor | None = None,
              device_counts: bool = False) -> "int | tuple[torch.Tensor, None]":
    """numba fused error-feedback select; same contract as ``kernels.ef_select``.

    Only for a threshold that is positive in the residual's dtype:
    ``ef_select``'s table sends the others to the torch reference.

    1. Cut the vector into a few spans per thread; each span does
       acc = r + scale*g, writes r, and compacts its selections in one pass
       (span 0 straight into the output, span c > 0 into its own scratch of
       ``capacity`` entries).
    2. Concatenate the spans' selections in order (they come out sorted).
       Entries that land past ``capacity`` are dropped from the output and
       their residual is restored to acc, so nothing is lost on overflow.
    """
    sc, th = _rd_scalar(scale, residual.dtype), _rd_scalar(threshold, residual.dtype)
    if not th > 0:  # the loop selects by |acc| >= th, which would take zeros
        raise ValueError(f"numba ef_select needs a threshold > 0 in {residual.dtype}, got {threshold}")
    impl = _jit()
    rd = residual.dtype
    if grad.dtype != rd:  # numba has no bf16 and slow fp16: widen (rare on CPU)
        grad = grad.to(rd)
    n = residual.numel()
    g, r = grad.numpy(), residual.numpy()
    oi, ov = out_idx.numpy(), out_val.numpy()
    bounds = impl.chunk_bounds(n, _spans(n), align=64)
    zo = None
    if zero_out is not None:
        # Zeroed in the pass by 32-byte-aligned vector stores, from every span's start (and
        # every 32-entry block's within it); numba has no bf16, and an odd start (out= a
        # view at an offset) is rare.
        size = zero_out.element_size()
        if zero_out.dtype in (torch.float32, torch.float64) and all(
                (zero_out.data_ptr() + int(lo) * size) % 32 == 0 for lo in bounds[:-1]):
            zo = zero_out.view(-1).numpy()
        else:
            zero_out.zero_()
    nch = bounds.size - 1
    # Span c > 0 compacts into its own scratch of min(capacity, span length)
    # entries (np.empty: pages are only touched where something is written).
    room = [min(capacity, int(bounds[c + 1] - bounds[c])) for c in range(nch)]
    start = np.concatenate([[0, 0], np.cumsum(room[1:])]).astype(np.int64)
    si = np.empty(int(start[-1]), dtype=np.int64)
    sv = np.empty(int(start[-1]), dtype=r.dtype)
    spans = []
    for c in range(nch):
        lo, hi = int(bounds[c]), int(bounds[c + 1])
        dst_i = oi if c == 0 else si[start[c]:start[c] + room[c]]
        dst_v = ov if c == 0 else sv[start[c]:start[c] + room[c]]
        spans.append((g[lo:hi], r[lo:hi], sc, th, room[c] if c else capacity, zero_selected, lo,
                      dst_i, dst_v, None if zo is None else zo[lo:hi]))
    counts = _map(impl.ef_select_span, spans)
    off = counts[0]
    for c in range(1, nch):
        w = min(counts[c], room[c])  # == counts[c] unless past the capacity anyway
        src_i = si[start[c]:start[c] + w]
        src_v = sv[start[c]:start[c] + w]
        fit = max(0, min(w, capacity - off))
        oi[off:off + fit] = src_i[:fit]
        ov[off:off + fit] = src_v[:fit]
        if zero_selected and fit < w:
            r[src_i[fit:]] = src_v[fit:]
        off += counts[c]
    if not device_counts:
        return int(off)
    return torch.tensor(int(off)), None  # kernels.tally counts the non-finite sums in its own pass


def select_above(x: torch.Tensor, threshold: float, use_abs: bool = False) -> torch.Tensor:
    """Sorted int64 indexes of ``x >= threshold`` (of ``|x|`` with ``use_abs``).

    A threshold <= 0 selects ``x > 0`` (``|x| > 0`` with ``use_abs``): the
    nonzero magnitudes.

    1. Cut ``x`` into spans; each span compacts its hits into its own
       buffer (np.empty of the span's length: only written pages are touched).
    2. Concatenate in span order: the result is sorted.

    Replaces ``torch.nonzero(x.abs() >= th)``: three passes, a full-size
    ``abs`` (45 ms of fresh pages at 25M) and a full-size mask.
    """
    if x.dtype not in (torch.float32, torch.float64):
        x = x.float()
    arr = x.detach().reshape(-1).numpy()
    n = arr.size
    th = arr.dtype.type(threshold)
    if not th > 0:  # every nonzero entry (rare): the exact != 0 test, whatever the denormal mode
        m = x.abs() > 0 if use_abs else x > 0
        return torch.nonzero(m).flatten()
    impl = _jit()
    bounds = impl.chunk_bounds(n, _spans(n))
    nch = bounds.size - 1
    bufs = [np.empty(int(bounds[c + 1] - bounds[c]), dtype=np.int64) for c in range(nch)]
    counts = _map(impl.select_span, [(arr[bounds[c]:bounds[c + 1]], th, int(bounds[c]), bufs[c],
                                      bool(use_abs)) for c in range(nch)])
    out = np.empty(sum(counts), dtype=np.int64)
    off = 0
    for c in range(nch):
        out[off:off + counts[c]] = bufs[c][:counts[c]]
        off += counts[c]
    return torch.from_numpy(out)


def _rd_scalar(value: float, dtype: torch.dtype):
    """``value`` as a numpy scalar of ``dtype`` (so numba does float32 math for float32)."""
    return np.float32(value) if dtype == torch.float32 else np.float64(value)


def ef_accumulate(grad: torch.Tensor, residual: torch.Tensor, block: int, maxima: torch.Tensor) -> int:
    """numba ``kernels.ef_accumulate``: spans of whole blocks over threads (``block`` 0: no maxima)."""
    impl = _jit()
    n = residual.numel()
    if grad.dtype != residual.dtype:
        # numba has no bf16 and slow fp16: widen a piece at a time (whole blocks), so that a
        # 16-bit gradient costs a few MB of temporary, not an n-sized one per call.
        piece = max(block, 1) * -(-_WIDEN_PIECE // max(block, 1))
        return sum(ef_accumulate(grad[lo:lo + piece].to(residual.dtype), residual[lo:lo + piece], block,
                                 maxima[lo // block:-(-min(lo + piece, n) // block)] if block else maxima)
                   for lo in range(0, n, piece))
    g, r, mx = grad.numpy(), residual.numpy(), maxima.numpy()
    ints, mask = (np.int32, np.int32(0x7FFFFFFF)) if r.dtype == np.float32 else (np.int64, np.int64(2**63 - 1))
    bits = r.view(ints)
    bounds = impl.chunk_bounds(n, _spans(n), align=block or 64)
    spans = [(lo, hi) for lo, hi in zip(bounds[:-1].tolist(), bounds[1:].tolist()) if hi > lo]
    if not block:
        return sum(_map(impl.ef_add_span, [(g[lo:hi], r[lo:hi]) for lo, hi in spans]))
    mb = mx.view(ints)
    return sum(_map(impl.ef_accumulate_span, [(g[lo:hi], r[lo:hi], bits[lo:hi], mask, block,
                                               mb[lo // block:-(-hi // block)]) for lo, hi in spans]))


def kth_largest(x: torch.Tensor, k: int, use_abs: bool = False) -> float:
    """Exact k-th largest of ``x`` (of ``|x|`` when ``use_abs``) on CPU.

    Below ``_SMALL`` entries: numpy's introselect. Up to ``_RADIX_MAX``: a radix select over the bit patterns
    (``_numba_jit.radix_kth``), on the calling thread. Beyond:

    1. Strided sample of about 64k elements; its order statistics around
       rank k*m/n (plus/minus 6 standard deviations of a binomial rank) give a
       bracket [lo, hi] that holds the k-th largest with near certainty.
    2. One pass (spans over threads): count entries > hi, collect entries in [lo, hi]
       (about 1% of n or less).
    3. If n_gt < k <= n_gt + n_cand the answer is the (k - n_gt)-th largest
       candidate (numpy introselect on the small set). Otherwise (a sample
       that misled, e.g. periodic data, or massive ties) fall back to numpy's
       introselect on the whole vector: always exact, only slower.
    """
    n = x.numel()
    if x.dtype not in (torch.float32, torch.float64):
        x = x.float()  # fp16/bf16 widen exactly
    arr = x.detach().reshape(-1).numpy()
    if n < _SMALL:
        return _partition_kth(arr, k, use_abs)
    impl = _jit()
    if n < _RADIX_MAX:
        bits, low, shift, inf = _radix_view(arr)
        key, _, _, nans = impl.radix_kth(bits, k, bool(use_abs), low, shift, inf)
        # NaN: numpy's order (every NaN largest), which the keys do not follow.
        return _radix_float(key, arr.dtype) if not nans else _partition_kth(arr, k, use_abs)
    stride = max(1, n // 65536)
    sample = arr[::stride]
    if use_abs:
        sample = np.abs(sample)
    m = sample.size
    q = k * m / n
    sd = math.sqrt(max(q * (1 - k / n), 1.0))
    r_hi = int(math.floor(q - 6 * sd - 2))  # descending ranks, 1-based
    r_lo = int(math.ceil(q + 6 * sd + 2))
    ranks = [m - r for r in (r_hi, r_lo) if 1 <= r <= m]
    part = np.partition(sample, ranks) if ranks else sample
    hi = float(part[m - r_hi]) if 1 <= r_hi <= m else math.inf
    lo = float(part[m - r_lo]) if 1 <= r_lo <= m else -math.inf
    bounds = impl.chunk_bounds(n, _spans(n))
    nch = bounds.size - 1
    expect = (r_lo - max(r_hi, 0)) * stride
    # Every span may hold every candidate (drifting data puts them all at one
    # end); np.empty only touches the pages that get written.
    cap = min(2 * expect + 4096, int(bounds[1] - bounds[0]))
    cand = np.empty(cap * nch, dtype=arr.dtype)
    lo_t, hi_t = arr.dtype.type(lo), arr.dtype.type(hi)
    found = _map(impl.bracket_span, [(arr[bounds[c]:bounds[c + 1]], use_abs, lo_t, hi_t,
                                      cand[c * cap:(c + 1) * cap], cap) for c in range(nch)])
    gt, nc = sum(f[0] for f in found), sum(f[1] for f in found)
    if max(f[1] for f in found) > cap or not gt < k <= gt + nc:
        return _partition_kth(arr, k, use_abs)
    pieces = np.concatenate([cand[c * cap:c * cap + found[c][1]] for c in range(nch)])
    r = k - gt
    return float(np.partition(pieces, nc - r)[nc - r])


def _radix_view(arr: np.ndarray) -> tuple[np.ndarray, Any, int, Any]:
    """float32/float64 ``arr`` as (same-width signed ints, the mask below the sign, key bits
    under the top 16, +inf's bits)."""
    if arr.dtype == np.float32:
        return arr.view(np.int32), np.int32(0x7FFFFFFF), 16, np.int32(0x7F800000)
    return arr.view(np.int64), np.int64(0x7FFFFFFFFFFFFFFF), 48, np.int64(0x7FF0000000000000)


def _radix_float(key: int, dtype: np.dtype) -> float:
    """The float whose order-preserving key (``_numba_jit._key``) is ``key``."""
    ints = np.array([key], dtype=np.int64)
    if ints[0] < 0:
        ints ^= 0x7FFFFFFFFFFFFFFF if dtype == np.float64 else 0x7FFFFFFF
    if dtype == np.float32:
        return float(ints.astype(np.int32).view(np.float32)[0])
    return float(ints.view(np.float64)[0])


def topk_of_candidates(idx: torch.Tensor, mag: torch.Tensor, k: int, positive: bool = False) -> torch.Tensor:
    """numba ``kernels.topk_of_candidates``: a radix select of the k-th largest, then one
    branch-free pass keeping what lies above it and the first ties (3 passes over the candidates;
    ``positive`` changes nothing: the host holds the count)."""
    impl = _jit()
    if mag.dtype not in (torch.float32, torch.float64):
        mag = mag.float()  # fp16/bf16 widen exactly
    arr = mag.detach().reshape(-1).contiguous().numpy()
    bits, low, shift, inf = _radix_view(arr)
    m = arr.size
    kth, ties = 0, 0  # keep every nonzero candidate
    if m > k:
        key, above, zeros, nans = impl.radix_kth(bits, k, True, low, shift, inf)
        if nans:  # never kept by the reference (NaN > th is False): its rules, not the keys'
            return topk_of_candidates_torch(idx, mag, k)
        if m - zeros > k:
            kth, ties = key, k - above
    elif np.isnan(arr).any():
        return topk_of_candidates_torch(idx, mag, k)
    out = np.empty(min(m, k) + 1, dtype=np.int64)
    cnt = impl.keep_above(bits, True, low, np.int64(kth), np.int64(ties), out)
    return torch.from_numpy(out[:cnt])


def scatter_add(out: torch.Tensor, idx: torch.Tensor, values: torch.Tensor) -> None:
    """numba ``kernels.scatter_add``: one loop in input order (``index_add_``'s bits; 250k indexes
    into 25M: 3.8 ms against 5.6 with cold caches). Bounds are checked first, as torch does."""
    i = idx.to(torch.int64).contiguous().numpy()
    if i.size and (int(i.min()) < 0 or int(i.max()) >= out.numel()):
        raise IndexError(f"scatter_add: an index lies outside [0, {out.numel()})")
    _jit().add_at(out.detach().numpy(), i, values.detach().contiguous().numpy())


def _partition_kth(arr: np.ndarray, k: int, use_abs: bool) -> float:
    a = np.abs(arr) if use_abs else arr
    n = a.size
    return float(np.partition(a, n - k)[n - k])


def count_above(x: torch.Tensor, thresholds: np.ndarray, every: int = 1) -> np.ndarray:
    """#{i : |x_i| >= t} for each of the descending ``thresholds``, in one pass (spans over threads).

    With ``every`` > 1 only every ``every``-th tile of 4096 entries is read and
    the counts are scaled up by (entries / entries read): a block sample.
    """
    impl = _jit()
    if x.dtype not in (torch.float32, torch.float64):
        x = x.float()
    arr = x.detach().reshape(-1).numpy()
    th = np.ascontiguousarray(thresholds, dtype=arr.dtype)
    tile = 4096
    # Spans start on tile boundaries so that the block sample stays regular.
    bounds = impl.chunk_bounds(arr.size, _spans(arr.size), align=tile * every)
    nch = bounds.size - 1
    counts = np.zeros((nch, th.size), dtype=np.int64)
    _map(impl.count_above_span, [(arr[bounds[c]:bounds[c + 1]], th, counts[c], every, tile)
                                 for c in range(nch)])
    total = counts.sum(axis=0)
    if every > 1:
        from .estimate import entries_read  # (estimate chooses this module by name: no cycle at import)

        total = np.rint(total * (arr.size / entries_read(arr.size, every, tile))).astype(np.int64)
    return total


def tally(values: torch.Tensor, count: torch.Tensor, capacity: int, rungs: torch.Tensor | None,
          nonfinite: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """numba ``kernels.tally``: one pass over the kept values on the calling thread (O(k)).

    Its buffers are made in numpy: the torch calls this replaced (``torch.zeros`` and item
    writes, views) took 0.13 ms a call, as long as the pass itself at 4M, 1%.
    """
    n = int(count)
    words = np.zeros(3 + (0 if rungs is None else rungs.numel()), dtype=np.int64)
    words[0] = n
    if nonfinite is not None:
        words[1] = int(nonfinite)
    bucket = None if rungs is None else np.empty(capacity, dtype=np.int64)
    v = values.numpy()[:capacity]
    ints, mask = _SIGN_MASKS[v.dtype.type]
    edges = _NO_EDGES[v.dtype.type] if rungs is None else rungs.numpy()
    _jit().tally_span(v, v.view(ints), mask, min(n, capacity), edges, nonfinite is None,
                      _NO_BUCKET if bucket is None else bucket, words)
    if rungs is None:
        words[2] = 0
    return torch.from_numpy(words), None if bucket is None else torch.from_numpy(bucket)


#: Per float type: its same-width integer type and the mask that clears the sign bit.
_SIGN_MASKS = {np.float32: (np.int32, np.int32(0x7FFFFFFF)), np.float64: (np.int64, np.int64(0x7FFFFFFFFFFFFFFF))}
_NO_EDGES = {np.float32: np.empty(0, np.float32), np.float64: np.empty(0, np.float64)}
_NO_BUCKET = np.empty(0, np.int64)


def bucketize(x: torch.Tensor, edges: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """numba ``kernels.bucketize``: one pass on the calling thread (its inputs are O(k))."""
    out = torch.empty(x.numel(), dtype=torch.int64)
    hist = torch.zeros(edges.numel() + 1, dtype=torch.int64)
    _jit().bucket_span(x.contiguous().numpy(), edges.contiguous().numpy(), out.numpy(), hist.numpy())
    return out, hist


def encode_codes(values: torch.Tensor, bits: int, scale: float, keep_error: bool = False) -> torch.Tensor:
    """numba ``kernels.payload.encode_codes`` of flat ``values``, by spans of output bytes."""
    impl = _jit()
    values, f, out = encode_buffers(values, bits, scale)
    g = decode_factor(bits, scale)
    v, o = values.numpy(), out.numpy()
    bounds = impl.chunk_bounds(o.size, _spans(values.numel()))
    _map(impl.encode_codes_span, [(v, f, g, bits, o, int(bounds[c]), int(bounds[c + 1]), keep_error)
                                  for c in range(bounds.size - 1)])
    return out


def decode_codes(packed: torch.Tensor, bits: int, count: int, scale: float, dtype: torch.dtype,
                 out: torch.Tensor | None = None, accumulate: bool = False) -> torch.Tensor:
    """numba ``kernels.payload.decode_codes`` to float32 (``dtype``), by spans of bytes."""
    impl = _jit()
    g, out = decode_buffers(packed, bits, count, scale, out)
    p, o = packed.numpy(), out.numpy()
    nbytes = -(-o.size * bits // 8)
    bounds = impl.chunk_bounds(nbytes, _spans(o.size))
    _map(impl.decode_codes_span, [(p, bits, g, o, int(bounds[c]), int(bounds[c + 1]), accumulate)
                                  for c in range(bounds.size - 1)])
    return out


# ---- O(k) index work: merge walks instead of sorts and random passes over n -------------
def union_sorted_runs(cat: torch.Tensor, runs: list[int]) -> torch.Tensor:
    """numba ``kernels.union_sorted_runs``: merge the runs pairwise, log2(runs) linear passes."""
    impl = _jit()
    src = cat.to(torch.int64).contiguous().numpy()
    bounds = np.asarray(runs, dtype=np.int64)
    if bounds.size <= 2:  # one run: already ascending and unique (a copy, as torch.unique gives)
        return torch.from_numpy(src[:int(bounds[-1]) if bounds.size else 0].copy())
    bufs = (np.empty_like(src), np.empty_like(src))  # never write into the caller's tensor
    level = 0
    while bounds.size > 2:
        dst = bufs[level % 2]
        bounds = impl.merge_runs(src, bounds, dst)
        src, level = dst, level + 1
    return torch.from_numpy(src[:int(bounds[-1])])


def isin_sorted(values: torch.Tensor, sorted_set: torch.Tensor, mark: torch.Tensor | None) -> torch.Tensor:
    """numba ``kernels.isin_sorted``: a merge walk (``mark`` is not needed)."""
    v = values.to(torch.int64).contiguous()
    out = torch.empty(v.shape, dtype=torch.bool)
    _jit().member_mask(v.numpy().reshape(-1), sorted_set.to(torch.int64).contiguous().numpy(),
                       out.numpy().reshape(-1))
    return out


def take_and_zero(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """numba ``kernels.take_and_zero``: one loop reads and clears each entry."""
    out = torch.empty(idx.numel(), dtype=x.dtype)
    _jit().take_and_zero(x.numpy(), idx.to(torch.int64).contiguous().numpy(), out.numpy())
    return out


def scatter_dense(out: torch.Tensor, idx: torch.Tensor, values: torch.Tensor, zeroed: bool = False) -> torch.Tensor:
    """numba ``kernels.scatter_dense``: each span of ``out`` written once, zeros and values
    together (only the values when ``zeroed``: one loop).

    Indexes that do not ascend strictly take the torch reference.
    """
    impl = _jit()
    i = idx.to(torch.int64).contiguous().numpy()
    o = out.numpy()
    if not impl.is_strictly_increasing(i, o.size):
        return scatter_dense_torch(out, idx, values, zeroed)
    v = values.contiguous().numpy()
    if zeroed:
        impl.put_at(o, i, v)
        return out
    bounds = impl.chunk_bounds(o.size, _spans(o.size))
    cuts = np.searchsorted(i, bounds)
    _map(impl.densify_span, [(o, int(bounds[c]), int(bounds[c + 1]), i, v, int(cuts[c]), int(cuts[c + 1]))
                             for c in range(bounds.size - 1)])
    return out


def nonzero(mask: torch.Tensor, count: int | None = None) -> torch.Tensor:
    """cpu ``kernels.nonzero``: numpy's ``flatnonzero`` (no numba needed)."""
    pos = torch.from_numpy(np.flatnonzero(mask.numpy()))
    if count is not None and pos.numel() != count:
        raise ValueError(f"nonzero: the mask holds {pos.numel()} True entries, not {count}")
    return pos


def sum_sorted_runs(idx: torch.Tensor, values: torch.Tensor, runs: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """cpu ``kernels.sum_sorted_runs``: runs merged into the running union one after another
    (a left fold, so each index sums in run order), linear merges instead of scatters."""
    impl = _jit()
    i = idx.to(torch.int64).contiguous().numpy()
    v = values.contiguous().numpy()
    v = v + v.dtype.type(0)  # 0 + v, as into zeros: -0 -> +0
    cur_i, cur_v = i[:0], v[:0]
    for a, b in zip(runs[:-1], runs[1:]):
        oi = np.empty(cur_i.size + (b - a), dtype=np.int64)
        ov = np.empty(oi.size, dtype=v.dtype)
        c = impl.merge_sum(cur_i, cur_v, i[a:b], v[a:b], oi, ov)
        cur_i, cur_v = oi[:c], ov[:c]
    return torch.from_numpy(cur_i), torch.from_numpy(cur_v)
