"""The simulated world: P virtual ranks as threads of one process.

``simulate(P, fn)`` runs ``fn(rank)`` on P threads, each with its own
:class:`SimCommunicator`. The algorithms run unchanged; only the transport is
in memory. Collectives rendezvous on a shared slot (the n-th collective call of
every rank meets the n-th of the others, and a rank calling a different
operation is reported), point-to-point messages go through mailboxes keyed by
(source, destination, tag). Reductions add contributions in rank order, so
results are deterministic and identical on every rank.

Time model (when ``network`` is given): each rank has a clock. A send of m
bytes occupies the sender for ``beta*m`` and arrives ``alpha + beta*m`` after it
starts; a receive completes no earlier than the arrival. A collective starts
when the last rank enters it and costs ``messages*alpha + bytes*beta`` with this
rank's counted messages and bytes. Computation is not modelled: ``.time`` is
communication time only.

Failure: an exception on any rank wakes every waiting rank with
:class:`PeerError`, and ``simulate`` re-raises the first original exception; a
wait that outlasts ``timeout`` raises :class:`CommTimeoutError` naming the
operation and the missing ranks, so a deadlock ends instead of hanging.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import defaultdict, deque
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import torch

from ..errors import CommTimeoutError, PeerError
from ..network import Network, TwoLevel, resolve_network
from ..segments import positions
from .base import Communicator, Request, default_timeout

__all__ = ["SimCommunicator", "SimResult", "simulate", "current_sim_comm", "single_rank"]

_local = threading.local()
#: A waiting rank of a world of up to 64 ranks looks for a timeout or a failed peer this
#: often (seconds); in larger worlds proportionally less often.
_POLL_SECONDS = 0.5


def current_sim_comm() -> "SimCommunicator | None":
    """The simulated communicator of the calling thread, if it runs inside ``simulate``."""
    return getattr(_local, "comm", None)


class _Slot:
    """One collective call: every rank's payload and entry clock."""

    def __init__(self, size: int) -> None:
        self.items: list[Any] = [None] * size
        self.ops: list[str | None] = [None] * size
        self.clocks = [0.0] * size
        self.arrived = 0
        self.read = 0
        self.combined: Any = None
        self.same = True  # every rank called the same operation
        self.start = 0.0  # the last entry clock: when the collective starts


class _World:
    """State shared by the ranks of one simulation.

    Ranks take turns: a rank thread runs only while it holds ``run``, and
    gives it up whenever it blocks in a wait. Letting P threads issue small
    torch operations at once made them 3-8x slower than one thread (they
    fight over the GIL on every operation), and large operations still use
    every core through torch's own threads. One condition guards the
    collective slots; each rank has its own for its inbox, so a message wakes
    only its receiver.

    Timeouts count from the last progress anywhere in the world (a message
    sent, a collective joined), so a slow but live simulation never times
    out, while a deadlock does after ``timeout`` seconds.
    """

    def __init__(self, size: int, timeout: float, network: "Network | TwoLevel | None") -> None:
        self.size = size
        self.timeout = timeout
        self.network = network
        self.run = threading.Lock()
        self.cond = threading.Condition()
        self.slots: dict[tuple, _Slot] = {}  # by (channel, collective sequence number)
        self.inbox = [threading.Condition() for _ in range(size)]
        self.mailbox: dict[tuple, deque] = defaultdict(deque)  # by (channel, src, dst, tag)
        self.failure: tuple[int, BaseException] | None = None
        self.last_progress = time.monotonic()
        self.run_holder: int | None = None
        # How often a waiting rank wakes to look for a timeout: every wake-up takes the GIL
        # from the rank that runs, and a thousand ranks waking twice a second slowed it.
        self.poll = _POLL_SECONDS * max(1.0, size / 64)

    def progress(self) -> None:
        self.last_progress = time.monotonic()

    def fail(self, rank: int, exc: BaseException) -> None:
        with self.cond:
            if self.failure is None:
                self.failure = (rank, exc)
            self.cond.notify_all()
        for cond in self.inbox:
            with cond:
                cond.notify_all()

    def wait_for(self, cond: threading.Condition, take: Callable[[], Any], rank: int,
                 what: Callable[[], str]) -> Any:
        """Return ``take()`` (called holding ``cond``) once it is not None.

        While waiting, give up the run lock so other ranks can proceed. The run
        lock is never requested while holding ``cond`` (a rank holding the run
        lock may need ``cond`` to deliver what we wait for).
        """
        start = time.monotonic()
        while True:
            with cond:
                value = take()
                if value is not None:
                    return value
                idle = self.check_waiting(rank, what, start)
                held = _release_run(self)
                cond.wait(min(self.timeout - idle, self.poll))
            if held:
                _acquire_run(self, rank, what)

    def check_waiting(self, rank: int, what: Callable[[], str], start: float, why: str = "") -> float:
        """Raise if a peer failed or nothing progressed for ``timeout``; else the idle seconds."""
        if self.failure is not None and self.failure[0] != rank:
            frank, fexc = self.failure
            raise PeerError(f"rank {rank}: {what()} abandoned because rank {frank} failed: "
                            f"{type(fexc).__name__}: {fexc}")
        idle = time.monotonic() - max(start, self.last_progress)
        if idle > self.timeout:
            raise CommTimeoutError(f"rank {rank}: {what()} timed out after {self.timeout:g} s "
                                   f"(simulated world){why}")
        return idle

    @contextlib.contextmanager
    def idle(self, rank: int) -> Iterator[None]:
        held = _release_run(self)
        try:
            yield
        finally:
            if held:
                _acquire_run(self, rank)


def _release_run(world: _World) -> bool:
    if getattr(_local, "holds_run", False):
        _local.holds_run = False
        world.run_holder = None
        world.run.release()
        return True
    return False


def _acquire_run(world: _World, rank: int, what: Callable[[], str] = lambda: "its turn") -> None:
    """Take this rank's turn to run (``what`` it waits in names it in errors).

    A peer that keeps the turn too long (blocked outside sparsecomm, say) or
    fails makes this raise instead of waiting forever.
    """
    start = time.monotonic()
    while not world.run.acquire(timeout=world.poll):
        world.check_waiting(rank, what, start, f": rank {world.run_holder} has not reached a "
                            "communicator call in that time (blocked outside sparsecomm?)")
    _local.holds_run = True
    world.run_holder = rank


class _SimRequest(Request):
    def __init__(self, fn: Callable[[], None] | None = None) -> None:
        self._fn = fn

    def wait(self) -> None:
        if self._fn is not None:
            fn, self._fn = self._fn, None
            fn()


class SimCommunicator(Communicator):
    """Rank ``rank`` of an in-process simulated world, or of a part of it (:meth:`split`).

    ``members``: the world ranks of this communicator's ranks, in its rank order (None: the
    whole world). A part shares its rank's clock (``clock_box``) with the communicator it
    was split from: one rank has one timeline.
    """

    name = "sim"

    def __init__(self, rank: int, world: _World, channel: tuple = (), members: list[int] | None = None,
                 clock_box: list[float] | None = None) -> None:
        self.members = list(range(world.size)) if members is None else list(members)
        super().__init__(rank, len(self.members), world.timeout)
        self._world = world
        self._me = self.members[rank]  # this rank in the world (its inbox, its turn to run)
        self.channel = channel  # () for the world's own; dup() and split() extend it
        self._dups = 0
        self._seq = 0
        self._clock = [0.0] if clock_box is None else clock_box
        self._cost = (0, 0)
        net = world.network
        # The network of this communicator's collectives: within a node, or across nodes.
        self._net = net.spanning(self.members) if isinstance(net, TwoLevel) else net

    @property
    def clock(self) -> float:
        """This rank's modelled communication seconds so far."""
        return self._clock[0]

    @clock.setter
    def clock(self, value: float) -> None:
        self._clock[0] = value

    def supports_device(self, device: torch.device) -> bool:
        return device.type != "meta"  # any device that holds values

    def idle(self) -> contextlib.AbstractContextManager:
        return self._world.idle(self._me)

    def dup(self) -> "SimCommunicator":
        """The same ranks on a channel of their own (messages and collectives never mix)."""
        self._dups += 1
        return SimCommunicator(self.rank, self._world, self.channel + (self._dups,), self.members)

    def _split(self, color: int, key: int) -> "SimCommunicator":
        """This rank's part on a channel of its own, on this rank's clock."""
        seq = self._seq  # (the split's own collective: every rank names the same one)
        part = next(p for p in self.split_colors(color, key) if self.rank in p)
        return SimCommunicator(part.index(self.rank), self._world, self.channel + ("split", seq, color),
                               [self.members[r] for r in part], self._clock)

    @property
    def node_size(self) -> int | None:
        """The two-level network's ranks per node, for the world's own ranks (None otherwise)."""
        net = self._world.network
        whole = len(self.members) == self._world.size and self.members == sorted(self.members)
        return net.ranks_per_node if isinstance(net, TwoLevel) and whole else None

    def _link(self, peer: int) -> Network | None:
        """The network between this rank and ``peer`` (a rank of this communicator)."""
        net = self._world.network
        return net.between(self._me, self.members[peer]) if isinstance(net, TwoLevel) else net

    def _links(self) -> tuple:
        """(alpha, beta) of every message of an exchange among this communicator's ranks:
        two numbers, or on a two-level network two matrices indexed [sender, receiver]."""
        net = self._world.network
        if not isinstance(net, TwoLevel):
            return net.alpha, net.beta
        node = np.asarray(self.members) // net.ranks_per_node
        same = node[:, None] == node[None, :]
        return (np.where(same, net.intra.alpha, net.inter.alpha), np.where(same, net.intra.beta, net.inter.beta))

    # ---- accounting hook: remember the cost of the collective being run ----
    def _count(self, nbytes: int, messages: int) -> None:
        super()._count(nbytes, messages)
        self._cost = (nbytes, messages)

    # ---- point to point -----------------------------------------------------
    def isend(self, buf: torch.Tensor, dst: int, tag: int = 0) -> Request:
        self._check_peer(dst, "isend")
        self._count_p2p_send(buf)
        net, nbytes = self._link(dst), buf.numel() * buf.element_size()
        start = self.clock
        if net is not None:
            self.clock += net.beta * nbytes
            arrival = start + net.alpha + net.beta * nbytes
        else:
            arrival = 0.0
        data = buf.detach().clone()
        inbox = self._world.inbox[self.members[dst]]
        with inbox:
            self._world.mailbox[(self.channel, self.rank, dst, tag)].append((data, arrival))
            inbox.notify()
        self._world.progress()
        return _SimRequest()

    def irecv(self, buf: torch.Tensor, src: int, tag: int = 0) -> Request:
        self._check_peer(src, "irecv")
        key = (self.channel, src, self.rank, tag)

        def complete() -> None:
            world = self._world
            box = world.mailbox[key]
            data, arrival = world.wait_for(
                world.inbox[self._me], lambda: box.popleft() if box else None, self._me,
                lambda: f"recv of {tuple(buf.shape)} {buf.dtype} from rank {src} (tag {tag})")
            if data.numel() * data.element_size() != buf.numel() * buf.element_size():
                raise ValueError(f"rank {self.rank}: recv from rank {src} (tag {tag}) got "
                                 f"{data.numel() * data.element_size()} bytes into a buffer of "
                                 f"{buf.numel() * buf.element_size()} bytes")
            buf.view(-1).view(torch.uint8).copy_(data.reshape(-1).view(torch.uint8))
            self._count_p2p_recv(buf)
            self.clock = max(self.clock, arrival)

        return _SimRequest(complete)

    def _check_peer(self, peer: int, op: str) -> None:
        if not 0 <= peer < self.size or peer == self.rank:
            raise ValueError(f"{op}: invalid peer {peer} for rank {self.rank} of {self.size}")

    # ---- collectives ----------------------------------------------------------
    def _exchange(self, op: str, payload: Any, combine: Callable[[list[Any]], Any] | None = None) -> Any:
        """Deposit ``payload``; return every rank's payload, or ``combine`` of them.

        ``combine`` runs once per collective (by the first rank to leave it) and
        its result is shared by every rank, so a reduction over P ranks costs
        P - 1 additions in all, not per rank.
        """
        world, seq = self._world, self._seq
        self._seq += 1
        with world.cond:
            slot = world.slots.setdefault((self.channel, seq), _Slot(self.size))
            slot.items[self.rank], slot.ops[self.rank] = payload, op
            slot.clocks[self.rank] = self.clock
            slot.arrived += 1
            if slot.arrived == self.size:
                world.cond.notify_all()
        world.progress()

        def leave() -> _Slot | None:
            if slot.arrived < self.size:
                return None
            if slot.read == 0:  # the first to leave looks at every rank's entry, once for all
                slot.same = all(o == op for o in slot.ops)
                slot.start = max(slot.clocks)
                if combine is not None and slot.same:
                    slot.combined = combine(slot.items)
            slot.read += 1
            if slot.read == self.size:
                del world.slots[(self.channel, seq)]
            return slot

        def waiting() -> str:
            missing = [r for r, o in enumerate(slot.ops) if o is None]
            return f"{op} (collective #{seq}) waiting for rank(s) {missing}"

        done = world.wait_for(world.cond, leave, self._me, waiting)
        if not done.same:
            raise ValueError(f"rank {self.rank}: collective #{seq} mismatched across ranks: {done.ops}")
        if self._net is not None:
            nbytes, messages = self._cost
            self.clock = done.start + self._net.time(messages, nbytes)
        # (every rank's payloads in one list the ranks share: read, never changed)
        return done.combined if combine is not None else done.items

    # Gathered results are shared by all ranks (read-only by convention, as the
    # algorithms treat them); reduced results are copied per rank.
    def _allgather(self, t: torch.Tensor) -> torch.Tensor:
        def stack(parts: list[torch.Tensor]) -> torch.Tensor | str:
            if any(p.shape != t.shape or p.dtype != t.dtype for p in parts):
                return (f"allgather: shapes or dtypes differ across ranks: "
                        f"{[(tuple(p.shape), p.dtype) for p in parts]}")
            return torch.stack(parts)

        return _raise_if_message(self._exchange("allgather", t, stack))

    def _allgatherv(self, t: torch.Tensor, counts: Sequence[int]) -> torch.Tensor:
        def cat(parts: list[torch.Tensor]) -> torch.Tensor | str:
            for r, p in enumerate(parts):
                if p.shape[0] != counts[r]:
                    return f"allgatherv: rank {r} sent {p.shape[0]} rows, counts say {counts[r]}"
            return torch.cat(parts)

        return _raise_if_message(self._exchange("allgatherv", t, cat))

    def _alltoall(self, t: torch.Tensor) -> torch.Tensor:
        # Stacked once for the world (P x P rows), each rank takes its column.
        def stack(parts: list[torch.Tensor]) -> torch.Tensor | str:
            if any(p.shape != t.shape or p.dtype != t.dtype for p in parts):
                return f"alltoall: shapes or dtypes differ across ranks: {[(tuple(p.shape), p.dtype) for p in parts]}"
            return torch.stack(parts)

        return _raise_if_message(self._exchange("alltoall", t, stack))[:, self.rank].clone()

    def _alltoallv(self, send: torch.Tensor, send_sizes: list[int], recv_sizes: list[int],
                   window: int) -> torch.Tensor:
        """All parts in one rendezvous: every byte moved by one gather over the whole world, each
        rank's clock as the rotation of point-to-point sends would leave it (:func:`_rotation_clocks`)."""
        me, net = self.rank, self._world.network
        out, inn = np.asarray(send_sizes, dtype=np.int64), np.asarray(recv_sizes, dtype=np.int64)
        out[me] = inn[me] = 0  # (a rank's part for itself is no message)
        self.stats.bytes_sent += int(out.sum())
        self.stats.messages_sent += int(np.count_nonzero(out))
        self.stats.bytes_received += int(inn.sum())
        self.stats.messages_received += int(np.count_nonzero(inn))
        self._cost = (0, 0)

        def combine(parts: list[tuple]) -> tuple | str:
            sizes = np.stack([p[1] for p in parts])  # sizes[i, j]: bytes from i to j
            for j, p in enumerate(parts):
                if not np.array_equal(sizes[:, j], p[2]):
                    return (f"alltoallv: rank {j} expects {p[2].tolist()} bytes from ranks 0..{self.size - 1}, "
                            f"they send {sizes[:, j].tolist()}")
            flat = torch.cat([p[0].to("cpu") for p in parts])
            rank_at = np.concatenate([[0], np.cumsum(sizes.sum(axis=1))[:-1]])
            part_at = rank_at[:, None] + np.cumsum(sizes, axis=1) - sizes
            where = positions(part_at.T.reshape(-1), sizes.T.reshape(-1))  # by receiver, then sender
            recv = sizes.sum(axis=0)
            clocks = (_rotation_clocks(sizes, [p[3] for p in parts], p[4], *self._links())
                      if net is not None else None)
            return flat[where], np.concatenate([[0], np.cumsum(recv)]), clocks

        payload = (send, np.asarray(send_sizes, dtype=np.int64), np.asarray(recv_sizes, dtype=np.int64), self.clock,
                   window)
        gathered, at, clocks = _raise_if_message(self._exchange("alltoallv", payload, combine))
        if clocks is not None:
            self.clock = float(clocks[me])
        return gathered[at[me]:at[me + 1]].to(send.device, copy=True)

    def _allreduce(self, t: torch.Tensor, op: str, out: torch.Tensor | None = None) -> torch.Tensor:
        fn = {"sum": torch.add, "max": torch.maximum, "min": torch.minimum}[op]
        total = self._exchange(f"allreduce/{op}", t, lambda parts: _fold(fn, parts))
        return total.clone() if out is None else out.copy_(total)

    def _reduce_scatter(self, t: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        total = self._exchange("reduce_scatter", t, lambda parts: _fold(torch.add, parts))
        m = t.numel() // self.size
        mine = total[self.rank * m:(self.rank + 1) * m]
        return mine.clone() if out is None else out.copy_(mine)

    def _allgather_dense(self, chunk: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        gathered = self._exchange("allgather_dense", chunk, torch.cat)
        return gathered if out is None else out.copy_(gathered)

    def _broadcast(self, t: torch.Tensor, root: int) -> torch.Tensor:
        return self._exchange(f"broadcast/{root}", t)[root].clone()

    def _barrier(self) -> None:
        self._exchange("barrier", None)


def _rotation_clocks(sizes: np.ndarray, clocks: Sequence[float], window: int, alpha: "float | np.ndarray",
                     beta: "float | np.ndarray") -> np.ndarray:
    """Every rank's clock after the point-to-point rotation of ``Communicator._alltoallv``.

    Each rank posts window b + 1 before it waits for window b. A send of m bytes occupies
    its sender for beta m and arrives alpha + beta m after it starts; a receive completes
    no earlier than its arrival: the model of ``isend``/``irecv``, with the same floating
    point operations in the same order (so the same times to the bit), over the whole
    world at once. ``alpha`` and ``beta``: numbers, or [sender, receiver] matrices (two levels).
    """
    P = len(clocks)
    clock = np.array(clocks, dtype=np.float64)
    ranks = np.arange(P)[:, None]
    arrivals: dict[int, np.ndarray] = {}

    def send(first: int) -> None:
        nonlocal clock
        steps = np.arange(first, min(first + window, P))[None, :]
        dst = (ranks + steps) % P
        nbytes = sizes[ranks, dst]
        a, b = (alpha[ranks, dst], beta[ranks, dst]) if np.ndim(alpha) else (alpha, beta)
        acc = np.cumsum(np.concatenate([clock[:, None], b * nbytes], axis=1), axis=1)
        clock = acc[:, -1]
        arrivals[first] = acc[:, :-1] + a + b * nbytes  # [sender, step]

    def wait(first: int) -> None:
        nonlocal clock
        steps = np.arange(first, min(first + window, P))[None, :]
        src = (ranks - steps) % P
        arrived = arrivals.pop(first)[src, steps - first]
        arrived = np.where(sizes[src, ranks] > 0, arrived, -np.inf)
        clock = np.maximum(clock, arrived.max(axis=1))

    firsts = list(range(1, P, window))
    if firsts:
        send(firsts[0])
    for b, first in enumerate(firsts):
        if b + 1 < len(firsts):
            send(firsts[b + 1])
        wait(first)
    return clock


def _fold(fn: Callable, parts: list[torch.Tensor]) -> torch.Tensor:
    """Reduce in rank order, so every run gives the same bits."""
    out = parts[0].clone()
    for p in parts[1:]:
        fn(out, p, out=out)
    return out


def _raise_if_message(result: Any) -> Any:
    if isinstance(result, str):
        raise ValueError(result)
    return result


def _join(threads: list[threading.Thread], world: _World, results: list[Any],
          errors: list[tuple[float, int, BaseException]]) -> None:
    """Join the rank threads; once a rank failed, give the others ``timeout`` seconds.

    A rank blocked outside sparsecomm (``time.sleep``, an Event that is never
    set) would otherwise keep ``simulate`` from returning: it is abandoned (its
    thread is a daemon) and reported as timed out.
    """
    deadline = None
    for t in threads:
        while t.is_alive():
            t.join(0.2)
            if deadline is None and world.failure is not None:
                deadline = time.monotonic() + world.timeout
            if deadline is not None and time.monotonic() > deadline:
                break
    for rank, t in enumerate(threads):
        if t.is_alive():
            exc = CommTimeoutError(f"rank {rank}: still running {world.timeout:g} s after rank "
                                   f"{world.failure[0]} failed; abandoned (blocked outside sparsecomm?)")
            errors.append((time.monotonic(), rank, exc))
            results[rank] = exc


def single_rank(timeout: float | None = None, name: str = "sim") -> SimCommunicator:
    """The communicator of a world of one rank (every collective returns its input)."""
    comm = SimCommunicator(0, _World(1, default_timeout() if timeout is None else float(timeout), None))
    comm.name = name
    return comm


@dataclass
class SimResult:
    """What ``simulate`` returns: per-rank results, traffic stats and modelled time."""

    results: list[Any]
    stats: list[dict]
    time: list[float] | None


def simulate(world_size: int, fn: Callable[..., Any], *args: Any,
             network: "str | tuple[float, float] | Network | TwoLevel | None" = None,
             timeout: float | None = None, return_exceptions: bool = False,
             **kwargs: Any) -> SimResult:
    """Run ``fn(rank, *args, **kwargs)`` on every rank of a simulated world.

    1. Build a world of ``world_size`` ranks sharing mailboxes and rendezvous slots.
    2. Start one thread per rank; inside it ``sparsecomm.allreduce`` (and
       ``sparsecomm.comm.current()``) use that rank's communicator.
    3. Join the threads; if any rank raised, re-raise the first original error
       (peers' resulting PeerErrors are secondary), unless ``return_exceptions``.

    Args:
        world_size: number of virtual ranks (>= 1).
        fn: called as ``fn(rank, *args, **kwargs)`` once per rank.
        network: None, a profile name ("pizdaint", "10gbe", "56gbib", "100gbib"),
            an ``(alpha, beta)`` pair or a :class:`~sparsecomm.network.Network`.
        timeout: seconds any wait may take (default ``$SPARSECOMM_TIMEOUT`` or 300).
        return_exceptions: put exceptions in ``.results`` instead of raising.

    Returns:
        SimResult with ``.results`` (one per rank), ``.stats`` (per-rank dicts with
        bytes_sent, bytes_received, messages_sent, messages_received) and ``.time``
        (per-rank modelled communication seconds, or None without ``network``).
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"simulate: world_size must be a positive int, got {world_size!r}")
    net = resolve_network(network)
    world = _World(world_size, default_timeout() if timeout is None else float(timeout), net)
    comms = [SimCommunicator(r, world) for r in range(world_size)]
    results: list[Any] = [None] * world_size
    errors: list[tuple[float, int, BaseException]] = []

    def run(rank: int) -> None:
        _local.comm = comms[rank]
        try:
            _acquire_run(world, rank)
            results[rank] = fn(rank, *args, **kwargs)
        except BaseException as exc:  # noqa: BLE001 - every failure must reach the caller
            errors.append((time.monotonic(), rank, exc))
            results[rank] = exc
            world.fail(rank, exc)
        finally:
            _local.comm = None
            _release_run(world)

    if world_size == 1:
        run(0)
    else:
        threads = [threading.Thread(target=run, args=(r,), name=f"sim-rank-{r}", daemon=True)
                   for r in range(world_size)]
        for t in threads:
            t.start()
        _join(threads, world, results, errors)
    if errors and not return_exceptions:
        primary = [e for e in sorted(errors, key=lambda e: e[:2]) if not isinstance(e[2], PeerError)]
        _, rank, exc = (primary or sorted(errors, key=lambda e: e[:2]))[0]
        if hasattr(exc, "add_note"):
            exc.add_note(f"(raised on simulated rank {rank} of {world_size})")
        raise exc
    return SimResult(results=results,
                     stats=[c.stats.as_dict() for c in comms],
                     time=[c.clock for c in comms] if net is not None else None)
