"""Dense: the plain allreduce of all n values (the reference for results and time).

With a compressor other than a plain cast, the allreduce is done by hand as
Rabenseifner does it, so that values can travel compressed (Pipe-SGD style):
a reduce-scatter in which rank j receives chunk j of every rank encoded,
decodes and sums it, then an allgather of every owner's re-encoded sum.
Volume: 2 n (P-1)/P values of the compressed size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..comm.base import Communicator, Request
from ..compress import Compressor
from ..network import Traffic
from ..registry import register, tree_levels
from ..result import PhaseRecorder, SparseResult
from ..state import CallStats, Compensated, Preselection, State
from .exchange import equal_boundaries

__all__ = ["DenseState", "dense", "dense_reduce", "dense_gather"]

_TAG_RS = 0x5C21


class DenseState(State):
    """State of the dense allreduce: error feedback of the compression error only.

    ``density`` is accepted for a uniform interface and ignored (k = n).

    With error feedback on CPU the accumulation is one fused pass
    (``kernels.ef_accumulate``, as for every state): residual += gradient where
    finite, and the input's finite check. Once a call has asked for chunk
    scales (a quantiser) it also keeps the max |acc| of every ``MAXIMA_BLOCK``
    entries, from which the chunk scales are read (:meth:`chunk_maxima`)
    instead of a pass over acc per call; without a quantiser they would cost
    more than they save (1.8 adds against 1.2).
    """

    #: Entries per block maximum: the scale of a chunk reads the maxima of its whole blocks
    #: and at most 2 * MAXIMA_BLOCK entries at its edges.
    MAXIMA_BLOCK = 4096

    def __init__(self, density: float = 1.0, error_feedback: bool = False) -> None:
        super().__init__(density, error_feedback)

    def compensate(self, flat: torch.Tensor, zero_out: torch.Tensor | None = None) -> Compensated:
        if not self.error_feedback:  # a dense result overwrites all of out: nothing to zero
            return super().compensate(flat)
        self.n = flat.numel()
        # Block maxima only on CPU: a GPU (with or without Triton) computes its chunk scales
        # by a pass over each chunk, which there is not worth a change of path.
        wanted = self.__dict__.get("_scales_wanted", False) and flat.device.type == "cpu"
        return self._accumulate(flat, self.residual_on(flat), self.MAXIMA_BLOCK if wanted else None)

    def chunk_maxima(self, acc: torch.Tensor, starts: list[int]) -> list[float] | None:
        """max |acc| over each chunk ``[starts[j], starts[j + 1])``, from this call's block maxima
        (None when this call's accumulation kept none): exactly what a pass over each chunk gives."""
        self._scales_wanted = True  # from the next call on, the accumulation keeps the maxima
        kept = self.__dict__.get("_maxima")
        if kept is None or kept[0] != self.iteration:
            return None
        maxima, B = kept[1], self.MAXIMA_BLOCK
        out = []
        for lo, hi in zip(starts[:-1], starts[1:]):
            first, last = -(-lo // B), hi // B  # the whole blocks inside: [first, last)
            parts = [maxima[first:last].max()] if first < last else []
            edges = ((lo, first * B), (last * B, hi)) if first < last else ((lo, hi),)
            parts += [acc[a:b].abs().max() for a, b in edges if b > a]
            out.append(float(torch.stack(parts).max()) if parts else 0.0)  # one host read per chunk
        return out


@dataclass
class _Half:
    """A dense call after its reduce-scatter (``done``: the whole result already, when nothing splits)."""

    acc: torch.Tensor
    state: DenseState
    codec: Compressor
    stats: CallStats
    done: SparseResult | None = None
    chunk: torch.Tensor | None = None  # this rank's reduced chunk (uncompressed split)
    sent: torch.Tensor | None = None
    mine: torch.Tensor | None = None  # compressed: this owner's summed chunk, decoded
    starts: list[int] | None = None
    settled: bool = False  # compressed: the errors of what was sent are already in acc


def dense_reduce(acc: torch.Tensor, k: int, comm: Communicator, state: DenseState,
                 codec: Compressor, preselected: Preselection | None = None, *, limit: float = math.inf) -> _Half:
    """The reduce-scatter half of :func:`dense` (world size 1, or a cast that is not the
    identity on a backend's own sums: the whole call)."""
    n, P = acc.numel(), comm.size
    if P > 1 and not codec.sums_on_wire:
        return _reduce_scatter(acc, comm, codec, CallStats(algorithm="dense", n=n, k=n, local_selected=n,
                                                           global_selected=n), state, limit)
    sent = codec.roundtrip(acc) if P > 1 else None
    if P == 1 or sent is not acc:
        return _Half(acc, state, codec, CallStats(algorithm="dense"), done=dense(acc, k, comm, state, codec))
    stats = CallStats(algorithm="dense", n=n, k=n, local_selected=n, global_selected=n)
    with PhaseRecorder(comm, stats).phase("reduce_scatter"):
        padded = state.workspace("padded", -(-n // P) * P, acc.dtype, acc.device)
        padded[:n].copy_(acc)
        padded[n:].zero_()
        chunk = comm.reduce_scatter(padded, out=state.workspace("chunk", padded.numel() // P, acc.dtype, acc.device))
    return _Half(acc, state, codec, stats, chunk=chunk, sent=acc)


def dense_gather(h: _Half, comm: Communicator) -> SparseResult:
    """The all-gather half of :func:`dense`."""
    if h.done is not None:
        return h.done
    acc, n, stats = h.acc, h.acc.numel(), h.stats
    if h.chunk is not None:
        with PhaseRecorder(comm, stats).phase("allgather"):
            # Straight into a buffer the state keeps (the padding is dropped by a view).
            total = comm.allgather_dense(h.chunk, out=h.state.workspace("gathered", h.chunk.numel() * comm.size,
                                                                   acc.dtype, acc.device))[:n]
        return SparseResult(n=n, indexes=None, values=total, contributed=None, sent=h.sent, stats=stats)
    return _allgather(h, comm)


def dense_volume(n: int, k: int, P: int) -> tuple[float, float]:
    """Words received per rank: 2n(P-1)/P.

    A reduce-scatter and an all-gather of n values."""
    f = (P - 1) / P
    return 2 * n * f, 2 * n * f


def dense_traffic(n: int, k: int, P: int, value_bytes: float, ranks_per_node: int = 1, grid: bool = False) -> Traffic:
    """Reduce-scatter and allgather by recursive halving and doubling (the simulated world's and
    MPI's for powers of two): 2 ceil(log2 P) messages, 2 (P - 1) / P of the tensor."""
    return Traffic(2.0 * tree_levels(P), 2.0 * (P - 1) / P * n * value_bytes)


@register("dense", DenseState, split=(dense_reduce, dense_gather), volume=dense_volume, traffic=dense_traffic)
def dense(acc: torch.Tensor, k: int, comm: Communicator, state: DenseState,
          codec: Compressor, preselected: Preselection | None = None, *, limit: float = math.inf) -> SparseResult:
    """Dense: the backend's allreduce (with a compressor, a compressed reduce-scatter and
    allgather).

    1. No compressor: the backend's own allreduce (ring, Rabenseifner) in the
       input's dtype, accounted as 2n(P-1)/P values per rank.
    2. With a compressor (fp16/bf16 casts included, so that sums are taken in
       float32 and the rounding stays in the residual), by hand: per-chunk scales agreed with one allreduce of P
       maxima; chunk j of every rank goes to rank j encoded (rotated sends);
       rank j decodes and sums, re-encodes its chunk and keeps that encoding's
       error; one allgatherv of the encoded chunks gives every rank the result.

    The registered halves (:func:`dense_reduce`, :func:`dense_gather`) that
    DeAR runs apart are a reduce-scatter and an all-gather, also without a
    compressor.
    """
    n = acc.numel()
    stats = CallStats(algorithm="dense", n=n, k=n, local_selected=n, global_selected=n)
    rec = PhaseRecorder(comm, stats)
    if codec.sums_on_wire or comm.size == 1:
        with rec.phase("allreduce"):
            # An identity cast: ``sent`` is ``acc`` itself (the residual update then zeroes
            # it in place), and the sum goes into a buffer the state keeps, so a steady-state
            # call allocates nothing of size n (two fresh 100 MB tensors per call at 25M
            # cost more in page faults than the allreduce on a 10 Gbit/s link).
            # A quantiser's own scale: the default 1.0 would clip every |value| above 1.
            sent = codec.roundtrip(acc, codec.own_scale(acc) if codec.needs_scale else 1.0)
            if comm.size == 1:
                total = state.workspace("sum", n, acc.dtype, acc.device).copy_(acc) if sent is acc else sent
            elif sent is acc:
                total = comm.allreduce(acc, "sum", out=state.workspace("sum", n, acc.dtype, acc.device))
            else:
                total = codec.decode(comm.allreduce(codec.encode(acc), "sum"), 1.0, acc.dtype)
        return SparseResult(n=n, indexes=None, values=total, contributed=None, sent=sent, stats=stats)
    return dense_gather(_reduce_scatter(acc, comm, codec, stats, state, limit), comm)


# Headroom of a bound on decoded values: decoding rounds a value up by at most a float32
# ulp of the scale, and a sum of P of them adds P more roundings (relative 2^-24 each).
_BOUND_MARGIN = 1.01


def _decoded_bound(codec: Compressor, scales: list[float]) -> float | None:
    """The largest |value| a payload encoded with any of ``scales`` decodes to, with headroom;
    None when the codec has no such bound or a scale is not finite (Python's ``max`` would
    skip a NaN that is not first, and an infinite scale decodes to NaN)."""
    if not all(math.isfinite(s) for s in scales):
        return None
    bound = codec.decoded_bound(max(scales, default=0.0))
    return None if bound is None else bound * _BOUND_MARGIN


def _reduce_scatter(acc: torch.Tensor, comm: Communicator, codec: Compressor, stats: CallStats,
                    state: DenseState, limit: float) -> _Half:
    """With a compressor: rank j receives chunk j of every rank encoded, and sums it.

    With error feedback, each chunk is encoded keeping its error in ``acc``
    (the residual) in the same pass, so the update has nothing left to
    subtract and nothing of size n is decoded for it (``SparseResult.settled``),
    when the scales bound the result below ``limit``: such a call
    cannot be refused for overflow, the one case that must put acc back whole.
    Otherwise (no error feedback, a cast, whose scale bounds nothing, a scale
    that is not finite, or a bound above the limit) what was sent is decoded
    into ``sent`` and acc is left as it was.
    """
    P, me, n = comm.size, comm.rank, acc.numel()
    starts = equal_boundaries(n, P, acc.device).tolist()
    chunk = [acc[starts[j]:starts[j + 1]] for j in range(P)]
    own = slice(starts[me], starts[me + 1])

    def ws(name: str, numel: int, dtype: torch.dtype = acc.dtype) -> torch.Tensor:
        # Buffers the state keeps: a steady-state call decodes into memory it already has
        # (each fresh n-sized tensor costs more in page faults than its decode).
        return state.workspace(name, numel, dtype, acc.device)

    with PhaseRecorder(comm, stats).phase("reduce_scatter"):
        scales = codec.agree_scales(comm, chunk, state.chunk_maxima(acc, starts) if codec.needs_scale else None)
        # Every decoded value is within its chunk's scale, so a sum of P within P times it;
        # the scales are agreed, so every rank decides the same.
        bound = _decoded_bound(codec, scales)
        settle = state.error_feedback and bound is not None and P * bound < limit
        payloads: list[torch.Tensor | None] = [None] * P
        payloads[me] = codec.pack(chunk[me], scales[me], keep_error=settle)
        width = payloads[me].numel()  # every rank's encoding of chunk ``me`` has this size
        inbox = ws("inbox", width * (P - 1), torch.uint8)
        sends: list[Request] = []
        recvs = []
        # Each peer's chunk is encoded and sent before anything else, so that decoding
        # this rank's own share overlaps the wire.
        for s in range(1, P):
            dst, src = (me + s) % P, (me - s) % P
            buf = inbox[(s - 1) * width:s * width]
            recvs.append((comm.irecv(buf, src, _TAG_RS), buf))
            payloads[dst] = codec.pack(chunk[dst], scales[dst], keep_error=settle)
            sends.append(comm.isend(payloads[dst], dst, _TAG_RS))
        sent = None
        if not settle:
            sent = ws("sent", n)
            for j in range(P):
                codec.unpack(payloads[j], chunk[j].numel(), scales[j], acc.dtype, out=sent[starts[j]:starts[j + 1]])
        # The sum in rank order from this rank on: its own share, then each received one
        # decoded straight into it.
        mine = codec.unpack(payloads[me], own.stop - own.start, scales[me], acc.dtype,
                            out=ws("mine", own.stop - own.start))
        for req, buf in recvs:
            req.wait()
            codec.unpack(buf, mine.numel(), scales[me], acc.dtype, out=mine, accumulate=True)
        for req in sends:
            req.wait()
    return _Half(acc, state, codec, stats, sent=sent, mine=mine, starts=starts, settled=settle)


def _allgather(h: _Half, comm: Communicator) -> SparseResult:
    """With a compressor: every owner re-encodes its sum (keeping the error in place); one allgatherv."""
    P, me, n = comm.size, comm.rank, h.acc.numel()
    acc, codec, mine, starts, stats = h.acc, h.codec, h.mine, h.starts, h.stats
    rec = PhaseRecorder(comm, stats)
    with rec.phase("allgather"):
        scale = codec.own_scale(mine)
        owner_payload = codec.pack(mine, scale, keep_error=True)  # mine: this owner's re-encoding error
        header = torch.tensor([scale], dtype=torch.float64).view(torch.uint8).to(owner_payload.device)
        message = torch.cat([header, owner_payload])
        sizes = comm.allgather(torch.tensor([message.numel()], dtype=torch.int64,
                                            device=comm.control_device)).flatten().tolist()
        gathered = comm.allgatherv(message, sizes)
    with rec.phase("decode"):
        total, pos, owner_scales = h.state.workspace("total", n, acc.dtype, acc.device), 0, []
        for j in range(P):
            msg = gathered[pos:pos + sizes[j]]
            pos += sizes[j]
            s = float(msg[:8].clone().view(torch.float64))
            owner_scales.append(s)
            codec.unpack(msg[8:], starts[j + 1] - starts[j], s, acc.dtype, out=total[starts[j]:starts[j + 1]])
    # Decoded values lie within their owner's scale: the overflow check needs no pass over them.
    bound = _decoded_bound(codec, owner_scales)
    return SparseResult(n=n, indexes=None, values=total, contributed=None, sent=h.sent, stats=stats,
                        kept_at=starts[me], kept_val=mine, settled=h.settled, bound=bound)
