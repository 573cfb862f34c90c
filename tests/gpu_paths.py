"""Which kernel backends the tests can run here, and how to run any of them on CPU test tensors.

A test of one operation takes ``backend`` from :func:`backend_params` (every
backend in the operation's ``KernelOp`` table; those that cannot run here are
skipped, the reason naming what is missing) and :func:`runner`, which runs
that backend's implementation on the test's CPU tensors:

* ``torch`` and ``cpu`` (numba) as they are;
* ``triton`` compiled, on copies on the GPU, where ``torch.cuda.is_available()``;
  elsewhere in Triton's interpreter, on the CPU tensors;
* ``cupy`` on copies on the GPU, with results and in-place outputs copied back.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys

import pytest
import torch

from sparsecomm import kernels
from sparsecomm.kernels import dispatch

__all__ = ["HAVE_NUMBA", "HAVE_TRITON", "cupy_ok", "missing", "backend_params", "interpret_triton", "runner",
           "interpreter_only"]

HAVE_NUMBA = dispatch.available("cpu", "cpu")  # imports numba: installed is not enough
HAVE_TRITON = importlib.util.find_spec("triton") is not None

#: For a test that audits the Triton chain in Triton's interpreter, on CPU tensors. The interpreter
#: runs ``tl.*`` only where triton was first imported interpreted, and a process that sees a GPU
#: imports it compiled: there ``benchmarks/audit_calls.py --device cuda`` counts the compiled chain.
interpreter_only = pytest.mark.skipif(
    torch.cuda.is_available() or not HAVE_TRITON,
    reason="needs Triton's interpreter in a process without a GPU (triton installed, no CUDA)")


def cupy_ok() -> bool:
    """Whether CuPy imports and sees a device (not just whether it is installed)."""
    try:
        import cupy

        return bool(cupy.cuda.is_available())
    except Exception:
        return False


def missing(backend: str) -> str | None:
    """Why ``backend``'s kernels cannot run in these tests, or None when they can.

    With a GPU the GPU libraries are never a reason: there a missing triton or cupy
    must fail the tests that need it, not skip them.
    """
    if backend in ("triton", "cupy") and torch.cuda.is_available():
        return None
    if backend == "cpu" and not HAVE_NUMBA:
        return "numba does not import (pip install numba)"
    if backend == "triton" and not HAVE_TRITON:
        return "triton not installed (its interpreter runs the kernels without a GPU)"
    if backend == "cupy" and not cupy_ok():
        return "cupy not installed or cupy.cuda.is_available() is False"
    return None


def backend_params(op: str) -> list:
    """A pytest param per backend in ``op``'s table (``dispatch.OPS``), skipped where it cannot run here."""
    return [pytest.param(b, id=b, marks=pytest.mark.skipif(missing(b) is not None, reason=str(missing(b))))
            for b in dispatch.OPS[op].backends]


_JIT = "sparsecomm.kernels._triton_jit"


def interpret_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make ``triton_backend`` launch interpreted kernels until ``monkeypatch`` is undone.

    ``triton.jit`` reads TRITON_INTERPRET when it wraps a kernel, i.e. when
    ``_triton_jit`` is imported, and the module then stays in sys.modules.
    So: set the variable, import a fresh ``_triton_jit`` (``triton_backend``
    looks it up in sys.modules at every launch), and let monkeypatch restore
    both the environment and the previous module (compiled or none) after the test.
    """
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    # setitem, not delitem: delitem of an absent key records nothing to undo,
    # and the interpreted module imported below would stay for later tests.
    monkeypatch.setitem(sys.modules, _JIT, None)
    del sys.modules[_JIT]
    monkeypatch.setattr(kernels, "_triton_jit", None, raising=False)  # the import sets it; undone after
    jit = importlib.import_module(_JIT)
    assert type(jit.ef_select_kernel).__name__ == "InterpretedFunction", type(jit.ef_select_kernel)


def _to(obj, device: str):
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, tuple):
        return tuple(_to(o, device) for o in obj)
    return obj


def runner(backend: str, monkeypatch: pytest.MonkeyPatch):
    """``run(op, *args)``: ``backend``'s implementation of ``op`` (after its fallback rule) on CPU tensors.

    The test's ``monkeypatch`` scopes the Triton interpreter to that test.
    """
    on_gpu = backend == "cupy" or (backend == "triton" and torch.cuda.is_available())
    if backend == "triton" and not on_gpu:
        interpret_triton(monkeypatch)

    def run(op: str, *args):
        table = dispatch.OPS[op]
        if not on_gpu:
            return table.run(backend, *args)
        moved = [_to(a, "cuda") for a in args]
        result = table.run(backend, *moved)
        for a, m in zip(args, moved):
            if isinstance(a, torch.Tensor):
                a.copy_(m)  # outputs written in place (residuals, buffers)
                if result is m:  # an output returned as written: the caller's own tensor, as on the CPU
                    return a
        return _to(result, "cpu")

    return run
