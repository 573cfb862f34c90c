"""The Slurm scripts (benchmarks/slurm/): syntax, a local run of bench.sbatch, sweep.sh --dry-run.

bench.sbatch runs here with bash (its #SBATCH lines are comments), Slurm's
variables faked, and srun replaced by a shim that starts the ranks with MPICH's
mpiexec; the suite is a one-benchmark stand-in, so the test checks the script,
not the real suites.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SLURM = ROOT / "benchmarks" / "slurm"
SCRIPTS = [SLURM / "bench.sbatch", SLURM / "sweep.sh"]


def _mpiexec() -> str | None:
    local = Path(sys.executable).parent / "mpiexec"
    return str(local) if local.exists() else shutil.which("mpiexec")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_scripts_parse(script):
    proc = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


# Only rank 0 writes --benchmark-json, as benchmarks/conftest.py does for the real suites.
STAND_IN_CONFTEST = """
import os

import pytest


@pytest.hookimpl(trylast=True)
def pytest_configure(config):
    if int(os.environ.get("RANK", os.environ.get("PMI_RANK", "0"))) != 0:
        session = getattr(config, "_benchmarksession", None)
        if session is not None:
            session.json = None
        config.option.benchmark_json = None
"""

STAND_IN_SUITE = """
def test_sum(benchmark):
    benchmark.pedantic(lambda: sum(range(1000)), rounds=3)
"""

# srun [--opt=value ...] CMD... -> mpiexec -n $SLURM_NNODES CMD...
FAKE_SRUN = """#!/bin/sh
while [ $# -gt 0 ]; do case $1 in -*) shift ;; *) break ;; esac; done
exec {mpiexec} -n "$SLURM_NNODES" "$@"
"""


@pytest.mark.skipif(_mpiexec() is None, reason="needs an mpiexec next to this Python or on PATH")
@pytest.mark.slow
@pytest.mark.parametrize("how", ["srun", "SRUN", "torchrun"])
def test_bench_sbatch_runs_locally(tmp_path, how):
    (tmp_path / "conftest.py").write_text(textwrap.dedent(STAND_IN_CONFTEST))
    (tmp_path / "test_tiny.py").write_text(textwrap.dedent(STAND_IN_SUITE))
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(FAKE_SRUN.format(mpiexec=_mpiexec()))
    (bin_dir / "srun").chmod(0o755)
    out = tmp_path / "out"
    # A job's environment: not this test run's pytest settings (a worker's PYTEST_XDIST_WORKER
    # switches pytest-benchmark off in the job's stand-in suite).
    job = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    env = dict(job, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
               SLURM_NNODES="2", SLURM_JOB_ID="test", SLURM_JOB_PARTITION="debug",
               SLURM_CPUS_PER_TASK="1", SLURM_JOB_NODELIST="localhost",
               SUITE_FILE=str(tmp_path / "test_tiny.py"), OUT=str(out), PYTHON=sys.executable,
               SPARSECOMM_BENCH_PASSTHROUGH="yes")
    for var in ("SPARSECOMM_LAUNCHER", "SPARSECOMM_NETWORK", "SRUN", "LAUNCHER", "SUITE"):
        env.pop(var, None)
    if how == "SRUN":
        env["SRUN"] = f"{_mpiexec()} -n 2"
    if how == "torchrun":
        env.update(LAUNCHER="torchrun", MASTER_ADDR="127.0.0.1", RDZV_PORT=str(_free_port()))
    proc = subprocess.run(["bash", str(SLURM / "bench.sbatch")], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    launch_line = next(line for line in proc.stdout.splitlines() if line.startswith("+ "))
    if how == "SRUN":
        assert launch_line.startswith(f"+ {_mpiexec()} -n 2 ")
    else:
        assert "srun --nodes=2 --ntasks=2 --ntasks-per-node=1" in launch_line
    assert ("torch.distributed.run --nnodes=2" in launch_line) == (how == "torchrun")

    data = json.loads((out / "allreduce_P2.json").read_text())
    assert {"machine_info", "commit_info", "benchmarks", "datetime", "version"} <= set(data)
    assert [b["name"] for b in data["benchmarks"]] == ["test_sum"]
    assert data["benchmarks"][0]["stats"]["rounds"] == 3
    recorded = (out / "job_allreduce_P2_test.env").read_text().splitlines()
    expected_launcher = "torchrun" if how == "torchrun" else "srun"
    assert f"SPARSECOMM_LAUNCHER={expected_launcher}" in recorded
    assert "SPARSECOMM_NETWORK=slurm debug" in recorded
    assert "SPARSECOMM_BENCH_PASSTHROUGH=yes" in recorded
    assert (out / "job_allreduce_P2_test.nodes").read_text().strip() == "localhost"


def test_bench_sbatch_rejects_an_unknown_suite(tmp_path):
    env = dict(os.environ, SUITE="nonsense", OUT=str(tmp_path / "out"))
    env.pop("SUITE_FILE", None)
    proc = subprocess.run(["bash", str(SLURM / "bench.sbatch")], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2 and "SUITE must be" in proc.stderr


def test_sweep_dry_run_prints_one_sbatch_per_world_size():
    proc = subprocess.run(["bash", str(SLURM / "sweep.sh"), "--dry-run", "-p", "debug", "-A", "proj",
                           "-s", "ddp", "-o", "/nonexistent/sweep", "--", "--gres=gpu:1"],
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    sizes = [2, 4, 8, 16, 32, 64, 128, 256]
    assert len(lines) == len(sizes)
    for P, line in zip(sizes, lines):
        words = line.split()
        assert words[0] == "sbatch" and words[words.index("-N") + 1] == str(P)
        assert words[words.index("-p") + 1] == "debug" and words[words.index("-A") + 1] == "proj"
        assert "SUITE=ddp" in line and "--gres=gpu:1" in words
        assert words[-1].endswith("benchmarks/slurm/bench.sbatch")
    assert not Path("/nonexistent/sweep").exists()

    custom = subprocess.run(["bash", str(SLURM / "sweep.sh"), "--dry-run", "-P", "3 5"],
                            capture_output=True, text=True, timeout=30)
    assert [line.split()[2] for line in custom.stdout.splitlines()] == ["3", "5"]
