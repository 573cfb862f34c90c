"""The communicator interface: the only door from an algorithm to the network.

An algorithm sees a :class:`Communicator` and nothing else. The interface holds
exactly the operations the sparse and dense allreduces need; three backends
implement it (torch.distributed, MPI, simulated world).

Traffic accounting. Every backend counts, per rank, bytes and messages sent and
received. Point-to-point traffic is counted as posted. A collective is counted
as the standard algorithm for it would move the data (so the counts are the
same on every backend and comparable with the cost formulas of the papers):

==================  ============================  ==========================
operation           bytes sent = bytes received   messages sent
==================  ============================  ==========================
allgather(v)        total - own (ring)            P - 1
alltoall            (P - 1) * chunk               P - 1
alltoallv           each part (point to point)    one a nonempty part
allreduce           2 m (P - 1) / P (Rabenseifner)  2 ceil(log2 P)
reduce_scatter      m (P - 1) / P                 ceil(log2 P)
allgather_dense     m (P - 1) / P                 ceil(log2 P)
broadcast           m at non-roots (tree)          children in a binomial tree
barrier             0                             ceil(log2 P)
==================  ============================  ==========================

Where a backend physically moves more than that (NCCL has no allgatherv, so
the torch backend pads every block to the largest one there) it counts what it moves.
"""

from __future__ import annotations

import abc
import contextlib
import math
import os
from dataclasses import asdict, dataclass
from typing import Sequence

import torch

__all__ = ["Communicator", "Request", "CommStats", "DEFAULT_TIMEOUT", "default_timeout", "launcher_node_size"]

#: Seconds any blocking wait may take before it raises CommTimeoutError.
DEFAULT_TIMEOUT = 300.0


def default_timeout() -> float:
    """The wait timeout in seconds: ``$SPARSECOMM_TIMEOUT`` or DEFAULT_TIMEOUT."""
    value = os.environ.get("SPARSECOMM_TIMEOUT")
    return float(value) if value else DEFAULT_TIMEOUT


#: Launcher variables holding the ranks on this rank's node, read in this order: torchrun,
#: Open MPI, MPICH's Hydra, Slurm (with --ntasks-per-node).
NODE_SIZE_VARS = ("LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", "SLURM_NTASKS_PER_NODE")


def launcher_node_size() -> int | None:
    """The ranks on this rank's node as the launcher says (:data:`NODE_SIZE_VARS`), or None."""
    for var in NODE_SIZE_VARS:
        try:
            value = int(os.environ.get(var, ""))
        except ValueError:
            continue
        if value >= 1:
            return value
    return None


_TAG_ALLTOALLV = 0xA11A

_COUNTERS = ("bytes_sent", "bytes_received", "messages_sent", "messages_received")


@dataclass
class CommStats:
    """Per-rank traffic counters; ``snapshot()`` and subtraction give a phase's share."""

    bytes_sent: int = 0
    bytes_received: int = 0
    messages_sent: int = 0
    messages_received: int = 0

    def snapshot(self) -> "CommStats":
        return CommStats(*(getattr(self, f) for f in _COUNTERS))

    def __sub__(self, other: "CommStats") -> "CommStats":
        return CommStats(*(getattr(self, f) - getattr(other, f) for f in _COUNTERS))

    def __iadd__(self, other: "CommStats") -> "CommStats":
        """Add ``other``'s four counters (a subclass keeps its own extra fields)."""
        for f in _COUNTERS:
            setattr(self, f, getattr(self, f) + getattr(other, f))
        return self

    def as_dict(self) -> dict:
        return asdict(self)


class Request(abc.ABC):
    """A pending non-blocking operation."""

    @abc.abstractmethod
    def wait(self) -> None:
        """Block until done; raise CommTimeoutError naming the operation and peer."""


def _log2ceil(p: int) -> int:
    return 0 if p <= 1 else math.ceil(math.log2(p))


class Communicator(abc.ABC):
    """A group of ``size`` ranks seen from rank ``rank``.

    Buffers are torch tensors. Collectives return new tensors (``allreduce``
    may write into ``out=`` instead) and never modify their inputs otherwise.
    Every wait is bounded by ``timeout`` seconds.
    """

    #: Backend name, e.g. "sim", "torch:gloo", "mpi".
    name: str = "abstract"

    def __init__(self, rank: int, size: int, timeout: float | None = None) -> None:
        self.rank = rank
        self.size = size
        self.timeout = default_timeout() if timeout is None else float(timeout)
        self.stats = CommStats()

    # ---- what the backend must provide ------------------------------------
    @abc.abstractmethod
    def isend(self, buf: torch.Tensor, dst: int, tag: int = 0) -> Request:
        """Start sending contiguous ``buf`` to rank ``dst``."""

    @abc.abstractmethod
    def irecv(self, buf: torch.Tensor, src: int, tag: int = 0) -> Request:
        """Start receiving into contiguous ``buf`` (exact size) from rank ``src``."""

    @abc.abstractmethod
    def _allgather(self, t: torch.Tensor) -> torch.Tensor:
        """Fixed-size allgather: returns a (size, *t.shape) tensor."""

    @abc.abstractmethod
    def _allgatherv(self, t: torch.Tensor, counts: Sequence[int]) -> torch.Tensor:
        """Variable-size allgather along dim 0; ``counts[r]`` rows from rank r."""

    @abc.abstractmethod
    def _alltoall(self, t: torch.Tensor) -> torch.Tensor:
        """Exchange equal chunks: row r of the input goes to rank r."""

    @abc.abstractmethod
    def _allreduce(self, t: torch.Tensor, op: str, out: torch.Tensor | None = None) -> torch.Tensor:
        """Elementwise reduction (``"sum"``, ``"max"`` or ``"min"``) over ranks, into ``out``
        when given (contiguous, like ``t``; may be ``t`` itself)."""

    @abc.abstractmethod
    def _reduce_scatter(self, t: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Sum over ranks, rank r keeps chunk r of ``size`` equal chunks (into ``out`` when given)."""

    @abc.abstractmethod
    def _allgather_dense(self, chunk: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Concatenate every rank's equal-size chunk (inverse of reduce_scatter), into ``out``
        when given."""

    @abc.abstractmethod
    def _broadcast(self, t: torch.Tensor, root: int) -> torch.Tensor:
        """Return root's ``t`` on every rank."""

    @abc.abstractmethod
    def _barrier(self) -> None:
        """Wait for every rank."""

    def supports_device(self, device: torch.device) -> bool:
        """Whether tensors on ``device`` can be passed to this communicator."""
        return device.type == "cpu"

    @property
    def node_size(self) -> int | None:
        """Ranks per node where the backend itself knows it (a simulated world on a two-level
        network), else None: ranks g G .. g G + G - 1 share node g."""
        return None

    @property
    def control_device(self) -> torch.device:
        """Where small control messages (signatures, counts, scales) are built and travel.

        The CPU, except for backends that take device tensors only (NCCL): the
        same device on every rank, whatever device a call's tensor is on.
        """
        return torch.device("cpu")

    def idle(self) -> contextlib.AbstractContextManager:
        """Context for blocking on something other than this communicator.

        The simulated world runs its ranks one at a time; a rank that waits on
        a thread of its own (e.g. DenseOvlp's communication thread) must let
        the other ranks run meanwhile. Real backends need nothing.
        """
        return contextlib.nullcontext()

    def dup(self) -> "Communicator":
        """A communicator over the same ranks whose traffic never mixes with this one's.

        Collective: every rank calls it, in the same order relative to its
        other collectives. An asynchronous engine runs its jobs on one, so they
        never race the caller's (or DDP's) collectives.
        """
        raise NotImplementedError(f"{self.name}: this communicator cannot be duplicated")

    def split(self, color: int, key: int | None = None) -> "Communicator":
        """The ranks that pass the same ``color``, ordered by ``key`` then rank: MPI's Comm_split.

        Collective: every rank calls it, in the same order relative to its other
        collectives. The part's traffic is this rank's traffic: it is counted in this
        communicator's counters (and, in the simulated world, on this rank's clock).
        Each call makes a new communicator (a process group on torch.distributed): keep it.
        torch.distributed orders a group by rank: there a key that orders a part otherwise
        is refused (ValueError on the part's every rank).
        """
        part = self._split(int(color), self.rank if key is None else int(key))
        part.stats = self.stats
        return part

    def _split(self, color: int, key: int) -> "Communicator":
        """The backend's split (see :meth:`split`)."""
        raise NotImplementedError(f"{self.name}: this communicator cannot be split")

    def split_colors(self, color: int, key: int) -> list[list[int]]:
        """Every part of a split, as lists of ranks in their new order, in color order: one
        allgather of (color, key) pairs, the same on every rank."""
        pairs = self.allgather(torch.tensor([color, key], dtype=torch.int64, device=self.control_device))
        rows = pairs.reshape(self.size, 2).tolist()
        parts: dict[int, list[tuple[int, int]]] = {}
        for rank, (c, k) in enumerate(rows):
            parts.setdefault(int(c), []).append((int(k), rank))
        return [[rank for _, rank in sorted(members)] for _, members in sorted(parts.items())]

    # ---- public collectives: accounting around the backend calls ----------
    def allgather(self, t: torch.Tensor) -> torch.Tensor:
        """Every rank's equal-size ``t``, stacked in rank order."""
        nbytes = _nbytes(t)
        self._count(nbytes * (self.size - 1), self.size - 1)
        return self._allgather(t.contiguous())

    def allgatherv(self, t: torch.Tensor, counts: Sequence[int]) -> torch.Tensor:
        """Concatenation in rank order of every rank's ``t`` (``counts[r]`` rows each)."""
        counts = [int(c) for c in counts]
        if len(counts) != self.size or counts[self.rank] != t.shape[0]:
            raise ValueError(f"allgatherv: counts {counts} do not match rank {self.rank}'s "
                             f"{t.shape[0]} rows or the world size {self.size}")
        self._count(_row_bytes(t) * (sum(counts) - counts[self.rank]), self.size - 1)
        return self._allgatherv(t.contiguous(), counts)

    def alltoall(self, t: torch.Tensor) -> torch.Tensor:
        """Row r of ``t`` (shape (size, ...)) goes to rank r; returns what each rank sent here."""
        if t.shape[0] != self.size:
            raise ValueError(f"alltoall: first dimension {t.shape[0]} != world size {self.size}")
        self._count(_nbytes(t) // self.size * (self.size - 1), self.size - 1)
        return self._alltoall(t.contiguous())

    def alltoallv(self, send: torch.Tensor, send_sizes: Sequence[int], recv_sizes: Sequence[int],
                  window: int | None = None) -> torch.Tensor:
        """Rank r gets ``send_sizes[r]`` bytes of ``send`` (1-D uint8, the parts end to end in
        rank order); returns what every rank sent here, end to end in rank order
        (``recv_sizes[r]`` bytes from rank r, which both ends know).

        Counted as the point-to-point messages it is: one a peer with something to send.
        Backends move them with point-to-point sends in a rotation (step s: to rank + s,
        from rank - s), ``window`` steps in flight at once (None: all), so that no rank is
        every peer's first destination; the simulated world moves them in one rendezvous
        and models each message's time as those sends would take.
        """
        send_sizes, recv_sizes = [int(x) for x in send_sizes], [int(x) for x in recv_sizes]
        if (send.dim() != 1 or send.dtype != torch.uint8 or len(send_sizes) != self.size
                or len(recv_sizes) != self.size or sum(send_sizes) != send.numel()
                or send_sizes[self.rank] != recv_sizes[self.rank]):
            raise ValueError(f"alltoallv: need 1-D uint8 bytes of {self.size} parts (own part the same size "
                             f"both ways), got {tuple(send.shape)} {send.dtype}, sizes {len(send_sizes)} and "
                             f"{len(recv_sizes)} summing to {sum(send_sizes)}")
        return self._alltoallv(send.contiguous(), send_sizes, recv_sizes, window or self.size)

    def _alltoallv(self, send: torch.Tensor, send_sizes: list[int], recv_sizes: list[int],
                   window: int) -> torch.Tensor:
        """The rotation of point-to-point sends (a backend may override it with its own)."""
        P, me = self.size, self.rank
        out_at = [0]
        for size in recv_sizes:
            out_at.append(out_at[-1] + size)
        send_at = [0]
        for size in send_sizes:
            send_at.append(send_at[-1] + size)
        out = torch.empty(out_at[-1], dtype=torch.uint8, device=send.device)
        out[out_at[me]:out_at[me + 1]] = send[send_at[me]:send_at[me + 1]]
        sends: list[Request] = []

        def post(first: int) -> list[Request]:
            recvs = []
            for s in range(first, min(first + window, P)):
                dst, src = (me + s) % P, (me - s) % P
                if recv_sizes[src]:
                    recvs.append(self.irecv(out[out_at[src]:out_at[src + 1]], src, _TAG_ALLTOALLV))
                if send_sizes[dst]:
                    sends.append(self.isend(send[send_at[dst]:send_at[dst + 1]], dst, _TAG_ALLTOALLV))
            return recvs

        # Bucket b + 1 is posted before window b is waited for: one window always in flight.
        firsts = list(range(1, P, window))
        pending = post(firsts[0]) if firsts else []
        for b in range(len(firsts)):
            following = post(firsts[b + 1]) if b + 1 < len(firsts) else []
            for req in pending:
                req.wait()
            pending = following
        for req in sends:
            req.wait()
        return out

    def allreduce(self, t: torch.Tensor, op: str = "sum", out: torch.Tensor | None = None) -> torch.Tensor:
        """Elementwise ``op`` ("sum", "max", "min") of ``t`` over all ranks.

        With ``out`` (contiguous, ``t``'s shape, dtype and device; ``t`` itself
        reduces in place) the result is written there and ``out`` returned: a
        large allreduce then allocates nothing (a fresh 100 MB buffer costs
        more in page faults than the copy into it).
        """
        if op not in ("sum", "max", "min"):
            raise ValueError(f"allreduce: unknown op {op!r}")
        if out is not None and (out.shape != t.shape or out.dtype != t.dtype or out.device != t.device
                                or not out.is_contiguous()):
            raise ValueError(f"allreduce: out= must be contiguous with the input's shape, dtype and "
                             f"device ({tuple(t.shape)}, {t.dtype}, {t.device})")
        p = self.size
        self._count(2 * _nbytes(t) * (p - 1) // p, 2 * _log2ceil(p))
        return self._allreduce(t.contiguous(), op, out)

    def reduce_scatter(self, t: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Sum over ranks of 1-D ``t`` (length divisible by size); rank r gets chunk r.

        ``out``: where to write it (contiguous, 1-D, ``t``'s dtype and device, a
        chunk long, not overlapping ``t``), so that a large call allocates nothing
        of its size.
        """
        if t.dim() != 1 or t.numel() % self.size:
            raise ValueError(f"reduce_scatter: need a 1-D tensor whose length is a multiple of "
                             f"{self.size}, got shape {tuple(t.shape)}")
        _check_out("reduce_scatter", out, t, t.numel() // self.size)
        p = self.size
        self._count(_nbytes(t) * (p - 1) // p, _log2ceil(p))
        return self._reduce_scatter(t.contiguous(), out)

    def allgather_dense(self, chunk: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Concatenation of every rank's equal-size 1-D ``chunk`` in rank order (into ``out``,
        contiguous, 1-D, ``size`` chunks long, when given): the allgather half of a dense
        allreduce, counted as one (ceil(log2 P) messages). :meth:`allgather` stacks rows and
        counts the P - 1 messages of a ring."""
        _check_out("allgather_dense", out, chunk, chunk.numel() * self.size)
        p = self.size
        self._count(_nbytes(chunk) * (p - 1), _log2ceil(p))
        return self._allgather_dense(chunk.contiguous(), out)

    def broadcast(self, t: torch.Tensor, root: int = 0) -> torch.Tensor:
        """Root's ``t`` on every rank (binomial tree accounting)."""
        children = _binomial_children(self.rank, root, self.size)
        nbytes = _nbytes(t)
        self.stats.bytes_sent += nbytes * children
        self.stats.messages_sent += children
        if self.rank != root:
            self.stats.bytes_received += nbytes
            self.stats.messages_received += 1
        return self._broadcast(t.contiguous(), root)

    def barrier(self) -> None:
        """Wait until every rank has entered the barrier."""
        self.stats.messages_sent += _log2ceil(self.size)
        self.stats.messages_received += _log2ceil(self.size)
        self._barrier()

    # ---- helpers ------------------------------------------------------------
    def _count(self, nbytes: int, messages: int) -> None:
        """Count a symmetric collective: as many bytes in as out."""
        self.stats.bytes_sent += nbytes
        self.stats.bytes_received += nbytes
        self.stats.messages_sent += messages
        self.stats.messages_received += messages

    def _count_p2p_send(self, buf: torch.Tensor) -> None:
        self.stats.bytes_sent += _nbytes(buf)
        self.stats.messages_sent += 1

    def _count_p2p_recv(self, buf: torch.Tensor) -> None:
        self.stats.bytes_received += _nbytes(buf)
        self.stats.messages_received += 1

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name} rank {self.rank} of {self.size}>"


def _check_out(what: str, out: torch.Tensor | None, like: torch.Tensor, numel: int) -> None:
    if out is not None and (out.dim() != 1 or out.numel() != numel or out.dtype != like.dtype
                            or out.device != like.device or not out.is_contiguous()):
        raise ValueError(f"{what}: out= must be a contiguous 1-D tensor of {numel} elements with the "
                         f"input's dtype and device ({like.dtype}, {like.device})")


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _row_bytes(t: torch.Tensor) -> int:
    return math.prod(t.shape[1:]) * t.element_size()


def _binomial_children(rank: int, root: int, size: int) -> int:
    """Number of children of ``rank`` in a binomial broadcast tree rooted at ``root``."""
    rel = (rank - root) % size
    children, mask = 0, 1
    while mask < size:
        if rel & mask:
            break
        if rel + mask < size:
            children += 1
        mask <<= 1
    return children
