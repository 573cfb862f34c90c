"""Group schedules outside DDP: the base that reduces layers in groups during backward, WFBP, SyncEASGD.

    sched = sparsecomm.schedules.MGWFBP(model, optimizer, algorithm="oktopk", density=0.01)
    for x, y in data:
        optimizer.zero_grad()
        loss_fn(model(x), y).backward()   # groups are reduced on the engine as they become ready
        sched.step()                      # wait for them, .grad become views of the results, optimizer.step()

A *layer* here is one trainable parameter tensor, numbered in
``model.parameters()`` order among those with ``requires_grad`` (forward
order for the usual models); backward produces them roughly last to first.
Layers travel in contiguous *groups*, each a sparsecomm allreduce (any
algorithm, compressor and state options) with a state of its own, so error
feedback, thresholds and boundaries persist per group:

* :class:`WFBP`: every layer alone, as soon as its gradient is ready.
* :class:`SyncEASGD`: one group of everything, after backward.
* :class:`~sparsecomm.schedules.mgwfbp.MGWFBP` (its own module): the groups
  of a merge plan made from profiled backward and allreduce times.

Readiness comes from ``register_post_accumulate_grad_hook``. Groups are
submitted strictly in plan order (a ready group waits for the ones before
it), so every rank issues the same collectives in the same order; the jobs
run on a :class:`~sparsecomm.schedules.Engine`.

Training-loop rules (docs/guarantees.md), the same in every schedule:

* A step with a refused call (``InputError``, raised on every rank alike)
  applies nothing: ``synchronize()``/``step()`` raise it with every ``.grad``
  set to None. The refused group's gradient is dropped, like a skipped batch;
  the other groups' results are carried to the next step (their residuals
  were already debited), so nothing else is lost.
* A backward that raised (an OOM skipped on every rank) is noticed at the next
  forward or backward: its started groups are waited for and carried.
* With ``scaler=`` (a ``torch.amp.GradScaler``), a call refused for NaN/Inf
  does not raise: its group's gradients become Inf on every rank, so
  ``scaler.step`` skips the step everywhere and the scale drops; the other
  groups are carried; residuals and carries follow the scale.
* ``no_sync()`` accumulates backwards locally; the next backward reduces the sum.
* Freezing or unfreezing a layer (``requires_grad``, on every rank alike) is
  seen at the next forward: the groups are rebuilt over the trainable layers,
  residuals move with their layers, and a frozen layer's ``.grad`` is None
  (no weight decay or momentum moves it).
"""

from __future__ import annotations

import time
from typing import Any, Sequence

import torch

from ..errors import InputError, NonFiniteError, ScheduleError
from ..memory import (GradientMemory, StateMaker, active_scaler, adopt_states, flat_dtype, hold_residual,
                      join_residuals, snapshot, split_residual)
from .base import Schedule, check_layers, check_optimizer, layer_settings, optimizer_size, refused_job
from .engine import (Engine, Job, at_backward_end, grad_versions, grads_changed, grads_in, point_grads,
                     second_backward, write_grads)

__all__ = ["GroupSchedule", "WFBP", "SyncEASGD"]


class GroupSchedule(Schedule):
    """Reduce a model's gradients in contiguous groups of layers on an engine, then step the optimizer.

    Args:
        model: the module whose parameters (with ``requires_grad``) are reduced.
        optimizer: any ``torch.optim`` optimizer over them (over the model's
            parameters only: ValueError otherwise, the ranks would drift apart).
        groups: lists of layer indexes (positions in the trainable
            parameters), in the order their allreduces start; each contiguous.
            After a layer is frozen or unfrozen: one group of every layer.
        algorithm, density, compressor, op: as for :func:`sparsecomm.allreduce`
            (``op`` "avg" by default, like DDP); ``algorithm="auto"``: per group, the
            algorithm ``sparsecomm.choose`` picks for its size (:class:`StateMaker`).
        error_feedback: for the sparse algorithms' states.
        algorithm_options: extra arguments of the algorithm's State.
        network: the profile ``"auto"`` models (``sparsecomm.choice.profile``).
        group, comm: the ranks; an engine duplicates them (collective).
        engine_threads: torch threads of the communication thread.
        scaler: a ``torch.amp.GradScaler`` for mixed precision (see the module
            docstring); ``step()`` then calls ``scaler.step(optimizer)``.
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 groups: Sequence[Sequence[int]] | None = None, *, algorithm: str = "oktopk",
                 density: float = 0.01, compressor: Any = None, op: str = "avg",
                 error_feedback: bool = True, algorithm_options: dict | None = None,
                 group: Any = None, comm: Any = None, engine_threads: int = 1, scaler: Any = None,
                 network: Any = None) -> None:
        self.model, self.optimizer = model, optimizer
        self._all = list(model.parameters())
        self._flags = tuple(p.requires_grad for p in self._all)
        self.params = [p for p in self._all if p.requires_grad]
        if not self.params:
            raise ValueError("the model has no trainable parameters")
        check_optimizer(optimizer, model, type(self).__name__)
        self._opt_size = optimizer_size(optimizer)
        self.algorithm, self.density, self.compressor, self.op = algorithm, density, compressor, op
        self.scaler = active_scaler(scaler)
        maker = StateMaker(algorithm, density, algorithm_options, error_feedback, compressor, network)
        self._memory = GradientMemory(maker, self.scaler)
        self._accumulating = False  # inside no_sync()
        self._forwarded = False  # the model's forward ran since this backward's first gradient
        self.engine = Engine(group=group, comm=comm, threads=engine_threads, name="sparsecomm-schedule")
        self._index = {id(p): i for i, p in enumerate(self.params)}
        self.set_groups(groups if groups is not None else self._default_groups())
        self._handles = [p.register_post_accumulate_grad_hook(self._on_grad) for p in self.params]
        self._forward_handle = model.register_forward_pre_hook(lambda *args: self._before_forward())
        self.stats: dict[str, list] = {"exposed_seconds": []}
        self._synchronized = False  # synchronize() ran, and neither a gradient nor the optimizer's step since
        self._opt_handle = optimizer.register_step_post_hook(lambda *args: setattr(self, "_synchronized", False))
        self.job_timings: list[tuple[int, float]] = []  # (elements, seconds on the thread), last step

    def _default_groups(self) -> list[list[int]]:
        """The groups to use at construction without ``groups=``, and after a layer froze or thawed."""
        return [list(range(len(self.params) - 1, -1, -1))]

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
        residuals = self._residuals_by_param()
        self.groups = [sorted(g, reverse=True) for g in groups]
        self._group_of = {i: gi for gi, g in enumerate(self.groups) for i in g}
        self._states = []
        # Error feedback keeps every bit across a re-plan: each layer's residual moves to its new
        # group (thresholds and boundaries restart, as for a state of a new tensor).
        for g in self.groups:
            params = [self.params[i] for i in g]
            st = self._memory.maker.for_params(params, self.engine.comm)
            hold_residual(st, join_residuals(params, residuals))
            self._states.append(st)
        self._memory.parked.update(residuals)  # layers not trainable now keep theirs for when they are again
        # Per group: the gathered gradients, and the result, in a buffer of its own so that
        # the fused pass zeroes it on its way (kernels.ef_select's zero_out) instead of a
        # pass over the group after the call, competing with backward for the core. The
        # gradients are then views of the result, and the two swap (see synchronize).
        self._buffers: list[torch.Tensor | None] = [None] * len(self.groups)
        self._results: list[torch.Tensor | None] = [None] * len(self.groups)
        self._reset()

    def _residuals_by_param(self) -> dict[int, torch.Tensor]:
        """Every residual held, by ``id`` of its parameter: the groups' slices and the parked ones."""
        out = dict(self._memory.parked)
        self._memory.parked = {}
        for i, r in self._layer_residuals().items():
            out[id(self.params[i])] = r
        return out

    def _layer_residuals(self) -> dict[int, torch.Tensor]:
        """Each layer's slice of its group's residual (a group lays its layers out in its order)."""
        out = {}
        for g, st in zip(getattr(self, "groups", []), getattr(self, "_states", [])):
            parts = split_residual([self.params[i] for i in g], getattr(st, "residual", None))
            out.update({i: parts[id(self.params[i])] for i in g if id(self.params[i]) in parts})
        return out

    def _reset(self) -> None:
        self._missing = [len(g) for g in self.groups]
        self._next = 0  # the next group to submit, in plan order
        self._jobs: list[Job] = []
        self._ready_at: dict[int, float] = {}
        self._t0: float | None = None
        self._seen: list | None = None  # every grad and its version when backward ended
        self._in_backward = 0  # groups submitted before then
        self._queued = False  # an end-of-backward callback is pending
        self._views_at: dict[int, int] = {}  # group -> its buffer's version when a job began reading it
        self._copied_at: dict[int, list] = {}  # group -> its own-storage grads and versions when copied
        self._changed: ScheduleError | None = None  # found at the end of backward
        self._rescaled = False  # the loss scale's move was applied this step

    # ---- between steps ---------------------------------------------------------------
    def _before_forward(self) -> None:
        """At each forward: recover from a backward that raised, follow frozen/unfrozen layers."""
        self._forwarded = True
        if self._aborted():
            self._recover()
        flags = tuple(p.requires_grad for p in self._all)
        if flags != self._flags and not self._ready_at and not self._jobs:
            self._retrain(flags)

    def _aborted(self) -> bool:
        # Gradients arrived but their backward never ended (the end-of-backward callback runs
        # only when the backward completes): it raised, and the user went on.
        return bool(self._ready_at) and self._seen is None and not self._accumulating

    def _recover(self) -> None:
        """A backward raised after some groups started: wait for them and carry their results.

        Every rank whose backward raised at the same point (a batch skipped on every rank)
        started the same groups, so these calls complete; their residuals were debited, so
        their results go to the next step. A refused one is dropped, like its batch.
        Noticed at the next forward of the model (or ``finish()``): a job started in the
        failed backward may still be reading gradients in place, so a loop that zeroes them
        in place (``zero_grad(set_to_none=False)``) calls ``finish()`` first.
        """
        for gi, job in enumerate(self._jobs):
            try:
                out = job.wait()
            except Exception:  # noqa: BLE001 - refused alike on every rank, or a broken engine (raised next)
                continue
            self._memory.carry.keep([self.params[i] for i in self.groups[gi]], out)
        self._reset()

    def _retrain(self, flags: tuple) -> None:
        """The trainable layers changed (every rank alike): rebuild the groups over them.

        Residuals move by parameter (a frozen layer's is parked until it trains again); a
        frozen layer's ``.grad`` is set to None, since it is no longer reduced and a stale one
        would be stepped (weight decay, momentum) by each rank on its own.
        """
        residuals = self._residuals_by_param()
        for h in self._handles:
            h.remove()
        for p, trains in zip(self._all, flags):
            if not trains:
                p.grad = None
        self._flags = flags
        self.params = [p for p in self._all if p.requires_grad]
        if not self.params:
            raise ScheduleError(f"{type(self).__name__}: every parameter of the model is frozen")
        self._index = {id(p): i for i, p in enumerate(self.params)}
        self._memory.parked = residuals
        self.groups, self._states = [], []
        self.set_groups(self._default_groups())
        self._handles = [p.register_post_accumulate_grad_hook(self._on_grad) for p in self.params]

    def _rescale(self) -> None:
        """Once per step, before its first call: follow the loss scaler's scale (see memory.LossScale)."""
        self._rescaled = True
        self._memory.rescale(self._memory.scale.moved(), self._states)

    # ---- during backward -------------------------------------------------------------
    def _on_grad(self, p: torch.nn.Parameter) -> None:
        if self._accumulating:  # no_sync(): the gradient accumulates; a later backward reduces it
            return
        i = self._index[id(p)]
        if i in self._ready_at:
            if self._seen is not None:
                raise second_backward(type(self).__name__)
            if not self._forwarded:  # no forward since: a second gradient within one backward
                raise ScheduleError(
                    f"{type(self).__name__}: a parameter (shape {tuple(p.shape)}) got its gradient twice in one "
                    "backward (a weight shared by two reentrant checkpoints?); its group's allreduce had "
                    "started from the first. Use torch.utils.checkpoint(..., use_reentrant=False), or "
                    "PipeSGD, which reduces what step() finds.")
            self._recover()  # the backward that delivered it raised (see _aborted)
        if not self._ready_at:  # the first gradient of a backward
            self._forwarded = False
        self._synchronized = False
        now = time.perf_counter()
        if self._t0 is None:
            self._t0 = now
        if not self._queued:  # the last end wins: a reentrant checkpoint's inner backward ends first
            self._queued = True
            at_backward_end(self._backward_ended)
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
        if not self._rescaled:
            self._rescale()
        params = [self.params[i] for i in self.groups[gi]]
        state = self._states[gi]
        try:
            buf = self._gather(gi, params)
        except Exception as exc:  # noqa: BLE001 - reported on every rank by the call's own check
            # This rank cannot gather (a gradient on the meta device, of the wrong shape, ...):
            # its call still runs, on a tensor the collective check refuses, so every rank
            # raises InputError instead of the others waiting out the timeout.
            problem = f"{type(self).__name__} could not gather group {gi}'s gradients: {type(exc).__name__}: {exc}"
            return refused_job(self.engine, problem, sum(p.numel() for p in params))
        return self.engine.submit(buf, state=state, op=self.op, compressor=self.compressor, out=self._results[gi])

    def _gather(self, gi: int, params: list[torch.nn.Parameter]) -> torch.Tensor:
        """The group's gradients in its flat buffer (reading them in place where they are its views)."""
        grads = [p.grad for p in params]
        buf = self._buffers[gi]
        numel = sum(g.numel() for g in grads)
        dtype = flat_dtype(grads)
        if buf is None or buf.numel() != numel or buf.dtype != dtype or buf.device != grads[0].device:
            buf = self._buffers[gi] = torch.empty(numel, dtype=dtype, device=grads[0].device)
            self._results[gi] = torch.empty_like(buf)
        if grads_in(params, buf):  # the backward accumulated into it (see synchronize): the job reads .grad
            self._views_at[gi] = buf._version
        else:
            if any(g.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr() for g in grads):
                buf.copy_(torch.cat([g.reshape(-1) for g in grads]))  # some still view buf: cat cannot write over them
            else:
                torch.cat([g.reshape(-1) for g in grads], out=buf)
            # A change after this copy is lost: checked at the end of backward for gradients with a
            # storage of their own (views of a shared buffer share a counter: later layers bump it).
            self._copied_at[gi] = [(g, g._version) for g in grads if g._base is None]
        return buf

    def _backward_ended(self) -> None:
        self._queued = False
        self._in_backward, self._seen = self._next, grad_versions(self.params)
        # A group's buffer is its own, so any change to it after its job began reading it (e.g.
        # a post-accumulate hook registered after the schedule's, pruning in place) is a race.
        raced = [gi for gi, version in self._views_at.items() if self._buffers[gi]._version != version]
        raced += [gi for gi, seen in self._copied_at.items() if any(g._version != v for g, v in seen)]
        if raced and self._changed is None:
            self._changed = ScheduleError(
                f"{type(self).__name__}: gradients changed in place during backward, after their group's "
                "allreduce had started from them (a gradient hook registered after the schedule's?). "
                "Change gradients before they are accumulated (tensor hooks), or after synchronize().")

    # ---- after backward ----------------------------------------------------------------
    def synchronize(self) -> None:
        """Wait for every group's allreduce and make the gradients views of the results.

        Layers that got no gradient this step (unused parameters) are reduced as zeros.
        To change the reduced gradients (clipping), call this, change them, then
        ``optimizer.step()`` (until the optimizer steps or a gradient arrives, a second call,
        or ``step()``, reduces nothing again). A change
        made before this call, to gradients whose allreduce started in backward, raises
        :class:`~sparsecomm.ScheduleError` (it would be lost) once the step is
        complete: the results are in the gradients, as every other rank has them.
        Changes through ``.data`` have a version counter of their own and escape the check.

        A refused call (``InputError`` on every rank) is raised here after every group
        was waited for, with every ``.grad`` None: the step applies nothing, the other
        groups' results are carried to the next step. With a scaler, a NaN/Inf refusal
        is not raised: its group's gradients are Inf, for the scaler to skip the step.
        """
        if self._synchronized:
            return
        changed = self._changed
        for gi in range(self._in_backward if self._seen is not None else 0):
            changed = changed or grads_changed(
                [self.params[i] for i in self.groups[gi]], [self._seen[i] for i in self.groups[gi]],
                type(self).__name__, "Call synchronize(), change the gradients, then optimizer.step().")
        for gi in range(self._next, len(self.groups)):
            for i in self.groups[gi]:
                p = self.params[i]
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            self._missing[gi] = 0
        self._submit_ready()
        t0 = time.perf_counter()
        self.job_timings = []
        outs: list[torch.Tensor | None] = []
        errors: list[Exception] = []
        for job in self._jobs:
            try:
                outs.append(job.wait())
            except Exception as exc:  # InputError alike on every rank, or a broken engine: wait the others
                outs.append(None)
                errors.append(exc)
        if errors:
            self.stats["exposed_seconds"].append(time.perf_counter() - t0)
            self._refused(outs, errors)  # raises, unless a scaler is to skip the step
            return
        for gi, (job, out) in enumerate(zip(self._jobs, outs)):
            self.job_timings.append((int(out.numel()), float(job.seconds)))
            params = [self.params[i] for i in self.groups[gi]]
            # The gradients become views of the result (no copy), and the two buffers swap
            # roles: after zero_grad(set_to_none=False) the next backward accumulates into
            # this one, so the next _submit copies nothing; the old input takes the result.
            if out is self._results[gi] and point_grads(params, out):
                self._buffers[gi], self._results[gi] = out, self._buffers[gi]
            else:
                write_grads(params, out)
            self._memory.carry.add_into(params)
        self.stats["exposed_seconds"].append(time.perf_counter() - t0)
        self._after_step()  # every rank makes its collective calls, whatever is raised below
        self._reset()
        self._synchronized = True
        if changed is not None:
            raise changed

    def _refused(self, outs: list, errors: list[Exception]) -> None:
        """A step with a failed call: carry what went through; Inf for a scaler, else raise.

        Raised alike on every rank (a refusal is collective), so no rank profiles this step
        and every rank starts the next one clean.
        """
        for gi, out in enumerate(outs):
            if out is not None:
                self._memory.carry.keep([self.params[i] for i in self.groups[gi]], out)
        self._reset()
        skip = self.scaler is not None and all(isinstance(e, NonFiniteError) for e in errors)
        for gi, out in enumerate(outs):
            for i in self.groups[gi]:
                p = self.params[i]
                # For the scaler, one Inf per refused group marks the step; the rest is carried.
                p.grad = torch.full_like(p, float("inf")) if skip and out is None else None
        if skip:
            self._synchronized = True
            return
        error = errors[0]
        if isinstance(error, InputError):
            error.args = (f"{error.args[0]} (the step applies nothing: every .grad is None; what other groups "
                          "reduced is carried to the next step)",) + error.args[1:]
        raise error

    def step(self) -> None:
        """:meth:`synchronize` (unless called since the backward), then the optimizer's step
        (``scaler.step(optimizer)`` with a scaler; taken before a :class:`~sparsecomm.ScheduleError`
        is raised, as on every other rank). A refused call raises from ``synchronize()``, and
        no parameter is stepped."""
        try:
            self.synchronize()
        except ScheduleError:
            self._optimizer_step()
            raise
        self._optimizer_step()

    def finish(self) -> None:
        """Nothing is left in flight after ``step()``; a backward not yet stepped raises ScheduleError
        (its allreduces are under way: call ``step()``). Unlike ``synchronize()``, which ends a step
        (after the optimizer stepped it reduces anew, as a rank without a backward must)."""
        if self._aborted():
            self._recover()
        if self._jobs or self._ready_at:
            raise ScheduleError(f"{type(self).__name__}.finish: a backward was not followed by step()")

    def _optimizer_step(self) -> None:
        if optimizer_size(self.optimizer) != self._opt_size:  # a param group was added
            check_optimizer(self.optimizer, self.model, type(self).__name__)
            self._opt_size = optimizer_size(self.optimizer)
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
        else:
            self.optimizer.step()

    def _after_step(self) -> None:
        """What a subclass does between steps (MG-WFBP: profile and plan)."""

    # ---- checkpoints --------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Groups, per-group algorithm states (residuals, thresholds), parked residuals, carried
        results and the loss scale seen: between steps (after ``step()``), never mid-step."""
        self._before_forward()  # recover, and follow the layers frozen since: what the next step would do
        if self._jobs or self._ready_at:
            raise ScheduleError(f"{type(self).__name__}.state_dict: a step is under way; call it after step()")
        index = {id(p): i for i, p in enumerate(self._all)}
        return {"schedule": type(self).__name__, "layers": layer_settings(self._all), "trainable": list(self._flags),
                "groups": [list(g) for g in self.groups], "states": [snapshot(st) for st in self._states],
                **self._memory.state_dict(index), **self._extra_state()}

    def load_state_dict(self, d: dict) -> None:
        """Restore a :meth:`state_dict` of the same model (ValueError for another model's).

        This schedule's settings win: saved states made with another algorithm, density or
        options are replaced by fresh ones that take their residuals (a warning says so).
        """
        what = type(self).__name__
        check_layers(d["layers"], self._all, what)
        for p, trains in zip(self._all, d["trainable"]):
            p.requires_grad_(trains)
        self._retrain(tuple(d["trainable"]))
        self.set_groups(d["groups"])
        self._states = adopt_states(d["states"], self._states, what, self._memory.maker)
        self._memory.load_state_dict(d, lambda i: id(self._all[i]), lambda i: self._all[i].device)
        self._load_extra_state(d)

    def _extra_state(self) -> dict:
        """What a subclass adds to :meth:`state_dict`."""
        return {}

    def _load_extra_state(self, d: dict) -> None:
        """What a subclass restores in :meth:`load_state_dict`."""

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._forward_handle.remove()
        self._opt_handle.remove()
        self.engine.close()


class WFBP(GroupSchedule):
    """Wait-free backpropagation: one allreduce per layer, started as soon as it is ready."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, **options: Any) -> None:
        super().__init__(model, optimizer, None, **options)

    def _default_groups(self) -> list[list[int]]:
        return [[i] for i in range(len(self.params) - 1, -1, -1)]


class SyncEASGD(GroupSchedule):
    """One allreduce of every gradient after backward (You et al.)."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, **options: Any) -> None:
        super().__init__(model, optimizer, None, **options)
