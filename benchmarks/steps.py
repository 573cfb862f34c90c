"""What the step suites (test_ddp.py, test_schedules.py) share: models, data and the timing.

Models (``SPARSECOMM_BENCH_MODEL``): ``mlp``, the steady-state benchmark's 5000 -> 5000 -> 10
(25M parameters, one big layer); ``deep``, 12 x Linear(1024, 1024) + ReLU and
a classifier (12.6M parameters in 26 tensors: backward to overlap with);
``cnn``, a ResNet-18-like CNN at half width on 32 x 32 images (2.8M parameters
in 62 tensors, most of them small: what MG-WFBP's merging is for); ``small``, 256 -> 256 ->
256 -> 10 (135k parameters in 6 tensors), which checks a suite's code in seconds and measures
nothing worth keeping.
Each step takes the next of 32 batches made up front (``batches``). Batch 64
per rank (the CNN: 16 images), or ``SPARSECOMM_BENCH_BATCH``: the
knob that moves a model between communication-bound and compute-bound (DeAR
gains only where the allreduce takes longer than backward but not longer
than forward and backward together). Cross-entropy, seeded per rank.
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Callable

import torch

from conftest import STEPS

ROUNDS = int(os.environ.get("SPARSECOMM_BENCH_ROUNDS", "8"))
#: The name of the model the last ``model()`` built (recorded in each row).
_BUILT: dict = {"name": "", "batch": None}


def model(default: str) -> torch.nn.Module:
    """The suite's model, the same initial weights on every rank."""
    torch.manual_seed(0)
    name = _BUILT["name"] = os.environ.get("SPARSECOMM_BENCH_MODEL", default)
    if name == "mlp":
        return torch.nn.Sequential(torch.nn.Linear(5000, 5000), torch.nn.ReLU(), torch.nn.Linear(5000, 10))
    if name == "cnn":
        return _resnet(width=32)
    if name == "small":
        return torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256),
                                   torch.nn.ReLU(), torch.nn.Linear(256, 10))
    if name != "deep":
        raise ValueError(f"SPARSECOMM_BENCH_MODEL: unknown model {name!r} (mlp, deep, cnn or small)")
    layers: list[torch.nn.Module] = []
    for _ in range(12):
        layers += [torch.nn.Linear(1024, 1024), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(1024, 10))


class _Block(torch.nn.Module):
    """A ResNet basic block: two 3x3 convolutions with batch norm, and a shortcut."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.c1 = torch.nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.b1 = torch.nn.BatchNorm2d(cout)
        self.c2 = torch.nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.b2 = torch.nn.BatchNorm2d(cout)
        self.short = torch.nn.Sequential()
        if stride != 1 or cin != cout:
            self.short = torch.nn.Sequential(torch.nn.Conv2d(cin, cout, 1, stride, bias=False),
                                             torch.nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.b1(self.c1(x)))
        return torch.relu(self.b2(self.c2(y)) + self.short(x))


def _resnet(width: int) -> torch.nn.Module:
    layers: list[torch.nn.Module] = [torch.nn.Conv2d(3, width, 3, 1, 1, bias=False), torch.nn.BatchNorm2d(width),
                                     torch.nn.ReLU()]
    cin = width
    for stage, mult in enumerate((1, 2, 4, 8)):
        for i in range(2):
            layers.append(_Block(cin, width * mult, 2 if stage and not i else 1))
            cin = width * mult
    layers += [torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(cin, 10)]
    return torch.nn.Sequential(*layers)


def batches(net: torch.nn.Module, rank: int, device: torch.device) -> Callable[[], tuple[torch.Tensor, torch.Tensor]]:
    """The rank's next batch, cycling through ``SPARSECOMM_BENCH_BATCHES`` (default 32) made up front.

    A step on the same batch every time is not a training step: the model
    memorises it within the warm-up, the gradient shrinks call after call,
    and Ok-Topk's threshold, predicted from the last call, keeps overshooting
    (on the 25M MLP at P = 2 its local count fell below the bounds on 21 of
    45 calls, each re-estimated by a counting pass: 52 against 39 ms of
    communication-thread time a step). Random inputs and labels that change
    every step keep the gradient's scale as in training.
    """
    gen = torch.Generator().manual_seed(rank)
    size = os.environ.get("SPARSECOMM_BENCH_BATCH")
    count = int(os.environ.get("SPARSECOMM_BENCH_BATCHES", "32"))
    first = next(m for m in net.modules() if isinstance(m, (torch.nn.Linear, torch.nn.Conv2d)))
    if isinstance(first, torch.nn.Conv2d):
        n = _BUILT["batch"] = int(size or 16)
        shape: tuple[int, ...] = (n, 3, 32, 32)
    else:
        n = _BUILT["batch"] = int(size or 64)
        shape = (n, first.in_features)
    pool = [(torch.randn(shape, generator=gen).to(device), torch.randint(0, 10, (n,), generator=gen).to(device))
            for _ in range(count)]
    at = [0]

    def next_batch() -> tuple[torch.Tensor, torch.Tensor]:
        at[0] += 1
        return pool[(at[0] - 1) % count]

    return next_batch


def time_steps(benchmark, comm, suite: str, config: str, step: Callable[[], None], warmup: int,
               device: torch.device, beside: Callable[[], None] | None = None, **extra) -> dict:
    """Time ``step`` through ``benchmark.pedantic`` (barrier before each round), record the row.

    ``beside``: the same step without communication, timed on its own timer before every
    timed round (the benchmark's timer covers ``step`` only); its slowest rank's median is the
    row's ``none_ms``, the yardstick of its ``/none``. On a shared machine the step without
    communication drifted by 20% between runs (154 to 196 ms), so a ratio to a "none" row
    timed minutes earlier is not one run's ratio.
    """
    def timed() -> None:
        step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    nones: list[float] = []
    warmed = [0]  # rounds set up so far (pedantic sets up its warm-up rounds too)

    def setup() -> None:
        if beside is not None and warmed[0] >= warmup:
            comm.barrier()
            t0 = time.perf_counter()
            beside()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            nones.append(time.perf_counter() - t0)
        warmed[0] += 1
        comm.barrier()

    benchmark.pedantic(timed, setup=setup, rounds=ROUNDS, warmup_rounds=warmup, iterations=1)
    times = list(benchmark.stats.stats.data)
    t = float(comm.allreduce(torch.tensor([statistics.median(times)], dtype=torch.float64,
                                          device=comm.control_device), "max"))
    if nones:
        extra["none_ms"] = 1e3 * float(comm.allreduce(torch.tensor([statistics.median(nones)], dtype=torch.float64,
                                                                   device=comm.control_device), "max"))
    row = {"suite": suite, "config": config, "ranks": comm.size, "backend": comm.name,
           "model": _BUILT["name"], "batch": _BUILT["batch"], "time_ms": 1e3 * t, "calls": len(times),
           "times_s": times, **extra}
    benchmark.extra_info["row"] = row
    STEPS.append(row)
    return row
