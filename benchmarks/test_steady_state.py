"""A steady-state call at world size 1: time over ``torch.add(r, g, out=r)``, as users call it.

Every row is one (algorithm, call, threads, workload) in one run:

* call ``out``: the result written into ``out=``; ``plain``: ``allreduce(g, state=s)``
  with no ``out=``, in the usual loop (the previous result alive through the call);
* threads ``1``, or ``default`` (torch's own setting, what a user gets);
* workload ``drift`` (x = 0.9 x + 0.1 randn each step, error feedback on, density 1%) or
  ``repeat`` (noise that repeats every 4 calls, the same batches every epoch: the residual
  grows steadily instead of wandering).

After ``WARMUP`` calls (thresholds and residuals settle), every round makes the next
gradient untimed (pedantic ``setup``, after one add of the same size on its own timer)
and times one call. Reported per row: median time, time / the median of its own adds,
time / the ``out=`` row of the same (algorithm, threads, workload), minor page faults
per call (``getrusage``: a fresh n-element tensor costs n/1024 of them), the fraction of
calls that corrected or re-selected exactly, and the selected count over k (mean, worst).

On CUDA (``SPARSECOMM_STEADY_DEVICE=cuda``) every timed call ends with a
device synchronisation, and one more call per algorithm is profiled: the
kernels it launches, its device memory copies, and each host synchronisation
it makes (``torch.cuda.set_sync_debug_mode``), listed by the line that made it,
since each is a stall a user pays per bucket.

    python -m pytest benchmarks/test_steady_state.py --benchmark-json steady.json
    SPARSECOMM_STEADY_SIZES=25000000,100000000 python -m pytest benchmarks/test_steady_state.py
    SPARSECOMM_STEADY_CALLS=plain SPARSECOMM_STEADY_THREADS=default python -m pytest benchmarks/test_steady_state.py
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
from sparsecomm.tools.audit import cuda_crosscheck

from conftest import STEADY

SIZES = [int(s) for s in os.environ.get("SPARSECOMM_STEADY_SIZES", "25000000").split(",")]
CALLS = os.environ.get("SPARSECOMM_STEADY_CALLS", "out,plain").split(",")
THREADS = os.environ.get("SPARSECOMM_STEADY_THREADS", "1,default").split(",")
WORKLOADS = os.environ.get("SPARSECOMM_STEADY_WORKLOADS", "drift,repeat").split(",")
ALGORITHMS = os.environ.get("SPARSECOMM_STEADY_ALGORITHMS", ",".join(sparsecomm.algorithms())).split(",")
_DEFAULT_THREADS = torch.get_num_threads()
DEV = torch.device(os.environ.get("SPARSECOMM_STEADY_DEVICE", "cpu"))
ROUNDS, WARMUP, DENSITY = int(os.environ.get("SPARSECOMM_BENCH_ROUNDS", "20")), 20, 0.01
EXACT_EVENTS = ("local_corrected", "local_recomputed", "local_overflowed", "local_estimate_fallback",
                "local_reselected")


def _minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _sync() -> None:
    if DEV.type == "cuda":
        torch.cuda.synchronize()


@pytest.fixture(scope="module", autouse=True)
def _one_process(comm):
    """Time on one process only: ranks running these at once on shared cores (or one GPU)
    would time each other. Every rank skips alike (the world size is the same everywhere)."""
    if comm.size > 1:
        pytest.skip(f"the world-size-1 floor: run with one process (this world has {comm.size} ranks)")


@pytest.fixture(params=THREADS)
def threads(request):
    """Threads for the test: 1, or torch's default (what a user gets)."""
    torch.set_num_threads(1 if request.param == "1" else _DEFAULT_THREADS)
    yield request.param
    torch.set_num_threads(_DEFAULT_THREADS)


@pytest.mark.parametrize("n", SIZES, ids=lambda n: f"n={n}")
def test_add(benchmark, n, threads):
    """The yardstick: one pass reading g and r and writing r."""
    r, g = torch.zeros(n, device=DEV), torch.randn(n, device=DEV)

    def add():
        torch.add(r, g, out=r)
        _sync()

    benchmark.pedantic(add, rounds=ROUNDS, warmup_rounds=2)
    STEADY.append({"algorithm": "add", "n": n, "threads": threads, "ms": benchmark.stats.stats.median * 1e3})


def _workload(name: str, n: int):
    """A function that makes the next gradient in place and returns it."""
    gen = torch.Generator(device=DEV).manual_seed(0)
    x = torch.randn(n, generator=gen, device=DEV)
    if name == "repeat":
        patterns, t = [torch.randn(n, generator=gen, device=DEV) for _ in range(3)] + [x], [0]

        def repeat():
            t[0] += 1
            return x.copy_(patterns[t[0] % 4])

        return repeat
    noise = torch.empty(n, device=DEV)
    return lambda: x.mul_(0.9).add_(torch.randn(n, generator=gen, out=noise), alpha=0.1)


@pytest.mark.parametrize("workload", WORKLOADS)
@pytest.mark.parametrize("call", CALLS)
@pytest.mark.parametrize("n", SIZES, ids=lambda n: f"n={n}")
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_steady_state_call(benchmark, algorithm, n, call, threads, workload):
    next_gradient = _workload(workload, n)
    into = torch.empty(n, device=DEV) if call == "out" else None
    state = sparsecomm.registry.get(algorithm).state_class(DENSITY, error_feedback=True)
    k = topk_count(DENSITY, n) if algorithm != "dense" else n
    seen = {"faults": [], "selected": [], "exact": 0, "calls": 0}
    held = [None]  # the usual loop: `out = allreduce(g, state=s)` keeps the last result alive

    def drift():
        g = next_gradient()
        _sync()
        return (g,), {}

    def reduce(g):
        held[0] = sparsecomm.allreduce(g, state=state, out=into)

    for _ in range(WARMUP):
        reduce(drift()[0][0])

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

    def timed(g):
        f0 = _minor_faults()
        reduce(g)
        _sync()
        seen["faults"].append(_minor_faults() - f0)
        seen["selected"].append(state.last.local_selected / k)
        seen["exact"] += any(e in state.last.events for e in EXACT_EVENTS)
        seen["calls"] += 1

    t0 = time.perf_counter()
    benchmark.pedantic(timed, setup=add_then_drift, rounds=ROUNDS, warmup_rounds=0, iterations=1)
    row = {"algorithm": algorithm, "n": n, "call": call, "threads": threads, "workload": workload,
           "ms": benchmark.stats.stats.median * 1e3,
           "add_ms": statistics.median(adds) * 1e3,
           "faults_per_call": statistics.median(seen["faults"]),
           "exact_or_corrected": seen["exact"] / seen["calls"],
           "selected_over_k_mean": statistics.mean(seen["selected"]),
           "selected_over_k_worst": max(seen["selected"], key=lambda s: abs(s - 1)),
           "wall_s": time.perf_counter() - t0}
    if DEV.type == "cuda":
        row.update(cuda_crosscheck(lambda: reduce(drift()[0][0])))
    benchmark.extra_info.update(row)
    STEADY.append(row)
