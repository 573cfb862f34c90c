"""Reference semantics, written independently of the library's code paths.

Selection rule (documented in sparsecomm.kernels.select): the top-k of a vector
are its k largest-magnitude nonzero entries, ties broken by lower index.
"""

from __future__ import annotations

import math

import numpy as np
import torch


def k_of(density: float, n: int) -> int:
    return min(n, max(1, math.ceil(round(density * n, 9))))


def ref_topk(vec: np.ndarray, k: int) -> np.ndarray:
    """Sorted indexes of the reference top-k of ``vec``."""
    mag = np.abs(vec.astype(np.float64))
    order = np.lexsort((np.arange(vec.size), -mag))  # by -|v|, then index
    chosen = [i for i in order[:k] if mag[i] > 0]
    return np.sort(np.array(chosen, dtype=np.int64))


def ref_oktopk(grads: list[torch.Tensor], density: float) -> torch.Tensor:
    """Exact Ok-Topk semantics: global top-k of the sum of every rank's local top-k.

    Sums are taken in float32 (float64 for float64 input), as the library
    accumulates; tests feed values whose sums are exact in any order.
    """
    dtype = grads[0].dtype
    work = torch.float64 if dtype == torch.float64 else torch.float32
    n = grads[0].numel()
    k = k_of(density, n)
    total = torch.zeros(n, dtype=work)
    for g in grads:
        flat = g.reshape(-1).to(work)
        idx = torch.from_numpy(ref_topk(flat.numpy(), k))
        total[idx] += flat[idx]
    gidx = torch.from_numpy(ref_topk(total.numpy(), k))
    out = torch.zeros(n, dtype=dtype)
    out[gidx] = total[gidx].to(dtype)
    return out.reshape(grads[0].shape)


def ref_local_topk(g: torch.Tensor, density: float) -> torch.Tensor:
    flat = g.reshape(-1).to(torch.float64)
    return torch.from_numpy(ref_topk(flat.numpy(), k_of(density, flat.numel())))
