"""The benchmark driver (``sparsecomm.tools.bench``) and the results collector (``sparsecomm report``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sparsecomm.tools import report
from sparsecomm.tools.bench import Case, Workload, environment, measure, write_results
from sparsecomm.tools.cli import main
from sparsecomm.comm import simulate
from sparsecomm.comm.sim import single_rank

ROOT = Path(__file__).resolve().parents[2]


def test_rows_count_the_bytes_and_keep_the_slowest_ranks_median():
    P, n = 3, 30_000

    def body(rank):
        from sparsecomm import resolve as current

        comm = current()
        rows = measure(comm, ["oktopk", "dense"], n, steps=3, warmup=1, compressors=[None, "q8"])
        # The time of a row is the slowest rank's median: give rank r the times r+1 seconds.
        work = Workload(comm, Case("dense", 1000))
        for _ in range(3):
            work.setup()
            work()
        fixed = work.row([rank + 1.0] * 3)
        # gTopk's ranks send different amounts (tree): the row must average them.
        tree = Workload(comm, Case("gtopk", n))
        for _ in range(2):
            tree.setup()
            tree()
        mine = sum(c["sent"] for c in tree.calls) / 2
        return rows, fixed, mine, tree.row([1.0, 1.0]).sent_per_rank

    out = simulate(P, body).results
    rows, fixed, _, _ = out[0]
    assert len({o[2] for o in out}) > 1  # the ranks' own means differ...
    assert out[0][3] == pytest.approx(sum(o[2] for o in out) / P)  # ...and the row holds their mean

    assert fixed.time_ms == pytest.approx(1e3 * P)  # on every rank
    assert all(o[1].time_ms == pytest.approx(1e3 * P) for o in out)
    by = {(r.algorithm, r.compressor): r for r in rows}
    assert set(by) == {("oktopk", "none"), ("oktopk", "q8"), ("dense", "none"), ("dense", "q8")}
    dense = by["dense", "none"]
    ring = 2 * (P - 1) / P * n * 4
    assert ring <= dense.sent_per_rank <= ring * 1.01  # plus the small signature check
    assert by["dense", "q8"].sent_per_rank < dense.sent_per_rank / 3
    ok = by["oktopk", "none"]
    assert ok.bytes_ratio == pytest.approx(ok.sent_per_rank / dense.sent_per_rank)
    assert ok.time_ratio == pytest.approx(ok.time_ms / dense.time_ms)
    assert 0 < ok.selected_over_k < 2 and ok.calls == 3 and len(ok.times_s) == 3
    assert ok.select_ms > 0 and ok.comm_ms > 0 and ok.other_ms >= 0
    assert ok.critical_messages > 0 and ok.critical_bytes > 0


def test_a_rank_holding_a_different_result_fails_the_benchmark():
    def body(rank):
        from sparsecomm import resolve as current

        work = Workload(current(), Case("dense", 100))
        work.setup()
        work()
        if rank == 1:
            work.out[0] += 1  # as if rank 1 had reduced differently
        work.setup()

    with pytest.raises(RuntimeError, match="ranks hold different results"):
        simulate(2, body)


def test_environment_names_launcher_nodes_network_and_versions(monkeypatch):
    monkeypatch.setenv("SPARSECOMM_LAUNCHER", "test-launcher")
    monkeypatch.setenv("SPARSECOMM_NETWORK", "emulated 1gbit tbf, P=2")
    env = simulate(3, lambda r: environment(__import__("sparsecomm").resolve())).results[0]
    assert env["launcher"] == "test-launcher" and env["ranks"] == 3 and env["nodes"] == 1
    assert env["network"].startswith("emulated 1gbit") and env["backend"] == "sim"
    assert env["versions"]["torch"] == torch.__version__
    rev = env["git_revision"]  # a checkout's commit (+dirty), or "unknown" for an installed package
    assert rev == "unknown" or len(rev.split("+")[0]) == 40


def _bench_file(tmp_path: Path, P: int, network: str) -> str:
    path = str(tmp_path / f"bench_P{P}_{network.replace(' ', '_')}.json")
    os.environ["SPARSECOMM_NETWORK"] = network
    try:
        assert main(["bench", "--launcher", "sim", "--ranks", str(P), "--n", "20000", "--steps", "2",
                     "--warmup", "1", "--algorithms", "oktopk,topka,dense", "--json", path]) == 0
    finally:
        del os.environ["SPARSECOMM_NETWORK"]
    return path


def test_report_reads_bench_files_of_several_machines_and_plots(tmp_path, capsys):
    files = [_bench_file(tmp_path, P, net) for net in ("net A", "net B") for P in (2, 4)]
    data = json.load(open(files[0]))
    assert data["sparsecomm"]["ranks"] == 2 and data["rows"][0]["algorithm"] == "oktopk"
    # Another rank count on another node count is the same machine (a sweep on a cluster).
    more = json.load(open(files[0]))
    more["sparsecomm"].update(nodes=8, ranks=8)
    for r in more["rows"]:
        r["ranks"] = 8
    files.append(str(tmp_path / "bench_P8_net_A.json"))
    json.dump(more, open(files[-1], "w"))
    records = report.load(files)
    (tmp_path / "calibration.json").write_text(json.dumps({"profiles": []}))  # not a benchmark file
    assert len(report.load([str(tmp_path)])) == len(records)  # a folder: its benchmark files
    assert len({r.machine for r in records}) == 2  # the two networks stay apart
    assert {int(r.row["ranks"]) for r in records} == {2, 4, 8}
    out = tmp_path / "report"
    assert main(["report", *files, "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert text.count("## allreduce:") == 2 and "| oktopk |" in text and "P=4" in text
    assert "speed-up over dense" in text and "Per-phase breakdown at P=8" in text and "| P=2 | P=4 | P=8 |" in text
    pngs = sorted(p.name for p in out.glob("*.png"))
    assert len(pngs) == 2 and all((out / p).stat().st_size > 10_000 for p in pngs)
    rows = (out / "rows.csv").read_text().splitlines()
    assert len(rows) == 1 + len(records) and rows[0].startswith("suite,machine,source")


def test_report_reads_the_suites_pytest_benchmark_json(tmp_path, capsys):
    """The allreduce suite, run for real in one process, writes JSON the collector reads."""
    path = tmp_path / "suite.json"
    env = dict(os.environ, SPARSECOMM_BENCH_SIZES="20000", SPARSECOMM_BENCH_ROUNDS="2",
               SPARSECOMM_BENCH_ALGORITHMS="oktopk,dense", SPARSECOMM_NETWORK="loopback")
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_allreduce.py",
                    f"--benchmark-json={path}"], cwd=ROOT / "benchmarks", env=env, check=True,
                   capture_output=True, timeout=300)
    data = json.load(open(path))
    assert data["sparsecomm"]["network"] == "loopback"
    times = {b["name"]: b["stats"] for b in data["benchmarks"]}
    ok = next(b for b in data["benchmarks"] if "oktopk" in b["name"])
    # pytest-benchmark's statistics are the real per-call times, the same the row holds.
    assert ok["stats"]["rounds"] == 2 and ok["stats"]["median"] > 0
    assert sorted(ok["extra_info"]["row"]["times_s"]) == pytest.approx(sorted(ok["stats"]["data"]))
    assert len(times) == 3  # oktopk, dense, the memory copy
    assert main(["report", str(path)]) == 0
    assert "| oktopk |" in capsys.readouterr().out


def test_report_rejects_a_file_that_is_not_a_benchmark(tmp_path):
    bad = tmp_path / "x.json"
    bad.write_text(json.dumps({"hello": 1}))
    with pytest.raises(ValueError, match="not a sparsecomm benchmark file"):
        report.load([str(bad)])


def test_write_results_round_trips_through_the_collector(tmp_path):
    comm = single_rank()
    rows = measure(comm, ["dense"], 1000, steps=2, warmup=0)
    path = str(tmp_path / "r.json")
    write_results(rows, environment(comm), path)
    (rec,) = report.load([path])
    assert rec.suite == "allreduce" and rec.row["n"] == 1000 and rec.env["ranks"] == 1
