"""Communicator over an mpi4py communicator (COMM_WORLD by default).

Buffers move with the upper-case (buffer) mpi4py calls, never pickled. Every
operation is non-blocking (MPI-3 ``I*`` collectives) and completed by polling
``Test`` until the communicator's timeout, so a dead peer gives
CommTimeoutError naming the operation rather than a hang. MPI cannot cancel a
collective: after a timeout the communicator is unusable and the job should
abort (``MPI.COMM_WORLD.Abort``), as after any MPI error.

Data are passed as raw bytes (``MPI.BYTE``) where no arithmetic is needed, so
every torch dtype (bfloat16 included) works. Reductions run in float32 for
float16/bfloat16 (MPI has no such types) and in the tensor's dtype otherwise.
CUDA tensors are staged through host memory.
"""

from __future__ import annotations

import time
from typing import Any, Sequence

import numpy as np
import torch

from ..errors import CommTimeoutError
from .base import Communicator, Request

__all__ = ["MPICommunicator"]


def _mpi() -> Any:
    try:
        from mpi4py import MPI  # optional engine: imported when an MPI communicator is made
    except ImportError as exc:  # pragma: no cover - depends on the machine
        raise ImportError("the MPI backend needs mpi4py: pip install 'sparsecomm[mpi]' "
                          "(or pip install mpi4py mpich)") from exc
    return MPI


def _bytes(t: torch.Tensor) -> np.ndarray:
    """A writable uint8 numpy view of contiguous CPU tensor ``t``."""
    return t.reshape(-1).view(torch.uint8).numpy()


class _MPIRequest(Request):
    def __init__(self, comm: "MPICommunicator", req: Any, what: str, on_done: Any = None) -> None:
        self._comm, self._req, self._what, self._on_done = comm, req, what, on_done

    def wait(self) -> None:
        if self._req is None:
            return
        req, self._req = self._req, None
        self._comm._wait(req, self._what)
        if self._on_done is not None:
            self._on_done()


class MPICommunicator(Communicator):
    """Rank of an MPI communicator."""

    name = "mpi"

    def __init__(self, comm: Any = None, timeout: float | None = None) -> None:
        MPI = _mpi()
        self._MPI = MPI
        self.comm = comm if comm is not None else MPI.COMM_WORLD
        super().__init__(self.comm.Get_rank(), self.comm.Get_size(), timeout)

    def dup(self) -> "MPICommunicator":
        """``MPI_Comm_dup``: the same ranks in a new communication context."""
        return MPICommunicator(self.comm.Dup(), self.timeout)

    def _split(self, color: int, key: int) -> "MPICommunicator":
        """``MPI_Comm_split``, counted as the allgather of (color, key) pairs it makes."""
        self._count(16 * (self.size - 1), self.size - 1)
        return MPICommunicator(self.comm.Split(color, key), self.timeout)

    def supports_device(self, device: torch.device) -> bool:
        return device.type in ("cpu", "cuda")

    def _wait(self, req: Any, what: str) -> None:
        # Spin briefly for latency, then back off so a waiting rank does not burn a core.
        # MPI progresses only inside Test: the back-off stops at 100 us, since each pause
        # delays the peer's next step too (at 1 ms, Ok-Topk's call at P = 4 on 2 cores
        # took 1.3x as long; at P = 2 the same).
        deadline = time.monotonic() + self.timeout
        spins, pause = 0, 1e-6
        while not req.Test():
            spins += 1
            if spins > 100:
                if time.monotonic() > deadline:
                    raise CommTimeoutError(f"rank {self.rank}: {what} timed out after "
                                           f"{self.timeout:g} s (MPI)")
                time.sleep(pause)
                pause = min(pause * 2, 1e-4)

    # ---- point to point -----------------------------------------------------
    def isend(self, buf: torch.Tensor, dst: int, tag: int = 0) -> Request:
        self._count_p2p_send(buf)
        host = buf.detach().cpu().contiguous()
        req = self.comm.Isend([_bytes(host), self._MPI.BYTE], dst, tag)
        # ``host`` must stay alive until the send completes: keep it on the request.
        r = _MPIRequest(self, req, f"send of {buf.numel()} x {buf.dtype} to rank {dst} (tag {tag})")
        r._keep = host  # type: ignore[attr-defined]
        return r

    def irecv(self, buf: torch.Tensor, src: int, tag: int = 0) -> Request:
        host = buf if buf.device.type == "cpu" else torch.empty_like(buf, device="cpu")

        def done() -> None:
            if host is not buf:
                buf.copy_(host)
            self._count_p2p_recv(buf)

        req = self.comm.Irecv([_bytes(host), self._MPI.BYTE], src, tag)
        return _MPIRequest(self, req, f"recv of {buf.numel()} x {buf.dtype} from rank {src} (tag {tag})", done)

    # ---- collectives --------------------------------------------------------
    def _run(self, what: str, req: Any) -> None:
        self._wait(req, what)

    def _allgather(self, t: torch.Tensor) -> torch.Tensor:
        src = t.detach().cpu().contiguous()
        out = torch.empty((self.size, *t.shape), dtype=t.dtype)
        self._run("allgather", self.comm.Iallgather([_bytes(src), self._MPI.BYTE],
                                                   [_bytes(out), self._MPI.BYTE]))
        return out.to(t.device)

    def _allgatherv(self, t: torch.Tensor, counts: Sequence[int]) -> torch.Tensor:
        src = t.detach().cpu().contiguous()
        row = (t[0:1].numel() if t.shape[0] else int(np.prod(t.shape[1:]))) * t.element_size()
        sizes = [c * row for c in counts]
        displs = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64).tolist()
        out = torch.empty((sum(counts), *t.shape[1:]), dtype=t.dtype)
        self._run("allgatherv", self.comm.Iallgatherv(
            [_bytes(src), self._MPI.BYTE], [_bytes(out), (sizes, displs), self._MPI.BYTE]))
        return out.to(t.device)

    def _alltoall(self, t: torch.Tensor) -> torch.Tensor:
        src = t.detach().cpu().contiguous()
        out = torch.empty_like(src)
        self._run("alltoall", self.comm.Ialltoall([_bytes(src), self._MPI.BYTE],
                                                 [_bytes(out), self._MPI.BYTE]))
        return out.to(t.device)

    def _reduce_buffers(self, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        wide = t.dtype in (torch.float16, torch.bfloat16)
        src = t.detach().to("cpu", torch.float32 if wide else t.dtype).contiguous()
        if src is t:
            src = src.clone()
        return src, torch.empty_like(src)

    def _allreduce(self, t: torch.Tensor, op: str, out: torch.Tensor | None = None) -> torch.Tensor:
        mop = {"sum": self._MPI.SUM, "max": self._MPI.MAX, "min": self._MPI.MIN}[op]
        if out is not None and out.device.type == "cpu" and out.dtype not in (torch.float16, torch.bfloat16):
            # Straight into the caller's buffer (MPI_IN_PLACE when it is the input).
            src = self._MPI.IN_PLACE if out is t else t.detach().numpy()
            self._run(f"allreduce/{op}", self.comm.Iallreduce(src, out.numpy(), op=mop))
            return out
        src, res = self._reduce_buffers(t)
        self._run(f"allreduce/{op}", self.comm.Iallreduce(src.numpy(), res.numpy(), op=mop))
        return res.to(t.device, t.dtype) if out is None else out.copy_(res)

    def _reduce_scatter(self, t: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        # Only read: no copy of a float32/float64 host tensor (and no result-sized spare).
        src = t.detach().to("cpu", torch.float32 if t.dtype in (torch.float16, torch.bfloat16) else t.dtype)
        direct = out is not None and out.device.type == "cpu" and out.dtype == src.dtype
        res = out if direct else torch.empty(t.numel() // self.size, dtype=src.dtype)
        self._run("reduce_scatter", self.comm.Ireduce_scatter_block(src.numpy(), res.numpy(),
                                                                   op=self._MPI.SUM))
        if direct:
            return out
        return res.to(t.device, t.dtype) if out is None else out.copy_(res)

    def _allgather_dense(self, chunk: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        gathered = self._allgather(chunk).reshape(-1)
        return gathered if out is None else out.copy_(gathered)

    def _broadcast(self, t: torch.Tensor, root: int) -> torch.Tensor:
        out = t.detach().cpu().clone().contiguous()
        self._run(f"broadcast from rank {root}", self.comm.Ibcast([_bytes(out), self._MPI.BYTE], root))
        return out.to(t.device)

    def _barrier(self) -> None:
        self._run("barrier", self.comm.Ibarrier())
