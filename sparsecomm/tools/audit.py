"""What a call would launch and where it would stall on a GPU, counted on any device.

A steady-state call on a GPU is bound by kernel launches and host
synchronisations, not bytes: each synchronisation drains the stream and stops
the CPU from queuing the backward's next kernels. :func:`audit` counts both on
the CPU, through the torch kernel path (the operations a CUDA run would launch;
``SPARSECOMM_KERNELS=torch`` inside the block):

* **device operations**, a launch proxy: every aten operation that computes
  (views, allocations and metadata do not launch a kernel);
* **synchronisations**, the operations that make the host wait for the device
  on CUDA: reads of values (``item``, ``tolist``, ``cpu``, ``numpy``,
  ``bool()``/``int()``/``float()``/``__index__`` of a tensor) and operations
  whose output size is data (``nonzero``, boolean indexing, ``masked_select``,
  ``unique``, ``repeat_interleave`` without ``output_size``, ``bincount``);
  each is listed by the source line that made it (``sites``);
* **data-dependent allocations**: outputs of those size-from-data operations,
  which no CUDA graph can replay;
* work marked ``kernels.dispatch.host_side`` (a few rungs computed from
  Python floats, host by design on a GPU too) counts as nothing;
* ``trace``: every device operation with its output shapes, so two calls can
  be compared (:meth:`Audit.replayable_with`): a call whose trace is the same
  whatever the data is ready to be captured in a CUDA graph.

Work inside the communicator (the simulated world's copies, gloo's host
staging) is counted apart (``comm_ops``, ``comm_syncs``): it belongs to the
engine, not to the algorithm. The kernels' Triton and CuPy wrappers read the
device through one function, ``kernels.dispatch.to_host``, a ``.cpu()`` the
function mode sees.

Modes are per thread: in the simulated world each rank enters its own block.
On a GPU, :func:`cuda_crosscheck` gives the same call's kernels and
synchronisations as the profiler and ``torch.cuda.set_sync_debug_mode`` see them.
"""

from __future__ import annotations

import contextlib
import os
import sys
import types
import warnings
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from ..comm.base import Communicator
from ..kernels import dispatch

__all__ = ["Audit", "audit", "audit_steady", "triton_view", "cuda_crosscheck", "SYNC_METHODS", "SIZE_FROM_DATA"]

#: Tensor methods that read device memory on the host (on the CPU some dispatch nothing).
SYNC_METHODS = frozenset({"item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__"})
#: Operations whose output size is data: the host must read it before allocating.
SIZE_FROM_DATA = frozenset({"nonzero", "masked_select", "unique", "_unique", "_unique2", "unique_dim",
                            "unique_consecutive", "bincount", "equal", "is_nonzero"})
#: Operations that launch nothing: allocations, metadata, scalar reads (counted as syncs).
_NO_LAUNCH = frozenset({"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "detach",
                        "lift_fresh", "alias", "_local_scalar_dense", "set_", "resize_", "sym_size",
                        "sym_stride", "sym_numel", "sym_storage_offset", "is_same_size", "_has_compatible_shallow_copy_type"})
_HERE = os.path.abspath(__file__)
_TORCH = os.path.dirname(os.path.abspath(torch.__file__))
_PACKAGE = os.path.dirname(os.path.dirname(_HERE))
_COMM = os.path.join(_PACKAGE, "comm") + os.sep
#: Frames a site is never attributed to: this module, and the kernels' dispatcher (its
#: ``to_host`` is every GPU wrapper's read; the caller's line says which).
_PLUMBING = (_HERE, os.path.abspath(dispatch.__file__))


@dataclass
class Audit:
    """Counts of one block (one rank's call, or several calls)."""

    ops: Counter = field(default_factory=Counter)
    syncs: Counter = field(default_factory=Counter)
    sites: Counter = field(default_factory=Counter)
    dynamic: Counter = field(default_factory=Counter)
    comm_ops: int = 0
    comm_syncs: int = 0
    trace: list = field(default_factory=list)

    @property
    def n_ops(self) -> int:
        """Device operations outside the communicator."""
        return sum(self.ops.values())

    @property
    def n_syncs(self) -> int:
        """Host synchronisations outside the communicator."""
        return sum(self.syncs.values())

    @property
    def n_dynamic(self) -> int:
        """Allocations whose size is data."""
        return sum(self.dynamic.values())

    def replayable_with(self, other: "Audit") -> bool:
        """Whether the two blocks launched the same operations with the same output shapes."""
        return self.trace == other.trace

    def summary(self) -> dict[str, Any]:
        """The counts as a JSON-ready row."""
        return {"ops": self.n_ops, "syncs": self.n_syncs, "dynamic_allocs": self.n_dynamic,
                "comm_ops": self.comm_ops, "comm_syncs": self.comm_syncs,
                "sync_sites": dict(self.sites.most_common())}


def _caller() -> tuple[str, bool]:
    """The innermost source line outside torch and this module, and whether a communicator is on the stack."""
    frame: types.FrameType | None = sys._getframe(2)
    site, in_comm = "", False
    while frame is not None:
        path = frame.f_code.co_filename
        if not site and not path.startswith(_TORCH) and os.path.abspath(path) not in _PLUMBING:
            site = f"{os.path.relpath(path, os.path.dirname(_PACKAGE))}:{frame.f_lineno}"
        if path.startswith(_COMM) and isinstance(frame.f_locals.get("self"), Communicator):
            in_comm = True
            break
        frame = frame.f_back
    return site, in_comm


class _Functions(TorchFunctionMode):
    def __init__(self, audit: Audit) -> None:
        super().__init__()
        self.audit, self.reading = audit, 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name not in SYNC_METHODS or not args or not isinstance(args[0], torch.Tensor) or dispatch.on_host():
            return func(*args, **(kwargs or {}))
        site, in_comm = _caller()
        if in_comm:
            self.audit.comm_syncs += 1
        else:
            self.audit.syncs[name.strip("_")] += 1
            self.audit.sites[site] += 1
        self.reading += 1  # the scalar read it dispatches is this sync, not another
        try:
            return func(*args, **(kwargs or {}))
        finally:
            self.reading -= 1


class _Dispatch(TorchDispatchMode):
    def __init__(self, audit: Audit, functions: _Functions) -> None:
        super().__init__()
        self.audit, self.functions = audit, functions

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if func.is_view or name in _NO_LAUNCH and name != "_local_scalar_dense" or dispatch.on_host():
            return out
        site, in_comm = _caller()
        if name == "_local_scalar_dense":
            if not self.functions.reading:
                self._sync("item", site, in_comm)
            return out
        if in_comm:
            self.audit.comm_ops += 1
            return out
        self.audit.ops[name] += 1
        outs = out if isinstance(out, (tuple, list)) else (out,)
        self.audit.trace.append((name, tuple(tuple(o.shape) for o in outs if isinstance(o, torch.Tensor))))
        reason = self._size_from_data(func, name, args, kwargs or {})
        if reason:
            self._sync(reason, site, False)
            self.audit.dynamic[reason] += 1
        return out

    def _sync(self, reason: str, site: str, in_comm: bool) -> None:
        if in_comm:
            self.audit.comm_syncs += 1
        else:
            self.audit.syncs[reason] += 1
            self.audit.sites[site] += 1

    @staticmethod
    def _size_from_data(func, name: str, args, kwargs) -> str | None:
        if name in SIZE_FROM_DATA:
            return "bincount" if name == "bincount" else name.strip("_")
        if name == "repeat_interleave" and kwargs.get("output_size", args[3] if len(args) > 3 else None) is None:
            return "repeat_interleave"
        if name in ("index", "index_put", "index_put_") and len(args) > 1:
            if any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in args[1] or ()):
                return "boolean_index"
        return None


@contextlib.contextmanager
def audit(kernels: str | None = "torch") -> Iterator[Audit]:
    """Count the block's device operations, synchronisations and size-from-data allocations.

    1. Choose the kernels: ``"torch"`` (default) sets ``SPARSECOMM_KERNELS``, the
       operations a GPU without Triton launches; ``"triton"`` runs every
       operation that has a Triton kernel through it (Triton's interpreter on
       CPU tensors: :func:`triton_view`), each launch one device operation, and
       the others through torch: the chain an H100 runs; None leaves the choice.
       Either way take the branches a CUDA run takes (``kernels.dispatch.gpu_path``:
       no argument checks that read values).
    2. Enter a function mode (value reads that dispatch nothing on the CPU)
       and a dispatch mode (every aten operation) on this thread.
    3. Yield the :class:`Audit` they fill.

    Args:
        kernels: ``"torch"``, ``"triton"``, or None for the current choice.
    """
    counts = Audit()
    functions = _Functions(counts)

    def launched(name: str, grid: tuple, args: tuple) -> None:
        site, in_comm = _caller()
        if in_comm:
            counts.comm_ops += 1
            return
        counts.ops[f"triton.{name}"] += 1
        # A graph replays the grid and the scalar arguments it captured: they are part of the shape.
        shapes = tuple(tuple(a.shape) if isinstance(a, torch.Tensor) else a for a in args)
        counts.trace.append((name, tuple(grid), shapes))

    forced = kernels if kernels == "triton" else None
    with _kernels(None if forced else kernels), triton_view(forced is not None), dispatch.gpu_path(forced), \
            dispatch.counting_launches(launched), functions, _Dispatch(counts, functions):
        yield counts


@contextlib.contextmanager
def triton_view(on: bool = True) -> Iterator[None]:
    """Run the Triton kernels interpreted in this block (when ``on``, and no GPU: with one they run
    compiled, on its tensors), whatever was imported before.

    ``triton.jit`` reads ``TRITON_INTERPRET`` when it wraps a kernel, i.e. when
    ``kernels._triton_jit`` is imported, and ``triton_backend`` looks that module up at
    every launch: so set the variable, import the module afresh, and put back both after.
    The interpreter runs Triton's own library functions (``tl.sum``) only if triton itself
    was first imported under the variable: a process that audits Triton sets it first.
    """
    name = f"{dispatch.__name__.rsplit('.', 1)[0]}._triton_jit"
    loaded = sys.modules.get(name)
    if not on or torch.cuda.is_available() or \
            type(getattr(loaded, "ef_select_kernel", None)).__name__ == "InterpretedFunction":
        yield  # (an enclosing block, or another rank's thread, swapped it already)
        return
    import importlib  # here: only the Triton view swaps modules

    old_env, old_module = os.environ.get("TRITON_INTERPRET"), sys.modules.pop(name, None)
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        importlib.import_module(name)
        yield
    finally:
        sys.modules.pop(name, None)
        if old_module is not None:
            sys.modules[name] = old_module
        if old_env is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = old_env


@contextlib.contextmanager
def _kernels(backend: str | None) -> Iterator[None]:
    """``SPARSECOMM_KERNELS`` set to ``backend`` inside the block (None: left as it is)."""
    old = os.environ.get("SPARSECOMM_KERNELS")
    if backend is not None:
        os.environ["SPARSECOMM_KERNELS"] = backend
    try:
        yield
    finally:
        if backend is not None:
            if old is None:
                os.environ.pop("SPARSECOMM_KERNELS", None)
            else:
                os.environ["SPARSECOMM_KERNELS"] = old


def cuda_crosscheck(fn: Callable[[], Any]) -> dict[str, Any]:
    """One ``fn()`` on CUDA as the profiler and the sync-debug mode see it (kernels, copies, syncs).

    1. Profile the call: CUDA kernels and memory copies/sets.
    2. Run it again under ``torch.cuda.set_sync_debug_mode("warn")`` and count
       the warnings, by the line that made them.
    """
    from torch.profiler import ProfilerActivity, profile  # imported here: the profiler is only for GPU runs

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    copies = sum(1 for e in events if e.name.startswith(("Memcpy", "Memset")))
    sites: Counter = Counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    for w in caught:
        # The sync warnings say "called a synchronizing CUDA operation"; the mode's own
        # notice ("... does not yet detect all synchronizing operations") is not one.
        if "called a synchronizing" in str(w.message):
            sites[f"{os.path.basename(w.filename)}:{w.lineno}"] += 1
    return {"kernels": len(events) - copies, "copies": copies, "syncs": sum(sites.values()),
            "sync_sites": dict(sites)}


#: Warm-up calls that run the audited Triton kernels themselves, at the end of the warm-up.
_TRITON_WARMUP = 4


def audit_steady(algorithm: str, world_size: int = 1, n: int = 20_000, density: float = 0.01,
                 warmup: int = 120, calls: int = 2, compressor: str | None = None, out: bool = False,
                 device: str = "cpu", kernels: str | None = "torch") -> list[list[Audit]]:
    """Audit steady-state calls of ``algorithm`` with error feedback in the simulated world.

    1. Every rank makes a drifting gradient (g <- 0.9 g + 0.1 noise, its own seed).
    2. ``warmup`` calls with a state: error feedback builds its residuals up
       over about 1 / density calls (until then TopkA's guide, say, misses
       every call), and the next ones reuse thresholds and boundaries (with
       Ok-Topk's default tau = 32 the audited calls 121 and 122 re-evaluate
       nothing).
    3. ``calls`` calls, each in its own :func:`audit` block.

    Args:
        algorithm: a registered name.
        world_size: simulated ranks (threads of this process).
        n, density: the gradient's size and the fraction selected.
        warmup, calls: calls before the audited ones, and audited calls.
        compressor: a compressor name, or None.
        out: pass ``out=`` (else the plain call).
        device: where the tensors live.
        kernels: the kernel backend audited (see :func:`audit`).

    Returns:
        Per rank, one :class:`Audit` per audited call.
    """
    import sparsecomm  # imported here: the tools' audit sits below the public API in the import graph
    from sparsecomm.comm.sim import simulate

    def rank_fn(rank: int) -> list[Audit]:
        gen = torch.Generator(device=device).manual_seed(1000 + rank)
        g = torch.randn(n, generator=gen, device=device)
        noise = torch.empty_like(g)
        state = sparsecomm.registry.get(algorithm).state_class(density, error_feedback=True)
        into = torch.empty_like(g) if out else None
        audits = []
        # The warm-up's last calls run the audited kernels too (a Triton view's backend is chosen
        # per thread), so their buffers and compiled kernels are in place; the calls before them
        # run this machine's kernels, which select the same entries at a fraction of the Triton
        # interpreter's time (it took a minute for 120 calls at P = 3).
        ahead = max(0, warmup - _TRITON_WARMUP) if kernels == "triton" else warmup
        for i in range(warmup):
            with dispatch.gpu_path("triton") if i >= ahead else contextlib.nullcontext():
                g.mul_(0.9).add_(torch.randn(n, generator=gen, device=device, out=noise), alpha=0.1)
                sparsecomm.allreduce(g, state=state, compressor=compressor, out=into)
        for i in range(calls):
            g.mul_(0.9).add_(torch.randn(n, generator=gen, device=device, out=noise), alpha=0.1)
            with audit(kernels) as counts:
                sparsecomm.allreduce(g, state=state, compressor=compressor, out=into)
            audits.append(counts)
        return audits

    with _kernels(None if kernels == "triton" else kernels), triton_view(kernels == "triton"):
        return simulate(world_size, rank_fn).results
