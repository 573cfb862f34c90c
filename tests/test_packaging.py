"""The README's commands are CI's commands, and a built wheel is a working package."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent


def _readme_setup_block() -> list[str]:
    """The command lines of the README's first bash block under "Set up, run, test"."""
    text = (ROOT / "README.md").read_text()
    section = text.split("## Set up, run, test", 1)[1]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    return [line.split("  #")[0].strip() for line in block.splitlines() if line.strip()]


def _ci_lines() -> list[str]:
    return [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]


def test_ci_runs_the_readme_install_and_test_commands_exactly():
    lines = _readme_setup_block()
    install = [line for line in lines if line.startswith("pip install")]
    assert len(install) == 1, lines
    assert "python -m pytest -q" in lines
    ci = _ci_lines()
    assert install[0] in ci, f"{install[0]!r} is not a line of .ci/run"
    assert "python -m pytest -q" in ci
    # The slow tier the README says CI runs (its benchmark lines at full size) is a line of both.
    full = [line for line in lines if line.startswith("SPARSECOMM_README_FULL=1 ")]
    assert len(full) == 1 and full[0] in ci, (full, ci)
    # The extras CI tests with are the ones the README installs: no second, wider install.
    extras = {m for line in ci if "pip install" in line for m in re.findall(r"\.\[([^\]]*)\]", line)}
    assert extras == set(re.findall(r"\.\[([^\]]*)\]", install[0])), extras


def test_declared_torch_floor_is_a_validated_version():
    pyproject = (ROOT / "pyproject.toml").read_text()
    floor = re.search(r'"torch>=([0-9.]+)"', pyproject).group(1)
    validated = (ROOT / "README.md").read_text().split("## Validated on", 1)[1]
    assert re.search(rf"torch {re.escape(floor)}\b", validated), f"torch {floor} is not in 'Validated on'"
    installed = tuple(int(x) for x in re.match(r"(\d+)\.(\d+)", torch.__version__).groups())
    assert installed >= tuple(int(x) for x in floor.split(".")[:2])


@pytest.mark.slow
def test_built_wheel_imports_and_runs_outside_the_checkout(tmp_path):
    # The editable install maps kernels/ and baselines/ by a path finder; a wheel must carry
    # them inside the package (and py.typed, and __main__) on its own.
    wheels = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "-w", str(wheels), str(ROOT)], check=True, timeout=300)
    (wheel,) = wheels.glob("sparsecomm-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for member in ("sparsecomm/py.typed", "sparsecomm/__main__.py", "sparsecomm/kernels/dispatch.py",
                   "sparsecomm/kernels/_numba_jit/efselect.py", "sparsecomm/baselines/denseovlp.py",
                   "sparsecomm/tools/cli.py", "sparsecomm/tools/emulate/ranks.py"):
        assert member in names, member
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(wheel)],
                   check=True, timeout=300)
    code = (
        "import sparsecomm, sparsecomm.kernels, sparsecomm.baselines, torch\n"
        "assert sparsecomm.__file__.startswith(%r), sparsecomm.__file__\n"
        "assert sparsecomm.kernels.__file__.startswith(%r), sparsecomm.kernels.__file__\n"
        "g = lambda r: torch.arange(1000, dtype=torch.float32) * (r + 1)\n"
        "res = sparsecomm.simulate(3, lambda r: sparsecomm.allreduce(g(r), density=0.01))\n"
        "top = torch.zeros(1000); top[990:] = torch.arange(990, 1000, dtype=torch.float32) * 6\n"
        "assert all(torch.equal(out, top) for out in res.results)\n"
        "print('ok')\n") % (str(site), str(site))
    env = {**os.environ, "PYTHONPATH": str(site)}
    run = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr[-2000:]
    cli = subprocess.run([sys.executable, "-m", "sparsecomm", "--help"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=120)
    assert cli.returncode == 0 and "bench" in cli.stdout, cli.stderr[-2000:]
