"""Run a test body on real engines: gloo through torch.multiprocessing, MPI through mpiexec."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from sparsecomm.tools.launch import collect, spawn

HERE = Path(__file__).resolve().parent


def run_gloo(size: int, fn, *args, timeout: float = 240, missing_ok: bool = False) -> list:
    """``fn(rank, size, *args)`` on ``size`` gloo processes; returns per-rank results."""
    return spawn(size, fn, *args, timeout=timeout, threads=1, missing_ok=missing_ok)


def mpiexec() -> str | None:
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        return None
    local = Path(sys.executable).parent / "mpiexec"
    return str(local) if local.exists() else shutil.which("mpiexec")


def run_mpi(size: int, case: str, timeout: float = 240) -> list:
    """Run ``mpi_worker.py case`` under ``mpiexec -n size``; returns per-rank results."""
    exe = mpiexec()
    with tempfile.TemporaryDirectory() as outdir:
        cmd = [exe, "-n", str(size), sys.executable, str(HERE / "mpi_worker.py"), case, outdir]
        # The worker imports test modules by name: tests/ and its folders (as pytest's sys.path has them).
        folders = [HERE, *sorted(d for d in HERE.iterdir() if d.is_dir() and not d.name.startswith(("_", ".")))]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([*map(str, folders), os.environ.get("PYTHONPATH", "")]),
                   # Open MPI's mpiexec refuses to run as root (containers, the GPU machines) unless
                   # told; MPICH ignores these.
                   OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
        if proc.returncode != 0:
            raise RuntimeError(f"mpiexec failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
        return collect(outdir, size)
