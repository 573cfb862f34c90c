"""Entry point run under mpiexec by the MPI engine tests: ``mpi_worker.py CASE OUTDIR``."""

from __future__ import annotations

import sys
import traceback

import torch

import cases


def main() -> None:
    from mpi4py import MPI

    import sparsecomm
    from sparsecomm.comm.mpi import MPICommunicator

    case, outdir = sys.argv[1], sys.argv[2]
    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    torch.set_num_threads(1)
    try:
        if case == "comm":
            result = cases.check_comm(MPICommunicator(world, timeout=60))
        elif case == "allreduce":
            result = cases.allreduce_cases(rank, size)  # default resolution finds COMM_WORLD
        elif case == "bad_input":
            result = cases.bad_input_cases(rank, size)
        elif case == "resolve":
            result = sparsecomm.resolve().name
        else:
            raise ValueError(case)
        torch.save({"ok": result}, f"{outdir}/{rank}.pt")
    except BaseException:  # noqa: BLE001
        torch.save({"error": traceback.format_exc()}, f"{outdir}/{rank}.pt")


if __name__ == "__main__":
    main()
