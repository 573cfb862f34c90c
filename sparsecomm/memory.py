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
from typing import Any, Callable, Hashable, Iterable, Sequence

import torch

from . import choice, registry
from .state import State

__all__ = ["GradientMemory", "flat_dtype", "Carry", "LossScale", "active_scaler", "split_flat", "join_flat", "split_residual", "join_residuals", "hold_residual", "StateMaker",
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
    3. Error feedback as the loop asks, except dense without a compressor, which sends
       everything and keeps nothing. Under ``"auto"``, with ``dense_keeps_residual``, dense
       keeps it too, so a layer's residual from a sparse call goes with its dense call's next
       one inside the state (see :func:`hold_residual` for when a loop wants which).

    Args:
        algorithm: a name from ``sparsecomm.algorithms()``, or ``"auto"`` (no options then).
        density, compressor, error_feedback, options: the states' settings.
        network: the profile ``"auto"`` models (``sparsecomm.choice.profile``).
        dense_keeps_residual: a residual that moves into a dense call without a compressor
            becomes its state's (the schedules) rather than waiting parked to be added to
            its input (the DDP hook).
    """

    def __init__(self, algorithm: str, density: float, options: dict | None, error_feedback: bool,
                 compressor: Any, network: Any, dense_keeps_residual: bool = True) -> None:
        self.algorithm, self.density, self.compressor, self.network = algorithm, density, compressor, network
        self.error_feedback, self.options = error_feedback, dict(options or {})
        self.dense_keeps_residual = dense_keeps_residual
        self.make(choice.validated(algorithm, options, network))  # validate now

    @property
    def auto(self) -> bool:
        return self.algorithm == choice.AUTO

    def make(self, name: str) -> State:
        """A fresh state of algorithm ``name`` with this schedule's settings."""
        kwargs = dict(self.options)
        if name != "dense" or self.compressor is not None or (self.auto and self.dense_keeps_residual):
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

    1. A copy of ``saved`` where its settings are ``like``'s (the state the object would make
       where ``saved`` was made; default ``mine``): the run resumes bit for bit, and the
       checkpoint stays as it was (loading it again resumes the same run again).
    2. Otherwise the object's own settings win: ``mine`` takes only the saved residual
       (:func:`hold_residual`), and a warning names both settings.
    """
    if state_settings(saved) == state_settings(mine if like is None else like):
        return snapshot(saved)
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


def split_flat(keys: Sequence[Hashable], sizes: Sequence[int], flat: torch.Tensor | None) -> dict:
    """``flat`` (the keys' entries one after another, ``sizes[i]`` each) copied apart per key."""
    out, offset = {}, 0
    if flat is None:
        return out
    for key, n in zip(keys, sizes):
        out[key] = flat[offset:offset + n].clone()
        offset += n
    return out


def join_flat(keys: Sequence[Hashable], sizes: Sequence[int], held: dict) -> torch.Tensor | None:
    """The keys' tensors of ``held`` one after another, taken out of it, zeros where a key has
    none; None when none has one (a state then starts without, as for a new tensor)."""
    found = [held[k] for k in keys if k in held]
    if not found:
        return None
    return torch.cat([held.pop(k) if k in held else found[0].new_zeros(n) for k, n in zip(keys, sizes)])


def split_residual(params: list[torch.nn.Parameter], residual: torch.Tensor | None) -> dict[int, torch.Tensor]:
    """A call's residual (``params``' entries one after another), copied apart per parameter, by
    ``id``: how error feedback keeps every bit when groups change (a re-plan, a freeze)."""
    return split_flat([id(p) for p in params], [p.numel() for p in params], residual)


def join_residuals(params: list[torch.nn.Parameter], residuals: dict[int, torch.Tensor]) -> torch.Tensor | None:
    """The residual of a call over ``params`` from ``residuals`` (by ``id``; see :func:`join_flat`)."""
    return join_flat([id(p) for p in params], [p.numel() for p in params], residuals)


def hold_residual(state: State, residual: torch.Tensor | None) -> None:
    """Give ``state`` a residual (a regrouped layer's, a checkpoint's) that its next call sends.

    The one rule for a residual that moves into a call: it goes with that call's next run.
    A state that keeps residuals (error feedback) takes it as its own. A call that keeps none
    (a dense one without a compressor, or none at all: the DDP hook's warm-up steps and small
    layouts) sends it in one of two ways, which :class:`GradientMemory` chooses by
    ``StateMaker.dense_keeps_residual``:

    1. Into the state: a dense state is switched to error feedback here (the residual goes with
       its next call, and a dense call leaves zeros). The schedules do this: their call's input
       is the gradients themselves, which must not change.
    2. Parked, and added to the call's input (:meth:`GradientMemory.owed`), forgotten once the
       call went through: a refused call leaves it exactly as it was, and no buffer of zeros is
       kept. The DDP hook does this: its input is DDP's own bucket.

    Every rank does the same: a residual exists on all of them or on none. A sparse state made
    with ``error_feedback=False`` drops it, as asked.
    """
    if residual is None:
        return
    if state.algorithm == "dense":
        state.error_feedback = True
    if state.error_feedback:
        state.residual = residual


class Carry:
    """Reduced results of calls whose step was not applied, added to the same parameters' next results.

    Keyed per parameter (its ``id`` in the schedules, its position in the DDP hook), so a
    regrouping (a new plan, a layer frozen or unfrozen, a rebuilt bucket) moves nothing;
    flat. Every rank holds the same values: the results are identical on every rank.
    """

    def __init__(self) -> None:
        self.values: dict = {}

    def keep_flat(self, keys: Sequence[Hashable], sizes: Sequence[int], flat: torch.Tensor) -> None:
        """Add ``flat`` (the keys' reduced gradients, one after another) to what is carried."""
        offset = 0
        for key, n in zip(keys, sizes):
            part = flat[offset:offset + n].detach()
            offset += n
            held = self.values.get(key)
            self.values[key] = part.clone() if held is None else held.add_(part)

    def keep(self, params: list[torch.nn.Parameter], flat: torch.Tensor) -> None:
        """:meth:`keep_flat` keyed by the parameters' ``id``."""
        self.keep_flat([id(p) for p in params], [p.numel() for p in params], flat)

    def take(self, key: Hashable) -> torch.Tensor | None:
        """What is carried for ``key`` (flat), forgotten here; None if nothing is."""
        return self.values.pop(key, None)

    def add_into(self, params: list[torch.nn.Parameter]) -> None:
        """Add what is carried for ``params`` into their ``.grad`` and forget it."""
        for p in params:
            held = self.values.pop(id(p), None)
            if held is not None and p.grad is not None:
                p.grad.add_(held.view(p.grad.shape).to(p.grad.dtype))
            elif held is not None:
                self.values[id(p)] = held  # no gradient to add it to this step: kept for the next

    def scale(self, ratio: float) -> None:
        for v in self.values.values():
            v.mul_(ratio)

    def state_dict(self, index: dict | None = None) -> dict[int, torch.Tensor]:
        """By parameter position: ``index`` maps a key to it (None: the keys are positions)."""
        return {k if index is None else index[k]: v.clone() for k, v in self.values.items()
                if index is None or k in index}

    def load(self, saved: dict[int, torch.Tensor], key_of: Callable[[int], Hashable] | None = None,
             device: Callable[[int], torch.device] | None = None) -> None:
        """Restore :meth:`state_dict` (its values flat, or shaped as checkpoints before kept them)."""
        self.values = {i if key_of is None else key_of(i):
                       v.clone().reshape(-1).to(v.device if device is None else device(i)) for i, v in saved.items()}


class GradientMemory:
    """What one training loop (a DDP hook's state, a schedule) remembers about gradients between
    steps, per parameter key (a parameter's ``id`` in the schedules, its position in the hook).

    1. ``maker``: makes the algorithm states of its calls, and says what a checkpoint's state
       is compared with (:class:`StateMaker`).
    2. ``parked``: residuals no call's state holds (a frozen layer's, a dropped layout's), sent
       by the next call over their parameters (:meth:`give`, :meth:`owed`).
    3. ``carry``: results of steps that were not applied, added to the next ones (:class:`Carry`).
    4. ``scale``: the loss scaler's scale, which residuals and carried results follow (:meth:`rescale`).

    The algorithm states themselves, and how a loop lays its calls out, stay the loop's own.
    """

    def __init__(self, maker: StateMaker, scaler: Any = None) -> None:
        self.maker, self.scale = maker, LossScale(scaler)
        self.parked: dict = {}
        self.carry = Carry()

    def park(self, keys: Sequence[Hashable], sizes: Sequence[int], residual: torch.Tensor | None) -> None:
        """Keep a call's residual per parameter until a call over them sends it."""
        self.parked.update(split_flat(keys, sizes, residual))

    def give(self, state: State, keys: Sequence[Hashable], sizes: Sequence[int]) -> None:
        """The parked residuals of ``keys`` go to ``state``, whose calls send them
        (:func:`hold_residual`); a dense state keeps none when the maker says so, and they wait
        here for :meth:`owed`."""
        if state.error_feedback or state.algorithm != "dense" or self.maker.dense_keeps_residual:
            hold_residual(state, join_flat(keys, sizes, self.parked))

    def owed(self, keys: Sequence[Hashable], sizes: Sequence[int], buf: torch.Tensor) -> list:
        """A call without a state over ``keys`` (laid out one after another in ``buf``): the
        parked residuals of its parameters are added to its input; returns their keys, which
        :meth:`settle` forgets once the call went through (a refused call leaves them parked)."""
        owed, offset = [], 0
        for key, n in zip(keys, sizes):
            if key in self.parked:
                buf[offset:offset + n] += self.parked[key].to(buf.device, buf.dtype)
                owed.append(key)
            offset += n
        return owed

    def settle(self, keys: Sequence[Hashable]) -> None:
        """Forget residuals that a call went through with (:meth:`owed`)."""
        for key in keys:
            del self.parked[key]

    def state_dict(self, index: dict | None = None) -> dict:
        """The memory's part of a checkpoint: ``parked`` residuals, ``carried`` results and the
        ``scale``, by parameter position (``index`` maps a key to it; None: the keys are positions).
        The states are the loop's: it saves them beside this."""
        pos = (lambda k: k) if index is None else index.__getitem__
        return {"parked": {pos(k): v.clone() for k, v in self.parked.items()},
                "carried": self.carry.state_dict(index), "scale": self.scale.value}

    def load_state_dict(self, d: dict, key_of: Callable[[int], Hashable] | None = None,
                        device: Callable[[int], torch.device] | None = None) -> None:
        """Restore :meth:`state_dict` (``key_of``: a position's key here; ``device``: where its tensors go)."""
        key = (lambda i: i) if key_of is None else key_of
        self.parked = {key(i): v.clone() for i, v in d.get("parked", {}).items()}
        self.carry.load(d.get("carried", {}), key_of, device)
        self.scale.value = d.get("scale")

    def rescale(self, ratio: float | None, states: Iterable[State]) -> None:
        """Residuals (the states' and the parked ones) and carried results times ``ratio``, when
        the loss scale moved (:meth:`LossScale.moved`)."""
        if ratio is None:
            return
        for st in states:
            if getattr(st, "residual", None) is not None:
                st.residual.mul_(ratio)
        for r in self.parked.values():
            r.mul_(ratio)
        self.carry.scale(ratio)


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

    def __getstate__(self) -> dict:  # a scaler does not pickle: an unpickled copy follows none
        return {"scaler": None, "value": self.value}

    def moved(self) -> float | None:
        """new/old when the scale changed since the last call, else None."""
        if self.scaler is None or not self.scaler.is_enabled():
            return None
        return self.moved_to(float(self.scaler.get_scale()))

    def moved_to(self, now: float) -> float | None:
        """:meth:`moved` with the scale read already (the DDP hook reads it on the caller's
        thread and follows it on the thread that reduces)."""
        old, self.value = self.value, now
        return None if old is None or old == now else now / old


def snapshot(state: Any) -> Any:
    """A copy of an algorithm state as a checkpoint holds it (no buffers, its own tensors)."""
    copied = state.__class__.__new__(state.__class__)
    copied.__dict__.update(copy.deepcopy(state.__getstate__()))
    return copied
