"""Entry point run under mpiexec by the MPI engine tests: ``mpi_worker.py CASE[,CASE...] OUTDIR``."""

from __future__ import annotations

import sys

import cases
import loop_cases
import schedule_cases
import test_gpu_equals_cpu
import test_properties
import torch


def main() -> None:
    from mpi4py import MPI

    import sparsecomm
    from sparsecomm.comm.mpi import MPICommunicator
    from sparsecomm.tools.launch import save_result

    case, outdir = sys.argv[1], sys.argv[2]
    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    torch.set_num_threads(1)
    bodies = {
        "comm": lambda: cases.check_comm(MPICommunicator(world, timeout=60)),
        "allreduce": lambda: cases.allreduce_cases(rank, size),  # resolution finds COMM_WORLD
        "bad_input": lambda: cases.bad_input_cases(rank, size),
        "resolve": lambda: sparsecomm.resolve().name,
        "properties": lambda: test_properties._seeded_cases(rank, size, test_properties.SEEDS),
        # Both devices in the same launch: the launcher's node size (``oktopk2l``'s G) is the same.
        "matrix_cuda": lambda: {d: test_gpu_equals_cpu.matrix(rank, size, d) for d in ("cuda", "cpu")},
        "engine": lambda: cases.engine_cases(rank, size),
        "schedules": lambda: schedule_cases.schedule_cases(rank, size),
        "oktopk_reuse": lambda: cases.oktopk_reuse_cases(rank, size),
        "loops": lambda: loop_cases.property_cases(rank, size, "oktopk", 200),
    }
    if "," in case:  # several cases on one launch: each rank's result is a dict by case
        save_result(outdir, rank, lambda: {name: bodies[name]() for name in case.split(",")})
    else:
        save_result(outdir, rank, bodies[case])


if __name__ == "__main__":
    main()
