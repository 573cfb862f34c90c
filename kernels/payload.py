"""Payload compression helpers for compressors: value casts, b-bit quantisation, delta indexes.

Torch only (any device): these run on O(k) selected entries, not on the
whole gradient, so they are never the bottleneck.
"""

from __future__ import annotations

import torch

__all__ = ["cast_values", "quantize", "dequantize", "delta_encode", "delta_decode",
           "QUANT_BITS"]

QUANT_BITS = (2, 4, 8)
_DELTA_DTYPES = ((255, torch.uint8), (65535, torch.uint16), (2**32 - 1, torch.uint32))


def cast_values(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``values`` in a 16-bit wire dtype (``torch.float16`` or ``torch.bfloat16``).

    float16 overflows above 65504: values are clamped to its range first so a
    large entry becomes the largest finite half instead of inf.
    """
    if dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"cast_values: dtype must be float16 or bfloat16, got {dtype}")
    if dtype == torch.float16:
        lim = torch.finfo(torch.float16).max
        return values.clamp(-lim, lim).to(dtype)
    return values.to(dtype)


def quantize(values: torch.Tensor, bits: int, chunk: int = 1024, stochastic: bool = False,
             generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric b-bit quantisation with one scale (max |v|) per chunk of entries.

    1. Per chunk of ``chunk`` entries, scale = max |v| (float32).
    2. q = v / scale * L with L = 2**(bits-1) - 1 levels per sign, rounded
       to nearest, or stochastically (floor(q + U[0,1))): unbiased, so error
       feedback and averaging over ranks do not drift.
    3. Codes are stored offset by L as unsigned integers, packed 8/bits per
       byte (little end first).

    Args:
        values: 1-D float tensor.
        bits: 2, 4 or 8.
        chunk: entries per scale.
        stochastic: stochastic rounding.
        generator: RNG for stochastic rounding.

    Returns:
        ``(packed uint8 codes, float32 scales)``; :func:`dequantize` inverts.
    """
    if bits not in QUANT_BITS:
        raise ValueError(f"quantize: bits must be one of {QUANT_BITS}, got {bits}")
    n = values.numel()
    levels = 2 ** (bits - 1) - 1
    nchunks = -(-n // chunk)
    v = torch.zeros(nchunks * chunk, dtype=torch.float32, device=values.device)
    v[:n] = values.reshape(-1).float()
    v = v.view(nchunks, chunk)
    scales = v.abs().amax(dim=1)
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = v / safe[:, None] * levels
    if stochastic:
        noise = torch.rand(q.shape, generator=generator, device=q.device)
        q = torch.floor(q + noise)
    else:
        q = torch.round(q)
    codes = (q.clamp(-levels, levels) + levels).to(torch.uint8).reshape(-1)[:n]
    return _pack(codes, bits), scales


def dequantize(packed: torch.Tensor, scales: torch.Tensor, bits: int, n: int,
               chunk: int = 1024, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of :func:`quantize`: ``n`` values of ``dtype``."""
    if bits not in QUANT_BITS:
        raise ValueError(f"dequantize: bits must be one of {QUANT_BITS}, got {bits}")
    levels = 2 ** (bits - 1) - 1
    codes = _unpack(packed, bits, n).float() - levels
    scale = scales.repeat_interleave(chunk)[:n]
    return (codes / levels * scale).to(dtype)


def _pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    per = 8 // bits
    if per == 1:
        return codes
    n = codes.numel()
    padded = torch.zeros(-(-n // per) * per, dtype=torch.uint8, device=codes.device)
    padded[:n] = codes
    padded = padded.view(-1, per)
    out = torch.zeros(padded.shape[0], dtype=torch.uint8, device=codes.device)
    for j in range(per):
        out |= padded[:, j] << (bits * j)
    return out


def _unpack(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    per = 8 // bits
    if per == 1:
        return packed[:n]
    mask = (1 << bits) - 1
    parts = [(packed >> (bits * j)) & mask for j in range(per)]
    return torch.stack(parts, dim=1).reshape(-1)[:n]


def delta_encode(indexes: torch.Tensor) -> tuple[int, torch.Tensor]:
    """Sorted int64 indexes as (first index, narrow deltas).

    1. deltas = diff(indexes) (non-negative because sorted).
    2. Their dtype is the narrowest of uint8/uint16/uint32 holding the
       largest delta (int64 if even uint32 does not).

    Returns:
        ``(first, deltas)``; an empty input gives ``(-1, empty uint8)``.
    """
    if indexes.numel() == 0:
        return -1, torch.empty(0, dtype=torch.uint8, device=indexes.device)
    idx = indexes.reshape(-1).to(torch.int64)
    d = torch.diff(idx)
    if d.numel() and int(d.min()) < 0:
        raise ValueError("delta_encode: indexes must be sorted ascending")
    big = int(d.max()) if d.numel() else 0
    for limit, dt in _DELTA_DTYPES:
        if big <= limit:
            return int(idx[0]), d.to(dt)
    return int(idx[0]), d


def delta_decode(first: int, deltas: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`delta_encode`: sorted int64 indexes (none when ``first < 0``)."""
    if first < 0:
        return torch.empty(0, dtype=torch.int64, device=deltas.device)
    out = torch.empty(deltas.numel() + 1, dtype=torch.int64, device=deltas.device)
    out[0] = first
    out[1:] = first + torch.cumsum(deltas.to(torch.int64), 0)
    return out
