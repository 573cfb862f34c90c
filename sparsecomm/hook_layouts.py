"""The parameter layouts a DDP hook holds, and their part of its checkpoints.

A *layout* is a tuple of parameter positions (in ``model.parameters()``) that the hook
reduces as one buffer, with one algorithm state (its thresholds and region boundaries).
:class:`Layouts` keeps which layouts are held, which layout holds each parameter, their
states and staging buffers, and the orders of the last step that the layout rules read
(``sparsecomm.hooks`` says how a bucket becomes a layout). Residuals are per parameter:
a layout's state holds its parameters' while the layout is held, and hands them to the
gradient memory (:class:`sparsecomm.memory.GradientMemory`) when it is dropped.
"""

from __future__ import annotations

import warnings
from typing import Any, Dict, List, Optional, Tuple

import torch

from .memory import GradientMemory, split_flat, state_settings
from .state import State

__all__ = ["Layout", "Layouts"]

#: Parameter positions (in ``model.parameters()``), in the order one buffer holds them.
Layout = Tuple[int, ...]


class Layouts:
    """The held layouts of one model's parameters (``numel``: each parameter's size)."""

    def __init__(self, numel: List[int]) -> None:
        self.numel = list(numel)
        self.states: Dict[Layout, State] = {}  # algorithm states of the held layouts reduced sparsely
        self.held: Dict[Layout, None] = {}  # every held layout (an ordered set), dense ones too
        self.holder: Dict[int, Layout] = {}  # parameter -> the held layout it belongs to
        self.staged_last: List[Layout] = []  # orders staged in the last step
        self.orders_last: Optional[List[Layout]] = None  # the last step's orders, as the rules saw them
        self.buffers: Dict[Layout, torch.Tensor] = {}  # staging buffers, kept across steps
        self._starts: Dict[Layout, Dict[int, int]] = {}

    def __getstate__(self) -> dict:  # buffers are rebuilt
        return {**self.__dict__, "buffers": {}, "_starts": {}}

    def sizes(self, key: Layout) -> List[int]:
        return [self.numel[i] for i in key]

    def starts(self, order: Layout) -> Dict[int, int]:
        """Where each parameter of ``order`` starts in a buffer laid out in that order."""
        starts = self._starts.get(order)
        if starts is None:
            starts, pos = {}, 0
            for i in order:
                starts[i] = pos
                pos += self.numel[i]
            self._starts[order] = starts
        return starts

    def hold(self, key: Layout) -> None:
        self.held[key] = None
        for i in key:
            self.holder[i] = key

    def drop(self, key: Layout, memory: GradientMemory) -> None:
        """Stop holding layout ``key``: its residuals wait per parameter in ``memory`` for the next layout."""
        del self.held[key]
        for i in key:
            if self.holder.get(i) == key:
                del self.holder[i]
        st = self.states.pop(key, None)
        if st is not None:
            memory.park(key, self.sizes(key), st.residual)
        self.buffers.pop(key, None)

    def decide(self, order: Layout, adopt: bool) -> str:
        """How a bucket of parameters ``order`` is reduced.

        1. "inplace": ``order`` is a held layout.
        2. "staged": its parameters all belong to held layouts (in any sets), and
           unless ``adopt`` is False the same order was not staged in the last step.
        3. "new": anything else; the caller makes ``order`` a layout.
        """
        if order in self.held:
            return "inplace"
        held = all(i in self.holder for i in order)
        if held and not (adopt and order in self.staged_last):
            return "staged"
        return "new"

    def buffer(self, key: Layout, like: torch.Tensor) -> torch.Tensor:
        """Layout ``key``'s staging buffer (kept across steps, so staged steps allocate nothing)."""
        n = sum(self.sizes(key))
        buf = self.buffers.get(key)
        if buf is None or buf.numel() != n or buf.dtype != like.dtype or buf.device != like.device:
            buf = self.buffers[key] = torch.empty(n, dtype=like.dtype, device=like.device)
        return buf

    def state(self, key: Layout, memory: GradientMemory, comm: Any, device: torch.device,
              dtype: torch.dtype = torch.float32) -> State:
        """The algorithm state of held layout ``key``, made by ``memory``'s maker (with its
        parameters' parked residuals) when missing."""
        state = self.states.get(key)
        if state is not None:
            return state
        state = memory.maker.new(sum(self.sizes(key)), dtype, device, comm)
        memory.give(state, key, self.sizes(key))
        if state.residual is not None:
            state.residual = state.residual.to(device)
        self.states[key] = state
        return state

    def residuals(self, memory: GradientMemory) -> Dict[int, torch.Tensor]:
        """Every parameter's residual: the held layouts' states' and the parked ones."""
        out = {i: r.clone() for i, r in memory.parked.items()}
        for key, st in self.states.items():
            out.update(split_flat(key, self.sizes(key), st.residual))
        return out

    # ---- checkpoints -------------------------------------------------------------------
    def state_dict(self) -> dict:
        """The layouts' part of the hook's checkpoint (the residuals are saved per parameter)."""
        algo = {}
        for key, st in self.states.items():
            copy = st.__class__.__new__(st.__class__)
            copy.__dict__ = {**st.__dict__, "residual": None}
            algo[key] = copy
        return {"algorithm_states": algo, "layouts": list(self.held), "staged": list(self.staged_last),
                "orders": None if self.orders_last is None else list(self.orders_last)}

    def check(self, d: dict) -> None:
        """Refuse a checkpoint of another model: a residual, carried result or layout naming a
        parameter this model lacks, or one of another size (ValueError)."""
        n = len(self.numel)
        for what, tensors in (("residual", d["residuals"]), ("carried result", d.get("carried", {}))):
            for i, r in tensors.items():
                if not (isinstance(i, int) and 0 <= i < n):
                    raise ValueError(f"SparseHookState.load_state_dict: the checkpoint holds a {what} for "
                                     f"parameter {i!r}; this model has {n} parameters (a checkpoint of another "
                                     "model?)")
                if r.numel() != self.numel[i]:
                    raise ValueError(f"SparseHookState.load_state_dict: the checkpoint's {what} for parameter "
                                     f"{i} has {r.numel()} elements; this model's has {self.numel[i]} (a "
                                     "checkpoint of another model?)")
        seen: set = set()
        for key in list(d["algorithm_states"]) + list(d.get("layouts", [])) + list(d.get("orders") or []):
            bad = [i for i in key if not (isinstance(i, int) and 0 <= i < n)]
            if bad:
                raise ValueError(f"SparseHookState.load_state_dict: a saved bucket holds parameter(s) {bad}; "
                                 f"this model has {n} parameters (a checkpoint of another model?)")
        for key in d.get("layouts", []):
            if seen & set(key):
                raise ValueError(f"SparseHookState.load_state_dict: the saved layouts share parameter(s) "
                                 f"{sorted(seen & set(key))} (not a checkpoint of SparseHookState.state_dict?)")
            seen |= set(key)

    def load(self, d: dict, memory: GradientMemory) -> None:
        """Restore :meth:`state_dict` (checked by :meth:`check`), and the saved residuals: into the
        saved layouts' states, the rest parked in ``memory``.

        Saved states made with other settings than ``memory``'s maker makes are dropped (a
        warning names both); their residuals wait per parameter for the states made next.
        """
        maker = memory.maker
        kept = {key: st for key, st in d["algorithm_states"].items()
                if state_settings(st) == state_settings(maker.like(st))}
        if len(kept) < len(d["algorithm_states"]):
            other = next(st for key, st in d["algorithm_states"].items() if key not in kept)
            warnings.warn(f"SparseHookState.load_state_dict: the checkpoint's bucket states were made with "
                          f"{state_settings(other)}, this hook makes {state_settings(maker.like(other))}: their "
                          "residuals carry over, their thresholds and boundaries start afresh", stacklevel=3)
        self.held, self.holder, self.buffers, self._starts = {}, {}, {}, {}
        for key in d.get("layouts", list(d["algorithm_states"])):  # checkpoints before layouts: the states'
            self.hold(tuple(key))
        self.states = {}
        for key, st in kept.items():
            st.residual = None
            if tuple(key) in self.held:
                self.states[tuple(key)] = st
        saved = d["residuals"]
        for key, st in self.states.items():  # re-attach residuals to the saved layouts
            here = [saved[i] for i in key if i in saved]
            if st.error_feedback and here:  # (else they wait, and the layout's next call adds them)
                st.residual = torch.cat([saved[i] if i in saved else here[0].new_zeros(self.numel[i]) for i in key])
        placed = {i for key, st in self.states.items() if st.error_feedback for i in key}
        memory.parked = {i: r.clone() for i, r in saved.items() if i not in placed}
        self.staged_last = [tuple(o) for o in d.get("staged", [])]
        orders = d.get("orders")
        self.orders_last = None if orders is None else [tuple(o) for o in orders]
