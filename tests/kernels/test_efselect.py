"""Fused error-feedback select, the k-th largest and threshold selection: every backend against the torch reference.

Each operation's test runs every backend in its ``KernelOp`` table
(``gpu_paths.backend_params``): numba as is, Triton in its interpreter on
small CPU inputs, CuPy only where ``cupy.cuda.is_available()``.
"""

from __future__ import annotations

import math

import pytest
import torch

from gpu_paths import HAVE_NUMBA, backend_params, runner

from sparsecomm import kernels
from sparsecomm.kernels.efselect import ef_select_torch
from sparsecomm.kernels.radix import radix_kth_largest_torch


def _select(run, g, r, th, cap, scale, zero):
    idx = torch.empty(cap, dtype=torch.int64)
    val = torch.empty(cap, dtype=r.dtype)
    c = run("ef_select", g, r, th, cap, scale, zero, idx, val)
    return idx, val, c, r


def _reference(g, r, th, cap, scale, zero):
    idx = torch.empty(cap, dtype=torch.int64)
    val = torch.empty(cap, dtype=r.dtype)
    return idx, val, ef_select_torch(g, r, th, cap, scale, zero, idx, val), r


# (name, n, threshold, capacity): random, all selected, none selected, overflow,
# n not a multiple of the 4096 tile, tiny, a positive threshold that is 0 in float32.
CASES = [("random", 70_001, 1.5, 20_000), ("all", 9_000, 0.0, 9_000), ("none", 9_000, 1e9, 100),
         ("overflow", 50_003, 1.0, 1_000), ("tiny", 3, 0.1, 2), ("fp32_zero_th", 9_000, 1e-46, 9_000)]


@pytest.mark.parametrize("backend", backend_params("ef_select"))
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("zero", [True, False])
def test_ef_select_matches_reference(backend, monkeypatch, case, zero):
    run = runner(backend, monkeypatch)
    _, n, th, cap = case
    gen = torch.Generator().manual_seed(n)
    g, r0 = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
    if case[0] == "fp32_zero_th":
        r0[::3] = 0.0  # with g = 0 below: exact zeros, which "every nonzero entry" must skip
        g[::3] = 0.0
    ri, vi, ci, rr = _reference(g, r0.clone(), th, cap, 0.5, zero)
    pi, pv, cp, pr = _select(run, g, r0.clone(), th, cap, 0.5, zero)
    assert cp == ci  # the true count, also on overflow
    w = min(ci, cap)
    assert torch.equal(pi[:w], ri[:w])  # sorted, and the lowest indexes win on overflow
    # Bitwise: scale 0.5 makes scale * g exact, so fused and unfused multiply-adds agree.
    assert torch.equal(pv[:w], vi[:w])
    assert torch.equal(pr, rr)
    # Nothing is lost: residual + sent values == r0 + 0.5 g.
    back = pr.clone()
    back.index_add_(0, pi[:w], pv[:w] if zero else torch.zeros(w))
    torch.testing.assert_close(back, r0 + 0.5 * g)


@pytest.mark.parametrize("backend", backend_params("ef_select"))
@pytest.mark.parametrize("cap", [2_000, 40])
@pytest.mark.parametrize("zero", [True, False])
def test_ef_select_leaves_its_counts_on_the_device_when_asked(backend, monkeypatch, cap, zero):
    # device_counts: the same buffers and residual, the count (and, where the pass has it, the
    # non-finite count) as device scalars, nothing read; kernels.tally counts the non-finite sums
    # where the pass did not (the GPU kernels), and ef_select_counted reads them all at once.
    run = runner(backend, monkeypatch)
    n = 9_000
    gen = torch.Generator().manual_seed(3)
    g, r = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
    g[[5, 700, 8_999]] = torch.tensor([float("nan"), float("inf"), -float("inf")])
    r[4_000] = g[4_000] = 3e38  # a sum that overflows float32
    ri, rv, rr = torch.empty(cap, dtype=torch.int64), torch.empty(cap), r.clone()
    want = ef_select_torch(g, rr, 2.5, cap, 1.0, zero, ri, rv)
    idx, val, res = torch.empty(cap, dtype=torch.int64), torch.empty(cap), r.clone()
    count, bad = run("ef_select", g, res, 2.5, cap, 1.0, zero, idx, val, None, True)
    assert isinstance(count, torch.Tensor) and int(count) == want and (want <= cap) == (cap == 2_000)
    assert bad is None or int(bad) == 4 or cap == 40  # every non-finite sum is a candidate: kept if they fit
    counted = kernels.tally(val, count.reshape(()), cap, None, bad)[0][1]
    assert int(counted) == 4 or cap == 40
    w = min(want, cap)
    assert torch.equal(idx[:w], ri[:w]) and torch.equal(res, rr)
    torch.testing.assert_close(val[:w], rv[:w], rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("backend", backend_params("tally"))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("count,cap", [(300, 1_000), (5_000, 1_000), (0, 1_000), (0, 0), (7, 7)])
@pytest.mark.parametrize("with_rungs", [True, False])
def test_tally_gives_the_reference_words_and_buckets(backend, monkeypatch, dtype, count, cap, with_rungs):
    # Everything a fused select's caller reads, from the buffer in one pass: the count, the
    # non-finite kept values, the counts at each rung, every entry's bucket and the peak. Past
    # the count the buffer holds garbage (huge values, NaN) that must count as zeros.
    run = runner(backend, monkeypatch)
    gen = torch.Generator().manual_seed(6)
    vals = (torch.randn(cap + 3, generator=gen) * 3).to(dtype)
    kept = min(count, cap)
    if kept > 5:
        vals[[1, 4]] = torch.tensor([float("nan"), -float("inf")], dtype=dtype)
        vals[2] = vals[3]  # a tie
    vals[kept:] = float("nan") if kept % 2 else 1e30
    rungs = (1.5 * torch.exp(torch.arange(0, 11, dtype=torch.float64) / 8)).to(dtype) if with_rungs else None
    want_words, want_bucket = kernels.efselect.tally_torch(vals, torch.tensor(count), cap, rungs)
    words, bucket = run("tally", vals, torch.tensor(count), cap, rungs)
    words = words.tolist()
    assert words[:-1] == want_words.tolist()[:-1]
    top, want_top = (kernels.efselect._from_bits(w[-1], dtype) for w in (words, want_words.tolist()))
    assert top == want_top or (math.isnan(top) and math.isnan(want_top))
    assert top == (float(torch.where(torch.arange(cap) < kept, vals[:cap].abs(), 0).max()) if cap and with_rungs
                   else 0.0) or math.isnan(top)
    assert words[1] == (2 if kept > 5 else 0) and words[0] == count
    if with_rungs:
        assert torch.equal(bucket, want_bucket)
        assert words[2] == int((want_bucket > 0).sum())  # at or above the lowest rung
    else:
        assert bucket is None and len(words) == 3


@pytest.mark.parametrize("cap", [2_000, 40])
def test_ef_select_counted_reads_counts_ladder_and_peak_at_once(cap):
    n = 9_000
    gen = torch.Generator().manual_seed(4)
    g, r = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
    g[17] = float("nan")
    rungs = 2.5 * torch.exp(torch.arange(0, 11, dtype=torch.float64) / 40).to(torch.float32)
    ri, rv = torch.empty(cap, dtype=torch.int64), torch.empty(cap)
    want = ef_select_torch(g, r.clone(), 2.5, cap, 1.0, False, ri, rv)
    sel = kernels.ef_select_counted(g, r.clone(), 2.5, cap, zero_selected=False, rungs=rungs)
    w = min(want, cap)
    mag = rv[:w].abs()
    bucket, hist = kernels.bucketize(mag, rungs)
    assert sel.count == want and sel.nonfinite == (1 if want <= cap else None)
    assert sel.above == hist.flip(0).cumsum(0).flip(0)[1:].tolist()
    assert torch.equal(sel.bucket[:w], bucket)
    top = float(mag.max())
    assert sel.top == top or (math.isnan(sel.top) and math.isnan(top))


@pytest.mark.parametrize("backend", backend_params("ef_select"))
@pytest.mark.parametrize("rdtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("zero", [True, False])
@pytest.mark.parametrize("overflowed", [False, True])
def test_ef_select_selects_every_nonfinite_sum_and_leaves_its_residual(backend, monkeypatch, rdtype, zero,
                                                                       overflowed):
    # The finite check folded into the pass: NaN, +-Inf and a sum that overflows are all
    # selected with their non-finite acc, while the residual keeps its old value there.
    run = runner(backend, monkeypatch)
    n = 70_001  # several spans and tiles, a ragged tail
    gen = torch.Generator().manual_seed(5)
    g, r0 = torch.randn(n, generator=gen), torch.randn(n, generator=gen).to(rdtype)
    big = torch.finfo(rdtype).max
    bad = {17: float("nan"), 4_096: float("inf"), 40_000: -float("inf"), n - 1: float("nan")}
    for i, v in bad.items():
        g[i] = v
    g = g.to(rdtype)
    r0[123], g[123] = big, big  # finite terms, overflowing sum
    cap = 5 if overflowed else 20_000
    ri, vi, ci, rr = _reference(g, r0.clone(), 2.0, cap, 1.0, zero)
    pi, pv, cp, pr = _select(run, g, r0.clone(), 2.0, cap, 1.0, zero)
    assert cp == ci
    w = min(ci, cap)
    assert torch.equal(pi[:w], ri[:w])
    assert torch.equal(pv[:w].view(-1), vi[:w].view(-1)) or torch.allclose(pv[:w], vi[:w], equal_nan=True)
    assert torch.equal(pr, rr)
    expect = {*bad, 123}
    if not overflowed:
        got = {int(i) for i, v in zip(pi[:w], pv[:w]) if not torch.isfinite(v)}
        assert got == expect
    for i in expect:
        assert pr[i] == r0[i]  # untouched, also when selected with zero=True
    assert torch.isfinite(pr).all()


@pytest.mark.parametrize("backend", backend_params("ef_select"))
@pytest.mark.parametrize("odtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("n", [3, 70_001])
def test_ef_select_zeroes_out_on_its_way(backend, monkeypatch, odtype, n):
    # zero_out changes nothing else: the same selection, values and residual, and every
    # entry of the output zero (numba in the pass for float32/64, a pass of its own else).
    run = runner(backend, monkeypatch)
    gen = torch.Generator().manual_seed(n)
    g, r0 = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
    ri, vi, ci, rr = _reference(g, r0.clone(), 1.5, n, 0.5, False)
    out = torch.full((n,), float("nan"), dtype=odtype)
    idx, val = torch.empty(n, dtype=torch.int64), torch.empty(n)
    c = run("ef_select", g, r := r0.clone(), 1.5, n, 0.5, False, idx, val, out)
    assert c == ci and torch.equal(idx[:c], ri[:c]) and torch.equal(val[:c], vi[:c]) and torch.equal(r, rr)
    assert torch.equal(out, torch.zeros(n, dtype=odtype))


def test_ef_select_refuses_a_zero_out_it_would_read_or_cannot_fill():
    g, r = torch.randn(100), torch.zeros(100)
    storage = torch.randn(250)
    cases = [(g, g), (g, r), (storage[50:150], storage[:100]),  # the same, the residual, a partial overlap
             (g, torch.zeros(99)), (g, torch.zeros(200)[::2]), (g, torch.zeros(100, dtype=torch.int32))]
    for grad, bad in cases:
        with pytest.raises(ValueError, match="zero_out"):
            kernels.ef_select(grad, r, 1.0, 100, zero_out=bad)
    # Views of one storage that do not overlap are fine.
    kernels.ef_select(storage[100:200], r, 1.0, 100, zero_out=storage[:100])
    assert storage[:100].abs().sum() == 0


@pytest.mark.skipif(not HAVE_NUMBA, reason="numba does not import (pip install numba)")
@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("cap_frac", [0.2, 0.5, 0.9, 1.0, 2.0])
def test_ef_select_cpu_spans_and_overflow(threads, cap_frac):
    # The CPU path cuts the vector into one span per torch thread and merges;
    # the capacity can run out inside any span (or not at all).
    n = 200_003
    gen = torch.Generator().manual_seed(threads)
    g, r0 = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
    expect = int(((r0 + g).abs() >= 2.0).sum())
    cap = int(cap_frac * expect)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    # zero_out in every span: aligned (the streaming stores), and at a 4-byte offset (a pass of its own)
    storage = torch.full((n + 8,), float("nan"), dtype=torch.float64 if cap_frac == 2.0 else torch.float32)
    out = storage[1:n + 1] if cap_frac == 0.5 else storage[:n]
    try:
        r = r0.clone()
        idx, val = torch.empty(cap, dtype=torch.int64), torch.empty(cap)
        c = kernels.dispatch.OPS["ef_select"].implementation("cpu")(g, r, 2.0, cap, 1.0, True, idx, val, out)
    finally:
        torch.set_num_threads(old)
    ri, rv, rc, rr = _reference(g, r0.clone(), 2.0, cap, 1.0, True)
    assert c == rc == expect
    w = min(c, cap)
    assert torch.equal(idx[:w], ri[:w]) and torch.equal(val[:w], rv[:w]) and torch.equal(r, rr)
    assert torch.equal(out, torch.zeros_like(out)) and int(storage.isnan().sum()) == 8  # nothing outside it


@pytest.mark.parametrize("backend", backend_params("ef_select"))
@pytest.mark.parametrize("gdtype", [torch.float16, torch.bfloat16, torch.float64])
def test_ef_select_grad_dtypes(backend, monkeypatch, gdtype):
    run = runner(backend, monkeypatch)
    gen = torch.Generator().manual_seed(1)
    g = torch.randn(5_000, generator=gen).to(gdtype)
    rdt = torch.float64 if gdtype == torch.float64 else torch.float32
    r0 = torch.randn(5_000, generator=gen).to(rdt)
    ri, vi, ci, rr = _reference(g, r0.clone(), 1.0, 6_000, 1.0, True)
    pi, pv, cp, pr = _select(run, g, r0.clone(), 1.0, 6_000, 1.0, True)
    assert cp == ci and torch.equal(pi[:cp], ri[:ci]) and torch.equal(pv[:cp], vi[:ci])
    assert torch.equal(pr, rr)


def test_ef_select_ties_and_zeros():
    # Entries exactly at the threshold are selected; zeros never are.
    r = torch.tensor([0.0, 1.0, -1.0, 0.5, 1.0, 0.0, -2.0])
    idx, val, c = kernels.ef_select(torch.zeros(7), r, 1.0, 10, backend="torch")
    assert c == 4 and idx[:c].tolist() == [1, 2, 4, 6]
    r = torch.tensor([0.0, 1.0, -1.0, 0.5, 1.0, 0.0, -2.0])
    idx, val, c = kernels.ef_select(torch.zeros(7), r, 0.0, 10, backend="auto")
    assert c == 5 and idx[:c].tolist() == [1, 2, 3, 4, 6] and r.abs().sum() == 0


def test_ef_select_public_defaults():
    g, r = torch.randn(1000), torch.zeros(1000)
    idx, val, c = kernels.ef_select(g, r, 1.0, 2000)
    assert idx.dtype == torch.int64 and val.dtype == torch.float32 and c == int((g.abs() >= 1).sum())
    with pytest.raises(ValueError):
        kernels.ef_select(g, torch.zeros(1000, dtype=torch.float16), 1.0, 10)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_radix_reference_matches_topk(dtype):
    x = torch.randn(30_001, generator=torch.Generator().manual_seed(2)).to(dtype)
    for k in (1, 300, 30_001):
        want = float(torch.sort(x.abs().float(), descending=True).values[k - 1])
        assert radix_kth_largest_torch(x, k) == want


@pytest.mark.parametrize("backend", backend_params("kth_largest"))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("use_abs", [False, True])
def test_kth_largest_matches_reference(backend, monkeypatch, dtype, use_abs):
    run = runner(backend, monkeypatch)
    # 70_001 entries: above the numba path's 65_536 cut-off to the plain introselect.
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(70_001, generator=gen).to(dtype)
    x[::7] = x[0]  # many ties
    mag = x if use_abs else x.abs()
    for k in (1, 2_000, 70_001):
        want = float(torch.sort(x.abs().double(), descending=True).values[k - 1])
        assert run("kth_largest", mag, k, use_abs) == want, k


@pytest.mark.skipif(not HAVE_NUMBA, reason="numba does not import (pip install numba)")
@pytest.mark.parametrize("kind", ["gauss", "ties", "periodic", "zeros"])
@pytest.mark.parametrize("n", [300_000, 1_100_000], ids=["radix", "sampled"])  # either side of _RADIX_MAX
def test_kth_largest_cpu_exact(kind, n):
    gen = torch.Generator().manual_seed(5)
    if kind == "gauss":
        x = torch.randn(n, generator=gen)
    elif kind == "ties":
        x = torch.randint(0, 4, (n,), generator=gen).float()
    elif kind == "periodic":  # defeats the strided sample: the fallback must still be exact
        x = torch.zeros(n)
        x[::4] = 5.0
    else:
        x = torch.zeros(n)
        x[123] = 1.0
    mag = x.abs()
    for k in (1, 300, 3_000, n):
        assert kernels.kth_largest(mag, k, backend="cpu") == kernels.kth_largest(mag, k, backend="torch")
    wide = mag.double()
    assert kernels.kth_largest(wide, 77, backend="cpu") == kernels.kth_largest(wide, 77, backend="torch")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="torch.cuda.is_available() is False")
def test_auto_on_gpu_matches_torch():
    g, r = torch.randn(1_000_003, device="cuda"), torch.randn(1_000_003, device="cuda")
    r2 = r.clone()
    a = kernels.ef_select(g, r, 2.0, 50_000)
    b = kernels.ef_select(g, r2, 2.0, 50_000, backend="torch")
    assert a[2] == b[2] and torch.equal(a[0][:a[2]], b[0][:b[2]])
    assert kernels.kth_largest(r.abs(), 1000) == kernels.kth_largest(r.abs(), 1000, backend="torch")


@pytest.mark.parametrize("backend", backend_params("select_above"))
@pytest.mark.parametrize("n", [0, 1, 33, 70_001, 200_003])
@pytest.mark.parametrize("threads", [1, 3])
def test_select_above_matches_reference(backend, monkeypatch, n, threads):
    run = runner(backend, monkeypatch)
    gen = torch.Generator().manual_seed(n)
    mag = torch.randn(n, generator=gen).abs()
    mag[::7] = 0.0  # zeros are never selected, even with threshold 0
    if n > 40:
        mag[5] = mag[40] = 1.5  # ties at the threshold are selected
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for th in (1.5, 0.0, -1.0, 2.5, 1e9):
            for use_abs, x in ((False, mag), (True, -mag)):
                want = torch.nonzero((x.abs() if use_abs else x) >= th if th > 0 else x != 0).flatten()
                assert torch.equal(run("select_above", x, th, use_abs), want), (th, use_abs)
        for dtype in (torch.float16, torch.float64):
            m = mag.to(dtype)
            assert torch.equal(run("select_above", m, 1.0, False), torch.nonzero(m >= 1.0).flatten())
    finally:
        torch.set_num_threads(old)


@pytest.mark.skipif(not HAVE_NUMBA, reason="numba does not import (pip install numba)")
def test_threshold_zero_selects_nonzeros_even_with_flushed_denormals():
    # "Every nonzero entry" must not depend on the denormal mode of the calling thread.
    torch.set_flush_denormal(True)
    try:
        x = torch.tensor([0.0, 1.0, 0.0, -2.0] * 20_000)
        assert torch.equal(kernels.select_above(x, 0.0, backend="cpu", use_abs=True),
                           torch.nonzero(x != 0).flatten())
        r = x.clone()
        _, _, c = kernels.ef_select(torch.zeros_like(x), r, 0.0, 10, backend="cpu")
        assert c == 40_000
    finally:
        torch.set_flush_denormal(False)


@pytest.mark.skipif(not HAVE_NUMBA, reason="numba does not import (pip install numba)")
def test_cpu_kernels_with_different_thread_budgets_per_thread():
    # torch keeps the thread budget per thread: rank threads with 2 and 3 threads
    # share the pools without tearing them down under each other.
    import threading

    x = torch.randn(1_000_000, generator=torch.Generator().manual_seed(0))
    expect = torch.nonzero(x.abs() >= 1.5).flatten()
    errors = []

    def rank(budget):
        torch.set_num_threads(budget)
        try:
            for _ in range(60):
                assert torch.equal(kernels.select_above(x, 1.5, backend="cpu", use_abs=True), expect)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    old = torch.get_num_threads()
    try:
        threads = [threading.Thread(target=rank, args=(b,)) for b in (2, 3, 2, 3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        torch.set_num_threads(old)
    assert not errors, errors[0]


@pytest.mark.skipif(not HAVE_NUMBA, reason="numba does not import (pip install numba)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_kth_largest_cpu_radix_orders_signed_values(dtype):
    # Without use_abs the radix keys keep the sign's order: negative values, -0.0 and +0.0 included.
    gen = torch.Generator().manual_seed(9)
    x = (torch.randn(100_000, generator=gen) * 3).to(dtype)
    x[:500] = -0.0
    x[500:1000] = 0.0
    x[1000:3000] = -1.5
    for k in (1, 2_500, 50_000, 99_000, 100_000):
        assert kernels.kth_largest(x, k, backend="cpu") == kernels.kth_largest(x, k, backend="torch"), k
        assert (kernels.kth_largest(x, k, backend="cpu", use_abs=True)
                == kernels.kth_largest(x, k, backend="torch", use_abs=True)), k


def _candidates(kind: str, m: int, gen: torch.Generator) -> torch.Tensor:
    if kind == "ties":
        return torch.randint(0, 5, (m,), generator=gen).float()  # zeros too
    if kind == "zeros":
        return torch.zeros(m)
    mag = torch.randn(m, generator=gen).abs()
    mag[::11] = 0
    mag[3::13] = mag[min(3, m - 1)]  # a tie class
    return mag


@pytest.mark.parametrize("backend", backend_params("topk_of_candidates"))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("kind", ["gauss", "ties", "zeros"])
def test_topk_of_candidates_matches_reference(backend, monkeypatch, dtype, kind):
    from sparsecomm.kernels.select import topk_of_candidates_torch

    run = runner(backend, monkeypatch)
    gen = torch.Generator().manual_seed(len(kind))
    for m in (1, 37, 70_001):  # the cpu path from 4096 candidates
        mag = _candidates(kind, m, gen).to(dtype)
        idx = torch.arange(m) * 3  # sorted, as the fused pass delivers them
        for k in sorted({1, 2, m // 3 + 1, m - 1, m, m + 5} - {0}):
            want = topk_of_candidates_torch(idx, mag, k)
            got = run("topk_of_candidates", idx, mag, k)
            assert got.dtype == torch.int64 and torch.equal(got, want), (m, k)
            positive = int((mag > 0).sum())
            assert got.numel() == min(k, positive)


@pytest.mark.parametrize("backend", backend_params("topk_of_candidates"))
def test_topk_of_candidates_never_keeps_nan(backend, monkeypatch):
    # The fused pass selects non-finite entries (a call that skips the input check passes
    # them on), and a gTopk merge of +inf and -inf makes a NaN: the reference keeps none.
    from sparsecomm.kernels.select import topk_of_candidates_torch

    run = runner(backend, monkeypatch)
    gen = torch.Generator().manual_seed(8)
    for m, nans in ((5000, 3), (5000, 4000)):
        mag = torch.randn(m, generator=gen).abs()
        mag[torch.randperm(m, generator=gen)[:nans]] = float("nan")
        idx = torch.arange(m)
        for k in (1, 100, 999, 4990, 6000):
            want = topk_of_candidates_torch(idx, mag, k)
            got = run("topk_of_candidates", idx, mag, k)
            assert torch.equal(got, want), (m, nans, k)
            assert not torch.isnan(mag[got]).any()


@pytest.mark.skipif(not HAVE_NUMBA, reason="numba does not import (pip install numba)")
def test_kth_largest_cpu_radix_with_nan_follows_numpy():
    x = torch.randn(100_000, generator=torch.Generator().manual_seed(4))
    x[::1000] = float("nan")
    x[500::1000] = -x[::1000]  # a NaN with its sign bit set (x86's default NaN): the keys rank it lowest
    for k in (1, 50, 101, 5_000):
        a, b = kernels.kth_largest(x, k, backend="cpu"), kernels.kth_largest(x, k, backend="torch")
        assert a == b or (a != a and b != b), k  # NaN ranks largest, as in np.partition


# ---- dense error feedback: accumulate with block maxima ----------------------------------
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # the interpreter's numpy sums
@pytest.mark.parametrize("backend", backend_params("ef_accumulate"))
@pytest.mark.parametrize("rdtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("gdtype", [None, torch.bfloat16])
@pytest.mark.parametrize("n,block", [(0, 4), (1, 4), (4097, 4096), (300_001, 4096), (1000, 1), (1000, 7),
                                     (1000, None), (300_001, None), (2_100_003, 4096), (2_100_003, None),
                                     (9_000, 128), (70_001, 16384), (70_001, None)])
def test_ef_accumulate_matches_reference(backend, monkeypatch, rdtype, gdtype, n, block):
    # 300,001 entries run as several spans of whole blocks on the CPU path (2 threads), and
    # 2,100,003 entries of a bf16 gradient are widened in three pieces; non-finite sums
    # (NaN, Inf, an overflowing sum) leave their residual and are counted.
    from sparsecomm.kernels.efselect import ef_accumulate_torch

    if backend == "triton" and n > 100_000 and not torch.cuda.is_available():
        pytest.skip("the Triton interpreter is too slow for this size")
    run = runner(backend, monkeypatch)
    gen = torch.Generator().manual_seed(n + (block or 0))
    g = torch.randn(n, generator=gen, dtype=rdtype) * 5
    r = torch.randn(n, generator=gen, dtype=rdtype)
    if n > 20:
        big = torch.finfo(rdtype).max
        g[3], g[8], g[n - 1] = float("inf"), float("nan"), -3e3
        r[5], g[5] = big, big  # the sum overflows
        r[n - 2] = -1e4  # the largest magnitude, in the last (short) block
    g = g.to(gdtype) if gdtype is not None else g
    b = block or 0  # None: no maxima, which the implementations take as 0
    want_r = r.clone()
    want_m = torch.empty(-(-n // b) if b else 0, dtype=rdtype)
    want_c = int(ef_accumulate_torch(g, want_r, b, want_m))
    got_r = r.clone()
    got_m = torch.full_like(want_m, float("nan"))  # every maximum must be written
    got_c = int(run("ef_accumulate", g.contiguous(), got_r, b, got_m))
    public_r = r.clone()
    public_m, public_c = kernels.ef_accumulate(g, public_r, block)
    assert public_c == want_c and torch.equal(public_r, want_r) and (public_m is None) == (block is None)
    assert got_c == want_c == (3 if n > 20 else 0)
    assert torch.equal(got_r, want_r) and torch.equal(got_m, want_m)
    if n > 20:
        assert got_r[5] == r[5] and got_r[3] == r[3]  # the non-finite sums left their entries


def test_dense_chunk_scales_from_block_maxima_equal_a_pass_over_each_chunk(monkeypatch):
    # DenseState reads a quantiser's chunk scales from its accumulation's block maxima and
    # the entries at the chunks' edges: the same floats as max |chunk| (own_scale), for
    # chunks inside one block, across many, empty, or ending in the short last block.
    import sparsecomm
    from sparsecomm.compress import Quantize

    monkeypatch.setattr(sparsecomm.DenseState, "MAXIMA_BLOCK", 16)
    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.float64):
        st = sparsecomm.DenseState(error_feedback=True)
        acc = st.compensate(torch.randn(1003, generator=gen, dtype=dtype)).acc  # the plain add
        assert st.chunk_maxima(acc, [0, 1003]) is None  # none kept before a call asked for them
        assert st.fuses_next()
        acc[500] = -40.0  # a negative maximum
        st.compensate(torch.zeros(1003, dtype=dtype))  # the maxima of the acc as it is now
        for starts in ([0, 1003], [0, 5, 9, 1003], [0, 16, 32, 32, 1000, 1003], [0, 17, 495, 501, 502, 1003],
                       [0, 334, 668, 1003]):
            want = [Quantize(8).own_scale(acc[a:b]) for a, b in zip(starts[:-1], starts[1:])]
            assert st.chunk_maxima(acc, starts) == want, starts
        st.iteration += 1  # maxima of an earlier call are never used
        assert st.chunk_maxima(acc, [0, 1003]) is None
