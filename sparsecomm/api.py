"""The public entry points: ``allreduce``, ``sparse_allreduce`` and ``algorithms``.

Input checking is collective. Every rank first checks its own arguments, then
the ranks exchange one small signature (error code, element count, shape,
dtype, density, algorithm, op, NaN/Inf flag, state type, compressor) with an
allgather of 10 integers.
Any problem on any rank, or any disagreement between ranks, raises
:class:`~sparsecomm.errors.InputError` on *every* rank, so that no rank is left
waiting in a collective its peers will never join. The exchange costs one
small allgather per call.
"""

from __future__ import annotations

import struct
import time
import zlib
from typing import Any

import torch

from . import registry
from .comm import Communicator, resolve
from .compress import Compressor, get_compressor
from .errors import InputError
from .registry import SparseResult
from .state import PhaseStats, State, check_density, topk_count

__all__ = ["allreduce", "sparse_allreduce", "algorithms"]

_DTYPES = {torch.float16: 1, torch.bfloat16: 2, torch.float32: 3, torch.float64: 4}
_OPS = {"sum": 1, "avg": 2}
# Codes of the local problems, so peers can name what went wrong on a rank.
_PROBLEMS = {1: "unsupported dtype", 2: "empty tensor", 3: "invalid density",
             4: "tensor on a device the communicator cannot use", 5: "unknown algorithm",
             6: "invalid op", 7: "state does not fit the call", 8: "not a tensor",
             9: "unknown compressor"}


def algorithms() -> list[str]:
    """Names of the registered allreduce algorithms."""
    return registry.names()


def _crc(text: str) -> int:
    return zlib.crc32(text.encode())


def _local_problem(tensor: Any, density: Any, algorithm: Any, op: Any, state: Any,
                   comm: Communicator, compressor: Any = None) -> tuple[int, str] | None:
    """This rank's first problem with the arguments, as (code, message), or None."""
    if not isinstance(tensor, torch.Tensor):
        return 8, f"expected a torch.Tensor, got {type(tensor).__name__}"
    if tensor.dtype not in _DTYPES:
        return 1, (f"dtype {tensor.dtype} is not supported: sparsecomm reduces floating-point "
                   "gradients (float16, bfloat16, float32, float64)")
    if tensor.numel() == 0:
        return 2, f"the tensor is empty (shape {tuple(tensor.shape)}): nothing to reduce"
    try:
        check_density(density)
    except ValueError as exc:
        return 3, str(exc)
    if not comm.supports_device(tensor.device):
        return 4, (f"the tensor is on {tensor.device}, which the {comm.name} communicator "
                   "cannot use (gloo and MPI take CPU tensors, NCCL takes CUDA tensors)")
    try:
        spec = registry.get(algorithm)
    except ValueError as exc:
        return 5, str(exc)
    if op not in _OPS:
        return 6, f"op must be 'sum' or 'avg', got {op!r}"
    try:
        get_compressor(compressor, tensor.dtype)
    except ValueError as exc:
        return 9, str(exc)
    if state is not None:
        if not isinstance(state, spec.state_class):
            return 7, (f"algorithm {algorithm!r} needs a {spec.state_class.__name__}, "
                       f"got {type(state).__name__}")
        why = state.check_tensor(tensor.numel())
        if why:
            return 7, why
    return None


def _check_collectively(tensor: Any, density: Any, algorithm: Any, op: Any, state: Any,
                        comm: Communicator, compressor: Any = None) -> None:
    """Raise InputError on every rank if any rank's arguments are bad or differ."""
    problem = _local_problem(tensor, density, algorithm, op, state, comm, compressor)
    code = problem[0] if problem else 0
    ok = code == 0
    sig = [
        code,
        tensor.numel() if ok else -1,
        _crc(str(tuple(tensor.shape))) if ok else -1,
        _DTYPES.get(tensor.dtype, 0) if ok else -1,
        struct.unpack("<q", struct.pack("<d", float(density)))[0] if ok else -1,
        _crc(str(algorithm)),
        _OPS.get(op, 0),
        int(not _all_finite(tensor)) if ok else 0,
        _crc(type(state).__name__) if state is not None else 0,
        _crc(repr(compressor)),
    ]
    device = tensor.device if ok else torch.device("cpu")
    if comm.size == 1:
        table = [sig]
    else:
        ctrl = torch.tensor(sig, dtype=torch.int64, device=_control_device(comm, device))
        table = comm.allgather(ctrl).tolist()
    bad = [r for r, row in enumerate(table) if row[0] != 0]
    if bad:
        mine = f"{problem[1]}; " if problem else ""
        others = ", ".join(f"rank {r}: {_PROBLEMS.get(table[r][0], 'error')}" for r in bad)
        raise InputError(f"sparsecomm.allreduce: {mine}bad input on {others}")
    nonfinite = [r for r, row in enumerate(table) if row[7]]
    if nonfinite:
        raise InputError(f"sparsecomm.allreduce: the tensor holds NaN or Inf on rank(s) "
                         f"{nonfinite}; refusing to reduce it (it would poison every rank's result)")
    fields = [(1, "element count"), (2, "shape"), (3, "dtype"), (4, "density"), (5, "algorithm"),
              (6, "op"), (8, "state type"), (9, "compressor")]
    for col, what in fields:
        values = [row[col] for row in table]
        if len(set(values)) > 1:
            detail = ""
            if col == 1:
                detail = f" (elements per rank: {values})"
            elif col == 3:
                names = {v: str(d) for d, v in _DTYPES.items()}
                detail = f" (per rank: {[names.get(v, '?') for v in values]})"
            elif col == 4:
                detail = f" (per rank: {[struct.unpack('<d', struct.pack('<q', v))[0] for v in values]})"
            raise InputError(f"sparsecomm.allreduce: the {what} differs across ranks{detail}; "
                             "every rank must pass the same kind of tensor and options")


def _all_finite(t: torch.Tensor) -> bool:
    """Whether ``t`` has no NaN/Inf: min and max propagate both, in one pass (10x isfinite)."""
    lo, hi = torch.aminmax(t.detach().reshape(-1))
    return bool(torch.isfinite(lo)) and bool(torch.isfinite(hi))


def _algorithm_name(algorithm: str | None, state: State | None) -> str:
    if algorithm is not None:
        return algorithm
    return state.algorithm if state is not None and state.algorithm else "oktopk"


def _control_device(comm: Communicator, device: torch.device) -> torch.device:
    return device if comm.supports_device(device) else torch.device("cpu")


def sparse_allreduce(tensor: torch.Tensor, density: float | None = None, *,
                     algorithm: str | None = None, state: State | None = None,
                     compressor: "str | Compressor | None" = None,
                     group: Any = None, comm: Any = None, check: bool = True) -> SparseResult:
    """Sparse allreduce returning the sparse result (indexes, values, contributed set, stats).

    Same arguments as :func:`allreduce` but ``op``; see there. The values are
    sums over ranks.
    """
    c = resolve(group=group, comm=comm)
    algorithm = _algorithm_name(algorithm, state)
    if density is None:
        density = state.density if state is not None else 0.01
    elif state is not None and isinstance(density, (int, float)) and density != state.density:
        raise InputError(f"density={density} differs from the state's density {state.density}")
    if check:
        _check_collectively(tensor, density, algorithm, "sum", state, c, compressor)
    spec = registry.get(algorithm)
    if state is None:
        state = spec.state_class.exact(density)
    flat = tensor.detach().reshape(-1)
    t0 = time.perf_counter()
    acc = state.compensate(flat)
    accumulate = time.perf_counter() - t0
    k = topk_count(state.density, flat.numel())
    codec = get_compressor(compressor, flat.dtype)
    result = spec.fn(acc, k, c, state, codec)
    # Error-feedback accumulation (fused with selection for Ok-Topk's reuse steps) is a phase too.
    result.stats.phases = {"accumulate": PhaseStats(seconds=accumulate), **result.stats.phases}
    state.update(acc, result)
    state.record(result.stats)
    return result


def allreduce(tensor: torch.Tensor, density: float | None = None, *, algorithm: str | None = None,
              op: str = "sum", state: State | None = None, compressor: "str | Compressor | None" = None,
              group: Any = None, comm: Any = None, check: bool = True) -> torch.Tensor:
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
        check: run the collective input check (default True).

    Returns:
        A dense tensor with the shape, dtype and device of ``tensor``.

    Example::

        out = sparsecomm.allreduce(grad, density=0.01)
        st = sparsecomm.OkTopkState(density=0.01, tau=32, tau_prime=64)
        out = sparsecomm.allreduce(grad, state=st, op="avg")
    """
    if op not in _OPS and not check:  # no collective check asked for: still never guess an op
        raise InputError(f"sparsecomm.allreduce: op must be 'sum' or 'avg', got {op!r}")
    if op not in _OPS and check:
        c = resolve(group=group, comm=comm)
        algorithm = _algorithm_name(algorithm, state)
        _check_collectively(tensor, density if density is not None else 0.01, algorithm, op, state, c,
                            compressor)
    result = sparse_allreduce(tensor, density, algorithm=algorithm, state=state, compressor=compressor,
                              group=group, comm=comm, check=check)
    scale = 1.0 / resolve(group=group, comm=comm).size if op == "avg" else 1.0
    return result.to_dense(tensor.dtype, scale).reshape(tensor.shape)
