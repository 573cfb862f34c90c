"""``algorithm="auto"`` against each fixed candidate, per size, on the emulated cluster.

    SPARSECOMM_AUTO_NETWORK=1gbe sparsecomm emulate --ranks 4 --rate 1gbit -- python benchmarks/emulated/auto_sizes.py

For every size (``SIZES``, default 10k, 100k, 1M, 10M float32 entries a rank) and every
configuration (dense, Ok-Topk, Ok-Topk 2-D, and auto: ``sparsecomm.auto_state``, which
models with ``$SPARSECOMM_AUTO_NETWORK``), 10 untimed warm-up calls on a drifting gradient
(x = 0.9 x + 0.1 randn), then ``ROUNDS`` rounds, each timing one call of every configuration
on the round's gradient, each call after a barrier; the slowest rank's median. Density 1%, error feedback. Rank 0 prints one JSON line per size and a
table last: each time, auto's choice, and auto's time over the best fixed one.
"""

from __future__ import annotations

import json
import os
import statistics
import time

import torch
import torch.distributed as dist

import sparsecomm

FIXED = ("dense", "oktopk", "oktopk2d")


def main() -> None:
    torch.set_num_threads(1)
    sizes = [int(s) for s in os.environ.get("SIZES", "10000,100000,1000000,10000000").split(",")]
    rounds, warm = int(os.environ.get("ROUNDS", "6")), 10
    dist.init_process_group("gloo")
    rank, P = dist.get_rank(), dist.get_world_size()
    rows = []
    for n in sizes:
        gen = torch.Generator().manual_seed(rank)
        x, noise, out = torch.randn(n, generator=gen), torch.empty(n), torch.empty(n)

        def drift() -> torch.Tensor:
            return x.mul_(0.9).add_(torch.randn(n, generator=gen, out=noise), alpha=0.1)

        states = {name: sparsecomm.registry.get(name).state_class(0.01, error_feedback=name != "dense")
                  for name in FIXED}
        states["auto"] = sparsecomm.auto_state(x, 0.01)
        for st in states.values():  # every configuration warm before any is timed
            for _ in range(warm):
                sparsecomm.allreduce(drift(), state=st, out=out)
        ts: dict = {name: [] for name in states}
        for _ in range(rounds):  # interleaved: a drift of the machine touches every configuration alike
            g = drift()
            for name, st in states.items():
                dist.barrier()
                t0 = time.perf_counter()
                sparsecomm.allreduce(g, state=st, out=out)
                ts[name].append(time.perf_counter() - t0)
        t = torch.tensor([statistics.median(ts[name]) for name in states], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        times = dict(zip(states, t.tolist()))
        best = min(FIXED, key=times.get)
        row = {"P": P, "n": n, "network": os.environ.get("SPARSECOMM_AUTO_NETWORK", "10gbe"),
               "cluster": os.environ.get("SPARSECOMM_NETWORK", ""),
               "ms": {k: round(v * 1e3, 3) for k, v in times.items()},
               "auto_chose": states["auto"].algorithm, "best": best, "auto_over_best": times["auto"] / times[best]}
        rows.append(row)
        if rank == 0:
            print(json.dumps(row), flush=True)
    if rank == 0:
        print(f"\n| n | {' | '.join(FIXED)} | auto | auto chose | best | auto / best |")
        print("|---|" + "---|" * (len(FIXED) + 4))
        for r in rows:
            cells = " | ".join(f"{r['ms'][k]:.2f}" for k in FIXED)
            print(f"| {r['n']:,} | {cells} | {r['ms']['auto']:.2f} | {r['auto_chose']} | {r['best']} | "
                  f"{r['auto_over_best']:.2f} |")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
