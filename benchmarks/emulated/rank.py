"""The per-call workload on the emulated cluster: sparse vs dense, a drifting gradient.

    sparsecomm emulate --ranks 2 --rate 1gbit -- python benchmarks/emulated/rank.py

Its gradient drifts as ``x = 0.9 x + 0.1 randn`` (the allreduce suite's synthetic
gradient differs); docs/results.md section 4 is its table.
The suites under ``benchmarks/`` (``sparsecomm emulate ... -- python -m pytest
benchmarks/test_allreduce.py``, ``test_ddp.py``, ``test_schedules.py``) are the
benchmarks of the DDP step and of the schedules.

Every configuration but "plain" passes ``out=`` (a preallocated result); "oktopk 1% plain" is the
call as a user first writes it. Each configuration gets 20 untimed warm-up calls (thresholds and residuals
settle), then ``ROUNDS`` timed calls, each after a barrier; the slowest rank's
median is what a training step would wait for. Before each timed call a
``dist.all_reduce`` of the same gradient is timed too, so each configuration's
ratio to dense is one run's (the dense time drifts 5-10% over a run). Rank 0
prints JSON lines: times, those ratios, the last call's phases.
"""

from __future__ import annotations

import json
import os
import statistics
import time

import torch
import torch.distributed as dist

import sparsecomm

CONFIGS = {"oktopk 1%": {"algorithm": "oktopk"}, "oktopk 1% plain": {"algorithm": "oktopk", "plain": True},
           "dense": {"algorithm": "dense"},
           "dense q8": {"algorithm": "dense", "compressor": "q8"},
           "topka 1%": {"algorithm": "topka"}, "gtopk 1%": {"algorithm": "gtopk"}}
ONLY = [c for c in os.environ.get("CONFIGS", "").split(",") if c]  # e.g. CONFIGS="oktopk 1%,dense"


def main() -> None:
    torch.set_num_threads(1)
    n, rounds, warm = int(os.environ.get("N", "25000000")), int(os.environ.get("ROUNDS", "8")), 20
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    gen = torch.Generator().manual_seed(rank)
    x, noise, out, buf = torch.randn(n, generator=gen), torch.empty(n), torch.empty(n), torch.empty(n)

    def drift() -> torch.Tensor:  # the workload: x = 0.9 x + 0.1 randn
        return x.mul_(0.9).add_(torch.randn(n, generator=gen, out=noise), alpha=0.1)

    def dense(g: torch.Tensor) -> None:
        dist.all_reduce(buf.copy_(g))

    def timed(call, beside=None) -> tuple[float, float | None]:
        """Slowest rank's median of ``call``; with ``beside``, also of ``beside`` timed before
        each round (the dense yardstick next to the call, so the ratio is one run's)."""
        ts, bs = [], []
        for _ in range(rounds):
            g = drift()
            if beside is not None:
                dist.barrier()
                t0 = time.perf_counter()
                beside(g)
                bs.append(time.perf_counter() - t0)
            dist.barrier()
            t0 = time.perf_counter()
            call(g)
            ts.append(time.perf_counter() - t0)
        t = torch.tensor([statistics.median(ts), statistics.median(bs) if bs else 0.0], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t[0]), (float(t[1]) if bs else None)

    res = {"dense dist.all_reduce": timed(dense)[0]}
    ratios = {}
    phases = {}
    for name, kw in CONFIGS.items():
        if ONLY and name not in ONLY:
            continue
        st = sparsecomm.registry.get(kw["algorithm"]).state_class(0.01, error_feedback=True)
        # "plain": the call as a user first writes it, a new result tensor each call (no out=).
        extra = {k: v for k, v in kw.items() if k not in ("algorithm", "plain")}
        if not kw.get("plain"):
            extra["out"] = out
        for _ in range(warm):
            sparsecomm.allreduce(drift(), state=st, **extra)
        res[name], beside = timed(lambda g: sparsecomm.allreduce(g, state=st, **extra), dense)
        ratios[name] = round(res[name] / beside, 5)
        phases[name] = {p: round(s.seconds * 1e3, 1) for p, s in st.last.phases.items()}
    if rank == 0:
        print(json.dumps(res))
        print(json.dumps({"ratio to dist.all_reduce timed beside each round": ratios}))
        print(json.dumps({"last call's phases on rank 0, ms": phases}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
