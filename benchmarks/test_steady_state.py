"""A steady-state call at world size 1, one thread: time over ``torch.add(r, g, out=r)``.

The workload of issue 11: a slowly drifting gradient (``x = 0.9 x + 0.1 randn``
each step), error feedback on, density 1%, the result written into ``out=``.
After ``WARMUP`` calls (thresholds and residuals settle), every round drifts
the gradient untimed (pedantic ``setup``, after one add of the same size on
its own timer) and times one call. Reported per
algorithm, all from the same run: median time, time / the median of its own
adds (the add test's row is the same yardstick alone), minor page faults
per call (``getrusage``: a fresh n-element tensor costs n/1024 of them), the
fraction of calls that corrected or re-selected exactly, and the selected
count over k (mean, worst).

On CUDA (``SPARSECOMM_STEADY_DEVICE=cuda``) every timed call ends with a
device synchronisation, and one more call per algorithm is profiled: the
kernels it launches, its device memory copies, and each host synchronisation
it makes (``torch.cuda.set_sync_debug_mode``), listed by the line that made it,
since each is a stall a user pays per bucket.

    python -m pytest benchmarks/test_steady_state.py --benchmark-json steady.json
    SPARSECOMM_STEADY_SIZES=25000000,100000000 python -m pytest benchmarks/test_steady_state.py
    SPARSECOMM_STEADY_DEVICE=cuda python -m pytest benchmarks/test_steady_state.py -s
"""

from __future__ import annotations

import os
import resource
import statistics
import time

import pytest
import torch

import sparsecomm
from sparsecomm.state import topk_count

from conftest import STEADY

SIZES = [int(s) for s in os.environ.get("SPARSECOMM_STEADY_SIZES", "25000000").split(",")]
DEV = torch.device(os.environ.get("SPARSECOMM_STEADY_DEVICE", "cpu"))
ROUNDS, WARMUP, DENSITY = int(os.environ.get("SPARSECOMM_BENCH_ROUNDS", "20")), 20, 0.01
EXACT_EVENTS = ("local_corrected", "local_recomputed", "local_overflowed", "local_estimate_fallback")


def _minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _sync() -> None:
    if DEV.type == "cuda":
        torch.cuda.synchronize()


def _profile_call(fn) -> dict:
    """Kernels, device copies and host synchronisations of one ``fn()`` on CUDA."""
    import warnings
    from collections import Counter

    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    _sync()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        _sync()
    device_events = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    copies = sum(e.name.startswith(("Memcpy", "Memset")) for e in device_events)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    sites = Counter(f"{os.path.basename(w.filename)}:{w.lineno}" for w in caught
                    if "synchronizing" in str(w.message))
    return {"kernels": len(device_events) - copies, "copies": copies, "syncs": sum(sites.values()),
            "sync_sites": dict(sites)}



@pytest.fixture(scope="module", autouse=True)
def _one_process(comm):
    """Time on one process only: ranks running these at once on shared cores (or one GPU)
    would time each other. Every rank skips alike (the world size is the same everywhere)."""
    if comm.size > 1:
        pytest.skip(f"the world-size-1 floor: run with one process (this world has {comm.size} ranks)")


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("n", SIZES, ids=lambda n: f"n={n}")
def test_add(benchmark, n):
    """The yardstick: one pass reading g and r and writing r."""
    r, g = torch.zeros(n, device=DEV), torch.randn(n, device=DEV)

    def add():
        torch.add(r, g, out=r)
        _sync()

    benchmark.pedantic(add, rounds=ROUNDS, warmup_rounds=2)
    STEADY.append({"algorithm": "add", "n": n, "ms": benchmark.stats.stats.median * 1e3})


@pytest.mark.parametrize("n", SIZES, ids=lambda n: f"n={n}")
@pytest.mark.parametrize("algorithm", sparsecomm.algorithms())
def test_steady_state_call(benchmark, algorithm, n):
    gen = torch.Generator(device=DEV).manual_seed(0)
    x = torch.randn(n, generator=gen, device=DEV)
    noise = torch.empty(n, device=DEV)
    out = torch.empty(n, device=DEV)
    state = sparsecomm.registry.get(algorithm).state_class(DENSITY, error_feedback=True)
    k = topk_count(DENSITY, n) if algorithm != "dense" else n
    seen = {"faults": [], "selected": [], "exact": 0, "calls": 0}

    def drift():
        x.mul_(0.9).add_(torch.randn(n, generator=gen, out=noise), alpha=0.1)
        _sync()
        return (x,), {}

    for _ in range(WARMUP):
        sparsecomm.allreduce(drift()[0][0], state=state, out=out)

    add_r, add_g, adds = torch.zeros(n, device=DEV), torch.randn(n, device=DEV), []
    torch.add(add_r, add_g, out=add_r)  # its pages touched before the first timed add

    def add_then_drift():
        # The yardstick, timed next to every call (untimed by the benchmark, before the drift
        # that writes the call's gradient): on a shared machine the add drifts by 20% over a
        # run, so an add timed minutes earlier does not give this run's ratio.
        t0 = time.perf_counter()
        torch.add(add_r, add_g, out=add_r)
        _sync()
        adds.append(time.perf_counter() - t0)
        return drift()

    def call(g):
        f0 = _minor_faults()
        sparsecomm.allreduce(g, state=state, out=out)
        _sync()
        seen["faults"].append(_minor_faults() - f0)
        seen["selected"].append(state.last.local_selected / k)
        seen["exact"] += any(e in state.last.events for e in EXACT_EVENTS)
        seen["calls"] += 1

    t0 = time.perf_counter()
    benchmark.pedantic(call, setup=add_then_drift, rounds=ROUNDS, warmup_rounds=0, iterations=1)
    row = {"algorithm": algorithm, "n": n, "ms": benchmark.stats.stats.median * 1e3,
           "add_ms": statistics.median(adds) * 1e3,
           "faults_per_call": statistics.median(seen["faults"]),
           "exact_or_corrected": seen["exact"] / seen["calls"],
           "selected_over_k_mean": statistics.mean(seen["selected"]),
           "selected_over_k_worst": max(seen["selected"], key=lambda s: abs(s - 1)),
           "wall_s": time.perf_counter() - t0}
    if DEV.type == "cuda":
        row.update(_profile_call(lambda: sparsecomm.allreduce(drift()[0][0], state=state, out=out)))
    benchmark.extra_info.update(row)
    STEADY.append(row)
