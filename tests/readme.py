"""The README's code blocks, and a runner of its shell lines as a user types them.

Used by ``test_readme.py`` (every line and snippet) and ``test_examples.py`` (what the example
lines print), which share one run of each line per test process.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


@dataclass(frozen=True)
class Block:
    """One fenced code block: its language, its first line's number in the README, its text."""

    language: str
    line: int
    text: str


def blocks(text: str | None = None) -> list[Block]:
    """The README's fenced code blocks, in order."""
    text = README.read_text() if text is None else text
    return [Block(m.group(1), text.count("\n", 0, m.start()) + 2, m.group(2))
            for m in re.finditer(r"^```(\w*)\n(.*?)^```", text, re.S | re.M)]


def commands(block: Block) -> list[str]:
    """The command lines of a bash block, as typed, without their trailing comments."""
    return [re.split(r"\s+#", line)[0].strip() for line in block.text.splitlines()
            if line.strip() and not line.lstrip().startswith("#")]


def shell_lines(text: str | None = None) -> list[str]:
    """Every command line of the README's bash blocks, in order."""
    return [line for block in blocks(text) if block.language == "bash" for line in commands(block)]


def block_of(line: str) -> Block:
    """The first bash block that holds ``line``."""
    return next(b for b in blocks() if b.language == "bash" and line in commands(b))


def group(line: str) -> str:
    """The unit of work (pytest-xdist group) of a line: its block's. A block's lines run in order
    in one folder (``report`` reads the file ``bench`` wrote above it); blocks run apart."""
    return f"readme:{block_of(line).line}"


def python_blocks(text: str | None = None) -> list[Block]:
    """The README's Python snippets."""
    return [b for b in blocks(text) if b.language == "python"]


#: The benchmark suites' documented size variables (benchmarks/conftest.py and each suite's
#: docstring), set small for the README's lines that run a suite: the suites' code and
#: launchers run as typed, at sizes that take seconds.
SMALL = {
    "SPARSECOMM_BENCH_SIZES": "100000",
    "SPARSECOMM_BENCH_DENSITIES": "0.01",
    "SPARSECOMM_BENCH_COMPRESSORS": "none",
    "SPARSECOMM_BENCH_ROUNDS": "2",
    "SPARSECOMM_BENCH_WARMUP": "1",
    "SPARSECOMM_BENCH_BATCHES": "4",
    "SPARSECOMM_STEADY_SIZES": "100000",
    "SPARSECOMM_BENCH_MODEL": "small",
}


def runs_a_benchmark_suite(line: str) -> bool:
    return "pytest benchmarks/" in line


def user_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a user's shell with this Python's scripts first on PATH: none of the
    test run's own settings (pytest's, a launcher's rank variables), which a user would not have."""
    drop = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TRITON_INTERPRET")
    env = {k: v for k, v in os.environ.items() if k not in drop and not k.startswith("PYTEST_")}
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env.update(extra or {})
    return env


def scratch(folder: Path) -> Path:
    """A folder to run README lines in: the repository's examples/ and benchmarks/ linked in (the
    lines name them relative to the checkout), every output left there."""
    folder.mkdir(parents=True, exist_ok=True)
    for name in ("examples", "benchmarks"):
        link = folder / name
        if not link.exists():
            link.symlink_to(ROOT / name, target_is_directory=True)
    return folder


def run_line(line: str, cwd: Path, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    """``line`` through ``bash -c`` in ``cwd``, in a process group of its own so that a line that
    hangs is killed with every process it started (a launcher's ranks too)."""
    proc = subprocess.Popen(["bash", "-c", line], cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        err += f"\n(killed after {timeout:g} s)"
        return subprocess.CompletedProcess(line, -signal.SIGKILL, out, err)
    return subprocess.CompletedProcess(line, proc.returncode, out, err)
