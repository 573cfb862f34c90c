"""Synthetic gradients that look like a real model's, for benchmarks and studies.

A model's flat gradient is a concatenation of layers whose scales differ by
orders of magnitude, with heavy-tailed values inside each layer, and it drifts
slowly from one step to the next (the property Ok-Topk's threshold reuse
relies on). ``gradient(rank, step, n)`` produces such a vector, seeded by
(rank, step) so every run is reproducible and every rank differs.
"""

from __future__ import annotations

from typing import Iterator

import numpy as np
import torch

__all__ = ["gradient", "drifting", "KINDS"]

KINDS = ("model", "gaussian", "student_t", "skewed")


def _layer_scales(n: int, layers: int, seed: int) -> torch.Tensor:
    gen = np.random.default_rng(seed)
    cuts = np.sort(gen.choice(np.arange(1, n), size=min(layers, n) - 1, replace=False)) if n > 1 else []
    sizes = np.diff(np.concatenate([[0], cuts, [n]])).astype(np.int64)
    scales = 10.0 ** gen.uniform(-3, 0, size=len(sizes))
    return torch.from_numpy(np.repeat(scales, sizes).astype(np.float32))


def gradient(rank: int, step: int, n: int, kind: str = "model", dtype: torch.dtype = torch.float32,
             drift: float = 0.1) -> torch.Tensor:
    """A synthetic gradient of ``n`` elements for ``rank`` at ``step``.

    Args:
        kind: "model" (layered, heavy-tailed, shared structure across ranks),
            "gaussian", "student_t" (3 degrees of freedom) or "skewed" (every
            large entry in the first 10% of the tensor).
        drift: weight of the per-step noise against the persistent part (model kind).
    """
    if kind not in KINDS:
        raise ValueError(f"unknown gradient kind {kind!r}; known: {KINDS}")
    gen = torch.Generator().manual_seed(1_000_003 * rank + step)
    if kind == "gaussian":
        g = torch.randn(n, generator=gen)
    elif kind == "student_t":
        g = _student_t(n, gen)
    elif kind == "skewed":
        g = 0.01 * torch.randn(n, generator=gen)
        g[: n // 10] = torch.randn(n // 10, generator=gen)
    else:
        shared = torch.Generator().manual_seed(7)  # the same model on every rank
        base = _student_t(n, shared) * _layer_scales(n, 32, 11)
        g = base * (1 + 0.01 * step) + drift * _student_t(n, gen) * _layer_scales(n, 32, 11)
    return g.to(dtype)


def drifting(rank: int, n: int, shrink: float = 1.0, shared_scale: bool = False) -> Iterator[torch.Tensor]:
    """Successive gradients of ``rank`` under error feedback's typical workload, endlessly.

    1. x starts as randn(n) (seeded by ``rank``).
    2. Each call x = 0.9 x + 0.1 randn (issue 11's slowly drifting gradient);
       with ``shared_scale`` it is yielded times a per-entry scale exp(randn)
       that every rank shares, and call t (from 0) is multiplied by ``shrink ** t``
       (0.97: a gradient shrinking as in early training).
    """
    gen = torch.Generator().manual_seed(100 + rank)
    scale = torch.exp(torch.randn(n, generator=torch.Generator().manual_seed(7))) if shared_scale else None
    x = torch.randn(n, generator=gen)
    t = 0
    while True:
        x = 0.9 * x + 0.1 * torch.randn(n, generator=gen)
        g = x.clone() if scale is None else x * scale
        yield g if shrink == 1.0 else g * shrink ** t
        t += 1


def _student_t(n: int, gen: torch.Generator, dof: float = 3.0) -> torch.Tensor:
    z = torch.randn(n, generator=gen)
    chi2 = torch.randn((int(dof), n), generator=gen).pow(2).sum(0)
    return z / torch.sqrt(chi2 / dof)
