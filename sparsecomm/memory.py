"""The gradient memory a training loop keeps between steps, shared by the DDP hook, the
schedules and the optimizers.

What the library remembers about gradients outside one call, each job defined once here:

* :class:`StateMaker`: the algorithm states of a loop's calls (``algorithm="auto"``: chosen per
  call size), and what a checkpoint's state is compared with (:meth:`StateMaker.like`,
  :func:`state_settings`, :func:`adopt_state`).
* Residuals per parameter: :func:`split_residual` cuts a call's residual apart,
  :func:`join_residuals` builds the residual of a new call from its parameters', and
  :func:`hold_residual` is the one rule for a residual that moves into a call.
* :class:`Carry`: the results of a step that was not applied, added to the same parameters'
  next results.
* :class:`LossScale` and :func:`active_scaler`: residuals and carried results are in the loss
  scaler's units and follow its scale.
* :func:`snapshot`: an algorithm state as a checkpoint holds it.
"""

from __future__ import annotations

import copy
import warnings
from typing import Any

import torch

from . import choice, registry
from .state import State

__all__ = ["flat_dtype", "Carry", "LossScale", "active_scaler", "split_residual", "join_residuals", "hold_residual", "StateMaker",
           "state_settings", "adopt_state", "adopt_states", "snapshot"]


def flat_dtype(tensors: "list[torch.Tensor]") -> torch.dtype:
    """The dtype a group's flat buffer takes: the widest of its gradients' (type promotion).

    The first gradient's dtype cast float32 gradients grouped with a bfloat16 one to
    bfloat16 (3.7e-3 relative error on the float32 layer); a narrower gradient widens
    exactly, and its reduced result is cast back as it is written.
    """
    dtype = tensors[0].dtype
    for t in tensors[1:]:
        dtype = torch.promote_types(dtype, t.dtype)
    return dtype


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


def snapshot(state: Any) -> Any:
    """A copy of an algorithm state as a checkpoint holds it (no buffers, its own tensors)."""
    copied = state.__class__.__new__(state.__class__)
    copied.__dict__.update(copy.deepcopy(state.__getstate__()))
    return copied
