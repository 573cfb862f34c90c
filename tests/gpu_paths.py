"""Which optional kernel libraries and devices the kernel tests can use here."""

from __future__ import annotations

import importlib.util

__all__ = ["HAVE_NUMBA", "HAVE_TRITON", "cupy_ok"]

HAVE_NUMBA = importlib.util.find_spec("numba") is not None
HAVE_TRITON = importlib.util.find_spec("triton") is not None


def cupy_ok() -> bool:
    """Whether CuPy imports and sees a device (not just whether it is installed)."""
    try:
        import cupy

        return bool(cupy.cuda.is_available())
    except Exception:
        return False
