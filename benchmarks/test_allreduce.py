"""The allreduce suite: every algorithm × sizes × densities × compressors, and a memory copy.

Each test times a :class:`sparsecomm.tools.bench.Workload` (the driver ``sparsecomm
bench`` uses) through ``benchmark.pedantic``: fixed rounds, a barrier and an
untimed check that all ranks agree before each, so pytest-benchmark's
statistics are the real per-call times. The row (slowest rank's median,
bytes, selected/k, phase breakdown) goes to ``extra_info["row"]``.

Environment (comma-separated): ``SPARSECOMM_BENCH_ALGORITHMS`` (default: all
registered), ``SPARSECOMM_BENCH_SIZES`` (default "4000000,25000000"),
``SPARSECOMM_BENCH_DENSITIES`` (default "0.01"), ``SPARSECOMM_BENCH_COMPRESSORS``
(default "none"; e.g. "none,fp16,q8"), ``SPARSECOMM_BENCH_KIND`` (synthetic
gradient, default "model"), ``SPARSECOMM_BENCH_ROUNDS`` (default 8, after 2
warm-up rounds).
"""

from __future__ import annotations

import os
from dataclasses import asdict

import pytest
import torch

import sparsecomm
from sparsecomm.tools.bench import Case, Row, Workload, bench_device

from conftest import ROWS


def _list(var: str, default: str) -> list[str]:
    return [s for s in os.environ.get(var, default).split(",") if s]


ALGORITHMS = _list("SPARSECOMM_BENCH_ALGORITHMS", ",".join(sparsecomm.algorithms()))
SIZES = [int(s) for s in _list("SPARSECOMM_BENCH_SIZES", "4000000,25000000")]
DENSITIES = [float(d) for d in _list("SPARSECOMM_BENCH_DENSITIES", "0.01")]
COMPRESSORS = _list("SPARSECOMM_BENCH_COMPRESSORS", "none")
KIND = os.environ.get("SPARSECOMM_BENCH_KIND", "model")
ROUNDS, WARMUP = int(os.environ.get("SPARSECOMM_BENCH_ROUNDS", "8")), 2


@pytest.mark.parametrize("n", SIZES, ids=lambda n: f"n={n}")
@pytest.mark.parametrize("density", DENSITIES, ids=lambda d: f"d={d}")
@pytest.mark.parametrize("compressor", COMPRESSORS)
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_allreduce(benchmark, comm, algorithm, compressor, density, n):
    work = Workload(comm, Case(algorithm, n, density, compressor, kind=KIND))
    benchmark.pedantic(work, setup=work.setup, rounds=ROUNDS, warmup_rounds=WARMUP, iterations=1)
    row = work.row(benchmark.stats.stats.data)
    benchmark.extra_info["row"] = asdict(row)
    ROWS.append(row)


@pytest.mark.parametrize("n", SIZES, ids=lambda n: f"n={n}")
def test_memory_copy(benchmark, comm, n):
    """The yardstick: copying the gradient's bytes once on this rank."""
    device = bench_device(comm)
    src = torch.randn(n, device=device)
    dst = torch.empty_like(src)

    def copy():
        dst.copy_(src)
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    benchmark.pedantic(copy, setup=comm.barrier, rounds=ROUNDS, warmup_rounds=WARMUP, iterations=1)
    t = benchmark.stats.stats.median
    row = Row("memcpy", "local", comm.size, n, 1.0, n * 4, t * 1e3, n * 4 / t / 1e9, float("nan"), 0.0,
              calls=ROUNDS, times_s=list(benchmark.stats.stats.data))
    benchmark.extra_info["row"] = asdict(row)
    ROWS.append(row)
