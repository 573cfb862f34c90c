"""Compressors: how values travel on the wire (truncation and b-bit quantization).

A compressor turns float values into a *wire* tensor and back. Every
algorithm sends its values through one (by default a plain cast to the input
dtype), so compressors stack with every sparse allreduce and with the dense
one. Error feedback keeps the compression error: a rank's residual is
``acc - decode(encode(acc))`` at what it sent, and a rank that re-encodes sums
it reduced (a region owner, a tree node) keeps that re-encoding error in its
own residual, so that results plus residuals still add up to every gradient.

=============  ===========================  ============================
name           wire                         error bound per value
=============  ===========================  ============================
``fp16``       float16                      2^-11 relative (+ range)
``bf16``       bfloat16 (round to nearest)  2^-8 relative
``trunc16``    top 16 bits of float32       2^-7 relative (truncation)
``fp8``        float8 e4m3, scale = max|v|  2^-4 relative above scale/2^15
``q8/q4/q2``   int8 codes, scale = max|v|   scale / (2^(b-1) - 1) / 2
=============  ===========================  ============================

Quantization (Pipe-SGD's scalar quantization): v -> round(v / s * L) with
L = 2^(b-1) - 1 levels each side and s the largest |v| (agreed by all ranks
with one small allreduce, so every rank decodes every code the same way),
optionally with stochastic rounding (unbiased). In sparse messages a code
takes one byte whatever b is (next to a 2- or 4-byte index, ``kernels.message``,
the index dominates); dense payloads pack codes tightly (b bits each).

The protocol an algorithm uses, whatever the compressor:

1. ``encode_shared(comm, values)``: one scale for every rank (collective;
   a no-op for casts), for values that are summed after decoding;
   ``encode_own(values)``: a scale of this message alone, sent with it (trees,
   where no moment exists at which all ranks could agree).
2. The :class:`Encoded` result's ``wire`` travels (in COO records, or as a
   dense ``pack``-ed payload); ``decoded(dtype)`` is what receivers will see.
3. Receivers ``decode(wire, scale, dtype)`` (or ``unpack`` a dense payload).

Stochastic rounding draws its noise from a stream per (seed, rank, step,
message): ``for_call(rank, step)`` binds a compressor to one call, so ranks
and steps never share noise, and a run is reproducible from its seed, across
a checkpoint too (the step is the state's iteration).
"""

from __future__ import annotations

import copy
import functools
import hashlib
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from . import kernels
from .comm.base import Communicator

__all__ = ["Compressor", "Cast", "Truncate16", "MaxScaled", "Quantize", "Float8", "Divided", "Encoded",
           "get_compressor", "COMPRESSORS", "register_compressor", "pack_bits", "unpack_bits"]


@dataclass
class Encoded:
    """Values as they travel: the wire tensor, its scale, and the compressor that made them."""

    wire: torch.Tensor
    scale: float
    codec: "Compressor"

    def decoded(self, dtype: torch.dtype) -> torch.Tensor:
        """What the receivers will see, in ``dtype``."""
        return self.codec.decode(self.wire, self.scale, dtype)


class Compressor:
    """Base: a cast to ``wire_dtype`` (no scale)."""

    name = "cast"
    needs_scale = False

    def __init__(self, wire_dtype: torch.dtype) -> None:
        self.wire_dtype = wire_dtype

    @property
    def value_bits(self) -> int:
        """Bits a value takes in a dense payload."""
        return torch.empty(0, dtype=self.wire_dtype).element_size() * 8

    @property
    def sums_on_wire(self) -> bool:
        """Whether the wire holds the values themselves, so a backend's own
        allreduce may sum them (no compression)."""
        return False

    def for_call(self, rank: int, step: int) -> "Compressor":
        """This compressor bound to one call of one rank (only stochastic rounding cares)."""
        return self

    def exact_for(self, dtype: torch.dtype) -> bool:
        """Whether values of ``dtype`` come back bit for bit (a cast to their own dtype):
        re-encoding errors are then zero and need not be kept."""
        return self.wire_dtype == dtype

    # ---- scales ------------------------------------------------------------------
    def agree_scales(self, comm: Communicator, parts: Sequence[torch.Tensor],
                     local: Sequence[float] | None = None) -> list[float]:
        """One scale per part, the same on every rank (collective when scales are needed).

        ``local``: each part's :meth:`own_scale`, when the caller knows them already
        (``DenseState.chunk_maxima``), which saves a pass over the parts.
        """
        return [1.0] * len(parts)

    def own_scale(self, values: torch.Tensor) -> float:
        """The scale of a message from these values alone."""
        return 1.0

    def decoded_bound(self, scale: float) -> float | None:
        """No value decoded from a payload encoded with ``scale`` exceeds this in magnitude
        (up to one rounding); None when the scale does not bound them (casts)."""
        return None

    # ---- the protocol ------------------------------------------------------------
    def encode_shared(self, comm: Communicator, values: torch.Tensor) -> Encoded:
        """Encode with the scale every rank agrees on for this step (see the module docstring)."""
        (scale,) = self.agree_scales(comm, [values])
        return Encoded(self.encode(values, scale), scale, self)

    def encode_own(self, values: torch.Tensor) -> Encoded:
        """Encode with a scale of these values alone (it must travel with them)."""
        scale = self.own_scale(values)
        return Encoded(self.encode(values, scale), scale, self)

    def encode(self, values: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        return values.to(self.wire_dtype)

    def decode(self, wire: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
        return wire.to(dtype)

    def roundtrip(self, values: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        """What the receiver will see of ``values``, in their dtype."""
        return self.decode(self.encode(values, scale), scale, values.dtype)

    # ---- dense payloads ----------------------------------------------------------
    def pack(self, values: torch.Tensor, scale: float, keep_error: bool = False) -> torch.Tensor:
        """A dense payload (uint8) of ``values``: ``value_bits`` per value.

        ``keep_error``: ``values`` (contiguous, written in place) become
        ``values - unpack(payload)``, what the receivers will not see: the
        error feedback of a dense sender without decoding what it sent.
        """
        payload = self._payload(values, scale)
        if keep_error:
            values.sub_(self.unpack(payload, values.numel(), scale, values.dtype))
        return payload

    def _payload(self, values: torch.Tensor, scale: float) -> torch.Tensor:
        """The bytes :meth:`pack` sends."""
        return self.encode(values, scale).contiguous().view(torch.uint8)

    def unpack(self, payload: torch.Tensor, count: int, scale: float, dtype: torch.dtype,
               out: torch.Tensor | None = None, accumulate: bool = False) -> torch.Tensor:
        """The ``count`` values of a :meth:`pack`-ed payload, decoded to ``dtype`` (into ``out``,
        or added to ``out`` with ``accumulate``)."""
        # clone: a slice of a gathered byte buffer may be misaligned for the wire dtype
        values = self.decode(payload.clone().view(self.wire_dtype), scale, dtype)
        if accumulate:
            return out.add_(values)
        return values if out is None else out.copy_(values)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name})"


class Cast(Compressor):
    """Values travel as ``dtype`` (fp16, bf16, or the input's own dtype)."""

    def __init__(self, dtype: torch.dtype, name: str | None = None) -> None:
        super().__init__(dtype)
        self.name = name or str(dtype).replace("torch.", "")

    @property
    def sums_on_wire(self) -> bool:
        return self.name == "none"  # the input's own dtype: nothing compressed


class Truncate16(Compressor):
    """float32 with its 16 low mantissa bits dropped (Pipe-SGD truncation): the top 16 bits.

    The same layout as bfloat16, but truncated toward zero rather than
    rounded: what dropping mantissa bits in a ring allreduce costs nothing to do.
    """

    name = "trunc16"

    def __init__(self) -> None:
        super().__init__(torch.int16)

    def encode(self, values: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        bits = values.to(torch.float32).contiguous().view(torch.int32)
        return (bits >> 16).to(torch.int16)

    def decode(self, wire: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
        return (wire.to(torch.int32) << 16).view(torch.float32).to(dtype)


def _stream_seed(*parts: int) -> int:
    """A 63-bit seed mixing ``parts`` (stable across processes and Python versions)."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


class MaxScaled(Compressor):
    """Base of the compressors whose scale is the largest |v| (agreed over ranks when shared)."""

    needs_scale = True

    def agree_scales(self, comm: Communicator, parts: Sequence[torch.Tensor],
                     local: Sequence[float] | None = None) -> list[float]:
        mine = torch.tensor(list(local) if local is not None else [self.own_scale(p) for p in parts],
                            dtype=torch.float64, device=comm.control_device)
        if comm.size > 1:
            mine = comm.allreduce(mine, "max")
        return mine.tolist()

    def own_scale(self, values: torch.Tensor) -> float:
        if not values.numel():
            return 0.0
        # max |v| from min and max: one pass and no |v| temporary of the message's size.
        lo, hi = torch.aminmax(values.reshape(-1))
        return float(torch.maximum(hi, -lo))

    def decoded_bound(self, scale: float) -> float | None:
        return scale  # values are clamped to the scale's range before they are encoded


class Quantize(MaxScaled):
    """b-bit scalar quantization with a shared scale (max |v| over ranks).

    Args:
        bits: 2, 4 or 8.
        stochastic: round up with probability equal to the fraction (unbiased)
            instead of to nearest.
        seed: of the rounding noise; the noise of message m of rank r at step
            t comes from the stream (seed, r, t, m).
    """

    def __init__(self, bits: int, stochastic: bool = False, seed: int = 0) -> None:
        if bits not in (2, 4, 8):
            raise ValueError(f"quantization bits must be 2, 4 or 8, got {bits!r}")
        super().__init__(torch.int8)
        self.bits, self.stochastic, self.seed = bits, stochastic, int(seed)
        self.levels = 2 ** (bits - 1) - 1
        self.name = f"q{bits}" + ("s" if stochastic else "")
        self._stream = (self.seed, 0, 0)
        self._messages = 0

    @property
    def value_bits(self) -> int:
        return self.bits

    def for_call(self, rank: int, step: int) -> "Quantize":
        if not self.stochastic:
            return self
        bound = copy.copy(self)
        bound._stream, bound._messages = (self.seed, int(rank), int(step)), 0
        return bound

    def _noise(self, shape: torch.Size, device: torch.device) -> torch.Tensor:
        gen = torch.Generator().manual_seed(_stream_seed(*self._stream, self._messages))
        self._messages += 1
        return torch.rand(shape, generator=gen).to(device)

    def encode(self, values: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        if scale <= 0 or values.numel() == 0:
            return torch.zeros(values.shape, dtype=torch.int8, device=values.device)
        x = values.to(torch.float32) * (self.levels / scale)
        x = torch.floor(x + self._noise(x.shape, x.device)) if self.stochastic else torch.round(x)
        return x.clamp_(-self.levels, self.levels).to(torch.int8)

    def decode(self, wire: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
        return (wire.to(torch.float32) * (scale / self.levels)).to(dtype)

    def pack(self, values: torch.Tensor, scale: float, keep_error: bool = False) -> torch.Tensor:
        """Codes packed to b bits: in one fused pass when rounding to nearest (which keeps
        the error in the same pass for float32 values)."""
        if not self.stochastic and (not keep_error or values.dtype == torch.float32):
            return kernels.encode_codes(values, self.bits, scale, keep_error=keep_error)
        return super().pack(values, scale, keep_error)

    def _payload(self, values: torch.Tensor, scale: float) -> torch.Tensor:
        if self.stochastic:
            return pack_bits(self.encode(values, scale), self.bits)
        return kernels.encode_codes(values, self.bits, scale)

    def unpack(self, payload: torch.Tensor, count: int, scale: float, dtype: torch.dtype,
               out: torch.Tensor | None = None, accumulate: bool = False) -> torch.Tensor:
        return kernels.decode_codes(payload, self.bits, count, scale, dtype, out=out, accumulate=accumulate)


class Float8(MaxScaled):
    """float8 (e4m3) with a shared scale: v -> fp8(v * 448 / s), s = max |v| over ranks.

    Unlike b-bit codes, whose levels are evenly spaced (at 8 bits a value 200 times below
    the largest is coded 1, and one 300 times below 0), a float keeps 2^-4 relative
    precision from the scale down to scale / 2^15 and codes values down to scale / 10^5:
    heavy-tailed values (top-k selections, DCT components) keep their small entries. One
    byte a value in COO records and in dense payloads; rounding to nearest.
    """

    name = "fp8"
    #: The largest finite float8 e4m3 value: the scale maps to it.
    LARGEST = 448.0

    def __init__(self) -> None:
        super().__init__(torch.float8_e4m3fn)

    def encode(self, values: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        if scale <= 0 or values.numel() == 0:
            return torch.zeros(values.shape, dtype=self.wire_dtype, device=values.device)
        x = values.to(torch.float32) * (self.LARGEST / scale)
        return x.clamp_(-self.LARGEST, self.LARGEST).to(self.wire_dtype)

    def decode(self, wire: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
        return (wire.to(torch.float32) * (scale / self.LARGEST)).to(dtype)


class Divided(Compressor):
    """``inner`` applied to values divided by ``divisor``; decoding multiplies back.

    Used for ``op="avg"`` when values travel as float16: a sum whose average
    fits float16 would overflow on the wire if sums travelled undivided
    (PyTorch's fp16 hook divides by the world size first for the same reason).
    Decoded values are in the original units, so algorithms and error
    feedback see no difference but the rounding.
    """

    def __init__(self, inner: Compressor, divisor: int) -> None:
        super().__init__(inner.wire_dtype)
        self.inner, self.divisor = inner, divisor
        self.name, self.needs_scale = inner.name, inner.needs_scale

    @property
    def value_bits(self) -> int:
        return self.inner.value_bits

    @property
    def sums_on_wire(self) -> bool:
        return self.inner.sums_on_wire  # a sum of divided values is the divided sum

    def exact_for(self, dtype: torch.dtype) -> bool:
        return False  # (v / P) * P need not be v

    def for_call(self, rank: int, step: int) -> "Divided":
        inner = self.inner.for_call(rank, step)
        return self if inner is self.inner else Divided(inner, self.divisor)

    def agree_scales(self, comm: Communicator, parts: Sequence[torch.Tensor],
                     local: Sequence[float] | None = None) -> list[float]:
        return self.inner.agree_scales(comm, parts, local)

    def own_scale(self, values: torch.Tensor) -> float:
        return self.inner.own_scale(values)

    def decoded_bound(self, scale: float) -> float | None:
        inner = self.inner.decoded_bound(scale)
        return None if inner is None else inner * self.divisor

    def encode(self, values: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        return self.inner.encode(values / self.divisor, scale)

    def decode(self, wire: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
        work = torch.promote_types(dtype, torch.float32)
        return (self.inner.decode(wire, scale, work) * self.divisor).to(dtype)

    def __repr__(self) -> str:
        return f"Divided({self.inner!r}, {self.divisor})"


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack int8 codes in [-(2^(b-1)-1), 2^(b-1)-1] into bytes, 8/b codes per byte.

    8 bits: the codes' bytes. 2 and 4 bits: code + 2^(b-1), the first code in
    the low bits (``kernels.payload.pack_unsigned``).
    """
    if bits == 8:
        return codes.view(torch.uint8)
    return kernels.pack_unsigned((codes.to(torch.int16) + (1 << (bits - 1))).to(torch.uint8), bits)


def unpack_bits(packed: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits` for ``count`` codes."""
    if bits == 8:
        return packed.view(torch.int8)[:count]
    u = kernels.unpack_unsigned(packed, bits, count)
    return (u.to(torch.int16) - (1 << (bits - 1))).to(torch.int8)


#: Compressor names users may pass as ``compressor=``, in registration order.
COMPRESSORS: list[str] = []
_FACTORIES: dict[str, Callable[[], Compressor]] = {}


def register_compressor(name: str, factory: Callable[[], Compressor]) -> None:
    """Make ``compressor=name`` build ``factory()`` (the commands and tests list it too)."""
    if name in _FACTORIES or name == "none":
        raise ValueError(f"compressor {name!r} is already registered")
    _FACTORIES[name] = factory
    COMPRESSORS.append(name)


register_compressor("fp16", functools.partial(Cast, torch.float16, "fp16"))
register_compressor("bf16", functools.partial(Cast, torch.bfloat16, "bf16"))
register_compressor("trunc16", Truncate16)
register_compressor("fp8", Float8)
for _stochastic in (False, True):
    for _bits in (8, 4, 2):
        register_compressor(f"q{_bits}{'s' if _stochastic else ''}",
                            functools.partial(Quantize, _bits, stochastic=_stochastic))


def get_compressor(spec: "str | Compressor | None", dtype: torch.dtype, divisor: int = 1) -> Compressor:
    """A compressor from a registered name (:data:`COMPRESSORS`), an instance, or None.

    None means no compression: values travel in the input's ``dtype`` and the
    dense allreduce uses the backend's own (a Cast named "none"). With
    ``divisor`` > 1 (``op="avg"``), a float16 cast is wrapped in
    :class:`Divided` so that averages that fit float16 never overflow on the wire.
    """
    codec = _named_compressor(spec, dtype)
    if divisor > 1 and codec.wire_dtype == torch.float16 and not codec.needs_scale:
        return Divided(codec, divisor)
    return codec


def _named_compressor(spec: "str | Compressor | None", dtype: torch.dtype) -> Compressor:
    if spec is None:
        return Cast(dtype, "none")
    if isinstance(spec, Compressor):
        return spec
    factory = _FACTORIES.get(spec) if isinstance(spec, str) else None
    if factory is None:
        raise ValueError(f"unknown compressor {spec!r}; known: {COMPRESSORS}")
    return factory()
