"""Local kernel benchmarks: fused select, exact and estimated thresholds, against torch.

    python -m pytest benchmarks/test_kernels.py -s                      # 1M and 25M
    SPARSECOMM_BENCH_SIZES=1000000,25000000,100000000 python -m pytest benchmarks/test_kernels.py -s

Runs on one process (no collective calls). Device: CUDA when available, else
CPU; the kernel path is the dispatcher's auto choice (``SPARSECOMM_KERNELS``
overrides), and ``SPARSECOMM_BENCH_BACKENDS=triton,cupy,torch`` times each
named path of the main operations side by side. Every timed result is checked
against torch in the same run, and a table of times, elements/s, GB/s and
ratios (measured in this run) is printed at the end, with the fused select's
bytes over the device's measured copy bandwidth (a copy of the same size,
bytes read plus written). Density 0.01; ``SPARSECOMM_BENCH_DTYPES`` picks the
gradient's dtypes (default float32; the residual is float32, as in a state).
Each time is pytest-benchmark's own measurement (pedantic, ``SPARSECOMM_BENCH_ROUNDS``
rounds, setup untimed, a device synchronisation inside the timed function): the
best round on CPU, the median on CUDA.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from sparsecomm import kernels
from sparsecomm.kernels.dispatch import OPS, available

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
SIZES = [int(s) for s in os.environ.get("SPARSECOMM_BENCH_SIZES", "1000000,25000000").split(",")]
DTYPES = [getattr(torch, d) for d in os.environ.get("SPARSECOMM_BENCH_DTYPES", "float32").split(",")]
BACKENDS = [b for b in os.environ.get("SPARSECOMM_BENCH_BACKENDS", "auto").split(",") if b]
DENSITY = 0.01
ROUNDS = int(os.environ.get("SPARSECOMM_BENCH_ROUNDS", "5"))
#: (n, dtype name, operation) -> (seconds, bytes moved)
RESULTS: dict[tuple[int, str, str], tuple[float, float]] = {}


def _sync() -> None:
    if DEV.type == "cuda":
        torch.cuda.synchronize()


def _time(benchmark, fn, setup=None) -> float:
    """Time ``fn`` through ``benchmark.pedantic`` (ROUNDS rounds after one warm-up) and return
    the best (CPU) or median (CUDA) seconds; ``setup`` runs untimed before each round.

    The timed function ends with a device synchronisation, so pytest-benchmark's
    statistics (and its JSON) are the kernels' real times.
    """
    def timed():
        fn()
        _sync()

    def untimed():
        if setup is not None:
            setup()
        _sync()

    benchmark.pedantic(timed, setup=untimed, rounds=ROUNDS, warmup_rounds=1, iterations=1)
    stats = benchmark.stats.stats
    return stats.median if DEV.type == "cuda" else stats.min


def _backend(backend: str, op: str, *args) -> str:
    """The path a ``backend`` parameter runs for ``op(*args)`` (skip the test where it cannot run here)."""
    if backend != "auto" and backend not in OPS[op].backends:
        pytest.skip(f"{op} has no {backend} path")
    if backend != "auto" and not available(backend, args[OPS[op].on].device):
        pytest.skip(f"{backend} cannot run on {args[OPS[op].on].device} here")
    name = OPS[op].choice(*args, backend=backend)
    return name if backend != "auto" else f"auto: {name}"


def _kw(backend: str) -> dict:
    return {} if backend == "auto" else {"backend": backend}


def _record(benchmark, n: int, dtype: torch.dtype, name: str, seconds: float, nbytes: float) -> None:
    RESULTS[(n, str(dtype).removeprefix("torch."), name)] = (seconds, nbytes)
    benchmark.extra_info.update(n=n, dtype=str(dtype), operation=name, seconds=seconds,
                                elements_per_s=n / seconds, gb_per_s=nbytes / seconds / 1e9)
    benchmark.extra_info["row"] = {"suite": "kernels", "operation": name, "n": n,
                                   "dtype": str(dtype).removeprefix("torch."), "time_ms": 1e3 * seconds,
                                   "gb_per_s": nbytes / seconds / 1e9, "device": str(DEV)}


def _data(n: int, dtype: torch.dtype = torch.float32, seed: int = 0):
    """(residual float32, gradient ``dtype``), drawn on the device (1e9 draws on a CPU take minutes)."""
    gen = torch.Generator(device=DEV).manual_seed(seed)
    r = torch.randn(n, generator=gen, device=DEV)
    g = torch.randn(n, generator=gen, device=DEV).mul_(0.1).to(dtype)
    return r, g


def _ids(params):
    return [f"n={n}" for n in params]


sizes = pytest.mark.parametrize("n", SIZES, ids=_ids(SIZES))
dtypes = pytest.mark.parametrize("dtype", DTYPES, ids=[str(d).removeprefix("torch.") for d in DTYPES])
backends = pytest.mark.parametrize("backend", BACKENDS)


@sizes
@dtypes
def test_yardstick_copy(benchmark, n, dtype):
    """The device's copy bandwidth at this size: bytes read plus written, the floor's unit."""
    src = torch.empty(3 * n, dtype=torch.float32, device=DEV).uniform_()
    dst = torch.empty_like(src)
    t = _time(benchmark, lambda: dst.copy_(src))
    _record(benchmark, n, dtype, "yardstick copy of 12n bytes", t, 2 * src.numel() * 4)


@sizes
@dtypes
@backends
def test_fused_select(benchmark, n, dtype, backend):
    r0, g = _data(n, dtype)
    k = max(1, int(DENSITY * n))
    th = kernels.kth_largest((r0 + g).abs(), k)
    cap = 2 * k
    r = r0.clone()
    path = _backend(backend, "ef_select", g, r, th, cap, 1.0, True, None, None)
    oi = torch.empty(cap, dtype=torch.int64, device=DEV)
    ov = torch.empty(cap, dtype=torch.float32, device=DEV)
    restore = lambda: r.copy_(r0)  # noqa: E731  untimed: every call sees the same input
    t = _time(benchmark, lambda: kernels.ef_select(g, r, th, cap, out_idx=oi, out_val=ov, **_kw(backend)), restore)
    # Check against the reference while we are here.
    restore()
    _, _, c = kernels.ef_select(g, r, th, cap, out_idx=oi, out_val=ov, **_kw(backend))
    ri = torch.nonzero((r0 + g).abs() >= th).flatten()
    assert c == ri.numel() and torch.equal(oi[:min(c, cap)], ri[:cap])
    # Floor: read g and r, write r, write the selected (int64, float32) records.
    nbytes = n * (g.element_size() + 8) + 12 * min(c, cap)
    _record(benchmark, n, dtype, f"fused select ({path})", t, nbytes)


@sizes
@dtypes
def test_yardstick_add(benchmark, n, dtype):
    r, g = _data(n, dtype)
    t = _time(benchmark, lambda: r.add_(g))
    _record(benchmark, n, dtype, "yardstick r.add_(g)", t, n * (g.element_size() + 8))


@sizes
@dtypes
def test_unfused_chain(benchmark, n, dtype):
    r0, g = _data(n, dtype)
    k = max(1, int(DENSITY * n))
    th = kernels.kth_largest((r0 + g).abs(), k)
    r = r0.clone()

    def chain():
        r.add_(g)
        idx = torch.nonzero(r.abs().ge(th)).flatten()
        val = r.gather(0, idx)
        r.index_fill_(0, idx, 0)
        return idx, val

    t = _time(benchmark, chain, lambda: r.copy_(r0))
    _record(benchmark, n, dtype, "unfused torch chain", t, n * (g.element_size() + 8))


@sizes
@dtypes
@backends
def test_exact_threshold(benchmark, n, dtype, backend):
    x, _ = _data(n, seed=1)
    mag = x.to(dtype).abs()
    k = max(1, int(DENSITY * n))
    path = _backend(backend, "kth_largest", mag, k, False)
    if path == "triton":  # the bound's misses (each costs the full radix select) over the timed calls
        from sparsecomm.kernels import triton_backend

        triton_backend.BOUNDED.update(calls=0, misses=0)
    t = _time(benchmark, lambda: kernels.kth_largest(mag, k, **_kw(backend)))
    assert kernels.kth_largest(mag, k, **_kw(backend)) == float(torch.topk(mag, k).values.min())
    if path == "triton" and triton_backend.BOUNDED["calls"]:
        path += f", bound missed {triton_backend.BOUNDED['misses']}/{triton_backend.BOUNDED['calls']}"
    _record(benchmark, n, dtype, f"exact threshold ({path})", t, n * mag.element_size())


@sizes
def test_numpy_partition(benchmark, n):
    if DEV.type != "cpu":
        pytest.skip("numpy partition is the CPU reference only")
    x, _ = _data(n, seed=1)
    k = max(1, int(DENSITY * n))
    mag = x.abs()
    t = _time(benchmark, lambda: kernels.kth_largest(mag, k, backend="torch"))
    _record(benchmark, n, torch.float32, "exact threshold (torch path: numpy.partition)", t, 4 * n)


@sizes
@dtypes
def test_topk_indexes(benchmark, n, dtype):
    # What an algorithm needs: the sorted indexes of the exact top-k of |x|.
    x, _ = _data(n, seed=1)
    x = x.to(dtype)
    k = max(1, int(DENSITY * n))
    t = _time(benchmark, lambda: kernels.topk_indexes(x, k, use_abs=True))
    idx = kernels.topk_indexes(x, k, use_abs=True)
    ref = torch.topk(x.abs(), k).indices.sort().values
    assert torch.equal(idx, ref) or torch.equal(x.abs()[idx].sort().values, x.abs()[ref].sort().values)
    _record(benchmark, n, dtype, "exact top-k indexes (auto)", t, n * x.element_size())


@sizes
@dtypes
def test_topk(benchmark, n, dtype):
    x, _ = _data(n, seed=1)
    x = x.to(dtype)
    k = max(1, int(DENSITY * n))
    t = _time(benchmark, lambda: torch.topk(x.abs(), k))
    _record(benchmark, n, dtype, "torch.topk(abs(x), k)", t, n * x.element_size())


@sizes
@dtypes
@backends
@pytest.mark.parametrize("kind", ["gaussian", "student_t", "drifting"])
def test_estimated_threshold(benchmark, n, dtype, backend, kind):
    gen = torch.Generator(device=DEV).manual_seed(2)
    if kind == "student_t":  # heavy tails: ratio of a normal to the root of a chi-square / 2.5
        z = torch.randn(n, generator=gen, device=DEV)
        chi2 = torch.distributions.Gamma(torch.tensor(1.25, device=DEV), torch.tensor(0.5, device=DEV)).sample((n,))
        x = z / (chi2 / 2.5).sqrt()
    else:
        x = torch.randn(n, generator=gen, device=DEV)
        if kind == "drifting":
            x.mul_(torch.linspace(0.05, 3.0, n, device=DEV))
    x = x.to(dtype)
    k = max(1, int(DENSITY * n))
    # Off the host the estimate counts with its own kernel (one read), on the host with count_above.
    path = (_backend(backend, "count_above", x, np.array([1.0]), 1) if x.device.type == "cpu"
            else _backend(backend, "count_on_device", x, torch.ones(1, device=x.device), 1))
    t = _time(benchmark, lambda: kernels.estimate_threshold(x, k, **_kw(backend)))
    th = kernels.estimate_threshold(x, k, **_kw(backend))
    err = int((x.abs() >= th).sum()) / k - 1
    benchmark.extra_info["count_error"] = err
    assert abs(err) <= 0.05
    _record(benchmark, n, dtype, f"estimated threshold ({path}), {kind} (count error {err:+.2%})", t,
            n * x.element_size())


def pytest_terminal_summary_table() -> str:
    """The table printed after the run (also used by the session fixture)."""
    lines = [f"{'n':>11} {'dtype':>9}  {'operation':<62} {'time ms':>9} {'Melem/s':>9} {'GB/s':>7}  ratio"]
    for n, dt in dict.fromkeys((m, d) for m, d, _ in RESULTS):
        base = {name: s for (m, d, name), (s, _) in RESULTS.items() if (m, d) == (n, dt)}
        add = base.get("yardstick r.add_(g)")
        chain = base.get("unfused torch chain")
        topk = base.get("torch.topk(abs(x), k)")
        copy = RESULTS.get((n, dt, "yardstick copy of 12n bytes"))
        copy_bw = copy[1] / copy[0] if copy else None
        for (m, d, name), (s, nb) in RESULTS.items():
            if (m, d) != (n, dt):
                continue
            ratio = ""
            if name.startswith("fused") and add and chain:
                ratio = f"{s / add:.2f}x the add, {chain / s:.1f}x faster than the chain"
                if copy_bw:
                    ratio += f", {100 * nb / s / copy_bw:.0f}% of copy bandwidth"
            elif ("threshold" in name or "top-k indexes" in name) and topk:
                ratio = f"{topk / s:.1f}x faster than torch.topk"
            elif name == "yardstick r.add_(g)" and copy_bw:
                ratio = f"{100 * nb / s / copy_bw:.0f}% of copy bandwidth"
            lines.append(f"{n:>11} {d:>9}  {name:<62} {1e3 * s:>9.3f} {n / s / 1e6:>9.0f} "
                         f"{nb / s / 1e9:>7.1f}  {ratio}")
    return "\n".join(lines)



@pytest.fixture(scope="module", autouse=True)
def _one_process(comm):
    """Time on one process only: ranks running these at once on shared cores (or one GPU)
    would time each other. Every rank skips alike (the world size is the same everywhere)."""
    if comm.size > 1:
        pytest.skip(f"local kernels: run with one process (this world has {comm.size} ranks)")


@pytest.fixture(scope="module", autouse=True)
def _table(comm):  # comm: the run's environment goes into the JSON
    yield
    if RESULTS:
        name = torch.cuda.get_device_name() if DEV.type == "cuda" else "cpu"
        print(f"\nsparsecomm kernels on {name}, density {DENSITY}\n" + pytest_terminal_summary_table())
