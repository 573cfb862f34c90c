"""Calibrate the network model against measured runs, and project to large P.

The model of one allreduce call on rank r (the one the study uses, section 6
of the papers README, plus the local work):

    T = alpha * M + beta * B + (gamma_a * n + delta_a) * c

* M, B: critical-path messages and bytes of the busiest rank (sum over the
  call's phases of max(sent, received)), counted by running the same
  workload (algorithm, compressor, gradient, state) in the simulated world.
  B grows with n (k = density * n), so the simulation runs at a smaller n and
  B is scaled; M does not depend on n.
* gamma_a: seconds of local work per element for algorithm a (selection,
  error feedback, packing, the output), a property of the machine's cores;
  delta_a: its fixed seconds per call (Python, launches, small buffers).
  Measure a small size next to the large one: with one n, delta and alpha
  cannot be told apart from the local costs, and alpha, which dominates the
  projection at large P, comes out as whatever makes P = 2 and 4 fit.
* c: core sharing, max(1, ranks per node / cores): on a laptop, or the
  emulated cluster, four ranks on two cores do their local work at half speed.

``fit`` finds alpha and beta per network (one pair per machine label) and
gamma, delta per algorithm (shared by the networks of one device) by non-negative
least squares on relative errors, over every measured row at P > 1.
``Profile`` saves a network's fit under a name; ``resolve_network`` (and so
``simulate(..., network=name)`` and ``sparsecomm study``) accepts that name.
``project`` applies a profile to the simulated M and B at any P, up to 1024.
"""

from __future__ import annotations

import functools
import json
import math
import os
import sys
from dataclasses import asdict, dataclass, field
from typing import Iterable

import numpy as np

from ..comm import resolve, simulate
from ..errors import InputFileError
from ..network import Network, profile_dir
from .bench import Case, Workload
from .output import progress, pyplot, read_json
from .report import load

__all__ = ["Profile", "Point", "traffic", "points", "fit", "model", "compare", "project", "reuse_traffic",
           "main"]


@dataclass
class Profile:
    """A calibrated network (alpha s/message, beta s/byte) and the local cost per element of each algorithm."""

    name: str
    alpha: float
    beta: float
    local_s_per_element: dict[str, float] = field(default_factory=dict)
    local_s_per_call: dict[str, float] = field(default_factory=dict)
    machine: str = ""
    sources: list[str] = field(default_factory=list)
    cpus: int = 1

    def network(self) -> Network:
        return Network(self.alpha, self.beta, self.name)

    def save(self, path: str | None = None) -> str:
        path = path or os.path.join(profile_dir(), f"{self.name}.json")
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump(asdict(self), f, indent=2)
        return path

    @classmethod
    def load(cls, path: str) -> "Profile":
        with open(path) as f:
            return cls(**json.load(f))


@dataclass
class Point:
    """One measured row with its simulated traffic: what the fit and the comparison use."""

    machine: str
    label: str  # algorithm, "+compressor" when one is used
    P: int
    n: int
    density: float
    measured_s: float
    messages: float
    bytes: float
    sharing: float
    device: str
    #: Critical bytes the real run counted (rank 0's mean), against which the simulated ``bytes`` is checked.
    measured_bytes: float = float("nan")


def _label(row: dict) -> str:
    comp = row.get("compressor") or "none"
    return row["algorithm"] + ("" if comp == "none" else f"+{comp}")


@functools.lru_cache(maxsize=None)  # the projection asks again for every profile
def traffic(algorithm: str, compressor: str | None, P: int, n: int, density: float = 0.01,
            kind: str = "model", n_sim: int = 1 << 18, calls: int = 3) -> tuple[float, float]:
    """Critical-path (messages, bytes) per call of the busiest rank, extrapolated from small simulations.

    1. Run :class:`sparsecomm.tools.bench.Workload` (the benchmark's own workload:
       same gradients, fresh state, error feedback) on P simulated ranks for
       ``calls`` calls; the first is the threshold's warm-up and not counted.
    2. Average each rank's critical messages and bytes over the counted calls
       and take the busiest rank.
    3. For n > n_sim, do this at n_sim / 2 and n_sim and extrapolate linearly
       to n: data bytes grow with k = density * n, control traffic (counts,
       thresholds, O(P) words) does not, and a plain n / n_sim scaling would
       multiply the latter too. Messages are taken from the larger run.
    """
    def run(m: int) -> tuple[float, float]:
        def body(rank: int) -> tuple[float, float]:
            work = Workload(resolve(), Case(algorithm, m, density, compressor, kind=kind), variants=2)
            for _ in range(calls):
                work.setup()
                work()
            counted = work.calls[1:] or work.calls
            return (sum(c["critical_messages"] for c in counted) / len(counted),
                    sum(c["critical_bytes"] for c in counted) / len(counted))

        per_rank = simulate(P, body, timeout=3600).results
        return max(r[0] for r in per_rank), max(r[1] for r in per_rank)

    if n <= n_sim:
        return run(n)
    m1, m2 = n_sim // 2, n_sim
    (_, b1), (msgs, b2) = run(m1), run(m2)
    return msgs, b2 + (b2 - b1) * (n - m2) / (m2 - m1)


def reuse_traffic(path: str) -> int:
    """Seed :func:`traffic` with the projection of an earlier ``calibration.json`` (same code, same
    workload: the simulation is deterministic), so a re-fit does not simulate P = 1024 again.
    Returns how many entries were loaded; InputFileError if ``path`` is not a calibration file."""
    data = read_json(path)
    rows = data.get("projection") if isinstance(data, dict) else None
    if not isinstance(rows, list) or not all(isinstance(r, dict) and _PROJECTION_KEYS <= set(r) for r in rows):
        raise InputFileError(f'{path}: not a sparsecomm calibration file (no "projection" list of rows)')
    for r in rows:
        algorithm, _, comp = r["algorithm"].partition("+")
        _TRAFFIC_SEEN[(algorithm, comp or None, r["P"], r["n"], r.get("density", 0.01), "model")] = (
            r["messages"], r["bytes"])
    return len(rows)


_PROJECTION_KEYS = {"algorithm", "P", "n", "messages", "bytes"}
#: Traffic loaded by :func:`reuse_traffic`, consulted by :func:`project` before simulating.
_TRAFFIC_SEEN: dict[tuple, tuple[float, float]] = {}


def _case(row: dict) -> tuple:
    """:func:`traffic`'s arguments for a measured row: (algorithm, compressor, P, n, density, kind)."""
    comp = None if row.get("compressor") in (None, "none") else row["compressor"]
    return (row["algorithm"], comp, int(row["ranks"]), int(row["n"]), float(row["density"]),
            row.get("kind", "model"))


def points(records: Iterable, n_sim: int = 1 << 18, show_progress: bool = False) -> list[Point]:
    """The allreduce rows at P > 1 of ``records`` (``sparsecomm.tools.report.load``), with simulated traffic.

    ``show_progress``: a progress bar over the simulated cases (on a terminal).
    """
    measured = [rec for rec in records if rec.suite == "allreduce" and rec.row.get("algorithm") != "memcpy"
                and int(rec.row["ranks"]) >= 2]
    cases = list(dict.fromkeys(_case(rec.row) for rec in measured))
    simulated = {case: traffic(*case, n_sim=n_sim)
                 for case in progress(cases, show=show_progress, desc="simulating traffic", unit="case")}
    out = []
    for rec in measured:
        row = rec.row
        M, B = simulated[_case(row)]
        env = rec.env or {}
        nodes = max(1, int(env.get("nodes", 1)))
        sharing = max(1.0, int(row["ranks"]) / nodes / max(1, int(env.get("cpus", 1))))
        out.append(Point(rec.machine, _label(row), int(row["ranks"]), int(row["n"]), float(row["density"]),
                         row["time_ms"] / 1e3, M, B, sharing, str(env.get("device", "?")),
                         float(row.get("critical_bytes", float("nan")))))
    return out


def fit(pts: list[Point], names: dict[str, str] | None = None) -> dict[str, Profile]:
    """alpha, beta per machine and gamma, delta per (device, algorithm): NNLS on relative errors.

    Returns one Profile per machine label (named by ``names`` or "calibrated-i").
    """
    from scipy.optimize import nnls  # optional: only the fit needs scipy

    machines = sorted({p.machine for p in pts})
    locals_ = sorted({(p.device, p.label) for p in pts})
    cols = 2 * len(machines) + 2 * len(locals_)
    A, y = np.zeros((len(pts), cols)), np.ones(len(pts))
    # Columns in natural units would differ by 1e9 (bytes against messages): scale them.
    for i, p in enumerate(pts):
        j, g = machines.index(p.machine), locals_.index((p.device, p.label))
        A[i, 2 * j], A[i, 2 * j + 1] = p.messages * 1e-6, p.bytes * 1e-9
        A[i, 2 * len(machines) + g] = p.n * p.sharing * 1e-9
        A[i, 2 * len(machines) + len(locals_) + g] = p.sharing * 1e-3
        A[i] /= p.measured_s  # relative errors: every row counts the same
    x, _ = nnls(A, y)
    profiles = {}
    for j, mach in enumerate(machines):
        sub = [p for p in pts if p.machine == mach]
        gammas = {label: float(x[2 * len(machines) + locals_.index((dev, label))]) * 1e-9
                  for dev, label in locals_ if dev == sub[0].device}
        deltas = {label: float(x[2 * len(machines) + len(locals_) + locals_.index((dev, label))]) * 1e-3
                  for dev, label in locals_ if dev == sub[0].device}
        name = (names or {}).get(mach, f"calibrated-{j}")
        profiles[mach] = Profile(name, float(x[2 * j]) * 1e-6, float(x[2 * j + 1]) * 1e-9, gammas, deltas, mach)
    return profiles


def model(profile: Profile, label: str, messages: float, nbytes: float, n: int, sharing: float = 1.0) -> float:
    """Modelled seconds of one call (see the module docstring)."""
    return (profile.alpha * messages + profile.beta * nbytes
            + (profile.local_s_per_element.get(label, 0.0) * n + profile.local_s_per_call.get(label, 0.0)) * sharing)


def compare(pts: list[Point], profiles: dict[str, Profile]) -> list[dict]:
    """Modelled against measured time for every point, with the error in percent."""
    rows = []
    for p in pts:
        prof = profiles[p.machine]
        t = model(prof, p.label, p.messages, p.bytes, p.n, p.sharing)
        rows.append({"machine": p.machine, "profile": prof.name, "algorithm": p.label, "P": p.P, "n": p.n,
                     "measured_ms": 1e3 * p.measured_s, "modelled_ms": 1e3 * t,
                     "network_ms": 1e3 * (prof.alpha * p.messages + prof.beta * p.bytes),
                     "local_ms": 1e3 * (t - prof.alpha * p.messages - prof.beta * p.bytes),
                     "error_pct": 100 * (t / p.measured_s - 1),
                     "bytes_run_over_sim": p.measured_bytes / p.bytes if p.bytes else float("nan")})
    return rows


def project(profile: Profile, labels: Iterable[str], world_sizes: Iterable[int], n: int,
            density: float = 0.01, kind: str = "model", n_sim: int = 1 << 16,
            show_progress: bool = False) -> list[dict]:
    """Modelled time per call at each P for each algorithm label, one rank per node (no core sharing).

    ``show_progress``: a progress bar over the (P, label) pairs (on a terminal).
    """
    rows = []
    pairs = [(P, label) for P in world_sizes for label in labels]
    for P, label in progress(pairs, show=show_progress, desc=f"projecting {profile.name}", unit="case"):
        algorithm, _, comp = label.partition("+")
        key = (algorithm, comp or None, P, n, density, kind)
        M, B = _TRAFFIC_SEEN.get(key) or traffic(*key, n_sim=n_sim, calls=2)
        t = model(profile, label, M, B, n)
        rows.append({"profile": profile.name, "algorithm": label, "P": P, "n": n, "density": density,
                     "messages": M, "bytes": B,
                     "time_ms": 1e3 * t, "network_ms": 1e3 * (profile.alpha * M + profile.beta * B)})
    dense = {r["P"]: r["time_ms"] for r in rows if r["algorithm"] == "dense"}
    for r in rows:
        r["speedup_over_dense"] = dense[r["P"]] / r["time_ms"] if r["P"] in dense else float("nan")
    return rows


def _table(rows: list[dict], cols: list[tuple[str, str]]) -> str:
    lines = ["| " + " | ".join(h for h, _ in cols) + " |", "|---" * len(cols) + "|"]
    for r in rows:
        lines.append("| " + " | ".join(fmt.format(r[k]) if not isinstance(r[k], str) else r[k]
                                       for (_, spec) in cols for k, fmt in [spec.split("|", 1)]) + " |")
    return "\n".join(lines)


def main(paths: list[str], names: list[str] | None, outdir: str | None, save: bool,
         project_to: int, project_n: int | None, n_sim: int, traffic_from: str | None = None) -> int:
    """``sparsecomm calibrate``: fit, print modelled vs measured, save profiles, project to ``project_to``."""
    if traffic_from:
        reuse_traffic(traffic_from)

    records = load(paths)
    pts = points(records, n_sim=n_sim, show_progress=True)
    if not pts:
        print("sparsecomm calibrate: no allreduce rows at P > 1 in " + ", ".join(paths), file=sys.stderr)
        return 1
    machines = sorted({p.machine for p in pts})
    if names and len(names) != len(machines):
        print(f"sparsecomm calibrate: {len(names)} name(s) for {len(machines)} machine(s): {machines}",
              file=sys.stderr)
        return 2
    profiles = fit(pts, dict(zip(machines, names)) if names else None)
    for prof in profiles.values():
        prof.sources = sorted({r.source for r in records if r.machine == prof.machine})
    cmp_rows = compare(pts, profiles)
    out = []
    for mach, prof in profiles.items():
        out += [f"## {prof.name}: {mach}", "",
                f"alpha = {prof.alpha * 1e6:.1f} us per message, beta = {prof.beta * 1e9:.3f} ns per byte "
                f"({8 / prof.beta / 1e9 if prof.beta else math.inf:.2f} Gbit/s); local cost per element: "
                + ", ".join(f"{k} {v * 1e9:.2f} ns" for k, v in sorted(prof.local_s_per_element.items()))
                + "; per call: " + ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in sorted(prof.local_s_per_call.items())),
                "",
                _table([r for r in cmp_rows if r["machine"] == mach],
                       [("algorithm", "algorithm|{}"), ("P", "P|{}"), ("n", "n|{:,}"),
                        ("measured ms", "measured_ms|{:.1f}"), ("modelled ms", "modelled_ms|{:.1f}"),
                        ("network ms", "network_ms|{:.1f}"), ("local ms", "local_ms|{:.1f}"),
                        ("error", "error_pct|{:+.0f}%"), ("bytes run/sim", "bytes_run_over_sim|{:.2f}")]),
                ""]
        if save:
            out.append(f"saved profile {prof.name!r}: {prof.save()}")
    worst = max(abs(r["error_pct"]) for r in cmp_rows)
    out.append(f"\nworst |modelled/measured - 1| over {len(cmp_rows)} rows: {worst:.0f}%")
    proj: list[dict] = []
    if project_to:
        # The simulation's cost grows with P^2 messages: a few sizes up to the target.
        sizes = sorted({p.P for p in pts} | {s for s in (16, 64, 256) if s < project_to} | {project_to})
        for prof in profiles.values():
            labels = sorted(prof.local_s_per_element)
            n = project_n or max(p.n for p in pts if p.machine == prof.machine)
            density = max(p.density for p in pts if p.machine == prof.machine)
            proj += project(prof, labels, sizes, n, density, n_sim=min(n_sim, 1 << 16), show_progress=True)
            sub = [r for r in proj if r["profile"] == prof.name]
            out += [f"\n## projection with {prof.name}: n = {n:,}, one rank per node", "",
                    _table(sub,
                           [("algorithm", "algorithm|{}"), ("P", "P|{}"), ("time ms", "time_ms|{:.1f}"),
                            ("network ms", "network_ms|{:.1f}"), ("×dense", "speedup_over_dense|{:.2f}")])]
    text = "\n".join(out)
    print(text)
    if outdir:
        os.makedirs(outdir, exist_ok=True)
        with open(os.path.join(outdir, "calibration.md"), "w") as f:
            f.write("# sparsecomm calibrate\n\n" + text + "\n")
        with open(os.path.join(outdir, "calibration.json"), "w") as f:
            json.dump({"profiles": [asdict(p) for p in profiles.values()], "comparison": cmp_rows,
                       "projection": proj}, f, indent=2)
        _plot(cmp_rows, proj, outdir)
        print(f"# wrote {outdir}/calibration.md, calibration.json and plots")
    return 0


def _plot(cmp_rows: list[dict], proj: list[dict], outdir: str) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 2 if proj else 1, figsize=(13 if proj else 6.5, 5), squeeze=False)
    ax = axes[0][0]
    for mach in sorted({r["profile"] for r in cmp_rows}):
        sub = [r for r in cmp_rows if r["profile"] == mach]
        ax.scatter([r["measured_ms"] for r in sub], [r["modelled_ms"] for r in sub], label=mach)
        for r in sub:
            ax.annotate(f"{r['algorithm']} P{r['P']}", (r["measured_ms"], r["modelled_ms"]), fontsize=6)
    lo = min(min(r["measured_ms"], r["modelled_ms"]) for r in cmp_rows)
    hi = max(max(r["measured_ms"], r["modelled_ms"]) for r in cmp_rows)
    ax.plot([lo, hi], [lo, hi], "k-", lw=0.8)
    ax.plot([lo, hi], [1.25 * lo, 1.25 * hi], "k:", lw=0.6)
    ax.plot([lo, hi], [0.75 * lo, 0.75 * hi], "k:", lw=0.6)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("measured ms per call")
    ax.set_ylabel("modelled ms per call")
    ax.set_title("calibrated model (dotted: ±25%)")
    ax.legend(fontsize=8)
    if proj:
        ax = axes[0][1]
        profs = sorted({r["profile"] for r in proj})
        labels = sorted({r["algorithm"] for r in proj})
        for prof, label in sorted({(r["profile"], r["algorithm"]) for r in proj}):
            sub = sorted((r for r in proj if r["profile"] == prof and r["algorithm"] == label), key=lambda r: r["P"])
            # colour: the algorithm; line style: the profile
            ax.plot([r["P"] for r in sub], [r["time_ms"] for r in sub], ["o-", "s--", "^:"][profs.index(prof) % 3],
                    ms=3, color=f"C{labels.index(label) % 10}", label=f"{label} ({prof})")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("ranks P (one per node)")
        ax.set_ylabel("modelled ms per call")
        ax.set_title(f"projection, n = {proj[0]['n']:,}")
        ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(os.path.join(outdir, "calibration.png"), dpi=90)
    plt.close(fig)
