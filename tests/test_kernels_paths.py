"""Scatter-add, threshold counts, COO records and quantised codes: every path against its reference.

Scatter-add is compared bitwise with a sequential loop; threshold counts
(``estimate_threshold``'s pass) exactly with ``count_above_torch``; records
and codes byte for byte with the torch path.

Triton runs in interpreter mode on CPU tensors (TRITON_INTERPRET=1 before
triton is first imported); CuPy only where ``cupy.cuda.is_available()``.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first import of triton


import pytest
import torch

from gpu_paths import HAVE_NUMBA, HAVE_TRITON, cupy_ok

from sparsecomm import kernels
from sparsecomm.kernels.coo import scatter_add_sorted_torch
from sparsecomm.kernels.estimate import candidate_thresholds, count_above_torch





def _sequential(out: torch.Tensor, idx: torch.Tensor, val: torch.Tensor) -> torch.Tensor:
    # The semantics, written as the loop it is.
    out = out.clone()
    for i, v in zip(idx.tolist(), val.to(out.dtype)):
        out[i] = out[i] + v
    return out


def _sorted_path(path: str, out, idx, val):
    sidx, order = torch.sort(idx, stable=True)
    sval = val.to(out.dtype)[order]
    if path == "torch" or out.dtype not in (torch.float32, torch.float64):
        scatter_add_sorted_torch(out, sidx, sval)  # coo.scatter_add's rule for 16-bit sums
    elif path == "triton":
        from sparsecomm.kernels.triton_kernels import scatter_add_sorted_triton

        scatter_add_sorted_triton(out, sidx, sval)
    else:
        from sparsecomm.kernels.cupy_kernels import scatter_add_sorted_cupy

        o = out.cuda()
        scatter_add_sorted_cupy(o, sidx.cuda(), sval.cuda())
        out.copy_(o.cpu())
    return out


PATHS = ["torch",
         pytest.param("triton", marks=pytest.mark.skipif(not HAVE_TRITON, reason="triton not installed")),
         pytest.param("cupy", marks=pytest.mark.skipif(not cupy_ok(), reason="cupy.cuda.is_available() is False"))]


def _case(name: str, gen: torch.Generator):
    if name == "gathered":  # TopkA: 5 ranks' sorted top-k concatenated, overlapping
        idx = torch.cat([torch.randperm(3000, generator=gen)[:700].sort().values for _ in range(5)])
        return 3000, idx
    if name == "one_index":  # a single run longer than a Triton block (1024)
        return 10, torch.full((1100,), 7)
    if name == "empty":
        return 10, torch.empty(0, dtype=torch.int64)
    if name == "unique":
        return 5000, torch.randperm(5000, generator=gen)[:3001]
    return 50, torch.randint(0, 50, (4099,), generator=gen)  # many long runs, odd length


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("case", ["gathered", "one_index", "empty", "unique", "dense_dups"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_scatter_add_matches_sequential_bitwise(path, case, dtype):
    # 16-bit outputs go through the torch path on Triton/CuPy (coo.scatter_add): still checked.
    gen = torch.Generator().manual_seed(len(case))
    n, idx = _case(case, gen)
    val = torch.randn(idx.numel(), generator=gen).to(dtype)
    out0 = torch.randn(n, generator=gen).to(dtype)
    expect = _sequential(out0, idx, val)
    got = _sorted_path(path, out0.clone(), idx, val)
    assert torch.equal(got, expect)
    # The dispatcher's CPU path (index_add_) is the same loop.
    assert torch.equal(kernels.scatter_add(out0.clone(), idx, val), expect)


def test_scatter_add_keeps_negative_zero():
    # -0.0 + -0.0 stays -0.0; a kernel padding with +0.0 would flip the sign bit.
    out = torch.tensor([-0.0, 1.0])
    idx = torch.tensor([0, 0, 1])
    val = torch.tensor([-0.0, -0.0, 2.0])
    for path in ["torch"] + (["triton"] if HAVE_TRITON else []):
        got = _sorted_path(path, out.clone(), idx, val)
        assert torch.equal(got, torch.tensor([-0.0, 3.0])) and torch.signbit(got[0])


def test_scatter_add_dispatch_rejects_unavailable_backend():
    with pytest.raises(kernels.BackendUnavailable):
        kernels.scatter_add(torch.zeros(3), torch.tensor([0]), torch.ones(1), backend="cpu")


def _count(path: str, x: torch.Tensor, th) -> list[int]:
    if path == "torch":
        return count_above_torch(x, th).tolist()
    if path == "triton":
        from sparsecomm.kernels.triton_kernels import count_above_triton

        return count_above_triton(x, th).tolist()
    from sparsecomm.kernels.cupy_kernels import count_above_cupy

    return count_above_cupy(x.cuda(), th).tolist()


@pytest.mark.parametrize("path", PATHS[1:])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("n", [1, 4099, 70_001])
def test_count_above_matches_torch(path, dtype, n):
    gen = torch.Generator().manual_seed(n)
    x = (torch.randn(n, generator=gen) * 3).to(dtype)
    k = max(1, n // 100)
    th = candidate_thresholds(x, k)
    assert _count(path, x, th) == _count("torch", x, th)
    # Ties: thresholds equal to entries count them (>=), with 16 thresholds, the most allowed.
    ties = torch.tensor([float(v) for v in range(16)] * 7, dtype=dtype)
    th16 = [float(v) for v in range(15, -1, -1)]
    assert _count(path, ties, th16) == _count("torch", ties, th16) == [7 * (j + 1) for j in range(16)]


@pytest.mark.parametrize("path", PATHS[1:])
def test_estimate_threshold_gpu_paths_agree(path):
    # Same candidates, same exact counts: the estimate equals the torch path's.
    x = torch.randn(50_000, generator=torch.Generator().manual_seed(5))
    if path == "triton":
        from sparsecomm.kernels import estimate

        th = candidate_thresholds(x, 500)
        counts = _count("triton", x, th)
        assert estimate._interpolate(th, counts, 500) == kernels.estimate_threshold(x, 500, backend="torch")
    else:
        y = x.cuda()
        assert kernels.estimate_threshold(y, 500, backend="cupy") == kernels.estimate_threshold(x, 500, backend="torch")


def _pack_path(path: str, idx, val, index_dtype, value_dtype):
    ib = torch.empty(0, dtype=index_dtype).element_size()
    out = torch.empty((idx.numel(), kernels.record_bytes(index_dtype, value_dtype)), dtype=torch.uint8)
    bits = val.to(value_dtype).contiguous()
    bits = bits.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[bits.element_size()])
    if path == "triton":
        from sparsecomm.kernels.triton_kernels import pack_records_triton, unpack_records_triton

        pack_records_triton(idx, bits, out, ib)
        ridx, rbits = torch.empty_like(idx), torch.empty_like(bits)
        unpack_records_triton(out, ridx, rbits, ib)
        return out, ridx, rbits.view(value_dtype)
    from sparsecomm.kernels.cupy_kernels import pack_records_cupy, unpack_records_cupy

    o, ridx, rbits = out.cuda(), torch.empty_like(idx).cuda(), torch.empty_like(bits).cuda()
    pack_records_cupy(idx.cuda(), bits.cuda(), o, ib)
    unpack_records_cupy(o, ridx, rbits, ib)
    return o.cpu(), ridx.cpu(), rbits.cpu().view(value_dtype)


@pytest.mark.parametrize("path", PATHS[1:])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("value_dtype", [torch.float32, torch.float16, torch.bfloat16, torch.uint8,
                                         torch.float64])
@pytest.mark.parametrize("count", [1, 1025])
def test_pack_unpack_match_torch_bytewise(path, index_dtype, value_dtype, count):
    gen = torch.Generator().manual_seed(count)
    big = 2**31 - 1 if index_dtype == torch.int32 else 2**40
    idx = torch.randint(0, big, (count,), generator=gen)
    idx[0] = big - 1  # the largest index the dtype must carry
    val = torch.randn(count, generator=gen) * 100
    if value_dtype == torch.uint8:
        val = torch.randint(0, 256, (count,), generator=gen)
    expect = kernels.pack_records(idx, val, index_dtype, value_dtype, backend="torch")
    got, ridx, rval = _pack_path(path, idx, val, index_dtype, value_dtype)
    assert torch.equal(got, expect)
    eidx, evals = kernels.unpack_records(expect, index_dtype, value_dtype, backend="torch")
    assert torch.equal(ridx, eidx) and torch.equal(ridx, idx)
    assert torch.equal(rval.view(torch.uint8), evals.view(torch.uint8))  # bitwise, NaN-safe


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("value_dtype", [torch.float32, torch.float16, torch.float64, torch.uint8])
@pytest.mark.parametrize("count", [0, 1, 7])
def test_pack_unpack_torch_round_trip(index_dtype, value_dtype, count):
    # count = 1 with 12-byte records once failed: a single row's view keeps the record stride.
    idx = torch.arange(count) * 3
    val = (torch.arange(count) + 1).to(value_dtype)
    rec = kernels.pack_records(idx, val, index_dtype, value_dtype)
    assert rec.shape == (count, kernels.record_bytes(index_dtype, value_dtype))
    ridx, rval = kernels.unpack_records(rec, index_dtype, value_dtype)
    assert torch.equal(ridx, idx) and torch.equal(rval, val)


def _codes(path: str, v, bits, scale):
    from sparsecomm.kernels import payload

    if path in ("torch", "cpu"):
        packed = payload.encode_codes(v, bits, scale, backend=path)
        return packed, payload.decode_codes(packed, bits, v.numel(), scale, torch.float32, backend=path)
    levels = 2 ** (bits - 1) - 1
    f = float(torch.tensor(levels / scale if scale > 0 else 0.0, dtype=torch.float32))
    g = float(torch.tensor(scale / levels, dtype=torch.float32))
    out = torch.empty(-(-v.numel() * bits // 8), dtype=torch.uint8)
    back = torch.empty(v.numel())
    if path == "triton":
        from sparsecomm.kernels.triton_kernels import decode_codes_triton, encode_codes_triton

        encode_codes_triton(v.float().contiguous(), bits, f, out)
        decode_codes_triton(out, bits, g, back)
        return out, back
    from sparsecomm.kernels.cupy_kernels import decode_codes_cupy, encode_codes_cupy

    o, b = out.cuda(), back.cuda()
    encode_codes_cupy(v.float().cuda(), bits, f, o)
    decode_codes_cupy(o, bits, g, b)
    return o.cpu(), b.cpu()


CODE_PATHS = [pytest.param("cpu", marks=pytest.mark.skipif(not HAVE_NUMBA, reason="numba not installed"))] + PATHS[1:]


@pytest.mark.parametrize("path", CODE_PATHS)
@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("n", [1, 7, 4099])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_encode_decode_codes_match_torch_bytewise(path, bits, n, dtype):
    levels = 2 ** (bits - 1) - 1
    gen = torch.Generator().manual_seed(bits * n)
    v = (torch.randn(n, generator=gen) * levels).to(dtype)
    v[: min(n, 6)] = torch.tensor([0.5, 1.5, -2.5, 2.5, -0.5, 1e6])[: min(n, 6)].to(dtype)  # ties, clamp
    for scale in (float(levels), float(v.float().abs().max()), 0.0):
        packed, back = _codes(path, v, bits, scale)
        ref = _codes("torch", v, bits, scale)
        assert torch.equal(packed, ref[0]), scale
        assert torch.equal(back, ref[1]), scale
    # Half to even, as torch.round: 0.5 -> 0, 1.5 -> 2, -2.5 -> -2 at scale = levels.
    if n >= 4 and bits >= 4:
        from sparsecomm.kernels import payload

        q = payload.decode_codes(_codes(path, v, bits, float(levels))[0], bits, 4, float(levels),
                                 torch.float32, backend="torch")
        assert q.tolist() == [0.0, 2.0, -2.0, 2.0]
