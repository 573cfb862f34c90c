"""The package's shape: the library never imports the tools, no import cycles, lazy imports say why.

The import graph is read from the source (every ``import`` and ``from ... import``,
inside functions too), so a cycle hidden behind a function-level import fails
here as well as one at module level.
"""

from __future__ import annotations

import ast
import re
import subprocess
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
    # Annotation-only imports are not edges: they never run.
    tree = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import a\nimport b\n")
    assert [n.names[0].name for n in _runtime_nodes(tree) if isinstance(n, ast.Import)] == ["b"]


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


def _tracked_files() -> list[Path]:
    try:
        out = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-z"], capture_output=True, check=True,
                             timeout=60).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    return [ROOT / name for name in out.decode().split("\0") if name]


#: Words that mean something only to the people who wrote the code, not to its readers.
HISTORY = re.compile(r"\b(issue|session)s? #?\d+", re.IGNORECASE)


def test_no_issue_or_session_numbers_anywhere_in_the_tree():
    found = []
    for path in _tracked_files():
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue  # binary (plots): no words in it
        found += [f"{path.relative_to(ROOT)}:{text.count(chr(10), 0, m.start()) + 1}: {m.group(0)}"
                  for m in HISTORY.finditer(text)]
    assert found == []


def test_the_history_pattern_matches_what_it_must():
    # Spelled in two pieces, or this file would hold what it forbids.
    assert HISTORY.search("as in Sess" + "ion 9") and HISTORY.search("(iss" + "ue #12, in progress)")
    assert not HISTORY.search("the issue is that 9 ranks") and not HISTORY.search("a session of 4 ranks")


def test_result_folders_are_named_by_date_and_machine_and_cited():
    results = ROOT / "benchmarks" / "results"
    cited = (ROOT / "docs" / "results.md").read_text()
    folders = sorted(p.name for p in results.iterdir() if p.is_dir())
    assert folders
    for name in folders:
        assert re.fullmatch(r"\d{4}-\d{2}-\d{2}-(cpu-vm|h100|h200)(-[a-z0-9.-]+)?", name), name
        assert (results / name / "README.md").is_file(), f"{name} has no README.md saying how it was made"
        assert name in cited, f"{name} is not cited by docs/results.md: superseded runs leave the tree"


#: The largest module allowed: a newcomer reads one in a sitting.
MAX_LINES = 600


@pytest.mark.parametrize("name", sorted(modules()))
def test_no_module_is_too_long_to_read(name):
    lines = len(modules()[name].read_text().splitlines())
    assert lines <= MAX_LINES, f"{name}: {lines} lines; split it by job"


def _expand(name: str) -> list[str]:
    """``test_{gloo,mpi}_x`` -> ``test_gloo_x``, ``test_mpi_x``."""
    m = re.search(r"\{([^}]*)\}", name)
    if not m:
        return [name]
    return [n for part in m.group(1).split(",") for n in _expand(name[:m.start()] + part + name[m.end():])]


def _slug(title: str) -> str:
    """A Markdown heading's anchor as GitHub makes it."""
    return re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")


def test_every_readme_promise_links_to_its_guarantee():
    # The README keeps one line per promise; docs/guarantees.md holds each in full. A promise
    # added to one and not the other, or a renamed heading, breaks a link a reader follows.
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Guarantees", 1)[1].split("\n## ", 1)[0]
    links = re.findall(r"^- \[\*\*.+?\*\*\]\(docs/guarantees\.md#([\w-]+)\): .+$", section, re.M)
    items = [line for line in section.splitlines() if line.startswith("- ")]
    assert len(links) == len(items) > 10, items
    headings = re.findall(r"^## (.+)$", (ROOT / "docs" / "guarantees.md").read_text(), re.M)
    assert links == [_slug(h) for h in headings]


def test_every_test_the_guarantees_name_exists():
    table = (ROOT / "docs" / "guarantees.md").read_text()
    named = re.findall(r"`([\w/]+\.py)(?:::([\w{},]+))?`", table)
    assert len(named) > 20
    missing = []
    for path, test in named:
        source = ROOT / "tests" / path
        if not source.is_file():
            missing.append(path)
            continue
        text = source.read_text()
        missing += [f"{path}::{t}" for t in (_expand(test) if test else []) if f"def {t}(" not in text]
    assert missing == []


@pytest.mark.parametrize("name", ["kernels", "baselines"])
def test_the_installed_mapping_is_visible_in_the_checkout(name):
    # pyproject maps sparsecomm.<name> to the top-level folder; the link shows static tools the same.
    link = ROOT / "sparsecomm" / name
    assert link.is_symlink() and link.resolve() == (ROOT / name).resolve()
    assert f'"sparsecomm.{name}" = "{name}"' in (ROOT / "pyproject.toml").read_text()
