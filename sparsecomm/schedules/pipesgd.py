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

Training-loop rules (docs/guarantees.md; the same in every schedule):
a refused call raises ``InputError`` from the ``step()`` that would have
applied it (the step after its own) and that step applies nothing; the job
submitted by that step is kept and applied at the next. Backwards accumulate
until ``step()`` (it reduces what it finds, so ``no_sync()`` changes
nothing). With ``scaler=``, Pipe-SGD drives the scaler (the loop is
``scaler.scale(loss).backward(); sched.step()``: it calls ``scaler.step`` and
``scaler.update`` for each update it applies, as its first step applies
none); a NaN/Inf refusal makes the gradients Inf for ``scaler.step`` to skip
the update, and the residual and a result in flight follow the scale.
Freezing or unfreezing a layer is seen at ``step()``: the gradient in
flight is applied first, then the buffers and the state are
rebuilt over the trainable layers (residuals move with their layers).
"""

from __future__ import annotations

from typing import Any

import torch

from ..errors import InputError, NonFiniteError
from ..memory import (GradientMemory, StateMaker, active_scaler, adopt_states, flat_dtype, hold_residual,
                      join_residuals, snapshot, split_residual)
from .base import Schedule, check_layers, check_optimizer, layer_settings, optimizer_size, refused_job
from .engine import Engine, Job, grads_in, point_grads, write_grads

__all__ = ["PipeSGD"]


class PipeSGD(Schedule):
    """One-step-stale data parallelism with a sparsecomm allreduce per step.

    Args:
        model: the module whose trainable parameters are reduced.
        optimizer: any ``torch.optim`` optimizer over them (the model's only).
        warmup_steps: synchronous steps first (the paper's warm-up epochs).
        algorithm, density, compressor, op: as for :func:`sparsecomm.allreduce`; ``"auto"``: the
            algorithm ``sparsecomm.choose`` picks for the trainable parameters' size.
        error_feedback, algorithm_options: the algorithm state's settings.
        network: the profile ``"auto"`` models (``sparsecomm.choice.profile``).
        group, comm: the ranks (the engine duplicates them: collective).
        engine_threads: torch threads of the communication thread.
        scaler: a ``torch.amp.GradScaler`` (see the module docstring); the
            updates then go through ``scaler.step(optimizer)``.
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, warmup_steps: int = 0,
                 algorithm: str = "oktopk", density: float = 0.01, compressor: Any = None, op: str = "avg",
                 error_feedback: bool = True, algorithm_options: dict | None = None, group: Any = None,
                 comm: Any = None, engine_threads: int = 1, scaler: Any = None, network: Any = None) -> None:
        if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 0:
            raise ValueError(f"warmup_steps must be an integer >= 0, got {warmup_steps!r}")
        self.model, self.optimizer, self.warmup_steps = model, optimizer, warmup_steps
        self._all = list(model.parameters())
        self._flags = tuple(p.requires_grad for p in self._all)
        self.params = [p for p in self._all if p.requires_grad]
        if not self.params:
            raise ValueError("the model has no trainable parameters")
        check_optimizer(optimizer, model, "PipeSGD")
        self._opt_size = optimizer_size(optimizer)
        self.density = density
        self.scaler = active_scaler(scaler)
        maker = StateMaker(algorithm, density, algorithm_options, error_feedback, compressor, network)
        self._memory = GradientMemory(maker, self.scaler)
        self.engine = Engine(group=group, comm=comm, threads=engine_threads, name="sparsecomm-pipesgd")
        self.state = self._new_state()
        self.options = {"state": self.state, "op": op, "compressor": compressor}
        self._accumulating = False
        self._make_buffers()
        self.step_count = 0
        self._pending: Job | None = None  # the allreduce of the last step's gradient
        self._ready: torch.Tensor | None = None  # an aggregated gradient restored from a checkpoint

    def _make_buffers(self) -> None:
        n = sum(p.numel() for p in self.params)
        self._buffers = [torch.empty(n, dtype=flat_dtype(self.params), device=self.params[0].device)
                         for _ in range(3)]

    def _gather(self) -> torch.Tensor:
        buf = self._buffers[self.step_count % 3]  # see the module docstring for the rotation
        if grads_in(self.params, buf):  # the backward accumulated into it (see _apply)
            return buf
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        return torch.cat([g.reshape(-1) for g in grads], out=buf)

    def _submit(self) -> Job:
        try:
            buf = self._gather()
        except Exception as exc:  # noqa: BLE001 - refused on every rank by the call's own check
            return refused_job(self.engine, f"PipeSGD could not gather the gradients: {type(exc).__name__}: {exc}",
                               self._buffers[0].numel())
        return self.engine.submit(buf, out=self._buffers[(self.step_count + 2) % 3], **self.options)

    def _apply(self, flat: torch.Tensor) -> None:
        # The gradients become views of the result (no copy). In the pipelined steady state
        # that buffer is the next step's gather buffer: zero_grad(set_to_none=False) clears it
        # and the backward accumulates straight into it, so _gather has nothing to copy.
        if not point_grads(self.params, flat):
            write_grads(self.params, flat)
        self._optimizer_step()

    def _optimizer_step(self) -> None:
        if optimizer_size(self.optimizer) != self._opt_size:  # a param group was added
            check_optimizer(self.optimizer, self.model, "PipeSGD")
            self._opt_size = optimizer_size(self.optimizer)
        if self.scaler is not None:  # Pipe-SGD drives the scaler: a step may apply nothing (its first)
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()

    def _previous(self) -> torch.Tensor | None:
        """The aggregated gradient of the last step (waited for), or None; raises its call's error."""
        if self._ready is not None:
            ready, self._ready = self._ready, None
            return ready
        if self._pending is not None:
            job, self._pending = self._pending, None
            return job.wait()
        return None

    def _apply_previous(self, previous_of: Any) -> None:
        """Apply what ``previous_of()`` returns; a refused call applies nothing (Inf for a scaler)."""
        try:
            previous = previous_of()
        except NonFiniteError:
            if self.scaler is None:
                raise
            for p in self.params:  # the scaler finds the Inf and skips this update on every rank
                p.grad = torch.full_like(p, float("inf"))
            self._optimizer_step()
            return
        except InputError as exc:
            for p in self.params:
                p.grad = None
            exc.args = (f"{exc.args[0]} (PipeSGD: the step applies nothing; its own gradient is in flight "
                        "and applied at the next step)",) + exc.args[1:]
            raise
        if previous is not None:
            self._apply(previous)

    def _follow_scale(self) -> None:
        """Before a job reads the residual: rescale it, and a result not yet applied, when the
        loss scale moved (see LossScale); the job in flight is waited for first, as it writes both."""
        if self.scaler is None:
            return
        ratio = self._memory.scale.moved()
        if ratio is None:
            return
        if self._pending is not None:
            job, self._pending = self._pending, None
            try:
                self._ready = job.wait()
            except InputError:
                self._pending = job  # raised where it is applied, as without a scaler
        if self._ready is not None:
            self._ready.mul_(ratio)
        if getattr(self.state, "residual", None) is not None:
            self.state.residual.mul_(ratio)
        for r in self._memory.parked.values():
            r.mul_(ratio)

    def step(self) -> None:
        """After backward: start this step's allreduce, then update with the previous step's result."""
        self._follow_scale()  # first: what is in flight is in the last step's scale
        try:
            self._follow_trainable()
        except InputError as exc:  # the last step's call, refused: this step's gradient still goes
            self._pending, self._ready = self._submit(), None
            self.step_count += 1
            raise exc
        if self.step_count < self.warmup_steps:
            job = self._submit()
            self.step_count += 1
            self._apply_previous(job.wait)
            return
        job = self._submit()
        pending, ready = self._pending, self._ready
        # Job t is recorded before job t-1's error can be raised, so it is applied next step.
        self._pending, self._ready = job, None
        self.step_count += 1
        self._apply_previous(lambda: ready if ready is not None else (None if pending is None else pending.wait()))

    def synchronize(self) -> None:
        """Apply the gradient still in flight (the last step's), if any."""
        self._follow_scale()  # the scaler unscales by its scale now: the result in flight follows it
        self._apply_previous(self._previous)

    flush = finish = synchronize

    def _follow_trainable(self) -> None:
        """A layer frozen or unfrozen (every rank alike): apply what is in flight, then rebuild the
        buffers and the state over the trainable layers; residuals move with their layers."""
        flags = tuple(p.requires_grad for p in self._all)
        if flags == self._flags:
            return
        # This step's gradients are set aside while the result in flight (for the old layers) is
        # applied: a thawed layer's own local gradient would otherwise be stepped with it.
        grads = [p.grad for p in self._all]
        for p in self._all:
            p.grad = None
        try:
            self.synchronize()  # a refusal is raised by step() once this step's job is submitted
        finally:
            for p, g in zip(self._all, grads):
                p.grad = g
            self._rebuild(flags)

    def _rebuild(self, flags: tuple) -> None:
        """The buffers and the state over the layers ``flags`` marks trainable."""
        residuals = {**self._memory.parked, **split_residual(self.params, getattr(self.state, "residual", None))}
        for p, trains in zip(self._all, flags):
            if not trains:
                p.grad = None  # no longer reduced: a stale one would be stepped by each rank alone
        self._flags = flags
        self.params = [p for p in self._all if p.requires_grad]
        self.state = self._new_state()
        self.options["state"] = self.state
        hold_residual(self.state, join_residuals(self.params, residuals))
        self._memory.parked = {k: v for k, v in residuals.items() if k not in {id(p) for p in self.params}}
        self._make_buffers()

    def _new_state(self) -> Any:
        """A state for one call over the trainable parameters (one flat buffer of their dtype)."""
        return self._memory.maker.for_params(self.params, self.engine.comm)

    def state_dict(self) -> dict:
        """Step count, the algorithm state and the aggregated gradient in flight (waited for; a
        refused one is saved as nothing in flight, and still raised by this run's next step)."""
        try:
            self._follow_trainable()  # the layers frozen since, as the next step() would
        except InputError:
            pass  # the refused call in flight: nothing to save, and this run's next step() goes on
        job = self._pending
        try:
            pending = self._previous()
        except InputError:
            pending, self._pending = None, job
        self._ready = pending
        index = {id(p): i for i, p in enumerate(self._all)}
        return {"schedule": "PipeSGD", "layers": layer_settings(self._all), "trainable": list(self._flags),
                "step_count": self.step_count, "algorithm_state": snapshot(self.state),
                "in_flight": None if pending is None else pending.clone(), **self._memory.state_dict(index)}

    def load_state_dict(self, d: dict) -> None:
        """Restore a :meth:`state_dict` of the same model (ValueError for another model's); this
        schedule's settings win (another algorithm's saved state gives only its residual)."""
        check_layers(d["layers"], self._all, "PipeSGD")
        if self._pending is not None:
            self._pending.wait()
            self._pending = None
        for p, trains in zip(self._all, d["trainable"]):
            p.requires_grad_(trains)
        self._follow_trainable()
        self.step_count = d["step_count"]
        self.state = adopt_states([d["algorithm_state"]], [self.state], "PipeSGD", self._memory.maker)[0]
        self.options["state"] = self.state
        self._ready = None if d["in_flight"] is None else d["in_flight"].clone()
        self._memory.load_state_dict(d, lambda i: id(self._all[i]), lambda i: self._all[i].device)

    def close(self) -> None:
        self.engine.close()
