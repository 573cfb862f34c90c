"""The ``sparsecomm`` command.

``sparsecomm study volume|bert``: the volume and scaling study in the
simulated world, with CSV/JSON and plots, and its projection to BERT's size on
cluster network profiles.

``sparsecomm train``: the convergence comparison (DDP with sparsecomm's hooks,
or a schedule, on scikit-learn's bundled digits or a transformer language model
of the standard library's sources), a final table and a plot.

``sparsecomm report RESULTS...``: tables and plots from benchmark JSON files
of any machines (time, bytes and speed-up over dense vs P, phase breakdown).

``sparsecomm calibrate RESULTS...``: fit the simulation's network model
(alpha, beta, local cost per element) to measured runs, report modelled vs
measured per algorithm, save named profiles and project to P = 1024.

``sparsecomm emulate --ranks P --rate 1gbit -- COMMAND``: P network
namespaces joined by a shaped bridge, one rank of COMMAND in each (root).

``sparsecomm bench``: start local ranks (torch.multiprocessing + gloo, or the
simulated world), run Ok-Topk and Dense on a realistic synthetic gradient, and
print one table. Works on a fresh machine with no GPU and no MPI. Under an
existing launcher (torchrun, mpiexec, srun) use ``--launcher external``: the
ranks are already there and the command runs on each of them.
"""

from __future__ import annotations

import argparse
import sys

from .output import write_json

__all__ = ["main"]


def _bench_rank(rank: int, size: int, args: argparse.Namespace) -> tuple[list, dict]:
    from .bench import environment, measure
    from .comm import resolve

    comm = resolve()
    rows = measure(comm, args.algorithms, args.n, args.density, args.steps, args.warmup, args.kind,
                   compressors=args.compressors)
    return rows, environment(comm)


def _bench(args: argparse.Namespace) -> int:
    import os

    from .bench import format_table, write_results

    if args.launcher == "spawn":
        from .launch import spawn

        os.environ.setdefault("SPARSECOMM_LAUNCHER", "spawn")  # the spawned ranks inherit it
        rows, env = spawn(args.ranks, _bench_rank, args)[0]
    elif args.launcher == "sim":
        from .comm import simulate

        os.environ.setdefault("SPARSECOMM_LAUNCHER", "sim")
        rows, env = simulate(args.ranks, lambda r: _bench_rank(r, args.ranks, args)).results[0]
    else:
        from .comm import resolve

        comm = resolve()
        rows, env = _bench_rank(comm.rank, comm.size, args)
        if comm.rank != 0:
            return 0
    print(f"# sparsecomm bench: n={args.n} density={args.density} kind={args.kind} "
          f"steps={args.steps} (+{args.warmup} warm-up); {env['launcher']}, {env['backend']}, "
          f"P={env['ranks']} on {env['nodes']} node(s), network {env['network']}")
    print(format_table(rows))
    if args.json:
        write_results(rows, env, args.json)
        print(f"# wrote {args.json}")
    return 0


def _study(args: argparse.Namespace) -> int:
    import os

    from . import study

    os.makedirs(args.out, exist_ok=True)
    sizes = [int(p) for p in args.ranks.split(",")]
    kinds = args.kinds.split(",")
    algs = args.algorithms

    done: list = []
    base = os.path.join(args.out, args.what)

    def progress(row: "study.VolumeRow") -> None:
        done.append(row)
        write_json(done, base + ".partial.json")  # a long study keeps what it measured
        print(f"  {row.kind:<9} P={row.P:<4} {row.algorithm:<10} bytes/rank max {row.bytes_max:>14,.0f} "
              f"mean {row.bytes_mean:>14,.0f}  msgs max {row.messages_max:>6.0f}  "
              f"measured/formula {row.ratio:6.3f}", flush=True)

    print(f"# sparsecomm study {args.what}: n={args.n:,} density={args.density} tau={args.tau} "
          f"P={sizes} kinds={kinds}")
    rows = study.volume_study(sizes, algs, kinds, args.n, args.density, args.tau, progress=progress)
    write_json(rows, base + ".json")
    study.write_csv(rows, base + ".csv")
    if args.what == "volume":
        study.plot_volume(rows, base + ".png")
        _print_ratios(rows)
    else:
        proj = []
        for net in args.networks.split(","):
            proj += study.project(rows, net, args.target_n)
        write_json(proj, base + "_projection.json")
        for net in args.networks.split(","):
            sub = [d for d in proj if d["network"] == net]
            study.plot_projection(sub, f"{base}_{net}.png")
            _print_projection(sub)
    print(f"# wrote {base}.json, .csv and plot(s) in {args.out}")
    return 0


def _train(args: argparse.Namespace) -> int:
    import os

    from . import train

    os.makedirs(args.out, exist_ok=True)
    print(f"# sparsecomm train: task {args.task}, {args.ranks} gloo ranks, {args.epochs} epochs, "
          f"configs {args.configs}", flush=True)
    # One configuration at a time, the JSON rewritten after each: a run that fails (a diverging
    # configuration raises on NaN) is reported and the others still land.
    results, failed = [], []
    for config in args.configs:
        try:
            results += train.run([config], ranks=args.ranks, epochs=args.epochs, lr=args.lr,
                                 batch=args.batch, network=args.network, schedule=args.schedule, task=args.task,
                                 optimizer=args.optimizer, warmup_steps=args.warmup_steps,
                                 momentum=args.momentum)
        except Exception as exc:  # noqa: BLE001 - reported, and the next configuration runs
            failed.append(config)
            # The error itself, not the note on how a process then ended (the JSON has it all).
            lines = [x for x in str(exc).strip().splitlines() if x.strip() and not x.startswith("(then")]
            print(f"\n# {config} failed: {lines[-1] if lines else type(exc).__name__}", flush=True)
            results.append({"config": config, "failed": str(exc)})
        write_json(results, os.path.join(args.out, "train.json"))
    done = [r for r in results if "failed" not in r]
    if done:
        print(train.format_results(done))
        train.plot(done, os.path.join(args.out, "train.png"))
    print(f"# wrote {args.out}/train.json and {args.out}/train.png"
          + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


def _print_ratios(rows: list) -> None:
    print("\n# bytes per rank (busiest) / Ok-Topk's, per kind and P")
    for kind in sorted({r.kind for r in rows}):
        for P in sorted({r.P for r in rows}):
            sub = {r.algorithm: r for r in rows if r.kind == kind and r.P == P}
            ok = sub.get("oktopk")
            if ok:
                print(f"  {kind:<9} P={P:<4} " + "  ".join(
                    f"{a}={r.bytes_max / ok.bytes_max:8.2f}" for a, r in sub.items()))


def _print_projection(proj: list[dict]) -> None:
    d0 = proj[0]
    print(f"\n# modelled time per call, {d0['target_n']:,} elements on {d0['network']} (ms; ratio to Ok-Topk)")
    for P in sorted({d["P"] for d in proj}):
        print(f"  P={P:<4} " + "  ".join(f"{d['algorithm']}={d['time_s'] * 1e3:8.2f} ({d['ratio_to_oktopk']:.2f}x)"
                                         for d in proj if d["P"] == P))


def main(argv: list[str] | None = None) -> int:
    from . import algorithms
    from .synthetic import KINDS

    parser = argparse.ArgumentParser(prog="sparsecomm", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="subcommand", required=True)
    b = sub.add_parser("bench", help="time sparse and dense allreduces on local or launched ranks")
    b.add_argument("--ranks", type=int, default=4, help="local ranks to start (spawn/sim)")
    b.add_argument("--n", type=int, default=4_000_000, help="gradient elements per rank")
    b.add_argument("--density", type=float, default=0.01)
    b.add_argument("--steps", type=int, default=10, help="timed calls per algorithm")
    b.add_argument("--warmup", type=int, default=3, help="untimed calls first")
    b.add_argument("--kind", choices=KINDS, default="model", help="synthetic gradient")
    b.add_argument("--algorithms", type=lambda s: s.split(","), default=["oktopk", "dense"],
                   help=f"comma-separated, from {algorithms()}")
    b.add_argument("--compressors", type=lambda s: [None if c == "none" else c for c in s.split(",")],
                   default=[None], help="comma-separated: none, fp16, bf16, trunc16, q8, q4, ...")
    b.add_argument("--launcher", choices=["spawn", "sim", "external"], default="spawn",
                   help="spawn gloo processes, simulate in-process, or use ranks "
                        "started by torchrun/mpiexec/srun")
    b.add_argument("--json", help="also write the rows to this JSON file")
    st = sub.add_parser("study", help="volume and scaling study in the simulated world")
    st.add_argument("what", choices=["volume", "bert"],
                    help="volume: bytes/messages per rank vs P for every algorithm; "
                         "bert: the same at P=32..256 projected to BERT's 133,547,324 elements")
    st.add_argument("--ranks", default=None, help="comma-separated world sizes")
    st.add_argument("--n", type=int, default=1 << 20, help="elements per rank in the simulation")
    st.add_argument("--density", type=float, default=0.01)
    st.add_argument("--tau", type=int, default=4, help="threshold period (calls 2..tau are measured)")
    st.add_argument("--kinds", default=None, help="gradient kinds, comma-separated")
    st.add_argument("--algorithms", type=lambda s: s.split(","), default=None)
    st.add_argument("--networks", default="pizdaint,10gbe,56gbib,100gbib",
                    help="profiles (or alpha:beta) for the projection")
    st.add_argument("--target-n", type=int, default=133_547_324)
    st.add_argument("--out", default="study", help="output folder")
    rp = sub.add_parser("report", help="tables and plots from benchmark JSON files (any machines)")
    rp.add_argument("results", nargs="+",
                    help="pytest-benchmark JSON of benchmarks/, sparsecomm bench --json, or folders of them")
    rp.add_argument("--out", default=None, help="folder for report.md, rows.csv and the plots")
    ca = sub.add_parser("calibrate", help="fit the network model's alpha, beta (and local costs) to measured runs")
    ca.add_argument("results", nargs="+", help="allreduce suite or sparsecomm bench JSON at P > 1")
    ca.add_argument("--names", type=lambda s: s.split(","), default=None,
                    help="profile names, one per machine found (comma-separated, in sorted machine order)")
    ca.add_argument("--save", action="store_true", help="save the profiles where resolve_network finds them")
    ca.add_argument("--project", type=int, default=1024, help="project to this many ranks (0: no projection)")
    ca.add_argument("--project-n", type=int, default=None, help="elements for the projection (default: measured)")
    ca.add_argument("--n-sim", type=int, default=1 << 18, help="largest n simulated to count traffic")
    ca.add_argument("--traffic-from", default=None,
                    help="an earlier calibration.json whose projection traffic is reused (no re-simulation)")
    ca.add_argument("--out", default=None, help="folder for calibration.md/.json/.png")
    em = sub.add_parser("emulate", help="run a command on P ranks of an emulated slow-link cluster (root)")
    from .emulate import add_arguments as _emulate_arguments

    _emulate_arguments(em)
    tr = sub.add_parser("train", help="convergence comparison: digits MLP or a transformer LM (4 gloo ranks)")
    tr.add_argument("--task", default="digits", choices=["digits", "lm"],
                    help="digits: scikit-learn's digits, an MLP; lm: a byte-level transformer language model "
                         "on the Python standard library's sources")
    tr.add_argument("--configs", type=lambda s: s.split(","),
                    default=["dense", "oktopk", "topka", "gtopk", "gaussiank", "dense-q4",
                             "dense-fp16", "oktopk-q8"],
                    help="comma-separated; each may name its schedule, e.g. oktopk/pipesgd")
    tr.add_argument("--ranks", type=int, default=4)
    tr.add_argument("--epochs", type=int, default=30, help="digits: passes over the data; lm: 50-step periods")
    tr.add_argument("--lr", type=float, default=None, help="default: the task's (digits 0.05 SGD, lm 2e-3 AdamW)")
    tr.add_argument("--optimizer", default=None, choices=["sgd", "adamw"],
                    help="default: the task's (digits: SGD with momentum, lm: AdamW)")
    tr.add_argument("--momentum", type=float, default=0.9,
                    help="SGD's momentum (one-step-stale Pipe-SGD diverged on the LM at 0.9; see README)")
    tr.add_argument("--batch", type=int, default=16, help="per rank")
    tr.add_argument("--warmup-steps", type=int, default=0,
                    help="DDP hook: dense steps first; Pipe-SGD: synchronous steps first")
    tr.add_argument("--network", default="10gbe", help="profile for the modelled time")
    tr.add_argument("--schedule", default="none", choices=["none", "wfbp", "synceasgd", "mgwfbp", "dear", "pipesgd"],
                    help="reduce with a schedule around the plain model instead of the DDP hook")
    tr.add_argument("--out", default="train", help="output folder")
    args = parser.parse_args(argv)
    if args.subcommand == "report":
        from . import report

        return report.main(args.results, args.out)
    if args.subcommand == "emulate":
        from . import emulate

        return emulate.main(args)
    if args.subcommand == "calibrate":
        from . import calibrate

        return calibrate.main(args.results, args.names, args.out, args.save, args.project, args.project_n,
                              args.n_sim, args.traffic_from)
    if args.subcommand == "train":
        return _train(args)
    if args.subcommand == "study":
        from .study import ALGORITHMS

        args.algorithms = args.algorithms or ALGORITHMS
        if args.what == "volume":
            args.ranks = args.ranks or "2,4,8,16,32,64,128,256"
            args.kinds = args.kinds or "gaussian,student_t,skewed"
        else:
            args.ranks = args.ranks or "32,64,128,256"
            args.kinds = args.kinds or "model"
    unknown = [a for a in args.algorithms if a not in algorithms()]
    if unknown:
        parser.error(f"unknown algorithm(s) {unknown}; registered: {algorithms()}")
    if args.subcommand == "study":
        return _study(args)
    if args.launcher == "external":
        from .launch import join_launched_group

        join_launched_group()  # torchrun; under mpiexec/srun resolve() finds MPI
    return _bench(args)


if __name__ == "__main__":
    sys.exit(main())
