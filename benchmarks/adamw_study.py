"""Which sparse AdamW: each approach at density 1% on a task, against dense AdamW.

    python benchmarks/adamw_study.py --task lm --epochs 4 --out DIR
    python benchmarks/adamw_study.py --task digits --epochs 10 --lr 0.002 --out DIR

Runs ``sparsecomm.train.run`` (4 gloo ranks) once per approach of :data:`APPROACHES`
(``--approaches`` picks some) and writes ``study.json`` (every run's record, with
its evaluation curve) and ``study.md`` (final metric against dense, and the time to
accuracy on 1 Gbit/s). "hook" is the naive path: error feedback on the gradient
through the DDP hook, then torch's AdamW. The others are ``SparseAdamW`` settings.
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from sparsecomm import train

#: name -> (configuration of ``sparsecomm train``, SparseAdamW keyword arguments or None).
APPROACHES: dict[str, tuple[str, dict | None]] = {
    "dense": ("dense", None),
    "hook": ("oktopk-hook", None),
    "local-preconditioned": ("oktopk", {"variance": "local", "compress": "preconditioned"}),
    "local-momentum": ("oktopk", {"variance": "local", "compress": "momentum"}),
    "frozen-preconditioned": ("oktopk", {"variance": "frozen", "compress": "preconditioned"}),
    "frozen-gradient": ("oktopk", {"variance": "frozen", "compress": "gradient"}),
    "frozen-refresh20": ("oktopk", {"variance": "frozen", "compress": "preconditioned", "variance_interval": 20}),
    "local-preconditioned-bf16": ("oktopk", {"variance": "local", "compress": "preconditioned",
                                             "residual_dtype": "bfloat16"}),
    "local-preconditioned-dw50": ("oktopk", {"variance": "local", "compress": "preconditioned",
                                             "density_warmup": 50}),
    "frozen-preconditioned-dw50": ("oktopk", {"variance": "frozen", "compress": "preconditioned",
                                              "density_warmup": 50}),
    "local-momentum-dw50": ("oktopk", {"variance": "local", "compress": "momentum", "density_warmup": 50}),
    "frozen-momentum": ("oktopk", {"variance": "frozen", "compress": "momentum"}),
    "cltk": ("cltk", {}),
    "cltk-hook": ("cltk-hook", None),
    "topka": ("topka", {}),
}


def _options(options: dict | None) -> dict | None:
    if options and options.get("residual_dtype") == "bfloat16":
        return {**options, "residual_dtype": torch.bfloat16}
    return options


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--task", default="lm", choices=["lm", "digits"])
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--lr", type=float, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--warmup-steps", type=int, default=0, help="SparseAdamW's dense steps (0: its default, 10)")
    ap.add_argument("--approaches", default=",".join(APPROACHES))
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "study.json")
    runs = json.load(open(path)) if os.path.exists(path) else []
    # One compute figure for every approach (measured before any run; or the study's earlier one).
    compute = next((r["compute_per_step"] for r in runs if "compute_per_step" in r), None)
    if compute is None:
        compute = train.measure_compute(args.task, 16, "adamw", seed=args.seed)
    for name in args.approaches.split(","):
        config, options = APPROACHES[name]
        if any(r["approach"] == name and r["seed"] == args.seed for r in runs):
            continue  # already measured: rerunning the script resumes
        try:
            (r,) = train.run([config], ranks=args.ranks, epochs=args.epochs, lr=args.lr, task=args.task,
                             optimizer="adamw", seed=args.seed, warmup_steps=args.warmup_steps,
                             adamw_options=_options(options), compute_per_step=compute)
        except Exception as exc:  # noqa: BLE001 - a diverging approach is a result too
            r = {"config": config, "failed": str(exc).strip().splitlines()[-1]}
        r.update(approach=name, seed=args.seed, adamw_options=options)
        runs.append(r)
        with open(path, "w") as f:
            json.dump(runs, f)
        print(f"# {name}: {r.get(r.get('metric', ''), ['failed'])[-1]}", flush=True)
    write_table(runs, os.path.join(args.out, "study.md"))


def write_table(runs: list[dict], path: str) -> None:
    """study.md: per approach and seed, the final metric, its ratio to dense, and the steps and
    modelled seconds on 1 Gbit/s to dense's marks."""
    lines = []
    for seed in sorted({r["seed"] for r in runs}):
        done = [r for r in runs if r["seed"] == seed and "failed" not in r]
        dense = next((r for r in done if r["approach"] == "dense"), None)
        if dense is None:
            continue
        metric = dense["metric"]
        tta = {id(d): row for d, row in zip(done, train.time_to_accuracy(done))}  # every run has a curve
        lines += [f"## seed {seed}", "",
                  f"| approach | final {metric} | vs dense | bytes/rank/step | to 1.02x: step | s (1 Gbit/s) "
                  f"| to 1.00x: step | s (1 Gbit/s) |", "|---|---|---|---|---|---|---|---|"]
        for r in runs:
            if r["seed"] != seed:
                continue
            if "failed" in r:
                lines.append(f"| {r['approach']} | failed: {r['failed'][:80]} | | | | | | |")
                continue
            row = tta.get(id(r))
            cells = []
            for mark in ("1.02x", "1.00x"):
                e = row[mark] if row else None
                cells += ["never", ""] if not e or e["step"] is None else [str(e["step"]), f"{e['1gbe']:.1f}"]
            final = r[metric][-1]
            lines.append(f"| {r['approach']} | {final:.4f} | {final / dense[metric][-1]:.4f} | "
                         f"{r['bytes_per_step']:,.0f} | " + " | ".join(cells) + " |")
        lines.append("")
    with open(path, "w") as f:
        f.write("\n".join(lines))


if __name__ == "__main__":
    main()
