"""Pipe-SGD: each step's allreduce overlaps the next step's computation (iteration width K = 2).

    sched = sparsecomm.schedules.PipeSGD(model, optimizer, algorithm="oktopk", density=0.01)
    for x, y in data:
        optimizer.zero_grad()
        loss_fn(model(x), y).backward()
        sched.step()          # submit this step's gradient, apply the previous step's
    sched.flush()             # apply the last one (before evaluating or saving)

The update at step t uses the aggregated gradient of step t-1: staleness of
exactly one step, deterministic (Pipe-SGD paper, section 5 of
``../shared/papers/README.md``). A delay acts as extra momentum: on the
transformer LM of ``sparsecomm train``, SGD with momentum 0.9 that trains
synchronously diverged one step stale (dense too), and trained at momentum 0.5.
Lower the optimizer's momentum, or its learning rate, when moving to Pipe-SGD. The first ``warmup_steps`` steps are
synchronous (each applies its own aggregated gradient); the first pipelined
step applies nothing (its predecessor was applied synchronously).

Every step's gradient is reduced from a flat buffer on an engine with one
algorithm state (error feedback, thresholds) for the whole model, into
another buffer: three rotate. Step t gathers into buffer t mod 3 and its
job writes buffer t+2 mod 3, the input of job t-1, which the engine (one job
at a time, in order) has finished when job t starts. Buffer t+1 mod 3 holds
job t-1's result until step t applies it, by making the parameters'
gradients views of it (no copy). That buffer is step t+1's gather buffer: a
``zero_grad(set_to_none=False)`` clears it and the backward accumulates into
it, so the gather copies nothing (with ``set_to_none=True`` the backward
makes new gradients and the gather copies them). A result in a buffer of its own
lets the fused pass zero it on its way (``kernels.ef_select``'s
``zero_out``), instead of a pass over n after the call that would compete
with the next step's compute for the core. ``state_dict()``
holds what is in flight: it waits for the pending allreduce and saves its
result, so a resumed run applies it at its next step, as the uninterrupted
run would have.
"""

from __future__ import annotations

from typing import Any

import torch

from .. import registry
from .engine import Engine, Job, flat_dtype, grads_in, point_grads, write_grads

__all__ = ["PipeSGD"]


class PipeSGD:
    """One-step-stale data parallelism with a sparsecomm allreduce per step.

    Args:
        model: the module whose trainable parameters are reduced.
        optimizer: any ``torch.optim`` optimizer over them.
        warmup_steps: synchronous steps first (the paper's warm-up epochs).
        algorithm, density, compressor, op: as for :func:`sparsecomm.allreduce`.
        error_feedback, algorithm_options: the algorithm state's settings.
        group, comm: the ranks (the engine duplicates them: collective).
        engine_threads: torch threads of the communication thread.
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, warmup_steps: int = 0,
                 algorithm: str = "oktopk", density: float = 0.01, compressor: Any = None, op: str = "avg",
                 error_feedback: bool = True, algorithm_options: dict | None = None, group: Any = None,
                 comm: Any = None, engine_threads: int = 1) -> None:
        if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 0:
            raise ValueError(f"warmup_steps must be an integer >= 0, got {warmup_steps!r}")
        self.model, self.optimizer, self.warmup_steps = model, optimizer, warmup_steps
        self.params = [p for p in model.parameters() if p.requires_grad]
        if not self.params:
            raise ValueError("the model has no trainable parameters")
        kwargs = dict(algorithm_options or {})
        if algorithm != "dense":
            kwargs.setdefault("error_feedback", error_feedback)
        self.state = registry.get(algorithm).state_class(density, **kwargs)
        self.options = {"state": self.state, "op": op, "compressor": compressor}
        self.engine = Engine(group=group, comm=comm, threads=engine_threads, name="sparsecomm-pipesgd")
        n = sum(p.numel() for p in self.params)
        like = self.params[0]
        self._buffers = [torch.empty(n, dtype=flat_dtype(self.params), device=like.device) for _ in range(3)]
        self.step_count = 0
        self._pending: Job | None = None  # the allreduce of the last step's gradient
        self._ready: torch.Tensor | None = None  # an aggregated gradient restored from a checkpoint

    def _gather(self) -> torch.Tensor:
        buf = self._buffers[self.step_count % 3]  # see the module docstring for the rotation
        if grads_in(self.params, buf):  # the backward accumulated into it (see _apply)
            return buf
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        return torch.cat([g.reshape(-1) for g in grads], out=buf)

    def _submit(self, buf: torch.Tensor) -> Job:
        return self.engine.submit(buf, out=self._buffers[(self.step_count + 2) % 3], **self.options)

    def _apply(self, flat: torch.Tensor) -> None:
        # The gradients become views of the result (no copy). In the pipelined steady state
        # that buffer is the next step's gather buffer: zero_grad(set_to_none=False) clears it
        # and the backward accumulates straight into it, so _gather has nothing to copy.
        if not point_grads(self.params, flat):
            write_grads(self.params, flat)
        self.optimizer.step()

    def _previous(self) -> torch.Tensor | None:
        if self._ready is not None:
            ready, self._ready = self._ready, None
            return ready
        if self._pending is not None:
            job, self._pending = self._pending, None
            return job.wait()
        return None

    def step(self) -> None:
        """After backward: start this step's allreduce, then update with the previous step's result."""
        buf = self._gather()
        if self.step_count < self.warmup_steps:
            out = self._submit(buf).wait()
            self.step_count += 1
            self._apply(out)
            return
        job = self._submit(buf)
        previous = self._previous()
        self._pending = job
        self.step_count += 1
        if previous is not None:
            self._apply(previous)

    def flush(self) -> None:
        """Apply the gradient still in flight (the last step's), if any."""
        previous = self._previous()
        if previous is not None:
            self._apply(previous)

    def state_dict(self) -> dict:
        """Step count, the algorithm state and the aggregated gradient in flight (waited for)."""
        pending = self._previous()
        self._ready = pending
        return {"step_count": self.step_count, "algorithm_state": self.state,
                "in_flight": None if pending is None else pending.clone()}

    def load_state_dict(self, d: dict) -> None:
        if self._pending is not None:
            self._pending.wait()
            self._pending = None
        self.step_count = d["step_count"]
        self.state.__dict__.update(d["algorithm_state"].__dict__)
        self._ready = None if d["in_flight"] is None else d["in_flight"].clone()

    def close(self) -> None:
        self.engine.close()
