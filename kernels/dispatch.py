"""Backend choice for the local kernels, and the one table-driven dispatcher every operation uses.

Every operation with fast paths (``ef_select``, ``kth_largest``,
``count_above``, ...) declares a :class:`KernelOp` next to its torch
reference: backend name -> implementation, plus the rule under which a chosen
backend hands the call to the reference. Calling the op picks the backend by
:func:`choose`, applies that rule and runs the implementation. The backends:

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

After the choice, the operation's own rule may still send a call to torch
(``KernelOp(accepts=...)``, e.g. float64 input to a kernel written for
16/32-bit floats): that is a property of the arguments, not of the machine,
so it is silent even for an explicit ``backend=``.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import os
import sys
import threading
import warnings
from typing import Any, Callable, Mapping

import torch

__all__ = ["BACKENDS", "BackendUnavailable", "KernelOp", "OPS", "choose", "available", "install_hint",
           "import_numba", "checks_values", "in_host_memory", "gpu_path", "host_side", "on_host", "to_host", "upload",
           "launch", "counting_launches"]

_ENV = "SPARSECOMM_KERNELS"
_ALIASES = {"numba": "cpu"}
_THREAD = threading.local()


def checks_values(tensor: torch.Tensor) -> bool:
    """Whether argument checks that read ``tensor``'s values on the host run: off GPUs only
    (on a GPU each would stall the stream), and not inside :func:`gpu_path`."""
    return tensor.device.type != "cuda" and not getattr(_THREAD, "gpu_path", False)


def in_host_memory(tensor: torch.Tensor) -> bool:
    """Whether a reference may treat ``tensor`` as host memory (hand it to numpy, take a CPU-only
    path): a CPU tensor, outside :func:`gpu_path`."""
    return tensor.device.type == "cpu" and not getattr(_THREAD, "gpu_path", False)


@contextlib.contextmanager
def gpu_path(kernels: str | None = None):
    """Take the branches a CUDA run takes, on any device, in this thread (the audit's view of a GPU call).

    Args:
        kernels: a GPU backend (``"triton"``) that every operation having it then runs
            whatever the tensors' device (Triton's interpreter runs it on CPU tensors),
            and operations without it run torch, as on a GPU; None keeps an enclosing
            block's (else the usual choice).
    """
    if kernels is not None and kernels not in ("triton", "cupy"):
        raise ValueError(f"gpu_path: kernels must be 'triton' or 'cupy', got {kernels!r}")
    before = getattr(_THREAD, "gpu_path", False), getattr(_THREAD, "forced", None)
    _THREAD.gpu_path, _THREAD.forced = True, kernels or before[1]
    try:
        yield
    finally:
        _THREAD.gpu_path, _THREAD.forced = before


@contextlib.contextmanager
def host_side():
    """Mark tensor work that runs on the host by design (a grid of a few rungs built from Python
    floats, or a value already read): it launches nothing on a GPU, and the audit counts none of it."""
    before, _THREAD.host = getattr(_THREAD, "host", False), True
    try:
        yield
    finally:
        _THREAD.host = before


def on_host() -> bool:
    """Whether this thread is inside :func:`host_side`."""
    return getattr(_THREAD, "host", False)


def to_host(tensor: torch.Tensor) -> Any:
    """``tensor``'s values as Python numbers: the one way the Triton and CuPy wrappers read the
    device (one ``.cpu()``, which the audit counts as one synchronisation)."""
    host = tensor.cpu()
    with host_side():
        return host.tolist()


def upload(values: Any, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A few host values (a list, or a host tensor) as a ``dtype`` tensor on ``device``, with no
    synchronisation: the mirror of :func:`to_host`.

    PyTorch copies pageable host memory to a GPU with a stream synchronisation (unless
    ``non_blocking``, which only pinned memory honours), so a CUDA upload goes through pinned
    memory, asynchronously; PyTorch's pinned allocator keeps the buffer until the copy is done.
    """
    host = values.to(dtype) if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    device = torch.device(device)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def launch(kernel: Any, grid: tuple, *args: Any, **meta: Any) -> None:
    """Launch a Triton kernel on ``grid``: the one way the Triton wrappers start one, so that
    :func:`counting_launches` sees each launch as one device operation."""
    count = getattr(_THREAD, "on_launch", None)
    if count is None:
        kernel[grid](*args, **meta)
        return
    count(getattr(kernel, "__name__", type(kernel).__name__), grid, args)
    with host_side():  # what the interpreter does on the host to run it is the launch
        kernel[grid](*args, **meta)


@contextlib.contextmanager
def counting_launches(count: Callable[[str, tuple, tuple], None]):
    """Call ``count(kernel name, grid, arguments)`` at every :func:`launch` in this thread."""
    before, _THREAD.on_launch = getattr(_THREAD, "on_launch", None), count
    try:
        yield
    finally:
        _THREAD.on_launch = before


class BackendUnavailable(RuntimeError):
    """A backend asked for by name cannot run on this tensor or machine."""


def import_numba():
    """Import numba with a thread pool no larger than torch's thread budget.

    numba sizes its pool from ``NUMBA_NUM_THREADS`` (default: every core) when
    it is first imported, and idle pool threads keep cores busy. With P ranks
    on one node (torchrun and ``sparsecomm.tools.launch`` give each rank cores/P
    torch threads) that made Ok-Topk 4x slower at P = 4 on 2 cores, and
    ``numba.set_num_threads`` later does not shrink the pool. So the budget is
    set before the import, unless the user set it.
    """
    if "numba" not in sys.modules and "NUMBA_NUM_THREADS" not in os.environ:
        os.environ["NUMBA_NUM_THREADS"] = str(max(1, torch.get_num_threads()))
    import numba  # optional; imported here because its thread count must be set first

    return numba


def _triton_ok() -> bool:
    import triton  # noqa: F401  (optional: is it installed?)

    return torch.cuda.is_available()


def _cupy_ok() -> bool:
    import cupy  # optional: is it installed, with a GPU?

    return bool(cupy.cuda.is_available())


def _numba_ok() -> bool:
    import_numba()
    return True


# The backends, in the order error messages list them: the device type each
# runs on (None: any), the probe that says whether its library works here,
# and how to install it. A new backend is one entry here and one in _AUTO.
_REGISTRY: dict[str, tuple[str | None, Callable[[], bool] | None, str]] = {
    "torch": (None, None, ""),
    "triton": ("cuda", _triton_ok, "pip install 'sparsecomm[triton]'  (triton>=3.0, needs a CUDA GPU)"),
    "cupy": ("cuda", _cupy_ok, "pip install 'sparsecomm[cupy]'  (cupy-cuda12x, needs a CUDA GPU)"),
    "cpu": ("cpu", _numba_ok, "pip install numba  (the 'cpu' extra)"),
}
# ``auto``'s preference per device type; any other device type runs torch.
_AUTO = {"cuda": ("triton", "cupy", "torch"), "cpu": ("cpu", "torch")}
# The passes over the whole tensor, where CuPy measured fastest on an H100
# (benchmarks/results/2026-11-23-h100/, float32, 100M / 1B elements): fused
# select at 54% / 70% of the copy bandwidth (Triton 28%, torch 27%), the
# thresholds' counts 1.1x / 5.7x torch.topk (Triton 1.0x / 1.9x). Their tables use
# this order on CUDA. (The exact threshold no longer does: see kernels.select.)
CUDA_SCANS = {"cuda": ("cupy", "triton", "torch")}

BACKENDS = (*_REGISTRY, "auto")


def install_hint(backend: str) -> str:
    """How to install what ``backend`` needs."""
    entry = _REGISTRY.get(_ALIASES.get(backend, backend))
    return entry[2] if entry else ""


@functools.lru_cache(maxsize=None)
def _library_ok(backend: str) -> bool:
    # Cached: importing triton/cupy/numba costs seconds, and availability does
    # not change during a process.
    entry = _REGISTRY.get(backend)
    if entry is None:
        return False
    probe = entry[1]
    if probe is None:
        return True
    try:
        return probe()
    except Exception:  # ImportError, or a broken CUDA runtime raising on probe
        return False


def available(backend: str, device: torch.device | str = "cpu") -> bool:
    """Whether ``backend`` can run on tensors of ``device`` here."""
    backend = _ALIASES.get(backend, backend)
    dev = torch.device(device).type
    entry = _REGISTRY.get(backend)
    if entry is None:
        return False
    runs_on = entry[0]
    return runs_on is None or (dev == runs_on and _library_ok(backend))


def _auto(dev: torch.device, supported: tuple[str, ...], prefer: Mapping[str, tuple[str, ...]] | None = None) -> str:
    for name in (prefer or {}).get(dev.type) or _AUTO.get(dev.type, ("torch",)):
        if name in supported and available(name, dev):
            return name
    return "torch"


@functools.lru_cache(maxsize=None)
def _warn_once(message: str) -> None:
    warnings.warn(message, RuntimeWarning, stacklevel=3)


def choose(tensor: torch.Tensor, backend: str | None = None,
           supported: tuple[str, ...] = ("torch", "triton", "cupy", "cpu"),
           prefer: Mapping[str, tuple[str, ...]] | None = None) -> str:
    """The backend to run an operation on ``tensor`` with.

    Args:
        tensor: the main input; its device decides what can run.
        backend: explicit choice (see the module docstring), or None.
        supported: the backends the operation has. A backend it lacks is
            treated like one that cannot run.
        prefer: device type -> the operation's own order for ``auto``
            (default: the module's, ``_AUTO``).

    Returns:
        One of ``"torch"``, ``"triton"``, ``"cupy"``, ``"cpu"``.
    """
    dev = tensor.device
    forced = getattr(_THREAD, "forced", None)
    if forced is not None and backend is None:  # the audit's view of a GPU (gpu_path)
        return forced if forced in supported else "torch"
    if backend is not None:
        name = _ALIASES.get(backend, backend)
        if name not in BACKENDS:
            raise ValueError(f"unknown kernel backend {backend!r}; choose from {BACKENDS}")
        if name == "auto":
            return _auto(dev, supported, prefer)
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
        # An operation without that backend (e.g. select_above has no Triton path)
        # simply takes its auto choice: the variable is a process-wide preference.
    return _auto(dev, supported, prefer)


#: Every operation's table, by operation name (filled as the kernel modules are imported).
OPS: dict[str, KernelOp] = {}


class KernelOp:
    """One operation's table: backend name -> implementation, and when a backend falls back to torch.

    Every implementation takes the operation's arguments (without
    ``backend``) and returns its result, so the table alone knows the
    backends. Calling ``op(*args, backend=None)`` chooses a backend for
    ``args[on]`` (:func:`choose`), applies the fallback rule and runs.

    Args:
        name: the operation's name (its public function), the key in :data:`OPS`.
        torch: the torch reference, a callable (always importable).
        on: position of the argument whose device decides the backend.
        accepts: backend, or tuple of backends -> predicate over the
            arguments; where it is false the call runs the torch reference
            (e.g. "triton/cupy only for fp16/bf16/fp32").
        prefer: device type -> this operation's order for ``auto`` where it
            differs from the default (measured: see the table that sets it).
        **paths: backend -> ``"module:function"``, the module relative to
            ``sparsecomm.kernels``. Imported when first chosen: backend
            modules import optional libraries.

    Example::

        _KTH = KernelOp("kth_largest", kth_largest_torch, cpu="numba_backend:kth_largest",
                        accepts={("triton", "cupy"): lambda mag, k, use_abs: mag.dtype == torch.float32})
        _KTH(mag, k, False, backend=None)
    """

    def __init__(self, name: str, torch: Callable[..., Any], *, on: int = 0,
                 accepts: Mapping[str | tuple[str, ...], Callable[..., bool]] | None = None,
                 prefer: Mapping[str, tuple[str, ...]] | None = None, **paths: str) -> None:
        for backend, path in paths.items():
            if backend not in _REGISTRY or backend == "torch":
                raise ValueError(f"{name}: unknown kernel backend {backend!r}")
            if path.count(":") != 1:
                raise ValueError(f"{name}: {backend} path {path!r} is not 'module:function'")
        self.name = name
        self.on = on
        self.prefer = dict(prefer or {})
        # In registry order, like choose()'s default.
        self.backends: tuple[str, ...] = tuple(b for b in _REGISTRY if b == "torch" or b in paths)
        self._paths = dict(paths)
        self._loaded: dict[str, Callable[..., Any]] = {"torch": torch}
        self._accepts: dict[str, Callable[..., bool]] = {}
        for key, rule in (accepts or {}).items():
            for backend in (key,) if isinstance(key, str) else key:
                if backend not in paths:
                    raise ValueError(f"{name}: a rule for {backend!r}, which is not in the table")
                self._accepts[backend] = rule
        OPS[name] = self

    def __repr__(self) -> str:
        return f"KernelOp({self.name!r}, backends={self.backends})"

    def __call__(self, *args: Any, backend: str | None = None) -> Any:
        return self.implementation(self.choice(*args, backend=backend))(*args)

    def choice(self, *args: Any, backend: str | None = None) -> str:
        """The backend a call with these arguments runs: chosen (:func:`choose`), then the fallback rule."""
        return self.fallback(choose(args[self.on], backend, self.backends, self.prefer), *args)

    def run(self, backend: str, *args: Any) -> Any:
        """Run ``backend``'s implementation (after the fallback rule), without checking that it can run here.

        For callers that already chose (and tests driving Triton's
        interpreter on CPU tensors).
        """
        return self.implementation(self.fallback(backend, *args))(*args)

    def fallback(self, backend: str, *args: Any) -> str:
        """The backend that runs these arguments when ``backend`` is chosen: it, or torch by the rule."""
        backend = _ALIASES.get(backend, backend)
        if backend not in self.backends:
            raise BackendUnavailable(f"{self.name} has no {backend!r} path (it has {self.backends})")
        rule = self._accepts.get(backend)
        return backend if rule is None or rule(*args) else "torch"

    def implementation(self, backend: str) -> Callable[..., Any]:
        """``backend``'s implementation, imported on first use."""
        fn = self._loaded.get(backend)
        if fn is None:
            if backend not in self._paths:
                raise BackendUnavailable(f"{self.name} has no {backend!r} path (it has {self.backends})")
            module, attr = self._paths[backend].split(":")
            fn = getattr(importlib.import_module(f"{__package__}.{module}"), attr)
            self._loaded[backend] = fn
        return fn
