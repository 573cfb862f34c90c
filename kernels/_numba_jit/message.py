"""Sparse messages with 16-bit offsets within 65536-wide blocks: pack and unpack."""

from __future__ import annotations

from numba import njit


__all__ = ["pack_blocked", "unpack_blocked"]


@njit(nogil=True, cache=True)
def pack_blocked(idx, bits, offsets, values, header, shift):
    """A blocked message (``kernels.message``): header[b] = entries in block b, offsets[t] =
    idx[t] mod 2**shift (a truncating store), values[t] = bits[t]. False, with nothing
    promised about the outputs, when ``idx`` descends or leaves the header's blocks."""
    header[:] = 0
    nb = header.size
    prev = 0
    for t in range(idx.size):
        i = idx[t]
        b = i >> shift
        if i < prev or b >= nb:
            return False
        header[b] += 1
        offsets[t] = i
        values[t] = bits[t]
        prev = i
    return True


@njit(nogil=True, cache=True)
def unpack_blocked(header, offsets, values, base, shift, idx, out):
    """Inverse of :func:`pack_blocked`: idx[t] = base + (block << shift) + offset, out[t] =
    values[t]. False when the header does not count ``idx.size`` entries."""
    mask = (1 << shift) - 1
    t, n = 0, idx.size
    for b in range(header.size):
        c = header[b]
        if c < 0 or t + c > n:
            return False
        start = base + (b << shift)
        for _ in range(c):
            idx[t] = start + (offsets[t] & mask)
            out[t] = values[t]
            t += 1
    return t == n
