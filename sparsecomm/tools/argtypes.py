"""Argument types of the ``sparsecomm`` commands: values checked where argparse reads them.

Each is an argparse ``type``: it returns the parsed value or raises
``argparse.ArgumentTypeError``, so a bad value ends the command with
argparse's one-line usage error and exit status 2, before any work starts.
Lists of names are checked against the registries the package keeps
(``sparsecomm.algorithms()``, ``compress.COMPRESSORS``, ``synthetic.KINDS``,
...), passed in as callables or sequences, never typed out again.
"""

from __future__ import annotations

import argparse
import math
import os
from typing import Any, Callable, Iterable, Union

__all__ = ["int_in", "float_in", "positive_int", "nonnegative_int", "positive_float", "density", "name_in",
           "comma_list", "checked_by", "out_folder", "new_file", "Known"]

#: A registry of names: a sequence, or a function returning one (read when an argument is parsed).
Known = Union[Iterable[str], Callable[[], Iterable[str]]]


def _bad(text: str, wanted: str) -> argparse.ArgumentTypeError:
    return argparse.ArgumentTypeError(f"must be {wanted}, got {text!r}")


def int_in(lo: int, hi: int | None = None) -> Callable[[str], int]:
    """An integer type accepting ``lo <= value`` (and ``value <= hi`` when given)."""
    wanted = f"an integer >= {lo}" if hi is None else f"an integer from {lo} to {hi}"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise _bad(text, wanted) from None
        if value < lo or (hi is not None and value > hi):
            raise _bad(text, wanted)
        return value

    parse.__name__ = wanted  # what argparse names in its own messages
    return parse


def float_in(lo: float, hi: float = math.inf, *, lo_open: bool = False, hi_open: bool = False
             ) -> Callable[[str], float]:
    """A finite float type in the interval from ``lo`` to ``hi``, each end closed unless ``*_open``."""
    if hi == math.inf:
        wanted = f"a number {'>' if lo_open else '>='} {lo:g}"
    else:
        wanted = f"a number in {'(' if lo_open else '['}{lo:g}, {hi:g}{')' if hi_open else ']'}"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise _bad(text, wanted) from None
        inside = (value > lo if lo_open else value >= lo) and (value < hi if hi_open else value <= hi)
        if not (math.isfinite(value) and inside):
            raise _bad(text, wanted)
        return value

    parse.__name__ = wanted
    return parse


positive_int = int_in(1)
nonnegative_int = int_in(0)
positive_float = float_in(0.0, lo_open=True)
#: The fraction of entries a sparse allreduce selects.
density = float_in(0.0, 1.0, lo_open=True)


def name_in(known: Known, what: str) -> Callable[[str], str]:
    """A type accepting one of ``known`` (a sequence, or a callable returning one: read when parsing)."""

    def parse(text: str) -> str:
        names = list(known() if callable(known) else known)
        if text not in names:
            raise argparse.ArgumentTypeError(f"unknown {what} {text!r}; choose from {', '.join(names)}")
        return text

    parse.__name__ = what
    return parse


def comma_list(item: Callable[[str], Any]) -> Callable[[str], list]:
    """A comma-separated list, each element parsed by ``item`` (one of the types above); none empty."""

    def parse(text: str) -> list:
        parts = [p.strip() for p in text.split(",")]
        if not all(parts):
            raise argparse.ArgumentTypeError(f"empty element in the comma-separated list {text!r}")
        return [item(p) for p in parts]

    parse.__name__ = f"comma-separated {getattr(item, '__name__', 'value')}"
    return parse


def checked_by(check: Callable[[str], Any], what: str) -> Callable[[str], str]:
    """A type keeping the text as it is once ``check(text)`` accepted it (its ValueError is the message)."""

    def parse(text: str) -> str:
        try:
            check(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        return text

    parse.__name__ = what
    return parse


def out_folder(text: str) -> str:
    """A folder to write into: it may not exist yet (it is created once there is something to write)."""
    if os.path.exists(text) and not os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text!r} exists and is not a folder")
    return text


def new_file(text: str) -> str:
    """A file to write: its folder must exist, and the path must not be a folder."""
    folder = os.path.dirname(text) or "."
    if os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text!r} is a folder")
    if not os.path.isdir(folder):
        raise argparse.ArgumentTypeError(f"folder {folder!r} of {text!r} does not exist")
    return text

