"""The ``sparsecomm`` command.

``sparsecomm bench``: start local ranks (torch.multiprocessing + gloo, or the
simulated world), run Ok-Topk and Dense on a realistic synthetic gradient, and
print one table. Works on a fresh machine with no GPU and no MPI. Under an
existing launcher (torchrun, mpiexec, srun) use ``--launcher external``: the
ranks are already there and the command runs on each of them.
"""

from __future__ import annotations

import argparse
import sys

__all__ = ["main"]


def _bench_rank(rank: int, size: int, args: argparse.Namespace) -> list:
    from .bench import measure
    from .comm import resolve

    return measure(resolve(), args.algorithms, args.n, args.density, args.steps, args.warmup, args.kind)


def _bench(args: argparse.Namespace) -> int:
    from .bench import format_table, write_json

    if args.launcher == "spawn":
        from .launch import spawn

        rows = spawn(args.ranks, _bench_rank, args)[0]
    elif args.launcher == "sim":
        from .comm import simulate

        rows = simulate(args.ranks, lambda r: _bench_rank(r, args.ranks, args)).results[0]
    else:
        from .comm import resolve

        comm = resolve()
        rows = _bench_rank(comm.rank, comm.size, args)
        if comm.rank != 0:
            return 0
    print(f"# sparsecomm bench: n={args.n} density={args.density} kind={args.kind} "
          f"steps={args.steps} (+{args.warmup} warm-up)")
    print(format_table(rows))
    if args.json:
        write_json(rows, args.json)
        print(f"# wrote {args.json}")
    return 0


def main(argv: list[str] | None = None) -> int:
    from . import algorithms
    from .synthetic import KINDS

    parser = argparse.ArgumentParser(prog="sparsecomm", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("bench", help="time sparse and dense allreduces on local or launched ranks")
    b.add_argument("--ranks", type=int, default=4, help="local ranks to start (spawn/sim)")
    b.add_argument("--n", type=int, default=4_000_000, help="gradient elements per rank")
    b.add_argument("--density", type=float, default=0.01)
    b.add_argument("--steps", type=int, default=10, help="timed calls per algorithm")
    b.add_argument("--warmup", type=int, default=3, help="untimed calls first")
    b.add_argument("--kind", choices=KINDS, default="model", help="synthetic gradient")
    b.add_argument("--algorithms", type=lambda s: s.split(","), default=["oktopk", "dense"],
                   help=f"comma-separated, from {algorithms()}")
    b.add_argument("--launcher", choices=["spawn", "sim", "external"], default="spawn",
                   help="spawn gloo processes, simulate in-process, or use ranks "
                        "started by torchrun/mpiexec/srun")
    b.add_argument("--json", help="also write the rows to this JSON file")
    args = parser.parse_args(argv)
    unknown = [a for a in args.algorithms if a not in algorithms()]
    if unknown:
        parser.error(f"unknown algorithm(s) {unknown}; registered: {algorithms()}")
    if args.launcher == "external":
        _init_external()
    return _bench(args)


def _init_external() -> None:
    """Under torchrun, join its process group; under mpiexec/srun, MPI is found by resolve()."""
    import os

    if "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "MASTER_ADDR" in os.environ):
        import torch.distributed as dist

        if not dist.is_initialized():
            dist.init_process_group("nccl" if _cuda() else "gloo")


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


if __name__ == "__main__":
    sys.exit(main())
