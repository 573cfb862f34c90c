"""What the step suites (test_ddp.py, test_schedules.py) share: models, data and the timing.

Models (``SPARSECOMM_BENCH_MODEL``): ``mlp``, issue 11's 5000 -> 5000 -> 10
(25M parameters, one big layer); ``deep``, 12 x Linear(1024, 1024) + ReLU and
a classifier (12.6M parameters in 26 tensors: backward to overlap with).
Batch 64 per rank, cross-entropy, seeded per rank.
"""

from __future__ import annotations

import os
import statistics
from typing import Callable

import torch

from conftest import STEPS

ROUNDS = int(os.environ.get("SPARSECOMM_BENCH_ROUNDS", "8"))
#: The name of the model the last ``model()`` built (recorded in each row).
_BUILT = {"name": ""}


def model(default: str) -> torch.nn.Module:
    """The suite's model, the same initial weights on every rank."""
    torch.manual_seed(0)
    name = _BUILT["name"] = os.environ.get("SPARSECOMM_BENCH_MODEL", default)
    if name == "mlp":
        return torch.nn.Sequential(torch.nn.Linear(5000, 5000), torch.nn.ReLU(), torch.nn.Linear(5000, 10))
    if name != "deep":
        raise ValueError(f"SPARSECOMM_BENCH_MODEL: unknown model {name!r} (mlp or deep)")
    layers: list[torch.nn.Module] = []
    for _ in range(12):
        layers += [torch.nn.Linear(1024, 1024), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(1024, 10))


def batch(net: torch.nn.Module, rank: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    width = next(m for m in net.modules() if isinstance(m, torch.nn.Linear)).in_features
    gen = torch.Generator().manual_seed(rank)
    return (torch.randn(64, width, generator=gen).to(device),
            torch.randint(0, 10, (64,), generator=gen).to(device))


def time_steps(benchmark, comm, suite: str, config: str, step: Callable[[], None], warmup: int,
               device: torch.device, **extra) -> dict:
    """Time ``step`` through ``benchmark.pedantic`` (barrier before each round), record the row."""
    def timed() -> None:
        step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    benchmark.pedantic(timed, setup=comm.barrier, rounds=ROUNDS, warmup_rounds=warmup, iterations=1)
    times = list(benchmark.stats.stats.data)
    t = float(comm.allreduce(torch.tensor([statistics.median(times)], dtype=torch.float64,
                                          device=comm.control_device), "max"))
    row = {"suite": suite, "config": config, "ranks": comm.size, "backend": comm.name,
           "model": _BUILT["name"], "time_ms": 1e3 * t, "calls": len(times),
           "times_s": times, **extra}
    benchmark.extra_info["row"] = row
    STEPS.append(row)
    return row
