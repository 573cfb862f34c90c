"""Benchmarks run on real ranks: under torchrun (gloo/NCCL), mpiexec/srun (MPI), or alone.

    torchrun --nproc-per-node 4 -m pytest benchmarks/            # gloo on a laptop
    mpiexec -n 4 python -m pytest benchmarks/                    # MPI
    srun -N 64 --ntasks-per-node 1 python -m pytest benchmarks/  # a cluster

Every rank runs the same tests in the same order with fixed rounds (pedantic
mode), so all ranks make the same collective calls. Only rank 0 prints and
writes ``--benchmark-json``; it also prints an nccl-tests style table
(``sparsecomm.bench`` columns) at the end. Sizes: ``SPARSECOMM_BENCH_SIZES``
(comma-separated element counts, default "4000000,25000000"). Under torchrun
the process group is NCCL where CUDA is available, else gloo;
``SPARSECOMM_DIST_BACKEND`` chooses (e.g. gloo for several ranks on one GPU).
Tensors are on the rank's GPU where the communicator takes them.
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
            backend = os.environ.get("SPARSECOMM_DIST_BACKEND") or ("nccl" if torch.cuda.is_available() else "gloo")
            if backend == "nccl":
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            dist.init_process_group(backend)
    return sparsecomm.resolve()


ROWS: list = []
#: Rows of test_steady_state.py (dicts), printed as one table with ratios to ``add``.
STEADY: list = []


def _steady_table() -> str:
    add = {r["n"]: r["ms"] for r in STEADY if r["algorithm"] == "add"}
    lines = [f"{'algorithm':>10} {'n':>11} {'time ms':>9} {'/add':>6} {'faults':>7} "
             f"{'exact%':>7} {'sel/k':>6} {'worst':>6}"
             + ("  kernels copies syncs" if any("syncs" in r for r in STEADY) else "")]
    for r in STEADY:
        if r["algorithm"] == "add":
            lines.append(f"{'add':>10} {r['n']:>11} {r['ms']:>9.2f} {1.0:>6.2f}")
            continue
        ratio = r["ms"] / add[r["n"]] if r["n"] in add else float("nan")
        lines.append(f"{r['algorithm']:>10} {r['n']:>11} {r['ms']:>9.2f} {ratio:>6.2f} "
                     f"{r['faults_per_call']:>7.0f} {100 * r['exact_or_corrected']:>6.0f}% "
                     f"{r['selected_over_k_mean']:>6.2f} {r['selected_over_k_worst']:>6.2f}"
                     + (f"  {r['kernels']:>7} {r['copies']:>6} {r['syncs']:>5}" if "syncs" in r else ""))
    for r in STEADY:
        if r.get("sync_sites"):
            lines.append(f"{r['algorithm']} syncs at: "
                         + ", ".join(f"{site} x{c}" for site, c in sorted(r["sync_sites"].items())))
    return "\n".join(lines)


def pytest_terminal_summary(terminalreporter):
    if STEADY and _launched_rank() == 0:
        terminalreporter.write_sep("=", "steady-state call at world size 1, one thread (ratios to add)")
        terminalreporter.write_line(_steady_table())
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
