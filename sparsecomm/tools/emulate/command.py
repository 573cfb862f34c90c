"""``sparsecomm emulate``: its arguments and its main."""

from __future__ import annotations

import argparse

from ..argtypes import checked_by, int_in, positive_float, positive_int
from .netns import MAX_RANKS, tc_rate
from .ranks import run, say

__all__ = ["add_arguments", "main"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the options of ``sparsecomm emulate`` to ``parser`` (the command is the REMAINDER after ``--``)."""
    parser.add_argument("--ranks", "-n", type=int_in(1, MAX_RANKS), required=True, metavar="P",
                        help=f"number of ranks, 1 to {MAX_RANKS} (one network namespace each)")
    parser.add_argument("--ranks-per-node", type=int_in(1, MAX_RANKS), default=1, metavar="G",
                        help="ranks sharing a node (a namespace, its one shaped port; their own traffic "
                             "stays on its loopback); P must be a multiple of G (default: 1)")
    parser.add_argument("--rate", type=checked_by(tc_rate, "rate"), default="1gbit",
                        help="tbf rate of every port, both directions, in tc syntax (default: 1gbit)")
    parser.add_argument("--timeout", type=positive_float, default=3600.0, metavar="S",
                        help="kill every rank after S seconds (default: 3600)")
    parser.add_argument("--threads", type=positive_int, default=1, metavar="T",
                        help="OMP_NUM_THREADS of each rank (default: 1)")
    parser.add_argument("--port", type=int_in(1, 65535), default=29600, help="MASTER_PORT (default: 29600)")
    parser.add_argument("--mpi", action="store_true",
                        help="run the ranks under MPICH's mpiexec (MPI over TCP) instead of as "
                             "torch.distributed ranks (RANK, WORLD_SIZE, MASTER_ADDR)")
    parser.add_argument("--logs", metavar="DIR", default=None,
                        help="folder for the logs of ranks 1..P-1 (default: a temporary folder)")
    parser.add_argument("command", nargs=argparse.REMAINDER, metavar="-- COMMAND...",
                        help="the program run on every rank")


def main(args: argparse.Namespace) -> int:
    """Run ``sparsecomm emulate`` with parsed ``args``; return the exit status (see :func:`run`)."""
    command = list(args.command)
    if command and command[0] == "--":  # argparse keeps the separator in a REMAINDER
        command = command[1:]
    try:
        return run(args.ranks, args.rate, command, args.timeout, threads=args.threads,
                   logs=args.logs, port=args.port, mpi=args.mpi, ranks_per_node=args.ranks_per_node)
    except KeyboardInterrupt:
        # run() has stopped the ranks and removed the cluster on the way out; no traceback.
        say("interrupted; ranks stopped and the emulated cluster removed")
        return 130
