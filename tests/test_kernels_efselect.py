"""Fused error-feedback select and the k-th largest: every path against the torch reference.

The Triton kernels run in interpreter mode (TRITON_INTERPRET=1, set in a
subprocess-free way: before triton is first imported by this module) on
small inputs; CuPy kernels only run where ``cupy.cuda.is_available()``.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first import of triton


import pytest
import torch

from gpu_paths import HAVE_NUMBA, HAVE_TRITON, cupy_ok

from sparsecomm import kernels
from sparsecomm.kernels import dispatch
from sparsecomm.kernels.efselect import ef_select_torch
from sparsecomm.kernels.radix import radix_kth_largest_torch





def _run(path: str, g, r, th, cap, scale, zero):
    idx = torch.empty(cap, dtype=torch.int64)
    val = torch.empty(cap, dtype=r.dtype)
    if path == "torch":
        c = ef_select_torch(g, r, th, cap, scale, zero, idx, val)
    elif path == "cpu":
        from sparsecomm.kernels.cpu import ef_select_cpu

        c = ef_select_cpu(g, r, th, cap, scale, zero, idx, val)
    elif path == "triton":
        from sparsecomm.kernels.triton_kernels import ef_select_triton

        c = ef_select_triton(g, r, th, cap, scale, zero, idx, val)
    else:
        from sparsecomm.kernels.cupy_kernels import ef_select_cupy

        g, r, idx, val = g.cuda(), r.cuda(), idx.cuda(), val.cuda()
        c = ef_select_cupy(g, r, th, cap, scale, zero, idx, val)
        r, idx, val = r.cpu(), idx.cpu(), val.cpu()
    return idx, val, c, r


PATHS = [pytest.param("cpu", marks=pytest.mark.skipif(not HAVE_NUMBA, reason="numba not installed")),
         pytest.param("triton", marks=pytest.mark.skipif(not HAVE_TRITON, reason="triton not installed")),
         pytest.param("cupy", marks=pytest.mark.skipif(not cupy_ok(), reason="cupy.cuda.is_available() is False"))]

# (name, n, threshold, capacity): random, all selected, none selected, overflow,
# n not a multiple of the 4096 tile, tiny.
CASES = [("random", 70_001, 1.5, 20_000), ("all", 9_000, 0.0, 9_000), ("none", 9_000, 1e9, 100),
         ("overflow", 50_003, 1.0, 1_000), ("tiny", 3, 0.1, 2)]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("zero", [True, False])
def test_ef_select_matches_reference(path, case, zero):
    _, n, th, cap = case
    gen = torch.Generator().manual_seed(n)
    g, r0 = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
    ri, vi, ci, rr = _run("torch", g, r0.clone(), th, cap, 0.5, zero)
    pi, pv, cp, pr = _run(path, g, r0.clone(), th, cap, 0.5, zero)
    assert cp == ci  # the true count, also on overflow
    w = min(ci, cap)
    assert torch.equal(pi[:w], ri[:w])  # sorted, and the lowest indexes win on overflow
    torch.testing.assert_close(pv[:w], vi[:w])
    torch.testing.assert_close(pr, rr)
    # Nothing is lost: residual + sent values == r0 + 0.5 g.
    back = pr.clone()
    back.index_add_(0, pi[:w], pv[:w] if zero else torch.zeros(w))
    torch.testing.assert_close(back, r0 + 0.5 * g)


@pytest.mark.skipif(not HAVE_NUMBA, reason="numba not installed")
@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("cap_frac", [0.2, 0.5, 0.9, 1.0, 2.0])
def test_ef_select_cpu_spans_and_overflow(threads, cap_frac):
    # The CPU path cuts the vector into one span per torch thread and merges;
    # the capacity can run out inside any span (or not at all).
    from sparsecomm.kernels.cpu import ef_select_cpu

    n = 200_003
    gen = torch.Generator().manual_seed(threads)
    g, r0 = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
    expect = int(((r0 + g).abs() >= 2.0).sum())
    cap = int(cap_frac * expect)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        r = r0.clone()
        idx, val = torch.empty(cap, dtype=torch.int64), torch.empty(cap)
        c = ef_select_cpu(g, r, 2.0, cap, 1.0, True, idx, val)
    finally:
        torch.set_num_threads(old)
    ri, rv, rc, rr = _run("torch", g, r0.clone(), 2.0, cap, 1.0, True)
    assert c == rc == expect
    w = min(c, cap)
    assert torch.equal(idx[:w], ri[:w]) and torch.equal(val[:w], rv[:w]) and torch.equal(r, rr)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("gdtype", [torch.float16, torch.bfloat16, torch.float64])
def test_ef_select_grad_dtypes(path, gdtype):
    gen = torch.Generator().manual_seed(1)
    g = torch.randn(5_000, generator=gen).to(gdtype)
    rdt = torch.float64 if gdtype == torch.float64 else torch.float32
    r0 = torch.randn(5_000, generator=gen).to(rdt)
    ri, _, ci, rr = _run("torch", g, r0.clone(), 1.0, 6_000, 1.0, True)
    pi, _, cp, pr = _run(path, g, r0.clone(), 1.0, 6_000, 1.0, True)
    assert cp == ci and torch.equal(pi[:cp], ri[:ci])
    torch.testing.assert_close(pr, rr)


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


@pytest.mark.skipif(not HAVE_TRITON, reason="triton not installed")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_kth_largest_triton(dtype):
    from sparsecomm.kernels.triton_kernels import kth_largest_triton

    gen = torch.Generator().manual_seed(3)
    x = torch.randn(20_011, generator=gen).to(dtype)
    x[::7] = x[0]  # many ties
    for k in (1, 2_000, 20_011):
        assert kth_largest_triton(x, k) == radix_kth_largest_torch(x, k)


@pytest.mark.skipif(not cupy_ok(), reason="cupy.cuda.is_available() is False")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_kth_largest_cupy(dtype):
    from sparsecomm.kernels.cupy_kernels import kth_largest_cupy

    x = torch.randn(1_000_003, generator=torch.Generator().manual_seed(4)).to(dtype)
    for k in (1, 10_000):
        assert kth_largest_cupy(x.cuda(), k) == radix_kth_largest_torch(x, k)


@pytest.mark.skipif(not HAVE_NUMBA, reason="numba not installed")
@pytest.mark.parametrize("kind", ["gauss", "ties", "periodic", "zeros"])
def test_kth_largest_cpu_exact(kind):
    gen = torch.Generator().manual_seed(5)
    n = 300_000
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
    assert kernels.kth_largest(mag.double(), 77, backend="cpu") == kernels.kth_largest(mag.double(), 77, backend="torch")


def test_dispatch_rules(monkeypatch):
    x = torch.zeros(4)
    monkeypatch.delenv("SPARSECOMM_KERNELS", raising=False)
    assert dispatch.choose(x) == ("cpu" if HAVE_NUMBA else "torch")
    assert dispatch.choose(x, "torch") == "torch"
    assert dispatch.choose(x, "numba" if HAVE_NUMBA else "torch") in ("cpu", "torch")
    with pytest.raises(dispatch.BackendUnavailable, match="install"):
        dispatch.choose(x, "cupy")  # a CPU tensor: never runnable
    with pytest.raises(ValueError):
        dispatch.choose(x, "fortran")
    monkeypatch.setenv("SPARSECOMM_KERNELS", "torch")
    assert dispatch.choose(x) == "torch"
    monkeypatch.setenv("SPARSECOMM_KERNELS", "triton")  # cannot run on CPU: falls back, warns
    with pytest.warns(RuntimeWarning):
        dispatch._warn_once.cache_clear()
        assert dispatch.choose(x) in ("cpu", "torch")
    assert dispatch.choose(x, supported=("torch",)) == "torch"
    import warnings

    monkeypatch.setenv("SPARSECOMM_KERNELS", "cpu")  # an operation without a cpu path: no warning
    dispatch._warn_once.cache_clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert dispatch.choose(x, supported=("torch", "triton", "cupy")) == "torch"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="torch.cuda.is_available() is False")
def test_auto_on_gpu_matches_torch():
    g, r = torch.randn(1_000_003, device="cuda"), torch.randn(1_000_003, device="cuda")
    r2 = r.clone()
    a = kernels.ef_select(g, r, 2.0, 50_000)
    b = kernels.ef_select(g, r2, 2.0, 50_000, backend="torch")
    assert a[2] == b[2] and torch.equal(a[0][:a[2]], b[0][:b[2]])
    assert kernels.kth_largest(r.abs(), 1000) == kernels.kth_largest(r.abs(), 1000, backend="torch")


@pytest.mark.skipif(not HAVE_NUMBA, reason="numba not installed")
@pytest.mark.parametrize("n", [0, 1, 33, 70_001, 200_003])
@pytest.mark.parametrize("threads", [1, 3])
def test_select_above_cpu_matches_torch(n, threads):
    gen = torch.Generator().manual_seed(n)
    mag = torch.randn(n, generator=gen).abs()
    mag[::7] = 0.0  # zeros are never selected, even with threshold 0
    if n > 40:
        mag[5] = mag[40] = 1.5  # ties at the threshold are selected
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for th in (1.5, 0.0, -1.0, 2.5, 1e9):
            got = kernels.select_above(mag, th, backend="cpu")
            assert torch.equal(got, kernels.select_above(mag, th, backend="torch")), th
        for dtype in (torch.float16, torch.float64):
            m = mag.to(dtype)
            assert torch.equal(kernels.select_above(m, 1.0, backend="cpu"),
                               kernels.select_above(m, 1.0, backend="torch"))
    finally:
        torch.set_num_threads(old)


@pytest.mark.skipif(not HAVE_NUMBA, reason="numba not installed")
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


@pytest.mark.skipif(not HAVE_NUMBA, reason="numba not installed")
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
