"""The ``cupy`` backend: CuPy RawKernel launchers (CUDA C) for the fused error-feedback
select, radix k-th largest, deterministic scatter-add, threshold counts, COO
record pack/unpack, quantise-and-pack.

Each function implements the operation of its name with that operation's
signature (the ``cupy`` entries of the ``KernelOp`` tables). The CUDA source
is ``kernels/_cupy_jit.py``'s :data:`CUDA_SOURCE`, compiled by CuPy on first
use; cupy is imported inside :func:`_module` only (``pip install
'sparsecomm[cupy]'``). Tensors stay torch tensors: kernels get their raw
device pointers and run on torch's current stream, so no copies and no
cross-stream races.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from . import dispatch
from ._cupy_jit import CUDA_SOURCE, GRAD_TYPES, RES_TYPES, SELECT_ITEMS, SELECT_THREADS
from .coo import record_buffers, record_fields, sort_by_index
from .payload import decode_buffers, encode_buffers
from .radix import radix_select

__all__ = ["ef_select", "kth_largest", "scatter_add", "count_above", "pack_records", "unpack_records",
           "encode_codes", "decode_codes", "SCATTER_THREADS", "HIST_THREADS", "HIST_BLOCKS"]

HIST_THREADS = 512
HIST_BLOCKS = 1056   # 8 blocks of 512 threads per SM on an H100 (132 SMs)
SCATTER_THREADS = 256


@functools.lru_cache(maxsize=None)
def _module():
    try:
        import cupy  # optional GPU library
    except ImportError as e:
        raise ImportError("the CuPy kernels need cupy: pip install 'sparsecomm[cupy]' "
                          "(cupy-cuda12x for CUDA 12)") from e
    return cupy, cupy.RawModule(code=CUDA_SOURCE, options=("--std=c++17",))


def _launch(name: str, grid: int, block: int, args: tuple, device: torch.device) -> None:
    cupy, mod = _module()
    with cupy.cuda.Device(device.index or 0):
        # Run on torch's stream so the kernel is ordered with the torch ops around it.
        stream = _stream(cupy, torch.cuda.current_stream(device))
        mod.get_function(name)((grid,), (block,), args, stream=stream)


def _stream(cupy, stream: torch.cuda.Stream):
    """torch's stream as a CuPy stream (``Stream.from_external`` where CuPy has it: CuPy 14
    deprecates ``ExternalStream``)."""
    from_external = getattr(cupy.cuda.Stream, "from_external", None)
    if from_external is not None and hasattr(stream, "__cuda_stream__"):
        return from_external(stream)
    return cupy.cuda.ExternalStream(stream.cuda_stream)


def _ptr(t: torch.Tensor) -> np.uint64:
    # A 64-bit integer passed by value is ABI-identical to a pointer argument.
    return np.uint64(t.data_ptr())


def ef_select(grad: torch.Tensor, residual: torch.Tensor, threshold: float, capacity: int,
              scale: float, zero_selected: bool, out_idx: torch.Tensor,
              out_val: torch.Tensor, zero_out: torch.Tensor | None = None,
              device_counts: bool = False) -> "int | tuple[torch.Tensor, None]":
    """CuPy fused error-feedback select; same contract as ``kernels.ef_select``.

    ``zero_out`` is a separate memset (a memory-speed pass on the device; not fused).

    1. One 256-thread block per 4096-element tile; each thread holds 16
       consecutive elements in registers.
    2. Block scan of per-thread counts (warp shuffles), then a decoupled
       look-back across tiles gives the tile's output offset: outputs come
       out in index order, in one pass over memory.
    """
    n = residual.numel()
    if n == 0:
        return (torch.zeros((), dtype=torch.int64, device=residual.device), None) if device_counts else 0
    tile = SELECT_THREADS * SELECT_ITEMS
    tiles = -(-n // tile)
    dev = residual.device
    # The tiles' status words and the ticket (the low half of one more word): one memset.
    status = torch.zeros(tiles + 1, dtype=torch.int64, device=dev)
    ticket = status[tiles:].view(torch.int32)
    rdt = np.float32 if residual.dtype == torch.float32 else np.float64
    name = f"ef_select_{GRAD_TYPES[grad.dtype][1]}_{RES_TYPES[residual.dtype][1]}"
    args = (_ptr(grad), _ptr(residual), _ptr(out_idx), _ptr(out_val), _ptr(status), _ptr(ticket),
            np.int64(n), rdt(scale), rdt(threshold if threshold > 0 else 0.0), np.int64(capacity),
            np.int32(zero_selected))
    if zero_out is not None:
        zero_out.zero_()
    _launch(name, tiles, SELECT_THREADS, args, dev)
    if not device_counts:
        return dispatch.to_host(status[tiles - 1]) >> 2
    return status[tiles - 1] >> 2, None  # no read: the count stays on the device (kernels.tally counts the rest)


def kth_largest(x: torch.Tensor, k: int, use_abs: bool = False) -> float:
    """Exact k-th largest of |x| (fp16/bf16/fp32): 8-bit radix select in CUDA C.

    Ranks magnitudes with or without ``use_abs`` (the keys drop the sign bit).

    1. Per digit, a grid-stride histogram kernel (shared-memory bins) over
       keys matching the prefix so far.
    2. ``radix.choose_digit`` on the device; one sync at the end.
    """
    blocks = max(1, min(HIST_BLOCKS, -(-x.numel() // HIST_THREADS)))

    def histogram(x, n, prefix32, hist, bits, shift, first):
        _launch("radix_hist_u16" if bits == 16 else "radix_hist_u32", blocks, HIST_THREADS,
                (_ptr(x), np.int64(n), _ptr(prefix32), _ptr(hist), np.int32(shift), np.int32(first)),
                x.device)

    return radix_select(x, k, histogram)


def scatter_add(out: torch.Tensor, idx: torch.Tensor, values: torch.Tensor) -> None:
    """Deterministic ``out[idx] += values`` (see ``coo.scatter_add``): a stable sort by index, then one kernel.

    One thread per sorted position; the first position of each run of equal
    indexes sums the run in order and writes once. float32/float64 ``out``
    (``scatter_add``'s table sends 16-bit sums to torch).
    """
    m = idx.numel()
    if m == 0:
        return
    sidx, sval = sort_by_index(idx, values)
    name = "scatter_add_sorted_f32" if out.dtype == torch.float32 else "scatter_add_sorted_f64"
    _launch(name, -(-m // SCATTER_THREADS), SCATTER_THREADS,
            (_ptr(out), _ptr(sidx.contiguous()), _ptr(sval.contiguous()), np.int64(m)), out.device)


def count_above(x: torch.Tensor, thresholds, every: int = 1) -> np.ndarray:
    """#{i : |x_i| >= t} for each of at most 16 descending ``thresholds`` (fp16/bf16/fp32 ``x``).

    Grid-stride loop; per-thread counts in registers, only touched by the
    rare entries above the smallest threshold; one shared and one global
    atomic per threshold per block. Reads every entry, whatever ``every``.
    """
    nt = len(thresholds)
    if not 1 <= nt <= 16:
        raise ValueError(f"cupy count_above: 1..16 thresholds, got {nt}")
    th = torch.tensor(np.asarray(thresholds, dtype=np.float32), device=x.device)
    counts = torch.zeros(nt, dtype=torch.int64, device=x.device)
    flat = x.reshape(-1).contiguous()
    n = flat.numel()
    name = {torch.float32: "count_above_f32", torch.float16: "count_above_f16",
            torch.bfloat16: "count_above_bf16"}[flat.dtype]
    blocks = max(1, min(HIST_BLOCKS, -(-n // HIST_THREADS)))
    _launch(name, blocks, HIST_THREADS, (_ptr(flat), np.int64(n), _ptr(th), np.int32(nt), _ptr(counts)),
            x.device)
    return np.asarray(dispatch.to_host(counts), dtype=np.int64)


def pack_records(rel_idx: torch.Tensor, values: torch.Tensor, index_dtype: torch.dtype,
                 value_dtype: torch.dtype, out: torch.Tensor) -> None:
    """Fill ``out`` (count x record bytes, uint8) with (index, value) records, one kernel."""
    idx, bits = record_fields(rel_idx, values, value_dtype)
    count = idx.numel()
    if count:
        ib = torch.empty(0, dtype=index_dtype).element_size()
        _launch(f"pack_i{ib}_v{bits.element_size()}", -(-count // SCATTER_THREADS), SCATTER_THREADS,
                (_ptr(idx), _ptr(bits), _ptr(out), np.int64(count)), idx.device)


def unpack_records(records: torch.Tensor, index_dtype: torch.dtype, value_dtype: torch.dtype
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """(int64 indexes, values) of ``records``, one kernel."""
    idx, bits = record_buffers(records, value_dtype)
    count = idx.numel()
    if count:
        ib = torch.empty(0, dtype=index_dtype).element_size()
        _launch(f"unpack_i{ib}_v{bits.element_size()}", -(-count // SCATTER_THREADS), SCATTER_THREADS,
                (_ptr(records.contiguous()), _ptr(idx), _ptr(bits), np.int64(count)), idx.device)
    return idx, bits.view(value_dtype)


def encode_codes(values: torch.Tensor, bits: int, scale: float, keep_error: bool = False) -> torch.Tensor:
    """``kernels.payload.encode_codes`` of flat ``values``, one thread per output byte.

    ``keep_error`` is a second kernel here (the decode) and a subtraction, where
    the numba and Triton paths keep the error in the encoding pass itself.
    """
    values, f, out = encode_buffers(values, bits, scale)
    flat = values.contiguous()
    nbytes = out.numel()
    if nbytes:
        _launch(f"encode_codes_b{bits}", -(-nbytes // SCATTER_THREADS), SCATTER_THREADS,
                (_ptr(flat), _ptr(out), np.int64(flat.numel()), np.int64(nbytes), np.float32(float(f))),
                flat.device)
        if keep_error:
            values.sub_(decode_codes(out, bits, values.numel(), scale, torch.float32))
    return out


def decode_codes(packed: torch.Tensor, bits: int, count: int, scale: float, dtype: torch.dtype,
                 out: torch.Tensor | None = None, accumulate: bool = False) -> torch.Tensor:
    """``kernels.payload.decode_codes`` to float32 (``dtype``), one thread per value
    (``accumulate``: into a temporary, then added)."""
    if accumulate:
        return out.add_(decode_codes(packed, bits, count, scale, dtype))
    g, out = decode_buffers(packed, bits, count, scale, out)
    packed = packed.contiguous()
    if count:
        _launch(f"decode_codes_b{bits}", -(-count // SCATTER_THREADS), SCATTER_THREADS,
                (_ptr(packed), _ptr(out), np.int64(count), np.float32(float(g))), packed.device)
    return out
