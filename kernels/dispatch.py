"""Backend choice for the local kernels: one rule shared by every dispatcher.

Every operation with fast paths (``ef_select``, ``kth_largest``,
``estimate_threshold``) has one dispatcher that calls :func:`choose` with the
tensor it works on. The backends:

* ``torch``  -- the reference, any device, always available.
* ``triton`` -- Triton kernels, CUDA tensors (``pip install 'sparsecomm[triton]'``).
* ``cupy``   -- CuPy RawKernels (CUDA C), CUDA tensors (``pip install 'sparsecomm[cupy]'``).
* ``cpu``    -- numba-compiled loops, CPU tensors (``pip install numba``); ``numba``
  is an alias.
* ``auto``   -- the fastest available path for the tensor's device.

Rules, in order:

1. An explicit ``backend=`` argument wins. If that backend cannot run here
   (library missing, no device, wrong device for the tensor) it raises
   :class:`BackendUnavailable` with the install hint: asking for a backend by
   name is a request, not a preference.
2. Else the environment variable ``SPARSECOMM_KERNELS``. It is process-wide
   and applies to tensors of every device, so when its backend cannot run on
   a given tensor the dispatcher falls back to ``auto`` for that tensor
   (warning once) instead of failing; operations that have no such backend
   at all take their ``auto`` choice silently.
3. ``auto``: CUDA tensors use triton, then cupy, then torch; CPU tensors use
   cpu (numba), then torch; other devices use torch.
"""

from __future__ import annotations

import functools
import os
import warnings

import torch

__all__ = ["BACKENDS", "BackendUnavailable", "choose", "available", "install_hint"]

BACKENDS = ("torch", "triton", "cupy", "cpu", "auto")
_ALIASES = {"numba": "cpu"}
_HINTS = {
    "triton": "pip install 'sparsecomm[triton]'  (triton>=3.0, needs a CUDA GPU)",
    "cupy": "pip install 'sparsecomm[cupy]'  (cupy-cuda12x, needs a CUDA GPU)",
    "cpu": "pip install numba  (the 'cpu' extra)",
    "torch": "",
}
_ENV = "SPARSECOMM_KERNELS"


class BackendUnavailable(RuntimeError):
    """A backend asked for by name cannot run on this tensor or machine."""


def install_hint(backend: str) -> str:
    """How to install what ``backend`` needs."""
    return _HINTS.get(_ALIASES.get(backend, backend), "")


def import_numba():
    """Import numba with a thread pool no larger than torch's thread budget.

    numba sizes its pool from ``NUMBA_NUM_THREADS`` (default: every core) when
    it is first imported, and idle pool threads keep cores busy. With P ranks
    on one node (torchrun and ``sparsecomm.launch`` give each rank cores/P
    torch threads) that made Ok-Topk 4x slower at P = 4 on 2 cores, and
    ``numba.set_num_threads`` later does not shrink the pool. So the budget is
    set before the import, unless the user set it.
    """
    import os
    import sys

    if "numba" not in sys.modules and "NUMBA_NUM_THREADS" not in os.environ:
        os.environ["NUMBA_NUM_THREADS"] = str(max(1, torch.get_num_threads()))
    import numba

    return numba


@functools.lru_cache(maxsize=None)
def _library_ok(backend: str) -> bool:
    # Cached: importing triton/cupy/numba costs seconds, and availability does
    # not change during a process.
    try:
        if backend == "triton":
            import triton  # noqa: F401

            return torch.cuda.is_available()
        if backend == "cupy":
            import cupy

            return bool(cupy.cuda.is_available())
        if backend == "cpu":
            import_numba()
            return True
    except Exception:  # ImportError, or a broken CUDA runtime raising on probe
        return False
    return backend == "torch"


def available(backend: str, device: torch.device | str = "cpu") -> bool:
    """Whether ``backend`` can run on tensors of ``device`` here."""
    backend = _ALIASES.get(backend, backend)
    dev = torch.device(device).type
    if backend == "torch":
        return True
    if backend in ("triton", "cupy"):
        return dev == "cuda" and _library_ok(backend)
    if backend == "cpu":
        return dev == "cpu" and _library_ok("cpu")
    return False


def _auto(dev: torch.device, supported: tuple[str, ...]) -> str:
    order = ("triton", "cupy", "torch") if dev.type == "cuda" else ("cpu", "torch")
    for name in order:
        if name in supported and available(name, dev):
            return name
    return "torch"


@functools.lru_cache(maxsize=None)
def _warn_once(message: str) -> None:
    warnings.warn(message, RuntimeWarning, stacklevel=3)


def choose(tensor: torch.Tensor, backend: str | None = None,
           supported: tuple[str, ...] = ("torch", "triton", "cupy", "cpu")) -> str:
    """The backend to run an operation on ``tensor`` with.

    Args:
        tensor: the main input; its device decides what can run.
        backend: explicit choice (see the module docstring), or None.
        supported: the backends the operation has. A backend it lacks is
            treated like one that cannot run.

    Returns:
        One of ``"torch"``, ``"triton"``, ``"cupy"``, ``"cpu"``.
    """
    dev = tensor.device
    if backend is not None:
        name = _ALIASES.get(backend, backend)
        if name not in BACKENDS:
            raise ValueError(f"unknown kernel backend {backend!r}; choose from {BACKENDS}")
        if name == "auto":
            return _auto(dev, supported)
        if name not in supported:
            raise BackendUnavailable(f"this operation has no {name!r} path (it has {supported})")
        if not available(name, dev):
            hint = install_hint(name)
            raise BackendUnavailable(
                f"kernel backend {name!r} cannot run on a {dev.type} tensor here"
                + (f"; install it with: {hint}" if hint else ""))
        return name
    env = os.environ.get(_ENV, "").strip().lower()
    if env:
        name = _ALIASES.get(env, env)
        if name not in BACKENDS:
            raise ValueError(f"{_ENV}={env!r}: unknown backend; choose from {BACKENDS}")
        if name != "auto" and name in supported:
            if available(name, dev):
                return name
            _warn_once(f"{_ENV}={env}: cannot run on {dev.type} tensors here, using auto"
                       + (f" (install: {install_hint(name)})" if install_hint(name) else ""))
        # An operation without that backend (e.g. scatter_add has no numba path)
        # simply takes its auto choice: the variable is a process-wide preference.
    return _auto(dev, supported)
