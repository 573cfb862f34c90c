"""The README's table of algorithms, made from the registry.

    python -m sparsecomm.tools.tables              # print it
    python -m sparsecomm.tools.tables --write README.md

Each row comes from what the algorithm's module registers, so the table cannot drift from the
code: what it does (the first paragraph of the algorithm's docstring), its words received per
rank (the first paragraph of its ``volume``'s docstring, and the function itself evaluated), and
its messages (its ``traffic`` model, which ``"auto"`` and the projections use). ``--write``
replaces the table between the README's markers; a test holds that the README's is this one.
"""

from __future__ import annotations

import argparse
import inspect
import sys

from .. import registry

__all__ = ["BEGIN", "END", "algorithm_table", "replace_table", "main"]

BEGIN = "<!-- algorithm table: made by `python -m sparsecomm.tools.tables --write README.md` -->"
END = "<!-- end of the algorithm table -->"

#: Where the numbers are evaluated: k selected of n = 100 k (density 1%), at these world sizes,
#: and nodes of this many ranks for the algorithms that have nodes.
WORLD_SIZES = (16, 256)
K = 1_000_000
RANKS_PER_NODE = 8
WORDS = "Words received per rank: "


def _words(spec: registry.AlgorithmSpec) -> tuple[str, str]:
    """The formula and its value ÷ k at each world size (low–high)."""
    formula = registry.first_paragraph(spec.volume.__doc__)
    if not formula.startswith(WORDS):
        raise ValueError(f"{spec.name}: its volume's docstring must begin {WORDS!r}, it begins {formula[:40]!r}")
    node = {"G": RANKS_PER_NODE} if "G" in inspect.signature(spec.volume).parameters else {}
    cells = []
    for P in WORLD_SIZES:
        lo, hi = spec.volume(100 * K, K, P, **node)
        cells.append(f"{lo / K:.3g}" if lo == hi else f"{lo / K:.3g}–{hi / K:.3g}")
    return formula[len(WORDS):].rstrip("."), " / ".join(cells)


def _messages(spec: registry.AlgorithmSpec) -> str:
    if spec.traffic is None:
        return "not modelled"
    counts = []
    for P in WORLD_SIZES:
        t = spec.traffic(100 * K, K, P, 4.0, ranks_per_node=RANKS_PER_NODE)
        counts.append(f"{t.messages + t.intra_messages:,.0f}")
    return " / ".join(counts)


def algorithm_table() -> str:
    """The table, in markdown (every registered algorithm, the default first)."""
    sizes = " / ".join(f"P = {P}" for P in WORLD_SIZES)
    rows = [f"| algorithm | what it does | words received per rank | ÷ k at {sizes} | "
            f"messages a rank sends at {sizes} |", "|---|---|---|---|---|"]
    names = sorted(registry.names(), key=lambda n: (n != "oktopk", n))
    for name in names:
        spec = registry.get(name)
        formula, values = _words(spec) if spec.volume is not None else ("not modelled", "")
        label = f"`{name}` (default)" if name == "oktopk" else f"`{name}`"
        rows.append(f"| {label} | {spec.summary} | {formula} | {values} | {_messages(spec)} |")
    return "\n".join(rows) + "\n"


def replace_table(text: str, table: str) -> str:
    """``text`` with what stands between :data:`BEGIN` and :data:`END` replaced by ``table``."""
    if text.count(BEGIN) != 1 or text.count(END) != 1:
        raise ValueError(f"the file must hold the markers {BEGIN!r} and {END!r} once each")
    head, rest = text.split(BEGIN)
    _, tail = rest.split(END)
    return f"{head}{BEGIN}\n{table}{END}{tail}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sparsecomm.tools.tables", description=__doc__.split("\n")[0])
    parser.add_argument("--write", metavar="FILE", help="replace the table between the file's markers")
    args = parser.parse_args(argv)
    table = algorithm_table()
    if args.write is None:
        sys.stdout.write(table)
        return 0
    with open(args.write, encoding="utf-8") as f:
        text = f.read()
    try:
        new = replace_table(text, table)
    except ValueError as exc:
        parser.exit(2, f"{parser.prog}: {args.write}: {exc}\n")
    with open(args.write, "w", encoding="utf-8") as f:
        f.write(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
