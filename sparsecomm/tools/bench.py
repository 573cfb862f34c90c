"""One benchmark driver, one table format (nccl-tests style), JSON with the environment.

Every timed allreduce, in ``sparsecomm bench`` and in the pytest-benchmark
suites under ``benchmarks/``, goes through a :class:`Workload`: ``setup()``
(untimed: check the previous call, barrier, pick the gradient) then
``workload()`` (the timed call, device synchronised) on every rank, and
``row(times)`` turns the per-call times into one :class:`Row`. The suites hand
the workload to ``benchmark.pedantic`` (so pytest-benchmark's statistics are
the real timings); ``measure`` times it with its own loop. Columns:

    algorithm  compressor  size(B)  time(ms)  algbw  busbw  sent/rank(B)  bytes÷dense  time÷dense  selected/k

* time: median over the timed calls of this rank's time, the slowest rank's
  median taken (a collective is as slow as its slowest rank);
* algbw = dense size / time; busbw = algbw * 2(P-1)/P (allreduce convention),
  so a sparse allreduce shows the dense bandwidth it is worth;
* sent/rank: bytes sent per call, from the communicator's counters, averaged over ranks;
* selected/k: globally selected entries over k (1.0 for dense);
* select/comm/other (ms): the call's phases: selection (phases named
  ``*select*``), communication (other phases that sent or received messages)
  and the rest (input checks, error feedback, decoding, the output).

Every timed call's result is checked untimed: all ranks must hold the same.
:func:`environment` describes where a run happened (launcher, backend, P,
nodes, network, device, versions, git revision); JSON files carry it so that
``sparsecomm report`` can tell machines apart.
"""

from __future__ import annotations

import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
import zlib
from dataclasses import asdict, dataclass, field
from typing import Any, Sequence

import torch

from .. import __version__, registry
from ..api import allreduce, auto_state
from ..choice import AUTO
from ..comm.base import Communicator
from ..state import topk_count
from .launch import local_rank
from .synthetic import gradient

__all__ = ["Case", "Row", "Workload", "measure", "add_ratios", "format_table", "environment",
           "bench_device", "write_results"]


@dataclass(frozen=True)
class Case:
    """What one benchmark row times: an algorithm with its options on an n-element gradient."""

    algorithm: str
    n: int
    density: float = 0.01
    compressor: str | None = None
    dtype: str = "float32"
    kind: str = "model"


@dataclass
class Row:
    """One measured case (see the module docstring for the columns)."""

    algorithm: str
    backend: str
    ranks: int
    n: int
    density: float
    size_bytes: int
    time_ms: float
    algbw_gbs: float
    busbw_gbs: float
    sent_per_rank: float
    bytes_ratio: float = float("nan")
    time_ratio: float = float("nan")
    selected_over_k: float = 1.0
    compressor: str = "none"
    dtype: str = "float32"
    kind: str = "model"
    #: The busiest rank's critical path: sum over phases of max(sent, received) bytes and messages.
    critical_bytes: float = 0.0
    critical_messages: float = 0.0
    select_ms: float = 0.0
    comm_ms: float = 0.0
    other_ms: float = 0.0
    calls: int = 0
    #: This rank's times (seconds) of the timed calls, for spreads and re-analysis.
    times_s: list[float] = field(default_factory=list)
    suite: str = "allreduce"


def bench_device(comm: Communicator) -> torch.device:
    """CUDA where this rank has a GPU the communicator takes (NCCL; gloo and MPI stage it), else CPU."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    cuda = torch.device("cuda", local_rank() % torch.cuda.device_count())
    return cuda if comm.supports_device(cuda) else torch.device("cpu")


class Workload:
    """The timed allreduce calls of one :class:`Case` on one rank.

    1. ``__init__``: a fresh state of the case's algorithm (threshold reuse and
       error feedback, as in training) and ``variants`` synthetic gradients
       (drifting from one to the next), the output buffer allocated once.
    2. ``setup()``, untimed: check that the previous call's result is the same
       on every rank, barrier, choose the next gradient.
    3. ``workload()``, timed: one allreduce into the output buffer, the device
       synchronised; its statistics are recorded.
    4. ``row(times)``: the row of the last ``len(times)`` calls.

    Every rank must make the same calls in the same order.
    """

    def __init__(self, comm: Communicator, case: Case, device: torch.device | None = None,
                 variants: int = 4) -> None:
        self.comm, self.case = comm, case
        self.device = device or bench_device(comm)
        dtype = getattr(torch, case.dtype)
        self.grads = [gradient(comm.rank, s, case.n, case.kind, dtype).to(self.device) for s in range(variants)]
        self.compressor = None if case.compressor in (None, "none") else case.compressor
        # "auto": the state of the algorithm chosen for this size, as a user's auto_state gives.
        self.state = (auto_state(self.grads[0], case.density, comm=comm, compressor=self.compressor)
                      if case.algorithm == AUTO else registry.get(case.algorithm).state_class(case.density))
        self.out = torch.empty_like(self.grads[0])
        self.calls: list[dict] = []
        self._g: torch.Tensor = self.grads[0]
        self._checked = 0

    def setup(self) -> tuple[tuple, dict]:
        """Untimed, before every call: check the last result across ranks, barrier, next gradient."""
        if self._checked < len(self.calls):
            _check_identical(self.comm, self.out)
            self._checked = len(self.calls)
        self.comm.barrier()
        self._g = self.grads[len(self.calls) % len(self.grads)]
        return (), {}

    def __call__(self) -> torch.Tensor:
        """The timed call: one allreduce into the output buffer (device synchronised); records its stats."""
        before = self.comm.stats.bytes_sent
        allreduce(self._g, state=self.state, comm=self.comm, compressor=self.compressor, out=self.out)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        last = self.state.last
        phases = last.phases
        select = sum(p.seconds for name, p in phases.items() if "select" in name)
        comm = sum(p.seconds for name, p in phases.items()
                   if "select" not in name and (p.messages_sent or p.messages_received))
        self.calls.append({"sent": self.comm.stats.bytes_sent - before, "selected": last.global_selected,
                           "critical_bytes": last.critical_bytes, "critical_messages": last.critical_messages,
                           "select": select, "comm": comm})
        return self.out

    def row(self, times: Sequence[float]) -> Row:
        """The row of the last ``len(times)`` calls, ``times`` in seconds (this rank's); collective.

        Time: the slowest rank's median. Bytes sent and selected/k: means over
        the ranks; critical bytes and messages: the busiest rank's; the phase
        breakdown: this rank's.
        """
        if not times:
            raise ValueError("Workload.row: no timed calls (steps must be >= 1)")
        comm, case = self.comm, self.case
        if self._checked < len(self.calls):
            _check_identical(comm, self.out)
        calls = self.calls[-len(times):]
        # A collective is as slow as its slowest rank: take every rank's median, keep the max.
        t = float(comm.allreduce(torch.tensor([statistics.median(times)], dtype=torch.float64,
                                              device=comm.control_device), "max"))
        size = case.n * self.grads[0].element_size()
        algbw = size / t / 1e9
        P = comm.size

        def mean(key: str) -> float:
            return statistics.mean(c[key] for c in calls)

        # Traffic over every rank: sent bytes averaged, the critical path of the busiest rank.
        sums = comm.allreduce(torch.tensor([mean("sent"), mean("selected")], dtype=torch.float64,
                                           device=comm.control_device), "sum").tolist()
        crit = comm.allreduce(torch.tensor([mean("critical_bytes"), mean("critical_messages")],
                                           dtype=torch.float64, device=comm.control_device), "max").tolist()
        select_ms, comm_ms = 1e3 * mean("select"), 1e3 * mean("comm")
        return Row(case.algorithm, comm.name, P, case.n, case.density, size, t * 1e3, algbw,
                   algbw * 2 * (P - 1) / P if P > 1 else algbw, sums[0] / P,
                   selected_over_k=sums[1] / P / topk_count(case.density, case.n)
                   if self.state.algorithm != "dense" else 1.0,
                   compressor=self.compressor or "none", dtype=case.dtype, kind=case.kind,
                   critical_bytes=crit[0], critical_messages=crit[1],
                   select_ms=select_ms, comm_ms=comm_ms,
                   other_ms=max(0.0, 1e3 * statistics.median(times) - select_ms - comm_ms),
                   calls=len(times), times_s=[float(x) for x in times])


def measure(comm: Communicator, algorithms: list[str], n: int, density: float = 0.01,
            steps: int = 10, warmup: int = 3, kind: str = "model",
            dtype: torch.dtype = torch.float32, compressors: Sequence[str | None] = (None,)) -> list[Row]:
    """Time each algorithm (× compressor) with a :class:`Workload`; ratios are to "dense" if run.

    Args:
        comm: the ranks (every rank calls this with the same arguments).
        algorithms, compressors: what to time (None or "none": no compressor).
        n, density, kind, dtype: the synthetic gradient and the selected fraction.
        steps, warmup: timed calls after untimed ones, per case.

    Returns:
        One :class:`Row` per case, identical on every rank but the phase breakdown.
    """
    if steps < 1 or warmup < 0:
        raise ValueError(f"measure: need steps >= 1 and warmup >= 0, got {steps} and {warmup}")
    rows = []
    for name in algorithms:
        for compressor in compressors:
            case = Case(name, n, density, compressor, str(dtype).removeprefix("torch."), kind)
            work, times = Workload(comm, case), []
            for s in range(warmup + steps):
                work.setup()
                t0 = time.perf_counter()
                work()
                if s >= warmup:
                    times.append(time.perf_counter() - t0)
            rows.append(work.row(times))
    return add_ratios(rows)


def add_ratios(rows: list[Row]) -> list[Row]:
    """Fill bytes÷dense and time÷dense from the uncompressed dense row of the same n and P."""
    dense = {(r.n, r.ranks): r for r in rows if r.algorithm == "dense" and r.compressor == "none"}
    for r in rows:
        d = dense.get((r.n, r.ranks))
        if d is not None and r.algorithm != "memcpy":
            r.bytes_ratio = r.sent_per_rank / d.sent_per_rank if d.sent_per_rank else float("nan")
            r.time_ratio = r.time_ms / d.time_ms
    return rows


def _check_identical(comm: Communicator, out: torch.Tensor) -> None:
    """Every rank must hold the same result: compare a checksum across ranks."""
    if comm.size == 1:
        return
    digest = torch.tensor([float(out.double().sum()), float(out.double().abs().sum())], dtype=torch.float64,
                          device=comm.control_device)
    lo, hi = comm.allreduce(digest, "min"), comm.allreduce(digest, "max")
    if not torch.equal(lo, hi):
        raise RuntimeError(f"benchmark check failed: ranks hold different results ({lo} vs {hi})")


def _launcher() -> str:
    """Who started the ranks, from the variables each launcher sets."""
    env = os.environ
    if env.get("SPARSECOMM_LAUNCHER"):
        return env["SPARSECOMM_LAUNCHER"]
    if "TORCHELASTIC_RUN_ID" in env:
        return "torchrun"
    if "SLURM_STEP_ID" in env and "SLURM_PROCID" in env:
        return "srun"
    if any(v in env for v in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "HYDI_CONTROL_FD")):
        return "mpiexec"
    return "single process"


def _git_revision() -> str:
    """The checkout's commit (with "+dirty" for local changes), or "unknown" for an installed package."""
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        rev = subprocess.run(["git", "-C", here, "rev-parse", "HEAD"], capture_output=True, text=True,
                             timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "--no-optional-locks", "-C", here, "status", "--porcelain",
                                "--untracked-files=no"], capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return (rev + ("+dirty" if dirty else "")) if rev else "unknown"


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip() + f" ({os.cpu_count()} cpus)"
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _versions(comm: Communicator) -> dict[str, str]:
    v = {"python": platform.python_version(), "torch": torch.__version__, "sparsecomm": __version__}
    for mod in ("numpy", "mpi4py", "triton", "cupy", "numba"):
        m = sys.modules.get(mod)
        if m is not None:
            v[mod] = getattr(m, "__version__", "?")
    if comm.name == "mpi":
        from mpi4py import MPI  # optional engine, in use on this path

        v["mpi"] = MPI.Get_library_version().strip().splitlines()[0]
    if torch.cuda.is_available():
        v["cuda"] = str(torch.version.cuda)
        try:
            v["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception:  # noqa: BLE001 - builds without NCCL
            pass
    return v


def environment(comm: Communicator) -> dict[str, Any]:
    """Where and how this run happened; a collective call (every rank must call it).

    Nodes are counted as distinct host names over the ranks. The network is
    ``$SPARSECOMM_NETWORK`` (``sparsecomm emulate`` and the Slurm scripts set
    it), else "unknown".
    """
    host = socket.gethostname()
    code = torch.tensor([zlib.crc32(host.encode())], dtype=torch.float64, device=comm.control_device)
    nodes = len(set(comm.allgather(code).flatten().tolist())) if comm.size > 1 else 1
    device = bench_device(comm)
    return {"launcher": _launcher(), "backend": comm.name, "ranks": comm.size, "nodes": nodes,
            "host": host, "network": os.environ.get("SPARSECOMM_NETWORK", "unknown"),
            "device": _device_name(device), "device_type": device.type, "cpus": os.cpu_count() or 1,
            "threads": torch.get_num_threads(), "versions": _versions(comm),
            # Only rank 0's environment is written; git on every rank of a big job is a metadata storm.
            "git_revision": _git_revision() if comm.rank == 0 else "", "slurm_job": os.environ.get("SLURM_JOB_ID", ""),
            "date": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


def write_results(rows: Sequence[Any], env: dict[str, Any], path: str) -> None:
    """Write ``{"sparsecomm": env, "rows": [...]}``: what ``sparsecomm report`` reads."""
    dicts = [asdict(r) if hasattr(r, "__dataclass_fields__") else r for r in rows]
    with open(path, "w") as f:
        json.dump({"sparsecomm": env, "rows": dicts}, f, indent=2)


_COLUMNS = [("algorithm", "{:<10}"), ("compressor", "{:<6}"), ("backend", "{:<11}"), ("ranks", "{:>5}"),
            ("size_bytes", "{:>12}"), ("time_ms", "{:>10.3f}"), ("algbw_gbs", "{:>9.3f}"),
            ("busbw_gbs", "{:>9.3f}"), ("sent_per_rank", "{:>13.0f}"), ("bytes_ratio", "{:>11.4f}"),
            ("time_ratio", "{:>10.3f}"), ("selected_over_k", "{:>10.3f}"), ("select_ms", "{:>9.2f}"),
            ("comm_ms", "{:>9.2f}"), ("other_ms", "{:>9.2f}")]
_HEADERS = ["algorithm", "comp", "backend", "ranks", "size(B)", "time(ms)", "algbw", "busbw",
            "sent/rank(B)", "bytes/dense", "time/dense", "selected/k", "select", "comm", "other"]


def format_table(rows: list[Row]) -> str:
    """The rows as a fixed-width table with the standard columns (bandwidths in GB/s, phases in ms)."""
    widths = [len(fmt.format(*([0] if "d" in fmt or "f" in fmt else [""]))) for _, fmt in _COLUMNS]
    head = " ".join(h.rjust(w) if i > 2 else h.ljust(w) for i, (h, w) in enumerate(zip(_HEADERS, widths)))
    lines = [head, "-" * len(head)]
    for r in rows:
        d = asdict(r)
        lines.append(" ".join(fmt.format(d[key]) for key, fmt in _COLUMNS))
    return "\n".join(lines)
