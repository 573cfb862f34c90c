"""The ``triton`` backend: launchers for the Triton kernels (fused select, radix k-th
largest, deterministic scatter-add, threshold counts, COO record pack/unpack,
quantise-and-pack).

Each function implements the operation of its name with that operation's
signature (the ``triton`` entries of the ``KernelOp`` tables). The kernels
themselves are in ``kernels/_triton_jit.py``, imported inside :func:`_jit`
only (``pip install 'sparsecomm[triton]'``), and looked up in ``sys.modules``
at every launch, so that tests can swap in an interpreted import of them.
Launch shapes are chosen for large tensors on A100/H100: see the constants below.
"""

from __future__ import annotations

import importlib
import math

import numpy as np
import torch

from . import dispatch
from .coo import _BITS, record_buffers, record_fields, sort_by_index
from .estimate import COUNT_TILE
from .payload import decode_buffers, decode_factor, encode_buffers
from .radix import key_to_float, radix_prefix, radix_select

__all__ = ["ef_select", "ef_accumulate", "kth_largest", "BOUNDED", "BOUNDED_MIN", "scatter_add", "count_above", "count_on_device", "tally", "pack_blocked",
           "unpack_blocked", "pack_records", "unpack_records",
           "encode_codes", "decode_codes", "CODES_BLOCK", "COUNT_BLOCK", "MAX_THRESHOLDS", "SELECT_BLOCK",
           "HIST_BLOCK", "SCATTER_BLOCK", "ACCUMULATE_BLOCK", "accumulate_warps"]

# Elements per program of the fused select: 32 per thread at 16 warps. Measured on
# an H100 (benchmarks/gpu/tune_select.py, benchmarks/results/2026-11-23-h100/):
# the decoupled look-back walks one tile per step, so fewer, larger tiles win:
# 16384 x 16 warps ran 25M in 0.45 ms and 100M in 1.45 ms, 2048 x 8 (chosen
# before from registers alone) 0.84 and 2.68 ms; 16384 x 4 warps spilled (9 ms).
SELECT_BLOCK = 16384
SELECT_WARPS = 16
HIST_BLOCK = 4096
HIST_WARPS = 8
HIST_PROGRAMS = 1024  # about 8 programs per SM on an H100 (132 SMs): enough to hide latency
SCATTER_BLOCK = 1024  # run starts per program; 4 warps, 8 per thread
SCATTER_WARPS = 4
COUNT_BLOCK = 512     # x 16 thresholds = 32 compares per thread at 8 warps
COUNT_WARPS = 8
MAX_THRESHOLDS = 16
TALLY_BLOCK = 256     # x 16 rungs = 16 compares per thread at 8 warps; buffers hold O(k) entries
TALLY_WARPS = 8
RECORD_BLOCK = 1024   # records per program of pack/unpack
RECORD_WARPS = 4
HEADER_BLOCK = 1024   # header words a blocked message's decoder sums at a time
CODES_BLOCK = 2048    # output bytes (encode) or values (decode) per program
CODES_WARPS = 4
ACCUMULATE_BLOCK = 4096  # entries per program of ef_accumulate without maxima (with them: one block)


def accumulate_warps(block: int) -> int:
    """Warps of an ef_accumulate program: 8 entries per thread, up to 32 warps (16384 entries: 16
    per thread). At 16 per thread for every size, 16384-entry blocks took 176-255 registers."""
    return max(1, min(32, block // 256))



def _jit():
    try:
        return importlib.import_module(f"{__package__}._triton_jit")
    except ImportError as e:
        raise ImportError("the Triton kernels need triton: pip install 'sparsecomm[triton]' "
                          "(triton>=3.0, matching your torch build)") from e


def ef_select(grad: torch.Tensor, residual: torch.Tensor, threshold: float, capacity: int,
              scale: float, zero_selected: bool, out_idx: torch.Tensor,
              out_val: torch.Tensor, zero_out: torch.Tensor | None = None,
              device_counts: bool = False) -> "int | tuple[torch.Tensor, None]":
    """Triton fused error-feedback select; same contract as ``kernels.ef_select``.

    ``zero_out`` is a separate memset (a memory-speed pass on the device; not fused).

    1. One program per SELECT_BLOCK-element tile, tile numbers from an atomic ticket.
    2. A single-pass decoupled look-back scan of tile counts gives each
       tile its output offset, so output order is index order.
    3. The true count is the last tile's inclusive prefix (one sync).
    """
    impl = _jit()
    n = residual.numel()
    if n == 0:
        return (torch.zeros((), dtype=torch.int64, device=residual.device), None) if device_counts else 0
    tiles = -(-n // SELECT_BLOCK)
    # The tiles' status words and the ticket (the low half of one more word): one memset.
    status = torch.zeros(tiles + 1, dtype=torch.int64, device=residual.device)
    ticket = status[tiles:].view(torch.int32)
    if zero_out is not None:
        zero_out.zero_()
    dispatch.launch(impl.ef_select_kernel, (tiles,), grad, residual, out_idx, out_val, status, ticket, n, scale,
                    threshold if threshold > 0 else 0.0, capacity, ZERO=zero_selected, BLOCK=SELECT_BLOCK,
                    FMAX=torch.finfo(residual.dtype).max, num_warps=SELECT_WARPS)
    if not device_counts:
        return dispatch.to_host(status[tiles - 1]) >> 2
    return status[tiles - 1] >> 2, None  # no read: the count stays on the device (kernels.tally counts the rest)


def ef_accumulate(grad: torch.Tensor, residual: torch.Tensor, block: int, maxima: torch.Tensor) -> torch.Tensor:
    """Triton ``kernels.ef_accumulate``: one program per block (``block`` a power of two, or 0 for
    no maxima: ACCUMULATE_BLOCK entries each), one pass; the count left on the device."""
    n = residual.numel()
    if n == 0:
        return torch.zeros((), dtype=torch.int64, device=residual.device)
    size = block or ACCUMULATE_BLOCK
    bad = torch.zeros(1, dtype=torch.int64, device=residual.device)
    dispatch.launch(_jit().ef_accumulate_kernel, (-(-n // size),),
        grad, residual, maxima if block else residual, bad, n, FMAX=torch.finfo(residual.dtype).max,  # (unused)
        BLOCK=size, MAXIMA=bool(block), num_warps=accumulate_warps(size))
    return bad[0]


#: The exact k-th largest below this many entries is the plain radix select (its four passes
#: cost little there); at and above, one pass compacts the candidates above a sampled bound.
BOUNDED_MIN = 1 << 20
BOUND_SAMPLE = 65536  # entries of the strided sample that sets the bound
#: Bounded selects run and those whose bound missed (fewer than k candidates, or more than the
#: buffer held) and took the full radix select after all: the miss rate the benchmarks report.
BOUNDED = {"calls": 0, "misses": 0}


def _histogram(x: torch.Tensor):
    """The radix select's histogram launch over ``x``."""
    impl = _jit()
    grid = (max(1, min(HIST_PROGRAMS, -(-x.numel() // HIST_BLOCK))),)

    def histogram(x, n, prefix32, hist, bits, shift, first):
        dispatch.launch(impl.radix_hist_kernel, grid, x, n, prefix32, hist, KEY_BITS=bits, SHIFT=shift,
                        FIRST=first, BLOCK=HIST_BLOCK, num_warps=HIST_WARPS)

    return histogram


def _choose(hist: torch.Tensor, krem: torch.Tensor, prefix: torch.Tensor, prefix32: torch.Tensor) -> None:
    """The radix select's digit choice in one launch (``radix.radix_prefix``'s ``choose``)."""
    dispatch.launch(_jit().choose_digit_kernel, (1,), hist, krem, prefix, prefix32)


def kth_largest(x: torch.Tensor, k: int, use_abs: bool = False) -> float:
    """Exact k-th largest of |x| (fp16/bf16/fp32): one full pass where a sampled bound holds.

    Ranks magnitudes with or without ``use_abs`` (the keys drop the sign bit).

    1. Below ``BOUNDED_MIN`` entries, or for a k near n: the 8-bit radix select, one
       histogram kernel per digit (4 for fp32, 2 for 16-bit) over the whole tensor,
       the digit chosen on the device (``radix.choose_digit``), one read at the end.
    2. Else a bound from a strided sample of m entries: the sample's r-th largest with
       r = e + 4 sqrt(e) + 4, e = k m / n, so that at least k entries lie at or above it
       unless the sample is off by four standard deviations.
    3. One pass (``compact_above_kernel``) writes every |x| at or above the bound into a
       zeroed buffer of 2 r n / m + 4096 entries, in no particular order, counting them on
       the device.
    4. The radix select of step 1 over that buffer (O(k) per digit): when the candidates
       number between k and the buffer's size, the k largest of x are all among them and
       the zeros past them rank below, so its k-th largest is x's.
    5. One read brings the key and the count back; a bound that missed (too few
       candidates, or too many) costs the full radix select of step 1 (``BOUNDED``).
    """
    flat = x.reshape(-1).contiguous()
    n = flat.numel()
    stride = max(1, n // BOUND_SAMPLE)
    sample = flat[::stride]
    m = sample.numel()
    e = k * m / n
    r = min(m, math.ceil(e + 4 * math.sqrt(e) + 4))
    capacity = 2 * r * stride + 4096
    if n < BOUNDED_MIN or 2 * capacity > n:
        return radix_select(flat, k, _histogram(flat), _choose)
    BOUNDED["calls"] += 1
    bound = torch.topk(sample.abs(), r, sorted=False).values.amin().reshape(1)
    tiles = -(-n // SELECT_BLOCK)
    count = torch.zeros(1, dtype=torch.int64, device=flat.device)
    candidates = torch.zeros(capacity, dtype=flat.dtype, device=flat.device)
    dispatch.launch(_jit().compact_above_kernel, (tiles,), flat, bound, candidates, count, n, capacity,
                    BLOCK=SELECT_BLOCK, num_warps=SELECT_WARPS)
    key = radix_prefix(candidates, k, _histogram(candidates), _choose)
    got, count = dispatch.to_host(torch.stack([key, count[0]]))
    if k <= count <= capacity:
        return key_to_float(got, flat.dtype)
    BOUNDED["misses"] += 1
    return radix_select(flat, k, _histogram(flat), _choose)


def scatter_add(out: torch.Tensor, idx: torch.Tensor, values: torch.Tensor) -> None:
    """Deterministic ``out[idx] += values`` (see ``coo.scatter_add``): a stable sort by index, then one kernel.

    One program per SCATTER_BLOCK sorted positions; each run of equal
    indexes is summed in order by the program holding its first position.
    float32/float64 ``out`` (``scatter_add``'s table sends 16-bit sums to torch).
    """
    m = idx.numel()
    if m == 0:
        return
    sidx, sval = sort_by_index(idx, values)
    grid = (-(-m // SCATTER_BLOCK),)
    dispatch.launch(_jit().scatter_add_sorted_kernel, grid, out, sidx, sval, m, BLOCK=SCATTER_BLOCK,
                    num_warps=SCATTER_WARPS)


def count_above(x: torch.Tensor, thresholds, every: int = 1) -> np.ndarray:
    """#{i : |x_i| >= t} for each of at most 16 ``thresholds`` (fp16/bf16/fp32 ``x``), one pass.

    Compares in float32 (exact for 16-bit inputs); the grid is capped like
    the histogram kernels and each program adds its counts once. Reads every
    entry, whatever ``every`` (a sampled count: :func:`count_on_device`).
    """
    nt = len(thresholds)
    if not 1 <= nt <= MAX_THRESHOLDS:
        raise ValueError(f"triton count_above: 1..{MAX_THRESHOLDS} thresholds, got {nt}")
    th = torch.tensor(np.asarray(thresholds, dtype=np.float32), device=x.device)
    return np.asarray(dispatch.to_host(count_on_device(x, th, 1)[:nt]), dtype=np.int64)


def count_on_device(x: torch.Tensor, thresholds: torch.Tensor, every: int) -> torch.Tensor:
    """The entries at or above each of the (at most 16, float32, on the device) ``thresholds``
    in the tiles of COUNT_TILE entries starting at multiples of ``every`` tiles, as 16 int64
    device counts (nothing read): ``every`` = 8 reads an eighth of ``x``."""
    counts = torch.zeros(MAX_THRESHOLDS, dtype=torch.int64, device=x.device)
    flat = x.reshape(-1).contiguous()  # reshape keeps a strided 1-D view as it is
    n = flat.numel()
    tiles = -(-n // (COUNT_TILE * every))
    dispatch.launch(_jit().count_above_kernel, (max(1, min(HIST_PROGRAMS, tiles)),), flat, n, thresholds,
                    thresholds.numel(), counts, every, tiles, NT=MAX_THRESHOLDS, BLOCK=COUNT_BLOCK, TILE=COUNT_TILE,
                    num_warps=COUNT_WARPS)
    return counts


def tally(values: torch.Tensor, count: torch.Tensor, capacity: int, rungs: torch.Tensor | None,
          nonfinite: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Triton ``kernels.tally``: one kernel over the buffer (TALLY_BLOCK entries per program),
    which counts the non-finite values itself (``nonfinite`` is not needed)."""
    nr = 0 if rungs is None else rungs.numel()
    dev = values.device
    words = torch.zeros(3 + nr, dtype=torch.int64, device=dev)
    bucket = torch.empty(capacity, dtype=torch.int64, device=dev)
    dispatch.launch(_jit().tally_kernel, (max(1, -(-capacity // TALLY_BLOCK)),), values, count, capacity,
                    values if rungs is None else rungs, nr, bucket, words, NT=MAX_THRESHOLDS, BLOCK=TALLY_BLOCK,
                    FMAX=torch.finfo(values.dtype).max, IBITS=8 * values.element_size(), num_warps=TALLY_WARPS)
    return words, None if rungs is None else bucket


def pack_records(rel_idx: torch.Tensor, values: torch.Tensor, index_dtype: torch.dtype,
                 value_dtype: torch.dtype, out: torch.Tensor) -> None:
    """Fill ``out`` (count x record bytes, uint8) with (index, value) records, one kernel."""
    idx, bits = record_fields(rel_idx, values, value_dtype)
    count = idx.numel()
    if count:
        dispatch.launch(_jit().pack_records_kernel, (-(-count // RECORD_BLOCK),),
            idx, bits, out, count, IB=torch.empty(0, dtype=index_dtype).element_size(),
            VB=bits.element_size(), BLOCK=RECORD_BLOCK, num_warps=RECORD_WARPS)


def pack_blocked(rel_idx: torch.Tensor, values: torch.Tensor, value_dtype: torch.dtype,
                 header: torch.Tensor, rows: torch.Tensor, base: int = 0) -> None:
    """Triton ``kernels.message`` blocked packing of ``rel_idx - base``: the header and the records, one launch.

    Indexes are not checked (on a GPU that is a sync): ones that descend or leave the
    header's blocks make a message that decodes to other indexes.
    """
    idx, bits = record_fields(rel_idx, values, value_dtype)
    count, blocks = idx.numel(), header.numel()
    dispatch.launch(_jit().pack_blocked_kernel, (blocks + -(-count // RECORD_BLOCK),), idx, bits, header, rows,
                    count, blocks, base, VB=bits.element_size(), BLOCK=RECORD_BLOCK, num_warps=RECORD_WARPS)


def unpack_blocked(rows: torch.Tensor, header: torch.Tensor, value_dtype: torch.dtype, base: int,
                   idx: torch.Tensor, vals: torch.Tensor, add_into: torch.Tensor | None = None) -> None:
    """Triton ``kernels.message`` blocked decoding (``header``: its bytes), one launch, one program
    a block; the values added into ``add_into`` in the same kernel."""
    bits = vals.view(_BITS[vals.element_size()])
    dispatch.launch(_jit().unpack_blocked_kernel, (header.numel() // 4,), header, rows, rows.shape[0], base, idx,
                    bits, idx if add_into is None else add_into, VB=bits.element_size(), BLOCK=RECORD_BLOCK,
                    HB=HEADER_BLOCK, ADD=add_into is not None, num_warps=RECORD_WARPS)


def unpack_records(records: torch.Tensor, index_dtype: torch.dtype, value_dtype: torch.dtype
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """(int64 indexes, values) of ``records``, one kernel."""
    idx, bits = record_buffers(records, value_dtype)
    count = idx.numel()
    if count:
        dispatch.launch(_jit().unpack_records_kernel, (-(-count // RECORD_BLOCK),),
            records.contiguous(), idx, bits, count, IB=torch.empty(0, dtype=index_dtype).element_size(),
            VB=bits.element_size(), BLOCK=RECORD_BLOCK, num_warps=RECORD_WARPS)
    return idx, bits.view(value_dtype)


def encode_codes(values: torch.Tensor, bits: int, scale: float, keep_error: bool = False) -> torch.Tensor:
    """``kernels.payload.encode_codes`` of flat ``values``, one kernel."""
    values, f, out = encode_buffers(values, bits, scale)
    nbytes = out.numel()
    if nbytes:
        # No FMA contraction: the rounding must see the rounded float32 product, as torch does,
        # and the kept error the rounded decode.
        # keep_error: values are contiguous float32 (encode_codes checks), written in place.
        flat = values if keep_error else values.contiguous()
        dispatch.launch(_jit().encode_codes_kernel, (-(-nbytes // CODES_BLOCK),),
            flat, out, flat.numel(), nbytes, float(f), float(decode_factor(bits, scale)), BITS=bits,
            BLOCK=CODES_BLOCK, KEEP=keep_error, num_warps=CODES_WARPS, enable_fp_fusion=False)
    return out


def decode_codes(packed: torch.Tensor, bits: int, count: int, scale: float, dtype: torch.dtype,
                 out: torch.Tensor | None = None, accumulate: bool = False) -> torch.Tensor:
    """``kernels.payload.decode_codes`` to float32 (``dtype``), one kernel."""
    g, out = decode_buffers(packed, bits, count, scale, out)
    if count:
        dispatch.launch(_jit().decode_codes_kernel, (-(-count // CODES_BLOCK),),
            packed.contiguous(), out, count, float(g), BITS=bits, BLOCK=CODES_BLOCK, ACC=accumulate,
            num_warps=CODES_WARPS, enable_fp_fusion=False)
    return out
