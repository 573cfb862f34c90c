"""Benchmark suites on real ranks, the same under every launcher.

    python -m pytest benchmarks/                                   # one process
    torchrun --nproc-per-node 4 -m pytest benchmarks/              # gloo on a laptop (NCCL with GPUs)
    mpiexec -n 4 python -m pytest benchmarks/                      # MPI
    srun -N 64 --ntasks-per-node 1 python -m pytest benchmarks/    # Slurm (benchmarks/slurm/)
    sparsecomm emulate --ranks 4 --rate 1gbit -- python -m pytest benchmarks/test_allreduce.py

Suites: ``test_allreduce.py`` (every algorithm × sizes × densities ×
compressors), ``test_kernels.py`` (local kernels, one process),
``test_ddp.py`` (a DDP step with each communication hook),
``test_schedules.py`` (a training step under each schedule) and
``test_steady_state.py`` (the world-size-1 floor).

Every rank runs the same tests in the same order with fixed rounds (pedantic
mode, a barrier before every round), so all ranks make the same collective
calls. Only rank 0 prints and writes ``--benchmark-json``; that JSON holds
pytest-benchmark's own statistics (rank 0's real per-call times), each
benchmark's row under ``extra_info["row"]`` (with the slowest rank's median),
and the run's environment under the top-level key ``"sparsecomm"``
(``sparsecomm.tools.bench.environment``): ``sparsecomm report`` reads it.

Environment: ``SPARSECOMM_BENCH_SIZES`` (elements, default "4000000,25000000"),
``SPARSECOMM_BENCH_ROUNDS``. Under torchrun the process group is NCCL where
CUDA is available, else gloo; ``SPARSECOMM_DIST_BACKEND`` chooses. Under an MPI
launcher the DDP suite starts a torch.distributed group of the same ranks
(address agreed over MPI).
"""

from __future__ import annotations

import datetime
import os

import pytest
import torch

#: The run's environment (``sparsecomm.tools.bench.environment``), set by the ``comm`` fixture on every rank.
ENV: dict = {}
#: Rows of test_allreduce.py (``sparsecomm.tools.bench.Row``), printed as one nccl-tests style table.
ROWS: list = []
#: Rows of test_steady_state.py (dicts), printed as one table with ratios to ``add``.
STEADY: list = []
#: Rows of the step suites (dicts: suite, config, time_ms, ...), printed with ratios to "none".
STEPS: list = []


def _launched_rank() -> int:
    for var in ("RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "SLURM_PROCID"):
        if var in os.environ:
            return int(os.environ[var])
    return 0


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config):
    """One process per rank, whatever the project's pytest options say: the tests' parallel
    workers (pyproject.toml's ``-n auto``) would time several benchmarks at once, and each
    rank must make the same collective calls in the same order."""
    if getattr(config.option, "numprocesses", None):
        config.option.numprocesses, config.option.dist = None, "no"
    # Started from a test that runs on a worker of the tests' pytest-xdist, this process inherits
    # the worker's PYTEST_XDIST_WORKER, which switches pytest-benchmark off: it is no worker.
    if not hasattr(config, "workerinput"):
        os.environ.pop("PYTEST_XDIST_WORKER", None)


@pytest.hookimpl(trylast=True)
def pytest_configure(config):
    if _launched_rank() != 0:  # one readable report: every rank but 0 runs silently
        from _pytest._io import TerminalWriter

        reporter = config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter._tw = TerminalWriter(open(os.devnull, "w"))
        # pytest-benchmark read its options in its own pytest_configure (before this one):
        # switch saving off on its session, or every rank writes the same JSON file.
        bs = getattr(config, "_benchmarksession", None)
        if bs is not None:
            bs.json, bs.save, bs.autosave = None, None, False
        config.option.benchmark_json = None
        config.option.benchmark_autosave = False


def _dist_backend() -> str:
    return os.environ.get("SPARSECOMM_DIST_BACKEND") or ("nccl" if torch.cuda.is_available() else "gloo")


@pytest.fixture(scope="session")
def comm():
    import sparsecomm
    from sparsecomm.tools.bench import environment
    from sparsecomm.tools.launch import join_launched_group

    join_launched_group()
    c = sparsecomm.resolve()
    ENV.update(environment(c))
    return c


@pytest.fixture(scope="session")
def torch_group(comm):
    """torch.distributed's default group over the same ranks (DDP needs it), started if need be.

    Under MPI (mpiexec, srun) rank 0 picks a port and the ranks agree on its
    address over MPI; alone, a group of one on loopback.
    """
    import socket

    import torch.distributed as dist

    if not dist.is_initialized():
        from sparsecomm.tools.launch import local_rank

        # Rank 0 resolves its address; every rank learns whether that worked, so a failure
        # raises everywhere instead of leaving the others waiting in the broadcast.
        msg = [0.0] * 6
        if comm.rank == 0:
            try:
                host = "127.0.0.1"
                if comm.size > 1:  # MASTER_ADDR where the host name does not resolve to a reachable address
                    host = socket.gethostbyname(os.environ.get("MASTER_ADDR") or socket.gethostname())
                    if host.startswith("127.") and ENV.get("nodes", 1) > 1:
                        raise OSError(f"{socket.gethostname()} resolves to {host}; set MASTER_ADDR")
                with socket.socket() as s:
                    s.bind(("", 0))
                    port = s.getsockname()[1]
                msg = [1.0] + [float(b) for b in socket.inet_aton(host)] + [float(port)]
            except OSError as exc:
                print(f"torch_group: rank 0 cannot offer an address: {exc}", flush=True)
        msg = comm.broadcast(torch.tensor(msg, dtype=torch.float64, device=comm.control_device), 0).tolist()
        if not msg[0]:
            raise RuntimeError("torch_group: rank 0 could not pick an address for torch.distributed "
                               "(set MASTER_ADDR to this node's reachable address)")
        host, port = ".".join(str(int(b)) for b in msg[1:5]), int(msg[5])
        backend = _dist_backend()
        if backend == "nccl":
            torch.cuda.set_device(local_rank() % torch.cuda.device_count())
        dist.init_process_group(backend, init_method=f"tcp://{host}:{port}", rank=comm.rank,
                                world_size=comm.size, timeout=datetime.timedelta(seconds=300))
        yield dist.group.WORLD
        # Left up, gloo's threads alive at interpreter exit abort the process now and then.
        dist.destroy_process_group()
    else:
        yield dist.group.WORLD


def pytest_benchmark_update_json(config, benchmarks, output_json):
    output_json["sparsecomm"] = dict(ENV)


def _steady_table() -> str:
    add = {(r["n"], r.get("threads")): r["ms"] for r in STEADY if r["algorithm"] == "add"}
    into = {(r["algorithm"], r["n"], r.get("threads"), r.get("workload")): r["ms"]
            for r in STEADY if r.get("call") == "out"}
    lines = [f"{'algorithm':>10} {'n':>11} {'call':>5} {'thr':>7} {'workload':>8} {'time ms':>9} {'add ms':>7} "
             f"{'/add':>6} {'/out=':>6} {'faults':>7} {'exact%':>7} {'sel/k':>6} {'worst':>6}"
             + ("  kernels copies syncs" if any("syncs" in r for r in STEADY) else "")]
    for r in STEADY:
        threads = r.get("threads", "1")
        if r["algorithm"] == "add":
            lines.append(f"{'add':>10} {r['n']:>11} {'':>5} {threads:>7} {'':>8} {r['ms']:>9.2f} {r['ms']:>7.2f} "
                         f"{1.0:>6.2f}")
            continue
        yardstick = r.get("add_ms", add.get((r["n"], threads)))  # the add timed next to its calls
        ratio = r["ms"] / yardstick if yardstick else float("nan")
        base = into.get((r["algorithm"], r["n"], threads, r.get("workload")))
        lines.append(f"{r['algorithm']:>10} {r['n']:>11} {r.get('call', 'out'):>5} {threads:>7} "
                     f"{r.get('workload', 'drift'):>8} {r['ms']:>9.2f} {yardstick or float('nan'):>7.2f} "
                     f"{ratio:>6.2f} {r['ms'] / base if base else float('nan'):>6.2f} "
                     f"{r['faults_per_call']:>7.0f} {100 * r['exact_or_corrected']:>6.0f}% "
                     f"{r['selected_over_k_mean']:>6.2f} {r['selected_over_k_worst']:>6.2f}"
                     + (f"  {r['kernels']:>7} {r['copies']:>6} {r['syncs']:>5}" if "syncs" in r else ""))
    for r in STEADY:
        if r.get("sync_sites"):
            lines.append(f"{r['algorithm']} syncs at: "
                         + ", ".join(f"{site} x{c}" for site, c in sorted(r["sync_sites"].items())))
    return "\n".join(lines)


def pytest_terminal_summary(terminalreporter):
    if _launched_rank() != 0:
        return
    if ENV:
        terminalreporter.write_sep("=", "environment")
        terminalreporter.write_line(", ".join(f"{k}={v}" for k, v in ENV.items() if k != "versions"))
        terminalreporter.write_line(", ".join(f"{k} {v}" for k, v in ENV.get("versions", {}).items()))
    if STEADY:
        terminalreporter.write_sep("=", "steady-state call at world size 1 (ratios to add and to the out= call)")
        terminalreporter.write_line(_steady_table())
    if ROWS:
        from sparsecomm.tools.bench import add_ratios, format_table

        terminalreporter.write_sep("=", "sparsecomm allreduce (nccl-tests columns; ratios to dense)")
        terminalreporter.write_line(format_table(add_ratios(ROWS)))
    for suite in dict.fromkeys(r["suite"] for r in STEPS):
        rows = [r for r in STEPS if r["suite"] == suite]
        none = next((r["time_ms"] for r in rows if r["config"] == "none"), float("nan"))
        terminalreporter.write_sep("=", f"{suite}: time per training step (slowest rank's median)")
        terminalreporter.write_line(f"{'config':<28} {'ranks':>5} {'step ms':>9} {'/none':>7} {'planned ms':>10}")
        for r in rows:
            # MG-WFBP: the step its plan predicts (the step without communication, its backward
            # replaced by the plan's end of the last allreduce), against the measured one.
            planned = (f"{none - r['backward_ms'] + r['planned_comm_ms']:>10.2f}"
                       if "planned_comm_ms" in r else "")
            # The step without communication timed next to this row's rounds, where it was.
            yardstick = r.get("none_ms", none)
            terminalreporter.write_line(f"{r['config']:<28} {r['ranks']:>5} {r['time_ms']:>9.2f} "
                                        f"{r['time_ms'] / yardstick:>7.2f} {planned}"
                                        + (f"  (none beside: {yardstick:.2f})" if "none_ms" in r else ""))
