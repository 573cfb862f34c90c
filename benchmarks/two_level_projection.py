"""Modelled communication a step at P = 64 ... 4096: every algorithm, one- and two-level networks.

1. Counts (``counts.csv``): the simulated world's busiest rank in a steady call (tau = 2:
   two warm-up calls, then the mean of one exact and one reusing call; density 1%, Gaussian
   gradients, n entries a rank) of two-level Ok-Topk (8 ranks a node) and flat Ok-Topk, at
   the ``--count-ranks``: critical-path bytes and messages within nodes (the ``node_*``
   phases) and between them, beside ``choice.traffic``'s formulas for the same call.
2. Projection (``projection.csv``, ``table.md``, ``docs/two_level_projection.png`` with
   ``--plot``): ``choice.traffic``'s formulas for a BERT-large-sized (340M) and a 1.5B
   gradient at 1%, float32 values, at every P, on each network: one rank a node
   (``pizdaint``, ``10gbe``: two-level Ok-Topk does not apply) and nodes of 8
   (``nvl8``, ``nvl8-10gbe``: flat algorithms' traffic is charged at the inter-node link,
   which their busiest rank's path crosses for all but G - 1 of its P - 1 peers).
   ``auto`` is what ``choice.choose`` picks for that size, P and network with an H100's
   local costs (its candidates: Ok-Topk, its grid and dense).

    python benchmarks/two_level_projection.py --out DIR [--count-ranks 64 256] [--plot docs/two_level_projection.png]
"""

from __future__ import annotations

import argparse
import csv
import os

import torch

import sparsecomm
from sparsecomm import choice
from sparsecomm.algorithms import OkTopkState, OkTopkTwoLevelState
from sparsecomm.network import TwoLevel, resolve_network
from sparsecomm.state import topk_count

TARGETS = {"340M": 340_000_000, "1.5B": 1_500_000_000}
ALGORITHMS = ["dense", "oktopk", "oktopk2d", "oktopk2l", "oktopk2l-grid", "gtopk", "topka", "cltk", "auto"]
NETWORKS = ["pizdaint", "10gbe", "nvl8", "nvl8-10gbe"]
DENSITY = 0.01
VALUE_BYTES = 4


def traffic(label: str, n: int, k: int, P: int, G: int) -> choice.Traffic:
    """``choice.traffic`` of a column: ``oktopk2l-grid`` is two-level Ok-Topk with ``grid=True``."""
    return choice.traffic(label.removesuffix("-grid"), n, k, P, VALUE_BYTES, G, grid=label.endswith("-grid"))


def count(P: int, algorithm: str, n: int, G: int, tau: int = 2) -> dict:
    """The busiest rank's mean critical-path (bytes, messages) in and between nodes over one
    threshold period after ``tau`` warm-up calls."""
    net = resolve_network("nvl8") if G == 8 else TwoLevel(*(resolve_network("nvl8").intra,) * 2, G)

    def body(rank: int) -> list[float]:
        if algorithm.startswith("oktopk2l"):
            state = OkTopkTwoLevelState(DENSITY, tau=tau, tau_prime=2 * tau, error_feedback=False, ranks_per_node=G,
                                        grid=algorithm.endswith("-grid"))
        else:
            state = OkTopkState(DENSITY, tau=tau, tau_prime=2 * tau, error_feedback=False)
        base = torch.randn(n, generator=torch.Generator().manual_seed(rank))
        totals = [0.0] * 4
        for step in range(2 * tau):
            noise = torch.randn(n, generator=torch.Generator().manual_seed(10_000 * step + rank))
            sparsecomm.allreduce(base + 0.05 * noise, state=state, check=False)
            if step >= tau:
                for name, p in state.last.phases.items():
                    at = 0 if name.startswith("node_") else 2
                    totals[at] += max(p.bytes_sent, p.bytes_received) / tau
                    totals[at + 1] += max(p.messages_sent, p.messages_received) / tau
        return totals

    per_rank = sparsecomm.simulate(P, body, network=net, timeout=3600).results
    busiest = max(per_rank, key=lambda t: t[0] + t[2])
    model = traffic(algorithm, n, topk_count(DENSITY, n), P, G)
    return {"algorithm": algorithm, "P": P, "G": G, "n": n,
            "intra_bytes": busiest[0], "intra_messages": busiest[1],
            "inter_bytes": busiest[2], "inter_messages": busiest[3],
            "model_intra_bytes": model.intra_bytes, "model_intra_messages": model.intra_messages,
            "model_inter_bytes": model.bytes, "model_inter_messages": model.messages}


def project(ranks: list[int]) -> list[dict]:
    """One row per network, gradient, P and algorithm: modelled seconds, bytes and messages."""
    rows = []
    for name in NETWORKS:
        net = resolve_network(name)
        G = net.ranks_per_node if isinstance(net, TwoLevel) else 1
        for label, n in TARGETS.items():
            k = topk_count(DENSITY, n)
            for P in ranks:
                for algorithm in ALGORITHMS:
                    if algorithm.startswith("oktopk2l") and G == 1:
                        continue  # one rank a node: nothing to do within a node
                    chosen = (choice.choose(n, DENSITY, P, network=net, device="cuda") if algorithm == "auto"
                              else algorithm)
                    t = traffic(chosen, n, k, P, G)
                    rows.append({"network": name, "gradient": label, "P": P, "algorithm": algorithm,
                                 "chosen": chosen, "time_s": t.time(net), "inter_bytes": t.bytes,
                                 "inter_messages": t.messages, "intra_bytes": t.intra_bytes,
                                 "intra_messages": t.intra_messages})
    return rows


def write_csv(rows: list[dict], path: str) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


def table(rows: list[dict], ranks: list[int]) -> str:
    """Milliseconds a step (the algorithm auto picks in brackets), then bytes and messages."""
    lines = ["| network | gradient | P | " + " | ".join(ALGORITHMS) + " |", "|---|---|---|" + "---|" * len(ALGORITHMS)]
    at = {(d["network"], d["gradient"], d["P"], d["algorithm"]): d for d in rows}
    for name in NETWORKS:
        for label in TARGETS:
            for P in ranks:
                cells = []
                for a in ALGORITHMS:
                    d = at.get((name, label, P, a))
                    cells.append("—" if d is None else f"{d['time_s'] * 1e3:,.1f}"
                                 + (f" ({d['chosen']})" if a == "auto" else ""))
                lines.append(f"| {name} | {label} | {P} | " + " | ".join(cells) + " |")
    lines += ["", "The busiest rank's critical path, 340M at 1%: MB between nodes / MB within a node / "
              "messages between nodes (nvl8; the flat algorithms' traffic all between nodes):", "",
              "| P | " + " | ".join(ALGORITHMS[:-1]) + " |", "|---|" + "---|" * (len(ALGORITHMS) - 1)]
    for P in ranks:
        cells = []
        for a in ALGORITHMS[:-1]:
            d = at[("nvl8", "340M", P, a)]
            cells.append(f"{d['inter_bytes'] / 1e6:,.1f} / {d['intra_bytes'] / 1e6:,.0f} / {d['inter_messages']:,.0f}")
        lines.append(f"| {P} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(TARGETS), len(NETWORKS), figsize=(4 * len(NETWORKS), 3.4 * len(TARGETS)),
                             sharex=True)
    for i, label in enumerate(TARGETS):
        for j, name in enumerate(NETWORKS):
            ax = axes[i][j]
            for c, a in enumerate(ALGORITHMS):  # one colour an algorithm in every panel
                pts = sorted((d["P"], d["time_s"] * 1e3) for d in rows
                             if d["network"] == name and d["gradient"] == label and d["algorithm"] == a)
                if pts:
                    ax.plot(*zip(*pts), marker="o", ms=3, label=a, color=f"C{c}",
                            linestyle=":" if a == "auto" else "-", linewidth=2.5 if a == "auto" else 1.2)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_title(f"{name}, {label} at 1%", fontsize=9)
            ax.set_xlabel("ranks P")
            ax.set_ylabel("modelled ms a step")
    axes[0][-1].legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[64, 128, 256, 512, 1024, 2048, 4096])
    parser.add_argument("--count-ranks", type=int, nargs="*", default=[64, 256])
    parser.add_argument("--n", type=int, default=100_000)
    parser.add_argument("--out", required=True)
    parser.add_argument("--plot", help="where to draw the projection (a .png)")
    parser.add_argument("--replot", action="store_true", help="only redraw --plot from --out's projection.csv")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    if args.replot:
        with open(os.path.join(args.out, "projection.csv")) as f:
            plot([dict(d, P=int(d["P"]), time_s=float(d["time_s"])) for d in csv.DictReader(f)], args.plot)
        return
    counted = []
    for P in args.count_ranks:
        for algorithm, G in (("oktopk2l", 8), ("oktopk2l-grid", 8), ("oktopk", 8)):
            row = count(P, algorithm, args.n, G)
            counted.append(row)
            print(row, flush=True)
    if counted:
        write_csv(counted, os.path.join(args.out, "counts.csv"))
    rows = project(args.ranks)
    write_csv(rows, os.path.join(args.out, "projection.csv"))
    text = table(rows, args.ranks)
    with open(os.path.join(args.out, "table.md"), "w") as f:
        f.write(text)
    print(text)
    if args.plot:
        plot(rows, args.plot)


if __name__ == "__main__":
    main()
