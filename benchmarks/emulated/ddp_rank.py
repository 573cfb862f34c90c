"""One rank of ``run.sh P RATE PYTHON ddp``: a DDP training step with each communication hook.

A 25M-parameter MLP (5000 -> 5000 -> 10), batch 64, SGD. For each hook: 5
untimed steps (warm-up, DDP's bucket rebuild), then ``ROUNDS`` timed steps
(forward, backward with the hook, optimizer step), each after a barrier.
"none" is the step without communication (``no_sync``), the floor every hook
is compared with. Rank 0 prints one JSON line: the slowest rank's median
seconds per step.
"""

from __future__ import annotations

import json
import os
import statistics
import time

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel as DDP

from sparsecomm.hooks import SparseHookState, sparse_allreduce_hook


def _hooks():
    yield "none", None
    yield "ddp default", None
    yield "fp16 hook", lambda m: m.register_comm_hook(None, default_hooks.fp16_compress_hook)
    yield "powersgd rank 1", lambda m: m.register_comm_hook(
        powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=1,
                                    start_powerSGD_iter=2), powerSGD_hook.powerSGD_hook)
    for name, kw in (("sparsecomm oktopk 1%", {"algorithm": "oktopk", "density": 0.01}),
                     ("sparsecomm oktopk 1% overlap", {"algorithm": "oktopk", "density": 0.01,
                                                       "overlap": True}),
                     ("sparsecomm dense q8", {"algorithm": "dense", "compressor": "q8"})):
        yield name, (lambda kw: lambda m: m.register_comm_hook(
            SparseHookState(m, warmup_steps=0, **kw), sparse_allreduce_hook))(kw)


def main() -> None:
    torch.set_num_threads(1)
    rounds = int(os.environ.get("ROUNDS", "8"))
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    gen = torch.Generator().manual_seed(rank)
    x, y = torch.randn(64, 5000, generator=gen), torch.randint(0, 10, (64,), generator=gen)
    res = {}
    for name, register in _hooks():
        torch.manual_seed(0)
        model = DDP(torch.nn.Sequential(torch.nn.Linear(5000, 5000), torch.nn.ReLU(),
                                        torch.nn.Linear(5000, 10)))
        if register is not None:
            register(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)

        def step() -> None:
            opt.zero_grad(set_to_none=False)
            if name == "none":
                with model.no_sync():
                    torch.nn.functional.cross_entropy(model(x), y).backward()
            else:
                torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()

        for _ in range(5):
            step()
        ts = []
        for _ in range(rounds):
            dist.barrier()
            t0 = time.perf_counter()
            step()
            ts.append(time.perf_counter() - t0)
        t = torch.tensor([statistics.median(ts)], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        res[name] = float(t)
    if rank == 0:
        print(json.dumps(res))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
