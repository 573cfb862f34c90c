"""Which sparse AdamW: each approach at density 1% on a task, against dense AdamW.

    python benchmarks/adamw_study.py --task lm --epochs 4 --out DIR
    python benchmarks/adamw_study.py --task digits --epochs 10 --lr 0.002 --out DIR

Runs ``sparsecomm.tools.train.run`` (4 gloo ranks) once per approach of :data:`APPROACHES`
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

from sparsecomm.tools import train

#: name -> (configuration of ``sparsecomm train``, SparseAdamW keyword arguments or None).
APPROACHES: dict[str, tuple[str, dict | None]] = {
    "dense": ("dense", None),
    "hook": ("oktopk-hook", None),
    "local-preconditioned": ("oktopk-sparseadamw", {"variance": "local", "compress": "preconditioned"}),
    "local-momentum": ("oktopk-sparseadamw", {"variance": "local", "compress": "momentum", "momentum_masking": False}),
    "frozen-preconditioned": ("oktopk-sparseadamw", {"variance": "frozen", "compress": "preconditioned"}),
    "frozen-gradient": ("oktopk-sparseadamw", {"variance": "frozen", "compress": "gradient"}),
    "frozen-refresh20": ("oktopk-sparseadamw", {"variance": "frozen", "compress": "preconditioned", "variance_interval": 20}),
    "local-preconditioned-bf16": ("oktopk-sparseadamw", {"variance": "local", "compress": "preconditioned",
                                             "residual_dtype": "bfloat16"}),
    "local-momentum-bf16": ("oktopk-sparseadamw", {"variance": "local", "compress": "momentum",
                                       "residual_dtype": "bfloat16", "momentum_masking": False}),
    "local-preconditioned-dw50": ("oktopk-sparseadamw", {"variance": "local", "compress": "preconditioned",
                                             "density_warmup": 50}),
    "frozen-preconditioned-dw50": ("oktopk-sparseadamw", {"variance": "frozen", "compress": "preconditioned",
                                              "density_warmup": 50}),
    "local-momentum-dw50": ("oktopk-sparseadamw", {"variance": "local", "compress": "momentum", "density_warmup": 50,
                                       "momentum_masking": False}),
    "frozen-momentum": ("oktopk-sparseadamw", {"variance": "frozen", "compress": "momentum", "momentum_masking": False}),
    "local-momentum-masked": ("oktopk-sparseadamw", {"variance": "local", "compress": "momentum", "momentum_masking": True}),
    # CLT-k and TopkA under local-momentum (without masking), as measured.
    "cltk": ("cltk-sparseadamw", {"momentum_masking": False}),
    "cltk-hook": ("cltk-hook", None),
    "topka": ("topka-sparseadamw", {"momentum_masking": False}),
    # Low-communication training (sparsecomm.optim.DiLoCo): torch's AdamW alone for H steps, then an
    # outer step on the pseudo-gradient. The options are DiLoCo's.
    "diloco-h10": ("dense-diloco", {"sync_every": 10, "outer": "nesterov"}),
    "average-h10": ("dense-diloco", {"sync_every": 10, "outer": "sparseloco"}),  # the replicas averaged
    # Dense outer steps at DeMo's bytes (bfloat16 values: about 1/32 of dense's a step).
    "average-h32": ("dense-diloco", {"sync_every": 32, "outer": "sparseloco"}),
    "diloco-h32": ("dense-diloco", {"sync_every": 32, "outer": "nesterov"}),
    "sparseloco-h10-d1": ("oktopk-diloco", {"sync_every": 10, "density": 0.01}),
    "sparseloco-h10-d5": ("oktopk-diloco", {"sync_every": 10, "density": 0.05}),
    "sparseloco-h5-d5": ("oktopk-diloco", {"sync_every": 5, "density": 0.05}),
    "sparseloco-h10-d10": ("oktopk-diloco", {"sync_every": 10, "density": 0.1}),
    # Decoupled momentum (sparsecomm.optim.DeMo) in place of AdamW: chunks of 64, the top
    # component of each (1.6% of the entries). The options are DeMo's.
    "demo-sign": ("topka-demo", {"chunk": 64, "topk": 1}),
    "demo-sign-k2": ("topka-demo", {"chunk": 64, "topk": 2}),
    "demo-oktopk": ("oktopk-demo", {"chunk": 64, "topk": 1, "reduce_density": 1 / 64}),  # one rank's room
    # Ok-Topk carrying the union of the 4 ranks' components (its k: 4 x each rank's).
    "demo-oktopk-x4": ("oktopk-demo", {"chunk": 64, "topk": 1, "reduce_density": 4 / 64}),
    "demo-oktopk-bf16-x4": ("oktopk-bf16-demo", {"chunk": 64, "topk": 1, "reduce_density": 4 / 64}),
    # Two components a chunk (twice the bytes): is one a chunk what holds long runs back?
    "demo-oktopk-k2-x4": ("oktopk-demo", {"chunk": 64, "topk": 2, "reduce_density": 8 / 64}),
    # A momentum that forgets faster: what one component a chunk leaves behind fades in ~100 steps.
    "demo-oktopk-x4-decay0.99": ("oktopk-demo", {"chunk": 64, "topk": 1, "reduce_density": 4 / 64, "decay": 0.99}),
    "demo-value": ("topka-demo", {"chunk": 64, "topk": 1, "update": "value"}),
    # The step over the root of its running mean square (DeMo's update="rms": AdamW's lr applies).
    "demo-rms": ("topka-demo", {"chunk": 64, "topk": 1, "update": "rms"}),
    "demo-oktopk-rms-x4": ("oktopk-demo", {"chunk": 64, "topk": 1, "reduce_density": 4 / 64, "update": "rms"}),
    "demo-rms-bf16-c128": ("topka-bf16-demo", {"chunk": 128, "topk": 1, "update": "rms"}),
    "demo-sign-c128": ("topka-demo", {"chunk": 128, "topk": 1}),
    "demo-sign-bf16": ("topka-bf16-demo", {"chunk": 64, "topk": 1}),
    "demo-sign-bf16-c128": ("topka-bf16-demo", {"chunk": 128, "topk": 1}),
    # float8 components (one byte each, 2^-4 relative, scaled to the largest of any rank).
    "demo-sign-fp8": ("topka-fp8-demo", {"chunk": 64, "topk": 1}),
    "demo-sign-fp8-k2": ("topka-fp8-demo", {"chunk": 64, "topk": 2}),
    "demo-oktopk-fp8-x4": ("oktopk-fp8-demo", {"chunk": 64, "topk": 1, "reduce_density": 4 / 64}),
    # The rms rule at under 2.5% of dense's bytes: float8 components over TopkA, one of 64, 80 or 128.
    "demo-rms-fp8": ("topka-fp8-demo", {"chunk": 64, "topk": 1, "update": "rms"}),
    "demo-rms-fp8-c128": ("topka-fp8-demo", {"chunk": 128, "topk": 1, "update": "rms"}),
    "demo-rms-fp8-c80": ("topka-fp8-demo", {"chunk": 80, "topk": 1, "update": "rms"}),  # under 2% of the bytes
    "demo-rms-fp8-k2": ("topka-fp8-demo", {"chunk": 64, "topk": 2, "update": "rms"}),  # twice the components
    "demo-oktopk-rms-fp8-x4": ("oktopk-fp8-demo", {"chunk": 64, "topk": 1, "reduce_density": 4 / 64,
                                                    "update": "rms"}),
    # The same with a momentum that forgets in ~100 steps.
    "demo-rms-fp8-decay0.99": ("topka-fp8-demo", {"chunk": 64, "topk": 1, "update": "rms", "decay": 0.99}),
    "demo-oktopk-rms-x4-decay0.99": ("oktopk-demo", {"chunk": 64, "topk": 1, "reduce_density": 4 / 64,
                                                      "update": "rms", "decay": 0.99}),
    # Under 2% of dense's bytes: one float8 component of each chunk of 128 (1.2%), the same decay.
    "demo-rms-fp8-c128-decay0.99": ("topka-fp8-demo", {"chunk": 128, "topk": 1, "update": "rms", "decay": 0.99}),
    # 2-D tiles (the published method's cut): one component of each 8 x 8 tile (the bytes of
    # one of 64), 64 of each 64 x 64 tile (the same), 32 of each (the published setting, half).
    "demo-rms-fp8-t8x8": ("topka-fp8-demo", {"chunk": (8, 8), "topk": 1, "update": "rms"}),
    "demo-rms-fp8-t64-k64": ("topka-fp8-demo", {"chunk": (64, 64), "topk": 64, "update": "rms"}),
    "demo-rms-fp8-t64-k32": ("topka-fp8-demo", {"chunk": (64, 64), "topk": 32, "update": "rms"}),
    # Dense outer steps at the bytes of DeMo over Ok-Topk (about 1/17 of dense's a step).
    "average-h16": ("dense-diloco", {"sync_every": 16, "outer": "sparseloco"}),
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
    ap.add_argument("--tag", default="", help="appended to the approaches' names: runs of another "
                    "length in the same folder (their time to accuracy is taken against the dense run's marks)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--tables-only", action="store_true", help="rewrite study.md from study.json; run nothing")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "study.json")
    runs = json.load(open(path)) if os.path.exists(path) else []
    if args.tables_only:
        write_table(runs, os.path.join(args.out, "study.md"))
        return
    # One compute figure for every approach (measured before any run; or the study's earlier one).
    compute = next((r["compute_per_step"] for r in runs if "compute_per_step" in r), None)
    if compute is None:
        compute = train.measure_compute(args.task, 16, "adamw", seed=args.seed)
    for name in args.approaches.split(","):
        config, options = APPROACHES[name]
        label = f"{name} {args.tag}".strip()
        if any(r["approach"] == label and r["seed"] == args.seed for r in runs):
            continue  # already measured: rerunning the script resumes
        try:
            own = train.own_optimizer(config)
            (r,) = train.run([config], ranks=args.ranks, epochs=args.epochs, lr=args.lr, task=args.task,
                             optimizer="adamw", seed=args.seed,
                             warmup_steps=args.warmup_steps if own == "sparseadamw" else 0,
                             adamw_options=_options(options) if own == "sparseadamw" else None,
                             diloco_options=options if own == "diloco" else None,
                             demo_options=options if own == "demo" else None, compute_per_step=compute)
        except Exception as exc:  # noqa: BLE001 - a diverging approach is a result too
            r = {"config": config, "failed": str(exc).strip().splitlines()[-1]}
        r.update(approach=label, seed=args.seed, adamw_options=options)
        runs.append(r)
        with open(path, "w") as f:
            json.dump(runs, f)
        print(f"# {label}: {r.get(r.get('metric', ''), ['failed'])[-1]}", flush=True)
    write_table(runs, os.path.join(args.out, "study.md"))


MARKS = ("dense@25%", "dense@50%", "dense@75%", "1.02x", "1.00x")


def write_table(runs: list[dict], path: str) -> None:
    """study.md: per approach and seed, the final metric, its ratio to dense's, bytes, and
    the step and modelled seconds on 1 Gbit/s at which it first reached each of dense's marks
    (``sparsecomm.tools.train.time_to_accuracy``)."""
    lines = []
    for seed in sorted({r["seed"] for r in runs}):
        done = [r for r in runs if r["seed"] == seed and "failed" not in r]
        dense = next((r for r in done if r["approach"] == "dense"), None)  # the marks: dense untagged
        if dense is None:
            continue
        metric = dense["metric"]
        rows = train.time_to_accuracy([dense] + [r for r in done if r is not dense])
        tta = {id(d): row for d, row in zip([dense] + [r for r in done if r is not dense], rows)}
        marks = " | ".join(f"{m} ({rows[0][m]['value']:.4f})" for m in MARKS)
        lines += [f"## seed {seed}", "", "Marks: step / modelled seconds on 1 Gbit/s at which the run first "
                  "reached dense's metric at 25/50/75% of its run, within 2% of its final, and its final.", "",
                  f"| approach | steps | final {metric} | vs dense | bytes/rank/step | {marks} |",
                  "|---|---|---|---|---|" + "---|" * len(MARKS)]
        for r in runs:
            if r["seed"] != seed:
                continue
            if "failed" in r:
                lines.append(f"| {r['approach']} | | failed: {r['failed'][:80]} |" + " |" * (2 + len(MARKS)))
                continue
            row = tta[id(r)]
            cells = ["never" if row[m]["step"] is None else f"{row[m]['step']} / {row[m]['1gbe']:.1f}" for m in MARKS]
            final = r[metric][-1]
            lines.append(f"| {r['approach']} | {r['epochs'] * r['steps_per_epoch']} | {final:.4f} | "
                         f"{final / dense[metric][-1]:.4f} | {r['bytes_per_step']:,.0f} | " + " | ".join(cells) + " |")
        lines += ["", "Modelled seconds to reach dense's final metric within 2% (1.02x) and itself (1.00x), on "
                  f"each network profile ({', '.join(train.CURVE_PROFILES)}), and their ratio to dense's.", "",
                  "| approach | " + " | ".join(f"{m} {p}" for m in MARKS[3:] for p in train.CURVE_PROFILES) + " |",
                  "|---|" + "---|" * (2 * len(train.CURVE_PROFILES))]
        for r in runs:
            if r["seed"] != seed or "failed" in r:
                continue
            cells = []
            for m in MARKS[3:]:
                for p in train.CURVE_PROFILES:
                    t, base = tta[id(r)][m][p], tta[id(dense)][m][p]
                    cells.append("never" if t is None else f"{t:.1f} ({t / base:.2f}x)")
            lines.append(f"| {r['approach']} | " + " | ".join(cells) + " |")
        lines.append("")
    lines += across_seeds(runs)
    with open(path, "w") as f:
        f.write("\n".join(lines))


def across_seeds(runs: list[dict]) -> list[str]:
    """study.md's last table: each approach run on two seeds or more, its final metric against
    dense's of the same seed, seed by seed, their mean, and its mean metric against dense's mean
    (one seed's luck moves a ratio; the means show what stays)."""
    ok = [r for r in runs if "failed" not in r]
    dense = {r["seed"]: r for r in ok if r["approach"] == "dense"}
    by_name: dict[str, dict[int, dict]] = {}
    for r in ok:
        if r["seed"] in dense:
            by_name.setdefault(r["approach"], {})[r["seed"]] = r
    rows = {name: seeds for name, seeds in by_name.items() if len(seeds) > 1 and name != "dense"}
    if not rows:
        return []
    metric = next(iter(dense.values()))["metric"]
    lines = ["## across seeds", "", f"Final {metric} ÷ dense's of the same seed; the mean of those ratios; the "
             f"mean {metric} ÷ dense's mean over the same seeds.", "",
             "| approach | seeds | ÷ dense, seed by seed | mean of the ratios | mean ÷ dense's mean |",
             "|---|---|---|---|---|"]
    for name, seeds in rows.items():
        ks = sorted(seeds)
        ratios = [seeds[s][metric][-1] / dense[s][metric][-1] for s in ks]
        mean = sum(seeds[s][metric][-1] for s in ks) / sum(dense[s][metric][-1] for s in ks)
        lines.append(f"| {name} | {', '.join(map(str, ks))} | {' / '.join(f'{x:.3f}' for x in ratios)} | "
                     f"{sum(ratios) / len(ratios):.3f} | {mean:.3f} |")
    return lines + [""]


if __name__ == "__main__":
    main()
