"""Sparse messages: ascending (index, value) entries of a known span, as bytes.

A message carries ``count`` entries whose indexes ascend in ``[0, span)``,
where both ends know ``span`` (a region, a whole tensor) and ``count`` (from
a counts exchange). Its layout follows from those two numbers alone, so it
needs no flag on the wire:

* **plain**: ``count`` records (``coo.pack_records``), each index in
  ``index_dtype``;
* **blocked**: a header of one int32 per 65536-wide block of the span (the
  number of entries in that block), then ``count`` records whose index is its
  offset within its block, 2 bytes. With fp32 values a record shrinks from 8
  bytes (int32 index) to 6, a quarter fewer bytes on the wire.

A message is blocked when the header costs less than the index bytes it
saves: with int32 indexes, when the span holds more than one entry per 32768
positions, i.e. at any density a sparse allreduce is run at but the lowest.
Decoding is a prefix expansion of the header (each entry's block from its
rank among the entries), no search and no per-entry branch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from ..segments import positions, starts_of
from . import dispatch
from .coo import _LITTLE, _PACK_RECORDS, _UNPACK_RECORDS, record_bytes, unpack_records

__all__ = ["INDEX_BLOCK", "index_blocks", "blocked", "message_bytes", "messages_bytes", "MessagesLayout",
           "pack_message", "pack_messages", "pack_messages_torch", "unpack_message", "unpack_messages",
           "unpack_messages_torch", "pack_blocked_torch", "unpack_blocked_torch", "pack_blocked_cupy",
           "unpack_blocked_cupy", "header_words"]

#: Width of the blocks a blocked message counts its entries in; an index travels as its
#: offset within its block, which fits 16 bits.
INDEX_BLOCK = 1 << 16
_OFFSET_DTYPE = torch.int16
_HEADER_DTYPE = torch.int32


def index_blocks(span: int) -> int:
    """Blocks of ``INDEX_BLOCK`` positions covering ``[0, span)``."""
    return -(-span // INDEX_BLOCK)


def blocked(count: int, span: int, index_dtype: torch.dtype) -> bool:
    """Whether a message of ``count`` entries in ``[0, span)`` is blocked: its header
    (4 bytes a block) is smaller than what 2-byte offsets save over ``index_dtype``."""
    return bool(_blocks_pay(np.array([count]), np.array([span]), index_dtype)[0])


def _blocks_pay(counts: np.ndarray, spans: np.ndarray, index_dtype: torch.dtype) -> np.ndarray:
    """:func:`blocked` of many messages: the one rule every size and layout follows."""
    saved = index_dtype.itemsize - _OFFSET_DTYPE.itemsize
    return (counts > 0) & (_HEADER_DTYPE.itemsize * (-(-spans // INDEX_BLOCK)) < saved * counts)


def message_bytes(count: int, span: int, index_dtype: torch.dtype, value_dtype: torch.dtype) -> int:
    """Size in bytes of a message of ``count`` entries in ``[0, span)``."""
    if blocked(count, span, index_dtype):
        return _HEADER_DTYPE.itemsize * index_blocks(span) + count * record_bytes(_OFFSET_DTYPE, value_dtype)
    return count * record_bytes(index_dtype, value_dtype)


def _layout(counts: Sequence[int], spans: Sequence[int], index_dtype: torch.dtype,
            value_dtype: torch.dtype) -> tuple[np.ndarray, ...]:
    """Per message, as arrays: counts, whether blocked, header bytes, record bytes, total bytes."""
    c = np.asarray(counts, dtype=np.int64).reshape(-1)
    spans_a = np.asarray(spans, dtype=np.int64).reshape(-1)
    blocks = -(-spans_a // INDEX_BLOCK)
    is_blocked = _blocks_pay(c, spans_a, index_dtype)
    head = np.where(is_blocked, _HEADER_DTYPE.itemsize * blocks, 0)
    rec = np.where(is_blocked, _OFFSET_DTYPE.itemsize, index_dtype.itemsize) + value_dtype.itemsize
    return c, is_blocked, head, rec, head + c * rec


def messages_bytes(counts: Sequence[int], spans: Sequence[int], index_dtype: torch.dtype,
                   value_dtype: torch.dtype) -> list[int]:
    """:func:`message_bytes` of many messages at once (no Python work per message)."""
    return _layout(counts, spans, index_dtype, value_dtype)[-1].tolist()


@dataclass(frozen=True)
class MessagesLayout:
    """Where every message of an exchange lies, from the counts alone (numpy int64 arrays, one
    entry a message): what both the packer and the decoder know before any byte moves.

    ``counts`` entries, ``blocked`` or plain, ``head`` header bytes, ``rec`` bytes a record,
    ``size`` bytes in all, starting at byte ``at``; the packer's part begins at entry
    ``firsts`` of its selection, the decoder's at ``put`` of its output; ``bases`` is what an
    index is relative to, ``spans`` how wide its range is.
    """

    counts: np.ndarray
    blocked: np.ndarray
    head: np.ndarray
    rec: np.ndarray
    size: np.ndarray
    at: np.ndarray
    firsts: np.ndarray
    put: np.ndarray
    bases: np.ndarray
    spans: np.ndarray

    @staticmethod
    def of(counts: Sequence[int], spans: Sequence[int], bases: Sequence[int], index_dtype: torch.dtype,
           value_dtype: torch.dtype, starts: Sequence[int] | None = None,
           firsts: Sequence[int] | None = None) -> "MessagesLayout":
        """The layout of messages of ``counts`` entries; ``starts``: their first bytes (None: end to
        end); ``firsts``: where each part begins in the packer's selection (None: end to end)."""
        c, is_blocked, head, rec, size = _layout(counts, spans, index_dtype, value_dtype)
        at = starts_of(size) if starts is None else np.asarray(starts, dtype=np.int64).reshape(-1)
        put = starts_of(c)
        first = put if firsts is None else np.asarray(firsts, dtype=np.int64).reshape(-1)
        return MessagesLayout(c, is_blocked, head, rec, size, at, first, put,
                              np.asarray(bases, dtype=np.int64).reshape(-1),
                              np.asarray(spans, dtype=np.int64).reshape(-1))


def pack_messages(idx: torch.Tensor, values: torch.Tensor, cuts: Sequence[int], spans: Sequence[int],
                  bases: Sequence[int], index_dtype: torch.dtype, value_dtype: torch.dtype,
                  skip: int | None = None, backend: str | None = None) -> tuple[torch.Tensor, list[int]]:
    """Messages of every part ``idx[cuts[j]:cuts[j+1]]`` at once, end to end: what
    :func:`pack_message` makes of each part (span ``spans[j]``, base ``bases[j]``), in one
    buffer, with their sizes. Part ``skip`` is left out (size 0).

    1. The layout (blocked or plain, header and record bytes, first byte) of every message,
       from the counts alone (:class:`MessagesLayout`).
    2. The bytes, by the path ``backend`` chooses (``kernels.dispatch``): ``cpu`` writes every
       header and record in place in one compiled pass; ``torch`` (the reference, and any
       device) packs each layout's records at once and scatters them to their bytes.
    """
    counts = np.diff(np.asarray(cuts, dtype=np.int64))
    if skip is not None:
        counts[skip] = 0
    layout = MessagesLayout.of(counts, spans, bases, index_dtype, value_dtype, firsts=cuts[:-1])
    out = torch.empty(int(layout.size.sum()), dtype=torch.uint8, device=values.device)
    if out.numel():
        _PACK_MESSAGES(idx, values, value_dtype, index_dtype, layout, out, backend=backend)
    return out, layout.size.tolist()


def pack_messages_torch(idx: torch.Tensor, values: torch.Tensor, value_dtype: torch.dtype, index_dtype: torch.dtype,
                        layout: MessagesLayout, out: torch.Tensor) -> None:
    """Reference of :func:`pack_messages`'s bytes: the records of each layout packed in one call
    (``coo.pack_records``), the headers counted in one ``bincount`` of (message, block), both
    scattered to their bytes (an index a byte: the reference, not a fast path)."""
    L = layout
    for group, idt, in_blocks in ((~L.blocked & (L.counts > 0), index_dtype, False), (L.blocked, _OFFSET_DTYPE, True)):
        sel = np.flatnonzero(group)
        if not sel.size:
            continue
        gc = L.counts[sel]
        take = positions(L.firsts[sel], gc, device=values.device)  # entries of these messages, in order
        rel = idx[take] - positions(L.bases[sel], gc, step=0, device=values.device)
        if dispatch.checks_values(rel) and rel.numel() and (int(rel.min()) < 0 or bool(
                (rel >= positions(L.spans[sel], gc, step=0, device=values.device)).any())):
            raise ValueError("pack_messages: an index lies outside its part's span")
        r = int(L.rec[sel[0]])
        rows = torch.empty((rel.numel(), r), dtype=torch.uint8, device=values.device)
        if in_blocks:
            nwords = L.head[sel] // _HEADER_DTYPE.itemsize  # (a word a block)
            first_word = positions(starts_of(nwords), gc, step=0, device=values.device)
            words = torch.bincount(first_word + rel // INDEX_BLOCK, minlength=int(nwords.sum()))
            hb = positions(L.at[sel], L.head[sel], device=values.device)
            out[hb] = words.to(_HEADER_DTYPE).view(torch.uint8)
            rel = rel.bitwise_and(INDEX_BLOCK - 1)
        _PACK_RECORDS.run("torch", rel, values[take], idt, value_dtype, rows)
        dest = positions(L.at[sel] + L.head[sel], gc * r, device=values.device)
        out[dest] = rows.reshape(-1)


def pack_message(rel_idx: torch.Tensor, values: torch.Tensor, span: int, index_dtype: torch.dtype,
                 value_dtype: torch.dtype, backend: str | None = None, *, base: int = 0) -> torch.Tensor:
    """A message (1-D uint8, ``message_bytes`` long) of ascending ``rel_idx - base`` in ``[0, span)``.

    1. Plain: the records, as ``coo.pack_records``.
    2. Blocked: the header counts the entries in each block, and the records
       carry ``rel_idx mod INDEX_BLOCK`` in 16 bits (:func:`pack_blocked_torch`;
       the ``cpu`` path and Triton do both in one pass, CuPy writes the records
       with its record kernel).

    Args:
        rel_idx: ascending int64 indexes in ``[0, span)`` (the callers cut them
            from sorted selections). Off GPUs, indexes that descend or leave
            the span raise ValueError; on a GPU they are not checked (a sync)
            and decode to other indexes.
        values: one value per index, written as ``value_dtype``.
        span, index_dtype: what both ends know; ``index_dtype`` holds ``span - 1``.
        backend: the kernels' path (``kernels.dispatch``).
        base: subtracted from every index first (a region's start: on Triton inside the
            kernel, not as an operation of its own).
    Returns:
        The message's bytes.
    """
    count = rel_idx.numel()
    if values.numel() != count:
        raise ValueError(f"pack_message: {count} indexes but {values.numel()} values")
    out = torch.empty(message_bytes(count, span, index_dtype, value_dtype), dtype=torch.uint8,
                      device=values.device)
    if not count:
        return out
    if dispatch.checks_values(rel_idx) and int(rel_idx.reshape(-1)[-1]) - base >= span:  # paths check the rest
        raise ValueError(f"pack_message: index {int(rel_idx.reshape(-1)[-1]) - base} is outside the span of {span}")
    if not blocked(count, span, index_dtype):
        _PACK_RECORDS(rel_idx - base if base else rel_idx, values, index_dtype, value_dtype, out.view(count, -1),
                      backend=backend)
        return out
    head = _HEADER_DTYPE.itemsize * index_blocks(span)
    _PACK_BLOCKED(rel_idx, values, value_dtype, out[:head].view(_HEADER_DTYPE), out[head:].view(count, -1),
                  int(base), backend=backend)
    return out


def pack_blocked_torch(rel_idx: torch.Tensor, values: torch.Tensor, value_dtype: torch.dtype,
                       header: torch.Tensor, rows: torch.Tensor, base: int = 0) -> None:
    """Reference of a blocked message's two parts: ``header`` (int32, the entries in each
    block: one ``searchsorted`` of the block ends) and ``rows`` (count x record bytes), of
    the indexes ``rel_idx - base``.

    Off GPUs (where the check would cost a sync) indexes that descend or
    leave the header's blocks are refused: ValueError.
    """
    _pack_blocked(rel_idx - base if base else rel_idx, values, value_dtype, header, rows, "torch")


def _pack_blocked(rel_idx: torch.Tensor, values: torch.Tensor, value_dtype: torch.dtype,
                  header: torch.Tensor, rows: torch.Tensor, records: str) -> None:
    """The header by ``searchsorted``, the 2-byte records by ``pack_records``'s ``records`` path."""
    idx = rel_idx.to(torch.int64)
    if dispatch.checks_values(idx) and idx.numel() and (
            int(idx[0]) < 0 or int(idx[-1]) >= header.numel() * INDEX_BLOCK or bool((idx[1:] < idx[:-1]).any())):
        raise ValueError(f"pack_message: the {idx.numel()} indexes do not ascend within the span's "
                         f"{header.numel()} blocks")
    ends = torch.arange(1, header.numel() + 1, dtype=torch.int64, device=idx.device).mul_(INDEX_BLOCK)
    below = torch.searchsorted(idx, ends)
    header.copy_(torch.diff(below, prepend=below.new_zeros(1)))
    # run(): the caller's table already chose this path (and the tests drive Triton's interpreter).
    _PACK_RECORDS.run(records, torch.bitwise_and(idx, INDEX_BLOCK - 1), values, _OFFSET_DTYPE, value_dtype, rows)


def pack_blocked_cupy(rel_idx: torch.Tensor, values: torch.Tensor, value_dtype: torch.dtype,
                      header: torch.Tensor, rows: torch.Tensor, base: int = 0) -> None:
    """cupy path: the reference's header, the records by the CuPy record kernel (one launch)."""
    _pack_blocked(rel_idx - base if base else rel_idx, values, value_dtype, header, rows, "cupy")


def unpack_message(msg: torch.Tensor, count: int, span: int, index_dtype: torch.dtype,
                   value_dtype: torch.dtype, backend: str | None = None, *,
                   add_into: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`pack_message`: (int64 indexes, values) of a 1-D uint8 message.

    ``add_into``: a tensor of ``value_dtype`` (float32 or float64) to which the values are
    also added at their indexes, which must then be unique (a part of one rank's selection:
    each entry is one addition, as ``index_add_`` makes it); on Triton in the decoding kernel.
    """
    if add_into is not None and (add_into.dtype != value_dtype or value_dtype not in (torch.float32, torch.float64)):
        raise ValueError(f"unpack_message: add_into must be float32/float64 like the values, got {add_into.dtype}")
    idx = torch.empty(count, dtype=torch.int64, device=msg.device)
    vals = torch.empty(count, dtype=value_dtype, device=msg.device)
    _unpack_into(msg, count, span, 0, index_dtype, value_dtype, idx, vals, backend, add_into)
    return idx, vals


def unpack_messages(buf: torch.Tensor, counts: Sequence[int], spans: Sequence[int], bases: Sequence[int],
                    index_dtype: torch.dtype, value_dtype: torch.dtype, backend: str | None = None, *,
                    starts: Sequence[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Messages in ``buf`` (an allgatherv's, an alltoallv's), decoded and concatenated.

    Message j has ``counts[j]`` entries in ``[0, spans[j])``; ``bases[j]`` is
    added to its indexes. Returns (int64 indexes, values) in message order.
    ``starts``: where each message begins in ``buf`` (None: end to end, filling it).

    In host memory all messages are decoded at once, by the path ``backend`` chooses: ``cpu``
    in one compiled pass over the bytes, ``torch`` (the reference) the records of each layout
    in one ``coo.unpack_records`` call and the blocks expanded from every header in one
    ``repeat_interleave``. Elsewhere each message is decoded by its kernel.
    """
    layout = MessagesLayout.of(counts, spans, bases, index_dtype, value_dtype, starts=starts)
    c, size, at = layout.counts, layout.size, layout.at
    if starts is None:
        if int(size.sum()) != buf.numel():
            raise ValueError(f"unpack_messages: {buf.numel()} bytes, the messages take {int(size.sum())}")
    elif at.size and int((at + size).max()) > buf.numel():
        raise ValueError(f"unpack_messages: {buf.numel()} bytes, the messages reach {int((at + size).max())}")
    total = int(c.sum())
    idx = torch.empty(total, dtype=torch.int64, device=buf.device)
    vals = torch.empty(total, dtype=value_dtype, device=buf.device)
    if not dispatch.in_host_memory(buf):
        put = layout.put
        for m in range(c.size):
            _unpack_into(buf[at[m]:at[m] + size[m]], int(c[m]), spans[m], bases[m], index_dtype, value_dtype,
                         idx[put[m]:put[m] + c[m]], vals[put[m]:put[m] + c[m]], backend)
        return idx, vals
    if total:
        _UNPACK_MESSAGES(buf, value_dtype, index_dtype, layout, idx, vals, backend=backend)
    return idx, vals


def unpack_messages_torch(buf: torch.Tensor, value_dtype: torch.dtype, index_dtype: torch.dtype,
                          layout: MessagesLayout, idx: torch.Tensor, vals: torch.Tensor) -> None:
    """Reference of :func:`unpack_messages` in host memory: each layout's records gathered (an
    index a byte) and decoded at once, the blocked ones' blocks expanded from every header."""
    L = layout
    for group, idt, in_blocks in ((~L.blocked & (L.counts > 0), index_dtype, False), (L.blocked, _OFFSET_DTYPE, True)):
        sel = np.flatnonzero(group)
        if not sel.size:
            continue
        gc, r = L.counts[sel], int(L.rec[sel[0]])
        rows = buf[positions(L.at[sel] + L.head[sel], gc * r, device=buf.device)].view(-1, r)
        got, v = unpack_records(rows, idt, value_dtype, backend="torch")
        if in_blocks:
            words = buf[positions(L.at[sel], L.head[sel], device=buf.device)].view(_HEADER_DTYPE).to(torch.int64)
            nwords = L.head[sel] // _HEADER_DTYPE.itemsize
            if dispatch.checks_values(words) and (bool((words < 0).any()) or not np.array_equal(
                    np.add.reduceat(words.numpy(), starts_of(nwords)) if words.numel() else words.numpy(), gc)):
                raise ValueError("unpack_messages: a header does not count its message's entries")
            block_at = positions(L.bases[sel], nwords, step=INDEX_BLOCK, device=buf.device)
            got = got.bitwise_and_(INDEX_BLOCK - 1) + torch.repeat_interleave(block_at, words, output_size=got.numel())
        else:
            got = got + positions(L.bases[sel], gc, step=0, device=buf.device)
        where = positions(L.put[sel], gc, device=buf.device)
        idx[where] = got
        vals[where] = v


def _unpack_into(msg: torch.Tensor, count: int, span: int, base: int, index_dtype: torch.dtype,
                 value_dtype: torch.dtype, idx: torch.Tensor, vals: torch.Tensor, backend: str | None,
                 add_into: torch.Tensor | None = None) -> None:
    """Decode one message into ``idx`` (plus ``base``) and ``vals`` (added into ``add_into``
    too, when given), refusing one of the wrong size."""
    want = message_bytes(count, span, index_dtype, value_dtype)
    if msg.dim() != 1 or msg.numel() != want:
        raise ValueError(f"unpack_message: {tuple(msg.shape)} bytes, a message of {count} entries "
                         f"in a span of {span} has {want}")
    if not count:
        return
    if not blocked(count, span, index_dtype):
        i, v = unpack_records(msg.view(count, -1), index_dtype, value_dtype, backend=backend)
        torch.add(i, base, out=idx)
        vals.copy_(v)
        if add_into is not None:
            add_into.index_add_(0, idx, vals)
        return
    head = _HEADER_DTYPE.itemsize * index_blocks(span)
    _UNPACK_BLOCKED(msg[head:].view(count, -1), msg[:head], value_dtype, base, idx, vals, add_into, backend=backend)


def unpack_blocked_torch(rows: torch.Tensor, header: torch.Tensor, value_dtype: torch.dtype, base: int,
                         idx: torch.Tensor, vals: torch.Tensor, add_into: torch.Tensor | None = None) -> None:
    """Reference of a blocked message's decoding into ``idx`` (plus ``base``) and ``vals``, the
    values also added into ``add_into`` when given; ``header`` is the message's header bytes (uint8).

    Off GPUs (where the check would cost a sync) a header that does not count
    the message's entries is refused: ValueError. On a GPU a wrong header is
    ``repeat_interleave``'s to catch (a device-side assert); the callers'
    headers come from :func:`pack_message` on the peer.
    """
    _unpack_blocked(rows, header, value_dtype, base, idx, vals, "torch", add_into)


def _unpack_blocked(rows: torch.Tensor, header: torch.Tensor, value_dtype: torch.dtype, base: int,
                    idx: torch.Tensor, vals: torch.Tensor, records: str, add_into: torch.Tensor | None = None) -> None:
    """The 2-byte records by ``unpack_records``'s ``records`` path, their blocks by expanding the header."""
    header = header_words(header)
    count = rows.shape[0]
    if dispatch.checks_values(header) and (int(header.sum()) != count or bool((header < 0).any())):
        raise ValueError(f"unpack_message: the header counts {int(header.sum())} entries, the message has {count}")
    off, v = _UNPACK_RECORDS.run(records, rows, _OFFSET_DTYPE, value_dtype)
    starts = torch.arange(header.numel(), dtype=torch.int64, device=rows.device).mul_(INDEX_BLOCK).add_(base)
    # The offsets come back sign-extended (an int16 view widened): keep their 16 bits.
    torch.add(off.bitwise_and_(INDEX_BLOCK - 1), torch.repeat_interleave(starts, header, output_size=count),
              out=idx)
    vals.copy_(v)
    if add_into is not None:
        add_into.index_add_(0, idx, vals)


def header_words(header: torch.Tensor) -> torch.Tensor:
    """A blocked message's header bytes as int32 counts (a copy: a header inside a gathered
    buffer may sit at any byte offset)."""
    return header.clone().view(_HEADER_DTYPE)


def unpack_blocked_cupy(rows: torch.Tensor, header: torch.Tensor, value_dtype: torch.dtype, base: int,
                        idx: torch.Tensor, vals: torch.Tensor, add_into: torch.Tensor | None = None) -> None:
    """cupy path: the records by the CuPy record kernel, then the reference's expansion."""
    _unpack_blocked(rows, header, value_dtype, base, idx, vals, "cupy", add_into)


# The tables carry the public functions' names; their paths do the blocked layout's part.
_PACK_BLOCKED = dispatch.KernelOp("pack_message", pack_blocked_torch, on=1, cpu="numba_wire_backend:pack_blocked",
                                  triton="triton_backend:pack_blocked", cupy="message:pack_blocked_cupy",
                                  accepts={"cpu": lambda *_: _LITTLE})
_UNPACK_BLOCKED = dispatch.KernelOp("unpack_message", unpack_blocked_torch, cpu="numba_wire_backend:unpack_blocked",
                                    triton="triton_backend:unpack_blocked", cupy="message:unpack_blocked_cupy",
                                    accepts={"cpu": lambda *_: _LITTLE})
_PACK_MESSAGES = dispatch.KernelOp("pack_messages", pack_messages_torch, on=1, cpu="numba_wire_backend:pack_messages",
                                   accepts={"cpu": lambda *_: _LITTLE})
_UNPACK_MESSAGES = dispatch.KernelOp("unpack_messages", unpack_messages_torch, cpu="numba_wire_backend:unpack_messages",
                                     accepts={"cpu": lambda *_: _LITTLE})
