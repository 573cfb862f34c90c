"""Per-tensor algorithm state: settings, error-feedback residual, iteration, statistics.

Every algorithm's state class derives from :class:`State`. Fields come in three
groups, as in PyTorch's comm-hook states: set by the user (validated in
``__init__``), internal (thresholds, boundaries, residual, iteration) and
statistics (``last`` call and running ``totals``). States hold tensors and
numbers only, so they pickle (``torch.save(state)``) for checkpoints.
"""

from __future__ import annotations

import functools
import inspect
import math
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch

from . import kernels
from .buffers import BufferPool
from .comm.base import CommStats

__all__ = ["State", "CallStats", "PhaseStats", "Compensated", "Preselection", "check_density", "topk_count",
           "allow_in_checkpoints"]


def allow_in_checkpoints(*classes: type) -> None:
    """Let ``torch.load`` with its defaults (``weights_only=True``) rebuild ``classes``.

    States hold only tensors, numbers, strings, tuples and dicts, which the
    weights-only unpickler accepts once the classes themselves are allowed.
    """
    add = getattr(torch.serialization, "add_safe_globals", None)  # torch >= 2.4
    if add is not None:
        add(list(classes))


def check_density(density: Any) -> float:
    """Return ``density`` as a float in (0, 1], or raise ValueError saying why not."""
    if isinstance(density, bool) or not isinstance(density, (int, float)):
        raise ValueError(f"density must be a real number in (0, 1], got {density!r}")
    d = float(density)
    if not (0.0 < d <= 1.0):  # also rejects NaN
        raise ValueError(f"density must be in (0, 1], got {density!r}")
    return d


def topk_count(density: float, n: int) -> int:
    """k = ceil(density * n), at least 1 and at most n.

    The product is rounded to 9 decimals first, so that e.g. 0.07 * 100 (which
    is 7.000000000000001 in binary floating point) gives k = 7, not 8.
    """
    return min(n, max(1, math.ceil(round(density * n, 9))))


@dataclass
class PhaseStats(CommStats):
    """Traffic (the communicator's counters) and wall time of one phase of one call on this rank."""

    seconds: float = 0.0


@dataclass
class CallStats:
    """Statistics of one allreduce call on this rank."""

    algorithm: str = ""
    n: int = 0
    k: int = 0
    local_selected: int = 0
    global_selected: int = 0
    phases: dict[str, PhaseStats] = field(default_factory=dict)
    #: Algorithm-specific events, e.g. {"local_recomputed": 1, "balanced": 0}.
    events: dict[str, int] = field(default_factory=dict)

    @property
    def bytes_sent(self) -> int:
        return sum(p.bytes_sent for p in self.phases.values())

    @property
    def bytes_received(self) -> int:
        return sum(p.bytes_received for p in self.phases.values())

    @property
    def messages_sent(self) -> int:
        return sum(p.messages_sent for p in self.phases.values())

    @property
    def seconds(self) -> float:
        return sum(p.seconds for p in self.phases.values())

    @property
    def critical_bytes(self) -> int:
        """Sum over phases of max(sent, received): the bytes a full-duplex link must
        carry when phases run one after another (what the papers' cost formulas count)."""
        return sum(max(p.bytes_sent, p.bytes_received) for p in self.phases.values())

    @property
    def critical_messages(self) -> int:
        """Sum over phases of max(messages sent, messages received)."""
        return sum(max(p.messages_sent, p.messages_received) for p in self.phases.values())


@dataclass
class Preselection:
    """Entries found above a reused threshold while the residual was accumulated (one fused pass).

    ``indexes`` holds the first ``min(count, capacity)`` of them in index
    order; ``count`` is how many there were in all (more than
    ``len(indexes)`` when the buffer overflowed). ``values``: the
    accumulated values at ``indexes``, when the pass kept them (saves
    gathering them again from n entries).
    """

    indexes: torch.Tensor
    count: int
    values: torch.Tensor | None = None
    #: When the pass also counted the candidates at a ladder of ``rungs`` (host floats):
    #: ``above[j]`` at or above rung j, ``top`` the largest magnitude, ``rung`` each
    #: candidate's rung (``kernels.ef_select_counted``), read with the count.
    rungs: list[float] | None = None
    above: list[int] | None = None
    top: float | None = None
    rung: torch.Tensor | None = None
    #: The largest |acc| of the call, when the pass saw every candidate (its largest, or
    #: the threshold when there were none): a bound on every value the call can send.
    peak: float | None = None


@dataclass
class Compensated:
    """What :meth:`State.compensate` hands to the algorithm.

    ``acc``: the error-compensated flat input in the work dtype (the algorithm
    must not modify it, but to settle the residual: see ``sparsecomm.registry``).
    ``preselected``: a :class:`Preselection`, when the state selected while
    accumulating, else None.
    """

    @classmethod
    def counted(cls, acc: torch.Tensor, sel: "kernels.Selected", capacity: int, out_zeroed: bool = False,
                rungs: list[float] | None = None, threshold: float | None = None) -> "Compensated":
        """What ``kernels.ef_select_counted`` read (counts, and the ladder's when ``rungs``) as a
        compensation. ``threshold``: the pass's, for ``Preselection.peak``."""
        kept = min(sel.count, capacity)
        peak = (max(sel.top, threshold) if threshold is not None and sel.top is not None and sel.count <= capacity
                else None)
        pre = Preselection(sel.indexes[:kept], sel.count, sel.values[:kept], rungs=rungs, above=sel.above,
                           top=sel.top, rung=None if sel.bucket is None else sel.bucket[:kept], peak=peak)
        return cls(acc, pre, nonfinite=sel.nonfinite, out_zeroed=out_zeroed)

    acc: torch.Tensor
    preselected: Preselection | None = None
    #: How many accumulated sums were not finite (and so not written), when a fused pass
    #: counted them (``ef_select`` selects every one, ``ef_accumulate`` counts them); None
    #: when none ran or its buffer overflowed.
    nonfinite: int | None = None
    #: Whether the pass also set the call's dense output to zeros (``zero_out`` of
    #: :meth:`State.compensate`): a sparse result then writes only its entries.
    out_zeroed: bool = False
    #: The pass's count of non-finite sums while it is still on the device (``nonfinite``
    #: None until :meth:`read`): the collective check carries it in its row unread.
    pending: torch.Tensor | None = None

    @property
    def finite(self) -> bool | None:
        """Whether every accumulated entry is finite, when the pass could tell (else None)."""
        return None if self.nonfinite is None else self.nonfinite == 0

    def read(self) -> "Compensated":
        """Read the ``pending`` count into ``nonfinite`` (one read of the device)."""
        if self.pending is not None:
            self.nonfinite, self.pending = int(kernels.dispatch.to_host(self.pending)), None
        return self


@functools.lru_cache(maxsize=None)
def _setting_names(cls: type) -> tuple[str, ...]:
    """The ``__init__`` arguments of a State class (``inspect.signature``: ~0.5 ms, once per class),
    without the old names of renamed settings (:attr:`State.RENAMED`)."""
    return tuple(p for p in inspect.signature(cls.__init__).parameters if p != "self" and p not in cls.RENAMED)


class State:
    """Base state: density, error feedback, iteration counter and statistics.

    Args:
        density: fraction of entries each rank selects, in (0, 1].
        error_feedback: keep what was not contributed in a residual and add it
            to the next call's input (residual accumulation).
    """

    #: Registry name of the algorithm this state belongs to (set by subclasses).
    algorithm = ""
    #: Attributes that live for one call or are buffers: never saved in checkpoints.
    _TRANSIENT = ("_pool", "_maxima", "_scales_wanted")
    #: Renamed settings, old name -> new: the old keyword still works (with a
    #: DeprecationWarning, :meth:`_renamed`) and checkpoints that hold it load.
    RENAMED: dict[str, str] = {}
    #: How many result buffers a plain call (no ``out=``) may keep (:meth:`result_buffer`):
    #: two serve ``out = allreduce(g, state=s)``, whose previous result lives through the call.
    RESULT_BUFFERS = 2
    def __init__(self, density: float = 0.01, error_feedback: bool = False) -> None:
        # Set by the user.
        self.density = check_density(density)
        if not isinstance(error_feedback, bool):
            raise ValueError(f"error_feedback must be True or False, got {error_feedback!r}")
        self.error_feedback = error_feedback
        # Internal.
        self.iteration = 0
        self.n: int | None = None
        self.residual: torch.Tensor | None = None
        # Statistics.
        self.last: CallStats | None = None
        self.totals: dict[str, int] = {"calls": 0, "bytes_sent": 0, "bytes_received": 0,
                                       "local_selected": 0, "global_selected": 0}

    def settings(self) -> dict[str, Any]:
        """The user's settings (the ``__init__`` arguments) and the iteration.

        Every rank must hold the same ones: the collective input check compares them.
        """
        return {**{name: getattr(self, name) for name in _setting_names(type(self))}, "iteration": self.iteration}

    @classmethod
    def exact(cls, density: float) -> "State":
        """The state a stateless call uses: exact selection, no residual."""
        return cls(density)

    # ---- checks made before the call (collectively, see sparsecomm.api) -----
    def check_tensor(self, n: int) -> str | None:
        """Why this state cannot serve a tensor of ``n`` elements, or None."""
        if self.n is not None and self.n != n:
            return (f"this {type(self).__name__} was used with a tensor of {self.n} elements, "
                    f"now {n}: use one state per tensor")
        return None

    # ---- error feedback --------------------------------------------------------
    @staticmethod
    def work_dtype(dtype: torch.dtype) -> torch.dtype:
        """Accumulation dtype: float32 for 16-bit inputs, else the input's."""
        return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype

    def compensate(self, flat: torch.Tensor, zero_out: torch.Tensor | None = None) -> Compensated:
        """The accumulated input: residual + flat (work dtype), or flat itself.

        ``zero_out``: the call's dense output (sharing no memory with flat or the
        residual), which a fused selecting pass may set to zeros on its way
        (``Compensated.out_zeroed`` says whether it did): the write of a sparse
        result is then O(k), not a pass over n of its own.
        """
        self.n = flat.numel()
        wd = self.work_dtype(flat.dtype)
        if not self.error_feedback:
            return Compensated(flat.to(wd))
        return self._accumulate(flat, self.residual_on(flat))

    def _accumulate(self, flat: torch.Tensor, residual: torch.Tensor, block: int | None = None) -> Compensated:
        """residual += flat in place (a fresh n-element tensor per call costs more in page
        faults than the add), in one pass (``kernels.ef_accumulate``: numba on CPU, Triton on
        CUDA, else the torch chain; with block maxima when ``block`` is given) that writes
        only the finite sums and counts the others: the input needs no finite check of its
        own, and an overflowing sum never reaches the residual, so a refused call can take
        the gradient back out (:meth:`rollback`) instead of leaving an inf behind."""
        maxima, nonfinite = kernels.ef_accumulate(flat, residual, block, lazy=True)
        if maxima is not None:
            self._maxima = (self.iteration, maxima)  # for this call only
        if isinstance(nonfinite, torch.Tensor):  # on the device: read with the check
            return Compensated(residual, pending=nonfinite)
        return Compensated(residual, nonfinite=nonfinite)

    def fuses_next(self) -> bool:
        """Whether the next :meth:`compensate` is a fused pass (``kernels.ef_select`` or
        ``kernels.ef_accumulate``, on every device), which also tells whether the input was finite."""
        if not self.error_feedback:
            return False
        # A first call has no residual yet: it is checked first, then accumulates into zeros.
        return self.residual is not None

    def rollback(self, flat: torch.Tensor, nonfinite: int | None = None) -> None:
        """Undo the fused :meth:`compensate` of ``flat`` (the call was rejected).

        The pass wrote residual + flat only where that sum was finite; there it
        is subtracted back (exact up to the one rounding of the sum), elsewhere
        the residual never changed. Which entries were written:

        1. ``nonfinite`` (the pass's count of sums it did not write,
           ``Compensated.nonfinite``) equal to the count of non-finite entries
           of flat: no finite entry overflowed, so every finite entry was written.
        2. Otherwise (some sum overflowed, or the pass could not count), those
           where residual + flat is finite now: this misses an entry whose
           written residual plus flat overflows again (|flat| near the dtype's
           maximum), which then keeps that gradient.
        """
        r = self.residual
        g = flat.to(r.dtype)
        zero = torch.zeros((), dtype=r.dtype, device=r.device)
        finite_g = torch.isfinite(g)
        if nonfinite is not None and nonfinite == int((~finite_g).sum()):
            r.sub_(torch.where(finite_g, g, zero))
        else:
            r.sub_(torch.where(torch.isfinite(r + g), g, zero))

    def residual_on(self, flat: torch.Tensor) -> torch.Tensor:
        """The residual on ``flat``'s device: zeros at first, moved (never reset) when it is
        elsewhere, e.g. restored from a checkpoint loaded with ``map_location="cpu"``."""
        if self.residual is None:
            self.residual = torch.zeros(flat.numel(), dtype=self.work_dtype(flat.dtype), device=flat.device)
        elif self.residual.device != flat.device:
            self.residual = self.residual.to(flat.device)
        return self.residual

    def update(self, acc: torch.Tensor, result: Any, keep_errors: bool = True) -> None:
        """Residual <- acc minus what this rank contributed, as received (so rounding stays),
        plus the re-encoding error of sums it reduced for others (``result.kept_*``; skipped
        with ``keep_errors=False``, when the caller knows them to be zero).

        ``result.contributed`` None means every entry was contributed
        (``result.sent`` then holds all n values); with ``result.reached`` it
        may hold more than contributed, with zeros sent there (r + -0 is r, bit
        for bit); ``result.settled``: the algorithm already left acc minus what
        it sent in acc.
        """
        if not self.error_feedback:
            return
        residual = acc  # the residual itself (compensate accumulated in place): O(k) updates
        if not result.settled:
            if result.contributed is None:
                residual.sub_(result.sent.to(acc.dtype))
            else:
                # contributed indexes are unique: r + (-v) is bitwise r - v
                kernels.scatter_add(residual, result.contributed, result.sent, unique=True, subtract=True)
        if keep_errors and result.kept_idx is not None and result.kept_idx.numel():
            kernels.scatter_add(residual, result.kept_idx, result.kept_val, unique=True)
        elif keep_errors and result.kept_at is not None and result.kept_val is not None:
            residual[result.kept_at:result.kept_at + result.kept_val.numel()] += result.kept_val.to(acc.dtype)
        self.residual = residual

    # ---- buffers the state keeps (never saved in checkpoints) -------------------
    @property
    def pool(self) -> BufferPool:
        """This state's persistent buffers (made on first use; a loaded state makes its own)."""
        pool = self.__dict__.get("_pool")
        if pool is None:
            pool = self.__dict__["_pool"] = BufferPool(self.RESULT_BUFFERS)
        return pool

    def scratch(self, name: str, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """:meth:`BufferPool.scratch`: an all-zero buffer its users leave all zero."""
        return self.pool.scratch(name, numel, dtype, device)

    def workspace(self, name: str, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """:meth:`BufferPool.workspace`: a buffer whose contents are undefined between uses."""
        return self.pool.workspace(name, numel, dtype, device)

    def result_buffer(self, like: torch.Tensor) -> torch.Tensor | None:
        """:meth:`BufferPool.result_buffer`: where a plain call's result goes, or None."""
        if self.n is not None and self.n != like.numel():
            return None  # the call is refused (one state per tensor): keep the buffers
        return self.pool.result_buffer(like)

    def buffers(self) -> list[torch.Tensor]:
        """The persistent buffers (scratch and workspace) this state holds."""
        pool = self.__dict__.get("_pool")
        return pool.buffers() if pool is not None else []

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k not in self._TRANSIENT}

    def __setstate__(self, d: dict) -> None:
        d = dict(d)
        for old, new in self.RENAMED.items():  # a checkpoint from before the rename
            if old in d and new not in d:
                d[new] = d.pop(old)
        self.__dict__.update(d)

    def _renamed(self, old: str, value: Any, current: Any) -> Any:
        """``current``, or ``value`` given under the setting's old name ``old`` (with a warning)."""
        if value is None:
            return current
        new = self.RENAMED[old]
        warnings.warn(f"{type(self).__name__}({old}=) is now {new}=; the old name will go", DeprecationWarning,
                      stacklevel=3)
        return value

    def keep_all(self, acc: torch.Tensor) -> None:
        """After a call that delivered nothing: the whole accumulated input stays in the residual."""
        if self.error_feedback:
            self.residual = acc

    def record(self, stats: CallStats) -> None:
        self.iteration += 1
        self.last = stats
        t = self.totals
        t["calls"] += 1
        t["bytes_sent"] += stats.bytes_sent
        t["bytes_received"] += stats.bytes_received
        t["local_selected"] += stats.local_selected
        t["global_selected"] += stats.global_selected
        for key, value in stats.events.items():
            t[key] = t.get(key, 0) + value

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(density={self.density}, error_feedback="
                f"{self.error_feedback}, iteration={self.iteration})")


allow_in_checkpoints(State, CallStats, PhaseStats)
