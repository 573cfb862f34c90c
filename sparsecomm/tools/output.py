"""Results in and out: JSON of rows (dataclasses or dicts), matplotlib for plots, progress bars.

Shared by the commands so that every command writes the same kind of file the
same way, reads the files it is given with the same one-line errors, and shows
progress the same way (on a terminal only).
"""

from __future__ import annotations

import json
from dataclasses import asdict, is_dataclass
from typing import Any, Iterable

from tqdm import tqdm

from ..errors import InputFileError

__all__ = ["write_json", "read_json", "pyplot", "progress"]


def write_json(rows: Iterable[Any], path: str) -> None:
    """Write ``rows`` (dataclass instances or dicts) as a JSON list of objects."""
    dicts = [asdict(r) if is_dataclass(r) and not isinstance(r, type) else r for r in rows]
    with open(path, "w") as f:
        json.dump(dicts, f, indent=2)


def read_json(path: str) -> Any:
    """The JSON document in ``path``; InputFileError naming the file if it is missing or not JSON."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        raise InputFileError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise InputFileError(f"{path}: is a folder, not a file") from None
    except OSError as exc:
        raise InputFileError(f"{path}: cannot read ({exc.strerror or exc})") from None
    except UnicodeDecodeError:
        raise InputFileError(f"{path}: not JSON (not UTF-8 text)") from None
    except json.JSONDecodeError as exc:
        raise InputFileError(f"{path}: not JSON (line {exc.lineno}: {exc.msg})") from None


def progress(iterable: Iterable[Any] | None = None, *, show: bool = True, **kwargs: Any) -> Any:
    """A tqdm progress bar on stderr, drawn only when ``show`` and stderr is a terminal.

    Logs and pipes get no carriage-return noise; keyword arguments go to tqdm
    (``total``, ``desc``, ``unit``, ...).
    """
    # disable=None: tqdm turns itself off when its stream (stderr) is not a terminal.
    return tqdm(iterable, disable=None if show else True, dynamic_ncols=True, **kwargs)


def pyplot() -> Any:
    """``matplotlib.pyplot`` with a file backend, or an ImportError saying how to install it."""
    try:
        import matplotlib  # optional: only plots need it

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # after use("Agg"): no display needed
    except ImportError as exc:  # pragma: no cover - depends on the machine
        raise ImportError("plots need matplotlib: pip install 'sparsecomm[study]'") from exc
    return plt
