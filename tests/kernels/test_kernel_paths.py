"""Scatter-add, threshold counts, COO records and quantised codes: every backend against its reference.

Scatter-add is compared bitwise with a sequential loop; threshold counts
(``estimate_threshold``'s pass) exactly with ``count_above_torch``; records
and codes byte for byte with the torch path. Each test runs every backend in
the operation's ``KernelOp`` table (``gpu_paths.backend_params``): Triton in
its interpreter on CPU tensors, CuPy only where ``cupy.cuda.is_available()``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gpu_paths import backend_params, runner

from sparsecomm import kernels
from sparsecomm.kernels import payload
from sparsecomm.kernels.estimate import _interpolate, candidate_thresholds, count_above_torch


def _sequential(out: torch.Tensor, idx: torch.Tensor, val: torch.Tensor) -> torch.Tensor:
    # The semantics, written as the loop it is.
    out = out.clone()
    for i, v in zip(idx.tolist(), val.to(out.dtype)):
        out[i] = out[i] + v
    return out


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


@pytest.mark.parametrize("backend", backend_params("scatter_add"))
@pytest.mark.parametrize("case", ["gathered", "one_index", "empty", "unique", "dense_dups"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_scatter_add_matches_sequential_bitwise(backend, monkeypatch, case, dtype):
    run = runner(backend, monkeypatch)
    # 16-bit outputs go through the torch path on Triton/CuPy (the table's rule): still checked.
    gen = torch.Generator().manual_seed(len(case))
    n, idx = _case(case, gen)
    val = torch.randn(idx.numel(), generator=gen).to(dtype)
    out0 = torch.randn(n, generator=gen).to(dtype)
    expect = _sequential(out0, idx, val)
    got = out0.clone()
    run("scatter_add", got, idx, val)
    assert torch.equal(got, expect)
    # The public function casts the values and dispatches (index_add_ on CPU: the same loop).
    assert torch.equal(kernels.scatter_add(out0.clone(), idx, val.double()), expect)


def test_scatter_add_sorted_reference_matches_sequential():
    # The reference the GPU paths mirror (torch on non-CPU devices), run here on CPU tensors.
    from sparsecomm.kernels.coo import scatter_add_sorted_torch, sort_by_index

    gen = torch.Generator().manual_seed(0)
    n, idx = _case("gathered", gen)
    val = torch.randn(idx.numel(), generator=gen)
    out0 = torch.randn(n, generator=gen)
    got = scatter_add_sorted_torch(out0.clone(), *sort_by_index(idx, val))
    assert torch.equal(got, _sequential(out0, idx, val))


@pytest.mark.parametrize("backend", backend_params("scatter_add"))
def test_scatter_add_keeps_negative_zero(backend, monkeypatch):
    run = runner(backend, monkeypatch)
    # -0.0 + -0.0 stays -0.0; a kernel padding with +0.0 would flip the sign bit.
    out = torch.tensor([-0.0, 1.0])
    run("scatter_add", out, torch.tensor([0, 0, 1]), torch.tensor([-0.0, -0.0, 2.0]))
    assert torch.equal(out, torch.tensor([-0.0, 3.0])) and torch.signbit(out[0])


def test_scatter_add_dispatch_rejects_unavailable_backend():
    with pytest.raises(kernels.BackendUnavailable):
        kernels.scatter_add(torch.zeros(3), torch.tensor([0]), torch.ones(1), backend="cupy")


@pytest.mark.parametrize("backend", [b for b in backend_params("scatter_add") if b.values[0] in ("torch", "cpu")])
def test_scatter_add_rejects_indexes_out_of_range(backend, monkeypatch):
    # The numba loop checks bounds first, as index_add_ does: never a write past the buffer.
    # (The GPU kernels trust their indexes: every caller passes indexes it computed.)
    run = runner(backend, monkeypatch)
    out = torch.zeros(4)
    for bad in ([0, 4], [-1]):
        with pytest.raises((IndexError, RuntimeError)):
            run("scatter_add", out, torch.tensor(bad), torch.ones(len(bad)))
    if backend == "cpu":  # checked before any write (torch's loop may have added index 0)
        assert torch.equal(out, torch.zeros(4))


def test_scatter_add_unique_gives_the_same_sums():
    # unique=True only lets a GPU skip the sort; the sums are those of the sequential loop.
    gen = torch.Generator().manual_seed(4)
    idx = torch.randperm(1000, generator=gen)[:300]
    val = torch.randn(300, generator=gen)
    out0 = torch.randn(1000, generator=gen)
    assert torch.equal(kernels.scatter_add(out0.clone(), idx, val, unique=True), _sequential(out0, idx, val))


@pytest.mark.parametrize("backend", backend_params("count_above"))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("n", [1, 4099, 70_001])
def test_count_above_matches_torch(backend, monkeypatch, dtype, n):
    run = runner(backend, monkeypatch)
    gen = torch.Generator().manual_seed(n)
    x = (torch.randn(n, generator=gen) * 3).to(dtype)
    k = max(1, n // 100)
    th = candidate_thresholds(x, k)
    assert run("count_above", x, th, 1).tolist() == count_above_torch(x, th).tolist()
    # Ties: thresholds equal to entries count them (>=), with 16 thresholds, the most the GPU kernels take.
    ties = torch.tensor([float(v) for v in range(1, 17)] * 7, dtype=dtype)
    th16 = np.arange(16, 0, -1, dtype=np.float64)
    assert run("count_above", ties, th16, 1).tolist() == [7 * (j + 1) for j in range(16)]
    # 17 thresholds: past the GPU kernels' limit, the table sends the call to torch.
    th17 = np.arange(17, 0, -1, dtype=np.float64)
    assert run("count_above", ties, th17, 1).tolist() == [0] + [7 * (j + 1) for j in range(16)]


@pytest.mark.parametrize("backend", backend_params("count_above"))
def test_estimate_threshold_from_each_path_agrees(backend, monkeypatch):
    run = runner(backend, monkeypatch)
    # estimate_threshold is candidates + one count_above pass + interpolation; with
    # exact counts (every = 1, which k = 500 asks for) every path gives the torch estimate.
    x = torch.randn(50_000, generator=torch.Generator().manual_seed(5))
    th = candidate_thresholds(x, 500)
    assert _interpolate(th, run("count_above", x, th, 1), 500) == kernels.estimate_threshold(
        x, 500, backend="torch")


@pytest.mark.parametrize("backend", backend_params("pack_records"))
@pytest.mark.parametrize("index_dtype", [torch.int16, torch.int32, torch.int64])
@pytest.mark.parametrize("value_dtype", [torch.float32, torch.float16, torch.bfloat16, torch.uint8,
                                         torch.float64, torch.int8])
@pytest.mark.parametrize("count", [0, 1, 1025])
def test_pack_unpack_match_torch_bytewise(backend, monkeypatch, index_dtype, value_dtype, count):
    run = runner(backend, monkeypatch)
    gen = torch.Generator().manual_seed(count)
    big = 2**40 if index_dtype == torch.int64 else torch.iinfo(index_dtype).max
    idx = torch.randint(0, big, (count,), generator=gen)
    if count:
        idx[0] = big - 1  # the largest index the dtype must carry
    if count > 1 and index_dtype == torch.int16:
        idx[1] = -5  # a blocked message's offset >= 2**15: sign-extended on every path
    val = torch.randn(count, generator=gen) * 100
    if value_dtype in (torch.uint8, torch.int8):
        val = torch.randint(0, 256, (count,), generator=gen) - (128 if value_dtype == torch.int8 else 0)
    expect = kernels.pack_records(idx, val, index_dtype, value_dtype, backend="torch")
    got = torch.full_like(expect, 0xAB)  # every byte must be written
    run("pack_records", idx, val, index_dtype, value_dtype, got)
    assert torch.equal(got, expect)
    if count == 0:
        return  # unpack_records returns before dispatching an empty buffer
    ridx, rval = run("unpack_records", expect, index_dtype, value_dtype)
    eidx, evals = kernels.unpack_records(expect, index_dtype, value_dtype, backend="torch")
    assert torch.equal(ridx, eidx) and torch.equal(ridx, idx)
    assert rval.dtype == value_dtype
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


@pytest.mark.parametrize("backend", backend_params("encode_codes"))
@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("n", [0, 1, 7, 4099])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_encode_decode_codes_match_torch_bytewise(backend, monkeypatch, bits, n, dtype):
    run = runner(backend, monkeypatch)
    levels = 2 ** (bits - 1) - 1
    gen = torch.Generator().manual_seed(bits * n)
    v = (torch.randn(n, generator=gen) * levels).to(dtype)
    v[: min(n, 6)] = torch.tensor([0.5, 1.5, -2.5, 2.5, -0.5, 1e6])[: min(n, 6)].to(dtype)  # ties, clamp
    for scale in (float(levels), float(v.float().abs().max()) if n else 1.0, 0.0):
        packed = run("encode_codes", v, bits, scale)
        assert torch.equal(packed, payload.encode_codes_torch(v, bits, scale)), scale
        for out_dtype in (torch.float32, torch.bfloat16):  # bf16 output: the table's torch fallback
            back = run("decode_codes", packed, bits, n, scale, out_dtype)
            assert torch.equal(back, payload.decode_codes_torch(packed, bits, n, scale, out_dtype)), scale
            into = torch.full((n,), float("nan"), dtype=out_dtype)  # every value must be written
            got = run("decode_codes", packed, bits, n, scale, out_dtype, into)
            assert torch.equal(into, back) and torch.equal(got, back)
    # Half to even, as torch.round: 0.5 -> 0, 1.5 -> 2, -2.5 -> -2 at scale = levels.
    if n >= 4 and bits >= 4:
        q = run("decode_codes", run("encode_codes", v, bits, float(levels)), bits, 4, float(levels),
                   torch.float32)
        assert q.tolist() == [0.0, 2.0, -2.0, 2.0]



@pytest.mark.parametrize("backend", backend_params("encode_codes"))
@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("n", [0, 1, 7, 4099, 200_003])
def test_encode_keeping_the_error_and_decode_accumulating_match_torch_bitwise(backend, monkeypatch, bits, n):
    # keep_error: v becomes v - decode(code) in the encoding pass; accumulate: out += decode.
    # Both must equal the reference's separate steps bit for bit (no FMA, same roundings);
    # 200,003 entries cut into several spans on the CPU path (odd, so the last byte is partial).
    if backend == "triton" and n > 100_000 and not torch.cuda.is_available():
        pytest.skip("the Triton interpreter is too slow for this size")
    run = runner(backend, monkeypatch)
    levels = 2 ** (bits - 1) - 1
    gen = torch.Generator().manual_seed(bits + n)
    v = torch.randn(n, generator=gen) * 3
    v[: min(n, 4)] = torch.tensor([0.5, -2.5, 1e6, -1e6])[: min(n, 4)]  # ties and clamped values
    for scale in (float(levels), float(v.abs().max()) / 2 if n else 1.0, 0.0):
        expect_err = v.clone()
        expect = payload.encode_codes_torch(expect_err, bits, scale, keep_error=True)
        assert torch.equal(expect, payload.encode_codes_torch(v, bits, scale)), "the codes do not depend on keep"
        torch.testing.assert_close(expect_err, v - payload.decode_codes_torch(expect, bits, n, scale, torch.float32),
                                   rtol=0, atol=0)
        err = v.clone()
        got = run("encode_codes", err, bits, scale, True)
        assert torch.equal(got, expect) and torch.equal(err, expect_err), scale
        base = torch.randn(n, generator=gen)
        want = base + payload.decode_codes_torch(expect, bits, n, scale, torch.float32)
        into = base.clone()
        assert run("decode_codes", expect, bits, n, scale, torch.float32, into, True) is into
        assert torch.equal(into, want), scale
    # The public checks: the error is written in place, so only contiguous float32 can keep it.
    with pytest.raises(ValueError, match="contiguous float32"):
        payload.encode_codes(torch.zeros(4, dtype=torch.bfloat16), bits, 1.0, keep_error=True)
    with pytest.raises(ValueError, match="contiguous float32"):
        payload.encode_codes(torch.zeros(8)[::2], bits, 1.0, keep_error=True)
    with pytest.raises(ValueError, match="out must be given"):
        payload.decode_codes(torch.zeros(4, dtype=torch.uint8), bits, 4, 1.0, torch.float32, accumulate=True)

# ---- the O(k) index work of a sparse reduction: merges, take-and-zero, densify ------------
def _runs(gen: torch.Generator, R: int, n: int, m: int) -> tuple[torch.Tensor, list[int]]:
    """R ascending duplicate-free runs of up to m indexes below n, overlapping each other."""
    parts = [torch.randperm(n, generator=gen)[:int(torch.randint(0, m + 1, (1,), generator=gen))].sort().values
             for _ in range(R)]
    runs = [0]
    for p in parts:
        runs.append(runs[-1] + p.numel())
    return (torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64)), runs


@pytest.mark.parametrize("backend", backend_params("union_sorted_runs"))
@pytest.mark.parametrize("R", [0, 1, 2, 3, 5, 8, 17])
def test_union_sorted_runs_matches_unique(backend, monkeypatch, R):
    run = runner(backend, monkeypatch)
    gen = torch.Generator().manual_seed(R)
    for n, m in ((10, 10), (1000, 300), (50_000, 4000)):  # dense overlaps, sparse ones
        cat, runs = _runs(gen, R, n, m)
        before = cat.clone()
        got = run("union_sorted_runs", cat, runs)
        assert torch.equal(got, torch.unique(cat)) and got.dtype == torch.int64
        assert torch.equal(cat, before)  # the input is never a scratch buffer
        if got.numel():  # ...nor shared with the result
            got[0] = -1
            assert torch.equal(cat, before)
    # int32 runs (unpacked records keep int64, but the op takes any integer dtype)
    cat, runs = _runs(gen, 3, 100, 40)
    assert torch.equal(run("union_sorted_runs", cat.int(), runs), torch.unique(cat))


@pytest.mark.parametrize("backend", backend_params("isin_sorted"))
def test_isin_sorted_paths_match_isin(backend, monkeypatch):
    run = runner(backend, monkeypatch)
    gen = torch.Generator().manual_seed(5)
    for m, k, order in ((0, 5, "unique"), (5, 0, "unique"), (300, 30, "unique"), (3000, 3000, "unique"),
                        (1000, 300, "sorted"),  # ascending with repeats: the branch-free walk
                        (1000, 200, "any")):  # values that step back restart by binary search
        values = torch.randint(0, 4000, (m,), generator=gen)
        if order == "unique":
            values = torch.unique(values)
        elif order == "sorted":
            values = values.sort().values
        sorted_set = torch.unique(torch.randint(0, 4000, (k,), generator=gen))
        mark = torch.zeros(4000, dtype=torch.bool)
        assert torch.equal(run("isin_sorted", values, sorted_set, mark), torch.isin(values, sorted_set))
        assert not mark.any()


@pytest.mark.parametrize("backend", backend_params("take_and_zero"))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_take_and_zero_reads_and_clears(backend, monkeypatch, dtype):
    run = runner(backend, monkeypatch)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(5000, generator=gen).to(dtype)
    for idx in (torch.randperm(5000, generator=gen)[:700], torch.empty(0, dtype=torch.int64)):
        buf = x.clone()
        got = run("take_and_zero", buf, idx)
        assert torch.equal(got, x[idx])
        expect = x.clone()
        expect[idx] = 0
        assert torch.equal(buf, expect)


@pytest.mark.parametrize("backend", backend_params("scatter_dense"))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16])
@pytest.mark.parametrize("case", ["sorted", "unsorted", "empty", "ends", "all"])
def test_scatter_dense_matches_reference(backend, monkeypatch, dtype, case):
    run = runner(backend, monkeypatch)
    gen = torch.Generator().manual_seed(len(case))
    n = 200_003  # several spans, one odd
    idx = {"sorted": torch.randperm(n, generator=gen)[:3000].sort().values,
           "unsorted": torch.randperm(n, generator=gen)[:3000],  # the cpu path hands it to torch
           "empty": torch.empty(0, dtype=torch.int64),
           "ends": torch.tensor([0, 1, n - 2, n - 1]),
           "all": torch.arange(n)}[case]
    vals = torch.randn(idx.numel(), generator=gen).to(dtype)
    expect = torch.zeros(n, dtype=dtype)
    expect[idx] = vals
    out = torch.randn(n, generator=gen).to(dtype)  # every old entry must go
    assert run("scatter_dense", out, idx, vals, False) is not None
    assert torch.equal(out, expect)
    # zeroed: the caller vouches that out is all zero, so only idx is written; the
    # nonzero entries planted here show that nothing else is.
    out = torch.zeros(n, dtype=dtype)
    out[1::2] = 3.0
    expect = out.clone()
    expect[idx] = vals
    assert run("scatter_dense", out, idx, vals, True) is not None
    assert torch.equal(out, expect)


@pytest.mark.parametrize("backend", backend_params("nonzero"))
@pytest.mark.parametrize("n,p", [(0, 0.5), (1, 1.0), (70_001, 0.01), (70_001, 0.0), (70_001, 1.0)])
def test_nonzero_matches_reference(backend, monkeypatch, n, p):
    run = runner(backend, monkeypatch)
    mask = torch.rand(n, generator=torch.Generator().manual_seed(n)) < p
    got = run("nonzero", mask)
    assert got.dtype == torch.int64 and torch.equal(got, torch.nonzero(mask).flatten())


@pytest.mark.parametrize("backend", backend_params("nonzero"))
@pytest.mark.parametrize("n,p", [(0, 0.5), (1, 1.0), (70_001, 0.01), (70_001, 0.0)])
def test_nonzero_with_a_known_count_needs_no_read_and_checks_it_off_gpus(backend, monkeypatch, n, p):
    # With the count the torch path sizes its output without reading the device (nonzero_static);
    # off GPUs a count that is not the mask's is refused rather than padded or cut.
    run = runner(backend, monkeypatch)
    mask = torch.rand(n, generator=torch.Generator().manual_seed(n)) < p
    count = int(mask.sum())
    assert torch.equal(run("nonzero", mask, count), torch.nonzero(mask).flatten())
    if backend in ("torch", "cpu"):
        with pytest.raises(ValueError, match="True entries"):
            run("nonzero", mask, count + 1)


@pytest.mark.parametrize("backend", backend_params("sum_sorted_runs"))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("runs", [0, 1, 2, 5, 9])
def test_sum_sorted_runs_is_the_accumulator_bit_for_bit(backend, monkeypatch, dtype, runs):
    # The sums must be those of adding each run into a zeroed accumulator in run order.
    run = runner(backend, monkeypatch)
    gen = torch.Generator().manual_seed(runs)
    n = 5_000
    parts = [torch.randperm(n, generator=gen)[:int(torch.randint(0, 900, (1,), generator=gen))].sort().values
             for _ in range(runs)]
    vals = [(torch.randn(p.numel(), generator=gen) * 10 ** torch.randint(-3, 4, (p.numel(),),
                                                                            generator=gen)).to(dtype)
            for p in parts]
    if runs:
        vals[0][:3] = -0.0  # negative zeros become +0 in a zeroed accumulator
    bounds = [0]
    for p in parts:
        bounds.append(bounds[-1] + p.numel())
    cat_i = torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64)
    cat_v = torch.cat(vals) if vals else torch.empty(0, dtype=dtype)
    acc = torch.zeros(n, dtype=dtype)
    for p, v in zip(parts, vals):
        acc.index_add_(0, p, v)
    want = torch.unique(cat_i)
    got_i, got_v = run("sum_sorted_runs", cat_i, cat_v, bounds)
    assert torch.equal(got_i, want)
    assert torch.equal(got_v, acc[want])
    assert torch.equal(torch.signbit(got_v), torch.signbit(acc[want]))  # zeros' signs too


@pytest.mark.parametrize("backend", backend_params("bucketize"))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16])
def test_bucketize_paths_match_torch(backend, monkeypatch, dtype):
    # Ok-Topk's grid counts: entries on an edge count at it, NaN lands above every edge,
    # zeros below; fp16 goes to torch (the table's rule) and is still checked.
    run = runner(backend, monkeypatch)
    gen = torch.Generator().manual_seed(6)
    edges = (0.5 * torch.exp(torch.arange(-8, 9, dtype=torch.float64) / 40)).to(dtype)
    for n in (0, 1, 4099):
        x = (torch.randn(n, generator=gen).abs() * 0.7).to(dtype)
        if n > 100:
            x[:17] = edges  # exactly on every edge
            x[17:20] = float("nan")
            x[20:23] = 0.0
            x[23] = float("inf")
        bucket, hist = run("bucketize", x, edges)
        want = torch.bucketize(x, edges, right=True)
        assert torch.equal(bucket, want)
        assert torch.equal(hist, torch.bincount(want, minlength=edges.numel() + 1))
        if n > 100:
            assert bucket[:17].tolist() == list(range(1, 18)) and bucket[17:20].tolist() == [17] * 3


def test_bucketize_rejects_edges_unlike_the_input():
    x = torch.rand(10)
    for edges in (torch.rand(3, dtype=torch.float64), torch.rand(2, 2)):
        with pytest.raises(ValueError, match="edges"):
            kernels.bucketize(x, edges)
