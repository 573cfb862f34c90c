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
import os
import sys
from typing import Any, Callable

from ..api import algorithms
from ..comm import resolve, simulate
from ..compress import COMPRESSORS
from ..errors import InputFileError
from ..network import resolve_network
from . import argtypes as at
from . import calibrate, emulate, report, study, train
from .bench import environment, format_table, measure, write_results
from .launch import join_launched_group, spawn
from .output import progress, write_json
from .synthetic import KINDS
from .tasks import OPTIMIZERS, TASKS
from .train import check_warmup, parse_config

__all__ = ["build_parser", "main"]


def _bench_rank(rank: int, size: int, args: argparse.Namespace) -> tuple[list, dict]:
    comm = resolve()
    rows = measure(comm, args.algorithms, args.n, args.density, args.steps, args.warmup, args.kind,
                   compressors=args.compressors)
    return rows, environment(comm)


def _bench(args: argparse.Namespace) -> int:
    if args.launcher == "spawn":
        os.environ.setdefault("SPARSECOMM_LAUNCHER", "spawn")  # the spawned ranks inherit it
        rows, env = spawn(args.ranks, _bench_rank, args)[0]
    elif args.launcher == "sim":
        os.environ.setdefault("SPARSECOMM_LAUNCHER", "sim")
        rows, env = simulate(args.ranks, lambda r: _bench_rank(r, args.ranks, args)).results[0]
    else:
        join_launched_group()  # torchrun; under mpiexec/srun resolve() finds MPI
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


#: ``study``'s world sizes, gradient kinds and elements left unsaid, by study: the plain run is a
#: first look of seconds, ``--full`` the study of docs/results.md.
STUDY_DEFAULTS = {
    ("volume", False): ([2, 4, 8, 16], ["gaussian"], 1 << 17),
    ("volume", True): ([2, 4, 8, 16, 32, 64, 128, 256], ["gaussian", "student_t", "skewed"], 1 << 20),
    ("bert", False): ([8, 16, 32], ["model"], 1 << 17),
    ("bert", True): ([32, 64, 128, 256], ["model"], 1 << 20),
}


def _study(args: argparse.Namespace) -> int:
    volume = args.what == "volume"
    default_sizes, default_kinds, default_n = STUDY_DEFAULTS[(args.what, args.full)]
    sizes, kinds, args.n = args.ranks or default_sizes, args.kinds or default_kinds, args.n or default_n
    algs = args.algorithms or algorithms()
    print(f"# sparsecomm study {args.what}: n={args.n:,} density={args.density} tau={args.tau} "
          f"P={sizes} kinds={kinds}", flush=True)
    done: list = []
    base = os.path.join(args.out, args.what)
    bar = progress(total=len(kinds) * len(sizes) * len(algs), desc="study", unit="case")

    def measured(row: "study.VolumeRow") -> None:
        done.append(row)
        os.makedirs(args.out, exist_ok=True)  # only once there is something to keep
        write_json(done, base + ".partial.json")  # a long study keeps what it measured
        bar.update()
        bar.write(f"  {row.kind:<9} P={row.P:<4} {row.algorithm:<10} bytes/rank max {row.bytes_max:>14,.0f} "
                  f"mean {row.bytes_mean:>14,.0f}  msgs max {row.messages_max:>6.0f}  "
                  f"measured/formula {row.ratio:6.3f}", file=sys.stdout)
        sys.stdout.flush()

    with bar:
        rows = study.volume_study(sizes, algs, kinds, args.n, args.density, args.tau, progress=measured)
    write_json(rows, base + ".json")
    study.write_csv(rows, base + ".csv")
    if volume:
        study.plot_volume(rows, base + ".png")
        _print_ratios(rows)
    else:
        proj = []
        for net in args.networks:
            proj += study.project(rows, net, args.target_n)
        write_json(proj, base + "_projection.json")
        for net in args.networks:
            sub = [d for d in proj if d["network"] == net]
            study.plot_projection(sub, f"{base}_{net}.png")
            _print_projection(sub)
    print(f"# wrote {base}.json, .csv and plot(s) in {args.out}")
    return 0


def _train_plan(args: argparse.Namespace) -> None:
    """The configurations and epochs left unsaid: a first run of about a minute, or ``--full``."""
    if args.configs is None:
        args.configs = list(train.FULL_CONFIGS if args.full else train.QUICK_CONFIGS)
    if args.epochs is None:
        args.epochs = train.FULL_EPOCHS if args.full else train.QUICK_EPOCHS[args.task]


def _train(args: argparse.Namespace) -> int:
    _train_plan(args)
    print(f"# sparsecomm train: task {args.task}, {args.ranks} gloo ranks, {args.epochs} epochs, "
          f"configs {','.join(args.configs)}", flush=True)
    # One configuration at a time, the JSON rewritten after each: a run that fails (a diverging
    # configuration raises on NaN) is reported and the others still land.
    results, failed = [], []
    compute = train.measure_compute(args.task, args.batch, args.optimizer, seed=args.seed)  # one figure for all
    for config in args.configs:
        try:
            results += train.run([config], ranks=args.ranks, epochs=args.epochs, compute_per_step=compute, lr=args.lr,
                                 batch=args.batch, network=args.network, schedule=args.schedule, task=args.task,
                                 optimizer=args.optimizer, warmup_steps=args.warmup_steps,
                                 momentum=args.momentum, eval_every=args.eval_every, seed=args.seed,
                                 diloco_options={"sync_every": args.sync_every})
        except Exception as exc:  # noqa: BLE001 - reported, and the next configuration runs
            failed.append(config)
            # The error itself, not the note on how a process then ended (the JSON has it all).
            lines = [x for x in str(exc).strip().splitlines() if x.strip() and not x.startswith("(then")]
            print(f"\n# {config} failed: {lines[-1] if lines else type(exc).__name__}", flush=True)
            results.append({"config": config, "failed": str(exc)})
        if len(results) > len(failed):  # a file only once some configuration trained
            os.makedirs(args.out, exist_ok=True)
            write_json(results, os.path.join(args.out, "train.json"))
    done = [r for r in results if "failed" not in r]
    if not done:
        print(f"sparsecomm train: every configuration failed ({', '.join(failed)}); nothing written",
              file=sys.stderr)
        return 1
    print(train.format_results(done))
    tta = train.time_to_accuracy(done)
    if tta:
        print(train.format_time_to_accuracy(tta))
        write_json(tta, os.path.join(args.out, "time_to_accuracy.json"))
    train.plot(done, os.path.join(args.out, "train.png"))
    print(f"# wrote {args.out}/train.json and {args.out}/train.png"
          + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


def _train_problem(args: argparse.Namespace) -> str | None:
    """An option combination ``train`` would refuse for a configuration, before any rank starts."""
    _train_plan(args)
    for config in args.configs:
        own = train.own_optimizer(parse_config(config)[0])
        if own and args.schedule != "none":
            return f"argument --schedule: {config} is its own optimizer's communication (-{own}), under no schedule"
        try:
            check_warmup(parse_config(config)[1] or args.schedule, args.warmup_steps)
        except ValueError as exc:
            return f"argument --warmup-steps: {config}: {exc}"
    return None


def _report(args: argparse.Namespace) -> int:
    return report.main(args.results, args.out)


def _calibrate(args: argparse.Namespace) -> int:
    return calibrate.main(args.results, args.names, args.out, args.save, args.project, args.project_n,
                          args.n_sim, args.traffic_from)


def _emulate(args: argparse.Namespace) -> int:
    return emulate.main(args)


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


def _names(known: at.Known, what: str) -> Callable[[str], list]:
    """A comma-separated list of names from ``known`` (a registry: a sequence or a function)."""
    return at.comma_list(at.name_in(known, what))


def _command(sub: Any, name: str, help: str, run: Callable[[argparse.Namespace], int],
             check: Callable[[argparse.Namespace], str | None] | None = None) -> argparse.ArgumentParser:
    """Add subcommand ``name``; parsed arguments carry what runs it and ``check``, a test of option
    combinations that no single type can make.

    Both are module-level functions: the arguments must pickle, since ``bench``'s default
    launcher sends them to the ranks it spawns (a parser in them would not pickle).
    """
    command = sub.add_parser(name, help=help)
    command.set_defaults(run=run, check=check)
    return command


def _subcommand(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    """The parser of subcommand ``name``, which reports that command's errors."""
    (subparsers,) = (a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return subparsers.choices[name]


def build_parser() -> argparse.ArgumentParser:
    """The ``sparsecomm`` parser: one subcommand each, every argument checked by its type."""
    network = at.checked_by(resolve_network, "network")
    parser = argparse.ArgumentParser(prog="sparsecomm", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="subcommand", required=True)
    b = _command(sub, "bench", "time sparse and dense allreduces on local or launched ranks", _bench)
    b.add_argument("--ranks", type=at.positive_int, default=4, help="local ranks to start (spawn/sim)")
    b.add_argument("--n", type=at.positive_int, default=4_000_000, help="gradient elements per rank")
    b.add_argument("--density", type=at.density, default=0.01, help="fraction selected, in (0, 1]")
    b.add_argument("--steps", type=at.positive_int, default=10, help="timed calls per algorithm")
    b.add_argument("--warmup", type=at.nonnegative_int, default=3, help="untimed calls first")
    b.add_argument("--kind", choices=KINDS, default="model", help="synthetic gradient")
    b.add_argument("--algorithms", type=_names(lambda: [*algorithms(), "auto"], "algorithm"),
                   default=["oktopk", "dense"],
                   help=f"comma-separated, from {', '.join(algorithms())}, auto (the one the network model "
                        "favours for --n: sparsecomm.choose)")
    b.add_argument("--compressors", type=_names(["none", *COMPRESSORS], "compressor"), default=["none"],
                   help=f"comma-separated, from none, {', '.join(COMPRESSORS)}")
    b.add_argument("--launcher", choices=["spawn", "sim", "external"], default="spawn",
                   help="spawn gloo processes, simulate in-process, or use ranks "
                        "started by torchrun/mpiexec/srun")
    b.add_argument("--json", type=at.new_file, help="also write the rows to this JSON file")
    st = _command(sub, "study", "volume and scaling study in the simulated world", _study)
    st.add_argument("what", choices=["volume", "bert"],
                    help="volume: bytes/messages per rank vs P for every algorithm; "
                         "bert: the same at P=32..256 projected to BERT's 133,547,324 elements")
    st.add_argument("--ranks", type=at.comma_list(at.int_in(2)), default=None,
                    help="comma-separated world sizes, each >= 2 (default: volume 2..16, bert 8..32; "
                         "--full: volume 2..256, bert 32..256)")
    st.add_argument("--n", type=at.positive_int, default=None,
                    help="elements per rank in the simulation (default 131072; --full 1048576)")
    st.add_argument("--full", action="store_true",
                    help="the full study of docs/results.md (P to 256, n = 2^20, volume: three kinds); "
                         "--ranks, --kinds and --n still choose")
    st.add_argument("--density", type=at.density, default=0.01, help="fraction selected, in (0, 1]")
    st.add_argument("--tau", type=at.positive_int, default=4, help="threshold period (calls 2..tau are measured)")
    st.add_argument("--kinds", type=_names(KINDS, "gradient kind"), default=None,
                    help=f"gradient kinds, comma-separated, from {', '.join(KINDS)} "
                         "(default: volume gaussian, --full gaussian,student_t,skewed; bert model)")
    st.add_argument("--algorithms", type=_names(algorithms(), "algorithm"), default=None,
                    help=f"comma-separated, from {', '.join(algorithms())} (default: all)")
    st.add_argument("--networks", type=at.comma_list(network), default="pizdaint,10gbe,56gbib,100gbib",
                    help="profiles (or alpha:beta) for the projection")
    st.add_argument("--target-n", type=at.positive_int, default=133_547_324)
    st.add_argument("--out", type=at.out_folder, default="study", help="output folder")
    rp = _command(sub, "report", "tables and plots from benchmark JSON files (any machines)", _report)
    rp.add_argument("results", nargs="+",
                    help="pytest-benchmark JSON of benchmarks/, sparsecomm bench --json, or folders of them")
    rp.add_argument("--out", type=at.out_folder, default=None, help="folder for report.md, rows.csv and the plots")
    ca = _command(sub, "calibrate", "fit the network model's alpha, beta (and local costs) to measured runs",
                  _calibrate)
    ca.add_argument("results", nargs="+", help="allreduce suite or sparsecomm bench JSON at P > 1")
    ca.add_argument("--names", type=at.comma_list(str), default=None,
                    help="profile names, one per machine found (comma-separated, in sorted machine order)")
    ca.add_argument("--save", action="store_true", help="save the profiles where resolve_network finds them")
    ca.add_argument("--project", type=at.nonnegative_int, default=256,
                    help="project to this many ranks (0: no projection; the projection simulates them: "
                         "256 takes about 20 s on 2 cores, 1024 about 2 minutes)")
    ca.add_argument("--project-n", type=at.positive_int, default=None,
                    help="elements for the projection (default: measured)")
    ca.add_argument("--n-sim", type=at.int_in(2), default=1 << 18, help="largest n simulated to count traffic")
    ca.add_argument("--traffic-from", default=None,
                    help="an earlier calibration.json whose projection traffic is reused (no re-simulation)")
    ca.add_argument("--out", type=at.out_folder, default=None, help="folder for calibration.md/.json/.png")
    em = _command(sub, "emulate", "run a command on P ranks of an emulated slow-link cluster (root)", _emulate)
    emulate.add_arguments(em)
    tr = _command(sub, "train", "convergence comparison: digits MLP or a transformer LM (4 gloo ranks)", _train,
                  check=_train_problem)
    tr.add_argument("--task", default="digits", choices=list(TASKS),
                    help="digits: scikit-learn's digits, an MLP; lm: a byte-level transformer language model "
                         "on the Python standard library's sources")
    tr.add_argument("--configs", type=at.comma_list(at.checked_by(train.parse_config, "configuration")),
                    default=None,
                    help="comma-separated: dense (DDP's own allreduce) or ALGORITHM[-COMPRESSOR][-hook|-diloco|-demo|"
                         "-sparseadamw], e.g. oktopk (SGD: the DDP hook; AdamW: the recommended method, "
                         "decoupled momentum with the rms rule), topka-q8, dense-q8, oktopk-hook (the hook under AdamW too), "
                         "oktopk-diloco (outer steps every --sync-every steps; dense-diloco: DiLoCo), topka-demo "
                         "(DeMo itself), oktopk-sparseadamw (SparseAdamW) "
                         f"(default: {','.join(train.QUICK_CONFIGS)}; "
                         f"--full: {','.join(train.FULL_CONFIGS)}); each may name its schedule, e.g. oktopk/pipesgd")
    tr.add_argument("--ranks", type=at.positive_int, default=4)
    tr.add_argument("--epochs", type=at.positive_int, default=None,
                    help="digits: passes over the data; lm: 50-step periods (default: digits "
                         f"{train.QUICK_EPOCHS['digits']}, lm {train.QUICK_EPOCHS['lm']}; --full: {train.FULL_EPOCHS})")
    tr.add_argument("--full", action="store_true",
                    help="the full comparison: every configuration, 30 epochs (digits: about 5 minutes on "
                         "2 cores); --configs and --epochs still choose")
    tr.add_argument("--lr", type=at.positive_float, default=None,
                    help="default: the task's (digits 0.05 SGD, lm 2e-3 AdamW; -demo, DeMo's sign "
                         "rule: half of it)")
    tr.add_argument("--optimizer", default=None, choices=OPTIMIZERS,
                    help="default: the task's (digits: SGD with momentum, lm: AdamW)")
    tr.add_argument("--momentum", type=at.float_in(0.0, 1.0, hi_open=True), default=0.9,
                    help="SGD's momentum (one-step-stale Pipe-SGD diverged on the LM at 0.9; see README)")
    tr.add_argument("--batch", type=at.positive_int, default=16, help="per rank")
    tr.add_argument("--warmup-steps", type=at.nonnegative_int, default=0,
                    help="DDP hook: dense steps first; Pipe-SGD: synchronous steps first; "
                         "-sparseadamw: SparseAdamW's dense steps (default 10)")
    tr.add_argument("--sync-every", type=at.positive_int, default=10,
                    help="-diloco configurations: inner steps between outer steps")
    tr.add_argument("--network", type=network, default="10gbe", help="profile for the modelled time")
    tr.add_argument("--eval-every", type=at.nonnegative_int, default=10,
                    help="evaluate every so many steps too, for the time to accuracy (0: per epoch only)")
    tr.add_argument("--seed", type=at.nonnegative_int, default=0, help="model, data split and batches")
    tr.add_argument("--schedule", default="none", choices=train.SCHEDULES,
                    help="reduce with a schedule around the plain model instead of the DDP hook")
    tr.add_argument("--out", type=at.out_folder, default="train", help="output folder")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one ``sparsecomm`` command; its exit status (2: bad arguments or input files)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    command = _subcommand(parser, args.subcommand)
    problem = args.check(args) if args.check else None
    if problem:
        command.error(problem)
    try:
        return args.run(args)
    except InputFileError as exc:  # one line naming the file, as argparse reports a bad argument
        command.exit(2, f"{command.prog}: {exc}\n")


if __name__ == "__main__":
    sys.exit(main())
