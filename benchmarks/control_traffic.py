"""The busiest rank's bytes received by one exact Ok-Topk call, against the data bound.

One call with exact selection and new boundaries (tau = tau' = 1, no error feedback) on
Gaussian gradients, in the simulated world: the control traffic (the input check, the
boundaries' histogram, the radix select's counts) beside the data, whose bound is
2k(P - 1)/P words of 4 bytes. Prints a markdown table::

    python benchmarks/control_traffic.py --ranks 12 64 256 --n 20011 100000
"""

from __future__ import annotations

import argparse
import math

import torch

import sparsecomm


def busiest(P: int, n: int, density: float) -> int:
    """Bytes the busiest rank receives in one exact call."""
    def body(rank: int) -> int:
        c = sparsecomm.resolve()
        st = sparsecomm.OkTopkState(density, tau=1, tau_prime=1, error_feedback=False)
        g = torch.randn(n, generator=torch.Generator().manual_seed(rank))
        before = c.stats.snapshot()
        sparsecomm.allreduce(g, state=st)
        return (c.stats - before).bytes_received

    return max(sparsecomm.simulate(P, body, timeout=900).results)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[12, 64, 256])
    parser.add_argument("--n", type=int, nargs="+", default=[20_011, 100_000])
    parser.add_argument("--density", type=float, default=0.01)
    args = parser.parse_args()
    print("| P | n per rank | k | busiest rank, bytes | x the data bound |")
    print("|---|---|---|---|---|")
    for n in args.n:
        for P in args.ranks:
            k = math.ceil(args.density * n)
            got = busiest(P, n, args.density)
            print(f"| {P} | {n:,} | {k:,} | {got:,} | {got / (2 * k * (P - 1) / P * 4):.1f} |", flush=True)


if __name__ == "__main__":
    main()
