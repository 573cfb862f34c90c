"""DeAR: each fused group's allreduce split in two, the second half and the update in the next forward.

    sched = sparsecomm.schedules.DeAR(model, optimizer, algorithm="dense")
    for x, y in data:
        optimizer.zero_grad()
        loss_fn(model(x), y).backward()   # first phases start as groups become ready
        sched.step()                      # queues the second phases; the updates come later
    sched.synchronize()                   # apply what is pending (before evaluating or saving)

Fusion: consecutive modules that own parameters (forward order) join a group
until it holds ``buffer_bytes``; a parameter shared by several modules (tied
weights) is owned by the first, and every module that uses it waits for its
group's update. Per step (DeAR paper, section 4 of
``../shared/papers/README.md``):

1. BackPipe: when a group's gradients are all ready, its first phase is a
   job on the engine, groups in backward order:
   :func:`sparsecomm.begin_allreduce`, the algorithm's first half where it
   registered two (``AlgorithmSpec.split``): dense, with or without a
   compressor, a reduce-scatter; Ok-Topk split-and-reduce and the global
   selection; TopkDSA its sparse reduce-scatter. Algorithms with no natural
   split (TopkA, gTopk, Gaussiank) run whole here.
2. ``step()`` (the end of backward) queues every group's second phase
   (``Pending.finish``: dense the all-gather, Ok-Topk balance and
   allgatherv, then the residual update), in forward order, and returns
   without waiting. The engine runs jobs in order, so the link goes from
   the last first phase straight into the first all-gathers while this
   thread moves on to the next forward. (Started from the pre-hooks
   instead, one group ahead, the all-gathers waited for the forward to
   reach them: dense on the 12-layer model, P = 2, 1 Gbit/s, 495 -> 482 ms
   a step.)
3. FeedPipe: a forward pre-hook on each group's modules (the first to run
   acts), in the next forward: wait for the group's second phase (a first
   phase's error surfaces here), write the gradients, and step the
   optimizer on this group's parameters only (the wrapped optimizer keeps
   its state: the other parameters' gradients are hidden for that call);
   the group's gradients are then set to None, so the coming backward
   starts afresh. A group none of whose modules ran (a branch skipped on
   this step, or on this rank) gets its update just before its next first
   phase, in backward or in ``step()``; its gradient is reduced as zeros
   where it got none, as every rank must take part.

Fusion size: fixed, or ``buffer_bytes="auto"``: tuned online by Bayesian
optimisation, as the paper does (10-20 trials of a few steps over 1-100 MB,
expected improvement): optuna's Gaussian-process sampler on rank 0, each
trial's time the slowest rank's, the proposal broadcast; regrouping moves
every parameter's residual to its new group.

Any ``torch.optim`` optimizer that skips parameters without a gradient
(all of torch's do) works. An LR scheduler stepped after ``sched.step()``
applies to the deferred updates (they run in the next forward).

Training-loop rules (docs/guarantees.md; the same in every schedule):

* A refused call (``InputError``, on every rank alike) is found at the next
  forward's first update (the first phases have all run by then): that
  step applies nothing, the other groups' results are carried to the next
  step, and the error is raised by the next ``step()`` (or ``synchronize()``),
  once; the forward and backward in between go on.
* A backward that raised is noticed at the next forward: the groups it
  started are finished and carried.
* ``no_sync()`` accumulates backwards locally; the next backward reduces the sum.
* A layer frozen or unfrozen (on every rank alike) is seen at the next
  forward: the pending updates are applied, then the groups are rebuilt.
* With ``scaler=``, DeAR drives the scaler itself, since its updates are per
  group (``GradScaler.step`` takes one call per step): the loop is
  ``scaler.scale(loss).backward(); sched.step()``, without ``scaler.step``
  or ``scaler.update``. Each group's reduced gradient is unscaled as it is
  applied; a NaN/Inf refusal skips the step on every rank and lowers the
  scale by the scaler's backoff factor; ``growth_interval`` steps in a row
  without one raise it by its growth factor, as ``GradScaler.update`` does.
"""

from __future__ import annotations

from typing import Any

import torch

from ..api import begin_allreduce
from ..errors import InputError, NonFiniteError, ScheduleError
from ..memory import (GradientMemory, StateMaker, active_scaler, adopt_states, flat_dtype, hold_residual,
                      join_residuals, snapshot, split_residual)
from .base import Schedule, check_layers, check_optimizer, layer_settings, refused_job
from .engine import (Engine, Job, at_backward_end, grad_versions, grads_changed, second_backward,
                     write_grads)
from .dear_tuner import FusionTuner

__all__ = ["DeAR"]


class DeAR(Schedule):
    """Decoupled allreduce with per-group just-in-time updates (see the module docstring).

    Args:
        model, optimizer: the model and any ``torch.optim`` optimizer over its parameters.
        buffer_bytes: fusion size: a group closes once it holds this many gradient
            bytes; ``"auto"``: tuned online (``tune_trials`` trials of
            ``tune_steps`` steps, sizes in ``tune_range``, Bayesian optimisation
            with optuna's Gaussian-process sampler on rank 0; see ``trials``).
        algorithm, density, compressor, op: as for :func:`sparsecomm.allreduce`; ``"auto"``:
            per group, the algorithm ``sparsecomm.choose`` picks for its size.
        error_feedback, algorithm_options: the algorithm states' settings (one per group).
        network: the profile ``"auto"`` models (``sparsecomm.choice.profile``).
        group, comm: the ranks (the engine duplicates them: collective).
        engine_threads: torch threads of the communication thread.
        scaler: a ``torch.amp.GradScaler``, which DeAR then drives (module docstring).
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *,
                 buffer_bytes: int | str = 4 << 20, algorithm: str = "dense", density: float = 1.0,
                 compressor: Any = None, op: str = "avg", error_feedback: bool = True,
                 algorithm_options: dict | None = None, group: Any = None, comm: Any = None,
                 engine_threads: int = 1, tune_trials: int = 12, tune_steps: int = 5,
                 tune_range: tuple[int, int] = (1 << 20, 100 << 20), tune_seed: int = 0, scaler: Any = None,
                 network: Any = None) -> None:
        self.tuning = buffer_bytes == "auto"
        if not self.tuning and (isinstance(buffer_bytes, bool) or not isinstance(buffer_bytes, int)
                                or buffer_bytes < 1):
            raise ValueError(f"buffer_bytes must be an integer >= 1 or 'auto', got {buffer_bytes!r}")
        if tune_trials < 1 or tune_steps < 2 or not 1 <= tune_range[0] < tune_range[1]:
            raise ValueError("need tune_trials >= 1, tune_steps >= 2 and 1 <= tune_range[0] < tune_range[1]")
        self.model, self.optimizer = model, optimizer
        self.algorithm, self.density, self.compressor, self.op = algorithm, density, compressor, op
        self._all = list(model.parameters())
        self._flags = tuple(p.requires_grad for p in self._all)
        if not any(self._flags):
            raise ValueError("the model has no trainable parameters")
        check_optimizer(optimizer, model, "DeAR")
        self.scaler = active_scaler(scaler)
        maker = StateMaker(algorithm, density, algorithm_options, error_feedback, compressor, network)
        self._memory = GradientMemory(maker, self.scaler)
        self._step_scale = 1.0  # the loss scale of the last backward
        self._pending_scale = 1.0  # the loss scale of the step whose updates are pending
        self._forwarded = False  # the model's forward ran since this backward's first gradient
        self._good_steps = 0  # steps applied in a row (the scaler's growth)
        self._accumulating = False
        self._ended = True  # the last backward ran to its end
        self.engine = Engine(group=group, comm=comm, threads=engine_threads, name="sparsecomm-dear")
        self._handles: list[Any] = []
        self.groups: list[list[torch.nn.Module]] = []
        self.params: list[list[torch.nn.Parameter]] = []
        self.states: list[Any] = []
        self._pending = False  # second phases queued whose updates wait for their forward
        self._verdict: bool | None = True  # None: the pending step is not yet decided (see _decide)
        self._refused: Exception | None = None  # a refused step's error, for the next step() to raise
        self._failed: Exception | None = None  # the first failed call found while updating
        self.trials: list[tuple[int, float]] = []  # (buffer bytes, seconds per step) of each trial
        self._tune = None
        if self.tuning:
            self._tune = FusionTuner(self, tune_trials, tune_steps, tune_range, tune_seed)
            buffer_bytes = self._tune.first()
        self.regroup(int(buffer_bytes))
        # Before every module's own pre-hook: recover from a backward that raised, follow freezing.
        self._root_handle = model.register_forward_pre_hook(lambda *args: self._at_forward(), prepend=True)

    def regroup(self, buffer_bytes: int) -> None:
        """Fuse anew with ``buffer_bytes`` (every rank the same, between steps, nothing pending).

        Residuals move with their parameters (error feedback keeps every bit);
        thresholds and boundaries restart, as for a state of a new tensor.
        """
        if self._pending:
            raise RuntimeError("DeAR.regroup: updates are pending; call synchronize() first")
        residuals, self._memory.parked = dict(self._memory.parked), {}
        for gi, (ps, st) in enumerate(zip(self.params, self.states)):
            r = getattr(st, "residual", None)
            held, now = (self._group_scale[gi], self._memory.scale.value) if self.scaler is not None else (None, None)
            if r is not None and held is not None and now is not None and held != now:
                r = r * (now / held)  # every residual moves (and is parked) in the current scale
            residuals.update(split_residual(ps, r))
        for h in self._handles:
            h.remove()
        self.buffer_bytes = buffer_bytes
        self._modules = [m for m in self.model.modules()
                         if any(p.requires_grad for p in m.parameters(recurse=False))]
        # A parameter shared by several modules (tied weights) belongs to the first module that
        # holds it: reduced once, updated once.
        seen: set[int] = set()
        owned = []
        for m in self._modules:
            new = [p for p in m.parameters(recurse=False) if p.requires_grad and id(p) not in seen]
            seen.update(id(p) for p in new)
            if new:
                owned.append((m, new))
        self.groups, self.params = [[]], [[]]
        size = 0
        for m, new in owned:
            if size >= buffer_bytes:
                self.groups.append([])
                self.params.append([])
                size = 0
            self.groups[-1].append(m)
            self.params[-1] += new
            size += sum(p.numel() * p.element_size() for p in new)
        self.states = [self._memory.maker.for_params(ps, self.engine.comm) for ps in self.params]
        for ps, st in zip(self.params, self.states):
            hold_residual(st, join_residuals(ps, residuals))
        self._memory.parked = residuals  # layers not trainable now keep theirs for when they are again
        self._group_scale = [self._memory.scale.value] * len(self.groups)  # the loss scale of each residual
        self._group_of = {id(p): gi for gi, ps in enumerate(self.params) for p in ps}
        # Per group: the gathered gradients, and the result in a buffer of its own, which the
        # first half's fused pass zeroes on its way (as the group schedules do, see groups.py).
        self._buffers: list[torch.Tensor | None] = [None] * len(self.groups)
        self._results: list[torch.Tensor | None] = [None] * len(self.groups)
        self._handles = [p.register_post_accumulate_grad_hook(self._on_grad) for ps in self.params for p in ps]
        # On every module, for the groups of every parameter it uses: whichever runs first applies
        # the update (models need not call their modules in registration order).
        self._handles += [m.register_forward_pre_hook(self._before_forward(
            sorted({self._group_of[id(p)] for p in m.parameters(recurse=False) if p.requires_grad})))
            for m in self._modules]
        self._first: list[Job | None] = [None] * len(self.groups)  # phase 1 of this step
        self._second: list[Job | None] = [None] * len(self.groups)  # phase 2, started in forward
        self._reset_backward()

    # ---- backward: first phases ----------------------------------------------------------
    def _reset_backward(self) -> None:
        self._missing = [len(ps) for ps in self.params]
        self._next = len(self.groups) - 1  # first phases start from the last group
        self._arrived: set[int] = set()
        self._queued = False  # an end-of-backward callback is pending
        self._seen: dict[int, list] = {}  # per group started in backward: its grads and versions at its end

    def _on_grad(self, p: torch.nn.Parameter) -> None:
        if self._accumulating:  # no_sync(): the gradient accumulates; a later backward reduces it
            return
        if id(p) in self._arrived:
            if self._ended:
                raise second_backward("DeAR")
            if not self._forwarded:  # no forward since: a second gradient within one backward
                raise ScheduleError(
                    f"DeAR: a parameter (shape {tuple(p.shape)}) got its gradient twice in one backward (a "
                    "weight shared by two reentrant checkpoints?); its group's first phase had started from "
                    "the first. Use torch.utils.checkpoint(..., use_reentrant=False).")
            self._recover()  # the backward that delivered it raised
        if not self._arrived:  # the first gradient of a backward
            self._ended, self._forwarded = False, False
            if self.scaler is not None:
                ratio = self._memory.scale.moved()
                self._step_scale = self._memory.scale.value
                for r in self._memory.parked.values():  # parked residuals are kept in the current scale
                    r.mul_(ratio or 1.0)
        if not self._queued:  # the last end wins: a reentrant checkpoint's inner backward ends first
            self._queued = True
            at_backward_end(self._backward_ended)
        self._arrived.add(id(p))
        gi = self._group_of[id(p)]
        self._missing[gi] -= 1
        while self._next >= 0 and self._missing[self._next] == 0:
            self._first[self._next] = self._start_first(self._next)
            self._next -= 1

    def _flat(self, gi: int) -> torch.Tensor:
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params[gi]]
        n = sum(g.numel() for g in grads)
        buf = self._buffers[gi]
        dtype = flat_dtype(grads)
        if buf is None or buf.numel() != n or buf.dtype != dtype:
            buf = self._buffers[gi] = torch.empty(n, dtype=dtype, device=grads[0].device)
            self._results[gi] = torch.empty_like(buf)
        torch.cat([g.reshape(-1) for g in grads], out=buf)
        return buf

    def _start_first(self, gi: int) -> Job:
        if self._second[gi] is not None:  # last step's update is still pending (see _catch_up)
            self._catch_up(gi)
        state = self.states[gi]
        if self.scaler is not None:  # the residual follows the loss scale (see LossScale)
            held = self._group_scale[gi]
            if held is not None and held != self._step_scale and getattr(state, "residual", None) is not None:
                state.residual.mul_(self._step_scale / held)
            self._group_scale[gi] = self._step_scale
        try:
            buf = self._flat(gi)
        except Exception as exc:  # noqa: BLE001 - refused on every rank by the call's own check
            return refused_job(self.engine, f"DeAR could not gather group {gi}'s gradients: "
                               f"{type(exc).__name__}: {exc}", sum(p.numel() for p in self.params[gi]))
        out = self._results[gi]
        return self.engine.run(lambda c: begin_allreduce(buf, comm=c, state=state, op=self.op,
                                                         compressor=self.compressor, out=out),
                               what=f"first half of group {gi}'s allreduce")

    def _backward_ended(self) -> None:
        self._queued, self._ended = False, True
        self._seen = {gi: grad_versions(self.params[gi]) for gi in range(self._next + 1, len(self.groups))}

    def step(self) -> None:
        """End of backward: queue every second phase; the updates follow in the next forward.

        The engine runs jobs in submission order, so each group's second phase
        (queued here in forward order) starts as soon as the communication
        thread is free after the first phases, with no wait on this thread: the
        link stays busy from the last reduce-scatter into the first all-gathers
        while the caller moves on to its next forward (each group's forward
        pre-hook waits for its own). A failed call's error surfaces there, once: the
        other groups' updates are applied first, and the failed group's gradient
        stays out of the update (a refused call keeps it in its residual).

        Raises :class:`~sparsecomm.ScheduleError` (after queueing, so every rank
        made the same calls) if gradients whose first phase started in backward
        were changed since backward ended: the change would be lost.
        """
        changed = None
        for gi, seen in self._seen.items():
            changed = changed or grads_changed(
                self.params[gi], seen, "DeAR", "DeAR reduces and updates group by group: change gradients inside "
                "the optimizer, or use a schedule that reduces what step() finds (PipeSGD).")
        if self._next >= 0:  # groups that got no gradient this step (unused): reduce zeros
            self._missing = [0] * len(self.groups)
            while self._next >= 0:
                self._first[self._next] = self._start_first(self._next)
                self._next -= 1
        for gi in range(len(self.groups)):
            if self._second[gi] is None:
                self._start_second(gi)
        self._pending, self._verdict = True, None  # decided at the first update (see _decide)
        self._pending_scale = self._step_scale
        self._reset_backward()
        try:
            if self._tune is not None:
                self._tune.after_step()
        finally:
            if self._refused is not None:  # the last step's refusal, found in this forward
                error, self._refused = self._refused, None
                raise error
            if changed is not None:  # raised last, so every rank made the same calls
                raise changed

    def _catch_up(self, gi: int) -> None:
        """Apply the group's update from the last step before its new first phase starts.

        A group none of whose modules ran in this forward had no pre-hook to apply it. Its
        buffers are about to be reused (the new first phase zeroes the result buffer the
        pending update lives in), so the update goes in now, during backward (its
        parameters' gradients are accumulated: the same point as an optimizer-in-backward
        hook) or in ``step()``. This step's gradients, already in ``.grad``, are set aside
        for the optimizer's call and put back; a failure is raised by the next update.
        """
        if self._verdict is None:
            self._decide()
            if self._second[gi] is None:  # carried by a refused step
                return
        params = self.params[gi]
        fresh = [p.grad for p in params]
        for p in params:
            p.grad = None
        flat = self._take(gi)
        try:
            self._apply(gi, flat)
        finally:
            for p, g in zip(params, fresh):
                p.grad = g

    # ---- forward: second phases and updates -------------------------------------------------
    def _start_second(self, gi: int) -> None:
        first = self._first[gi]
        # Jobs run in order: when this one runs, the first phase is done (its value, or its error).
        self._second[gi] = self.engine.run(lambda c: first.future.value().finish(),
                                           what=f"second half of group {gi}'s allreduce")

    def _before_forward(self, groups: list[int]):
        def hook(module: torch.nn.Module, args: Any) -> None:
            for gi in groups:
                if self._pending and self._second[gi] is not None:  # not yet updated this forward
                    self._update(gi)
        return hook

    def _update(self, gi: int) -> None:
        if self._verdict is None:
            self._decide()  # the step's first update: all its first phases have run
            if self._second[gi] is None:  # the step was skipped (a scaler's overflow): carried
                return
        flat = self._take(gi)
        if self._failed is not None:  # a call failed: the other groups' updates go in now, then its error
            error = self._failed
            self._apply(gi, flat)
            for other in range(len(self.groups)):
                if self._second[other] is not None:
                    self._apply(other, self._take(other))
            self._failed = None
            raise error
        self._apply(gi, flat)

    def _decide(self) -> None:
        """At the pending step's first update: apply it, or (a call refused) carry it and skip.

        The engine runs jobs in order, so once any second phase is waited for every
        first phase has run; a refusal (collective) shows there on every rank alike.
        A refused step applies nothing: every group's result is carried (unscaled) to the
        next step and its error raised once here, unless a scaler takes a NaN/Inf refusal
        as its skipped step (the scale drops). Otherwise the scaler's growth is counted.
        """
        self._verdict = True
        errors = []
        for job in self._first:
            if job is not None:
                try:
                    job.wait()
                except InputError as exc:
                    errors.append(exc)
                except Exception:  # noqa: BLE001 - a broken engine: its second phase raises it (_failed)
                    pass
        if not errors:
            self._scaler_update(skipped=False)
            return
        for gi in range(len(self.groups)):
            if self._second[gi] is None:
                continue
            flat = self._take(gi)  # its .grad is the user's to clear (zero_grad), or this backward's
            if flat is not None:
                self._memory.carry.keep(self.params[gi], flat / self._pending_scale if self.scaler is not None else flat)
        self._failed = None  # the refused calls' own errors: handled here
        if self.scaler is not None and all(isinstance(e, NonFiniteError) for e in errors):
            self._scaler_update(skipped=True)
            return
        error = errors[0]
        error.args = (f"{error.args[0]} (DeAR: the step applies nothing; what other groups reduced is carried "
                      "to the next step)",) + error.args[1:]
        # Raised by the next step() (or synchronize()), not here in a forward: that batch's forward
        # and backward go on, so its gradient is taken like any other.
        self._refused = error

    def _scaler_update(self, skipped: bool) -> None:
        """What ``GradScaler.update`` does after a step, for the step DeAR applied or skipped."""
        if self.scaler is None or not self.scaler.is_enabled():
            return
        scale = self._pending_scale
        if skipped:
            self._good_steps, scale = 0, scale * self.scaler.get_backoff_factor()
        else:
            self._good_steps += 1
            if self._good_steps == self.scaler.get_growth_interval():
                self._good_steps, scale = 0, scale * self.scaler.get_growth_factor()
        self.scaler.update(scale)

    def _take(self, gi: int) -> torch.Tensor | None:
        """The group's reduced gradient (None if its call failed: the error in ``_failed``);
        the group is done with either way, so no later forward or synchronize() raises it again."""
        job = self._second[gi]  # queued by step()
        self._second[gi] = None
        self._first[gi] = None
        if all(j is None for j in self._second):
            self._pending = False
        try:
            return job.wait()
        except Exception as exc:  # InputError, CommTimeoutError: raised by the caller of _update
            self._failed = self._failed or exc
            return None

    def _apply(self, gi: int, flat: torch.Tensor | None) -> None:
        """Step the optimizer on the group with its reduced gradient (none: no step)."""
        if flat is not None:
            write_grads(self.params[gi], flat)
            if self.scaler is not None:  # unscaled as applied (DeAR drives the scaler)
                for p in self.params[gi]:
                    p.grad.div_(self._pending_scale)
            self._memory.carry.add_into(self.params[gi])
            self._step_only(self.params[gi])
        for p in self.params[gi]:  # the backward about to run accumulates afresh
            p.grad = None

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
        if self._pending and self._verdict is None:
            self._decide()
        for gi in range(len(self.groups)):
            if self._pending and self._second[gi] is not None:
                self._update(gi)
        self._pending = False
        if self._failed is not None:  # found by a catch-up (see _catch_up) with nothing left to update
            error, self._failed = self._failed, None
            raise error
        if self._refused is not None:
            error, self._refused = self._refused, None
            raise error

    def finish(self) -> None:
        """Apply every pending update (:meth:`synchronize`), after recovering from a backward that raised."""
        if self._arrived and not self._ended and not self._accumulating:
            self._recover()
        self.synchronize()

    # ---- between steps ---------------------------------------------------------------------
    def _at_forward(self) -> None:
        """At each forward, before any group's update: recover from a backward that raised, and
        follow layers frozen or unfrozen."""
        self._forwarded = True
        if self._arrived and not self._ended and not self._accumulating:
            self._recover()
        flags = tuple(p.requires_grad for p in self._all)
        if flags != self._flags and not self._arrived:
            self.synchronize()  # the pending updates are for the old groups
            for p, trains in zip(self._all, flags):
                if not trains:
                    p.grad = None  # no longer reduced: a stale one would be stepped by each rank alone
            self._flags = flags
            self.regroup(self.buffer_bytes)

    def _recover(self) -> None:
        """A backward raised after some first phases started: finish them and carry their results.

        Every rank whose backward raised at the same point started the same ones. Last step's
        updates (if still pending) go in first, as they would have.
        """
        try:
            self.synchronize()
        except InputError as exc:  # last step's refusal: still for the next step() to raise
            self._refused = exc
        started = [gi for gi in range(self._next + 1, len(self.groups)) if self._first[gi] is not None]
        for gi in started:
            self._start_second(gi)
        for gi in started:
            try:
                flat = self._second[gi].wait()
            except Exception:  # noqa: BLE001 - refused alike on every rank (dropped), or a broken engine
                flat = None
            self._first[gi] = self._second[gi] = None
            if flat is not None:
                self._memory.carry.keep(self.params[gi], flat / self._step_scale if self.scaler is not None else flat)
        self._reset_backward()
        self._ended = True

    # ---- checkpoints -----------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Fusion size, per-group algorithm states, parked residuals, carried results and the
        scaler's bookkeeping: with nothing pending (``synchronize()`` first)."""
        if self._pending or self._arrived:
            raise ScheduleError("DeAR.state_dict: updates are pending; call synchronize() first")
        self._at_forward()  # follow the layers frozen since, as the next forward would
        index = {id(p): i for i, p in enumerate(self._all)}
        return {"schedule": "DeAR", "layers": layer_settings(self._all), "trainable": list(self._flags),
                "buffer_bytes": self.buffer_bytes, "states": [snapshot(st) for st in self.states],
                **self._memory.state_dict(index), "group_scale": list(self._group_scale), "good_steps": self._good_steps, "trials": list(self.trials)}

    def load_state_dict(self, d: dict) -> None:
        """Restore a :meth:`state_dict` of the same model (ValueError for another model's); this
        schedule's settings win (another algorithm's saved states give only their residuals)."""
        check_layers(d["layers"], self._all, "DeAR")
        self.synchronize()
        for p, trains in zip(self._all, d["trainable"]):
            p.requires_grad_(trains)
        self._flags = tuple(d["trainable"])
        if self._tune is not None:  # the saved run had its fusion size: tuning is over
            self._tune, self.tuning = None, False
        self.regroup(d["buffer_bytes"])
        self.states = adopt_states(d["states"], self.states, "DeAR", self._memory.maker)
        self._memory.load_state_dict(d, lambda i: id(self._all[i]), lambda i: self._all[i].device)
        self._group_scale = list(d["group_scale"])
        self._good_steps, self.trials = d["good_steps"], list(d["trials"])

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._root_handle.remove()
        self.engine.close()
