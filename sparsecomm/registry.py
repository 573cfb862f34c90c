"""The algorithm registry: name -> (function, State class).

An algorithm is a function ``fn(acc, k, comm, state, codec, preselected) ->
SparseResult`` registered under a name with the State class it uses::

    @register("oktopk", OkTopkState)
    def oktopk(acc, k, comm, state, codec, preselected): ...

``acc`` is the (error-compensated) flat input in the work dtype, which the
algorithm must not modify, with one exception: with error feedback ``acc`` is
the residual, and an algorithm may leave in it what it did not send while it
encodes, saying so with ``SparseResult.settled`` (dense with a quantiser does;
a call that fails after that leaves the residual settled for a result that was
never delivered, so a state is not reused after a communication error);
``codec`` (a :class:`~sparsecomm.compress.Compressor`, bound to this call)
is how values travel: a cast to the input's dtype unless the caller chose a
compressor; ``preselected`` is what the state's
``compensate`` selected while accumulating (a
:class:`~sparsecomm.state.Preselection`, Ok-Topk's fused pass), else None.

An algorithm whose communication falls into two halves (a reduction, then a
gather of the reduced entries) may also register them, so that schedules
(DeAR) can run the first half in backward and the second before the next
forward: ``split=(first, second)`` where ``first`` takes ``fn``'s arguments
and returns an opaque object, ``second(that, comm)`` the SparseResult, and
``second(first(...), comm)`` is exactly ``fn(...)``.

An algorithm that settles the residual while it encodes (above) must know
the largest magnitude its result may take without being refused for
overflow: it declares a keyword argument ``limit`` (in ``fn`` and in the
first half), and each call passes it (infinite when nothing is refused).

An algorithm may carry the collective input check in its first exchange
(:class:`~sparsecomm.check.CarriedCheck`), which saves the check's own
exchange and host read: it declares ``check`` (in ``fn`` and in the first
half), and calls it exactly once, before any other collective. It gets None
when the check ran before it.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass
from typing import Any, Callable

from .network import Traffic
from .result import SparseResult
from .state import State, allow_in_checkpoints

__all__ = ["AlgorithmSpec", "Volume", "TrafficModel", "INDEX_BYTES", "register", "get", "names", "tree_levels"]

#: ``volume(n, k, P)`` -> (lower, upper) words (4 bytes) received per rank by one call.
Volume = Callable[[int, int, int], tuple[float, float]]
#: ``traffic(n, k, P, value_bytes, ranks_per_node, grid)`` -> the busiest rank's critical-path
#: messages and bytes in one steady call, for P > 1 (``choice.traffic``: what ``"auto"`` and the
#: projections model; ``ranks_per_node`` and ``grid`` matter to two-level algorithms only).
TrafficModel = Callable[[int, int, int, float, int, bool], Traffic]
#: Bytes of an index on the wire where it does not fit 16 bits (traffic models use it).
INDEX_BYTES = 4


@dataclass(frozen=True)
class AlgorithmSpec:
    name: str
    fn: Callable[..., SparseResult]
    state_class: type[State]
    summary: str
    split: tuple[Callable[..., Any], Callable[..., SparseResult]] | None = None
    #: Whether ``fn`` (and ``split[0]``) take ``limit=`` (see the module docstring).
    takes_limit: bool = False
    #: Whether ``fn`` (and ``split[0]``) take ``check=``: a :class:`~sparsecomm.check.CarriedCheck`
    #: its first exchange carries, or None when the check ran before it.
    takes_check: bool = False
    #: Its communication volume by formula (Table 1 of the Ok-Topk paper), or None.
    volume: Volume | None = None
    #: Its modelled traffic in a steady call (fitted to the simulated world), or None.
    traffic: TrafficModel | None = None
    #: Whether k counts entries of the sum (one global selection: Ok-Topk, gTopk, CLT-k) rather
    #: than each rank's (TopkA, TopkDSA, Gaussiank): P ranks' k entries each need P k of it.
    global_k: bool = False


_REGISTRY: dict[str, AlgorithmSpec] = {}


def first_paragraph(doc: str | None) -> str:
    """A docstring's first paragraph on one line (an algorithm's summary, its volume's formula)."""
    return " ".join((doc or "").strip().split("\n\n")[0].split())


def register(name: str, state_class: type[State], *,
             split: tuple[Callable[..., Any], Callable[..., SparseResult]] | None = None,
             volume: Volume | None = None, traffic: TrafficModel | None = None, global_k: bool = False) -> Callable:
    """Decorator registering an algorithm function under ``name``.

    Args:
        name: what users pass as ``algorithm=``.
        state_class: its State (saved in checkpoints, so allowed by ``torch.load``).
        split: its two halves, if it has them (see the module docstring).
        volume: words received per rank, (lower, upper), as a function of (n, k, P):
            what ``sparsecomm study volume`` compares the measured traffic with.
        traffic: its steady call's modelled traffic (:data:`TrafficModel`): what ``"auto"``
            chooses by and the projections use.
        global_k: k counts entries of the sum, not each rank's (:attr:`AlgorithmSpec.global_k`).
    """

    def deco(fn: Callable[..., SparseResult]) -> Callable[..., SparseResult]:
        if name in _REGISTRY:
            raise ValueError(f"algorithm {name!r} is already registered")
        summary = first_paragraph(fn.__doc__)
        takes = {arg: arg in inspect.signature(fn).parameters for arg in ("limit", "check")}
        for arg, taken in takes.items():
            if split is not None and taken != (arg in inspect.signature(split[0]).parameters):
                raise ValueError(f"algorithm {name!r}: fn and its first half must both take {arg}=, or neither")
        _REGISTRY[name] = AlgorithmSpec(name, fn, state_class, summary, split, takes_limit=takes["limit"],
                                        takes_check=takes["check"], volume=volume,
                                        traffic=traffic, global_k=global_k)
        state_class.algorithm = name
        allow_in_checkpoints(state_class)
        return fn

    return deco


def get(name: str) -> AlgorithmSpec:
    """The registered algorithm ``name``; ValueError listing the known ones otherwise."""
    try:
        return _REGISTRY[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown algorithm {name!r}; registered: {names()}") from None


def names() -> list[str]:
    """Registered algorithm names, sorted."""
    return sorted(_REGISTRY)


def tree_levels(P: int) -> int:
    """Levels of a tree over ``P`` ranks, ceil(log2 P) (0 for one rank): volume formulas use it."""
    return math.ceil(math.log2(P)) if P > 1 else 0
