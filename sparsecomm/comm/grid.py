"""The ranks of a communicator as a grid: every all-to-all exchange in two hops.

A rank talks to every other rank in an allgather, an alltoall or an alltoallv: P - 1
messages on its critical path, which at P = 1024 and a cluster's alpha outweigh the
bytes of a sparse allreduce. :class:`GridCommunicator` lays the same ranks out as R rows
of C = ceil(sqrt(P)) columns (rank p at row p // C, column p % C; the last row may be
shorter) and moves those exchanges in two hops over ``inner``'s alltoallv:

* ``allgatherv``: every rank's block to its row (C - 1 messages), then each row's blocks
  to the column (R - 1 messages, one per other row). The same bytes as a ring, in
  2 (sqrt(P) - 1) messages instead of P - 1.
* ``alltoallv``: part (s, d) goes first to the rank in s's row and d's column (where
  the last row lacks that column, to the rank in d's row and s's column), which
  forwards it to d: every part travels at most twice, each rank sends about
  2 sqrt(P) messages. A hop of the parts' sizes goes first, so that every intermediate
  knows what it forwards.

Every other operation is ``inner``'s, and so are the traffic counters and the clock: the
hops are counted as the point-to-point messages they are. Results are those of ``inner``
bit for bit (the same bytes arrive, in the same order).
"""

from __future__ import annotations

import contextlib
import math
from typing import Sequence

import numpy as np
import torch

from ..segments import positions
from .base import Communicator, Request

__all__ = ["GridCommunicator"]


class GridCommunicator(Communicator):
    """``inner``'s ranks as a grid of ceil(sqrt(P)) columns (see the module docstring)."""

    def __init__(self, inner: Communicator) -> None:
        # (no counters of its own: everything it sends is inner's traffic)
        self.inner = inner
        self.rank, self.size, self.timeout = inner.rank, inner.size, inner.timeout
        self.stats = inner.stats
        self.name = f"grid:{inner.name}"
        self.cols = self.columns(self.size)
        self.rows = -(-self.size // self.cols)
        self.last = self.size - (self.rows - 1) * self.cols  # ranks in the last row

    # ---- the grid -------------------------------------------------------------
    @staticmethod
    def columns(P: int) -> int:
        """Columns of the grid of P ranks: ceil(sqrt(P))."""
        return math.isqrt(P - 1) + 1 if P > 1 else 1

    def via(self, src: int | np.ndarray, dst: int | np.ndarray) -> np.ndarray:
        """The rank a part from ``src`` to ``dst`` passes through: (row of src, column of dst),
        or (row of dst, column of src) where the last row lacks that column."""
        C = self.cols
        src, dst = np.asarray(src), np.asarray(dst)
        first = (src // C) * C + dst % C
        return np.where(first < self.size, first, (dst // C) * C + src % C)

    def _relayed(self, m: int) -> list[tuple[int, np.ndarray]]:
        """(origin, destinations in rank order) of every bundle rank ``m`` receives in the
        first hop: the parts of origin s for which m is the intermediate (m's own among them)."""
        C, P = self.cols, self.size
        row, col = divmod(m, C)
        column = np.arange(col, P, C)
        out = [(s, column) for s in range(row * C, min(row * C + C, P)) if s != m]
        lower = (self.rows - 1) * C + col  # the last row's rank in m's column
        if row != self.rows - 1 and col < self.last and self.last < C:
            mine = np.arange(row * C + self.last, row * C + C)  # m's row, columns the last row lacks
            out.append((lower, mine))
        return sorted(out)

    # ---- the two-hop exchanges ---------------------------------------------------
    def alltoallv(self, send: torch.Tensor, send_sizes: Sequence[int], recv_sizes: Sequence[int],
                  window: int | None = None) -> torch.Tensor:
        """``Communicator.alltoallv`` in two hops (module docstring), after a hop of sizes.

        1. Sizes: each rank tells every intermediate of its parts the size of each.
        2. Hop 1: to each intermediate, its parts end to end (destinations in rank order).
        3. Hop 2: each intermediate forwards what it holds for a rank, origins in rank order.
        4. Every rank puts what reached it in origin order.
        """
        P, me, inner = self.size, self.rank, self.inner
        if P <= 2:
            return inner.alltoallv(send, send_sizes, recv_sizes, window)
        sizes = np.asarray([int(x) for x in send_sizes], dtype=np.int64)
        want = np.asarray([int(x) for x in recv_sizes], dtype=np.int64)
        if send.numel() != int(sizes.sum()) or sizes[me] != want[me]:
            raise ValueError(f"alltoallv: {send.numel()} bytes to send, the sizes say {int(sizes.sum())}")
        at = np.concatenate([[0], np.cumsum(sizes)[:-1]])
        ranks = np.arange(P)
        via_out = self.via(me, ranks)
        relayed = self._relayed(me)

        # 1. sizes of my parts to each intermediate; the sizes of the parts it relays come back.
        dests = ranks[(via_out != me) & (ranks != me)]
        dests = dests[np.argsort(via_out[dests], kind="stable")]  # by intermediate, then destination
        firsts, cut = np.unique(via_out[dests], return_index=True)
        hops = list(zip(firsts.tolist(), np.split(dests, cut[1:]))) if dests.size else []
        head = torch.from_numpy(np.concatenate([sizes[ds] for _, ds in hops] or [np.zeros(0, np.int64)]))
        head_out = np.zeros(P, dtype=np.int64)
        for m, ds in hops:
            head_out[m] = 8 * ds.size
        head_in = np.zeros(P, dtype=np.int64)
        for s, ds in relayed:
            head_in[s] = 8 * ds.size
        got = inner.alltoallv(head.view(torch.uint8), head_out.tolist(), head_in.tolist(), window)
        relay_sizes = got.view(torch.int64).numpy() if got.numel() else np.zeros(0, np.int64)

        # 2. hop 1: the parts themselves.
        order = np.concatenate([ds for _, ds in hops] or [np.zeros(0, np.int64)])
        out1 = send[positions(at[order], sizes[order], device=send.device)] if order.size else send[:0]
        hop1_out = np.zeros(P, dtype=np.int64)
        for m, ds in hops:
            hop1_out[m] = sizes[ds].sum()
        hop1_in = np.zeros(P, dtype=np.int64)
        held = []  # (origin, destination, size, where in hop1) of every part received
        pos, k = 0, 0
        for s, ds in relayed:
            part = relay_sizes[k:k + ds.size]
            k += ds.size
            hop1_in[s] = part.sum()
            for d, size in zip(ds.tolist(), part.tolist()):
                held.append((s, d, size, pos))
                pos += size
        hop1 = inner.alltoallv(out1, hop1_out.tolist(), hop1_in.tolist(), window)

        # 3. hop 2: what this rank holds for others (its own parts it relays itself among them).
        own = ranks[(via_out == me) & (ranks != me)]
        pieces = [(me, int(d), int(sizes[d]), -1 - int(at[d])) for d in own]  # (negative: from send)
        pieces += [p for p in held if p[1] != me]
        pieces.sort(key=lambda p: (p[1], p[0]))  # by destination, then origin
        if pieces:
            source = torch.cat([hop1, send])
            where = np.array([p[3] if p[3] >= 0 else hop1.numel() - 1 - p[3] for p in pieces], dtype=np.int64)
            out2 = source[positions(where, np.array([p[2] for p in pieces]), device=send.device)]
        else:
            out2 = send[:0]
        hop2_out = np.zeros(P, dtype=np.int64)
        for _, d, size, _ in pieces:
            hop2_out[d] += size
        via_in = self.via(ranks, me)  # the intermediate of each origin's part for this rank
        hop2_in = np.zeros(P, dtype=np.int64)
        relayed_in = (via_in != me) & (ranks != me)
        np.add.at(hop2_in, via_in[relayed_in], want[relayed_in])
        hop2 = inner.alltoallv(out2, hop2_out.tolist(), hop2_in.tolist(), window)

        # 4. in origin order: hop 2's (by intermediate, then origin), hop 1's own parts, mine.
        start = np.zeros(P, dtype=np.int64)
        source_of = np.zeros(P, dtype=np.int64)  # 0: hop 2, 1: hop 1, 2: send
        hop2_at = np.concatenate([[0], np.cumsum(hop2_in)[:-1]])
        for m in np.unique(via_in[relayed_in]).tolist():
            origins = ranks[relayed_in & (via_in == m)]
            start[origins] = hop2_at[m] + np.concatenate([[0], np.cumsum(want[origins])[:-1]])
        for s, d, _, p in held:
            if d == me:
                start[s], source_of[s] = p, 1
        start[me], source_of[me] = at[me], 2
        offset = np.array([0, hop2.numel(), hop2.numel() + hop1.numel()], dtype=np.int64)
        everything = torch.cat([hop2, hop1, send])
        return everything[positions(start + offset[source_of], want, device=send.device)]

    def allgatherv(self, t: torch.Tensor, counts: Sequence[int]) -> torch.Tensor:
        """``Communicator.allgatherv`` in two hops: the row's blocks, then the rows'."""
        counts = [int(c) for c in counts]
        P, me, C = self.size, self.rank, self.cols
        if len(counts) != P or counts[me] != t.shape[0]:
            raise ValueError(f"allgatherv: counts {counts} do not match rank {me}'s {t.shape[0]} rows "
                             f"or the world size {P}")
        if P <= 2:
            return self.inner.allgatherv(t, counts)
        row_shape, dtype = t.shape[1:], t.dtype
        width = math.prod(row_shape) * t.element_size()
        nbytes = np.asarray(counts, dtype=np.int64) * width
        mine = t.contiguous().view(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8,
                                                                                        device=t.device)
        row = me // C
        members = np.arange(row * C, min(row * C + C, P))
        # 1. my block to my row.
        out = np.zeros(P, dtype=np.int64)
        out[members] = nbytes[me]
        out[me] = nbytes[me]
        inn = np.zeros(P, dtype=np.int64)
        inn[members] = nbytes[members]
        block = mine.repeat(len(members)) if mine.numel() else mine
        bundle = self.inner.alltoallv(block, out.tolist(), inn.tolist())  # my row's blocks, in rank order
        # 2. the row's bundle to one rank of every other row; the other rows' bundles here.
        #    Rank (r, c) serves the ranks of columns c, c + len(row r), ... of the other rows.
        out = np.zeros(P, dtype=np.int64)
        senders = []
        for r in range(self.rows):
            size_r = min(C, P - r * C)
            if r != row:
                senders.append(r * C + (me % C) % size_r)  # who sends row r's bundle here
        q = np.arange(P)
        out[(q // C != row) & (members[(q % C) % len(members)] == me)] = nbytes[members].sum()
        out[me] = bundle.numel()
        inn = np.zeros(P, dtype=np.int64)
        for s in senders:
            r = s // C
            inn[s] = nbytes[r * C:min(r * C + C, P)].sum()
        inn[me] = bundle.numel()
        payload = bundle.repeat(int((out > 0).sum())) if bundle.numel() else bundle
        rows_in = self.inner.alltoallv(payload, out.tolist(), inn.tolist())
        # Rows arrive in sender order, which is row order; my row's own bundle sits at its place.
        return rows_in.view(dtype).reshape(-1, *row_shape)

    def allgather(self, t: torch.Tensor) -> torch.Tensor:
        """``Communicator.allgather`` as a two-hop allgatherv of equal blocks."""
        return self.allgatherv(t.reshape(1, *t.shape), [1] * self.size).reshape(self.size, *t.shape)

    def alltoall(self, t: torch.Tensor) -> torch.Tensor:
        """``Communicator.alltoall`` as a two-hop alltoallv of equal parts."""
        if t.shape[0] != self.size:
            raise ValueError(f"alltoall: first dimension {t.shape[0]} != world size {self.size}")
        part = math.prod(t.shape[1:]) * t.element_size()
        data = t.contiguous().view(-1).view(torch.uint8)
        got = self.alltoallv(data, [part] * self.size, [part] * self.size)
        return got.view(t.dtype).reshape(t.shape)

    # ---- everything else is inner's ------------------------------------------------
    def allreduce(self, t: torch.Tensor, op: str = "sum", out: torch.Tensor | None = None) -> torch.Tensor:
        return self.inner.allreduce(t, op, out)

    def reduce_scatter(self, t: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        return self.inner.reduce_scatter(t, out)

    def allgather_dense(self, chunk: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        return self.inner.allgather_dense(chunk, out)

    def broadcast(self, t: torch.Tensor, root: int = 0) -> torch.Tensor:
        return self.inner.broadcast(t, root)

    def barrier(self) -> None:
        self.inner.barrier()

    def isend(self, buf: torch.Tensor, dst: int, tag: int = 0) -> Request:
        return self.inner.isend(buf, dst, tag)

    def irecv(self, buf: torch.Tensor, src: int, tag: int = 0) -> Request:
        return self.inner.irecv(buf, src, tag)

    def supports_device(self, device: torch.device) -> bool:
        return self.inner.supports_device(device)

    @property
    def control_device(self) -> torch.device:
        return self.inner.control_device

    def idle(self) -> contextlib.AbstractContextManager:
        return self.inner.idle()

    def dup(self) -> "GridCommunicator":
        return GridCommunicator(self.inner.dup())

    def _split(self, color: int, key: int) -> Communicator:
        return self.inner.split(color, key)

    # (the public methods above never reach these)
    def _allgather(self, t: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _allgatherv(self, t: torch.Tensor, counts: Sequence[int]) -> torch.Tensor:
        raise NotImplementedError

    def _alltoall(self, t: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _allreduce(self, t: torch.Tensor, op: str, out: torch.Tensor | None = None) -> torch.Tensor:
        raise NotImplementedError

    def _reduce_scatter(self, t: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        raise NotImplementedError

    def _allgather_dense(self, chunk: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        raise NotImplementedError

    def _broadcast(self, t: torch.Tensor, root: int) -> torch.Tensor:
        raise NotImplementedError

    def _barrier(self) -> None:
        raise NotImplementedError
