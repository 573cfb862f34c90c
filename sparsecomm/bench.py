"""One benchmark driver, one table format (nccl-tests style), JSON output.

``measure`` runs on every rank of a communicator (all ranks make the same
calls) and returns one :class:`Row` per algorithm; ``format_table`` prints
the rows with the same columns everywhere:

    algorithm  size(B)  time(ms)  algbw(GB/s)  busbw(GB/s)  sent/rank(B)  bytes÷dense  time÷dense  selected/k

* time: median over the timed calls of the slowest rank's time per call
  (warm-up calls excluded);
* algbw = dense size / time; busbw = algbw * 2(P-1)/P (allreduce convention),
  so a sparse allreduce shows the dense bandwidth it is worth;
* sent/rank: mean bytes sent per rank per call, from the communicator's counters;
* selected/k: globally selected entries over k (1.0 for dense).

Every timed call is also checked: all ranks must hold the same result.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass

import torch

from . import registry
from .api import allreduce
from .comm.base import Communicator
from .state import topk_count
from .synthetic import gradient

__all__ = ["Row", "measure", "format_table"]


@dataclass
class Row:
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


def measure(comm: Communicator, algorithms: list[str], n: int, density: float = 0.01,
            steps: int = 10, warmup: int = 3, kind: str = "model",
            dtype: torch.dtype = torch.float32) -> list[Row]:
    """Time each algorithm on a drifting synthetic gradient; ratios are to "dense" if run.

    Each algorithm gets a fresh state (threshold reuse and error feedback, as in
    training) and sees the same gradients.
    """
    P, rows = comm.size, []
    grads = [gradient(comm.rank, s, n, kind, dtype) for s in range(warmup + steps)]
    for name in algorithms:
        spec = registry.get(name)
        state = spec.state_class(density)
        times, sent, selected = [], [], []
        for s, g in enumerate(grads):
            comm.barrier()
            before = comm.stats.bytes_sent
            t0 = time.perf_counter()
            out = allreduce(g, state=state, comm=comm)
            elapsed = time.perf_counter() - t0
            if s < warmup:
                continue
            times.append(float(comm.allreduce(torch.tensor([elapsed], dtype=torch.float64,
                                                           device=comm.control_device), "max")))
            sent.append(comm.stats.bytes_sent - before)
            selected.append(state.last.global_selected)
            _check_identical(comm, out)
        t = statistics.median(times)
        size = n * g.element_size()
        algbw = size / t / 1e9
        rows.append(Row(name, comm.name, P, n, density, size, t * 1e3, algbw,
                        algbw * 2 * (P - 1) / P if P > 1 else algbw, statistics.mean(sent),
                        selected_over_k=statistics.mean(selected) / topk_count(density, n)
                        if name != "dense" else 1.0))
    dense = next((r for r in rows if r.algorithm == "dense"), None)
    if dense is not None:
        for r in rows:
            r.bytes_ratio = r.sent_per_rank / dense.sent_per_rank if dense.sent_per_rank else float("nan")
            r.time_ratio = r.time_ms / dense.time_ms
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


_COLUMNS = [("algorithm", "{:<10}"), ("backend", "{:<11}"), ("ranks", "{:>5}"), ("size_bytes", "{:>12}"),
            ("time_ms", "{:>10.3f}"), ("algbw_gbs", "{:>11.3f}"), ("busbw_gbs", "{:>11.3f}"),
            ("sent_per_rank", "{:>13.0f}"), ("bytes_ratio", "{:>11.4f}"), ("time_ratio", "{:>10.3f}"),
            ("selected_over_k", "{:>10.3f}")]
_HEADERS = ["algorithm", "backend", "ranks", "size(B)", "time(ms)", "algbw(GB/s)", "busbw(GB/s)",
            "sent/rank(B)", "bytes/dense", "time/dense", "selected/k"]


def format_table(rows: list[Row]) -> str:
    """The rows as a fixed-width table with the standard columns."""
    widths = [len(fmt.format(*([0] if "d" in fmt or "f" in fmt else [""]))) for _, fmt in _COLUMNS]
    head = " ".join(h.rjust(w) if i > 1 else h.ljust(w) for i, (h, w) in enumerate(zip(_HEADERS, widths)))
    lines = [head, "-" * len(head)]
    for r in rows:
        d = asdict(r)
        lines.append(" ".join(fmt.format(d[key]) for key, fmt in _COLUMNS))
    return "\n".join(lines)
