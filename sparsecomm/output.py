"""Writing results: JSON of rows (dataclasses or dicts) and matplotlib for plots.

Shared by ``bench``, ``study`` and ``train`` so that every command writes the
same kind of file the same way.
"""

from __future__ import annotations

import json
from dataclasses import asdict, is_dataclass
from typing import Any, Iterable

__all__ = ["write_json", "pyplot"]


def write_json(rows: Iterable[Any], path: str) -> None:
    """Write ``rows`` (dataclass instances or dicts) as a JSON list of objects."""
    dicts = [asdict(r) if is_dataclass(r) and not isinstance(r, type) else r for r in rows]
    with open(path, "w") as f:
        json.dump(dicts, f, indent=2)


def pyplot() -> Any:
    """``matplotlib.pyplot`` with a file backend, or an ImportError saying how to install it."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:  # pragma: no cover - depends on the machine
        raise ImportError("plots need matplotlib: pip install 'sparsecomm[study]'") from exc
    return plt
