"""The public entry points: ``allreduce``, ``sparse_allreduce`` and ``algorithms``.

Input checking is collective. Every rank first checks its own arguments, then
the ranks exchange one small :class:`Signature` (problem code, element count,
shape, dtype, density, algorithm, op, NaN/Inf flag, state type and settings,
compressor) with an allgather of a few integers. Any problem on any rank, or
any disagreement between ranks, raises :class:`~sparsecomm.errors.InputError`
on *every* rank, so that no rank is left waiting in a collective its peers
will never join. The exchange costs one small allgather per call.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import itertools
import math
import struct
import time
import zlib
from dataclasses import dataclass
from typing import Any, Callable, TypeVar

import torch

from . import registry
from .comm import Communicator, resolve
from .compress import Compressor, get_compressor
from .errors import InputError, NonFiniteError
from .kernels import shares_memory
from .result import SparseResult
from .state import Compensated, PhaseStats, State, check_density, topk_count

__all__ = ["allreduce", "begin_allreduce", "Pending", "sparse_allreduce", "algorithms"]

_DTYPES = {torch.float16: 1, torch.bfloat16: 2, torch.float32: 3, torch.float64: 4}
_OPS = {"sum": 1, "avg": 2}
# Codes of the local problems, so peers can name what went wrong on a rank.
_PROBLEMS = {1: "unsupported dtype", 2: "empty tensor", 3: "invalid density",
             4: "tensor on a device the communicator cannot use", 5: "unknown algorithm",
             6: "invalid op", 7: "state does not fit the call", 8: "not a tensor",
             9: "unknown compressor", 10: "tensor cannot be read", 11: "out= does not fit the tensor",
             12: "the error-feedback accumulation failed"}

F = TypeVar("F", bound=Callable[..., Any])


def algorithms() -> list[str]:
    """Names of the registered allreduce algorithms."""
    return registry.names()


def _eager_under_compile(fn: F) -> F:
    """Run ``fn`` eagerly (a graph break) when called from a ``torch.compile``'d function.

    Dynamo would otherwise trace into numba's dispatcher and the communicators
    and fail. ``torch.compiler.disable`` is applied only at trace time, because
    it imports dynamo (1.4 s), which most processes never need.
    """
    is_compiling = getattr(getattr(torch, "compiler", None), "is_compiling", None)
    if is_compiling is None:  # torch without torch.compiler: nothing to guard against
        return fn

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if is_compiling():
            return torch.compiler.disable(fn, recursive=True)(*args, **kwargs)
        return fn(*args, **kwargs)

    return wrapper  # type: ignore[return-value]


# ---- the call, resolved once ------------------------------------------------------
@dataclass
class _Call:
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

    @classmethod
    def resolve(cls, tensor: Any, density: Any, algorithm: Any, op: Any, state: State | None,
                compressor: Any, group: Any, comm: Any, out: Any = None) -> "_Call":
        if algorithm is None:
            algorithm = state.algorithm if state is not None and state.algorithm else "oktopk"
        if density is None:
            density = state.density if isinstance(state, State) else 0.01
        return cls(tensor, density, algorithm, op, state, compressor, resolve(group=group, comm=comm), out)


# ---- the collective check ----------------------------------------------------------
def _crc(text: str) -> int:
    return zlib.crc32(text.encode())


def _float_bits(x: float) -> int:
    return struct.unpack("<q", struct.pack("<d", float(x)))[0]


@dataclass
class Signature:
    """What every rank must agree on, as integers (one row of the allgathered table).

    ``problem`` is 0 or a code of ``_PROBLEMS``; the other fields are -1/0
    when the rank has a problem (its tensor may not even be a tensor).
    """

    problem: int = 0
    numel: int = -1
    shape: int = -1
    dtype: int = -1
    density: int = -1
    algorithm: int = 0
    op: int = 0
    nonfinite: int = 0
    state_type: int = 0
    state_settings: int = 0
    compressor: int = 0

    #: Fields compared across ranks, with the words that name them in errors.
    COMPARED = (("numel", "element count"), ("shape", "shape"), ("dtype", "dtype"),
                ("density", "density"), ("algorithm", "algorithm"), ("op", "op"),
                ("state_type", "state type"), ("compressor", "compressor"))

    def row(self) -> list[int]:
        return [getattr(self, f.name) for f in dataclasses.fields(self)]

    @classmethod
    def of_row(cls, row: list[int]) -> "Signature":
        return cls(*row)


def _local_problem(call: _Call) -> tuple[int, str] | None:
    """This rank's first problem with the arguments, as (code, message), or None."""
    tensor, density = call.tensor, call.density
    if not isinstance(tensor, torch.Tensor):
        return 8, f"expected a torch.Tensor, got {type(tensor).__name__}"
    if tensor.dtype not in _DTYPES:
        return 1, (f"dtype {tensor.dtype} is not supported: sparsecomm reduces floating-point "
                   "gradients (float16, bfloat16, float32, float64)")
    if tensor.numel() == 0:
        return 2, f"the tensor is empty (shape {tuple(tensor.shape)}): nothing to reduce"
    if tensor.layout != torch.strided:
        return 10, f"the tensor has layout {tensor.layout}; pass a dense (strided) tensor"
    try:
        check_density(density)
    except ValueError as exc:
        return 3, str(exc)
    if not call.comm.supports_device(tensor.device):
        return 4, (f"the tensor is on {tensor.device}, which the {call.comm.name} communicator "
                   "cannot use (gloo and MPI take CPU and CUDA tensors, NCCL takes CUDA tensors; "
                   "a meta tensor has no values)")
    try:
        spec = registry.get(call.algorithm)
    except ValueError as exc:
        return 5, str(exc)
    if call.op not in _OPS:
        return 6, f"op must be 'sum' or 'avg', got {call.op!r}"
    try:
        get_compressor(call.compressor, tensor.dtype)
    except ValueError as exc:
        return 9, str(exc)
    why = _out_problem(call)
    if why:
        return 11, why
    state = call.state
    if state is not None:
        if not isinstance(state, spec.state_class):
            return 7, (f"algorithm {call.algorithm!r} needs a {spec.state_class.__name__}, "
                       f"got {type(state).__name__}")
        why = _density_vs_state(call)
        if why:
            return 7, why
        why = state.check_tensor(tensor.numel())
        if why:
            return 7, why
    return None


def _out_problem(call: _Call) -> str | None:
    """Why ``out=`` cannot take the result, or None."""
    out, t = call.out, call.tensor
    if out is None or (isinstance(out, torch.Tensor) and out.shape == t.shape and out.dtype == t.dtype
                       and out.device == t.device and out.is_contiguous()):
        return None
    return ("out= must be a contiguous tensor with the input's shape, dtype and device "
            f"({tuple(t.shape)}, {t.dtype}, {t.device})")


def _density_vs_state(call: _Call) -> str | None:
    """Why the call's density contradicts its state's, or None."""
    if call.state is None or float(call.density) == call.state.density:
        return None
    return (f"density={call.density} differs from the state's density {call.state.density} "
            "(omit density= to use the state's)")


def _signature(call: _Call, problem: tuple[int, str] | None, nonfinite: int | None = None) -> Signature:
    """This rank's row. ``nonfinite``: 1 NaN/Inf in the tensor, 2 its sum with the residual
    overflows, 0 neither; None: check the tensor here (one read of it)."""
    if problem is not None:
        return Signature(problem=problem[0], algorithm=_crc(str(call.algorithm)),
                         op=_OPS.get(call.op, 0), compressor=_crc(repr(call.compressor)))
    t, state = call.tensor, call.state
    return Signature(
        numel=t.numel(), shape=_crc(str(tuple(t.shape))), dtype=_DTYPES[t.dtype],
        density=_float_bits(call.density), algorithm=_crc(str(call.algorithm)), op=_OPS[call.op],
        nonfinite=int(not _all_finite(t)) if nonfinite is None else nonfinite,
        state_type=_crc(type(state).__name__) if state is not None else 0,
        state_settings=_crc(repr(sorted(state.settings().items()))) if state is not None else 0,
        compressor=_crc(repr(call.compressor)))


def _check_collectively(call: _Call, problem: tuple[int, str] | None, nonfinite: int | None = None) -> None:
    """Raise InputError on every rank if any rank's arguments are bad or differ.

    1. ``problem``: what :func:`_local_problem` found on this rank (None: nothing);
       building the signature (a tensor whose values cannot be read) may add one.
       ``nonfinite``: see :func:`_signature`.
    2. Allgather every rank's :class:`Signature`.
    3. Raise, on every rank and with the same words, for the first of: a rank
       with a problem, NaN/Inf on a rank, a field that differs across ranks,
       state settings that differ (a second small allgather names them).
    """
    comm = call.comm
    try:
        sig = _signature(call, problem, nonfinite)
    except Exception as exc:  # noqa: BLE001 - a check that raises on one rank must not strand the others
        problem = (10, f"checking the tensor raised {type(exc).__name__}: {exc}")
        sig = _signature(call, problem)
    if comm.size == 1:
        table = [sig]
    else:
        ctrl = torch.tensor(sig.row(), dtype=torch.int64, device=comm.control_device)
        table = [Signature.of_row(row) for row in comm.allgather(ctrl).tolist()]
    bad = [r for r, s in enumerate(table) if s.problem]
    if bad:
        mine = f"{problem[1]}; " if problem else ""
        others = ", ".join(f"rank {r}: {_PROBLEMS.get(table[r].problem, 'error')}" for r in bad)
        raise InputError(f"sparsecomm.allreduce: {mine}bad input on {others}")
    nonfinite = [r for r, s in enumerate(table) if s.nonfinite == 1]
    if nonfinite:
        raise NonFiniteError(f"sparsecomm.allreduce: the tensor holds NaN or Inf on rank(s) "
                             f"{nonfinite}; refusing to reduce it (it would poison every rank's result)", nonfinite)
    overflow = [r for r, s in enumerate(table) if s.nonfinite == 2]
    if overflow:
        raise NonFiniteError(f"sparsecomm.allreduce: the tensor plus the error-feedback residual "
                             f"overflows on rank(s) {overflow}; refusing to reduce it (the residual "
                             "is left as it was)", overflow)
    for field, what in Signature.COMPARED:
        values = [getattr(s, field) for s in table]
        if len(set(values)) > 1:
            raise InputError(f"sparsecomm.allreduce: the {what} differs across ranks"
                             f"{_detail(field, values)}; every rank must pass the same kind of "
                             "tensor and options")
    if len({s.state_settings for s in table}) > 1:
        raise InputError(_settings_mismatch(call.state, comm))


def _detail(field: str, values: list[int]) -> str:
    if field == "numel":
        return f" (elements per rank: {values})"
    if field == "dtype":
        names = {v: str(d) for d, v in _DTYPES.items()}
        return f" (per rank: {[names.get(v, '?') for v in values]})"
    if field == "density":
        return f" (per rank: {[struct.unpack('<d', struct.pack('<q', v))[0] for v in values]})"
    if field == "op":
        names = {v: k for k, v in _OPS.items()}
        return f" (per rank: {[names.get(v, '?') for v in values]})"
    return ""


def _settings_mismatch(state: State, comm: Communicator) -> str:
    """The message for state settings that differ (every rank takes part in one allgather)."""
    settings = sorted(state.settings().items())
    crcs = torch.tensor([_crc(repr(v)) for _, v in settings], dtype=torch.int64, device=comm.control_device)
    table = comm.allgather(crcs).tolist()
    differ = [name for j, (name, _) in enumerate(settings) if len({row[j] for row in table}) > 1]
    mine = ", ".join(f"{name}={dict(settings)[name]!r}" for name in differ)
    return (f"sparsecomm.allreduce: the {type(state).__name__} settings differ across ranks: "
            f"{', '.join(differ)} (rank {comm.rank} has {mine}); every rank must build its "
            "state with the same settings and call it the same number of times")


def _check_unchecked(call: _Call) -> None:
    """With ``check=False``: still never guess an op or ignore a density (local, no traffic)."""
    if call.op not in _OPS:
        raise InputError(f"sparsecomm.allreduce: op must be 'sum' or 'avg', got {call.op!r}")
    why = _out_problem(call)
    if why:
        raise InputError(f"sparsecomm.allreduce: {why}")
    why = _density_vs_state(call)
    if why:
        raise InputError(f"sparsecomm.allreduce: {why}")


def _all_finite(t: torch.Tensor) -> bool:
    """Whether ``t`` has no NaN/Inf, in one pass over it.

    A sum is finite only if every term is: for float32/float64 the sum
    (1.7x faster than ``aminmax`` on one CPU thread at 25M) decides, and
    only a non-finite sum (NaN/Inf, or finite values whose sum overflows)
    is confirmed by min and max, which propagate NaN/Inf without overflowing
    (10x ``isfinite``). 16-bit tensors go straight to min/max: a sum would
    have to widen them (10x slower).
    """
    flat = t.detach().reshape(-1)
    if flat.dtype in (torch.float32, torch.float64) and bool(torch.isfinite(flat.sum())):
        return True
    lo, hi = torch.aminmax(flat)
    return bool(torch.isfinite(torch.stack([lo, hi])).all())  # one host read (a GPU sync), not two


# ---- running the algorithm ---------------------------------------------------------
_stateless_calls = itertools.count()


def _execute(call: _Call, check: bool, out_dtype: torch.dtype | None, scale: float,
             private: bool = False, split: bool = False) -> "SparseResult | _Started":
    """Check the call (collectively unless ``check=False``), then run it.

    When the state's next accumulation is the fused pass (``State.fuses_next``),
    the pass runs before the collective check and its output says whether the
    input was finite (``Compensated.finite``), which saves the check's own read
    of the tensor (a third of an ``add``, ~15% of a steady-state Ok-Topk call
    at 25M on CPU); a rejected call then takes the gradient back out
    (``State.rollback``).

    ``split``: stop after the algorithm's first half (see :func:`_start`) and
    return it; :func:`_finish` completes it.
    """
    if not check:
        _check_unchecked(call)
        started = _start(call, out_dtype, scale, private, split=split)
        return started if split else _finish(started)
    early = None
    try:
        problem = _local_problem(call)
    except Exception as exc:  # noqa: BLE001 - reported collectively below
        problem = (10, f"checking the tensor raised {type(exc).__name__}: {exc}")
    nonfinite = None
    if problem is None and call.state is not None and call.state.fuses_next():
        flat = call.tensor.detach().reshape(-1)
        t0 = time.perf_counter()
        try:
            early = (_compensate(call.state, flat, _zero_target(call)), time.perf_counter() - t0)
            call.out_zeroed = early[0].out_zeroed
        except Exception as exc:  # noqa: BLE001 - raised on every rank below, never a hang
            problem = (12, f"accumulating the residual raised {type(exc).__name__}: {exc}")
        else:
            finite = early[0].finite
            # True: settled by the pass. False (a non-finite sum) or None (a buffer too small to
            # tell): one read of the tensor says whether it, or only its sum, is not finite.
            nonfinite = 0 if finite else (1 if not _all_finite(call.tensor) else (2 if finite is False else 0))
    try:
        _check_collectively(call, problem, nonfinite)
    except InputError:
        if early is not None:
            call.state.rollback(call.tensor.detach().reshape(-1), early[0].nonfinite)
        raise
    started = _start(call, out_dtype, scale, private, early, split)
    return started if split else _finish(started)


@functools.lru_cache(maxsize=None)
def _takes_zero_out(cls: type) -> bool:
    """Whether a State class's ``compensate`` takes ``zero_out`` (a user's registered state
    may predate it)."""
    return "zero_out" in inspect.signature(cls.compensate).parameters


def _compensate(state: State, flat: torch.Tensor, zero_out: torch.Tensor | None) -> Compensated:
    return state.compensate(flat, zero_out) if zero_out is not None else state.compensate(flat)


def _zero_target(call: _Call) -> torch.Tensor | None:
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
class _Started:
    """A call whose algorithm ran (``result``), or ran its first half (``half``)."""

    call: _Call
    state: State
    acc: torch.Tensor
    codec: Compressor
    out_dtype: torch.dtype | None
    scale: float
    private: bool
    accumulate: float
    result: SparseResult | None = None
    half: Any = None


def _start(call: _Call, out_dtype: torch.dtype | None, scale: float, private: bool = False,
           early: "tuple[Compensated, float] | None" = None, split: bool = False) -> _Started:
    """Compensate and run the algorithm: whole, or with ``split`` only its first half when it
    registered two (``AlgorithmSpec.split``).

    ``out_dtype``/``scale``: what the caller will turn the result into (the
    overflow check covers that conversion); None for the sparse result itself.
    ``private``: the result goes to the user, so none of its tensors may be
    the state's buffers (which the state updates in place, or reuses next call).
    ``early``: the compensation and its seconds, when :func:`_execute` ran it already.
    """
    spec = registry.get(call.algorithm)
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
    # What the overflow check in _finish will allow: an algorithm that bounds its result
    # below this may settle the residual before the check (State.result_limit).
    dtype = out_dtype or acc.dtype
    state.result_limit = min(torch.finfo(acc.dtype).max,
                             torch.finfo(dtype).max / abs(scale) if scale else math.inf)
    k = topk_count(state.density, flat.numel())
    # With op="avg", 16-bit float values travel pre-divided by P (as PyTorch's
    # fp16 hook does): sums whose average fits float16 must not overflow on the wire.
    codec = get_compressor(call.compressor, flat.dtype,
                           divisor=comm.size if call.op == "avg" else 1).for_call(comm.rank, step)
    started = _Started(call, state, acc, codec, out_dtype, scale, private, accumulate)
    if split and spec.split is not None:
        started.half = spec.split[0](acc, k, comm, state, codec, compensated.preselected)
    else:
        started.result = spec.fn(acc, k, comm, state, codec, compensated.preselected)
    return started


def _finish(started: _Started) -> SparseResult:
    """The second half of the algorithm if one is left, then refuse a non-finite result and
    keep the residual."""
    call, state, acc, codec = started.call, started.state, started.acc, started.codec
    result = started.result
    if result is None:
        result = registry.get(call.algorithm).split[1](started.half, call.comm)
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
    return result


class Pending:
    """An :func:`allreduce` started by :func:`begin_allreduce`; :meth:`finish` completes it.

    Until then the input tensor must stay unchanged, its state takes no other call, and
    ``out``'s contents are unspecified (the first half may have zeroed it).
    """

    def __init__(self, started: _Started, out: torch.Tensor | None) -> None:
        self._started, self._out = started, out
        #: Whether the algorithm ran only its first half (False: it has no halves and ran whole,
        #: residual update included; ``finish`` then only writes the result).
        self.split = started.result is None
        self._result = None if self.split else _finish(started)

    def finish(self) -> torch.Tensor:
        """Run what is left (a collective: every rank in the same order) and return the result."""
        if self._started is None:
            raise RuntimeError("Pending.finish: this call has finished already")
        started, self._started = self._started, None
        result = _finish(started) if self._result is None else self._result
        self._result = None
        tensor = started.call.tensor
        if self._out is not None:
            result.to_dense(tensor.dtype, started.scale, out=self._out.view(-1), zeroed=started.call.out_zeroed)
            return self._out
        return result.to_dense(tensor.dtype, started.scale).reshape(tensor.shape)


@_eager_under_compile
def sparse_allreduce(tensor: torch.Tensor, density: float | None = None, *,
                     algorithm: str | None = None, state: State | None = None,
                     compressor: "str | Compressor | None" = None,
                     group: Any = None, comm: Any = None, check: bool = True) -> SparseResult:
    """Sparse allreduce returning the sparse result (indexes, values, contributed set, stats).

    Same arguments as :func:`allreduce` but ``op``; see there. The values are
    sums over ranks.
    """
    call = _Call.resolve(tensor, density, algorithm, "sum", state, compressor, group, comm)
    return _execute(call, check, None, 1.0, private=True)


@_eager_under_compile
def allreduce(tensor: torch.Tensor, density: float | None = None, *, algorithm: str | None = None,
              op: str = "sum", state: State | None = None, compressor: "str | Compressor | None" = None,
              group: Any = None, comm: Any = None, check: bool = True,
              out: torch.Tensor | None = None) -> torch.Tensor:
    """Sum (or average) ``tensor`` over all ranks, sending only its largest entries.

    1. Check the arguments on every rank and exchange a signature, so bad or
       mismatched input raises InputError on all ranks (``check=False`` skips
       this one small allgather, at your own risk).
    2. With error feedback, add the state's residual to the input.
    3. Run the algorithm: it selects about k = ceil(density * n) entries and
       reduces them across ranks (see each algorithm's docstring).
    4. Keep what this rank did not contribute in the residual; count stats.
    5. Return the result as a new dense tensor, identical on every rank.

    Args:
        tensor: the local gradient, float16/bfloat16/float32/float64, any shape
            (non-contiguous is fine), on a device the communicator supports.
            It is not modified.
        density: fraction of entries selected, in (0, 1] (default: the state's,
            else 0.01).
        algorithm: a name from :func:`algorithms`; default: the state's
            algorithm, else "oktopk".
        op: "sum" or "avg" (the sum divided by the world size).
        state: the algorithm's State for this tensor (threshold reuse, residual,
            statistics). Without it each call is exact and stateless.
        compressor: how values travel: None (the input's dtype), a name from
            ``sparsecomm.compress.COMPRESSORS`` ("fp16", "bf16", "trunc16",
            "q8", "q4", "q2", and "q8s"... with stochastic rounding) or a
            Compressor. Stacks with every algorithm; with error feedback the
            compression error stays in the residual.
        group: a torch.distributed process group.
        comm: an mpi4py communicator or a sparsecomm Communicator.
        check: run the collective input check (default True). Without it the
            caller vouches for the input: with error feedback on CPU a non-finite
            sum of residual and tensor is then left out of the residual, unreported.
        out: write the result here (a contiguous tensor like ``tensor``;
            ``tensor`` itself reduces in place) instead of into a new tensor:
            steady-state calls then allocate nothing of size n. When the call
            raises, its contents are unspecified (a fused pass may have zeroed it).
            Without it a stateful call writes into one of the state's result
            buffers, taken only when nothing refers to it any more
            (:meth:`State.result_buffer`): the plain call costs what this one does.

    Returns:
        A dense tensor with the shape, dtype and device of ``tensor`` (``out`` if given),
        the caller's until it lets go of it (and of every view of it).

    Raises:
        InputError: on every rank, for bad or mismatched arguments, NaN/Inf
            in an input, or a result that overflows the input's dtype.
        CommTimeoutError: a wait ran out of time (a peer is absent).

    Example::

        out = sparsecomm.allreduce(grad, density=0.01)
        st = sparsecomm.OkTopkState(density=0.01, tau=32, tau_prime=64)
        out = sparsecomm.allreduce(grad, state=st, op="avg")
    """
    out = _plain_out(tensor, state, out)
    call = _Call.resolve(tensor, density, algorithm, op, state, compressor, group, comm, out)
    scale = 1.0 / call.comm.size if op == "avg" else 1.0
    result = _execute(call, check, tensor.dtype, scale)
    if out is not None:
        result.to_dense(tensor.dtype, scale, out=out.view(-1), zeroed=call.out_zeroed)
        return out
    return result.to_dense(tensor.dtype, scale).reshape(tensor.shape)


def _plain_out(tensor: Any, state: State | None, out: torch.Tensor | None) -> torch.Tensor | None:
    """``out``, or for a stateful call without it one of the state's result buffers
    (:meth:`State.result_buffer`): the plain call then runs as the ``out=`` call does."""
    if out is not None or not isinstance(state, State) or not isinstance(tensor, torch.Tensor):
        return out  # (a state of the wrong kind is refused by the collective check)
    return state.result_buffer(tensor)


def begin_allreduce(tensor: torch.Tensor, density: float | None = None, *, algorithm: str | None = None,
                    op: str = "sum", state: State | None = None, compressor: "str | Compressor | None" = None,
                    group: Any = None, comm: Any = None, check: bool = True,
                    out: torch.Tensor | None = None) -> Pending:
    """:func:`allreduce` in two halves, for schedules that overlap them with other work (DeAR).

    1. Now: the checks, the error-feedback accumulation and the algorithm's
       first half when it registered two (``AlgorithmSpec.split``: Ok-Topk's
       split-and-reduce and global selection, TopkDSA's and dense's
       reduce-scatter); an algorithm without halves runs whole here.
    2. ``Pending.finish()``, later: the second half (the gather of the reduced
       entries), the residual update and the dense result.

    The result, thresholds and residuals are those of :func:`allreduce` with
    the same arguments, bit for bit (dense without a compressor, which then
    takes a reduce-scatter and an all-gather instead of the backend's
    allreduce, to rounding). Same arguments as :func:`allreduce`; ``out``
    holds the result once ``finish()`` returns, and nothing to read before.
    """
    out = _plain_out(tensor, state, out)
    call = _Call.resolve(tensor, density, algorithm, op, state, compressor, group, comm, out)
    scale = 1.0 / call.comm.size if op == "avg" else 1.0
    return Pending(_execute(call, check, tensor.dtype, scale, split=True), out)
