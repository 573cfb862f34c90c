"""Top-k selection by magnitude, with a deterministic tie rule.

Selection semantics used everywhere in sparsecomm: the top-k of a vector are
its k largest-magnitude *nonzero* entries; among entries of equal magnitude the
lower index wins. Zeros are never selected (they carry nothing), so a vector
with fewer than k nonzeros yields all of them, and an all-zero vector yields an
empty selection.
"""

from __future__ import annotations

import numpy as np
import torch

from . import dispatch

__all__ = ["kth_largest", "kth_largest_torch", "topk_indexes", "select_above", "select_above_torch",
           "topk_of_candidates", "topk_of_candidates_torch", "nonzero", "nonzero_torch"]


def kth_largest(mag: torch.Tensor, k: int, backend: str | None = None, *,
                use_abs: bool = False) -> float:
    """The k-th largest value of 1-D ``mag`` (of ``|mag|`` with ``use_abs``), 1 <= k <= numel.

    Exact. Paths (``kernels.dispatch``): ``torch`` is numpy's introselect on
    CPU and ``torch.topk`` elsewhere (the reference); ``cpu`` is a radix
    select up to 2^20 entries, beyond a sampled bracket plus one numba pass
    (``kernels.numba_backend``); ``triton``/``cupy`` are
    8-bit radix selects over the float bit patterns without the sign bit
    (fp16/bf16/fp32; other dtypes use the torch path), i.e. over |x|. The
    fast paths rank magnitudes, so without ``use_abs`` they equal the
    reference for the non-negative ``mag`` every caller passes. With
    ``use_abs`` no ``|x|`` tensor is materialised on the CPU path.
    """
    n = mag.numel()
    if not 1 <= k <= n:
        raise ValueError(f"kth_largest: k={k} outside [1, {n}]")
    return _KTH_LARGEST(mag, k, use_abs, backend=backend)


def kth_largest_torch(mag: torch.Tensor, k: int, use_abs: bool = False) -> float:
    """Reference k-th largest (of ``|mag|`` with ``use_abs``): numpy introselect on CPU, ``topk`` elsewhere."""
    if use_abs:
        mag = mag.abs()
    n = mag.numel()
    if dispatch.in_host_memory(mag) and mag.dtype in (torch.float32, torch.float64):
        arr = mag.detach().numpy()
        return float(np.partition(arr, n - k)[n - k])
    if dispatch.in_host_memory(mag):
        return kth_largest_torch(mag.float(), k)
    return float(torch.topk(mag, k, sorted=False).values.min())


def _radix_dtype(mag: torch.Tensor, k: int, use_abs: bool) -> bool:
    return mag.dtype in (torch.float16, torch.bfloat16, torch.float32)


# triton/cupy: radix selects over 16/32-bit float keys only; other dtypes go to torch.
# Triton first on CUDA (the default order): from 2^20 entries its select reads the tensor once
# above a sampled bound, where CuPy's radix makes four full passes (0.71 ms of device time at
# 100M on an H100; 0.77 against 2.09 ms a call: benchmarks/results/2026-11-26-h100-hot-path).
_KTH_LARGEST = dispatch.KernelOp(
    "kth_largest", kth_largest_torch, cpu="numba_backend:kth_largest",
    triton="triton_backend:kth_largest", cupy="cupy_backend:kth_largest",
    accepts={("triton", "cupy"): _radix_dtype})


def topk_of_candidates(idx: torch.Tensor, mag: torch.Tensor, k: int, positive: bool = False,
                       backend: str | None = None) -> torch.Tensor:
    """Positions (into ``idx``) of the top-k of candidates with magnitudes ``mag``.

    1. If there are at most k nonzero candidates, keep all nonzero ones.
    2. Else th = k-th largest magnitude; keep every candidate above th and,
       of those equal to th, the ones with the lowest ``idx`` until k are kept.

    ``idx`` must be sorted ascending so that "first" means "lowest index";
    ``mag`` is non-negative (a NaN is never kept). ``positive``: the caller knows every
    magnitude to be positive and finite (candidates at or above a positive threshold), so
    exactly min(k, count) are kept: no read of how many. Returns a sorted int64 tensor of positions.
    Paths: ``torch`` (the reference, a chain of masks), ``cpu`` (a numba radix
    select and one pass, ``kernels.numba_backend``).
    """
    return _TOPK_OF_CANDIDATES(idx, mag, k, positive, backend=backend)


def topk_of_candidates_torch(idx: torch.Tensor, mag: torch.Tensor, k: int, positive: bool = False) -> torch.Tensor:
    """Reference of :func:`topk_of_candidates`: one read of the device (none when ``positive``).

    1. A stable descending sort of the magnitudes (NaN as 0: never kept): ties keep
       the candidates' order, which is ascending ``idx``.
    2. Mark the first k of them that are positive, and return the marked positions
       (``positive``: all of the first k, sorted).
    """
    if k < 1:
        raise ValueError(f"topk_of_candidates: k must be >= 1, got {k}")
    m = torch.nan_to_num(mag, nan=0.0)
    order = torch.sort(m, descending=True, stable=True).indices[:k]
    if positive:
        return torch.sort(order).values
    keep = torch.zeros(m.shape, dtype=torch.bool, device=m.device)
    keep.index_put_((order,), m.index_select(0, order) > 0)
    return nonzero(keep)


# cpu: from 4096 candidates (below, the radix select's 64k-bin histogram costs more than torch's
# few passes) and for k >= 1 (the reference's errors for the rest).
_TOPK_OF_CANDIDATES = dispatch.KernelOp("topk_of_candidates", topk_of_candidates_torch,
                                        cpu="numba_backend:topk_of_candidates",
                                        accepts={"cpu": lambda idx, mag, k, positive=False: k >= 1 and mag.numel() >= 4096})


def topk_indexes(mag: torch.Tensor, k: int, *, use_abs: bool = False) -> torch.Tensor:
    """Sorted int64 indexes of the top-k of 1-D magnitudes ``mag`` (exact, ties to lower index).

    With ``use_abs``, ``mag`` may be signed and ``|mag|`` is ranked (without
    materialising it on the CPU path).
    """
    n = mag.numel()
    if k >= n:
        return select_above(mag, 0.0, use_abs=use_abs)
    th = kth_largest(mag, k, use_abs=use_abs)
    idx = select_above(mag, th, use_abs=use_abs)  # th <= 0: every nonzero entry, fewer than k
    if th <= 0 or idx.numel() == k:
        return idx
    cand = mag[idx]
    return idx[topk_of_candidates(idx, cand.abs() if use_abs else cand, k)]


def select_above(mag: torch.Tensor, threshold: float, backend: str | None = None, *,
                 use_abs: bool = False) -> torch.Tensor:
    """Sorted int64 indexes of nonzero entries with ``mag >= threshold`` (``|mag|`` with ``use_abs``).

    ``mag`` is 1-D (non-negative unless ``use_abs``). Paths: ``cpu`` is one
    numba pass (``kernels.numba_backend.select_above``); ``torch`` is ``nonzero``
    of a mask (any device; on CUDA a single fused kernel already).
    """
    return _SELECT_ABOVE(mag, threshold, use_abs, backend=backend)


def select_above_torch(mag: torch.Tensor, threshold: float, use_abs: bool = False) -> torch.Tensor:
    """Reference of :func:`select_above`: ``nonzero`` of a mask."""
    m = mag.abs() if use_abs else mag
    if threshold > 0:
        return torch.nonzero(m >= threshold).flatten()
    return torch.nonzero(m > 0).flatten()


_SELECT_ABOVE = dispatch.KernelOp("select_above", select_above_torch, cpu="numba_backend:select_above")


def nonzero(mask: torch.Tensor, count: int | None = None, backend: str | None = None) -> torch.Tensor:
    """Sorted int64 positions of the True entries of a 1-D bool ``mask``.

    The ``cpu`` path is numpy's ``flatnonzero``: 0.29 ms against torch's 1.5 ms
    for 260k entries on one thread (12 against 71 ms at 25M).

    ``count``: the number of True entries, when the caller knows it already (a
    count it read). The torch path then sizes its output with it
    (``nonzero_static``) instead of reading the count from the device: no
    synchronisation on a GPU. A wrong count is the caller's error (off GPUs
    it raises ValueError).
    """
    return _NONZERO(mask, count, backend=backend)


def nonzero_torch(mask: torch.Tensor, count: int | None = None) -> torch.Tensor:
    """Reference of :func:`nonzero`."""
    if count is None:
        return torch.nonzero(mask).flatten()
    pos = torch.nonzero_static(mask.reshape(-1), size=count).flatten()
    if dispatch.checks_values(mask) and int(mask.sum()) != count:
        raise ValueError(f"nonzero: the mask holds {int(mask.sum())} True entries, not {count}")
    return pos


_NONZERO = dispatch.KernelOp("nonzero", nonzero_torch, cpu="numba_backend:nonzero",
                             accepts={"cpu": lambda mask, count=None: mask.dtype == torch.bool and mask.dim() == 1
                                      and mask.is_contiguous()})
