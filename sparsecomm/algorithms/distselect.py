"""Exact distributed top-k selection over values spread across ranks.

Used for Ok-Topk's global threshold: each rank holds the reduced values of its
own region, and the ranks must agree on the exact global top-k without
gathering the values. Magnitudes of non-negative floats order like their bit
patterns read as integers, so a most-significant-digit radix select finds the
k-th largest exactly:

1. key = bits of |v| (int32 for float32, int64 for float64); zeros are ignored.
2. For each byte of the key from the top: every rank histograms the byte of
   its keys that still match the prefix found so far (256 counts), the
   histograms are summed with one allreduce, and the bin holding the k-th
   largest is appended to the prefix.
3. After 4 (float32) or 8 (float64) rounds the prefix is the k-th largest key.
   Ties at that key are broken by global index: regions are ordered by rank,
   so a second small allgather of (count above, count equal) per rank tells
   each rank how many of its ties to keep.

Cost: 4 allreduces of 256 int64 counts plus one allgather of 2P counts, i.e. a
constant 16 KiB of traffic per rank plus O(P) words, independent of k and n.
"""

from __future__ import annotations

import torch

from ..comm.base import Communicator

__all__ = ["magnitude_keys", "global_topk_mask"]


def magnitude_keys(mag: torch.Tensor) -> torch.Tensor:
    """Integer keys ordering like the non-negative float magnitudes ``mag``."""
    if mag.dtype == torch.float64:
        return mag.view(torch.int64)
    return mag.to(torch.float32).view(torch.int32).to(torch.int64)


def _kth_key(keys: torch.Tensor, k: int, bits: int, comm: Communicator) -> tuple[int, int] | None:
    """Globally k-th largest positive key and the global count of keys above it.

    Returns None when there are at most k positive keys in all.
    """
    cand = keys[keys > 0]
    prefix, above = 0, 0
    for shift in range(bits - 8, -1, -8):
        digit = (cand >> shift) & 255
        hist = comm.allreduce(torch.bincount(digit, minlength=256).to(torch.int64), "sum").tolist()
        if shift == bits - 8 and sum(hist) <= k:
            return None
        # Walk down from the top bin until the k-th largest is inside bin b.
        b, remaining = 255, k - above
        while hist[b] < remaining:
            remaining -= hist[b]
            b -= 1
        above = k - remaining
        prefix = (prefix << 8) | b
        cand = cand[digit == b]
    return prefix, above


def global_topk_mask(mag: torch.Tensor, k: int, comm: Communicator) -> tuple[torch.Tensor, list[int], float | None]:
    """Select this rank's share of the global top-k of distributed magnitudes.

    Rank r's ``mag`` must hold the magnitudes of a contiguous index range that
    comes after rank r-1's and before rank r+1's, in index order, so that
    "lower index wins ties" is well defined across ranks.

    Args:
        mag: this rank's non-negative magnitudes (float32 or float64).
        k: how many entries to select over all ranks.
        comm: the communicator of the ranks holding the pieces.

    Returns:
        (mask over ``mag`` of selected entries, selected count of every rank,
        k-th largest magnitude or None when all nonzero entries were taken).
    """
    keys = magnitude_keys(mag)
    bits = 64 if mag.dtype == torch.float64 else 32
    found = _kth_key(keys, k, bits, comm)
    if found is None:
        mask = keys > 0
        counts = comm.allgather(mask.sum().reshape(1).to(torch.int64)).flatten()
        return mask, counts.tolist(), None
    th_key, above_global = found
    gt, eq = keys > th_key, keys == th_key
    table = comm.allgather(torch.stack([gt.sum(), eq.sum()]).to(torch.int64))
    need = k - above_global
    eq_before = torch.cumsum(table[:, 1], 0) - table[:, 1]
    take = torch.clamp(need - eq_before, min=0)
    take = torch.minimum(take, table[:, 1])
    mine = int(take[comm.rank])
    mask = gt | (eq & (torch.cumsum(eq, 0) <= mine))
    counts = (table[:, 0] + take).tolist()
    th = float(torch.tensor([th_key], dtype=torch.int64 if bits == 64 else torch.int32)
               .view(torch.float64 if bits == 64 else torch.float32))
    return mask, counts, th
