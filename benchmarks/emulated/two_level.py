"""Two-level Ok-Topk against flat Ok-Topk and dense on an emulated cluster of nodes.

    sparsecomm emulate --ranks 4 --ranks-per-node 2 --rate 1gbit -- python benchmarks/emulated/two_level.py

For every size (``SIZES``, default 1M and 10M float32 entries a rank) and algorithm (dense,
Ok-Topk, two-level Ok-Topk, which finds its nodes from ``LOCAL_WORLD_SIZE``): 10 untimed
warm-up calls on a drifting gradient (x = 0.9 x + 0.1 randn), then ``ROUNDS`` rounds timing
one call of each on the round's gradient, each after a barrier; the slowest rank's median.
Density 1%, error feedback (dense: none). Beside the times, the busiest rank's bytes a call
received within its node (the ``node_*`` phases; over the namespace's loopback) and
across the node's shaped port (the rest; flat algorithms count all their bytes there,
including those to the rank of their own node). Rank 0 prints a JSON line per size and a table.
"""

from __future__ import annotations

import json
import os
import statistics
import time

import torch
import torch.distributed as dist

import sparsecomm

ALGORITHMS = ("dense", "oktopk", "oktopk2l")


def main() -> None:
    torch.set_num_threads(1)
    sizes = [int(s) for s in os.environ.get("SIZES", "1000000,10000000").split(",")]
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
                  for name in ALGORITHMS}
        for st in states.values():
            for _ in range(warm):
                sparsecomm.allreduce(drift(), state=st, out=out)
        ts: dict = {name: [] for name in states}
        within: dict = {name: 0 for name in states}
        across: dict = {name: 0 for name in states}
        for _ in range(rounds):
            g = drift()
            for name, st in states.items():
                dist.barrier()
                t0 = time.perf_counter()
                sparsecomm.allreduce(g, state=st, out=out)
                ts[name].append(time.perf_counter() - t0)
                for phase, p in st.last.phases.items():
                    if phase.startswith("node_"):
                        within[name] += p.bytes_received / rounds
                    else:
                        across[name] += p.bytes_received / rounds
        stats = torch.tensor([[statistics.median(ts[a]), within[a], across[a]] for a in states], dtype=torch.float64)
        dist.all_reduce(stats, op=dist.ReduceOp.MAX)
        row = {"P": P, "n": n, "cluster": os.environ.get("SPARSECOMM_NETWORK", ""),
               "ranks_per_node": int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
               "ms": {a: round(stats[i, 0].item() * 1e3, 3) for i, a in enumerate(states)},
               "bytes_within_node": {a: int(stats[i, 1]) for i, a in enumerate(states)},
               "bytes_across_nodes": {a: int(stats[i, 2]) for i, a in enumerate(states)}}
        rows.append(row)
        if rank == 0:
            print(json.dumps(row), flush=True)
    if rank == 0:
        print("\n| n | " + " | ".join(f"{a} ms (kB in node / across)" for a in ALGORITHMS) + " |")
        print("|---|" + "---|" * len(ALGORITHMS))
        for r in rows:
            print(f"| {r['n']:,} | " + " | ".join(
                f"{r['ms'][a]:.1f} ({r['bytes_within_node'][a] / 1e3:,.0f} / {r['bytes_across_nodes'][a] / 1e3:,.0f})"
                for a in ALGORITHMS) + " |")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
