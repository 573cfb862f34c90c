"""Start a few local ranks for real: torch.multiprocessing processes joined by gloo.

``spawn(4, fn, *args)`` runs ``fn(rank, size, *args)`` in 4 fresh processes
with an initialised gloo process group and returns their results in rank
order. It is what ``sparsecomm bench`` uses on a laptop; on a cluster, start
ranks with torchrun, srun or mpiexec instead.
"""

from __future__ import annotations

import atexit
import datetime
import functools
import gc
import os
import socket
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import sparsecomm

__all__ = ["spawn", "preload", "save_result", "collect", "join_launched_group", "local_rank"]


def local_rank() -> int:
    """This rank's index on its node, from whichever launcher started it (0 if none says)."""
    for var in ("LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "PMI_LOCAL_RANK", "SLURM_LOCALID"):
        if var in os.environ:
            return int(os.environ[var])
    return 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _alive(pid: int) -> bool:
    """Whether process ``pid`` still exists (the rank's parent is the fork server, not the
    spawner, so the spawner is watched by its pid, not by ``getppid()``)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, owned by someone else
        return True
    return True


def _exit_with_parent(parent: int, poll: float = 1.0) -> None:
    """End this process when ``parent``, the process that spawned it, has gone.

    Otherwise the ranks go on training, or wait in a collective for a peer, with no one
    to collect their results: a parent killed mid-run left four ranks computing. A daemon
    thread polls the parent's pid (portable, unlike prctl's death signal). The spawner
    passes its own pid: one read here could already see the re-parented value.
    """
    if not _alive(parent):
        os._exit(3)

    def watch() -> None:
        while True:
            time.sleep(poll)
            if not _alive(parent):
                os._exit(3)

    threading.Thread(target=watch, name="sparsecomm-parent-watch", daemon=True).start()


def _entry(rank: int, size: int, port: int, outdir: str, backend: str, threads: int,
           fn: Callable[..., Any], args: tuple, parent: int, environ: dict) -> None:
    _exit_with_parent(parent)
    # The spawner's environment as it is now (the fork server started with an earlier one).
    os.environ.clear()
    os.environ.update(environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(threads)
    dist.init_process_group(backend, rank=rank, world_size=size,
                            timeout=datetime.timedelta(seconds=120))
    try:
        save_result(outdir, rank, lambda: fn(rank, size, *args))
    finally:
        # Tear down together, with the function's objects (e.g. DDP reducers) gone
        # first: a rank destroying its group while a peer still used it aborted the
        # peer ("terminate called without an active exception") under load. A rank
        # that failed joins too; if the barrier itself fails, the saved results
        # still say what went wrong.

        gc.collect()
        if dist.is_initialized():  # (the function may have destroyed it itself)
            try:
                if backend == "gloo":
                    dist.monitored_barrier(timeout=datetime.timedelta(seconds=30))
                else:
                    dist.barrier()
            except Exception:  # noqa: BLE001 - the saved result is the report
                pass
            dist.destroy_process_group()


#: Imported once by the fork server, so that a rank starts in a fraction of the 1.5 s of CPU
#: that importing them costs a fresh interpreter (every rank of every launch paid it).
_PRELOAD = ["torch", "torch.distributed", "sparsecomm", "sparsecomm.tools.launch"]


def preload(*modules: str) -> None:
    """Have the fork server import ``modules`` too, once for every rank it starts.

    For what every rank of the caller's launches imports anyway: ``torch._dynamo``, say,
    which ``DistributedDataParallel`` imports on construction (2.2 s of CPU a rank here).
    Only a fork server not yet started takes them (the first :func:`spawn` of a process
    starts it), so call this before that. A module must start no thread on import: the
    server forks every rank from its one thread.
    """
    _PRELOAD.extend(m for m in modules if m not in _PRELOAD)


def _start_method() -> str:
    """"forkserver" where the platform has it: a clean server process (no threads, no CUDA
    context, so forking it is safe) that imported torch once forks each rank; else "spawn"."""
    if "forkserver" not in mp.get_all_start_methods():
        return "spawn"
    mp.get_context("forkserver").set_forkserver_preload(_PRELOAD)
    return "forkserver"


@functools.cache
def _compile_kernels() -> None:
    """Compile the CPU kernels of the common call here, once a process, before ranks start.

    numba caches compiled kernels on disk, but ranks started together on a cold cache (a
    fresh install, a new checkout) each compiled the same kernels at once: the first
    ``sparsecomm bench`` took 28 s of wall time and 39 s of CPU against 12 s and 20 s
    warm. One compile here (a few seconds; milliseconds once cached) and the ranks load it.
    The call: Ok-Topk, stateless and with error feedback, float32, on two simulated ranks
    (their exchange packs messages).
    """
    if not sparsecomm.kernels.dispatch.available("cpu", "cpu"):
        return

    def body(rank: int, size: int) -> None:
        g = torch.randn(1 << 17, generator=torch.Generator().manual_seed(rank))
        sparsecomm.allreduce(g, 0.01)
        state = sparsecomm.OkTopkState(0.01, error_feedback=True)
        for _ in range(3):
            sparsecomm.allreduce(g, state=state)

    sparsecomm.simulate(2, body, 2)


def spawn(nprocs: int, fn: Callable[..., Any], *args: Any, backend: str = "gloo",
          timeout: float = 600, threads: int | None = None, missing_ok: bool = False) -> list[Any]:
    """Run ``fn(rank, nprocs, *args)`` on ``nprocs`` local processes; return their results.

    1. Pick a free loopback port and spawn the processes.
    2. Each initialises ``backend`` (gloo by default), runs ``fn`` and saves
       its result (or its traceback) to a temporary file.
    3. Wait at most ``timeout`` seconds, then kill the processes and raise.

    ``fn`` must be importable by name (a module-level function). Each process
    uses ``threads`` torch threads (default: cores / nprocs, at least 1).
    Raises RuntimeError with the failing rank's traceback if any rank failed.
    With ``missing_ok``, a rank that exited without a result gives None.
    """

    threads = threads or max(1, (os.cpu_count() or 1) // nprocs)
    _compile_kernels()
    with tempfile.TemporaryDirectory() as outdir:
        ctx = mp.start_processes(_entry, args=(nprocs, _free_port(), outdir, backend, threads, fn, args, os.getpid(),
                                               dict(os.environ)),
                                 nprocs=nprocs, join=False, start_method=_start_method())
        deadline = time.monotonic() + timeout
        try:
            while not ctx.join(timeout=1):
                if time.monotonic() > deadline:
                    for p in ctx.processes:
                        p.kill()
                    raise TimeoutError(f"spawn: {getattr(fn, '__name__', fn)} did not finish in {timeout:g} s")
        except mp.ProcessExitedException as exc:
            # A rank whose function raised can still die in teardown (gloo's threads abort the
            # process: "terminate called without an active exception"); the traceback it saved
            # first says why, which the bare signal does not. Every rank saved a result: the
            # work is done, and only a teardown died.
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            try:
                return collect(outdir, nprocs, missing_ok)
            except RuntimeError as failed:
                raise RuntimeError(f"{failed}\n(then a process ended: {exc})") from exc
        return collect(outdir, nprocs, missing_ok)


def save_result(outdir: str, rank: int, fn: Callable[[], Any]) -> bool:
    """Save ``fn()`` (or the traceback it raised) as rank ``rank``'s result in ``outdir``.

    Returns whether ``fn`` succeeded.
    """
    try:
        torch.save({"ok": fn()}, f"{outdir}/{rank}.pt")
        return True
    except BaseException:  # noqa: BLE001 - reported by whoever collects
        torch.save({"error": traceback.format_exc()}, f"{outdir}/{rank}.pt")
        return False


def collect(outdir: str, nprocs: int, missing_ok: bool = False) -> list[Any]:
    """Results saved by :func:`save_result` for ranks 0..nprocs-1; raise on any failure.

    With ``missing_ok``, a rank that saved nothing (it exited) gives None.
    """
    results = []
    for rank in range(nprocs):
        path = Path(outdir) / f"{rank}.pt"
        if not path.exists():
            if missing_ok:
                results.append(None)
                continue
            raise RuntimeError(f"rank {rank} exited without a result")
        data = torch.load(path, weights_only=False)
        if "error" in data:
            raise RuntimeError(f"rank {rank} failed:\n{data['error']}")
        results.append(data["ok"])
    return results


def join_launched_group() -> bool:
    """Under torchrun (or RANK/MASTER_ADDR set), initialise torch.distributed's default group.

    The backend is ``$SPARSECOMM_DIST_BACKEND``, else NCCL where CUDA is
    available (this rank's GPU chosen by its local rank), else gloo. Returns
    whether a torchrun-style launch was found; under mpiexec/srun there is none
    and ``sparsecomm.resolve()`` finds MPI by itself. A group started here is
    destroyed at interpreter exit: gloo's worker threads still alive while the
    interpreter finalises abort the process now and then.
    """
    if not ("TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "MASTER_ADDR" in os.environ)):
        return False
    if not dist.is_initialized():
        backend = os.environ.get("SPARSECOMM_DIST_BACKEND") or ("nccl" if torch.cuda.is_available() else "gloo")
        if backend == "nccl":
            torch.cuda.set_device(local_rank() % torch.cuda.device_count())
        dist.init_process_group(backend)
        atexit.register(_destroy_group)
    return True


def _destroy_group() -> None:
    # What still holds the group (DDP reducers in reference cycles, above all) is freed first,
    # while the interpreter is whole: freed by its last collection during finalisation, gloo's
    # teardown aborted the process now and then ("terminate called without an active exception").
    # (sparsecomm's own cached wrappers go at exit too: sparsecomm.comm._forget_all.)
    gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()
