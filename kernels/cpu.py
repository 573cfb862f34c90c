"""Fast CPU paths (numba) for the fused select, the exact k-th largest and threshold counts.

numba is optional (the ``cpu`` extra: ``pip install numba``). It is imported
inside :func:`_impl`, never when ``sparsecomm.kernels`` is imported; the
dispatchers only pick these paths when numba imports (``kernels.dispatch``).
Why numba rather than numpy: see ``kernels/_numba_impl.py``.
"""

from __future__ import annotations

import math
import threading

import numpy as np
import torch

__all__ = ["ef_select_cpu", "kth_largest_cpu", "count_above_cpu"]

_SMALL = 1 << 16  # below this, numpy's introselect beats sampling + a pass
# numba's default (workqueue) threading layer aborts the process when two
# Python threads enter parallel code at once, as the simulated world's rank
# threads could: serialise the calls.
_LOCK = threading.Lock()


def _impl():
    try:
        from . import _numba_impl
    except ImportError as e:  # numba missing: say how to get it
        raise ImportError("the fast CPU kernels need numba: pip install numba "
                          "(or pip install 'sparsecomm[cpu]')") from e
    return _numba_impl


def _chunks() -> int:
    import numba

    return max(1, numba.get_num_threads())


def ef_select_cpu(grad: torch.Tensor, residual: torch.Tensor, threshold: float, capacity: int,
                  scale: float, zero_selected: bool, out_idx: torch.Tensor,
                  out_val: torch.Tensor) -> int:
    """numba fused error-feedback select; same contract as ``kernels.ef_select``.

    1. Cut the vector into one chunk per thread; each thread does
       acc = r + scale*g, writes r, and compacts its selections (one pass).
    2. Concatenate the chunks' selections in order (they come out sorted).
    """
    impl = _impl()
    rd = residual.dtype
    if grad.dtype != rd:  # numba has no bf16 and slow fp16: widen (rare on CPU)
        grad = grad.to(rd)
    n = residual.numel()
    nch = _chunks() if n >= _SMALL else 1
    bounds = impl.chunk_bounds(n, nch)
    nch = bounds.size - 1
    scratch_idx = np.empty(max(0, nch - 1) * capacity, dtype=np.int64)
    scratch_val = np.empty(max(0, nch - 1) * capacity, dtype=residual.numpy().dtype)
    counts = np.zeros(nch, dtype=np.int64)
    with _LOCK:
        total = impl.ef_select_chunks(grad.numpy(), residual.numpy(), _rd_scalar(scale, rd),
                                      _rd_scalar(threshold, rd), capacity, zero_selected,
                                      out_idx.numpy(), out_val.numpy(), scratch_idx, scratch_val,
                                      bounds, counts)
    return int(total)


def _rd_scalar(value: float, dtype: torch.dtype):
    """``value`` as a numpy scalar of ``dtype`` (so numba does float32 math for float32)."""
    return np.float32(value) if dtype == torch.float32 else np.float64(value)


def kth_largest_cpu(x: torch.Tensor, k: int, use_abs: bool = False) -> float:
    """Exact k-th largest of ``x`` (of ``|x|`` when ``use_abs``) on CPU.

    1. Strided sample of about 64k elements; its order statistics around
       rank k*m/n (plus/minus 6 standard deviations of a binomial rank) give a
       bracket [lo, hi] that holds the k-th largest with near certainty.
    2. One parallel pass: count entries > hi, collect entries in [lo, hi]
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
    impl = _impl()
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
    nch = _chunks()
    bounds = impl.chunk_bounds(n, nch)
    nch = bounds.size - 1
    expect = (r_lo - max(r_hi, 0)) * stride
    cap = int(2 * expect / nch) + 4096
    cand = np.empty(cap * nch, dtype=arr.dtype)
    n_gt = np.zeros(nch, dtype=np.int64)
    n_cand = np.zeros(nch, dtype=np.int64)
    with _LOCK:
        impl.bracket_pass(arr, use_abs, arr.dtype.type(lo), arr.dtype.type(hi), bounds, cand, cap,
                          n_gt, n_cand)
    gt, nc = int(n_gt.sum()), int(n_cand.sum())
    if n_cand.max() > cap or not gt < k <= gt + nc:
        return _partition_kth(arr, k, use_abs)
    pieces = np.concatenate([cand[c * cap:c * cap + n_cand[c]] for c in range(nch)])
    r = k - gt
    return float(np.partition(pieces, nc - r)[nc - r])


def _partition_kth(arr: np.ndarray, k: int, use_abs: bool) -> float:
    a = np.abs(arr) if use_abs else arr
    n = a.size
    return float(np.partition(a, n - k)[n - k])


def count_above_cpu(x: torch.Tensor, thresholds: np.ndarray, every: int = 1) -> np.ndarray:
    """#{i : |x_i| >= t} for each of the descending ``thresholds``, in one parallel pass.

    With ``every`` > 1 only every ``every``-th tile of 4096 entries is read and
    the counts are scaled up by (entries / entries read): a block sample.
    """
    impl = _impl()
    if x.dtype not in (torch.float32, torch.float64):
        x = x.float()
    arr = x.detach().reshape(-1).numpy()
    th = np.ascontiguousarray(thresholds, dtype=arr.dtype)
    nch = _chunks() if arr.size >= _SMALL else 1
    bounds = impl.chunk_bounds(arr.size, nch)
    tile = 4096
    # Chunks must start on tile boundaries for the block sample to be regular.
    bounds = impl.chunk_bounds(arr.size, bounds.size - 1, align=tile * every)
    counts = np.zeros((bounds.size - 1, th.size), dtype=np.int64)
    with _LOCK:
        impl.count_above(arr, th, bounds, counts, every, tile)
    total = counts.sum(axis=0)
    if every > 1:
        seen = sum(min(tile, arr.size - t0) for t0 in range(0, arr.size, tile * every))
        total = np.rint(total * (arr.size / seen)).astype(np.int64)
    return total
