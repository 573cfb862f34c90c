"""Payload compression helpers for compressors: value casts, b-bit quantisation, delta indexes.

``encode_codes``/``decode_codes`` quantise with a given scale and pack the
codes to b bits in one pass; they serve the compressed dense allreduce
(``q8``/``q4``/``q2`` on the whole gradient), so they have numba, Triton and
CuPy paths behind a dispatcher. The other helpers run on O(k) selected
entries and stay torch only (any device): they are never the bottleneck.
"""

from __future__ import annotations

import numpy as np
import torch

from . import dispatch

__all__ = ["cast_values", "quantize", "dequantize", "delta_encode", "delta_decode",
           "encode_codes", "decode_codes", "encode_codes_torch", "decode_codes_torch",
           "encode_buffers", "decode_buffers", "decode_factor",
           "pack_unsigned", "unpack_unsigned", "QUANT_BITS"]

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
    return pack_unsigned(codes, bits), scales


def dequantize(packed: torch.Tensor, scales: torch.Tensor, bits: int, n: int,
               chunk: int = 1024, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of :func:`quantize`: ``n`` values of ``dtype``."""
    if bits not in QUANT_BITS:
        raise ValueError(f"dequantize: bits must be one of {QUANT_BITS}, got {bits}")
    levels = 2 ** (bits - 1) - 1
    codes = unpack_unsigned(packed, bits, n).float() - levels
    scale = scales.repeat_interleave(chunk)[:n]
    return (codes / levels * scale).to(dtype)


def pack_unsigned(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Unsigned ``bits``-bit codes (uint8) packed 8/bits per byte, the first in the low bits."""
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


def unpack_unsigned(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Inverse of :func:`pack_unsigned`: ``n`` uint8 codes."""
    per = 8 // bits
    if per == 1:
        return packed[:n]
    mask = (1 << bits) - 1
    parts = [(packed >> (bits * j)) & mask for j in range(per)]
    return torch.stack(parts, dim=1).reshape(-1)[:n]


# ---- quantise with a given scale and pack, in one pass (the dense compressors' wire format) ----

def _factor(bits: int, scale: float) -> tuple[int, float]:
    levels = 2 ** (bits - 1) - 1
    return levels, (levels / scale if scale > 0 else 0.0)


def encode_codes_torch(values: torch.Tensor, bits: int, scale: float, keep_error: bool = False) -> torch.Tensor:
    """Reference of :func:`encode_codes`, as a chain of torch ops (``compress.Quantize``'s
    encode followed by ``compress.pack_bits``; with ``keep_error``, then the decode subtracted)."""
    levels, f = _factor(bits, scale)
    flat = values.reshape(-1)
    q = torch.round(flat.to(torch.float32) * f).clamp_(-levels, levels).to(torch.int8)
    if keep_error:
        flat.sub_(q.to(torch.float32) * (scale / levels))  # decode_codes_torch's decode
    if bits == 8:
        return q.view(torch.uint8)
    return pack_unsigned((q.to(torch.int16) + (1 << (bits - 1))).to(torch.uint8), bits)


def decode_codes_torch(packed: torch.Tensor, bits: int, count: int, scale: float,
                       dtype: torch.dtype, out: torch.Tensor | None = None, accumulate: bool = False
                       ) -> torch.Tensor:
    """Reference of :func:`decode_codes`."""
    if bits == 8:
        q = packed[:count].view(torch.int8)
    else:
        q = (unpack_unsigned(packed, bits, count).to(torch.int16) - (1 << (bits - 1))).to(torch.int8)
    levels = 2 ** (bits - 1) - 1
    values = (q.to(torch.float32) * (scale / levels)).to(dtype)
    if accumulate:
        return out.add_(values)
    return values if out is None else out.copy_(values)


def encode_codes(values: torch.Tensor, bits: int, scale: float, backend: str | None = None, *,
                 keep_error: bool = False) -> torch.Tensor:
    """Quantise ``values`` to signed ``bits``-bit codes with ``scale`` and pack them, in one pass.

    1. q = round_half_even(float32(v) * float32(L / scale)), clamped to
       [-L, L] with L = 2**(bits-1) - 1 (q = 0 for every entry when scale <= 0).
    2. 8 bits: the int8 code's byte. 2 and 4 bits: q + 2**(bits-1), packed
       8/bits per byte, the first code in the low bits, the last byte padded
       with zero bits.
    3. With ``keep_error``: v <- v - q * float32(scale / L) in place, the
       quantisation error (what :func:`decode_codes` will not give back), in
       the same pass. Error feedback then needs no decode of what was sent.

    Args:
        values: float tensor (any shape; read flat); with ``keep_error``
            contiguous float32, written in place.
        bits: 2, 4 or 8.
        scale: the magnitude mapped to L (max |v| agreed by the ranks).
        backend: ``torch``/``cpu``/``triton``/``cupy``/``auto`` (``kernels.dispatch``).
        keep_error: leave the quantisation error in ``values``.

    Returns:
        ``ceil(n * bits / 8)`` uint8 bytes, bitwise equal on every path.
    """
    if bits not in QUANT_BITS:
        raise ValueError(f"encode_codes: bits must be one of {QUANT_BITS}, got {bits}")
    if keep_error and (values.dtype != torch.float32 or not values.is_contiguous()):
        raise ValueError(f"encode_codes: keep_error writes the error in place, so values must be contiguous "
                         f"float32, got {values.dtype}{'' if values.is_contiguous() else ' (not contiguous)'}")
    return _ENCODE_CODES(values.reshape(-1), bits, scale, keep_error, backend=backend)


def decode_codes(packed: torch.Tensor, bits: int, count: int, scale: float, dtype: torch.dtype,
                 backend: str | None = None, *, out: torch.Tensor | None = None,
                 accumulate: bool = False) -> torch.Tensor:
    """Inverse of :func:`encode_codes`: ``count`` values q * (scale / L) in ``dtype``.

    Written into ``out`` (contiguous, ``count`` values of ``dtype``) when given:
    a large decode then touches no fresh memory (a new 100 MB tensor costs more
    in page faults than the decode). With ``accumulate`` they are added to
    ``out`` instead (out += decoded, one rounding per value, as decoding
    first and adding after): a reduction sums what it receives in one pass.
    The fast paths cover float32 output; others go through the reference.
    """
    if bits not in QUANT_BITS:
        raise ValueError(f"decode_codes: bits must be one of {QUANT_BITS}, got {bits}")
    if accumulate and out is None:
        raise ValueError("decode_codes: accumulate adds the values to out, so out must be given")
    if packed.numel() * 8 < count * bits:
        raise ValueError(f"decode_codes: {packed.numel()} bytes cannot hold {count} {bits}-bit codes")
    if out is not None and (out.numel() != count or out.dtype != dtype or not out.is_contiguous()
                            or out.device != packed.device):
        raise ValueError(f"decode_codes: out must be {count} contiguous {dtype} values on {packed.device}")
    return _DECODE_CODES(packed, bits, count, scale, dtype, out, accumulate, backend=backend)


def encode_buffers(flat: torch.Tensor, bits: int, scale: float
                   ) -> tuple[torch.Tensor, np.float32, torch.Tensor]:
    """What the encode kernels take: float32 values, the float32 factor L / scale, and the output bytes."""
    if flat.dtype != torch.float32:
        flat = flat.float()  # the reference's first step
    out = torch.empty(-(-flat.numel() * bits // 8), dtype=torch.uint8, device=flat.device)
    return flat, np.float32(_factor(bits, scale)[1]), out


def decode_factor(bits: int, scale: float) -> np.float32:
    """The float32 factor scale / L that decoding multiplies codes by."""
    return np.float32(scale / (2 ** (bits - 1) - 1))


def decode_buffers(packed: torch.Tensor, bits: int, count: int, scale: float, out: torch.Tensor | None = None
                   ) -> tuple[np.float32, torch.Tensor]:
    """What the decode kernels take: the float32 factor scale / L and the float32 output (``out``
    or a new tensor)."""
    g = decode_factor(bits, scale)
    return g, torch.empty(count, dtype=torch.float32, device=packed.device) if out is None else out


def _nonempty(values: torch.Tensor, bits: int, scale: float, keep_error: bool = False) -> bool:
    return values.numel() > 0


def _float32_out(packed: torch.Tensor, bits: int, count: int, scale: float, dtype: torch.dtype,
                 out: torch.Tensor | None = None, accumulate: bool = False) -> bool:
    return count > 0 and dtype == torch.float32


# The fast paths have no empty launch, and decode only to float32.
_ENCODE_CODES = dispatch.KernelOp(
    "encode_codes", encode_codes_torch, cpu="numba_backend:encode_codes",
    triton="triton_backend:encode_codes", cupy="cupy_backend:encode_codes",
    accepts={("cpu", "triton", "cupy"): _nonempty})
_DECODE_CODES = dispatch.KernelOp(
    "decode_codes", decode_codes_torch, cpu="numba_backend:decode_codes",
    triton="triton_backend:decode_codes", cupy="cupy_backend:decode_codes",
    accepts={("cpu", "triton", "cupy"): _float32_out})


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
