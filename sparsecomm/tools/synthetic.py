"""Synthetic gradients that look like a real model's, for benchmarks and studies.

A model's flat gradient is a concatenation of layers whose scales differ by
orders of magnitude, with heavy-tailed values inside each layer, and it drifts
slowly from one step to the next (the property Ok-Topk's threshold reuse
relies on). ``gradient(rank, step, n)`` produces such a vector, seeded by
(rank, step) so every run is reproducible and every rank differs.
"""

from __future__ import annotations

import functools
from typing import Iterator

import numpy as np
import torch

__all__ = ["gradient", "drifting", "repeating", "digits_gradients", "KINDS"]

KINDS = ("model", "gaussian", "student_t", "skewed")


@functools.lru_cache(maxsize=2)
def _layer_scales(n: int, layers: int, seed: int) -> torch.Tensor:
    """Per-entry scales of ``layers`` layers of random sizes (cached: a permutation of n
    entries each; callers only read the tensor)."""
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
        g = _shared_model(n) * (1 + 0.01 * step) + drift * _student_t(n, gen) * _layer_scales(n, 32, 11)
    return g.to(dtype)


@functools.lru_cache(maxsize=2)
def _shared_model(n: int) -> torch.Tensor:
    """The "model" kind's persistent part, the same on every rank and step: made once per size
    (every simulated rank of a study made it anew). Callers only read it."""
    return _student_t(n, torch.Generator().manual_seed(7)) * _layer_scales(n, 32, 11)


def drifting(rank: int, n: int, shrink: float = 1.0, shared_scale: bool = False) -> Iterator[torch.Tensor]:
    """Successive gradients of ``rank`` under error feedback's typical workload, endlessly.

    1. x starts as randn(n) (seeded by ``rank``).
    2. Each call x = 0.9 x + 0.1 randn (the slowly drifting gradient of the steady-state benchmark);
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


def repeating(rank: int, n: int, period: int = 4) -> Iterator[torch.Tensor]:
    """Gradients whose noise repeats every ``period`` calls, endlessly (the same batches
    coming back every epoch): call t yields pattern t mod ``period`` of ``rank``'s own,
    each randn(n). Under error feedback the residual then grows steadily where the
    patterns' mean is large, instead of wandering as on :func:`drifting`."""
    gen = torch.Generator().manual_seed(200 + rank)
    patterns = [torch.randn(n, generator=gen) for _ in range(period)]
    t = 0
    while True:
        yield patterns[t % period].clone()
        t += 1


def digits_gradients(ranks: int, steps: int, batches: int = 8, batch: int = 16, width: int = 512,
                     lr: float = 0.05, seed: int = 0) -> list[list[torch.Tensor]]:
    """Every rank's flat gradient at each step of a real model trained over a fixed dataset.

    An MLP 64-``width``-``width``-10 (300k parameters at 512) on scikit-learn's bundled
    digits (no download; needs scikit-learn). Rank r holds ``batches`` fixed batches of
    ``batch`` samples and takes batch t mod ``batches`` at step t, so each epoch repeats
    the last; the model steps with SGD (momentum 0.9) on the ranks' average gradient, as
    dense data parallelism would. Returns ``[rank][step]`` gradients.
    """
    # optional: only this gradient kind needs it
    from sklearn.datasets import load_digits

    d = load_digits()
    x = torch.tensor(d.data, dtype=torch.float32) / 16.0
    y = torch.tensor(d.target, dtype=torch.int64)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    per = batches * batch
    if ranks * per > len(x):
        raise ValueError(f"digits has {len(x)} samples: {ranks} ranks x {batches} batches x {batch} do not fit")
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(64, width), torch.nn.ReLU(), torch.nn.Linear(width, width),
                                    torch.nn.ReLU(), torch.nn.Linear(width, 10))
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    out: list[list[torch.Tensor]] = [[] for _ in range(ranks)]
    for t in range(steps):
        mean = None
        for r in range(ranks):
            at = order[r * per + (t % batches) * batch:][:batch]
            model.zero_grad()
            torch.nn.functional.cross_entropy(model(x[at]), y[at]).backward()
            flat = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
            out[r].append(flat)
            mean = flat.clone() if mean is None else mean.add_(flat)
        at = 0
        for p in model.parameters():
            p.grad.copy_(mean[at:at + p.numel()].view_as(p)).div_(ranks)
            at += p.numel()
        opt.step()
    return out


def _student_t(n: int, gen: torch.Generator, dof: float = 3.0) -> torch.Tensor:
    z = torch.randn(n, generator=gen)
    chi2 = torch.randn((int(dof), n), generator=gen).pow(2).sum(0)
    return z / torch.sqrt(chi2 / dof)
