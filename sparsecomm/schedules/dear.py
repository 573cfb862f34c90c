"""DeAR: each fused group's allreduce split in two, the second half and the update in the next forward.

    sched = sparsecomm.schedules.DeAR(model, optimizer, algorithm="dense")
    for x, y in data:
        optimizer.zero_grad()
        loss_fn(model(x), y).backward()   # first phases start as groups become ready
        sched.step()                      # waits for the first phases; the updates come later
    sched.synchronize()                   # apply what is pending (before evaluating or saving)

Fusion: consecutive modules that own parameters (forward order) join a group
until it holds ``buffer_bytes``. Per step (DeAR paper, section 4 of
``../shared/papers/README.md``):

1. BackPipe: when a group's gradients are all ready, its first phase is a
   job on the engine, groups in backward order: for ``dense`` without a
   compressor a reduce-scatter; every other algorithm and compressor runs
   its whole allreduce here (no natural split is implemented yet: Ok-Topk's
   split-and-reduce / balance-and-allgatherv split is still to do).
2. ``step()`` waits for the first phases (the end of backward).
3. FeedPipe: a forward pre-hook on each group's first module, in the next
   forward: start the group's second phase (dense: the all-gather) unless
   it is running, and the next group's, so that it overlaps this group's
   forward; wait for this one, write the gradients, and step the optimizer
   on this group's parameters only (the wrapped optimizer keeps its state:
   the other parameters' gradients are hidden for that call); the group's
   gradients are then set to None, so the coming backward starts afresh.

Any ``torch.optim`` optimizer that skips parameters without a gradient
(all of torch's do) works. An LR scheduler stepped after ``sched.step()``
applies to the deferred updates (they run in the next forward).
"""

from __future__ import annotations

from typing import Any

import torch

from .. import registry
from ..comm import Communicator
from .engine import Engine, Job

__all__ = ["DeAR"]


class DeAR:
    """Decoupled allreduce with per-group just-in-time updates (see the module docstring).

    Args:
        model, optimizer: the model and any ``torch.optim`` optimizer over its parameters.
        buffer_bytes: fusion size: a group closes once it holds this many gradient bytes.
        algorithm, density, compressor, op: as for :func:`sparsecomm.allreduce`.
        error_feedback, algorithm_options: the algorithm states' settings (one per group).
        group, comm: the ranks (the engine duplicates them: collective).
        engine_threads: torch threads of the communication thread.
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *,
                 buffer_bytes: int = 4 << 20, algorithm: str = "dense", density: float = 1.0,
                 compressor: Any = None, op: str = "avg", error_feedback: bool = True,
                 algorithm_options: dict | None = None, group: Any = None, comm: Any = None,
                 engine_threads: int = 1) -> None:
        if buffer_bytes < 1:
            raise ValueError(f"buffer_bytes must be >= 1, got {buffer_bytes!r}")
        self.model, self.optimizer = model, optimizer
        self.algorithm, self.density, self.compressor, self.op = algorithm, density, compressor, op
        kwargs = dict(algorithm_options or {})
        if algorithm != "dense":
            kwargs.setdefault("error_feedback", error_feedback)
        spec = registry.get(algorithm)
        self.split = algorithm == "dense" and compressor is None  # reduce-scatter + all-gather
        modules = [m for m in model.modules()
                   if any(p.requires_grad for p in m.parameters(recurse=False))]
        if not modules:
            raise ValueError("the model has no trainable parameters")
        self.groups: list[list[torch.nn.Module]] = [[]]
        size = 0
        for m in modules:
            if size >= buffer_bytes:
                self.groups.append([])
                size = 0
            self.groups[-1].append(m)
            size += sum(p.numel() * p.element_size() for p in m.parameters(recurse=False) if p.requires_grad)
        self.params = [[p for m in g for p in m.parameters(recurse=False) if p.requires_grad] for g in self.groups]
        self.states = [spec.state_class(density, **kwargs) for _ in self.groups]
        self.engine = Engine(group=group, comm=comm, threads=engine_threads, name="sparsecomm-dear")
        self._group_of = {id(p): gi for gi, ps in enumerate(self.params) for p in ps}
        self._buffers: list[torch.Tensor | None] = [None] * len(self.groups)
        self._handles = [p.register_post_accumulate_grad_hook(self._on_grad) for ps in self.params for p in ps]
        self._handles += [g[0].register_forward_pre_hook(self._before_forward(gi)) for gi, g in enumerate(self.groups)]
        self._first: list[Job | None] = [None] * len(self.groups)  # phase 1 of this step
        self._second: list[Job | None] = [None] * len(self.groups)  # phase 2, started in forward
        self._pending = False  # reduced first phases waiting for their forward
        self._reset_backward()

    # ---- backward: first phases ----------------------------------------------------------
    def _reset_backward(self) -> None:
        self._missing = [len(ps) for ps in self.params]
        self._next = len(self.groups) - 1  # first phases start from the last group

    def _on_grad(self, p: torch.nn.Parameter) -> None:
        gi = self._group_of[id(p)]
        self._missing[gi] -= 1
        while self._next >= 0 and self._missing[self._next] == 0:
            self._first[self._next] = self._start_first(self._next)
            self._next -= 1

    def _flat(self, gi: int) -> torch.Tensor:
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params[gi]]
        n = sum(g.numel() for g in grads)
        P = self.engine.comm.size
        padded = -(-n // P) * P if self.split else n
        buf = self._buffers[gi]
        if buf is None or buf.numel() != padded or buf.dtype != grads[0].dtype:
            buf = self._buffers[gi] = torch.zeros(padded, dtype=grads[0].dtype, device=grads[0].device)
        torch.cat([g.reshape(-1) for g in grads], out=buf[:n])
        return buf

    def _start_first(self, gi: int) -> Job:
        buf = self._flat(gi)
        if self.split:
            return self.engine.run(lambda c: c.reduce_scatter(buf), what=f"reduce-scatter of group {gi}")
        return self.engine.submit(buf, state=self.states[gi], op=self.op, compressor=self.compressor, out=buf)

    def step(self) -> None:
        """End of backward: wait for every first phase; the updates follow in the next forward."""
        if self._next >= 0:  # groups that got no gradient this step (unused): reduce zeros
            self._missing = [0] * len(self.groups)
            while self._next >= 0:
                self._first[self._next] = self._start_first(self._next)
                self._next -= 1
        for job in self._first:
            job.wait()
        self._pending = True
        self._reset_backward()

    # ---- forward: second phases and updates -------------------------------------------------
    def _start_second(self, gi: int) -> None:
        if not self.split:
            self._second[gi] = self._first[gi]  # whole in backward: nothing left to send
            return
        chunk = self._first[gi].wait()
        P = self.engine.comm.size

        def gather(c: Communicator) -> torch.Tensor:
            full = c.all_gather(chunk)
            return full / P if self.op == "avg" else full

        self._second[gi] = self.engine.run(gather, what=f"all-gather of group {gi}")

    def _before_forward(self, gi: int):
        def hook(module: torch.nn.Module, args: Any) -> None:
            if self._pending:
                self._update(gi)
        return hook

    def _update(self, gi: int) -> None:
        if self._second[gi] is None:
            self._start_second(gi)
        if gi + 1 < len(self.groups) and self._second[gi + 1] is None:
            self._start_second(gi + 1)  # overlaps this group's forward
        flat = self._second[gi].wait()
        self._second[gi] = None
        self._first[gi] = None
        offset = 0
        for p in self.params[gi]:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            p.grad.copy_(flat[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
        self._step_only(self.params[gi])
        for p in self.params[gi]:  # the backward about to run accumulates afresh
            p.grad = None
        if all(job is None for job in self._first):
            self._pending = False

    def _step_only(self, params: list[torch.nn.Parameter]) -> None:
        """``optimizer.step()`` on ``params`` alone: the others' gradients are hidden for the call."""
        mine = {id(p) for p in params}
        hidden = []
        for pg in self.optimizer.param_groups:
            for p in pg["params"]:
                if id(p) not in mine and p.grad is not None:
                    hidden.append((p, p.grad))
                    p.grad = None
        try:
            self.optimizer.step()
        finally:
            for p, g in hidden:
                p.grad = g

    def synchronize(self) -> None:
        """Apply every pending update now (before evaluation, a checkpoint or a change of data)."""
        for gi in range(len(self.groups)):
            if self._pending and self._first[gi] is not None:
                self._update(gi)
        self._pending = False

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self.engine.close()
