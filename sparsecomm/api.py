"""The public entry points: ``allreduce``, ``begin_allreduce``, ``sparse_allreduce`` and ``algorithms``.

Each resolves its arguments into a :class:`~sparsecomm.call.Call` and hands
it to the call pipeline (:mod:`sparsecomm.pipeline`), whose first step is the
collective input check (:mod:`sparsecomm.check`): bad or mismatched input
raises on every rank, never a hang.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, TypeVar

import torch

from . import choice, registry
from .call import Call
from .comm import resolve
from .compress import Compressor
from .memory import StateMaker
from .algorithms.reduce_scatter import SHARD_ALGORITHMS, shard_reduce
from .check import Problem, local_problem
from .pipeline import Pending, check_prepared, execute, prepare
from .result import SparseResult
from .state import State, topk_count

__all__ = ["allreduce", "begin_allreduce", "reduce_scatter", "Pending", "sparse_allreduce", "algorithms", "auto_state"]

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


@_eager_under_compile
def sparse_allreduce(tensor: torch.Tensor, density: float | None = None, *,
                     algorithm: str | None = None, state: State | None = None,
                     compressor: "str | Compressor | None" = None,
                     group: Any = None, comm: Any = None, check: bool = True) -> SparseResult:
    """Sparse allreduce returning the sparse result (indexes, values, contributed set, stats).

    Same arguments as :func:`allreduce` but ``op``; see there. The values are
    sums over ranks.
    """
    call = Call.resolve(tensor, density, algorithm, "sum", state, compressor, group, comm)
    return execute(call, check, None, 1.0, private=True)


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
            "fp8", "q8", "q4", "q2", and "q8s"... with stochastic rounding) or a
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
    call = Call.resolve(tensor, density, algorithm, op, state, compressor, group, comm, out)
    scale = 1.0 / call.comm.size if op == "avg" else 1.0
    result = execute(call, check, tensor.dtype, scale)
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
    call = Call.resolve(tensor, density, algorithm, op, state, compressor, group, comm, out)
    scale = 1.0 / call.comm.size if op == "avg" else 1.0
    return Pending(execute(call, check, tensor.dtype, scale, split=True), out)


def reduce_scatter(tensor: torch.Tensor, density: float | None = None, *, algorithm: str | None = None,
                   op: str = "sum", state: State | None = None, compressor: "str | Compressor | None" = None,
                   group: Any = None, comm: Any = None) -> torch.Tensor:
    """This rank's shard of the sum (or average) of ``tensor`` over all ranks, sending only
    its largest entries.

    Rank r owns the r-th of P equal shards of the flat tensor (entries r n/P to (r+1) n/P - 1),
    as FSDP's reduce-scatter lays them out.

    1. Check the arguments on every rank, as :func:`allreduce` does (also: the algorithm is
       one of ``SHARD_ALGORITHMS``, and n splits into P equal shards).
    2. With error feedback, add the state's residual to the input (full size: n).
    3. Select about k = ceil(density * n) entries (Ok-Topk's reused threshold, or TopkDSA's
       exact top-k) and send each shard's part to its owner, which sums what it receives
       (``sparsecomm.algorithms.reduce_scatter``).
    4. Keep what this rank did not send in the residual; count stats.

    Args:
        tensor: the local gradient, n = P x shard entries, float16/bfloat16/float32/float64.
        density, algorithm ("oktopk", default, or "topkdsa"), op, state, compressor,
            group, comm: as :func:`allreduce`.

    Returns:
        A new dense 1-D tensor of n / P entries, ``tensor``'s dtype and device: this rank's
        shard (each rank's differs). A sum that overflows the dtype is inf on its owner only.

    Raises:
        InputError: on every rank, for bad or mismatched arguments or NaN/Inf in an input.
    """
    call = Call.resolve(tensor, density, algorithm, op, state, compressor, group, comm)
    call.name = "reduce_scatter"
    try:
        problem = local_problem(call)
    except Exception as exc:  # noqa: BLE001 - reported collectively
        problem = (Problem.CHECK_RAISED, f"checking the tensor raised {type(exc).__name__}: {exc}")
    if problem is None and call.algorithm not in SHARD_ALGORITHMS:
        problem = (Problem.ALGORITHM, f"the sparse reduce-scatter runs {SHARD_ALGORITHMS}, not {call.algorithm!r} "
                   "(a reduce-scatter keeps no global phase to run)")
    if problem is None and tensor.numel() % call.comm.size:
        problem = (Problem.SHARDS, f"{tensor.numel()} entries do not split into {call.comm.size} equal shards")
    problem, early, nonfinite = prepare(call, problem)
    check_prepared(call, problem, early, nonfinite)
    st = call.state if call.state is not None else call.spec.state_class.exact(call.density)
    flat = tensor.detach().reshape(-1)
    compensated = early[0] if early is not None else st.compensate(flat)
    acc = compensated.acc
    codec = call.codec.for_call(call.comm.rank, st.iteration)
    result = shard_reduce(acc, topk_count(st.density, flat.numel()), call.comm, st, codec, compensated.preselected)
    st.update(acc, result, keep_errors=not codec.exact_for(acc.dtype))
    st.record(result.stats)
    shard = torch.zeros(result.n, dtype=acc.dtype, device=acc.device).index_add_(0, result.indexes, result.values)
    if op == "avg":
        shard.div_(call.comm.size)
    return shard.to(tensor.dtype)


def auto_state(tensor: torch.Tensor, density: float = 0.01, *, comm: Any = None, group: Any = None,
               compressor: Any = None, network: Any = None, error_feedback: bool = True) -> State:
    """A State of the algorithm :func:`choose` picks for ``tensor``: pass it as ``state=``
    to every call on tensors of this size (the choice stays with the state).

    Example::

        st = sparsecomm.auto_state(grad, density=0.01)
        out = sparsecomm.allreduce(grad, state=st)
    """
    c = resolve(group=group, comm=comm)
    name = choice.choose(tensor.numel(), density, c.size, tensor.dtype, compressor, network, tensor.device.type, c)
    # The training loops' rule: dense keeps a residual only when a compressor loses something.
    return StateMaker(name, density, None, error_feedback, compressor, network, dense_keeps_residual=False).make(name)
