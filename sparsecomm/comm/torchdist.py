"""Communicator over an initialised torch.distributed process group (gloo, NCCL, ...).

Every operation is issued with ``async_op=True`` and waited on with the
communicator's timeout, so a dead or absent peer raises CommTimeoutError
naming the operation instead of blocking for the process group's own
(30-minute) timeout.

torch.distributed has no variable-size allgather: on gloo ``allgatherv`` and
``allgather_dense`` go point to point (each rank's part straight to every other,
faster than gloo's own all-gather on a slow link); elsewhere ``allgatherv``
pads every block to the largest and counts the padded bytes, since that is
what travels. gloo is
given CUDA tensors through host memory (each buffer copied to the host and the
result back, as the MPI backend does): a CUDA model under DDP with gloo works,
at the cost of the copies. NCCL takes CUDA tensors as they are.
"""

from __future__ import annotations

import contextlib
import datetime
import time
from typing import Any, Iterator, Sequence

import torch
import torch.distributed as dist

from ..errors import CommTimeoutError, PeerError
from .base import Communicator, Request

__all__ = ["TorchCommunicator"]

_TAG_RS = 0x5C31  # the point-to-point reduce-scatter (gloo)
_TAG_AG = 0x5C32  # the point-to-point all-gather (gloo)


class _TorchRequest(Request):
    def __init__(self, comm: "TorchCommunicator", work: Any, what: str,
                 on_done: Any = None) -> None:
        self._comm, self._work, self._what, self._on_done = comm, work, what, on_done

    def wait(self) -> None:
        if self._work is None:
            return
        work, self._work = self._work, None
        self._comm._wait(work, self._what)
        if self._on_done is not None:
            self._on_done()


class TorchCommunicator(Communicator):
    """Rank of a torch.distributed process group (default: the world group)."""

    def __init__(self, group: Any = None, timeout: float | None = None) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialised: call "
                               "torch.distributed.init_process_group first (or use torchrun)")
        self._dist = dist
        self.group = group if group is not None else dist.group.WORLD
        super().__init__(dist.get_rank(self.group), dist.get_world_size(self.group), timeout)
        self.backend = str(dist.get_backend(self.group)).lower()
        # torch >= 2.10 renamed the tensor-in/tensor-out collectives to *_single.
        self._all_gather_t = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        self._reduce_scatter_t = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        self.name = f"torch:{self.backend}"
        # gloo's point-to-point and all_to_all take CPU tensors only: stage every buffer.
        self._staged = self.backend == "gloo"

    def dup(self) -> "TorchCommunicator":
        """A new process group over the same ranks (``dist.new_group``: every process of the
        default group must call it, as torch.distributed requires)."""
        ranks = self._dist.get_process_group_ranks(self.group)
        return TorchCommunicator(self._dist.new_group(ranks=ranks, backend=self.backend), self.timeout)

    def _split(self, color: int, key: int) -> "TorchCommunicator":
        """A process group of this rank's part (``dist.new_group`` with local synchronisation:
        only the part's members create it, so parts need not be made in the same order)."""
        parts = self.split_colors(color, key)
        mine = next(part for part in parts if self.rank in part)
        if mine != sorted(mine):  # (every rank of the part sees the same order, so all raise)
            raise ValueError(f"split: torch.distributed orders a group's ranks by rank; keys that order "
                             f"them otherwise ({mine}) cannot be honoured")
        ranks = [self._global(r) for r in mine]
        group = self._dist.new_group(ranks=ranks, backend=self.backend, use_local_synchronization=True)
        return TorchCommunicator(group, self.timeout)

    def supports_device(self, device: torch.device) -> bool:
        if self.backend == "gloo":
            return device.type in ("cpu", "cuda")
        if self.backend == "nccl":
            return device.type == "cuda"
        return True

    @property
    def control_device(self) -> torch.device:
        if self.backend == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def _host(self, t: torch.Tensor) -> torch.Tensor:
        """``t``, or a host copy of it where this backend stages device buffers."""
        return t.cpu() if self._staged and t.device.type != "cpu" else t

    def _direct(self, out: torch.Tensor | None) -> bool:
        """Whether the backend can write into ``out`` itself (not staged through the host)."""
        return out is not None and not (self._staged and out.device.type != "cpu")

    # ---- waiting ---------------------------------------------------------------
    def _wait(self, work: Any, what: str) -> None:
        t0 = time.monotonic()
        try:
            ok = work.wait(timeout=datetime.timedelta(seconds=self.timeout))
        except RuntimeError as exc:
            elapsed = time.monotonic() - t0
            if elapsed < 0.9 * self.timeout:  # not a timeout: the transport failed
                raise PeerError(f"rank {self.rank}: {what} failed after {elapsed:.2g} s on "
                                f"{self.name}, before its {self.timeout:g} s timeout: a peer "
                                f"closed its connection or exited ({exc})") from exc
            raise CommTimeoutError(f"rank {self.rank}: {what} timed out after "
                                   f"{self.timeout:g} s on {self.name}: {exc}") from exc
        if ok is False:
            raise CommTimeoutError(f"rank {self.rank}: {what} timed out after {self.timeout:g} s "
                                   f"on {self.name}")

    def _destroyed(self) -> bool:
        """Whether this communicator's process group was destroyed under it."""
        if not self._dist.is_initialized():
            return True
        try:
            self._dist.get_process_group_ranks(self.group)
        except (ValueError, RuntimeError):
            return True
        return False

    @contextlib.contextmanager
    def _issuing(self, what: str) -> Iterator[None]:
        """Issue an operation: torch's error for a group destroyed under this communicator
        (``destroy_process_group()`` while a thread still calls, a ValueError "Group ... is not
        registered") becomes the library's :class:`PeerError`, as a peer gone does."""
        try:
            yield
        except (ValueError, RuntimeError) as exc:
            if not self._destroyed():
                raise
            raise PeerError(f"rank {self.rank}: {what} on {self.name}: its process group was destroyed "
                            f"(torch.distributed.destroy_process_group) while this communicator was in use "
                            f"({exc})") from exc

    def _global(self, rank: int) -> int:
        with self._issuing("a point-to-point operation"):
            return self._dist.get_global_rank(self.group, rank)

    # ---- point to point -----------------------------------------------------
    def isend(self, buf: torch.Tensor, dst: int, tag: int = 0) -> Request:
        self._count_p2p_send(buf)
        host = self._host(buf)
        work = self._dist.isend(host, self._global(dst), group=self.group, tag=tag)
        req = _TorchRequest(self, work, f"send of {buf.numel()} x {buf.dtype} to rank {dst} (tag {tag})")
        req._keep = host  # type: ignore[attr-defined]  # alive until the send completes
        return req

    def irecv(self, buf: torch.Tensor, src: int, tag: int = 0) -> Request:
        host = torch.empty_like(buf, device="cpu") if self._staged and buf.device.type != "cpu" else buf

        def done() -> None:
            if host is not buf:
                buf.copy_(host)
            self._count_p2p_recv(buf)

        work = self._dist.irecv(host, self._global(src), group=self.group, tag=tag)
        return _TorchRequest(self, work, f"recv of {buf.numel()} x {buf.dtype} from rank {src} (tag {tag})",
                             done)

    # ---- collectives --------------------------------------------------------
    def _run(self, what: str, fn: Any, *args: Any, **kwargs: Any) -> None:
        with self._issuing(what):
            work = fn(*args, group=self.group, async_op=True, **kwargs)
        self._wait(work, what)

    def _allgather(self, t: torch.Tensor) -> torch.Tensor:
        device, t = t.device, self._host(t)
        out = torch.empty((self.size, *t.shape), dtype=t.dtype, device=t.device)
        self._run("allgather", self._all_gather_t, out.view(-1), t.reshape(-1))
        return out.to(device)

    def _allgatherv(self, t: torch.Tensor, counts: Sequence[int]) -> torch.Tensor:
        device, t = t.device, self._host(t)
        if self.backend == "gloo" and self.size > 1:
            # Point to point, unpadded: gloo's all-gather took 186 ms for 12.5 MB per rank on a
            # 1 Gbit/s link where the bytes take 100 (dense q8's allgatherv, P = 2).
            out = torch.empty((sum(counts), *t.shape[1:]), dtype=t.dtype, device=t.device)
            self._gather_p2p(t, out.split(list(counts)))
            return out.to(device)
        largest = max(counts)
        row = t.shape[1:]
        padded = torch.zeros((largest, *row), dtype=t.dtype, device=t.device)
        padded[: t.shape[0]] = t
        # Padding travels too: count it beyond what the base class counted.
        row_bytes = padded[0:1].numel() * t.element_size() if largest else 0
        extra = row_bytes * (largest * (self.size - 1) - (sum(counts) - counts[self.rank]))
        self.stats.bytes_sent += extra
        self.stats.bytes_received += extra
        gathered = self._allgather(padded)
        return torch.cat([gathered[r, : counts[r]] for r in range(self.size)]).to(device)

    def _alltoall(self, t: torch.Tensor) -> torch.Tensor:
        device, t = t.device, self._host(t)
        out = torch.empty_like(t)
        self._run("alltoall", self._dist.all_to_all_single, out, t)
        return out.to(device)

    def _copy_on_host(self, t: torch.Tensor) -> torch.Tensor:
        """A private copy of ``t`` to reduce into: on the host where this backend stages."""
        host = self._host(t)
        return host.clone() if host is t else host

    def _allreduce(self, t: torch.Tensor, op: str, out: torch.Tensor | None = None) -> torch.Tensor:
        red = {"sum": self._dist.ReduceOp.SUM, "max": self._dist.ReduceOp.MAX,
               "min": self._dist.ReduceOp.MIN}[op]
        if self._direct(out):  # reduce in the caller's buffer
            if out is not t:
                out.copy_(t)
            self._run(f"allreduce/{op}", self._dist.all_reduce, out, op=red)
            return out
        res = self._copy_on_host(t)
        self._run(f"allreduce/{op}", self._dist.all_reduce, res, op=red)
        return res.to(t.device) if out is None else out.copy_(res)

    def _reduce_scatter(self, t: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        if self.backend == "gloo" and self.size > 1:
            res = self._reduce_scatter_p2p(t, out if self._direct(out) else None)
            return res if out is None or res is out else out.copy_(res)
        device, t = t.device, self._host(t)
        direct = self._direct(out)
        res = out if direct else torch.empty(t.numel() // self.size, dtype=t.dtype, device=t.device)
        self._run("reduce_scatter", self._reduce_scatter_t, res, t)
        if direct:
            return out
        return res.to(device) if out is None else out.copy_(res)

    def _inbox(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A receive buffer this communicator keeps (its calls run one at a time; it holds
        (P-1)/P of the largest reduce-scatter so far): a fresh one per call of a 50 MB
        reduce-scatter cost more in page faults than the sum."""
        nbytes = numel * dtype.itemsize
        buf = self.__dict__.get("_inbox_buf")
        if buf is None or buf.numel() < nbytes:
            buf = self._inbox_buf = torch.empty(nbytes, dtype=torch.uint8)
        return buf[:nbytes].view(dtype)

    def _reduce_scatter_p2p(self, t: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Reduce-scatter by point-to-point: chunk j of every rank goes straight to rank j.

        gloo's own reduce-scatter is an allreduce with the other chunks thrown
        away (pytorch/pytorch#118911): twice the bytes. Here each rank sends
        (P-1)/P of the tensor, the optimum, in P-1 messages rotated so that at
        step s rank i sends to i+s and receives from i-s; the parts are then
        summed in rank order (the simulated world's order, so results match it
        bit for bit).
        """
        device, t = t.device, self._host(t)
        P, me = self.size, self.rank
        m = t.numel() // P
        chunks = t.view(P, m)
        inbox = self._inbox((P - 1) * m, t.dtype)
        parts: list[torch.Tensor | None] = [None] * P
        parts[me] = chunks[me]
        sends, recvs = [], []
        for s in range(1, P):
            dst, src = (me + s) % P, (me - s) % P
            parts[src] = inbox[(s - 1) * m:s * m]
            recvs.append((self._dist.irecv(parts[src], self._global(src), group=self.group, tag=_TAG_RS), src))
            sends.append((self._dist.isend(chunks[dst], self._global(dst), group=self.group, tag=_TAG_RS), dst))
        try:
            for work, src in recvs:
                self._wait(work, f"reduce-scatter: receiving chunk {me} from rank {src}")
            for work, dst in sends:
                self._wait(work, f"reduce-scatter: sending chunk {dst} to rank {dst}")
        except BaseException:
            self._inbox_buf = None  # a late message must not land in the next call's buffer
            raise
        res = torch.add(parts[0], parts[1], out=out)  # in rank order, as the simulated world sums
        for part in parts[2:]:
            res += part
        return res.to(device)

    def _gather_p2p(self, t: torch.Tensor, out: "torch.Tensor | Sequence[torch.Tensor]") -> None:
        """``out[r]`` = rank r's ``t`` (each ``out[r]`` contiguous, sized as rank r's ``t``), by
        point-to-point sends.

        gloo's all-gather took 700 ms for 50 MB per rank on a 1 Gbit/s link,
        where the bytes take 400 ms (and its reduce-scatter, point to point,
        450); each rank sends its tensor straight to every other, rotated.
        Empty parts travel not at all (every rank knows every part's size).
        """
        P, me = self.size, self.rank
        flat = t.reshape(-1)
        out[me].view(-1).copy_(flat)
        recvs = [(self._dist.irecv(out[(me - s) % P].view(-1), self._global((me - s) % P), group=self.group,
                                   tag=_TAG_AG), (me - s) % P) for s in range(1, P) if out[(me - s) % P].numel()]
        sends = [(self._dist.isend(flat, self._global((me + s) % P), group=self.group, tag=_TAG_AG),
                  (me + s) % P) for s in range(1, P) if flat.numel()]
        for work, src in recvs:
            self._wait(work, f"all-gather: receiving rank {src}'s part")
        for work, dst in sends:
            self._wait(work, f"all-gather: sending to rank {dst}")

    def _allgather_dense(self, chunk: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        device, chunk = chunk.device, self._host(chunk)
        direct = self._direct(out)
        res = out if direct else torch.empty(chunk.numel() * self.size, dtype=chunk.dtype, device=chunk.device)
        if self.backend == "gloo" and self.size > 1:
            self._gather_p2p(chunk, res.view(self.size, -1))
        else:
            self._run("all_gather", self._all_gather_t, res, chunk)
        if direct:
            return out
        return res.to(device) if out is None else out.copy_(res)

    def _broadcast(self, t: torch.Tensor, root: int) -> torch.Tensor:
        out = self._copy_on_host(t)
        self._run(f"broadcast from rank {root}", self._dist.broadcast, out, self._global(root))
        return out.to(t.device)

    def _barrier(self) -> None:
        # A barrier is an allreduce of one element: gloo's barrier cannot be waited with a timeout.
        out = torch.zeros(1, device="cuda" if self.backend == "nccl" else "cpu")
        self._run("barrier", self._dist.all_reduce, out)
