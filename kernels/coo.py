"""COO helpers: split by regions, pack into byte records, scatter-add into dense.

A COO *record* is one (index, value) entry laid out as bytes: the index (int32
when it fits, else int64, relative to a known base) followed by the value in
the payload dtype. Records are fixed-size, so a packed buffer can be cut at
any entry boundary and re-sent (as Ok-Topk's data balancing does) without
re-encoding.
"""

from __future__ import annotations

import sys

import torch

from . import dispatch
from .select import nonzero

__all__ = ["split_by_boundaries", "index_dtype_for", "record_bytes", "pack_records",
           "pack_records_torch", "record_fields", "unpack_records", "unpack_records_torch",
           "record_buffers", "scatter_add", "scatter_add_torch", "scatter_add_sorted_torch",
           "sort_by_index", "isin_sorted", "isin_sorted_torch", "unique_indexes", "union_sorted_runs",
           "union_sorted_runs_torch", "take_and_zero", "take_and_zero_torch", "scatter_dense",
           "scatter_dense_torch", "sum_sorted_runs", "sum_sorted_runs_torch"]


def split_by_boundaries(idx: torch.Tensor, bounds: torch.Tensor, on_device: bool = False) -> list[int] | torch.Tensor:
    """Offsets cutting sorted ``idx`` into regions ``[bounds[j], bounds[j+1])``.

    ``bounds`` has P+1 non-decreasing entries starting at 0 and ending at n.
    Returns P+1 offsets: region j's entries are ``idx[off[j]:off[j+1]]``; with
    ``on_device`` as an int64 tensor on ``idx``'s device (no read: the caller
    reads them with whatever else it needs).
    """
    off = torch.searchsorted(idx, bounds.to(idx.dtype))
    return off if on_device else off.tolist()


def index_dtype_for(span: int) -> torch.dtype:
    """The narrowest index dtype able to hold offsets in ``[0, span)``."""
    return torch.int32 if span <= 2**31 - 1 else torch.int64


def record_bytes(index_dtype: torch.dtype, value_dtype: torch.dtype) -> int:
    """Bytes of one record."""
    return index_dtype.itemsize + value_dtype.itemsize


# Integer dtypes carrying a value's bit pattern, by its width in bytes.
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def pack_records(rel_idx: torch.Tensor, values: torch.Tensor, index_dtype: torch.dtype,
                 value_dtype: torch.dtype, backend: str | None = None) -> torch.Tensor:
    """A (count, record_bytes) uint8 tensor of (index, value) records.

    Paths (``kernels.dispatch``): ``torch`` writes the two columns with
    strided copies; ``triton``/``cupy`` (CUDA) write each record's bytes in
    one kernel from the int64 index and the value's bit pattern; ``cpu``
    copies the two fields through a packed numpy record view.
    """
    count = rel_idx.numel()
    if values.numel() != count:
        raise ValueError(f"pack_records: {count} indexes but {values.numel()} values")
    out = torch.empty((count, record_bytes(index_dtype, value_dtype)), dtype=torch.uint8,
                      device=values.device)
    _PACK_RECORDS(rel_idx, values, index_dtype, value_dtype, out, backend=backend)
    return out


def pack_records_torch(rel_idx: torch.Tensor, values: torch.Tensor, index_dtype: torch.dtype,
                       value_dtype: torch.dtype, out: torch.Tensor) -> None:
    """Reference of :func:`pack_records`: fills ``out`` column by column with strided copies."""
    count = rel_idx.numel()
    ib = torch.empty(0, dtype=index_dtype).element_size()
    out[:, :ib] = rel_idx.to(index_dtype).reshape(count, 1).view(torch.uint8)
    out[:, ib:] = values.to(value_dtype).reshape(count, 1).view(torch.uint8)


def record_fields(rel_idx: torch.Tensor, values: torch.Tensor, value_dtype: torch.dtype
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """What the record kernels read: contiguous int64 indexes and the values' bit patterns."""
    vals = values.reshape(-1).to(value_dtype).contiguous()
    return rel_idx.reshape(-1).to(torch.int64).contiguous(), vals.view(_BITS[vals.element_size()])


def unpack_records(records: torch.Tensor, index_dtype: torch.dtype, value_dtype: torch.dtype,
                   backend: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`pack_records`: (int64 relative indexes, values)."""
    if records.shape[0] == 0:  # an empty slice keeps its record stride, which view() rejects
        return (torch.empty(0, dtype=torch.int64, device=records.device),
                torch.empty(0, dtype=value_dtype, device=records.device))
    return _UNPACK_RECORDS(records, index_dtype, value_dtype, backend=backend)


def unpack_records_torch(records: torch.Tensor, index_dtype: torch.dtype, value_dtype: torch.dtype
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference of :func:`unpack_records` (non-empty ``records``): the two columns, copied out."""
    ib = torch.empty(0, dtype=index_dtype).element_size()
    return _column(records, 0, ib, index_dtype).to(torch.int64), _column(records, ib, None, value_dtype)


def record_buffers(records: torch.Tensor, value_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """What the unpack kernels write: int64 indexes and an integer tensor for the values' bit patterns."""
    count = records.shape[0]
    vb = torch.empty(0, dtype=value_dtype).element_size()
    return (torch.empty(count, dtype=torch.int64, device=records.device),
            torch.empty(count, dtype=_BITS[vb], device=records.device))


# An empty pack is the torch path's (the kernels need a record to launch). The cpu path's
# records are little-endian numpy records, the byte order of every host torch runs on.
_LITTLE = sys.byteorder == "little"
_PACK_RECORDS = dispatch.KernelOp(
    "pack_records", pack_records_torch, on=1, triton="triton_backend:pack_records",
    cupy="cupy_backend:pack_records", cpu="numba_wire_backend:pack_records",
    accepts={("triton", "cupy"): lambda rel_idx, *_: rel_idx.numel() > 0,
             "cpu": lambda rel_idx, *_: _LITTLE and rel_idx.numel() > 0})
_UNPACK_RECORDS = dispatch.KernelOp(
    "unpack_records", unpack_records_torch, triton="triton_backend:unpack_records",
    cupy="cupy_backend:unpack_records", cpu="numba_wire_backend:unpack_records",
    accepts={"cpu": lambda *_: _LITTLE})


def _column(records: torch.Tensor, lo: int, hi: int | None, dtype: torch.dtype) -> torch.Tensor:
    # A fresh copy: .contiguous() is a no-op on a single record, whose view
    # keeps the record stride (12 for int64 + fp32) that view(int64) rejects.
    col = records[:, lo:hi]
    out = torch.empty(col.shape, dtype=torch.uint8, device=records.device)
    return out.copy_(col).view(dtype).reshape(-1)


def scatter_add(out: torch.Tensor, idx: torch.Tensor, values: torch.Tensor,
                backend: str | None = None, *, unique: bool = False, subtract: bool = False) -> torch.Tensor:
    """``out[idx] += values`` (``-= values`` with ``subtract``), duplicates summed in the order they
    appear; returns ``out``.

    Deterministic on every path, and bitwise equal across paths: each
    ``out[i]`` becomes ``((out[i] + v_first) + v_second) + ...`` over the
    duplicates of i in input order, which is what a sequential loop (and
    torch's CPU ``index_add_``) computes. That is what keeps ranks bitwise
    identical when they sum the same gathered records (TopkA): CUDA's
    ``index_add_`` adds duplicates with atomics, in a different order on
    every run.

    1. CPU: ``index_add_``, a sequential loop (``torch`` path), or the same
       loop in numba (``cpu``, the same bits).
    2. Elsewhere: a stable sort by index (duplicates keep their order), then
       one pass where the first entry of each run of equal indexes sums its
       run in order and writes once: no atomics (``triton``, ``cupy``, or
       :func:`scatter_add_sorted_torch`); 16-bit sums always take the
       torch path (the kernels sum in fp32/fp64, 16-bit sums round at every step).

    Args:
        out: dense float tensor, updated in place.
        idx: int64 indexes into ``out`` (any order, duplicates allowed).
        values: same length as ``idx``; cast to ``out.dtype`` first.
        backend: ``torch``/``triton``/``cupy``/``cpu``/``auto`` (``kernels.dispatch``).
        unique: the caller knows ``idx`` has no duplicates: off the CPU there
            is then no order to keep, and ``index_add_`` runs without the sort.
        subtract: add ``-values`` (r + (-v) is bitwise r - v; off the CPU with ``unique``
            in the same operation: ``alpha=-1``).
    """
    values = values.to(out.dtype)
    if unique and not dispatch.in_host_memory(out) and backend is None:
        out.index_add_(0, idx, values, alpha=-1 if subtract else 1)
        return out
    _SCATTER_ADD(out, idx, values.neg() if subtract else values, backend=backend)
    return out


def scatter_add_torch(out: torch.Tensor, idx: torch.Tensor, values: torch.Tensor) -> None:
    """Reference of :func:`scatter_add`, for ``values`` already in ``out.dtype``.

    ``index_add_`` on CPU, sorted runs (:func:`scatter_add_sorted_torch`) elsewhere.
    """
    if idx.numel() == 0:
        return
    if out.device.type == "cpu":
        out.index_add_(0, idx, values)
        return
    scatter_add_sorted_torch(out, *sort_by_index(idx, values))


def sort_by_index(idx: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int64 indexes, values) stably sorted by index: duplicates keep their input order."""
    sidx, order = torch.sort(idx.to(torch.int64), stable=True)  # the kernels read int64
    return sidx, values[order]


def scatter_add_sorted_torch(out: torch.Tensor, sidx: torch.Tensor, sval: torch.Tensor) -> torch.Tensor:
    """Reference for sorted input: every run of equal indexes summed in order, written once.

    Loops once per position in the longest run (at most P for gathered
    records), each step a few vector ops over the runs.
    """
    m = sidx.numel()
    if m == 0:
        return out
    start = torch.ones(m, dtype=torch.bool, device=sidx.device)
    start[1:] = sidx[1:] != sidx[:-1]
    pos = torch.nonzero(start).flatten()
    first = sidx[pos]
    acc = out[first] + sval[pos]
    run = torch.diff(pos, append=torch.tensor([m], device=pos.device))
    for d in range(1, int(run.max())):
        more = run > d
        acc[more] = acc[more] + sval[pos[more] + d]
    out[first] = acc
    return out


def _wide_sum(out: torch.Tensor, idx: torch.Tensor, values: torch.Tensor) -> bool:
    return out.dtype in (torch.float32, torch.float64)


# The GPU kernels sum in fp32/fp64 (numba has no 16-bit arithmetic): 16-bit outputs go to torch.
def _flat_wide_sum(out: torch.Tensor, idx: torch.Tensor, values: torch.Tensor) -> bool:
    # The numba loop trusts shapes: anything else goes to index_add_, which checks them.
    return _wide_sum(out, idx, values) and out.dim() == 1 and idx.dim() == 1 and idx.numel() == values.numel()


_SCATTER_ADD = dispatch.KernelOp(
    "scatter_add", scatter_add_torch, triton="triton_backend:scatter_add",
    cupy="cupy_backend:scatter_add", cpu="numba_backend:scatter_add",
    accepts={("triton", "cupy"): _wide_sum, "cpu": _flat_wide_sum})


def isin_sorted(values: torch.Tensor, sorted_set: torch.Tensor,
                mark: torch.Tensor | None = None, backend: str | None = None) -> torch.Tensor:
    """``torch.isin(values, sorted_set)`` for an ascending ``sorted_set`` of indexes.

    ``torch.isin`` sorts: 1.2 s for Ok-Topk's contributed set at n = 25M
    (250k values in 250k). Paths (``kernels.dispatch``):

    * ``cpu``: one merge walk over both lists while ``values`` ascend (a
      binary search where they step back), O(m + k): ~1 ms.
    * ``torch``: with ``mark`` (an all-zero bool tensor indexable by every
      value, e.g. a state's scratch buffer, left all zero) by marking, O(m + k)
      random accesses (~4 ms on CPU); without, a binary search per value,
      O(m log k) (~14 ms).
    """
    return _ISIN_SORTED(values, sorted_set, mark, backend=backend)


def isin_sorted_torch(values: torch.Tensor, sorted_set: torch.Tensor,
                      mark: torch.Tensor | None = None) -> torch.Tensor:
    """Reference of :func:`isin_sorted`."""
    if mark is not None:
        mark[sorted_set] = True
        hit = mark[values]
        mark[sorted_set] = False
        return hit
    if sorted_set.numel() == 0:
        return torch.zeros(values.shape, dtype=torch.bool, device=values.device)
    pos = torch.searchsorted(sorted_set, values).clamp_(max=sorted_set.numel() - 1)
    return sorted_set[pos] == values


def union_sorted_runs(cat: torch.Tensor, runs: list[int], backend: str | None = None) -> torch.Tensor:
    """The ascending union (int64, no duplicates) of ``cat``'s runs ``cat[runs[j]:runs[j+1]]``.

    Each run ascends without duplicates (e.g. the index lists the ranks sent
    for one region). ``runs``: R+1 offsets from 0 to ``cat.numel()``.

    * ``cpu``: pairwise merges, log2(R) linear passes (2 ms for 375k indexes in 2 runs).
    * ``torch``: ``torch.unique(cat)``, a sort (25 ms on one CPU thread).
    """
    return _UNION_SORTED_RUNS(cat, runs, backend=backend)


def union_sorted_runs_torch(cat: torch.Tensor, runs: list[int]) -> torch.Tensor:
    """Reference of :func:`union_sorted_runs`."""
    return torch.unique(cat.to(torch.int64))


def sum_sorted_runs(idx: torch.Tensor, values: torch.Tensor, runs: list[int],
                    backend: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Union of the ascending, duplicate-free runs ``idx[runs[j]:runs[j+1]]``, and each index's
    values summed in run order: ``((0 + v_first_run) + v_next_run) + ...``.

    What a dense accumulator gives when the runs are added into zeros one after
    another (``index_add_``), bit for bit, without touching O(n) memory:

    * ``cpu``: each run merged into the running union (a left fold of linear
      merges, O(runs x union)): for the few runs of a small world, against two
      scatters into a region-sized buffer, a union and a read-and-clear.
    * ``torch``: ``unique`` of the concatenation and ``index_add_`` in order.
    """
    return _SUM_SORTED_RUNS(idx, values, runs, backend=backend)


def sum_sorted_runs_torch(idx: torch.Tensor, values: torch.Tensor, runs: list[int]
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference of :func:`sum_sorted_runs`."""
    uniq, inverse = torch.unique(idx.to(torch.int64), return_inverse=True)
    sums = torch.zeros(uniq.numel(), dtype=values.dtype, device=values.device)
    return uniq, sums.index_add_(0, inverse, values)


def take_and_zero(x: torch.Tensor, idx: torch.Tensor, backend: str | None = None) -> torch.Tensor:
    """``x[idx]``, then ``x[idx] = 0`` (``idx`` without duplicates): an accumulator read out and
    left all zero for its next use, in one pass on the ``cpu`` path."""
    return _TAKE_AND_ZERO(x, idx, backend=backend)


def take_and_zero_torch(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Reference of :func:`take_and_zero`."""
    vals = x[idx]
    x[idx] = 0
    return vals


def scatter_dense(out: torch.Tensor, idx: torch.Tensor, values: torch.Tensor,
                  backend: str | None = None, *, zeroed: bool = False) -> torch.Tensor:
    """``out`` all zero except ``out[idx] = values`` (``idx`` without duplicates); returns ``out``.

    ``values`` must be in ``out.dtype``. The ``cpu`` path writes each span of
    ``out`` once, zeros and values together, when ``idx`` ascends (else it
    takes the reference): the zero fill and a scatter over n were two passes.
    ``zeroed``: the caller knows ``out`` is all zero already (e.g.
    ``ef_select``'s ``zero_out``), so only the entries are written: O(k).
    """
    return _SCATTER_DENSE(out, idx, values, bool(zeroed), backend=backend)


def scatter_dense_torch(out: torch.Tensor, idx: torch.Tensor, values: torch.Tensor,
                        zeroed: bool = False) -> torch.Tensor:
    """Reference of :func:`scatter_dense`."""
    if not zeroed:
        out.zero_()
    out[idx] = values
    return out


def _numba_floats(x: torch.Tensor, *_: object) -> bool:
    return x.dtype in (torch.float32, torch.float64)


_ISIN_SORTED = dispatch.KernelOp("isin_sorted", isin_sorted_torch, cpu="numba_backend:isin_sorted")
_UNION_SORTED_RUNS = dispatch.KernelOp("union_sorted_runs", union_sorted_runs_torch,
                                       cpu="numba_backend:union_sorted_runs")
_SUM_SORTED_RUNS = dispatch.KernelOp("sum_sorted_runs", sum_sorted_runs_torch, cpu="numba_backend:sum_sorted_runs",
                                     accepts={"cpu": lambda idx, values, runs: _numba_floats(values)})
_TAKE_AND_ZERO = dispatch.KernelOp("take_and_zero", take_and_zero_torch, cpu="numba_backend:take_and_zero",
                                   accepts={"cpu": _numba_floats})
_SCATTER_DENSE = dispatch.KernelOp("scatter_dense", scatter_dense_torch, cpu="numba_backend:scatter_dense",
                                   accepts={"cpu": lambda out, idx, values, zeroed: _numba_floats(out)
                                            and values.dtype == out.dtype})


def unique_indexes(idx: torch.Tensor, n: int) -> torch.Tensor:
    """``torch.unique(idx)`` (ascending) for indexes in ``[0, n)``.

    When ``idx`` is long next to ``n`` (TopkA at large P gathers P*k records)
    marking a dense mask is O(n + m) and 9x faster than unique's sort
    (1.3M indexes into 1M: 20 ms against 174 ms); for short lists the sort wins.
    """
    m = idx.numel()
    if m * max(1, m.bit_length()) < 4 * n:
        return torch.unique(idx)
    mask = torch.zeros(n, dtype=torch.bool, device=idx.device)
    mask[idx] = True
    return nonzero(mask)
