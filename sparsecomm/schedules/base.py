"""What every schedule offers, and the pieces of training-loop bookkeeping they share.

:class:`Schedule` is the interface (``step``, ``synchronize``, ``no_sync``,
``state_dict``, ``load_state_dict``, ``close``) that WFBP, SyncEASGD, MG-WFBP,
DeAR and Pipe-SGD implement alike, so a training loop, a test or a benchmark
drives any of them the same way. The helpers below hold the rules they share:

* :func:`check_optimizer`: the optimizer steps only parameters of the model
  (one it steps that the schedule never reduces would drift apart across ranks).
* :class:`Carry`: the reduced results of a step that was not applied (a call of
  it refused on every rank, or a loss scaler skipping it), added to the same
  parameters' results at the next step that is, so no gradient is lost.
* :class:`LossScale`: residuals and carried results are in the loss scaler's
  units; when its scale changes between steps they are rescaled by new/old.
* :func:`layer_settings`, :func:`check_layers`: what a checkpoint must match.
* :class:`StateMaker`: the algorithm states of a schedule's calls (``algorithm="auto"``:
  chosen per call size), and :func:`hold_residual`, which gives a state a residual it
  will send.
"""

from __future__ import annotations

import contextlib
import copy
import warnings
from typing import Any, Iterator

import torch

from .. import choice, registry
from ..api import allreduce
from ..errors import InputError
from ..state import State
from .engine import flat_dtype

__all__ = ["Schedule", "Carry", "LossScale", "check_optimizer", "optimizer_size", "layer_settings", "check_layers",
           "state_settings", "adopt_state", "adopt_states", "refused_job", "snapshot", "active_scaler", "split_residual",
           "join_residuals", "StateMaker", "hold_residual"]


class Schedule:
    """The interface every schedule implements (see each subclass for what its steps do).

    A training loop::

        for x, y in data:
            optimizer.zero_grad()
            loss_fn(model(x), y).backward()
            sched.step()
        sched.finish()                # before evaluating or saving
        torch.save({"model": model.state_dict(), "opt": optimizer.state_dict(),
                    "sched": sched.state_dict()}, path)

    With a loss scaler (``scaler=`` given to the schedule), ``scaler.scale(loss).backward()``,
    then ``sched.step()`` (which calls ``scaler.step(optimizer)``) and ``scaler.update()``.
    """

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer

    def step(self) -> None:
        """After backward: finish (or queue) this step's reductions and update the parameters."""
        raise NotImplementedError

    def synchronize(self) -> None:
        """Wait for what is in flight and bring the gradients (or updates) up to date."""
        raise NotImplementedError

    def finish(self) -> None:
        """Apply what earlier steps left in flight (Pipe-SGD's last gradient, DeAR's last updates),
        before evaluating, saving or stopping; the group schedules leave nothing after ``step()``."""
        raise NotImplementedError

    def state_dict(self) -> dict:
        """Everything a resumed run needs to continue bit for bit (residuals, thresholds, plans)."""
        raise NotImplementedError

    def load_state_dict(self, d: dict) -> None:
        """Restore :meth:`state_dict` (same model; this schedule's own settings win)."""
        raise NotImplementedError

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backwards inside accumulate locally and reduce nothing (as DDP's ``no_sync``); the
        first backward after it reduces the accumulated gradients."""
        self._accumulating = True
        try:
            yield
        finally:
            self._accumulating = False

    def close(self) -> None:
        """Remove the hooks and stop the engine (finishing its queued jobs)."""
        raise NotImplementedError

    def __enter__(self) -> "Schedule":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def check_optimizer(optimizer: torch.optim.Optimizer, model: torch.nn.Module, what: str) -> None:
    """Refuse an optimizer that steps a parameter the model does not hold.

    Such a parameter is never reduced: each rank would step it with its own
    gradient and the ranks drift apart silently. Frozen parameters of the model
    are fine (no gradient, no step).
    """
    mine = {id(p) for p in model.parameters()}
    extra = [p for pg in optimizer.param_groups for p in pg["params"] if id(p) not in mine]
    if extra:
        raise ValueError(f"{what}: the optimizer steps {len(extra)} parameter(s) that are not the model's "
                         f"(first of shape {tuple(extra[0].shape)}); the schedule reduces only the model's, so "
                         "the ranks would drift apart. Give the schedule a model holding every parameter "
                         "the optimizer steps.")


def optimizer_size(optimizer: torch.optim.Optimizer) -> int:
    """How many parameters the optimizer steps (a cheap sign of an ``add_param_group``)."""
    return sum(len(pg["params"]) for pg in optimizer.param_groups)


class Carry:
    """Reduced results of layers whose step was not applied, added to their next results.

    Keyed by the parameter itself (its ``id``), so a regrouping (a new plan, a
    layer frozen or unfrozen) moves nothing. Every rank holds the same values:
    the results are identical on every rank.
    """

    def __init__(self) -> None:
        self.values: dict[int, torch.Tensor] = {}

    def keep(self, params: list[torch.nn.Parameter], flat: torch.Tensor) -> None:
        """Add ``flat`` (``params``' reduced gradients, one after another) to what is carried."""
        offset = 0
        for p in params:
            part = flat[offset:offset + p.numel()].detach().reshape(p.shape)
            offset += p.numel()
            held = self.values.get(id(p))
            self.values[id(p)] = part.clone() if held is None else held.add_(part)

    def add_into(self, params: list[torch.nn.Parameter]) -> None:
        """Add what is carried for ``params`` into their ``.grad`` and forget it."""
        for p in params:
            held = self.values.pop(id(p), None)
            if held is not None and p.grad is not None:
                p.grad.add_(held.to(p.grad.dtype))
            elif held is not None:
                self.values[id(p)] = held  # no gradient to add it to this step: kept for the next

    def scale(self, ratio: float) -> None:
        for v in self.values.values():
            v.mul_(ratio)

    def state_dict(self, index: dict[int, int]) -> dict[int, torch.Tensor]:
        return {index[k]: v.clone() for k, v in self.values.items() if k in index}

    def load(self, saved: dict[int, torch.Tensor], params: list[torch.nn.Parameter]) -> None:
        self.values = {id(params[i]): v.clone().to(params[i].device) for i, v in saved.items()}


def active_scaler(scaler: Any) -> Any:
    """``scaler`` where it scales, else None: a disabled ``GradScaler`` (``enabled=False``, the usual
    switch for an fp32 run) steps the optimizer as it is, so the schedule behaves as without one."""
    if scaler is not None and not callable(getattr(scaler, "is_enabled", None)):
        raise ValueError(f"scaler must be a torch.amp.GradScaler (or None), got {type(scaler).__name__}")
    return scaler if scaler is not None and scaler.is_enabled() else None


class LossScale:
    """Follows a loss scaler's scale from step to step (``scaler=None``: nothing to follow).

    Residuals and carried results hold scaled gradients. A gradient of the next
    step carries the scaler's new scale, so at the start of each step, when the
    scale moved (halved after an overflow, grown every ``growth_interval``
    steps), they are multiplied by new/old: powers of two, so exactly. Reading
    the scale is one host read on CUDA, once per step.
    """

    def __init__(self, scaler: Any) -> None:
        if scaler is not None and not callable(getattr(scaler, "get_scale", None)):
            raise ValueError(f"scaler must be a torch.amp.GradScaler (or None), got {type(scaler).__name__}")
        self.scaler = scaler
        self.value: float | None = None

    def moved(self) -> float | None:
        """new/old when the scale changed since the last call, else None."""
        if self.scaler is None or not self.scaler.is_enabled():
            return None
        now = float(self.scaler.get_scale())
        old, self.value = self.value, now
        return None if old is None or old == now else now / old


def split_residual(params: list[torch.nn.Parameter], residual: torch.Tensor | None) -> dict[int, torch.Tensor]:
    """A call's residual (``params``' entries one after another), copied apart per parameter, by
    ``id``: how error feedback keeps every bit when groups change (a re-plan, a freeze)."""
    out, offset = {}, 0
    if residual is None:
        return out
    for p in params:
        out[id(p)] = residual[offset:offset + p.numel()].clone()
        offset += p.numel()
    return out


def join_residuals(params: list[torch.nn.Parameter], residuals: dict[int, torch.Tensor]) -> torch.Tensor | None:
    """The residual of a call over ``params``: each one's taken out of ``residuals``, zeros where it
    has none; None when none has one (the state then starts without, as for a new tensor)."""
    held = [residuals[id(p)] for p in params if id(p) in residuals]
    if not held:
        return None
    return torch.cat([residuals.pop(id(p)) if id(p) in residuals else held[0].new_zeros(p.numel())
                      for p in params])


def hold_residual(state: State, residual: torch.Tensor | None) -> None:
    """Give ``state`` a residual (a regrouped layer's, a checkpoint's) that its next call sends.

    A dense state without error feedback (no compressor) would keep it and never add it:
    it is switched to error feedback, so the residual goes with its next call (and a dense
    call leaves zeros). Every rank does the same: a residual exists on all of them or on
    none. A sparse state made with ``error_feedback=False`` drops it, as asked.
    """
    if residual is None:
        return
    if state.algorithm == "dense":
        state.error_feedback = True
    if state.error_feedback:
        state.residual = residual


class StateMaker:
    """Makes the algorithm states of a schedule's calls.

    1. A named algorithm: a state of it for every call (a group, Pipe-SGD's one call).
    2. ``"auto"``: per call, the algorithm :func:`sparsecomm.choose` picks for its size, dtype,
       P and network profile, as the DDP hook picks per bucket. The state keeps it: a group's
       thresholds and residual are never stranded by a switch; a new grouping (MG-WFBP's
       plan, DeAR's fusion size, a freeze) chooses again for the new sizes, and residuals
       move with their layers as for any regrouping.
    3. Error feedback as the schedule asks, except dense without a compressor, which sends
       everything and keeps nothing; under ``"auto"`` dense keeps it too, so a layer's
       residual from a sparse group goes with its dense group's next call.

    Args:
        algorithm: a name from ``sparsecomm.algorithms()``, or ``"auto"`` (no options then).
        density, compressor, error_feedback, options: the states' settings.
        network: the profile ``"auto"`` models (``sparsecomm.choice.profile``).
    """

    def __init__(self, algorithm: str, density: float, options: dict | None, error_feedback: bool,
                 compressor: Any, network: Any) -> None:
        self.algorithm, self.density, self.compressor, self.network = algorithm, density, compressor, network
        self.error_feedback, self.options = error_feedback, dict(options or {})
        self.make(choice.validated(algorithm, options, network))  # validate now

    @property
    def auto(self) -> bool:
        return self.algorithm == choice.AUTO

    def make(self, name: str) -> State:
        """A fresh state of algorithm ``name`` with this schedule's settings."""
        kwargs = dict(self.options)
        if name != "dense" or self.compressor is not None or self.auto:
            kwargs.setdefault("error_feedback", self.error_feedback)
        return registry.get(name).state_class(self.density, **kwargs)

    def new(self, numel: int, dtype: torch.dtype, device: torch.device, comm: Any) -> State:
        """The state of a call of ``numel`` elements of ``dtype`` on ``device`` among ``comm``'s ranks."""
        if not self.auto:
            return self.make(self.algorithm)
        return self.make(choice.choose(numel, self.density, comm.size, dtype, self.compressor, self.network,
                                       device.type, comm))

    def for_params(self, params: list[torch.nn.Parameter], comm: Any) -> State:
        """The state of one call over ``params``' gradients, laid out one after another."""
        if not params:  # (every layer frozen: a placeholder, never called)
            return self.make("oktopk" if self.auto else self.algorithm)
        return self.new(sum(p.numel() for p in params), flat_dtype(params), params[0].device, comm)

    def like(self, saved: State) -> State:
        """The state this schedule makes where ``saved`` was made: under ``"auto"`` the saved
        choice stands (a call keeps its algorithm) if it is one ``auto`` chooses from."""
        name = saved.algorithm if self.auto and saved.algorithm in choice.CANDIDATES else (
            "oktopk" if self.auto else self.algorithm)
        return self.make(name)


def state_settings(state: Any) -> tuple:
    """What makes two algorithm states interchangeable: the class and its settings."""
    settings = state.settings()
    settings.pop("iteration", None)
    return (type(state).__name__, tuple(sorted(settings.items())))


def layer_settings(params: list[torch.nn.Parameter]) -> list[tuple[int, ...]]:
    """The model's parameter shapes, which a checkpoint must match."""
    return [tuple(p.shape) for p in params]


def check_layers(saved: list, params: list[torch.nn.Parameter], what: str) -> None:
    """Refuse a checkpoint of another model (ValueError naming the first difference)."""
    mine = layer_settings(params)
    saved = [tuple(s) for s in saved]
    if saved != mine:
        where = next((i for i, (a, b) in enumerate(zip(saved, mine)) if a != b), min(len(saved), len(mine)))
        raise ValueError(f"{what}.load_state_dict: the checkpoint's model has {len(saved)} parameters, this one "
                         f"{len(mine)}; they differ from parameter {where} on (a checkpoint of another model?)")


def adopt_state(saved: State, mine: State, what: str, like: State | None = None) -> State:
    """The state to go on with after loading ``saved`` into an object that made ``mine``.

    1. ``saved`` itself where its settings are ``like``'s (the state the object would make
       where ``saved`` was made; default ``mine``): the run resumes bit for bit.
    2. Otherwise the object's own settings win: ``mine`` takes only the saved residual
       (:func:`hold_residual`), and a warning names both settings.
    """
    if state_settings(saved) == state_settings(mine if like is None else like):
        return saved
    warnings.warn(f"{what}.load_state_dict: the checkpoint's states were made with {state_settings(saved)}, "
                  f"this {what} makes {state_settings(mine)}: their residuals carry over, their "
                  "thresholds and boundaries start afresh", stacklevel=3)
    residual = getattr(saved, "residual", None)
    hold_residual(mine, None if residual is None else residual.clone())
    return mine


def adopt_states(saved: list, mine: list, what: str, maker: StateMaker) -> list:
    """:func:`adopt_state` for each of a schedule's states (under ``"auto"`` the saved state's
    algorithm stands where ``auto`` chooses from it: :meth:`StateMaker.like`)."""
    return [adopt_state(old, new, what, maker.like(old)) for old, new in zip(saved, mine)]


def snapshot(state: Any) -> Any:
    """A copy of an algorithm state as a checkpoint holds it (no buffers, its own tensors)."""
    copied = state.__class__.__new__(state.__class__)
    copied.__dict__.update(copy.deepcopy(state.__getstate__()))
    return copied


def refused_job(engine: Any, problem: str, numel: int) -> Any:
    """The job a rank submits in place of a call it cannot make (its gradients cannot be gathered).

    It takes part in the call's collective check with a tensor the check refuses
    (on the meta device), so every rank raises InputError instead of the others
    waiting out the timeout; this rank's message says what went wrong here.
    """
    def refuse(comm: Any) -> None:
        try:
            allreduce(torch.empty(numel, device="meta"), comm=comm)
        except InputError as exc:
            raise InputError(f"{problem} ({exc})") from exc

    return engine.run(refuse, what="a call this rank could not gather")
