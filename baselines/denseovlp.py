"""DenseOvlp: dense allreduce per bucket, fired as soon as the bucket is ready in backward.

This is the overlap DDP does, written against sparsecomm's communicator so it
runs on every backend (simulated world included) and is measured the same way
as the sparse algorithms. It is a model-level wrapper, not a tensor allreduce,
so it is not in the algorithm registry.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Any

import torch

from ..comm import Communicator, resolve

__all__ = ["DenseOverlap"]


class DenseOverlap:
    """Overlap dense gradient allreduce with backward, bucket by bucket.

    1. Parameters are grouped, in reverse registration order (the order
       backward produces their gradients), into buckets of about
       ``bucket_bytes``.
    2. A post-accumulate-grad hook marks each gradient ready; when a bucket is
       complete it is handed to a communication thread.
    3. The thread reduces buckets strictly in bucket order (so every rank issues
       the same collectives in the same order): flatten, allreduce, write back.
    4. ``synchronize()`` (call it after backward, before the optimizer step)
       waits for the last bucket and re-arms the hooks for the next step.

    Args:
        model: the module whose gradients are reduced.
        bucket_bytes: target bucket size in bytes (DDP's default is 25 MiB).
        op: "avg" (DDP's convention) or "sum".
        group, comm: which ranks (see ``sparsecomm.resolve``).

    Attributes:
        stats: per step, seconds from the end of backward to the end of the
            last bucket ("exposed"), and the bytes each bucket sent.
    """

    def __init__(self, model: torch.nn.Module, bucket_bytes: int = 25 << 20, op: str = "avg",
                 group: Any = None, comm: Any = None) -> None:
        if op not in ("avg", "sum"):
            raise ValueError(f"op must be 'avg' or 'sum', got {op!r}")
        if bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
        self.comm: Communicator = resolve(group=group, comm=comm)
        self.op = op
        params = [p for p in model.parameters() if p.requires_grad]
        self.buckets: list[list[torch.nn.Parameter]] = []
        size = bucket_bytes
        for p in reversed(params):
            if size >= bucket_bytes:
                self.buckets.append([])
                size = 0
            self.buckets[-1].append(p)
            size += p.numel() * p.element_size()
        self._bucket_of = {id(p): b for b, ps in enumerate(self.buckets) for p in ps}
        self._missing = [len(ps) for ps in self.buckets]
        self._lock = threading.Lock()
        self._ready: "queue.Queue[int]" = queue.Queue()
        self._done = threading.Event()
        self._error: BaseException | None = None
        self.stats: dict[str, list] = {"exposed_seconds": [], "bucket_bytes_sent": []}
        self._handles = [p.register_post_accumulate_grad_hook(self._on_grad) for p in params]
        self._thread: threading.Thread | None = None

    def _on_grad(self, p: torch.nn.Parameter) -> None:
        if self._thread is None:  # first gradient of a step: start the communication thread
            self._done.clear()
            self._thread = threading.Thread(target=self._communicate, daemon=True,
                                            name=f"denseovlp-rank-{self.comm.rank}")
            self._thread.start()
        b = self._bucket_of[id(p)]
        with self._lock:
            self._missing[b] -= 1
            complete = self._missing[b] == 0
        if complete:
            self._ready.put(b)

    def _communicate(self) -> None:
        try:
            arrived: set[int] = set()
            sent = []
            for b in range(len(self.buckets)):  # strictly in bucket order on every rank
                while b not in arrived:
                    arrived.add(self._ready.get(timeout=self.comm.timeout))
                grads = [p.grad for p in self.buckets[b]]
                flat = torch.cat([g.reshape(-1) for g in grads])
                before = self.comm.stats.bytes_sent
                total = self.comm.allreduce(flat, "sum")
                sent.append(self.comm.stats.bytes_sent - before)
                if self.op == "avg":
                    total /= self.comm.size
                offset = 0
                for g in grads:
                    g.copy_(total[offset:offset + g.numel()].view_as(g))
                    offset += g.numel()
            self.stats["bucket_bytes_sent"].append(sent)
        except BaseException as exc:  # noqa: BLE001 - re-raised by synchronize()
            self._error = exc
        finally:
            self._done.set()

    def synchronize(self) -> None:
        """Wait until every bucket is reduced; raise what the communication thread raised."""
        if self._thread is None:
            raise RuntimeError("DenseOverlap.synchronize() called before any gradient was produced")
        t0 = time.perf_counter()
        with self.comm.idle():
            finished = self._done.wait(self.comm.timeout + 1)
        if not finished:
            raise TimeoutError(f"DenseOverlap: buckets not reduced within {self.comm.timeout:g} s")
        self.stats["exposed_seconds"].append(time.perf_counter() - t0)
        self._thread = None
        self._missing = [len(ps) for ps in self.buckets]
        if self._error is not None:
            err, self._error = self._error, None
            raise err

    def remove(self) -> None:
        """Detach the hooks from the model."""
        for h in self._handles:
            h.remove()
