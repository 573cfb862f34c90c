"""Exact distributed top-k selection over values spread across ranks.

Used for Ok-Topk's global threshold: each rank holds the reduced values of its
own region, and the ranks must agree on the exact global top-k without
gathering the values. Magnitudes of non-negative floats order like their bit
patterns read as integers, so a most-significant-digit radix select finds the
k-th largest exactly:

1. key = bits of |v| (int32 for float32, int64 for float64); zeros are ignored.
2. The key's bits below the sign are cut into digits of 4 to 8 bits (:func:`radix_widths`):
   as few rounds as keep their bins within a budget of words that grows with k
   (``max(128, k / 2)``), so that the counts are sized by what the call carries. For
   each digit from the top, every rank histograms the digit of its keys that still
   match the prefix found so far, the histograms are summed with one allreduce, and
   the bin holding the k-th largest is appended to the prefix.
3. After the last digit the prefix is the k-th largest key. Ties at that key are
   broken by global index: regions are ordered by rank. Every rank's count travels
   in one small allgather; where the last bin holds more keys than the k-th largest
   needs (ties to split), every rank's (count above, count equal) instead, which
   tells each rank how many of its ties to keep.

Cost: at most 896 counts in 4 rounds (k of 1792 and more), down to 120 counts in 8
rounds (k up to 256); int32 where a bound on the candidates, ``candidates_at_most``,
fits their totals (else int64); then one allgather of P counts (16-bit below k = 2^15),
or of 2P. Its 8 KiB of
8-bit digits were most of an exact Ok-Topk call's traffic at k = 200 (5.1x the
2k(P-1)/P bound by themselves at P = 12; 0.6x with 4-bit digits). When the candidates
are few, ``method="gather"`` allgathers every rank's count of positive magnitudes,
then the magnitudes, and selects locally: two rounds and T values.
``method="auto"`` decides without a message, from a bound on T every rank knows
(Ok-Topk's hard cap: P ranks contribute at most floor(hi k) entries each): gather
when T values take at most ``GATHER_BYTES_PER_K`` bytes a selected entry and the two
allgathers take no
more messages than the radix rounds. Every method gives the same keys, ties and masks.
"""

from __future__ import annotations

import torch

from ..comm.base import Communicator

__all__ = ["magnitude_keys", "global_topk_mask", "count_dtype", "radix_widths", "METHODS", "GATHER_BYTES_PER_K"]

METHODS = ("auto", "radix", "gather")


#: ``auto`` gathers at most this many bytes of candidates a selected entry: twice the data
#: bound of 2k words. Gathering more made an exact Ok-Topk call receive up to 6.3x that bound
#: at k = 201 (P = 7), in 2 rounds where the radix select takes 9.
GATHER_BYTES_PER_K = 16
#: The radix rounds' counts take at most max(RADIX_WORDS_MIN, k / 2) words where digits of
#: 4 bits or more allow: half a word per selected entry (a ring allreduce receives about
#: twice its words, so the counts stay within half of the 2k words of data).
RADIX_WORDS_MIN = 128


def radix_widths(key_bits: int, k: int) -> list[int]:
    """The radix select's digit widths from the top, for keys of ``key_bits`` significant bits:
    the fewest rounds (digits of 8 bits at most) whose bins together fit in
    max(``RADIX_WORDS_MIN``, k / 2) words, or digits of 4 bits where none do.

    31-bit keys (float32): 8, 8, 8, 7 (896 bins) from k = 1792; 8 rounds of 4 bits or 3
    (120 bins) for k up to 256.
    """
    budget = max(RADIX_WORDS_MIN, k // 2)
    widest, narrowest = -(-key_bits // 8), -(-key_bits // 4)
    for rounds in range(widest, narrowest + 1):
        base, extra = divmod(key_bits, rounds)
        widths = [base + 1] * extra + [base] * (rounds - extra)
        if sum(1 << w for w in widths) <= budget or rounds == narrowest:
            return widths
    raise AssertionError("unreachable")


def gather_is_cheaper(candidates_at_most: int, value_bytes: int, bits: int, P: int, k: int) -> bool:
    """Whether gathering at most ``candidates_at_most`` values beats the radix rounds: at most
    ``GATHER_BYTES_PER_K`` bytes a selected entry, and no more messages (two allgathers of
    P - 1 against one allreduce of 2 log2 P per digit, ``radix_widths``, and one allgather)."""
    rounds = len(radix_widths(bits - 1, k))
    fewer_bytes = candidates_at_most * value_bytes <= GATHER_BYTES_PER_K * k
    no_more_messages = P - 1 <= rounds * 2 * max(1, (P - 1).bit_length())
    return fewer_bytes and no_more_messages


def count_dtype(most: int | None) -> torch.dtype:
    """The narrowest integer dtype for counts summed over ranks, given a bound ``most`` on
    their total that every rank knows (None: no bound, int64)."""
    return torch.int32 if most is not None and most < 2**31 else torch.int64


def _allgather_counts(comm: Communicator, count: torch.Tensor, most: int | None) -> list[int]:
    """Every rank's one ``count``, each at most ``most`` (None: no bound), in the narrowest
    integers that hold it (sent as bytes: NCCL has no 16-bit integers)."""
    width = torch.int16 if most is not None and most < 2**15 else count_dtype(most)
    word = count.reshape(1).to(width).view(torch.uint8)
    return comm.allgather(word).view(width).flatten().tolist()


def magnitude_keys(mag: torch.Tensor) -> torch.Tensor:
    """Integer keys ordering like the non-negative float magnitudes ``mag``."""
    if mag.dtype == torch.float64:
        return mag.view(torch.int64)
    return mag.to(torch.float32).view(torch.int32).to(torch.int64)


def _kth_key(keys: torch.Tensor, k: int, bits: int, comm: Communicator,
             dtype: torch.dtype = torch.int64) -> tuple[int, int, bool] | None:
    """Globally k-th largest positive key, the global count of keys above it, and whether
    ties at it must be split (more keys equal to it than the k-th largest needs); the
    histograms summed in ``dtype``, which must hold the total.

    Returns None when there are at most k positive keys in all.
    """
    cand = keys[keys > 0]
    prefix, above, shift, split = 0, 0, bits - 1, False
    for i, width in enumerate(radix_widths(bits - 1, k)):
        shift -= width
        digit = (cand >> shift) & ((1 << width) - 1)
        hist = comm.allreduce(torch.bincount(digit, minlength=1 << width).to(dtype), "sum").tolist()
        if i == 0 and sum(hist) <= k:
            return None
        # Walk down from the top bin until the k-th largest is inside bin b.
        b, remaining = (1 << width) - 1, k - above
        while hist[b] < remaining:
            remaining -= hist[b]
            b -= 1
        above, split = k - remaining, hist[b] > remaining
        prefix = (prefix << width) | b
        cand = cand[digit == b]
    return prefix, above, split


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
    2. ``radix``: the k-th largest key digit by digit (module docstring), then
       one allgather of every rank's count, or of its (above, equal) counts where
       ties at the k-th largest must be split.
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
            candidates_at_most, mag.element_size(), bits, comm.size, k)
        method = "gather" if cheaper else "radix"
    counts_pos, table, dtype = None, None, count_dtype(candidates_at_most)
    if method == "gather":
        counts_pos = _allgather_counts(comm, positive.sum(), candidates_at_most)
        # At most k positive entries in all: every one is selected, nothing to gather or rank.
        found, table = (None, None) if sum(counts_pos) <= k else _kth_key_gathered(mag, positive, k,
                                                                                    counts_pos, comm)
    else:
        found = _kth_key(keys, k, bits, comm, dtype)
    if found is None:
        if counts_pos is None:  # (found by the radix: at most k in all)
            counts_pos = _allgather_counts(comm, positive.sum(), k)
        return positive, counts_pos, None
    th_key, above_global, split = found if table is None else (*found, True)
    gt, eq = keys > th_key, keys == th_key
    th = float(torch.tensor([th_key], dtype=torch.int64 if bits == 64 else torch.int32)
               .view(torch.float64 if bits == 64 else torch.float32))
    if not split:  # every key at the threshold is selected: each rank's count is all the table needs
        mask = gt | eq
        counts = _allgather_counts(comm, mask.sum(), k)  # (k in all)
        return mask, counts, th
    if table is None:
        table = comm.allgather(torch.stack([gt.sum(), eq.sum()]).to(dtype)).to(torch.int64)
    need = k - above_global
    eq_before = torch.cumsum(table[:, 1], 0) - table[:, 1]
    take = torch.clamp(need - eq_before, min=0)
    take = torch.minimum(take, table[:, 1])
    mine = int(take[comm.rank])
    mask = gt | (eq & (torch.cumsum(eq, 0) <= mine))
    counts = (table[:, 0] + take).tolist()
    return mask, counts, th
