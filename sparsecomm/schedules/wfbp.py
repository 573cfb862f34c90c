"""Wait-free backpropagation schedules outside DDP: WFBP, SyncEASGD and MG-WFBP.

    sched = sparsecomm.schedules.MGWFBP(model, optimizer, algorithm="oktopk", density=0.01)
    for x, y in data:
        optimizer.zero_grad()
        loss_fn(model(x), y).backward()   # groups are reduced on the engine as they become ready
        sched.step()                      # wait for them, write the gradients back, optimizer.step()

A *layer* here is one parameter tensor, numbered in ``model.parameters()``
order (forward order for the usual models); backward produces them roughly
last to first. Layers travel in contiguous *groups*, each a sparsecomm
allreduce (any algorithm, compressor and state options) with a state of its
own, so error feedback, thresholds and boundaries persist per group:

* :class:`WFBP`: every layer alone, as soon as its gradient is ready.
* :class:`SyncEASGD`: one group of everything, after backward.
* :class:`MGWFBP`: the groups of :func:`sparsecomm.schedules.plan_merge`, planned
  from per-layer backward times profiled over the first steps (averaged
  across ranks) and the a, b of T(M) = a + b M fitted from this algorithm's
  and compressor's allreduces of several sizes on the engine's communicator;
  rank 0 plans and broadcasts. Until then it runs as WFBP.

Readiness comes from ``register_post_accumulate_grad_hook``. Groups are
submitted strictly in plan order (a ready group waits for the ones before
it), so every rank issues the same collectives in the same order; the jobs
run on a :class:`~sparsecomm.schedules.Engine`.
"""

from __future__ import annotations

import time
from typing import Any, Sequence

import torch

from .. import registry
from ..api import allreduce
from ..comm import Communicator
from .engine import Engine, Job
from .planner import fit_linear, plan_merge

__all__ = ["GroupSchedule", "WFBP", "SyncEASGD", "MGWFBP"]


class GroupSchedule:
    """Reduce a model's gradients in contiguous groups of layers on an engine, then step the optimizer.

    Args:
        model: the module whose parameters (with ``requires_grad``) are reduced.
        optimizer: any ``torch.optim`` optimizer over them.
        groups: lists of layer indexes (positions in the trainable
            parameters), in the order their allreduces start; each contiguous.
        algorithm, density, compressor, op: as for :func:`sparsecomm.allreduce`
            (``op`` "avg" by default, like DDP).
        error_feedback: for the sparse algorithms' states.
        algorithm_options: extra arguments of the algorithm's State.
        group, comm: the ranks; an engine duplicates them (collective).
        engine_threads: torch threads of the communication thread.
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 groups: Sequence[Sequence[int]] | None = None, *, algorithm: str = "oktopk",
                 density: float = 0.01, compressor: Any = None, op: str = "avg",
                 error_feedback: bool = True, algorithm_options: dict | None = None,
                 group: Any = None, comm: Any = None, engine_threads: int = 1) -> None:
        self.model, self.optimizer = model, optimizer
        self.params = [p for p in model.parameters() if p.requires_grad]
        if not self.params:
            raise ValueError("the model has no trainable parameters")
        self.spec = registry.get(algorithm)
        self.algorithm, self.density, self.compressor, self.op = algorithm, density, compressor, op
        self._state_kwargs = dict(algorithm_options or {})
        if algorithm != "dense":
            self._state_kwargs.setdefault("error_feedback", error_feedback)
        self.spec.state_class(density, **self._state_kwargs)  # validate now
        self.engine = Engine(group=group, comm=comm, threads=engine_threads, name="sparsecomm-schedule")
        self._index = {id(p): i for i, p in enumerate(self.params)}
        self.set_groups(groups if groups is not None else [list(range(len(self.params) - 1, -1, -1))])
        self._handles = [p.register_post_accumulate_grad_hook(self._on_grad) for p in self.params]
        self.stats: dict[str, list] = {"exposed_seconds": []}

    # ---- groups --------------------------------------------------------------------
    def set_groups(self, groups: Sequence[Sequence[int]]) -> None:
        """Use ``groups`` from the next step on (every rank the same)."""
        L = len(self.params)
        flat = [i for g in groups for i in g]
        if sorted(flat) != list(range(L)):
            raise ValueError(f"groups must cover layers 0..{L - 1} once each, got {groups}")
        for g in groups:
            if sorted(g) != list(range(min(g), max(g) + 1)):
                raise ValueError(f"group {list(g)} is not contiguous")
        self.groups = [sorted(g, reverse=True) for g in groups]
        self._group_of = {i: gi for gi, g in enumerate(self.groups) for i in g}
        self._states = [self.spec.state_class(self.density, **self._state_kwargs) for _ in self.groups]
        self._buffers: list[torch.Tensor | None] = [None] * len(self.groups)
        self._reset()

    def _reset(self) -> None:
        self._missing = [len(g) for g in self.groups]
        self._next = 0  # the next group to submit, in plan order
        self._jobs: list[Job] = []
        self._ready_at: dict[int, float] = {}
        self._t0: float | None = None

    # ---- during backward -------------------------------------------------------------
    def _on_grad(self, p: torch.nn.Parameter) -> None:
        i = self._index[id(p)]
        now = time.perf_counter()
        if self._t0 is None:
            self._t0 = now
        self._ready_at[i] = now
        gi = self._group_of[i]
        self._missing[gi] -= 1
        if self._missing[gi] == 0:
            self._submit_ready()

    def _submit_ready(self) -> None:
        while self._next < len(self.groups) and self._missing[self._next] == 0:
            self._jobs.append(self._submit(self._next))
            self._next += 1

    def _submit(self, gi: int) -> Job:
        layers = self.groups[gi]
        grads = [self.params[i].grad for i in layers]
        buf = self._buffers[gi]
        numel = sum(g.numel() for g in grads)
        if buf is None or buf.numel() != numel or buf.dtype != grads[0].dtype or buf.device != grads[0].device:
            buf = self._buffers[gi] = torch.empty(numel, dtype=grads[0].dtype, device=grads[0].device)
        torch.cat([g.reshape(-1) for g in grads], out=buf)
        state = self._states[gi]
        return self.engine.submit(buf, state=state, op=self.op, compressor=self.compressor, out=buf)

    # ---- after backward ----------------------------------------------------------------
    def synchronize(self) -> None:
        """Wait for every group's allreduce and write the results into the gradients.

        Layers that got no gradient this step (unused parameters) are reduced as zeros.
        """
        for gi in range(self._next, len(self.groups)):
            for i in self.groups[gi]:
                p = self.params[i]
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            self._missing[gi] = 0
        self._submit_ready()
        t0 = time.perf_counter()
        for gi, job in enumerate(self._jobs):
            out = job.wait()
            offset = 0
            for i in self.groups[gi]:
                g = self.params[i].grad
                g.copy_(out[offset:offset + g.numel()].view_as(g))
                offset += g.numel()
        self.stats["exposed_seconds"].append(time.perf_counter() - t0)
        self._after_step()
        self._reset()

    def step(self) -> None:
        """:meth:`synchronize`, then the optimizer's step."""
        self.synchronize()
        self.optimizer.step()

    def _after_step(self) -> None:
        """What a subclass does between steps (MG-WFBP: profile and plan)."""

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self.engine.close()


class WFBP(GroupSchedule):
    """Wait-free backpropagation: one allreduce per layer, started as soon as it is ready."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, **options: Any) -> None:
        n = sum(1 for p in model.parameters() if p.requires_grad)
        super().__init__(model, optimizer, [[i] for i in range(n - 1, -1, -1)], **options)


class SyncEASGD(GroupSchedule):
    """One allreduce of every gradient after backward (You et al.)."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, **options: Any) -> None:
        super().__init__(model, optimizer, None, **options)


class MGWFBP(GroupSchedule):
    """MG-WFBP: layers merged by the exact plan of :func:`plan_merge`, profiled and fitted online.

    Args:
        profile_steps: steps run as WFBP while per-layer backward times are
            recorded (the first is skipped: warm-up).
        calibration_sizes: element counts of the allreduces timed to fit a and b
            (each timed ``calibration_rounds`` times after one untimed call).
        method: ``"optimal"`` or ``"mgwfbp"`` (the paper's Algorithm 1).
        replan_drift: re-plan when the mean per-layer backward time of the
            last ``profile_steps`` steps moved by more than this fraction.
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *,
                 profile_steps: int = 5, calibration_sizes: Sequence[int] = (1 << 12, 1 << 16, 1 << 20),
                 calibration_rounds: int = 3, method: str = "optimal", replan_drift: float = 0.25,
                 **options: Any) -> None:
        n = sum(1 for p in model.parameters() if p.requires_grad)
        super().__init__(model, optimizer, [[i] for i in range(n - 1, -1, -1)], **options)
        if profile_steps < 2:
            raise ValueError(f"profile_steps must be >= 2, got {profile_steps}")
        self.profile_steps, self.method, self.replan_drift = profile_steps, method, replan_drift
        self.calibration_sizes, self.calibration_rounds = list(calibration_sizes), calibration_rounds
        self.sizes = [p.numel() for p in self.params]
        self._profile: list[list[float]] = []
        self.a: float | None = None
        self.b: float | None = None
        self.backward_times: list[float] | None = None
        self.plans = 0

    def _layer_times(self) -> list[float]:
        """This step's backward time per layer: the gap since the gradient ready just before."""
        order = sorted(self._ready_at, key=self._ready_at.get)
        times = [0.0] * len(self.params)
        prev = self._t0
        for i in order:
            times[i] = self._ready_at[i] - prev
            prev = self._ready_at[i]
        return times

    def _after_step(self) -> None:
        if len(self._ready_at) == len(self.params):
            self._profile.append(self._layer_times())
        if len(self._profile) <= self.profile_steps:  # the first step is warm-up
            return
        recent = self._profile[1:]
        mean = [sum(t[i] for t in recent) / len(recent) for i in range(len(self.params))]
        self._profile = self._profile[:1]
        if self.backward_times is not None:
            old, new = sum(self.backward_times), sum(mean)
            if abs(new - old) <= self.replan_drift * old:
                return
        self._plan(mean)

    def _plan(self, local_times: list[float]) -> None:
        comm = self.engine.comm
        times = self.engine.run(lambda c: c.allreduce(torch.tensor(local_times, dtype=torch.float64,
                                                                   device=c.control_device), "sum"),
                                what="averaging the backward profile").wait()
        self.backward_times = (times / comm.size).tolist()
        if self.a is None:
            self.a, self.b = self.calibrate()
        cuts = torch.zeros(len(self.params), dtype=torch.int64, device=comm.control_device)
        if comm.rank == 0:
            for gi, g in enumerate(plan_merge(self.backward_times, self.sizes, self.a, self.b, self.method)):
                cuts[g] = gi
        cuts = self.engine.run(lambda c: c.broadcast(cuts, 0), what="broadcasting the plan").wait().tolist()
        groups: dict[int, list[int]] = {}
        for i, gi in enumerate(cuts):
            groups.setdefault(gi, []).append(i)
        self.set_groups([groups[gi] for gi in sorted(groups)])
        self.plans += 1

    def calibrate(self) -> tuple[float, float]:
        """a and b of this algorithm's allreduce (seconds, seconds per element) on the engine's
        communicator: every rank times the same calls; the slowest rank's medians are fitted."""
        def measure(comm: Communicator) -> list[float]:
            out = []
            for n in self.calibration_sizes:
                x = torch.randn(n, generator=torch.Generator().manual_seed(comm.rank))
                state = self.spec.state_class(self.density, **self._state_kwargs)
                allreduce(x, state=state, compressor=self.compressor, comm=comm)
                ts = []
                for _ in range(self.calibration_rounds):
                    comm.barrier()
                    t0 = time.perf_counter()
                    allreduce(x, state=state, compressor=self.compressor, comm=comm)
                    ts.append(time.perf_counter() - t0)
                out.append(sorted(ts)[len(ts) // 2])
            worst = comm.allreduce(torch.tensor(out, dtype=torch.float64, device=comm.control_device), "max")
            return worst.tolist()

        times = self.engine.run(measure, what="calibrating a and b").wait()
        return fit_linear(self.calibration_sizes, times)
