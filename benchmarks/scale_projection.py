"""Modelled communication per step at scale, from traffic counted in the simulated world.

For every algorithm given and every P, ``tools.study.volume_study`` counts the busiest
rank's critical-path bytes and messages of a steady call (n entries a rank, density 1%,
Gaussian gradients); ``tools.study.project`` models a step's communication on a network
profile as messages x alpha + bytes x (target / n) x beta, for a BERT-large-sized (340M)
and a 1.5B-parameter gradient. Writes ``rows.csv``, ``projection.csv``, a markdown table
and a plot::

    python benchmarks/scale_projection.py --ranks 64 256 1024 --out DIR
"""

from __future__ import annotations

import argparse
import os

from sparsecomm.tools import study

TARGETS = {"BERT-large (340M)": 340_000_000, "1.5B": 1_500_000_000}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[64, 256, 1024])
    parser.add_argument("--algorithms", nargs="+", default=["dense", "oktopk", "oktopk2d", "gtopk", "topka", "cltk"])
    parser.add_argument("--networks", nargs="+", default=["pizdaint", "10gbe"])
    parser.add_argument("--n", type=int, default=100_000)
    parser.add_argument("--tau", type=int, default=2)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    rows = study.volume_study(args.ranks, args.algorithms, kinds=["gaussian"], n=args.n, tau=args.tau,
                              progress=lambda r: print(f"  P={r.P} {r.algorithm}: {r.bytes_max:,.0f} B, "
                                                       f"{r.messages_max:.0f} messages", flush=True))
    study.write_csv(rows, os.path.join(args.out, "rows.csv"))
    projected = []
    lines = ["| network | gradient | P | " + " | ".join(args.algorithms) + " |",
             "|---|---|---|" + "---|" * len(args.algorithms)]
    for net in args.networks:
        for label, target in TARGETS.items():
            proj = study.project(rows, net, target)
            projected += [dict(d, gradient=label) for d in proj]
            for P in args.ranks:
                at = {d["algorithm"]: d["time_s"] for d in proj if d["P"] == P}
                lines.append(f"| {net} | {label} | {P} | "
                             + " | ".join(f"{at[a] * 1e3:.1f}" for a in args.algorithms) + " |")
    study.write_csv(projected, os.path.join(args.out, "projection.csv"))
    by = {(r.algorithm, r.P): r for r in rows}
    lines += ["", "| P | " + " | ".join(f"{a}: bytes, messages" for a in args.algorithms) + " |",
              "|---|" + "---|" * len(args.algorithms)]
    for P in args.ranks:
        lines.append(f"| {P} | " + " | ".join(f"{by[a, P].bytes_max:,.0f}, {by[a, P].messages_max:.0f}"
                                              for a in args.algorithms) + " |")
    with open(os.path.join(args.out, "table.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    study.plot_projection([d for d in projected if d["gradient"] == "1.5B" and d["network"] == args.networks[0]],
                          os.path.join(args.out, "projection.png"))


if __name__ == "__main__":
    main()
