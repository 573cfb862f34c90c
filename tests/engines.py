"""Run a test body on real engines: gloo through torch.multiprocessing, MPI through mpiexec."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _gloo_entry(rank: int, size: int, port: int, outdir: str, fn, args) -> None:
    import datetime

    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=size,
                            timeout=datetime.timedelta(seconds=60))
    try:
        result = fn(rank, size, *args)
        torch.save({"ok": result}, f"{outdir}/{rank}.pt")
    except BaseException:  # noqa: BLE001 - the parent reports it
        torch.save({"error": traceback.format_exc()}, f"{outdir}/{rank}.pt")
    finally:
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001
            pass


def run_gloo(size: int, fn, *args, timeout: float = 240) -> list:
    """``fn(rank, size, *args)`` on ``size`` gloo processes; returns per-rank results."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as outdir:
        ctx = mp.start_processes(_gloo_entry, args=(size, free_port(), outdir, fn, args),
                                 nprocs=size, join=False, start_method="spawn")
        import time

        deadline = time.monotonic() + timeout
        while not ctx.join(timeout=1):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    p.kill()
                raise TimeoutError(f"gloo run of {fn.__name__} did not finish in {timeout} s")
        return _collect(outdir, size)


def _collect(outdir: str, size: int) -> list:
    results = []
    for r in range(size):
        path = Path(outdir) / f"{r}.pt"
        if not path.exists():
            raise RuntimeError(f"rank {r} wrote no result")
        data = torch.load(path, weights_only=False)
        if "error" in data:
            raise RuntimeError(f"rank {r} failed:\n{data['error']}")
        results.append(data["ok"])
    return results


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
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]))
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
        if proc.returncode != 0:
            raise RuntimeError(f"mpiexec failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
        return _collect(outdir, size)
