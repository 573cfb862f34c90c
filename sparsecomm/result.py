"""What every algorithm returns (:class:`SparseResult`) and how it counts its phases (:class:`PhaseRecorder`)."""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

import torch

from . import kernels
from .comm.base import Communicator
from .state import CallStats, PhaseStats

__all__ = ["SparseResult", "PhaseRecorder"]


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
            tree node), so that results plus residuals keep every gradient;
            None when the values travel exactly (no error to keep).
        kept_at: with ``kept_idx`` None, ``kept_val`` covers the contiguous
            positions ``kept_at, kept_at + 1, ...`` (a dense owner's chunk: an
            index per entry would cost an n-sized ``arange`` per call).
        settled: the algorithm already subtracted what this rank sent from its
            residual (acc), in the pass that encoded it; ``sent`` is then None
            (the update only adds ``kept_*`` back).
        bound: no |value| exceeds this, known without reading the values (from
            the scales they were decoded with): the overflow check then skips
            its pass over n values. None: unknown.
        reached: when given, ``contributed`` is a superset (this rank's whole
            selection) and ``reached`` marks the entries of it that reached the
            result; ``sent`` is zero elsewhere, so the residual update needs no
            compaction (on a GPU, no read of its size). :meth:`compact` makes
            ``contributed`` exact.
    """

    n: int
    indexes: torch.Tensor | None
    values: torch.Tensor
    contributed: torch.Tensor | None
    sent: torch.Tensor | None
    stats: CallStats
    kept_idx: torch.Tensor | None = None
    kept_val: torch.Tensor | None = None
    kept_at: int | None = None
    settled: bool = False
    bound: float | None = None
    reached: torch.Tensor | None = None

    def compact(self) -> "SparseResult":
        """Cut ``contributed`` and ``sent`` to the entries that reached the result (see ``reached``)."""
        if self.reached is not None:
            pos = kernels.nonzero(self.reached)
            self.contributed, self.sent = self.contributed.index_select(0, pos), self.sent.index_select(0, pos)
            self.reached = None
        return self

    def _scaled(self, scale: float, vals: torch.Tensor | None = None) -> torch.Tensor:
        """``vals`` (default: the values) times ``scale``, in at least float32."""
        vals = self.values if vals is None else vals
        if scale != 1.0:
            vals = vals.to(torch.promote_types(vals.dtype, torch.float32)) * scale
        return vals

    def count_nonfinite(self, dtype: torch.dtype, scale: float = 1.0) -> int:
        """How many result values are NaN/Inf once scaled and cast to ``dtype`` (O(k) when sparse).

        One min/max pass when all is well (a dense result has n values); counts only when not.
        Only the two extremes are scaled: scaling and casting are monotonic, roundings
        included, so the values are finite once scaled if their extremes are (no n-sized
        temporary; with ``bound`` not even the pass).
        """
        if self.bound is not None and self.bound * abs(scale) < torch.finfo(dtype).max:
            return 0  # every value is within the bound, so finite in dtype
        if self.values.numel() == 0:
            return 0
        lo, hi = torch.aminmax(self.values.reshape(-1))
        if bool(torch.isfinite(self._scaled(scale, torch.stack([lo, hi])).to(dtype)).all()):  # one host read
            return 0
        return int((~torch.isfinite(self._scaled(scale).to(dtype))).sum())

    def to_dense(self, dtype: torch.dtype, scale: float = 1.0,
                 out: torch.Tensor | None = None, zeroed: bool = False) -> torch.Tensor:
        """A dense tensor of n entries holding the result times ``scale``: new, or ``out``.

        ``out`` (flat, contiguous, n elements of ``dtype``) is written once
        (``kernels.scatter_dense``: zeros and the result's entries together; a
        dense result's product goes straight into it, with no n-sized temporary).
        ``zeroed``: ``out`` is all zero already, so a sparse result writes only
        its entries (O(k)).
        """
        if self.indexes is None:
            if out is None:
                return self._scaled(scale).to(dtype, copy=True)
            if scale == 1.0:
                return out.copy_(self.values)
            if self.values.dtype == torch.promote_types(self.values.dtype, torch.float32):
                # The product in the values' dtype, cast as it is stored: _scaled's bits.
                return torch.mul(self.values, scale, out=out)
            return out.copy_(self._scaled(scale))
        vals = self._scaled(scale)
        if out is None:
            out = torch.empty(self.n, dtype=dtype, device=self.values.device)
        return kernels.scatter_dense(out, self.indexes, vals.to(dtype), zeroed=zeroed)


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
            p = self.stats.phases.setdefault(name, PhaseStats())
            p += self.comm.stats - before
            p.seconds += time.perf_counter() - t0
