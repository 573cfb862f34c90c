"""Local kernel benchmarks: fused select, exact and estimated thresholds, against torch.

    python -m pytest benchmarks/test_kernels.py -s                      # 1M and 25M
    SPARSECOMM_BENCH_SIZES=1000000,25000000,100000000 python -m pytest benchmarks/test_kernels.py -s

Runs on one process (no collective calls). Device: CUDA when available, else
CPU; the kernel path is the dispatcher's auto choice (``SPARSECOMM_KERNELS``
overrides). Every timed result is checked against torch in the same run, and
a table of times, elements/s, GB/s and ratios (measured in this run) is
printed at the end. Density 0.01, float32.
"""

from __future__ import annotations

import os
import time

import pytest
import torch

from sparsecomm import kernels
from sparsecomm.kernels.dispatch import choose

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
SIZES = [int(s) for s in os.environ.get("SPARSECOMM_BENCH_SIZES", "1000000,25000000").split(",")]
DENSITY = 0.01
ROUNDS = int(os.environ.get("SPARSECOMM_BENCH_ROUNDS", "5"))
RESULTS: dict[tuple[int, str], tuple[float, float]] = {}  # (n, name) -> (seconds, bytes moved)


def _sync() -> None:
    if DEV.type == "cuda":
        torch.cuda.synchronize()


def _time(fn, setup=None) -> float:
    """Best of ROUNDS after one warm-up; ``setup`` runs untimed before each call."""
    best = float("inf")
    for i in range(ROUNDS + 1):
        if setup is not None:
            setup()
        _sync()
        t0 = time.perf_counter()
        fn()
        _sync()
        if i:
            best = min(best, time.perf_counter() - t0)
    return best


def _record(benchmark, n: int, name: str, seconds: float, nbytes: float) -> None:
    RESULTS[(n, name)] = (seconds, nbytes)
    benchmark.extra_info.update(n=n, seconds=seconds, elements_per_s=n / seconds,
                                gb_per_s=nbytes / seconds / 1e9)
    benchmark.pedantic(lambda: None, rounds=1)  # timing is ours (setup must stay untimed)


def _data(n: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=gen).to(DEV), (0.1 * torch.randn(n, generator=gen)).to(DEV)


@pytest.mark.parametrize("n", SIZES)
def test_fused_select(benchmark, n):
    r0, g = _data(n)
    k = max(1, int(DENSITY * n))
    th = kernels.kth_largest((r0 + g).abs(), k)
    cap = 2 * k
    r = r0.clone()
    oi = torch.empty(cap, dtype=torch.int64, device=DEV)
    ov = torch.empty(cap, dtype=torch.float32, device=DEV)
    restore = lambda: r.copy_(r0)  # noqa: E731  untimed: every call sees the same input
    t = _time(lambda: kernels.ef_select(g, r, th, cap, out_idx=oi, out_val=ov), restore)
    # Check against the reference while we are here.
    restore()
    _, _, c = kernels.ef_select(g, r, th, cap, out_idx=oi, out_val=ov)
    r2 = r0.clone()
    ri = torch.nonzero((r2 + g).abs() >= th).flatten()
    assert c == ri.numel() and torch.equal(oi[:min(c, cap)], ri[:cap])
    _record(benchmark, n, f"fused select ({choose(r)})", t, 12 * n + 12 * min(c, cap))


@pytest.mark.parametrize("n", SIZES)
def test_yardstick_add(benchmark, n):
    r, g = _data(n)
    t = _time(lambda: torch.add(r, g, out=r))
    _record(benchmark, n, "yardstick torch.add(r, g, out=r)", t, 12 * n)


@pytest.mark.parametrize("n", SIZES)
def test_unfused_chain(benchmark, n):
    r0, g = _data(n)
    k = max(1, int(DENSITY * n))
    th = kernels.kth_largest((r0 + g).abs(), k)
    r = r0.clone()

    def chain():
        r.add_(g)
        idx = torch.nonzero(r.abs().ge(th)).flatten()
        val = r.gather(0, idx)
        r.index_fill_(0, idx, 0)
        return idx, val

    t = _time(chain, lambda: r.copy_(r0))
    _record(benchmark, n, "unfused torch chain", t, 12 * n)


@pytest.mark.parametrize("n", SIZES)
def test_exact_threshold(benchmark, n):
    x, _ = _data(n, 1)
    k = max(1, int(DENSITY * n))
    mag = x.abs()
    t = _time(lambda: kernels.kth_largest(mag, k))
    assert kernels.kth_largest(mag, k) == float(torch.topk(mag, k).values.min())
    _record(benchmark, n, f"exact threshold ({choose(mag)})", t, 4 * n)


@pytest.mark.parametrize("n", SIZES)
def test_numpy_partition(benchmark, n):
    if DEV.type != "cpu":
        pytest.skip("numpy partition is the CPU reference only")
    x, _ = _data(n, 1)
    k = max(1, int(DENSITY * n))
    mag = x.abs()
    t = _time(lambda: kernels.kth_largest(mag, k, backend="torch"))
    _record(benchmark, n, "exact threshold (torch path: numpy.partition)", t, 4 * n)


@pytest.mark.parametrize("n", SIZES)
def test_topk_indexes(benchmark, n):
    # What an algorithm needs: the sorted indexes of the exact top-k of |x|.
    x, _ = _data(n, 1)
    k = max(1, int(DENSITY * n))
    t = _time(lambda: kernels.topk_indexes(x, k, use_abs=True))
    idx = kernels.topk_indexes(x, k, use_abs=True)
    ref = torch.topk(x.abs(), k).indices.sort().values
    assert torch.equal(idx, ref) or torch.equal(x.abs()[idx].sort().values, x.abs()[ref].sort().values)
    _record(benchmark, n, f"exact top-k indexes ({choose(x)})", t, 4 * n)


@pytest.mark.parametrize("n", SIZES)
def test_topk(benchmark, n):
    x, _ = _data(n, 1)
    k = max(1, int(DENSITY * n))
    t = _time(lambda: torch.topk(x.abs(), k))
    _record(benchmark, n, "torch.topk(abs(x), k)", t, 4 * n)


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("kind", ["gaussian", "student_t", "drifting"])
def test_estimated_threshold(benchmark, n, kind):
    gen = torch.Generator().manual_seed(2)
    if kind == "gaussian":
        x = torch.randn(n, generator=gen)
    elif kind == "student_t":
        torch.manual_seed(2)
        x = torch.distributions.StudentT(torch.tensor(2.5)).sample((n,))
    else:
        x = torch.randn(n, generator=gen) * torch.linspace(0.05, 3.0, n)
    x = x.to(DEV)
    k = max(1, int(DENSITY * n))
    t = _time(lambda: kernels.estimate_threshold(x, k))
    th = kernels.estimate_threshold(x, k)
    err = int((x.abs() >= th).sum()) / k - 1
    benchmark.extra_info["count_error"] = err
    assert abs(err) <= 0.05
    _record(benchmark, n, f"estimated threshold, {kind} (count error {err:+.2%})", t, 4 * n)


def pytest_terminal_summary_table() -> str:
    """The table printed after the run (also used by the session fixture)."""
    lines = [f"{'n':>11}  {'operation':<58} {'time ms':>9} {'Melem/s':>9} {'GB/s':>7}  ratio"]
    for n in SIZES:
        base = {name: s for (m, name), (s, _) in RESULTS.items() if m == n}
        add = base.get("yardstick torch.add(r, g, out=r)")
        chain = base.get("unfused torch chain")
        topk = base.get("torch.topk(abs(x), k)")
        for (m, name), (s, nb) in RESULTS.items():
            if m != n:
                continue
            ratio = ""
            if name.startswith("fused") and add and chain:
                ratio = f"{s / add:.2f}x the add, {chain / s:.1f}x faster than the chain"
            elif ("threshold" in name or "top-k indexes" in name) and topk:
                ratio = f"{topk / s:.1f}x faster than torch.topk"
            lines.append(f"{n:>11}  {name:<58} {1e3 * s:>9.2f} {n / s / 1e6:>9.0f} {nb / s / 1e9:>7.2f}  {ratio}")
    return "\n".join(lines)


@pytest.fixture(scope="module", autouse=True)
def _table():
    yield
    if RESULTS:
        print(f"\nsparsecomm kernels on {DEV.type}, density {DENSITY}, float32\n" + pytest_terminal_summary_table())
