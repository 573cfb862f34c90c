"""Sparse messages (``kernels.message``): one message's blocked layout, and every message of an
exchange at once, each byte written in place (no index per byte, no Python per message)."""

from __future__ import annotations

import numpy as np
from numba import njit


__all__ = ["pack_blocked", "unpack_blocked", "pack_messages", "unpack_messages"]


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


@njit(nogil=True, cache=True, inline="always")
def _put(out, at, value, nbytes):
    """Store the low ``nbytes`` bytes of ``value`` at ``out[at:]``, little-endian."""
    for b in range(nbytes):
        out[at + b] = (value >> (8 * b)) & 0xFF


@njit(nogil=True, cache=True, inline="always")
def _get(buf, at, nbytes):
    """The ``nbytes``-byte little-endian integer at ``buf[at:]``, sign-extended to 64 bits."""
    v = np.int64(0)
    for b in range(nbytes):
        v |= np.int64(buf[at + b]) << (8 * b)
    if nbytes < 8:
        shift = 64 - 8 * nbytes
        v = (v << shift) >> shift
    return v


@njit(nogil=True, cache=True)
def pack_messages(idx, bits, firsts, counts, bases, spans, blocked, at, head, ib, vb, shift, out):
    """Every part's message into ``out`` (``kernels.message``'s layouts): part m is
    ``idx[firsts[m]:firsts[m] + counts[m]]`` (minus ``bases[m]``, in ``[0, spans[m])``) with
    the values' bit patterns ``bits``, written from byte ``at[m]``; a blocked part's header
    (``head[m]`` bytes, an int32 count a block) first, then its records of 2-byte offsets.
    Records are ``ib`` bytes of index and ``vb`` of value. False, with nothing promised about
    ``out``, when a part's indexes descend or leave its span."""
    for m in range(counts.size):
        c, f, base, span, pos = counts[m], firsts[m], bases[m], spans[m], at[m]
        if c == 0:
            continue
        prev = 0
        if blocked[m]:
            for w in range(head[m]):
                out[pos + w] = 0
            rec = pos + head[m]
            block, run = -1, 0
            for t in range(c):
                i = idx[f + t] - base
                if i < prev or i >= span:
                    return False
                b = i >> shift
                if b != block:
                    if block >= 0:
                        _put(out, pos + 4 * block, run, 4)
                    block, run = b, 0
                run += 1
                _put(out, rec, i, 2)
                _put(out, rec + 2, bits[f + t], vb)
                rec += 2 + vb
                prev = i
            _put(out, pos + 4 * block, run, 4)
        else:
            rec = pos
            for t in range(c):
                i = idx[f + t] - base
                if i < prev or i >= span:
                    return False
                _put(out, rec, i, ib)
                _put(out, rec + ib, bits[f + t], vb)
                rec += ib + vb
                prev = i
    return True


@njit(nogil=True, cache=True)
def unpack_messages(buf, counts, bases, blocked, at, head, ib, vb, shift, put, idx, bits):
    """Inverse of :func:`pack_messages`: message m (from byte ``at[m]``) decoded into
    ``idx[put[m]:put[m] + counts[m]]`` (plus ``bases[m]``) and the values' bit patterns into
    ``bits``. False when a header does not count its message's entries."""
    mask = (1 << shift) - 1
    for m in range(counts.size):
        c, pos, o, base = counts[m], at[m], put[m], bases[m]
        if c == 0:
            continue
        if blocked[m]:
            rec, t = pos + head[m], 0
            for w in range(head[m] // 4):
                n = _get(buf, pos + 4 * w, 4)
                if n < 0 or t + n > c:
                    return False
                start = base + (w << shift)
                for _ in range(n):
                    idx[o + t] = start + (_get(buf, rec, 2) & mask)
                    bits[o + t] = _get(buf, rec + 2, vb)
                    rec += 2 + vb
                    t += 1
            if t != c:
                return False
        else:
            rec = pos
            for t in range(c):
                idx[o + t] = base + _get(buf, rec, ib)
                bits[o + t] = _get(buf, rec + ib, vb)
                rec += ib + vb
    return True
