"""Communication stages shared by several algorithms.

* ``equal_boundaries``: P regions of (almost) equal size.
* ``carry_or_run``: the collective check, left for the first exchange of sizes to carry
  (``check.CarriedCheck``), or run first where something collective comes before it.
* ``peak_bits`` / ``peak_of``: a rank's largest magnitude as integer bits that
  travel with its counts, and the largest over ranks, which bounds a result.
* ``split_and_reduce``: the sparse reduce-scatter of Ok-Topk and TopkDSA. Each
  rank cuts its sorted selection by region, sends region j's part to rank j
  as a ``kernels.pack_message`` (indexes as 16-bit offsets within 65536-wide
  blocks where that is smaller) and sums what it receives for its own region.
  Every part travels in one ``Communicator.alltoallv``: in the destination
  rotation (step s: send to i+s, receive from i-s, no hot spots), ``window``
  steps in flight, on real engines; in one rendezvous in the simulated world.
"""

from __future__ import annotations

import struct
from typing import Callable, Sequence

import torch

from .. import kernels
from ..check import CarriedCheck
from ..comm.base import Communicator
from ..compress import Compressor, Encoded

__all__ = ["carry_or_run", "equal_boundaries", "equal_starts", "region_sizes", "split_and_reduce", "merges", "MERGE_MAX_P", "peak_bits", "peak_of"]

_TAG_SPLIT = 0x5C01
#: Up to this many ranks, a region's parts are merged (``kernels.sum_sorted_runs``, O(P k)
#: linear work) instead of scattered into a region-sized accumulator (O(k) random writes
#: into O(n / P) memory, then read and cleared): at P = 2, 25M, 1% ~6 ms a call less.
MERGE_MAX_P = 8


def merges(P: int, device: torch.device) -> bool:
    """Whether P ranks' sorted parts are summed by merging (``kernels.sum_sorted_runs``) rather
    than in a dense accumulator: few ranks, on CPU (the GPU paths keep their scatter kernels,
    and so does the audit of a GPU call, ``kernels.dispatch.gpu_path``)."""
    return P <= MERGE_MAX_P and kernels.dispatch.in_host_memory(torch.empty(0, device=device))


def equal_boundaries(n: int, P: int, device: torch.device) -> torch.Tensor:
    """Region starts [0, n/P, 2n/P, ..., n] (P+1 int64 values)."""
    return torch.tensor(equal_starts(n, P), dtype=torch.int64, device=device)


def equal_starts(n: int, P: int) -> list[int]:
    """:func:`equal_boundaries` on the host (nothing to read back)."""
    return [j * n // P for j in range(P + 1)]


def carry_or_run(check: CarriedCheck | None, codec: Compressor, carries: bool = True) -> CarriedCheck | None:
    """``check``, for the call's first exchange of sizes to carry; or None, having run it, when
    something collective comes first: a call that repartitions (``carries`` False), or values
    whose scale the ranks agree on."""
    if check is not None and (not carries or codec.needs_scale):
        check()
        return None
    return check


def peak_bits(mag: torch.Tensor) -> torch.Tensor:
    """The largest of the non-negative ``mag`` as its float32 bits in one int32 (0 when empty;
    -1, no bound, for other dtypes): bits whose order as integers is that of the floats."""
    if mag.dtype != torch.float32:
        return torch.full((1,), -1, dtype=torch.int32, device=mag.device)
    top = mag.max().reshape(1) if mag.numel() else mag.new_zeros(1)
    return top.view(torch.int32)


def peak_of(bits: Sequence[int], dtype: torch.dtype) -> float | None:
    """The largest magnitude on any rank, from every rank's :func:`peak_bits` (None: no bound)."""
    top = max(bits)
    if dtype != torch.float32 or top < 0:
        return None
    return struct.unpack("=f", struct.pack("=i", top))[0]


def region_sizes(starts: Sequence[int]) -> list[int]:
    """The P regions' sizes, from their P+1 starts (the last one is n): what both ends of a
    region's message know (``kernels.message`` sizes it from them)."""
    return [b - a for a, b in zip(starts[:-1], starts[1:])]


def split_and_reduce(local_idx: torch.Tensor, values: Encoded, starts: Sequence[int],
                     comm: Communicator, index_dtype: torch.dtype, work_dtype: torch.dtype,
                     window: int, region: Callable[[], torch.Tensor] | None = None, padded: bool = False,
                     check: CarriedCheck | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Sorted region-relative indexes touched by any rank, and their sums over ranks.

    ``padded``: the dense accumulator's result may hold an index more than once, each
    repeat with a zero sum (the union's size is data: on a GPU a read of the device). For
    callers that drop zero sums anyway, as Ok-Topk's global selection does.

    ``values`` holds the encoded values of ``local_idx`` (with a scale every rank shares).
    1. Cut the selection by region; every rank learns what each peer sends it (an
       alltoall of sizes, or the carried check's row).
    2. Pack every part (all at once in host memory), move them in one alltoallv.
    3. Decode the parts and add them into a dense accumulator of the region (or merge
       them, up to ``MERGE_MAX_P`` ranks) in step order: own part, then from rank - 1,
       rank - 2, ..., so the sum is the same whatever engine moved them. The touched
       indexes come from the parts, not from a scan of the whole region.
    ``region``: returns an all-zero accumulator of this rank's region (a
    state's scratch buffer), left all zero again; asked for only when the
    parts are not merged (more than ``MERGE_MAX_P`` ranks); None allocates one.
    ``check``: the collective input check, to carry in the exchange of sizes (every rank's
    P + 1 cuts travel in its row, in place of an alltoall of what each peer gets).
    """
    P, me = comm.size, comm.rank
    wire, codec, scale = values.wire, values.codec, values.scale
    if P == 1:  # one region, one contributor: nothing to add
        return local_idx, codec.decode(wire, scale, work_dtype)
    # One read gives the host this rank's cuts and what every peer sends it: the cuts' sizes
    # go out from the device (the control device, where that differs) and come back with them.
    cuts = kernels.split_by_boundaries(local_idx, kernels.dispatch.upload(starts, torch.int64, local_idx.device),
                                       on_device=True)
    if check is not None:
        rows = check(cuts)  # every rank's cuts: what each peer sends here is the width of its cut
        off, recv_counts = rows[me], [row[me + 1] - row[me] for row in rows]
    else:
        # A part holds at most the n entries every rank agrees on (the check ran): in 16 bits
        # where that fits, sent as bytes (NCCL has no 16-bit integers).
        sent = torch.cat([cuts, torch.diff(cuts)]).to(comm.control_device)
        width = torch.int16 if starts[-1] < 2**15 else torch.int32 if starts[-1] < 2**31 else torch.int64
        sizes = sent[P + 1:].to(width).reshape(P, 1).view(torch.uint8)
        received = comm.alltoall(sizes).view(width).flatten()
        off, recv_counts = _split(sent[:P + 1].tolist() + received.tolist(), P + 1)
    # A few parts (small worlds) are merged, summing in step order; more are added into a
    # dense accumulator of the region. The sums are the same bit for bit either way.
    merge = merges(P, wire.device)
    if not merge:
        region = region() if region is not None else torch.zeros(starts[me + 1] - starts[me], dtype=work_dtype,
                                                                   device=wire.device)
    span = region_sizes(starts)
    host = kernels.dispatch.in_host_memory(wire)
    # Every part in one exchange: on the host packed at once, on a device one kernel a part.
    if host:
        send, send_sizes = kernels.pack_messages(local_idx, wire, off, span, starts[:-1], index_dtype,
                                                 codec.wire_dtype, skip=me)
    else:
        msgs = [kernels.pack_message(local_idx[off[j]:off[j + 1]], wire[off[j]:off[j + 1]], span[j], index_dtype,
                                     codec.wire_dtype, base=starts[j]) if j != me and off[j + 1] > off[j] else None
                for j in range(P)]
        send_sizes = [0 if m is None else m.numel() for m in msgs]
        send = torch.cat([m for m in msgs if m is not None]) if any(send_sizes) else wire.new_empty(0, dtype=torch.uint8)
    counts_in = list(recv_counts)
    counts_in[me] = 0
    recv_sizes = kernels.messages_bytes(counts_in, [span[me]] * P, index_dtype, codec.wire_dtype)
    received = comm.alltoallv(send, send_sizes, recv_sizes, window)
    # Parts are added in step order (from rank - 1, rank - 2, ...), so the sums are the same
    # whatever engine moved them.
    at = [0]
    for size in recv_sizes:
        at.append(at[-1] + size)
    order = [(me - s) % P for s in range(1, P) if counts_in[(me - s) % P]]
    own_idx, own_wire = local_idx[off[me]:off[me + 1]] - starts[me], wire[off[me]:off[me + 1]]
    in_counts = [counts_in[j] for j in order]
    if host:
        got_idx, got_codes = kernels.unpack_messages(received, in_counts, [span[me]] * len(order), [0] * len(order),
                                                     index_dtype, codec.wire_dtype, starts=[at[j] for j in order])
        touched = torch.cat([own_idx, got_idx])
        decoded = codec.decode(torch.cat([own_wire, got_codes]), scale, work_dtype)
        if not merge:
            kernels.scatter_add(region, touched, decoded)  # in order: own part, then step order
    else:
        touched, decoded = [own_idx], [codec.decode(own_wire, scale, work_dtype)]
        if not merge:  # (each part's indexes are unique: cut from one rank's selection)
            kernels.scatter_add(region, own_idx, decoded.pop(), unique=True)
        for j in order:
            msg = received[at[j]:at[j + 1]]
            if not merge and codec.exact_for(work_dtype):  # values as they are: added while decoded
                idx, _ = kernels.unpack_message(msg, counts_in[j], span[me], index_dtype, codec.wire_dtype,
                                                add_into=region)
            else:
                idx, codes = kernels.unpack_message(msg, counts_in[j], span[me], index_dtype, codec.wire_dtype)
                if merge:
                    decoded.append(codec.decode(codes, scale, work_dtype))
                else:
                    kernels.scatter_add(region, idx, codec.decode(codes, scale, work_dtype), unique=True)
            touched.append(idx)
        touched = torch.cat(touched)
        decoded = torch.cat(decoded) if merge else None
    # Every part ascends (cut from a sorted selection): merge them rather than sort.
    runs = [0, own_idx.numel()]
    for count in in_counts:
        runs.append(runs[-1] + count)
    if merge:
        return kernels.sum_sorted_runs(touched, decoded, runs)
    if padded:  # every touched index, sorted; the sum at its first place, zeros at its repeats
        rel = torch.sort(touched).values
        first = torch.ones_like(rel, dtype=torch.bool)
        torch.ne(rel[1:], rel[:-1], out=first[1:])
        sums = torch.where(first, region.index_select(0, rel), torch.zeros((), dtype=region.dtype,
                                                                            device=region.device))
        region.index_fill_(0, rel, 0)  # all zero again for the next call
        return rel, sums
    rel = kernels.union_sorted_runs(touched, runs)
    sums = kernels.take_and_zero(region, rel)  # O(k): the buffer is all zero again for the next call
    return rel, sums


def _split(values: list[int], at: int) -> tuple[list[int], list[int]]:
    return values[:at], values[at:]
