"""COO helpers: split by regions, pack into byte records, scatter-add into dense.

A COO *record* is one (index, value) entry laid out as bytes: the index (int32
when it fits, else int64, relative to a known base) followed by the value in
the payload dtype. Records are fixed-size, so a packed buffer can be cut at
any entry boundary and re-sent (as Ok-Topk's data balancing does) without
re-encoding.
"""

from __future__ import annotations

import torch

__all__ = ["split_by_boundaries", "index_dtype_for", "record_bytes", "pack_records",
           "unpack_records", "scatter_add", "isin_sorted", "unique_indexes"]


def split_by_boundaries(idx: torch.Tensor, bounds: torch.Tensor) -> list[int]:
    """Offsets cutting sorted ``idx`` into regions ``[bounds[j], bounds[j+1])``.

    ``bounds`` has P+1 non-decreasing entries starting at 0 and ending at n.
    Returns P+1 offsets: region j's entries are ``idx[off[j]:off[j+1]]``.
    """
    off = torch.searchsorted(idx, bounds.to(idx.dtype))
    return off.tolist()


def index_dtype_for(span: int) -> torch.dtype:
    """The narrowest index dtype able to hold offsets in ``[0, span)``."""
    return torch.int32 if span <= 2**31 - 1 else torch.int64


def record_bytes(index_dtype: torch.dtype, value_dtype: torch.dtype) -> int:
    """Bytes of one record."""
    return torch.empty(0, dtype=index_dtype).element_size() + torch.empty(0, dtype=value_dtype).element_size()


def pack_records(rel_idx: torch.Tensor, values: torch.Tensor, index_dtype: torch.dtype,
                 value_dtype: torch.dtype) -> torch.Tensor:
    """A (count, record_bytes) uint8 tensor of (index, value) records."""
    count = rel_idx.numel()
    ib = torch.empty(0, dtype=index_dtype).element_size()
    out = torch.empty((count, record_bytes(index_dtype, value_dtype)), dtype=torch.uint8,
                      device=values.device)
    out[:, :ib] = rel_idx.to(index_dtype).reshape(count, 1).view(torch.uint8)
    out[:, ib:] = values.to(value_dtype).reshape(count, 1).view(torch.uint8)
    return out


def unpack_records(records: torch.Tensor, index_dtype: torch.dtype,
                   value_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`pack_records`: (int64 relative indexes, values)."""
    ib = torch.empty(0, dtype=index_dtype).element_size()
    if records.shape[0] == 0:  # an empty slice keeps its record stride, which view() rejects
        return (torch.empty(0, dtype=torch.int64, device=records.device),
                torch.empty(0, dtype=value_dtype, device=records.device))
    idx = records[:, :ib].contiguous().view(index_dtype).reshape(-1).to(torch.int64)
    val = records[:, ib:].contiguous().view(value_dtype).reshape(-1)
    return idx, val


def scatter_add(out: torch.Tensor, idx: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``out[idx] += values`` with duplicate indexes summed; returns ``out``."""
    return out.index_add_(0, idx, values.to(out.dtype))


def isin_sorted(values: torch.Tensor, sorted_set: torch.Tensor) -> torch.Tensor:
    """``torch.isin(values, sorted_set)`` for an ascending ``sorted_set``, by binary search.

    O(m log k) and no sort: ``torch.isin`` took 1.2 s for Ok-Topk's contributed
    set at n = 25M (250k values in 250k), this takes milliseconds.
    """
    if sorted_set.numel() == 0:
        return torch.zeros(values.shape, dtype=torch.bool, device=values.device)
    pos = torch.searchsorted(sorted_set, values).clamp_(max=sorted_set.numel() - 1)
    return sorted_set[pos] == values


def unique_indexes(idx: torch.Tensor, n: int) -> torch.Tensor:
    """``torch.unique(idx)`` (ascending) for indexes in ``[0, n)``.

    When ``idx`` is long next to ``n`` (TopkA at large P gathers P*k records)
    marking a dense mask is O(n + m) and 9x faster than unique's sort
    (1.3M indexes into 1M: 20 ms against 174 ms); for short lists the sort wins.
    """
    m = idx.numel()
    if m * max(1, m.bit_length()) < 4 * n:
        return torch.unique(idx)
    mask = torch.zeros(n, dtype=torch.bool, device=idx.device)
    mask[idx] = True
    return mask.nonzero().flatten()
