"""What the README shows is what works: every shell line of its code blocks runs as typed, in a
scratch folder, and every Python snippet runs.

A line added to the README is tested without anyone writing a test for it. The only lines not
run are named in :data:`SKIPPED`, each with its reason, and the reasons come from one short
list. A line that runs a benchmark suite runs with the suite's documented size variables set
small (``readme.SMALL``); the line itself is unchanged. Each line runs once per test process
(the ``readme_run`` fixture): ``test_examples.py`` checks what the example lines printed.

The same lines at their full size are a tier of their own, which CI runs after the suite (the
README's line with ``SPARSECOMM_README_FULL=1``): :func:`test_benchmark_line_at_full_size`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import readme

INSTALL = "the install line: CI has just run it"
TESTS = "the test command itself"
SLURM = "Slurm"
GPU = "a GPU"
PLACEHOLDER = "a placeholder for the user's own script"
ROOT_NEEDED = "root (network namespaces), and the tests are not root"
#: The reasons a line may be skipped for; none other.
REASONS = {INSTALL, TESTS, SLURM, GPU, PLACEHOLDER, ROOT_NEEDED}

#: Lines not run, each with its reason.
SKIPPED = {
    "pip install torch==2.13.0 && pip install -e '.[test,mpi,cpu,triton]'": INSTALL,
    "python -m pytest -q": TESTS,
    'python -m pytest -q -m "not slow"': TESTS,
    "SPARSECOMM_README_FULL=1 python -m pytest -q -n 0 tests/test_readme.py -k full_size": TESTS,
    "torchrun --nproc-per-node 4 train.py": PLACEHOLDER,
    "mpiexec -n 4 python train.py": PLACEHOLDER,
    "srun -N 64 --ntasks-per-node 1 python train.py": SLURM,
    "sbatch -N 16 -p normal benchmarks/slurm/bench.sbatch": SLURM,
    "benchmarks/gpu/run.sh": GPU,
}

LINES = readme.shell_lines()


def _root_reason(line: str) -> str | None:
    return ROOT_NEEDED if line.startswith("sparsecomm emulate") and os.geteuid() != 0 else None


def test_skipped_lines_are_readme_lines_with_a_listed_reason():
    # A line renamed in the README would otherwise be silently run (or a skip outlive its line).
    assert set(SKIPPED) <= set(LINES), set(SKIPPED) - set(LINES)
    assert set(SKIPPED.values()) <= REASONS


def test_every_subcommand_has_its_plain_run_in_the_readme():
    # The commands' own first run is a README line, so it is run below as typed.
    for command in ("sparsecomm bench", "sparsecomm train", "sparsecomm study volume", "sparsecomm study bert",
                    "sparsecomm report", "sparsecomm calibrate"):
        assert any(line == command or line.startswith(command + " ") for line in LINES), command


def _reason(line: str) -> str | None:
    return SKIPPED.get(line) or _root_reason(line)


@pytest.mark.slow
@pytest.mark.parametrize("block", [pytest.param(b, marks=pytest.mark.xdist_group(readme.group(readme.commands(b)[0])))
                                   for b in readme.blocks() if b.language == "bash"],
                         ids=lambda b: f"README.md:{b.line}")
def test_readme_block_runs_as_typed(block, readme_run):
    # One test a block: its lines run in order in one folder (``report`` reads the file ``bench``
    # wrote above it), whichever worker takes it. Each line must exit 0 without a traceback.
    lines = readme.commands(block)
    ran = [line for line in lines if _reason(line) is None]
    if not ran:
        pytest.skip("; ".join(f"{line}: {_reason(line)}" for line in lines))
    for line in ran:
        done = readme_run(line)
        assert done.returncode == 0, f"{line}\nexit {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        assert "Traceback" not in done.stderr, f"{line}\n{done.stderr[-3000:]}"


#: The tier that runs the README's benchmark-suite lines at their full, documented size.
FULL = os.environ.get("SPARSECOMM_README_FULL") == "1"
#: A full-size line's time limit: the longest takes ~10 min on 2 cores.
FULL_TIMEOUT = 3600


@pytest.mark.slow
@pytest.mark.skipif(not FULL, reason="the full-size tier: SPARSECOMM_README_FULL=1 (CI runs it after the suite)")
@pytest.mark.parametrize("line", [line for line in LINES if readme.runs_a_benchmark_suite(line)])
def test_benchmark_line_at_full_size(line, tmp_path):
    # As a user types it, with no size variable set: the suite's own defaults.
    if _reason(line):
        pytest.skip(_reason(line))
    env = {k: v for k, v in readme.user_env().items() if k not in readme.SMALL}
    done = readme.run_line(line, readme.scratch(tmp_path), env, timeout=FULL_TIMEOUT)
    assert done.returncode == 0, f"{line}\nexit {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    assert "Traceback" not in done.stderr, f"{line}\n{done.stderr[-3000:]}"
    assert " passed" in done.stdout and " failed" not in done.stdout, done.stdout[-3000:]


@pytest.fixture(scope="module")
def snippets(tmp_path_factory):
    folder = tmp_path_factory.mktemp("snippets")
    result = folder / "result.json"
    run = subprocess.run([sys.executable, str(readme.ROOT / "tests" / "readme_snippets.py"), str(result), str(folder)],
                         env=readme.user_env(), capture_output=True, text=True, timeout=600)
    assert run.returncode == 0 and result.exists(), run.stderr[-3000:]
    return json.loads(result.read_text())


@pytest.mark.slow
@pytest.mark.parametrize("block", readme.python_blocks(), ids=lambda b: f"README.md:{b.line}")
def test_readme_snippet_runs(block, snippets):
    failed = snippets[readme.python_blocks().index(block)]
    assert failed is None, f"the snippet at README.md:{block.line} raised:\n{failed}"
