"""pytest-benchmark suite: Ok-Topk vs Dense (and a memory copy of the same bytes) on real ranks."""

from __future__ import annotations

import os
import statistics

import pytest
import torch

import sparsecomm
from sparsecomm.bench import Row, _check_identical
from sparsecomm.state import topk_count
from sparsecomm.synthetic import gradient

from conftest import ROWS

SIZES = [int(s) for s in os.environ.get("SPARSECOMM_BENCH_SIZES", "4000000,25000000").split(",")]
DENSITY = 0.01
ROUNDS, WARMUP = int(os.environ.get("SPARSECOMM_BENCH_ROUNDS", "8")), 2


def _device(comm) -> torch.device:
    """CUDA where this rank has a GPU the communicator takes (NCCL; gloo and MPI stage it)."""
    cuda = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % max(1, torch.cuda.device_count()))
    return cuda if torch.cuda.is_available() and comm.supports_device(cuda) else torch.device("cpu")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@pytest.mark.parametrize("n", SIZES, ids=lambda n: f"n={n}")
@pytest.mark.parametrize("algorithm", ["oktopk", "dense"])
def test_allreduce(benchmark, comm, algorithm, n):
    device = _device(comm)
    grads = [gradient(comm.rank, s, n).to(device) for s in range(4)]
    state = sparsecomm.registry.get(algorithm).state_class(DENSITY)
    calls = {"i": 0, "sent": [], "selected": []}

    def setup():
        comm.barrier()  # every round starts together; not timed
        g = grads[calls["i"] % len(grads)]
        calls["i"] += 1
        calls["before"] = comm.stats.bytes_sent
        return (g,), {}

    def run(g):
        out = sparsecomm.allreduce(g, state=state, comm=comm)
        _sync(device)
        calls["sent"].append(comm.stats.bytes_sent - calls["before"])
        calls["selected"].append(state.last.global_selected)
        return out

    out = benchmark.pedantic(run, setup=setup, rounds=ROUNDS, warmup_rounds=WARMUP, iterations=1)
    _check_identical(comm, out)
    # The slowest rank's median time is the collective's time.
    t = float(comm.allreduce(torch.tensor([benchmark.stats.stats.median], dtype=torch.float64,
                                          device=comm.control_device), "max"))
    sent = statistics.mean(calls["sent"][WARMUP:])
    size = n * 4
    algbw = size / t / 1e9
    P = comm.size
    benchmark.extra_info.update(bytes_sent_per_rank=sent, ranks=P, backend=comm.name,
                                selected_over_k=statistics.mean(calls["selected"]) / topk_count(DENSITY, n))
    ROWS.append(Row(algorithm, comm.name, P, n, DENSITY, size, t * 1e3, algbw,
                    algbw * 2 * (P - 1) / P if P > 1 else algbw, sent,
                    selected_over_k=benchmark.extra_info["selected_over_k"] if algorithm != "dense" else 1.0))


@pytest.mark.parametrize("n", SIZES, ids=lambda n: f"n={n}")
def test_memory_copy(benchmark, comm, n):
    """The yardstick: copying the gradient's bytes once on this rank."""
    device = _device(comm)
    g = gradient(comm.rank, 0, n).to(device)
    dst = torch.empty_like(g)

    def copy():
        dst.copy_(g)
        _sync(device)

    benchmark.pedantic(copy, rounds=ROUNDS, warmup_rounds=WARMUP, iterations=1)
    t = benchmark.stats.stats.median
    ROWS.append(Row("memcpy", "local", comm.size, n, 1.0, n * 4, t * 1e3, n * 4 / t / 1e9,
                    float("nan"), 0.0))
