"""Estimated top-k threshold: a sample, then one counting pass to correct it.

Exact thresholds cost a selection over all n entries; Ok-Topk re-evaluates
them only every tau calls and reuses them in between, so a cheap threshold
whose count is within a few percent of k is often all a caller needs.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from . import dispatch

__all__ = ["estimate_threshold", "candidate_thresholds", "entries_read", "count_above", "count_above_torch", "count_on_device",
           "count_on_device_torch", "bucketize", "bucketize_torch", "GRID", "COUNT_TILE"]

# Candidate count targets, as fractions of k. Spaced ~7% apart near 1 so the
# interpolation between neighbours lands within a few percent of k, wide
# enough (0.5..2) to hold k even when the sample is off by several standard
# deviations (a 64k sample at density 0.01 has ~6% relative rank noise).
GRID = (0.5, 0.6, 0.7, 0.8, 0.87, 0.93, 1.0, 1.07, 1.15, 1.25, 1.4, 1.6, 2.0)
#: A sampled count reads whole tiles of this many entries, one tile in ``every``.
COUNT_TILE = 4096


def entries_read(n: int, every: int, tile: int = COUNT_TILE) -> int:
    """Entries in the tiles of ``tile`` that start at multiples of ``every`` tiles, of ``n``: what
    a sampled count reads. (In closed form: a sum over the tiles was 3,052 Python steps a call
    at n = 100M, about a third of the estimate's host time on an H100, ``benchmarks/gpu/profile_call.py``.)"""
    stride = tile * every
    started = -(-n // stride)  # tiles read, the last maybe partial
    return 0 if n <= 0 else (started - 1) * tile + min(tile, n - (started - 1) * stride)


def _ranks(k: int, m: int, n: int) -> list[int]:
    """The sample's descending ranks whose order statistics are the candidates."""
    return sorted({min(m, max(1, int(round(f * k * m / n)))) for f in GRID})


def candidate_thresholds(x: torch.Tensor, k: int, sample_size: int = 65536) -> np.ndarray:
    """Descending positive candidate thresholds from a strided sample of |x|.

    1. Sample every ``n // sample_size``-th entry (strided: no RNG, cheap on
       any device, and spread over every layer of a flattened model).
    2. Candidate j is the sample's order statistic at descending rank
       ``GRID[j] * k * m / n``; duplicates and zeros are dropped.
    """
    n = x.numel()
    flat = x.reshape(-1)
    stride = max(1, n // sample_size)
    sample = flat[::stride].abs().float().cpu().numpy()
    m = sample.size
    ranks = _ranks(k, m, n)
    part = np.partition(sample, [m - r for r in ranks])
    th = np.array([part[m - r] for r in ranks], dtype=np.float64)
    th = np.unique(th[th > 0])[::-1]  # unique sorts ascending; we want descending
    if th.size == 0:  # the sample is all zero: count the nonzeros
        th = np.array([np.finfo(np.float32).tiny])
    return th


def count_above_torch(x: torch.Tensor, thresholds: np.ndarray, every: int = 1) -> np.ndarray:
    """#{i : |x_i| >= t} for each descending threshold t (torch reference, any device).

    Counts every entry: ``every`` (see :func:`count_above`) permits sampling, it does not ask for it.
    """
    asc = torch.tensor(thresholds[::-1].copy(), dtype=torch.float64, device=x.device).to(
        x.dtype if x.dtype != torch.bfloat16 and x.dtype != torch.float16 else torch.float32)
    mag = x.reshape(-1).abs().to(asc.dtype)
    # bucket b = number of thresholds <= |x_i|; count(>= asc[j]) = #{b > j}.
    b = torch.bucketize(mag, asc, right=True)
    # One read (bincount would read the largest bucket first to size its output).
    hist = torch.zeros(asc.numel() + 1, dtype=torch.int64, device=x.device).index_add_(0, b, torch.ones_like(b))
    hist = hist.cpu().numpy()
    ge_asc = np.cumsum(hist[::-1])[::-1][1:]  # ge_asc[j] = #{b >= j + 1}
    return ge_asc[::-1].astype(np.int64)


def estimate_threshold(x: torch.Tensor, k: int, sample_size: int = 65536,
                       count_every: int = 8, backend: str | None = None) -> float:
    """A threshold t with #{|x_i| >= t} close to k (within a few percent), cheaply.

    1. Candidates from a strided sample (:func:`candidate_thresholds`).
    2. One pass counts the entries at or above every candidate (numba on
       CPU, a Triton or CuPy kernel on CUDA, ``torch.bucketize`` otherwise). On CPU it reads every
       ``count_every``-th tile of 4096 entries and scales: at density 0.01 an
       eighth of 25M entries still holds ~31k selected, a 0.6% count noise,
       for an eighth of the memory traffic.
    3. k lies between two neighbouring candidates' counts: interpolate
       between them, linearly in log(count), since tails of gradient
       distributions are close to exponential over such a short span.
       If k lies outside every count, the nearest candidate is returned.

    Args:
        x: values (signed or magnitudes), any shape, any float dtype.
        k: target count, 1 <= k <= numel.
        sample_size: sample entries used for the candidates.
        count_every: CPU counting pass reads at most one tile in this many
            (fewer when k is small, so ~20k selected entries are still counted).
        backend: ``cpu``/``triton``/``cupy``/``torch``/``auto`` (``kernels.dispatch``).

    Returns:
        The threshold, a positive float.
    """
    n = x.numel()
    if not 1 <= k <= n:
        raise ValueError(f"estimate_threshold: k={k} outside [1, {n}]")
    # Read enough tiles that ~20k selected entries are counted (count noise ~0.7%); small k
    # means a full pass.
    every = max(1, min(count_every, k // 20_000))
    if not dispatch.in_host_memory(x):
        return _estimate_on_device(x, k, sample_size, every, backend)
    th = candidate_thresholds(x, k, sample_size)
    counts = count_above(x, th, backend, every=every)
    return _interpolate(th, counts, k)


def _estimate_on_device(x: torch.Tensor, k: int, sample_size: int, every: int, backend: str | None) -> float:
    """:func:`estimate_threshold` off the host: the same candidates and counts, one read.

    1. The candidates are order statistics of the strided sample, taken on the device
       (``topk``), zeros kept for now.
    2. One pass counts the entries at or above each (a zero counts at the smallest
       positive float) over one tile in ``every`` (:func:`count_on_device`): an eighth
       of the tensor at ``every`` = 8, as the numba path reads.
    3. One read of the candidates and their counts; on the host the zeros and repeats
       are dropped as :func:`candidate_thresholds` drops them, the counts scaled by the
       share read, and the two candidates around k interpolated.
    """
    n = x.numel()
    flat = x.reshape(-1)
    stride = max(1, n // sample_size)
    sample = flat[::stride].abs().float()
    ranks = _ranks(k, sample.numel(), n)
    top = torch.topk(sample, ranks[-1]).values
    raw = torch.stack([top[r - 1] for r in ranks])  # (views of one tensor, one copy)
    tiny = float(np.finfo(np.float32).tiny)
    # The device count has Triton and torch paths; a backend it lacks (cupy) counts the default way.
    own = backend if backend in (None, "auto") or backend in _COUNT_ON_DEVICE.backends else None
    counts = count_on_device(flat, torch.where(raw > 0, raw, tiny), every, backend=own)
    got = np.asarray(dispatch.to_host(torch.cat([raw.double(), counts[:len(ranks)].double()])))
    raw_h, counted = got[:len(ranks)], got[len(ranks):]
    if every > 1:
        counted = np.rint(counted * (n / entries_read(n, every)))
    keep = raw_h > 0
    if not keep.any():  # the sample is all zero: count the nonzeros
        return _interpolate(np.array([tiny]), counted[:1].astype(np.int64), k)
    th, first = np.unique(raw_h[keep], return_index=True)
    return _interpolate(th[::-1], counted[keep][first][::-1].astype(np.int64), k)


def count_on_device(x: torch.Tensor, thresholds: torch.Tensor, every: int = 1, backend: str | None = None
                    ) -> torch.Tensor:
    """The entries of ``x`` at or above each of the positive float32 ``thresholds`` (at most 16, on
    ``x``'s device, any order), over the tiles of ``COUNT_TILE`` entries that start at multiples of
    ``every`` tiles, as int64 device counts (at least one per threshold; nothing read)."""
    if thresholds.numel() > 16 or thresholds.dtype != torch.float32:
        raise ValueError("count_on_device: at most 16 float32 thresholds")
    return _COUNT_ON_DEVICE(x.reshape(-1), thresholds, int(every), backend=backend)


def count_on_device_torch(x: torch.Tensor, thresholds: torch.Tensor, every: int) -> torch.Tensor:
    """Reference of :func:`count_on_device` (the tiles not read count as zeros: the thresholds
    are positive)."""
    mag = x.abs().float()
    if every > 1:
        read = torch.arange(x.numel(), device=x.device).div_(COUNT_TILE, rounding_mode="floor").remainder_(every) == 0
        mag = torch.where(read, mag, torch.zeros((), device=x.device))
    return torch.stack([(mag >= t).sum() for t in thresholds])


_COUNT_ON_DEVICE = dispatch.KernelOp("count_on_device", count_on_device_torch,
                                     triton="triton_backend:count_on_device",
                                     accepts={"triton": lambda x, *_: x.dtype != torch.float64})


def count_above(x: torch.Tensor, thresholds: np.ndarray, backend: str | None = None,
                every: int = 1) -> np.ndarray:
    """#{i : |x_i| >= t} for each of the descending positive ``thresholds``, in one pass.

    Paths: ``cpu`` (numba; with ``every`` > 1 it reads one tile of 4096 in
    ``every`` and scales the counts: an estimate), ``triton``/``cupy`` (CUDA,
    fp16/bf16/fp32, at most 16 thresholds, else torch), ``torch``
    (``bucketize``, any device). Exact unless ``every`` > 1.
    """
    th = np.asarray(thresholds, dtype=np.float64).reshape(-1)
    if th.size == 0 or not (th > 0).all() or (th.size > 1 and not (np.diff(th) < 0).all()):
        raise ValueError("count_above: thresholds must be positive and strictly descending, "
                         f"got {th.tolist()[:8]}")
    if every < 1:
        raise ValueError(f"count_above: every must be >= 1, got {every}")
    if x.numel() == 0:
        return np.zeros(th.size, dtype=np.int64)
    return _COUNT_ABOVE(x, th, every, backend=backend)


def _gpu_countable(x: torch.Tensor, thresholds: np.ndarray, every: int) -> bool:
    return x.dtype != torch.float64 and thresholds.size <= 16


# triton/cupy compare in float32, for at most 16 thresholds; the rest go to torch.
_COUNT_ABOVE = dispatch.KernelOp(
    "count_above", count_above_torch, cpu="numba_backend:count_above",
    triton="triton_backend:count_above", cupy="cupy_backend:count_above",
    accepts={("triton", "cupy"): _gpu_countable}, prefer=dispatch.CUDA_SCANS)


def _interpolate(th: np.ndarray, counts: np.ndarray, k: int) -> float:
    if k <= counts[0]:
        return float(th[0])
    if k >= counts[-1]:
        return float(th[-1])
    j = int(np.searchsorted(counts, k, side="right")) - 1  # counts[j] <= k < counts[j+1]
    c0, c1 = counts[j], counts[j + 1]
    if c0 <= 0 or c1 == c0:
        return float(th[j + 1] if c0 <= 0 else th[j])
    w = (math.log(k) - math.log(c0)) / (math.log(c1) - math.log(c0))
    return float(th[j] + w * (th[j + 1] - th[j]))


def bucketize(x: torch.Tensor, edges: torch.Tensor, backend: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(bucket of each entry, entries per bucket) for ascending ``edges`` (m of them).

    Bucket i holds edges[i-1] <= x < edges[i] (``torch.bucketize(right=True)``):
    0 below every edge, m at or above the last, and NaN in m too. Returns an
    int64 tensor like ``x`` and m + 1 int64 counts. Paths: ``torch`` (the
    reference: ``bucketize`` and ``bincount``, any device); ``cpu`` (numba:
    per entry a branch-free count of the edges it is not below, 6.7 -> 1.6 ms
    for 290k entries and 17 edges, where torch's binary search mispredicts).
    """
    if edges.dim() != 1 or edges.dtype != x.dtype or edges.device != x.device:
        raise ValueError("bucketize: edges must be a 1-D tensor of x's dtype and device")
    return _BUCKETIZE(x.reshape(-1), edges, backend=backend)


def bucketize_torch(x: torch.Tensor, edges: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference of :func:`bucketize`."""
    bucket = torch.bucketize(x, edges, right=True)
    # A scatter-add into edges + 1 counters: bincount sizes its output by the largest bucket,
    # a read of the device on a GPU.
    hist = torch.zeros(edges.numel() + 1, dtype=torch.int64, device=x.device)
    return bucket, hist.index_add_(0, bucket, torch.ones_like(bucket))


_BUCKETIZE = dispatch.KernelOp("bucketize", bucketize_torch, cpu="numba_backend:bucketize",
                               accepts={"cpu": lambda x, edges: x.dtype in (torch.float32, torch.float64)})
