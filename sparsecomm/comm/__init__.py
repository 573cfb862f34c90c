"""Communicators: one small interface, three backends, one resolution rule.

``resolve(group=None, comm=None)`` picks the communicator for a call:

1. ``comm=``: a :class:`Communicator`, or an mpi4py communicator (wrapped);
2. ``group=``: a torch.distributed process group (wrapped);
3. inside ``simulate``: the calling virtual rank's communicator;
4. the default torch.distributed group, if initialised;
5. MPI COMM_WORLD, when launched by an MPI launcher with more than one rank;
6. otherwise a world of size 1, where every collective is the identity.

Wrappers are cached per group/communicator so their traffic counters persist.
"""

from __future__ import annotations

import atexit
import gc
import os
import threading
from typing import Any

import torch.distributed as dist

from .base import CommStats, Communicator, Request, default_timeout
from .mpi import MPICommunicator
from .sim import SimCommunicator, SimResult, current_sim_comm, simulate, single_rank
from .torchdist import TorchCommunicator

__all__ = ["Communicator", "Request", "CommStats", "SimCommunicator", "SimResult",
           "simulate", "resolve", "self_communicator", "default_timeout"]

_cache: dict[int, tuple[Any, Communicator]] = {}
_lock = threading.Lock()
_MPI_SIZE_VARS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE", "MPI_LOCALNRANKS",
                  "MV2_COMM_WORLD_SIZE", "SLURM_NTASKS")


def _cached(key_obj: Any, make: Any) -> Communicator:
    with _lock:
        hit = _cache.get(id(key_obj))
        if hit is not None and hit[0] is key_obj:
            return hit[1]
        wrapper = make()
        _cache[id(key_obj)] = (key_obj, wrapper)
        return wrapper


@atexit.register
def _forget_all() -> None:
    """Drop the cached wrappers at exit, while the interpreter is whole. A process group the
    cache kept alive past the program's ``destroy_process_group()`` was freed during
    finalisation, where gloo's teardown aborted the process now and then ("terminate called
    without an active exception"; benchmarks/results/2026-11-27-cpu-vm-teardown-abort)."""
    with _lock:
        _cache.clear()
    gc.collect()


def self_communicator() -> Communicator:
    """A communicator of world size 1 (every collective returns its input)."""
    return _cached(self_communicator, lambda: _make_self())


def _make_self() -> Communicator:
    return single_rank(name="self")


def _launched_by_mpi() -> bool:
    for var in _MPI_SIZE_VARS:
        try:
            if int(os.environ.get(var, "1")) > 1:
                return True
        except ValueError:
            continue
    return False


def resolve(group: Any = None, comm: Any = None) -> Communicator:
    """The communicator a call should use (see the module docstring for the order)."""
    if comm is not None and group is not None:
        raise ValueError("pass either group= (torch.distributed) or comm= (MPI or a "
                         "sparsecomm Communicator), not both")
    if comm is not None:
        if isinstance(comm, Communicator):
            return comm
        return _cached(comm, lambda: MPICommunicator(comm))
    if group is not None:
        return _cached(group, lambda: TorchCommunicator(group))
    sim = current_sim_comm()
    if sim is not None:
        return sim
    if dist.is_available() and dist.is_initialized():
        world = dist.group.WORLD
        return _cached(world, lambda: TorchCommunicator(world))
    if _launched_by_mpi():
        try:
            from mpi4py import MPI  # optional engine: present only where MPI is installed
        except ImportError:
            pass
        else:
            return _cached(MPI.COMM_WORLD, lambda: MPICommunicator(MPI.COMM_WORLD))
    return self_communicator()
