"""How well Ok-Topk's reused thresholds hold the count: selected / k and exact selections per call.

Runs in the simulated world (counts do not depend on the engine: sim, gloo and MPI give
bit-identical results). For each workload and world size, ``calls`` calls with error
feedback on, and per call the local count of rank 0 and the global count over k:

* ``drift``: x = 0.9 x + 0.1 randn each call (the steady-state workload);
* ``decay``: the same with a shared per-entry scale, shrinking 3% a call (early training);
* ``repeat``: noise that repeats every 4 calls (the same batches every epoch), whose
  residual grows steadily instead of wandering;
* the ``sparsecomm bench`` gradients (``sparsecomm.tools.synthetic.KINDS``);
* ``digits``: a real model's gradients, a 300k-parameter MLP trained on scikit-learn's
  digits over 8 fixed batches per rank (``synthetic.digits_gradients``; ``--n`` does not apply).

The first ``--warmup`` calls are left out (thresholds and residuals settle), and so are
the tau-periodic exact re-evaluations.

Columns: mean and worst (farthest from 1) selected / k, local and global; the fraction of
calls, not counting the tau-periodic re-evaluations, whose global selection was exact
(``global_corrected`` or ``global_recomputed``), or moved the threshold to a rung
(``global_moved``); the fraction whose local selection was corrected or exact, and the
fraction that selected once more above a measured threshold (``local_reselected``: the
gradient jumped past the local ladder).

    python benchmarks/threshold_counts.py [--n 1000000] [--world-sizes 2,4,8] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics

import sparsecomm
from sparsecomm.tools.synthetic import KINDS, digits_gradients, drifting, gradient, repeating

WORKLOADS = ("drift", "decay", "repeat") + KINDS + ("digits",)
_EXACT_GLOBAL = ("global_corrected", "global_recomputed")
_EXACT_LOCAL = ("local_corrected", "local_recomputed")


def stream(workload: str, rank: int, n: int, recorded: list | None = None):
    """Rank ``rank``'s gradients of ``workload``, one a call (``recorded``: digits' per rank)."""
    if workload in ("drift", "decay"):
        return drifting(rank, n, **({"shrink": 0.97, "shared_scale": True} if workload == "decay" else {}))
    if workload == "repeat":
        return repeating(rank, n)
    if workload == "digits":
        return iter(recorded[rank])
    return (gradient(rank, t, n, workload) for t in range(1 << 62))


def _run(workload: str, P: int, n: int, calls: int, tau: int, warmup: int) -> dict:
    recorded = digits_gradients(P, calls) if workload == "digits" else None

    def body(rank: int):
        grads = stream(workload, rank, n, recorded)
        st = sparsecomm.OkTopkState(0.01, tau=tau)
        rows = []
        for t in range(calls):
            sparsecomm.allreduce(next(grads), state=st)
            rows.append((st.last.local_selected / st.last.k, st.last.global_selected / st.last.k,
                         set(st.last.events)))
        return rows

    rows = sparsecomm.simulate(P, body).results[0]
    steady = [r for t, r in enumerate(rows) if t % tau and t >= warmup]  # not the re-evaluations
    worst = lambda xs: max(xs, key=lambda s: abs(s - 1))  # noqa: E731
    frac = lambda names: sum(bool(names & ev) for _, _, ev in steady) / len(steady)  # noqa: E731
    local, glob = [r[0] for r in steady], [r[1] for r in steady]
    return {"workload": workload, "P": P, "n": len(recorded[0][0]) if recorded else n, "calls": calls,
            "local_mean": statistics.mean(local), "local_worst": worst(local),
            "global_mean": statistics.mean(glob), "global_worst": worst(glob),
            "global_exact": frac(set(_EXACT_GLOBAL)), "global_moved": frac({"global_moved"}),
            "local_exact": frac(set(_EXACT_LOCAL)), "local_reselected": frac({"local_reselected"})}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=1_000_000)
    ap.add_argument("--calls", type=int, default=64)
    ap.add_argument("--tau", type=int, default=32)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--world-sizes", default="2,4,8")
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    head = (f"{'workload':>10} {'P':>3} {'local mean':>10} {'worst':>6} {'global mean':>11} {'worst':>6} "
            f"{'g exact':>7} {'g moved':>7} {'l exact':>7} {'l resel':>7}")
    print(head)
    out = []
    for workload in args.workloads.split(","):
        for P in map(int, args.world_sizes.split(",")):
            r = _run(workload, P, args.n, args.calls, args.tau, args.warmup)
            out.append(r)
            print(f"{workload:>10} {P:>3} {r['local_mean']:>10.3f} {r['local_worst']:>6.3f} {r['global_mean']:>11.3f} "
                  f"{r['global_worst']:>6.3f} {r['global_exact']:>7.2f} {r['global_moved']:>7.2f} "
                  f"{r['local_exact']:>7.2f} {r['local_reselected']:>7.2f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
