"""Benchmarks run on real ranks: under torchrun (gloo/NCCL), mpiexec/srun (MPI), or alone.

    torchrun --nproc-per-node 4 -m pytest benchmarks/            # gloo on a laptop
    mpiexec -n 4 python -m pytest benchmarks/                    # MPI
    srun -N 64 --ntasks-per-node 1 python -m pytest benchmarks/  # a cluster

Every rank runs the same tests in the same order with fixed rounds (pedantic
mode), so all ranks make the same collective calls. Only rank 0 prints and
writes ``--benchmark-json``; it also prints an nccl-tests style table
(``sparsecomm.bench`` columns) at the end. Sizes: ``SPARSECOMM_BENCH_SIZES``
(comma-separated element counts, default "4000000,25000000").
"""

from __future__ import annotations

import os

import pytest
import torch


def _launched_rank() -> int:
    for var in ("RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "SLURM_PROCID"):
        if var in os.environ:
            return int(os.environ[var])
    return 0


@pytest.hookimpl(trylast=True)
def pytest_configure(config):
    if _launched_rank() != 0:  # one readable report: every rank but 0 runs silently
        from _pytest._io import TerminalWriter

        reporter = config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter._tw = TerminalWriter(open(os.devnull, "w"))
        config.option.benchmark_json = None
        config.option.benchmark_autosave = False


@pytest.fixture(scope="session")
def comm():
    import sparsecomm

    if "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "MASTER_ADDR" in os.environ):
        import torch.distributed as dist

        if not dist.is_initialized():
            dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    return sparsecomm.resolve()


ROWS: list = []


def pytest_terminal_summary(terminalreporter):
    if ROWS and _launched_rank() == 0:
        from sparsecomm.bench import format_table

        dense = {(r.n,): r for r in ROWS if r.algorithm == "dense"}
        for r in ROWS:
            d = dense.get((r.n,))
            if d is not None and r.algorithm != "memcpy":
                r.bytes_ratio = r.sent_per_rank / d.sent_per_rank if d.sent_per_rank else float("nan")
                r.time_ratio = r.time_ms / d.time_ms
        terminalreporter.write_sep("=", "sparsecomm allreduce (nccl-tests columns; ratios to dense)")
        terminalreporter.write_line(format_table(ROWS))
