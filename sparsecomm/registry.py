"""The algorithm registry and the result type every algorithm returns.

An algorithm is a function ``fn(acc, k, comm, state, codec, preselected) ->
SparseResult`` registered under a name with the State class it uses::

    @register("oktopk", OkTopkState)
    def oktopk(acc, k, comm, state, codec, preselected): ...

``acc`` is the (error-compensated) flat input in the work dtype, which the
algorithm must not modify; ``codec`` (a :class:`~sparsecomm.compress.Compressor`,
bound to this call) is how values travel: a cast to the input's dtype unless
the caller chose a compressor; ``preselected`` is what the state's
``compensate`` selected while accumulating (a
:class:`~sparsecomm.state.Preselection`, Ok-Topk's fused pass), else None.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator

import torch

from .comm.base import Communicator
from .state import CallStats, PhaseStats, State, allow_in_checkpoints

__all__ = ["SparseResult", "AlgorithmSpec", "register", "get", "names", "PhaseRecorder"]


@dataclass
class SparseResult:
    """The reduced result of one call, identical on every rank (but ``contributed``/``sent``).

    Attributes:
        n: number of elements of the flat tensor.
        indexes: sorted int64 indexes of the result's entries, or None when
            the result is dense (``values`` then has n entries).
        values: reduced values (sum over ranks) at ``indexes``.
        contributed: this rank's local indexes that reached the result, or
            None when every entry did.
        sent: the values this rank contributed at ``contributed``, as the
            receivers decode them, in the work dtype.
        stats: this rank's statistics of the call.
        kept_idx, kept_val: values this rank must add back to its residual:
            the error of re-encoding sums it reduced for others (region owner,
            tree node), so that results plus residuals keep every gradient.
    """

    n: int
    indexes: torch.Tensor | None
    values: torch.Tensor
    contributed: torch.Tensor | None
    sent: torch.Tensor | None
    stats: CallStats
    kept_idx: torch.Tensor | None = None
    kept_val: torch.Tensor | None = None

    def _scaled(self, scale: float) -> torch.Tensor:
        vals = self.values
        if scale != 1.0:
            vals = vals.to(torch.promote_types(vals.dtype, torch.float32)) * scale
        return vals

    def count_nonfinite(self, dtype: torch.dtype, scale: float = 1.0) -> int:
        """How many result values are NaN/Inf once scaled and cast to ``dtype`` (O(k) when sparse)."""
        return int((~torch.isfinite(self._scaled(scale).to(dtype))).sum())

    def to_dense(self, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
        """A new dense tensor of n entries holding the result times ``scale``."""
        vals = self._scaled(scale)
        if self.indexes is None:
            return vals.to(dtype, copy=True)
        out = torch.zeros(self.n, dtype=dtype, device=self.values.device)
        out[self.indexes] = vals.to(dtype)
        return out


@dataclass(frozen=True)
class AlgorithmSpec:
    name: str
    fn: Callable[..., SparseResult]
    state_class: type[State]
    summary: str


_REGISTRY: dict[str, AlgorithmSpec] = {}


def register(name: str, state_class: type[State]) -> Callable:
    """Decorator registering an algorithm function under ``name``."""

    def deco(fn: Callable[..., SparseResult]) -> Callable[..., SparseResult]:
        if name in _REGISTRY:
            raise ValueError(f"algorithm {name!r} is already registered")
        summary = (fn.__doc__ or "").strip().splitlines()[0] if fn.__doc__ else ""
        _REGISTRY[name] = AlgorithmSpec(name, fn, state_class, summary)
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


class PhaseRecorder:
    """Collects per-phase traffic (from the communicator's counters) and wall time."""

    def __init__(self, comm: Communicator, stats: CallStats) -> None:
        self.comm, self.stats = comm, stats

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        before, t0 = self.comm.stats.snapshot(), time.perf_counter()
        try:
            yield
        finally:
            delta = self.comm.stats - before
            p = self.stats.phases.setdefault(name, PhaseStats())
            p.bytes_sent += delta.bytes_sent
            p.bytes_received += delta.bytes_received
            p.messages_sent += delta.messages_sent
            p.messages_received += delta.messages_received
            p.seconds += time.perf_counter() - t0
