"""One call's arguments, resolved: its communicator, its algorithm (``"auto"``'s choice made
here, once) and density, and the lookups the check and the pipeline share (the registered
algorithm, the compressor for the tensor's dtype).

The public calls (:mod:`sparsecomm.api`) make a :class:`Call`; the collective check
(:mod:`sparsecomm.check`) then refuses it on every rank or none, and the pipeline
(:mod:`sparsecomm.pipeline`) runs it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from . import choice, registry
from .comm import Communicator, resolve
from .compress import Compressor, get_compressor
from .registry import AlgorithmSpec
from .state import State

__all__ = ["Call"]


@dataclass
class Call:
    """The arguments of one call after resolution (communicator, algorithm, density)."""

    tensor: Any
    density: Any
    algorithm: Any
    op: Any
    state: State | None
    compressor: Any
    comm: Communicator
    out: Any = None
    #: Set when the call's fused pass left ``out`` all zero (see :func:`_zero_target`).
    out_zeroed: bool = False
    #: Why ``algorithm="auto"`` could not choose (a bad network profile), reported by the check.
    auto_error: str | None = None
    #: The public call's name, as its refusals begin ("sparsecomm.allreduce: ...").
    name: str = "allreduce"

    @classmethod
    def resolve(cls, tensor: Any, density: Any, algorithm: Any, op: Any, state: State | None,
                compressor: Any, group: Any, comm: Any, out: Any = None) -> "Call":
        if algorithm is None:
            algorithm = state.algorithm if state is not None and state.algorithm else "oktopk"
        if density is None:
            density = state.density if isinstance(state, State) else 0.01
        c, auto_error = resolve(group=group, comm=comm), None
        if algorithm == choice.AUTO:
            algorithm, auto_error = _auto(tensor, density, state, compressor, c)
        return cls(tensor, density, algorithm, op, state, compressor, c, out, auto_error=auto_error)

    @functools.cached_property
    def spec(self) -> AlgorithmSpec:
        """The registered algorithm, looked up once (ValueError if there is none)."""
        if self.algorithm == choice.AUTO:
            raise ValueError(f"algorithm='auto' could not choose: {self.auto_error}")
        return registry.get(self.algorithm)

    @functools.cached_property
    def codec(self) -> Compressor:
        """How values travel, looked up once (ValueError for an unknown compressor).

        With op="avg", 16-bit float values travel pre-divided by P (as PyTorch's
        fp16 hook does): sums whose average fits float16 must not overflow on the wire.
        """
        return get_compressor(self.compressor, self.tensor.dtype,
                              divisor=self.comm.size if self.op == "avg" else 1)


def _auto(tensor: Any, density: Any, state: State | None, compressor: Any, comm: Communicator
          ) -> tuple[str, str | None]:
    """``algorithm="auto"`` resolved: a state's own algorithm (the choice was made when it was),
    else :func:`choice.choose` for the tensor. Input the check refuses anyway (not a tensor,
    a bad density or compressor) leaves the default, for the check to name."""
    if isinstance(state, State) and state.algorithm:
        return state.algorithm, None
    try:
        prof = choice.profile(comm=comm)
    except ValueError as exc:  # a bad $SPARSECOMM_AUTO_NETWORK: refused on every rank by the check
        return choice.AUTO, str(exc)
    try:
        return choice.choose(tensor.numel(), density, comm.size, tensor.dtype, compressor, prof,
                             tensor.device.type, comm), None
    except (AttributeError, TypeError, ValueError, KeyError):
        return "oktopk", None
