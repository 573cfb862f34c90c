"""The package's shape: the library never imports the tools, no import cycles, lazy imports say why.

The import graph is read from the source (every ``import`` and ``from ... import``,
inside functions too), so a cycle hidden behind a function-level import fails
here as well as one at module level.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: Installed package name -> folder in the checkout (pyproject's package-dir).
PACKAGES = {"sparsecomm": ROOT / "sparsecomm", "sparsecomm.kernels": ROOT / "kernels",
            "sparsecomm.baselines": ROOT / "baselines"}
TOOLS = "sparsecomm.tools"
#: The one core module allowed to reach the tools: ``python -m sparsecomm`` runs the command.
ENTRY_POINTS = {"sparsecomm.__main__"}


def modules() -> dict[str, Path]:
    """Every module of the installed package, by dotted name."""
    found = {}
    for package, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join([package, *parts])] = path
    return found


def _runtime_nodes(tree: ast.AST) -> list[ast.AST]:
    """Every node but those under ``if TYPE_CHECKING:`` (annotations only: never imported)."""
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for child in node.body for n in ast.walk(child))
    return [n for n in ast.walk(tree) if id(n) not in skip]


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The package's modules that ``name`` imports anywhere in its source (at run time)."""
    here = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    out = set()
    for node in _runtime_nodes(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = ".".join(here[:len(here) - node.level + 1] + ([node.module] if node.module else [])) \
                if node.level else (node.module or "")
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                out.add(sub if sub in known else base)
        elif isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
    return {m for m in out if m in known and m != name}


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports(name, path, known) for name, path in known.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in edges:
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            for w in children:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(edges[w]))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    component = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        component.append(w)
                        if w == v:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def test_the_graph_is_read():
    edges = graph()
    assert "sparsecomm.tools.cli" in edges and "sparsecomm.api" in edges["sparsecomm.tools.bench"]
    assert "sparsecomm.kernels.dispatch" in edges["sparsecomm.kernels.select"]
    # Annotation-only imports are not edges (they would make a cycle here).
    assert "sparsecomm.algorithms.oktopk" not in edges["sparsecomm.algorithms.oktopk_local"]


def test_the_library_never_imports_the_tools():
    bad = sorted((a, b) for a, targets in graph().items() for b in targets
                 if not a.startswith(TOOLS) and a not in ENTRY_POINTS and b.startswith(TOOLS))
    assert bad == [], f"library modules importing sparsecomm.tools: {bad}"


def test_no_import_cycles():
    assert cycles(graph()) == []


def test_the_cycle_finder_finds_cycles():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


@pytest.mark.parametrize("name", sorted(modules()))
def test_function_level_imports_say_why(name):
    """Imports inside functions only for optional dependencies or start-up cost, with the reason
    (a comment on the line, or on the line above)."""
    path = modules()[name]
    lines = path.read_text().splitlines()
    silent = []
    for fn in ast.walk(ast.parse(path.read_text())):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for node in ast.walk(fn):
                if not isinstance(node, (ast.Import, ast.ImportFrom)):
                    continue
                if "#" not in lines[node.lineno - 1] + (lines[node.lineno - 2] if node.lineno > 1 else ""):
                    silent.append(f"{path.relative_to(ROOT)}:{node.lineno}: {lines[node.lineno - 1].strip()}")
    assert silent == [], "a function-level import without a comment giving its reason"
