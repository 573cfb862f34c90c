"""Wall time of the simulated world at scale: one exact Ok-Topk call on P ranks.

One call with exact selection and new boundaries (tau = tau' = 1, no error feedback) on
Gaussian gradients of n entries a rank, density 1%, with the ``pizdaint`` network model:
the seconds the simulation takes on this machine, and the modelled communication time
of the slowest rank (which must not depend on how the simulator moves the bytes). Prints
a markdown table::

    python benchmarks/sim_scale.py --ranks 64 256 1024 4096 --n 100000
"""

from __future__ import annotations

import argparse
import time

import torch

import sparsecomm


def one_call(P: int, n: int, density: float) -> tuple[float, float, int]:
    """(wall seconds, modelled seconds of the slowest rank, busiest rank's bytes received)."""
    def body(rank: int) -> None:
        st = sparsecomm.OkTopkState(density, tau=1, tau_prime=1, error_feedback=False)
        sparsecomm.allreduce(torch.randn(n, generator=torch.Generator().manual_seed(rank)), state=st)

    start = time.perf_counter()
    sim = sparsecomm.simulate(P, body, network="pizdaint", timeout=3600)
    return time.perf_counter() - start, max(sim.time), max(s["bytes_received"] for s in sim.stats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[64, 256, 1024])
    parser.add_argument("--n", type=int, default=100_000)
    parser.add_argument("--density", type=float, default=0.01)
    args = parser.parse_args()
    one_call(4, args.n, args.density)  # compile the kernels before timing
    print(f"| P | wall, s | modelled, ms (slowest rank) | busiest rank, bytes |  (n = {args.n:,} a rank)")
    print("|---|---|---|---|")
    for P in args.ranks:
        wall, modelled, busiest = one_call(P, args.n, args.density)
        print(f"| {P} | {wall:.1f} | {modelled * 1e3:.4f} | {busiest:,} |", flush=True)


if __name__ == "__main__":
    main()
