"""Volume and scaling study, and projection to cluster scale.

``volume_study`` runs every algorithm in the simulated world for a list of
world sizes and gradient kinds, in steady state (thresholds reused), and
records bytes and messages per rank (mean and max over ranks), next to the
Table 1 formula of the Ok-Topk paper (papers README, section 2). A rank's
bytes are counted as the formulas count them: phases run one after another
and a link is full-duplex, so each phase costs max(bytes sent, bytes
received) and the phases add up (``CallStats.critical_bytes``); messages
likewise.

=========  ===============================  ===================
algorithm  words received per rank          latency (messages)
=========  ===============================  ===================
dense      2n(P-1)/P                        2 log P
topka      2k(P-1)                          log P
gaussiank  2k(P-1)                          log P
topkdsa    4k(P-1)/P ... 2k(P-1)/P+n(P-1)/P  P + 2 log P
gtopk      4k ceil(log P)                   2 ceil(log P)
oktopk     2k(P-1)/P ... 6k(P-1)/P          4P + O(log P)
oktopk2d   3k(1-1/s) ... 7k(1-1/s)          7s + O(log P), s = ceil(sqrt P)
=========  ===============================  ===================

A word is 4 bytes (a COO entry, int32 index + float32 value, is 2 words; where
``kernels.message`` sends indexes as 16-bit offsets, as Ok-Topk, TopkA,
Gaussiank and TopkDSA do, an entry takes 1.5 words).
Where the table gives a range, ``formula`` is its upper end and ``formula_low``
its lower end. ``project`` turns measured messages and bytes into modelled
time on a network profile, scaling bytes linearly to a target model size.
"""

from __future__ import annotations

import csv
import functools
import inspect
import math
from dataclasses import asdict, dataclass
from typing import Iterable

import torch

from .. import registry
from ..api import allreduce
from ..comm import simulate
from ..network import Network, resolve_network
from ..state import topk_count
from .output import pyplot
from .synthetic import gradient

__all__ = ["VolumeRow", "formula_words", "volume_study", "project", "write_csv",
           "plot_volume", "plot_projection", "BERT_ELEMENTS"]

# Distinct markers and dashes: TopkA and Gaussiank often coincide and must both show.
_MARKERS = "oDsx^vP*<>"
_DASHES = ("-", "--", ":", "-.")


def _style(algorithm: str) -> tuple[str, str]:
    """(marker, dash) of an algorithm in the plots: by its place in the registry."""
    names = registry.names()
    i = names.index(algorithm) if algorithm in names else len(names)
    return _MARKERS[i % len(_MARKERS)], _DASHES[i % len(_DASHES)]
BERT_ELEMENTS = 133_547_324
WORD = 4


def formula_words(algorithm: str, n: int, k: int, P: int) -> tuple[float, float]:
    """(lower, upper) words received per rank by the algorithm's registered volume formula
    (Table 1 of the Ok-Topk paper); NaN for an algorithm registered without one."""
    volume = registry.get(algorithm).volume
    return volume(n, k, P) if volume is not None else (math.nan, math.nan)


@dataclass
class VolumeRow:
    algorithm: str
    kind: str
    P: int
    n: int
    k: int
    bytes_mean: float
    bytes_max: float
    messages_mean: float
    messages_max: float
    formula_low: float  # bytes
    formula: float  # bytes
    ratio: float  # bytes_max / formula
    selected_over_k: float


@functools.lru_cache(maxsize=64)
def _base(rank: int, n: int, kind: str) -> torch.Tensor:
    """The persistent part of a rank's gradient; for the "model" kind a shared model
    gradient plus per-rank noise of half its size (ranks see different minibatches).
    Cached: every algorithm of a study starts from the same; callers only read it."""
    return gradient(rank, 0, n, kind, drift=0.5)


def _gradient(base: torch.Tensor, rank: int, step: int) -> torch.Tensor:
    """The persistent part plus 5% fresh noise: slowly changing, like training."""
    noise = torch.randn(base.numel(), generator=torch.Generator().manual_seed(7919 * rank + step))
    return base + 0.05 * float(base.abs().mean()) * noise


def _measure(P: int, algorithm: str, n: int, density: float, kind: str, tau: int,
             warmup: int, error_feedback: bool) -> list[tuple[float, float, float]]:
    """Per rank (bytes, messages, selected) averaged over one threshold period after warm-up."""

    def body(rank: int):
        spec = registry.get(algorithm)
        takes_tau = "tau_prime" in inspect.signature(spec.state_class).parameters  # (Ok-Topk's and its grid's)
        kwargs = {"tau": tau, "tau_prime": 2 * tau} if takes_tau else {}
        if algorithm != "dense":
            kwargs["error_feedback"] = error_feedback
        state = spec.state_class(density, **kwargs)
        base = _base(rank, n, kind)
        totals = [0.0, 0.0, 0.0]
        for step in range(warmup + tau):
            allreduce(_gradient(base, rank, step), state=state, check=False)
            if step >= warmup:
                totals[0] += state.last.critical_bytes
                totals[1] += state.last.critical_messages
                totals[2] += state.last.global_selected
        return [t / tau for t in totals]

    return simulate(P, body, timeout=3600).results


def volume_study(world_sizes: Iterable[int] = (2, 4, 8, 16, 32, 64, 128, 256),
                 algorithms: Iterable[str] | None = None, kinds: Iterable[str] = ("gaussian", "student_t", "skewed"),
                 n: int = 1 << 20, density: float = 0.01, tau: int = 4, warmup: int | None = None,
                 error_feedback: bool = False, progress=None) -> list[VolumeRow]:
    """Bytes and messages per rank of every algorithm at every P, in steady state.

    1. For each kind, P and algorithm, run ``warmup`` (default ``tau``) calls on
       slowly changing gradients (a fixed per-rank part plus 5% noise each
       step), so thresholds and boundaries settle. Error feedback is off by
       default: with it, accumulated values grow for about 1/density calls
       before their distribution settles, far longer than a study can afford,
       and communication volume does not depend on it once settled.
    2. Measure the next ``tau`` calls: one full threshold period, i.e. one exact
       re-evaluation and tau-1 reuses, which is what training pays on average.
    3. Report mean and max over ranks, and the busiest rank over its Table 1 formula.

    ``algorithms``: default every registered one.
    """
    algorithms = registry.names() if algorithms is None else list(algorithms)
    warmup = tau if warmup is None else warmup
    rows = []
    k = topk_count(density, n)
    for kind in kinds:
        for P in world_sizes:
            for algorithm in algorithms:
                per_rank = _measure(P, algorithm, n, density, kind, tau, warmup, error_feedback)
                b = [r[0] for r in per_rank]
                m = [r[1] for r in per_rank]
                lo, hi = formula_words(algorithm, n, k, P)
                row = VolumeRow(algorithm, kind, P, n, k, sum(b) / P, max(b), sum(m) / P, max(m),
                                lo * WORD, hi * WORD, max(b) / (hi * WORD) if hi else float("nan"),
                                per_rank[0][2] / k)
                rows.append(row)
                if progress:
                    progress(row)
    return rows


def project(rows: list[VolumeRow], network: "str | tuple[float, float] | Network",
            target_n: int = BERT_ELEMENTS, kind: str | None = None) -> list[dict]:
    """Modelled communication time per call at ``target_n`` elements on ``network``.

    time = messages * alpha + bytes * (target_n / n) * beta, for the busiest
    rank (max messages, max bytes), with each algorithm's ratio to Ok-Topk.
    """
    net = resolve_network(network)
    out = []
    for r in rows:
        if kind is not None and r.kind != kind:
            continue
        t = r.messages_max * net.alpha + r.bytes_max * (target_n / r.n) * net.beta
        out.append({"algorithm": r.algorithm, "kind": r.kind, "P": r.P, "network": net.name,
                    "target_n": target_n, "time_s": t})
    ok = {(d["kind"], d["P"]): d["time_s"] for d in out if d["algorithm"] == "oktopk"}
    for d in out:
        ref = ok.get((d["kind"], d["P"]))
        d["ratio_to_oktopk"] = d["time_s"] / ref if ref else float("nan")
    return out


def write_csv(rows: list, path: str) -> None:
    dicts = [asdict(r) if hasattr(r, "__dataclass_fields__") else r for r in rows]
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(dicts[0]))
        writer.writeheader()
        writer.writerows(dicts)


def _lines(ax, points: dict[str, list[tuple[float, float]]], ylabel: str) -> None:
    """One line per algorithm (fixed markers and dashes) on log-log axes over P."""
    for alg in sorted(points):
        pts = sorted(points[alg])
        if pts:
            marker, dash = _style(alg)
            ax.plot(*zip(*pts), marker=marker, linestyle=dash, label=alg)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("ranks P")
    ax.set_ylabel(ylabel)
    ax.grid(True, which="both", alpha=0.3)


def plot_volume(rows: list[VolumeRow], path: str) -> None:
    """Bytes per rank (busiest) vs P, log-log, one panel per kind, the lower bound drawn."""
    plt = pyplot()
    kinds = sorted({r.kind for r in rows})
    fig, axes = plt.subplots(1, len(kinds), figsize=(5.5 * len(kinds), 4.5), squeeze=False)
    for ax, kind in zip(axes[0], kinds):
        sub = [r for r in rows if r.kind == kind]
        _lines(ax, {alg: [(r.P, r.bytes_max) for r in sub if r.algorithm == alg] for alg in {r.algorithm for r in sub}},
               "bytes per rank per call (busiest rank)")
        Ps = sorted({r.P for r in sub})
        k = sub[0].k
        ax.plot(Ps, [2 * k * (P - 1) / P * WORD for P in Ps], "k--", label="lower bound 2k(P-1)/P")
        ax.plot(Ps, [6 * k * (P - 1) / P * WORD for P in Ps], "k:", label="Ok-Topk bound 6k(P-1)/P")
        ax.set_title(f"{kind}, n={sub[0].n:,}, k={k:,}")
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_projection(proj: list[dict], path: str) -> None:
    """Modelled time per call vs P, one line per algorithm."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    _lines(ax, {alg: [(d["P"], d["time_s"] * 1e3) for d in proj if d["algorithm"] == alg]
                for alg in {d["algorithm"] for d in proj}}, "modelled communication time per call (ms)")
    d0 = proj[0]
    ax.set_title(f"{d0['target_n']:,} elements, density 1%, {d0['network']} ({d0['kind']})")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
