"""Modelled communication per step at scale, from traffic counted in the simulated world.

For every algorithm given and every P, ``tools.study.volume_study`` counts the busiest
rank's critical-path bytes and messages of a steady call (density 1%, Gaussian gradients)
at two sizes, n and 2n entries a rank. Bytes are fitted as B(n) = c + d n a rank: the
control traffic c (sizes, counts, the selection's allreduces: O(P) words whatever n) does
not grow with the gradient, the data d n does (scaling all of B by target / n charged a
1.5B gradient P-word control messages 15,000 times over). A step's communication is then
messages x alpha + (c + d x target) x beta on a network profile, for a BERT-large-sized
(340M) and a 1.5B-parameter gradient. Writes ``rows.csv``, ``projection.csv``, a markdown
table and a plot::

    python benchmarks/scale_projection.py --ranks 64 256 1024 --out DIR
    python benchmarks/scale_projection.py --out DIR --replot     # the plots again, from DIR's csv
"""

from __future__ import annotations

import argparse
import csv
import os

from sparsecomm.network import resolve_network
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
    parser.add_argument("--replot", action="store_true", help="redraw the plots from --out's projection.csv")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    if args.replot:
        with open(os.path.join(args.out, "projection.csv")) as f:
            rows = list(csv.DictReader(f))
        plot([dict(d, P=int(d["P"]), target_n=int(d["target_n"]), time_s=float(d["time_s"])) for d in rows], args.out)
        return
    def measure(n: int) -> list:
        return study.volume_study(args.ranks, args.algorithms, kinds=["gaussian"], n=n, tau=args.tau,
                                  progress=lambda r: print(f"  n={n} P={r.P} {r.algorithm}: {r.bytes_max:,.0f} B, "
                                                           f"{r.messages_max:.0f} messages", flush=True))

    rows, rows2 = measure(args.n), measure(2 * args.n)
    study.write_csv(rows + rows2, os.path.join(args.out, "rows.csv"))
    fit = {}
    for r, r2 in zip(rows, rows2):
        per_entry = max(0.0, (r2.bytes_max - r.bytes_max) / args.n)
        fit[r.algorithm, r.P] = (max(0.0, r.bytes_max - per_entry * args.n), per_entry, r.messages_max)
    projected = []
    lines = ["| network | gradient | P | " + " | ".join(args.algorithms) + " |",
             "|---|---|---|" + "---|" * len(args.algorithms)]
    for name in args.networks:
        net = resolve_network(name)
        for label, target in TARGETS.items():
            at = {}
            for (algorithm, P), (control, per_entry, messages) in fit.items():
                t = messages * net.alpha + (control + per_entry * target) * net.beta
                at[algorithm, P] = t
                projected.append({"algorithm": algorithm, "kind": "gaussian", "P": P, "network": name,
                                  "gradient": label,
                                  "target_n": target, "time_s": t, "messages": messages,
                                  "control_bytes": control, "bytes_per_entry": per_entry})
            for P in args.ranks:
                lines.append(f"| {name} | {label} | {P} | "
                             + " | ".join(f"{at[a, P] * 1e3:.1f}" for a in args.algorithms) + " |")
    study.write_csv(projected, os.path.join(args.out, "projection.csv"))
    lines += ["", "| P | " + " | ".join(f"{a}: control bytes, bytes an entry, messages" for a in args.algorithms)
              + " |", "|---|" + "---|" * len(args.algorithms)]
    for P in args.ranks:
        lines.append(f"| {P} | " + " | ".join(f"{fit[a, P][0]:,.0f}, {fit[a, P][1]:.3f}, {fit[a, P][2]:.0f}"
                                              for a in args.algorithms) + " |")
    with open(os.path.join(args.out, "table.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    plot(projected, args.out)


def plot(projected: list[dict], out: str) -> None:
    """One plot per network and gradient: modelled time against P, a line per algorithm."""
    for name in sorted({d["network"] for d in projected}):
        for label, target in TARGETS.items():
            study.plot_projection([d for d in projected if d["target_n"] == target and d["network"] == name],
                                  os.path.join(out, f"projection_{name}_{target // 10**6}M.png"))


if __name__ == "__main__":
    main()
