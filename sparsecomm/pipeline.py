"""The call pipeline: check, accumulate, run the algorithm, refuse overflow, keep the residual.

1. :func:`execute`: the collective check (:mod:`sparsecomm.check`), with the
   error-feedback accumulation run first when it can stand in for the check's
   read of the tensor (the fused pass).
2. :func:`start`: the accumulation (if not run yet) and the algorithm, whole or
   its first half (:func:`sparsecomm.registry.register`'s ``split``).
3. :func:`finish`: the second half, if any; a result that overflows the
   caller's dtype is refused on every rank (the input stays in the residual);
   the residual update and the statistics.
"""

from __future__ import annotations

import functools
import inspect
import itertools
import math
import time
from dataclasses import dataclass
from typing import Any

import torch

from . import check
from .call import Call
from .compress import Compressor
from .errors import InputError
from .kernels import shares_memory
from .result import SparseResult
from .state import Compensated, PhaseStats, State, topk_count

__all__ = ["execute", "prepare", "check_prepared", "start", "finish", "Started", "Pending"]


_stateless_calls = itertools.count()


def execute(call: Call, checked: bool, out_dtype: torch.dtype | None, scale: float,
            private: bool = False, split: bool = False) -> "SparseResult | Started":
    """Check the call (collectively unless ``checked`` is False), then run it.

    When the state's next accumulation is the fused pass (``State.fuses_next``),
    the pass runs before the collective check and its output says whether the
    input was finite (``Compensated.finite``), which saves the check's own read
    of the tensor (a third of an ``add``, ~15% of a steady-state Ok-Topk call
    at 25M on CPU); a rejected call then takes the gradient back out
    (``State.rollback``).

    ``split``: stop after the algorithm's first half (see :func:`start`) and
    return it; :func:`finish` completes it.
    """
    if not checked:
        check.check_unchecked(call)
        started = start(call, out_dtype, scale, private, split=split)
        return started if split else finish(started)
    problem, early, nonfinite = prepare(call)
    if early is not None and problem is None and call.spec.takes_check and check.carried_words(call.comm.size):
        started = _start_carrying(call, out_dtype, scale, private, early, split, nonfinite)
        return started if split else finish(started)
    check_prepared(call, problem, early, nonfinite)
    started = start(call, out_dtype, scale, private, early, split)
    return started if split else finish(started)


def prepare(call: Call, problem: "tuple[int, str] | None" = None
            ) -> "tuple[tuple[int, str] | None, tuple[Compensated, float] | None, int | torch.Tensor | None]":
    """What the collective check needs from this rank: its first problem (``problem``, a
    caller's own, else :func:`check.local_problem`'s), and, when the state's next accumulation
    is the fused pass, that pass run now (with its seconds) and what it says of the input's
    finiteness (``nonfinite`` for :func:`check.check_collectively`)."""
    if problem is None:
        try:
            problem = check.local_problem(call)
        except Exception as exc:  # noqa: BLE001 - reported collectively
            problem = (check.Problem.CHECK_RAISED, f"checking the tensor raised {type(exc).__name__}: {exc}")
    early, nonfinite = None, None
    if problem is None and call.state is not None and call.state.fuses_next():
        flat = call.tensor.detach().reshape(-1)
        t0 = time.perf_counter()
        try:
            early = (_compensate(call.state, flat, _zero_target(call)), time.perf_counter() - t0)
            call.out_zeroed = early[0].out_zeroed
        except Exception as exc:  # noqa: BLE001 - raised on every rank by the check, never a hang
            problem = (check.Problem.ACCUMULATION_RAISED,
                       f"accumulating the residual raised {type(exc).__name__}: {exc}")
        else:
            if early[0].pending is not None and call.comm.size == 1:
                early[0].read()  # no exchange to carry the count
            if early[0].pending is not None:  # the check's row carries the count, and classifies it
                nonfinite = early[0].pending
            else:
                finite = early[0].finite
                # True: settled by the pass. False (a non-finite sum) or None (a buffer too small
                # to tell): one read of the tensor says whether it, or only its sum, is not finite.
                nonfinite = 0 if finite else (1 if not check.all_finite(call.tensor) else (2 if finite is False else 0))
    return problem, early, nonfinite


def check_prepared(call: Call, problem: "tuple[int, str] | None", early: "tuple[Compensated, float] | None",
                   nonfinite: "int | torch.Tensor | None") -> None:
    """The collective check of a call that :func:`prepare` made ready; a refusal takes the fused pass's
    gradient back out of the residual (``State.rollback``) before it raises."""
    try:
        check.check_collectively(call, problem, nonfinite)
    except InputError:
        if early is not None:
            call.state.rollback(call.tensor.detach().reshape(-1), early[0].read().nonfinite)
        raise


def _start_carrying(call: Call, out_dtype: torch.dtype | None, scale: float, private: bool,
                    early: "tuple[Compensated, float]", split: bool, nonfinite: int | torch.Tensor | None
                    ) -> "Started":
    """:func:`start` with the collective check left to the algorithm's first exchange.

    1. Keep the state's fields (the algorithm's local steps move its thresholds
       before the check).
    2. Run the algorithm with a :class:`check.CarriedCheck`.
    3. A refusal: take the gradient back out of the residual and restore the fields,
       as if the check had come first. An error on this rank before the check: tell
       the peers through the check (every rank raises), never leave them waiting.
    """
    state = call.state
    kept = dict(vars(state))
    carried = check.CarriedCheck(call, None, nonfinite)
    try:
        started = start(call, out_dtype, scale, private, early, split, carried)
    except Exception as exc:
        try:
            if not carried.done:
                carried.fail(exc)  # raises InputError here and on every peer
            raise
        finally:
            if carried.refused:
                state.rollback(call.tensor.detach().reshape(-1), early[0].read().nonfinite)
                vars(state).clear()
                vars(state).update(kept)
    if not carried.done:
        raise RuntimeError(f"algorithm {call.algorithm!r} took check= but never ran the collective check")
    return started


@functools.lru_cache(maxsize=None)
def _takes_zero_out(cls: type) -> bool:
    """Whether a State class's ``compensate`` takes ``zero_out`` (a user's registered state
    may predate it)."""
    return "zero_out" in inspect.signature(cls.compensate).parameters


def _compensate(state: State, flat: torch.Tensor, zero_out: torch.Tensor | None) -> Compensated:
    return state.compensate(flat, zero_out) if zero_out is not None else state.compensate(flat)


def _zero_target(call: Call) -> torch.Tensor | None:
    """``out=``, flat, when the fused accumulating pass may set it to zeros on its way
    (``State.compensate``'s ``zero_out``), or None.

    Only for an ``out`` sharing no memory with the input or the residual,
    which the pass still reads. A refused call may leave ``out`` zeroed, and
    a split call's ``out`` holds nothing until ``Pending.finish()``: both
    are documented.
    """
    out = call.out
    if out is None or call.state is None or not _takes_zero_out(type(call.state)):
        return None
    flat = out.view(-1)
    residual = call.state.residual
    if shares_memory(flat, call.tensor) or (residual is not None and shares_memory(flat, residual)):
        return None
    return flat


@dataclass
class Started:
    """A call whose algorithm ran (``result``), or ran its first half (``half``)."""

    call: Call
    state: State
    acc: torch.Tensor
    codec: Compressor
    out_dtype: torch.dtype | None
    scale: float
    private: bool
    accumulate: float
    result: SparseResult | None = None
    half: Any = None


def start(call: Call, out_dtype: torch.dtype | None, scale: float, private: bool = False,
          early: "tuple[Compensated, float] | None" = None, split: bool = False,
          carried: "check.CarriedCheck | None" = None) -> Started:
    """Compensate and run the algorithm: whole, or with ``split`` only its first half when it
    registered two (``AlgorithmSpec.split``).

    ``out_dtype``/``scale``: what the caller will turn the result into (the
    overflow check covers that conversion); None for the sparse result itself.
    ``private``: the result goes to the user, so none of its tensors may be
    the state's buffers (which the state updates in place, or reuses next call).
    ``early``: the compensation and its seconds, when :func:`execute` ran it already.
    ``carried``: the collective check, for the algorithm's first exchange to carry
    (passed as its ``check=``; algorithms that take one get None when it ran already).
    """
    spec = call.spec
    state = call.state if call.state is not None else spec.state_class.exact(call.density)
    comm = call.comm
    flat = call.tensor.detach().reshape(-1)
    # Stochastic rounding draws noise per (rank, step): the state's iteration,
    # or a count of this process's stateless calls (every rank makes the same).
    step = state.iteration if call.state is not None else next(_stateless_calls)
    if early is None:
        t0 = time.perf_counter()
        early = (_compensate(state, flat, _zero_target(call)), time.perf_counter() - t0)
        call.out_zeroed = early[0].out_zeroed
    compensated, accumulate = early
    acc = compensated.acc
    # What the overflow check in finish will allow: an algorithm that bounds its result
    # below this may settle the residual before the check (its ``limit`` argument).
    dtype = out_dtype or acc.dtype
    limit = min(torch.finfo(acc.dtype).max, torch.finfo(dtype).max / abs(scale) if scale else math.inf)
    extra = {"limit": limit} if spec.takes_limit else {}
    if spec.takes_check:
        extra["check"] = carried
    k = topk_count(state.density, flat.numel())
    codec = call.codec.for_call(comm.rank, step)
    started = Started(call, state, acc, codec, out_dtype, scale, private, accumulate)
    if split and spec.split is not None:
        started.half = spec.split[0](acc, k, comm, state, codec, compensated.preselected, **extra)
    else:
        started.result = spec.fn(acc, k, comm, state, codec, compensated.preselected, **extra)
    return started


def finish(started: Started) -> SparseResult:
    """The second half of the algorithm if one is left, then refuse a non-finite result and
    keep the residual."""
    call, state, acc, codec = started.call, started.state, started.acc, started.codec
    result = started.result
    if result is None:
        result = call.spec.split[1](started.half, call.comm)
        started.half = None
    # Error-feedback accumulation (fused with selection for Ok-Topk's reuse steps) is a phase too.
    result.stats.phases = {"accumulate": PhaseStats(seconds=started.accumulate), **result.stats.phases}
    overflow = result.count_nonfinite(started.out_dtype or result.values.dtype, started.scale)
    if overflow:
        # The result is the same on every rank, so every rank takes this branch.
        state.keep_all(acc)
        state.record(result.stats)
        dtype = started.out_dtype or result.values.dtype
        raise InputError(
            f"sparsecomm.allreduce: the reduced result overflows {dtype} at {overflow} "
            f"entr{'y' if overflow == 1 else 'ies'} (every rank's values are finite, their "
            f"{'average' if call.op == 'avg' else 'sum'} is not); use op='avg', a wider input "
            "dtype or compressor='bf16'"
            + ("; this call's input stays in the residual" if state.error_feedback else ""))
    if started.private:
        # Views count too (a dense result is a view of a padded buffer).
        kept = [acc.untyped_storage().data_ptr()] + [buf.untyped_storage().data_ptr() for buf in state.buffers()]
        for name in ("values", "sent", "kept_val"):
            value = getattr(result, name)
            if value is not None and value.untyped_storage().data_ptr() in kept:
                setattr(result, name, value.clone())
    # A cast to the work dtype re-encodes exactly: the kept errors are all zero, and their
    # scatter into the residual (O(k) random writes, ~3 ms at k = 250k on CPU) is skipped.
    state.update(acc, result, keep_errors=not codec.exact_for(acc.dtype))
    state.record(result.stats)
    if started.private:
        result.compact()  # the user's result says exactly which entries reached it
    return result


class Pending:
    """An :func:`allreduce` started by :func:`begin_allreduce`; :meth:`finish` completes it.

    Until then the input tensor must stay unchanged, its state takes no other call, and
    ``out``'s contents are unspecified (the first half may have zeroed it).
    """

    def __init__(self, started: Started, out: torch.Tensor | None) -> None:
        self._started, self._out = started, out
        #: Whether the algorithm ran only its first half (False: it has no halves and ran whole,
        #: residual update included; ``finish`` then only writes the result).
        self.split = started.result is None
        self._result = None if self.split else finish(started)

    def finish(self) -> torch.Tensor:
        """Run what is left (a collective: every rank in the same order) and return the result."""
        if self._started is None:
            raise RuntimeError("Pending.finish: this call has finished already")
        started, self._started = self._started, None
        result = finish(started) if self._result is None else self._result
        self._result = None
        tensor = started.call.tensor
        if self._out is not None:
            result.to_dense(tensor.dtype, started.scale, out=self._out.view(-1), zeroed=started.call.out_zeroed)
            return self._out
        return result.to_dense(tensor.dtype, started.scale).reshape(tensor.shape)


