"""Reference semantics, written independently of the library's code paths.

Selection rule (documented in sparsecomm.kernels.select): the top-k of a vector
are its k largest-magnitude nonzero entries, ties broken by lower index.
"""

from __future__ import annotations

import math
from statistics import NormalDist

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


def ref_oktopk2l(grads: list[torch.Tensor], density: float, G: int) -> torch.Tensor:
    """Two-level Ok-Topk: node j's sum S_j (ranks jG .. jG + G - 1); shard l (m = ceil(n/G)
    entries) of the result is Ok-Topk's exact result over the nodes' shards S_j[l], with
    ceil(k/G) entries. Float32 sums."""
    n, P = grads[0].numel(), len(grads)
    k, m = k_of(density, n), -(-n // G)
    kk = min(m, -(-k // G))
    sums = [sum(g.reshape(-1).float() for g in grads[j * G:(j + 1) * G]) for j in range(P // G)]
    out = torch.zeros(n, dtype=torch.float32)
    for lo in range(0, n, m):
        total = torch.zeros(min(m, n - lo), dtype=torch.float32)
        for s in sums:
            part = s[lo:lo + m]
            idx = torch.from_numpy(ref_topk(part.numpy(), kk))
            total[idx] += part[idx]
        keep = torch.from_numpy(ref_topk(total.numpy(), kk))
        out[lo + keep] = total[keep]
    return out.to(grads[0].dtype).reshape(grads[0].shape)


def ref_cltk(grads: list[torch.Tensor], density: float, leader: int) -> torch.Tensor:
    """CLT-k: every rank's values summed at the leader's k largest |value|, ties (zeros too,
    when fewer than k are nonzero) to the lower index; zero elsewhere. Float32 sums."""
    n = grads[0].numel()
    k = k_of(density, n)
    lead = grads[leader].reshape(-1).to(torch.float64).numpy()
    order = np.lexsort((np.arange(n), -np.abs(lead)))
    idx = torch.from_numpy(np.sort(order[:k]).astype(np.int64))
    total = torch.zeros(n, dtype=torch.float32)
    for g in grads:
        total[idx] += g.reshape(-1).float()[idx]
    return total.to(grads[0].dtype).reshape(grads[0].shape)


def ref_local_topk(g: torch.Tensor, density: float) -> torch.Tensor:
    flat = g.reshape(-1).to(torch.float64)
    return torch.from_numpy(ref_topk(flat.numpy(), k_of(density, flat.numel())))


def ref_sum_of_selected(grads, selections):
    total = torch.zeros(grads[0].numel(), dtype=torch.float32)
    for g, idx in zip(grads, selections):
        total[idx] += g.float()[idx]
    return total


def ref_gaussian_selection(g: torch.Tensor, density: float) -> torch.Tensor:
    """Independent float64 version of the Gaussiank rule."""
    v = g.double().numpy()
    k = k_of(density, v.size)
    th = abs(v.mean()) + NormalDist().inv_cdf(1 - density / 2) * (v.std(ddof=1) if v.size > 1 else 0.0)
    mag = np.abs(v)
    nonzero = int((mag > 0).sum())
    for _ in range(20):
        count = int((mag >= th).sum())
        if th <= 0 or count >= 0.75 * k or count >= nonzero:
            break
        th *= 0.8
    return torch.from_numpy(np.nonzero((mag >= th) & (mag > 0))[0])


def ref_gtopk(grads, density, value_dtype=torch.float32):
    """The binomial tree of top-k merges, written out."""
    P, n = len(grads), grads[0].numel()
    k = k_of(density, n)

    def top(vec_dict):
        idx = np.array(sorted(vec_dict), dtype=np.int64)
        vals = np.array([vec_dict[i] for i in idx], dtype=np.float64)
        keep = ref_topk(vals, k) if idx.size else np.array([], dtype=np.int64)
        return {int(idx[j]): vals[j] for j in keep}

    sets = []
    for g in grads:
        flat = g.float().numpy()
        sets.append({int(i): float(flat[i]) for i in ref_topk(flat, k)})
    d = 1
    while d < P:
        for i in range(0, P, 2 * d):
            if i + d < P:
                merged = dict(sets[i])
                for j, v in sets[i + d].items():
                    merged[j] = merged.get(j, 0.0) + v
                sets[i] = top(merged)
        d *= 2
    out = torch.zeros(n, dtype=torch.float32)
    for j, v in sets[0].items():
        out[j] = v
    return out


def _sum_of_local_topk(grads, density):
    k = k_of(density, grads[0].numel())
    return ref_sum_of_selected(grads, [torch.from_numpy(ref_topk(g.numpy(), k)) for g in grads])


#: The exact result of a stateless call of every registered algorithm, from float32 gradients
#: whose sums are exact in any order (a new algorithm adds its line here).
REFERENCES = {
    "oktopk": ref_oktopk,
    "oktopk2d": ref_oktopk,  # (Ok-Topk on a grid of ranks: the same selection)
    # (one rank a node where nothing says otherwise: Ok-Topk's selection; test_twolevel.py has G > 1)
    "oktopk2l": lambda grads, density: ref_oktopk2l(grads, density, 1),
    "topka": _sum_of_local_topk,
    "topkdsa": _sum_of_local_topk,
    "gaussiank": lambda grads, density: ref_sum_of_selected(
        grads, [ref_gaussian_selection(g, density) for g in grads]),
    "gtopk": ref_gtopk,
    # A stateless call is its state's first: rank 0 leads.
    "cltk": lambda grads, density: ref_cltk(grads, density, 0),
    "dense": lambda grads, density: sum(grads),
}
