"""One rank of ``run.sh P RATE PYTHON sched``: a training step under each communication schedule.

Model ``MODEL`` (environment): ``deep`` (default), 12 x Linear(1024, 1024) + ReLU and a
classifier, 12.6M parameters in 26 tensors, batch 64: many layers, so there is
backward computation to overlap with; or ``mlp``, issue 11's 5000 -> 5000 -> 10.
For each configuration: 6 untimed steps (MG-WFBP profiles over 5 and plans),
then ``ROUNDS`` timed steps, each after a barrier. Rank 0 prints one JSON line:
the slowest rank's median seconds per step (Pipe-SGD: its step waits for the previous
step's allreduce and applies it, so "wait" there is what did not overlap), and for MG-WFBP the planner's
predicted step (forward + the plan's communication end + optimizer step, the
first and last measured in the no-communication step) and its plan.
"""

from __future__ import annotations

import json
import os
import statistics
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from sparsecomm.schedules import MGWFBP, WFBP, DeAR, PipeSGD, SyncEASGD, plan_time

TRIALS = int(os.environ.get("DEAR_TRIALS", "10"))  # DeAR's fusion tuning: trials of 4 steps


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    if os.environ.get("MODEL", "deep") == "mlp":
        return torch.nn.Sequential(torch.nn.Linear(5000, 5000), torch.nn.ReLU(), torch.nn.Linear(5000, 10))
    layers: list[torch.nn.Module] = []
    for _ in range(12):
        layers += [torch.nn.Linear(1024, 1024), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(1024, 10))


def main() -> None:
    torch.set_num_threads(1)
    rounds = int(os.environ.get("ROUNDS", "8"))
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    gen = torch.Generator().manual_seed(rank)
    width = 5000 if os.environ.get("MODEL", "deep") == "mlp" else 1024
    x, y = torch.randn(64, width, generator=gen), torch.randint(0, 10, (64,), generator=gen)
    configs = [("none", None, None), ("ddp default", "ddp", None)]
    for algo, kw in (("dense", {"algorithm": "dense", "density": 1.0}),
                     ("oktopk 1%", {"algorithm": "oktopk", "density": 0.01})):
        for sname, cls in (("wfbp", WFBP), ("synceasgd", SyncEASGD), ("mgwfbp", MGWFBP), ("dear", DeAR),
                           ("pipesgd", PipeSGD)):
            configs.append((f"{sname} {algo}", cls, kw))
        configs.append((f"dear auto {algo}", DeAR, {**kw, "buffer_bytes": "auto", "tune_trials": TRIALS,
                                                    "tune_steps": 4}))
    res: dict = {}
    phases = {}
    for name, cls, kw in configs:
        model = _model()
        if cls == "ddp":
            model = DDP(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        sched = cls(model, opt, **kw) if cls not in (None, "ddp") else None

        def step() -> dict:
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=False)
            loss = torch.nn.functional.cross_entropy(model(x), y)
            t1 = time.perf_counter()
            loss.backward()
            t2 = time.perf_counter()
            if isinstance(sched, PipeSGD):  # submits this step, waits for and applies the last
                sched.step()
                t3 = time.perf_counter()
            elif isinstance(sched, DeAR):  # waits for the first phases; updates run in the next forward
                sched.step()
                t3 = time.perf_counter()
            else:
                if sched is not None:
                    sched.synchronize()
                t3 = time.perf_counter()
                opt.step()
            return {"forward": t1 - t0, "backward": t2 - t1, "wait": t3 - t2, "update": time.perf_counter() - t3}

        for _ in range(6 + (TRIALS * 4 if name.startswith("dear auto") else 0)):  # tuning first
            step()
        ts, parts = [], []
        for _ in range(rounds):
            dist.barrier()
            t0 = time.perf_counter()
            parts.append(step())
            ts.append(time.perf_counter() - t0)
        t = torch.tensor([statistics.median(ts)], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        res[name] = float(t)
        phases[name] = {k: statistics.median(p[k] for p in parts) for k in parts[0]}
        if isinstance(sched, DeAR) and sched.trials:
            res[f"{name} chosen MB"] = sched.buffer_bytes / 2**20
        if isinstance(sched, MGWFBP) and sched.backward_times is not None:
            comm_end = plan_time(sched.groups, sched.backward_times, sched.sizes, sched.a, sched.b)
            none = phases["none"]
            res[f"{name} predicted"] = none["forward"] + comm_end + none["update"]
            res[f"{name} groups"] = len(sched.groups)
            res[f"{name} a,b"] = [sched.a, sched.b]
        if sched is not None:
            sched.close()
    if rank == 0:
        print(json.dumps({"model": os.environ.get("MODEL", "deep"), "step_s": res, "phases_rank0": phases}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
