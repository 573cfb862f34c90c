"""The schedules suite: one training step under each communication schedule.

Configurations: "none" (no communication), DDP's default, and each schedule
(WFBP, SyncEASGD, MG-WFBP, DeAR, Pipe-SGD) with dense and with Ok-Topk 1%.
A step is forward, backward and the schedule's step (Pipe-SGD: wait for and
apply the previous step's gradient; DeAR: wait for the first phases, updates
run in the next forward; the others: wait for every group, then the
optimizer). Warm-up rounds cover MG-WFBP's profiling and plan. The schedules
run over sparsecomm's communicator (MPI, torch.distributed or the default);
only "ddp default" needs a torch.distributed group. Model:
``SPARSECOMM_BENCH_MODEL`` (default deep; also mlp, cnn and small, see steps.py);
``SPARSECOMM_BENCH_SCHEDULES`` narrows the schedules (comma-separated);
``SPARSECOMM_BENCH_WARMUP`` untimed steps at least (default 20).
MG-WFBP's row records its plan: groups, a, b, the profiled backward and the
plan's end of the last allreduce, from which the summary predicts the step.
"""

from __future__ import annotations

import os

import pytest
import torch

from sparsecomm.tools.bench import bench_device
from sparsecomm.schedules import SCHEDULES, plan_time

from steps import batches, model, time_steps

CHOSEN = [s for s in os.environ.get("SPARSECOMM_BENCH_SCHEDULES", ",".join(SCHEDULES)).split(",") if s]
ALGORITHMS = {"dense": {"algorithm": "dense", "density": 1.0}, "oktopk 1%": {"algorithm": "oktopk", "density": 0.01}}
#: Untimed steps at least (``SPARSECOMM_BENCH_WARMUP``): the steady state, not error feedback's build-up.
WARMUP = int(os.environ.get("SPARSECOMM_BENCH_WARMUP", "20"))
CONFIGS = ["none", "ddp default"] + [f"{s} {a}" for a in ALGORITHMS for s in CHOSEN]


@pytest.mark.parametrize("config", CONFIGS)
def test_schedule_step(benchmark, comm, request, config):
    device = bench_device(comm)
    net = model("deep").to(device)
    if config == "ddp default":
        from torch.nn.parallel import DistributedDataParallel as DDP

        net = DDP(net, process_group=request.getfixturevalue("torch_group"),
                  device_ids=[device.index] if device.type == "cuda" else None)
    opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    sched, name = None, config.split(" ", 1)[0]
    if config not in ("none", "ddp default"):
        algo = config.split(" ", 1)[1]
        sched = SCHEDULES[name](net, opt, comm=comm, **ALGORITHMS[algo])
    data = batches(net, comm.rank, device)

    def step() -> None:
        x, y = data()
        opt.zero_grad(set_to_none=False)
        torch.nn.functional.cross_entropy(net(x), y).backward()
        if sched is not None:
            sched.step()  # the Schedule interface: reduce and update
        else:
            opt.step()

    try:
        # MG-WFBP profiles (6 steps), then measures its plan against one group (6 steps each);
        # Ok-Topk's thresholds and residuals settle over ~20 calls.
        warmup = max(20 if name == "mgwfbp" else 6, WARMUP)
        row = time_steps(benchmark, comm, "schedules", config, step, warmup=warmup, device=device)
        if name == "mgwfbp" and sched.backward_times is not None:  # the plan it made
            row.update(groups=len(sched.groups), a=sched.a, b=sched.b, backward_ms=1e3 * sum(sched.backward_times),
                       trials=[(len(g), 1e3 * t) for g, t in sched.trials],
                       planned_comm_ms=1e3 * plan_time(sched.groups, sched.backward_times, sched.sizes,
                                                       sched.a, sched.b))
    finally:
        if sched is not None:
            sched.close()
