"""The steady-state call's structure per algorithm: device operations, host syncs, size-from-data allocations.

Runs :func:`sparsecomm.tools.audit.audit_steady` (the simulated world, error
feedback, the plain call) for every registered algorithm at each world size
and writes one JSON row per (algorithm, P) and a Markdown table. Counts are per
rank (the busiest rank's), one steady call; ``replay`` says whether two
consecutive calls launched the same operations with the same shapes (what a
CUDA graph needs). ``--kernels torch`` counts the torch kernel path (a GPU
without Triton); ``--kernels triton`` the chain an H100 runs, each Triton launch
one operation (Triton's interpreter runs them here: minutes at P = 8).

    python benchmarks/audit_calls.py --sizes 1 3 8 --kernels torch --out DIR
"""

from __future__ import annotations

import argparse
import json
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: its interpreter runs tl.* too
import sparsecomm  # noqa: E402
from sparsecomm.tools.audit import audit_steady  # noqa: E402


def rows(world_sizes: list[int], n: int, density: float, kernels: str = "torch",
         algorithms: list[str] | None = None, device: str = "cpu") -> list[dict]:
    """One row per (algorithm, world size): the busiest rank's counts of one steady call."""
    out = []
    for P in world_sizes:
        for name in algorithms or sparsecomm.registry.names():
            per_rank = audit_steady(name, P, n=n, density=density, kernels=kernels, device=device)
            first = [calls[0] for calls in per_rank]
            busiest = max(first, key=lambda a: (a.n_syncs, a.n_ops))
            out.append({"algorithm": name, "P": P, "n": n, "density": density, "kernels": kernels, "device": device,
                        "ops": max(a.n_ops for a in first), "syncs": max(a.n_syncs for a in first),
                        "dynamic_allocs": max(a.n_dynamic for a in first),
                        "comm_ops": max(a.comm_ops for a in first),
                        "replay": all(calls[0].replayable_with(calls[1]) for calls in per_rank),
                        "sync_sites": busiest.summary()["sync_sites"]})
    return out


def table(data: list[dict]) -> str:
    """The rows as Markdown."""
    lines = ["| algorithm | P | device ops | host syncs | size-from-data allocs | replayable |",
             "|---|---|---|---|---|---|"]
    for r in data:
        lines.append(f"| {r['algorithm']} | {r['P']} | {r['ops']} | {r['syncs']} | {r['dynamic_allocs']} | "
                     f"{'yes' if r['replay'] else 'no'} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 3, 8])
    parser.add_argument("--n", type=int, default=20_000)
    parser.add_argument("--density", type=float, default=0.01)
    parser.add_argument("--kernels", choices=["torch", "triton"], default="torch")
    parser.add_argument("--device", default="cpu", help="where the tensors live: cuda audits the chain a GPU "
                        "runs, Triton compiled (set TRITON_INTERPRET=0)")
    parser.add_argument("--algorithms", nargs="+", choices=sparsecomm.registry.names(), default=None)
    parser.add_argument("--out", default=None, help="folder for audit_KERNELS.json and audit_KERNELS.md")
    args = parser.parse_args()
    data = rows(args.sizes, args.n, args.density, args.kernels, args.algorithms, args.device)
    print(table(data))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, f"audit_{args.kernels}{'' if args.device == 'cpu' else '_' + args.device}.json"), "w") as f:
            json.dump(data, f, indent=1)
        with open(os.path.join(args.out, f"audit_{args.kernels}{'' if args.device == 'cpu' else '_' + args.device}.md"), "w") as f:
            f.write(table(data) + "\n")


if __name__ == "__main__":
    main()
