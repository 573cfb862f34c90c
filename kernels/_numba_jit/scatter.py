"""Scattered writes with prefetch: put and add at indexes, in input order."""

from __future__ import annotations

from numba import njit

from ._base import PREFETCH_AHEAD, _prefetch_for_write

__all__ = ["put_at", "add_at"]


@njit(nogil=True, cache=True, inline="always")
def _scatter_at(out, idx, values, add):
    m = idx.size
    for t in range(m):
        if t + PREFETCH_AHEAD < m:
            _prefetch_for_write(out, idx[t + PREFETCH_AHEAD])
        i = idx[t]
        out[i] = out[i] + values[t] if add else values[t]


@njit(nogil=True, cache=True)
def put_at(out, idx, values):
    """out[idx[t]] = values[t] for t in order."""
    _scatter_at(out, idx, values, False)


@njit(nogil=True, cache=True)
def add_at(out, idx, values):
    """out[idx[t]] += values[t] for t in order (duplicates summed in input order)."""
    _scatter_at(out, idx, values, True)
