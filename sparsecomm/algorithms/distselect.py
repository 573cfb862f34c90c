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

Cost: 4 allreduces of 256 counts plus one allgather of 2P counts, i.e. a
constant 8 KiB of traffic per rank (int32 counts where a bound on the candidates,
``candidates_at_most``, fits them; else 16 KiB of int64) plus O(P) words,
independent of k and n, in 5 rounds. When the candidates are few that constant dominates (k = 200 at
P = 6: 6.4x the 2k(P-1)/P bound for the whole call), so ``method="gather"``
allgathers every rank's count of positive magnitudes, then the magnitudes,
and selects locally: two rounds and T values. ``method="auto"`` decides
without a message, from a bound on T every rank knows (Ok-Topk's hard cap:
P ranks contribute at most floor(hi k) entries each): gather when T values
take fewer bytes than the radix rounds and the two allgathers take no more
messages. Every method gives the same keys, ties and masks.
"""

from __future__ import annotations

import torch

from ..comm.base import Communicator

__all__ = ["magnitude_keys", "global_topk_mask", "count_dtype", "METHODS"]

METHODS = ("auto", "radix", "gather")


def gather_is_cheaper(candidates_at_most: int, value_bytes: int, bits: int, P: int) -> bool:
    """Whether gathering at most ``candidates_at_most`` values beats the radix rounds, in
    bytes received (a ring allreduce of 256 counts per round receives about twice
    that) and in messages (two allgathers of P - 1 against ``bits / 8`` allreduces of
    2 log2 P and one allgather)."""
    rounds = bits // 8
    count_bytes = count_dtype(candidates_at_most).itemsize
    fewer_bytes = candidates_at_most * value_bytes <= rounds * 2 * 256 * count_bytes
    no_more_messages = P - 1 <= rounds * 2 * max(1, (P - 1).bit_length())
    return fewer_bytes and no_more_messages


def count_dtype(most: int | None) -> torch.dtype:
    """The narrowest integer dtype for counts summed over ranks, given a bound ``most`` on
    their total that every rank knows (None: no bound, int64)."""
    return torch.int32 if most is not None and most < 2**31 else torch.int64


def magnitude_keys(mag: torch.Tensor) -> torch.Tensor:
    """Integer keys ordering like the non-negative float magnitudes ``mag``."""
    if mag.dtype == torch.float64:
        return mag.view(torch.int64)
    return mag.to(torch.float32).view(torch.int32).to(torch.int64)


def _kth_key(keys: torch.Tensor, k: int, bits: int, comm: Communicator,
             dtype: torch.dtype = torch.int64) -> tuple[int, int] | None:
    """Globally k-th largest positive key and the global count of keys above it (the
    histograms summed in ``dtype``, which must hold the total).

    Returns None when there are at most k positive keys in all.
    """
    cand = keys[keys > 0]
    prefix, above = 0, 0
    for shift in range(bits - 8, -1, -8):
        digit = (cand >> shift) & 255
        hist = comm.allreduce(torch.bincount(digit, minlength=256).to(dtype), "sum").tolist()
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


def _kth_key_gathered(mag: torch.Tensor, positive: torch.Tensor, k: int, counts: list[int],
                      comm: Communicator) -> tuple[tuple[int, int], torch.Tensor]:
    """The radix select's answer (k-th largest key, count above it) and the (above, equal)
    table of every rank, from all positive magnitudes gathered in rank order (more than k)."""
    gathered = comm.allgatherv(mag[positive], counts) if comm.size > 1 else mag[positive]
    keys = magnitude_keys(gathered)
    th_key = int(torch.topk(keys, k, sorted=False).values.min())
    owner = torch.repeat_interleave(torch.arange(comm.size, device=keys.device),
                                    torch.tensor(counts, device=keys.device))
    gt, eq = keys > th_key, keys == th_key
    table = torch.stack([torch.bincount(owner[gt], minlength=comm.size),
                         torch.bincount(owner[eq], minlength=comm.size)], 1).to(torch.int64)
    return (th_key, int(gt.sum())), table


def global_topk_mask(mag: torch.Tensor, k: int, comm: Communicator, method: str = "radix",
                     candidates_at_most: int | None = None) -> tuple[torch.Tensor, list[int], float | None]:
    """Select this rank's share of the global top-k of distributed magnitudes.

    Rank r's ``mag`` must hold the magnitudes of a contiguous index range that
    comes after rank r-1's and before rank r+1's, in index order, so that
    "lower index wins ties" is well defined across ranks.

    1. ``auto``: ``gather`` if :func:`gather_is_cheaper` for
       ``candidates_at_most`` positive magnitudes over all ranks, else ``radix``.
    2. ``radix``: the k-th largest key by 8-bit digits (module docstring),
       then one allgather of every rank's (above, equal) counts.
       ``gather``: one allgather of every rank's count of positive
       magnitudes, then the magnitudes themselves, in rank order; the k-th
       largest key and the (above, equal) table computed locally.
    3. Ties at the k-th largest go to the lowest global indexes.

    Args:
        mag: this rank's non-negative magnitudes (float32 or float64).
        k: how many entries to select over all ranks.
        comm: the communicator of the ranks holding the pieces.
        method: ``auto``, ``radix`` or ``gather`` (same result; cost differs).
        candidates_at_most: a bound on the positive magnitudes of all ranks
            together, the same on every rank: ``auto`` decides by it (None: radix),
            and counts travel as int32 where it fits them (None: int64).

    Returns:
        (mask over ``mag`` of selected entries, selected count of every rank,
        k-th largest magnitude or None when all nonzero entries were taken).
    """
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    keys = magnitude_keys(mag)
    bits = 64 if mag.dtype == torch.float64 else 32
    positive = keys > 0
    if method == "auto":
        cheaper = candidates_at_most is not None and gather_is_cheaper(
            candidates_at_most, mag.element_size(), bits, comm.size)
        method = "gather" if cheaper else "radix"
    counts_pos, table = None, None
    if method == "gather":
        counts_pos = comm.allgather(positive.sum().reshape(1).to(torch.int64)).flatten().tolist()
        # At most k positive entries in all: every one is selected, nothing to gather or rank.
        found, table = (None, None) if sum(counts_pos) <= k else _kth_key_gathered(mag, positive, k,
                                                                                    counts_pos, comm)
    else:
        found = _kth_key(keys, k, bits, comm, count_dtype(candidates_at_most))
    if found is None:
        if counts_pos is None:
            counts_pos = comm.allgather(positive.sum().reshape(1).to(torch.int64)).flatten().tolist()
        return positive, counts_pos, None
    th_key, above_global = found
    gt, eq = keys > th_key, keys == th_key
    if table is None:
        table = comm.allgather(torch.stack([gt.sum(), eq.sum()]).to(count_dtype(candidates_at_most))).to(torch.int64)
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
