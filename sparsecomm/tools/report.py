"""``sparsecomm report``: benchmark JSON files from any machine turned into tables and plots.

Reads the two formats sparsecomm writes:

* pytest-benchmark JSON from the suites under ``benchmarks/`` (rows in each
  benchmark's ``extra_info["row"]``, the environment under ``"sparsecomm"``);
* ``sparsecomm bench --json`` (``{"sparsecomm": environment, "rows": [...]}``,
  or a bare list of rows from older versions).

Every row is tagged with its run's machine (a short label made from the
launcher, backend, network, device and node count) so that runs from several
clusters, or the emulated 1 and 10 Gbit/s networks, sit side by side.

Outputs, for the allreduce rows of each (machine, n, density, compressor):
time vs P per algorithm, bytes sent per rank vs P, speed-up over dense vs P,
and the per-phase breakdown (selection / communication / other) at the
largest P; the DDP and schedules suites give their step time ÷ the
no-communication step. Tables go to stdout and ``report.md``, plots to PNG.
"""

from __future__ import annotations

import csv
import math
import os
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Iterable

from ..errors import InputFileError
from .output import pyplot, read_json

__all__ = ["Record", "load", "machine_label", "tables", "plot", "main"]


@dataclass
class Record:
    """One row of one run, with its environment."""

    suite: str
    machine: str
    env: dict[str, Any]
    row: dict[str, Any]
    source: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


def machine_label(env: dict[str, Any]) -> str:
    """A short, stable name for where a run happened: "mpiexec/mpi, emulated 1gbit tbf, Xeon".

    The node count is left out: a sweep over P on a cluster (one rank per node)
    is one machine whose rows differ in P.
    """
    if not env:
        return "unknown machine"
    device = str(env.get("device", "?"))
    for noise in ("(R)", "(TM)", " Processor", " CPU"):
        device = device.replace(noise, "")
    network = str(env.get("network", "unknown")).split(",")[0]
    return f"{env.get('launcher', '?')}/{env.get('backend', '?')}, {network}, {' '.join(device.split())}"


_ROW_KEYS = {"algorithm", "n", "ranks", "time_ms"}
#: What the tables, plots and the calibration read of each suite's rows.
_SUITE_KEYS = {"allreduce": {"algorithm", "n", "ranks", "density", "time_ms", "sent_per_rank"},
               "ddp": {"config", "ranks", "time_ms"}, "schedules": {"config", "ranks", "time_ms"},
               "kernels": {"n", "dtype", "operation", "time_ms", "gb_per_s"}}


#: Row fields that must be finite numbers >= 0 where present (time_ms > 0: the fit divides by it).
_NUMBERS = ("n", "ranks", "density", "time_ms", "sent_per_rank", "gb_per_s", "critical_bytes")
#: Environment fields that must be whole numbers where present.
_ENV_INTS = ("nodes", "cpus", "ranks", "threads")


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= 0


def _row_problem(row: Any) -> str | None:
    """Why the tables cannot use ``row`` (not an object, without what its suite needs, or a
    field of the wrong type), or None."""
    if not isinstance(row, dict):
        return "is not an object"
    missing = _SUITE_KEYS.get(row.get("suite", "allreduce"), set()) - set(row)
    if missing:
        return "has no " + ", ".join(map(repr, sorted(missing)))
    for key in _NUMBERS:
        if key in row and not (_number(row[key]) and (key != "time_ms" or row[key] > 0)):
            return f"has {key} = {row[key]!r}, not a {'positive' if key == 'time_ms' else 'non-negative'} number"
    return None


def _field(value: Any) -> dict:
    """A JSON object field, or {} where it is absent or of another type."""
    return value if isinstance(value, dict) else {}


def _rows(path: str, data: Any) -> tuple[dict, list[dict]] | None:
    """(environment, rows) of one file's JSON in any format sparsecomm writes; None if it is none of them."""
    if isinstance(data, list) and all(isinstance(r, dict) and _ROW_KEYS <= set(r) for r in data):
        data = {"rows": data}  # sparsecomm bench before environments were written
    if not isinstance(data, dict):
        return None
    if isinstance(data.get("benchmarks"), list):  # pytest-benchmark
        rows = []
        for b in data["benchmarks"]:
            row = _field(b).get("extra_info")
            row = _field(row).get("row")
            if row is None:
                continue
            median = _field(_field(b).get("stats")).get("median", float("nan"))
            rows.append({**row, "_pytest_median_ms": 1e3 * median if _number(median) else float("nan"),
                         "_name": b.get("name", "")} if isinstance(row, dict) else row)
    elif isinstance(data.get("rows"), list):
        rows = data["rows"]
    else:
        return None
    env = data.get("sparsecomm") or {}
    if not isinstance(env, dict):
        raise InputFileError(f"{path}: its \"sparsecomm\" environment is not an object")
    for key in _ENV_INTS:
        if key in env and not (isinstance(env[key], int) and not isinstance(env[key], bool)):
            raise InputFileError(f"{path}: its environment has {key} = {env[key]!r}, not a whole number")
    for i, row in enumerate(rows):
        problem = _row_problem(row)
        if problem:
            raise InputFileError(f"{path}: row {i + 1} {problem}")
    return env, rows


def load(paths: Iterable[str]) -> list[Record]:
    """Every row of every file (pytest-benchmark or ``sparsecomm bench`` JSON); a folder means its *.json.

    A file that is missing, not JSON or not a benchmark file raises
    :class:`~sparsecomm.errors.InputFileError`; in a folder, JSON files of
    another kind (a calibration, a study) are skipped with a note on stderr.
    """
    records: list[Record] = []
    files: list[tuple[str, bool]] = []
    for path in paths:
        if os.path.isdir(path):
            files += [(f, True) for f in sorted(os.path.join(d, f) for d, _, fs in os.walk(path)
                                                 for f in fs if f.endswith(".json"))]
        else:
            files.append((path, False))
    for path, found in files:
        parsed = _rows(path, read_json(path))
        if parsed is None and found:  # a folder may hold other JSON (a calibration, a study): say so and go on
            print(f"sparsecomm report: skipping {path}: not a benchmark file", file=sys.stderr)
            continue
        if parsed is None:
            raise InputFileError(f'{path}: not a sparsecomm benchmark file (no "benchmarks" or "rows" list)')
        env, rows = parsed
        label = machine_label(env)
        for row in rows:
            records.append(Record(row.get("suite", "allreduce"), label, env, row, path))
    return records


def _fmt(x: float, digits: int = 3) -> str:
    """Three significant digits, without exponents for the large numbers tables hold."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "–"
    return f"{x:,.0f}" if abs(x) >= 10 ** (digits - 1) else f"{x:.{digits}g}"


def _allreduce_groups(records: list[Record]) -> dict[tuple, list[Record]]:
    groups: dict[tuple, list[Record]] = defaultdict(list)
    for r in records:
        if r.suite == "allreduce" and r.row.get("algorithm") != "memcpy":
            key = (r.machine, r.row["n"], r.row["density"], r.row.get("kind", "model"))
            groups[key].append(r)
    return groups


def _series(recs: list[Record]) -> dict[str, dict[int, dict]]:
    """label ("oktopk", "dense+q8") -> P -> row (the last one read wins)."""
    out: dict[str, dict[int, dict]] = defaultdict(dict)
    for r in recs:
        comp = r.row.get("compressor", "none")
        label = r.row["algorithm"] + ("" if comp in ("none", None) else f"+{comp}")
        out[label][int(r.row["ranks"])] = r.row
    return out


def tables(records: list[Record]) -> str:
    """Markdown tables: per machine and size, time/bytes/speed-up vs P and the phase breakdown."""
    lines: list[str] = []
    for (machine, n, density, kind), recs in sorted(_allreduce_groups(records).items(), key=str):
        series = _series(recs)
        Ps = sorted({p for s in series.values() for p in s})
        lines += [f"## allreduce: {machine}", "",
                  f"n = {n:,} ({kind} gradient), density {density}; times are the slowest rank's median", ""]
        dense = series.get("dense", {})
        head = "| algorithm | " + " | ".join(f"P={p}" for p in Ps) + " |"
        rule = "|---" * (1 + len(Ps)) + "|"
        for title, cell in (
                ("time per call (ms)", lambda row, d: _fmt(row["time_ms"])),
                ("bytes sent per rank", lambda row, d: f"{row['sent_per_rank']:,.0f}"),
                ("speed-up over dense (dense time ÷ time)",
                 lambda row, d: _fmt(d["time_ms"] / row["time_ms"]) if d else "–")):
            lines += [f"**{title}**", "", head, rule]
            for label, byP in sorted(series.items()):
                lines.append(f"| {label} | " + " | ".join(
                    cell(byP[p], dense.get(p)) if p in byP else "" for p in Ps) + " |")
            lines.append("")
        p = Ps[-1]
        lines += [f"**Per-phase breakdown at P={p}** (ms per call, rank 0's mean; "
                  "'other' is the rest of the median call)", "",
                  "| algorithm | selection | communication | other | total |", "|---|---|---|---|---|"]
        for label, byP in sorted(series.items()):
            row = byP.get(p)
            if row is not None:
                lines.append(f"| {label} | {_fmt(row.get('select_ms', 0))} | {_fmt(row.get('comm_ms', 0))} | "
                             f"{_fmt(row.get('other_ms', 0))} | {_fmt(row['time_ms'])} |")
        lines.append("")
    steps: dict[tuple, list[Record]] = defaultdict(list)
    for r in records:
        if r.suite in ("ddp", "schedules"):
            steps[(r.suite, r.machine, r.row.get("model", ""))].append(r)
    for (suite, machine, model), recs in sorted(steps.items(), key=str):
        Ps = sorted({int(r.row["ranks"]) for r in recs})
        lines += [f"## {suite} step: {machine}" + (f", model {model}" if model else ""), "",
                  "| config | " + " | ".join(f"P={p} ms | P={p} ÷none" for p in Ps) + " |",
                  "|---" * (1 + 2 * len(Ps)) + "|"]
        by: dict[str, dict[int, dict]] = defaultdict(dict)
        for r in recs:
            by[r.row["config"]][int(r.row["ranks"])] = r.row
        for config, byP in by.items():
            cells = []
            for p in Ps:
                row, none = byP.get(p), by.get("none", {}).get(p)
                cells += ["", ""] if row is None else [
                    _fmt(row["time_ms"]), _fmt(row["time_ms"] / none["time_ms"] if none else float("nan"))]
            lines.append(f"| {config} | " + " | ".join(cells) + " |")
        lines.append("")
    kern = [r for r in records if r.suite == "kernels"]
    if kern:
        lines += ["## kernels", "", "| machine | n | dtype | operation | ms | GB/s |", "|---|---|---|---|---|---|"]
        for r in kern:
            lines.append(f"| {r.machine} | {r.row['n']:,} | {r.row['dtype']} | {r.row['operation']} | "
                         f"{_fmt(r.row['time_ms'])} | {_fmt(r.row['gb_per_s'])} |")
        lines.append("")
    return "\n".join(lines)


def plot(records: list[Record], outdir: str) -> list[str]:
    """One PNG per (machine, n, density): time, bytes and speed-up vs P, and the phase breakdown."""
    plt = pyplot()
    written = []
    for i, ((machine, n, density, kind), recs) in enumerate(sorted(_allreduce_groups(records).items(), key=str)):
        series = _series(recs)
        Ps = sorted({p for s in series.values() for p in s})
        fig, axes = plt.subplots(1, 4, figsize=(22, 4.8))
        dense = series.get("dense", {})
        for label, byP in sorted(series.items()):
            ps = sorted(byP)
            axes[0].plot(ps, [byP[p]["time_ms"] for p in ps], "o-", label=label)
            axes[1].plot(ps, [max(byP[p]["sent_per_rank"], 1) for p in ps], "o-", label=label)
            sp = [(p, dense[p]["time_ms"] / byP[p]["time_ms"]) for p in ps if p in dense]
            if sp:
                axes[2].plot([p for p, _ in sp], [s for _, s in sp], "o-", label=label)
        for ax, ylabel in zip(axes[:3], ["time per call (ms)", "bytes sent per rank", "speed-up over dense"]):
            ax.set_xscale("log", base=2)
            ax.set_xticks(Ps, [str(p) for p in Ps])
            ax.set_xlabel("ranks P")
            ax.set_ylabel(ylabel)
            ax.grid(alpha=0.3)
        axes[0].set_yscale("log")
        axes[1].set_yscale("log")
        axes[2].axhline(1.0, color="grey", lw=0.8)
        axes[0].legend(fontsize=8)
        p = Ps[-1]
        labels = [label for label in sorted(series) if p in series[label]]
        sel = [series[label][p].get("select_ms", 0) for label in labels]
        com = [series[label][p].get("comm_ms", 0) for label in labels]
        oth = [series[label][p].get("other_ms", 0) for label in labels]
        axes[3].bar(labels, sel, label="selection")
        axes[3].bar(labels, com, bottom=sel, label="communication")
        axes[3].bar(labels, oth, bottom=[a + b for a, b in zip(sel, com)], label="other")
        axes[3].set_ylabel(f"ms per call at P={p}")
        axes[3].tick_params(axis="x", rotation=45)
        axes[3].legend(fontsize=8)
        fig.suptitle(f"{machine}: n = {n:,}, density {density} ({kind})", fontsize=10)
        fig.tight_layout()
        path = os.path.join(outdir, f"allreduce_{i}.png")
        fig.savefig(path, dpi=90)
        plt.close(fig)
        written.append(path)
    return written


def main(paths: list[str], outdir: str | None) -> int:
    """Print the tables; with ``outdir``, also write report.md, the plots and every row as CSV."""
    records = load(paths)
    if not records:
        print("sparsecomm report: no rows in " + ", ".join(paths), file=sys.stderr)
        return 1
    text = tables(records)
    print(text)
    if outdir:
        os.makedirs(outdir, exist_ok=True)
        pngs = plot(records, outdir)
        with open(os.path.join(outdir, "report.md"), "w") as f:
            f.write("# sparsecomm report\n\nSources: " + ", ".join(sorted({r.source for r in records}))
                    + "\n\n" + text + "\n" + "".join(f"![{os.path.basename(p)}]({os.path.basename(p)})\n"
                                                     for p in pngs))
        _write_csv(records, os.path.join(outdir, "rows.csv"))
        print(f"# wrote {outdir}/report.md, rows.csv and {len(pngs)} plot(s)")
    return 0


def _write_csv(records: list[Record], path: str) -> None:
    keys: list[str] = ["suite", "machine", "source"]
    for r in records:
        keys += [k for k in r.row if k not in keys and k != "times_s" and not k.startswith("_")]
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys, extrasaction="ignore")
        w.writeheader()
        for r in records:
            w.writerow({"suite": r.suite, "machine": r.machine, "source": r.source, **r.row})
