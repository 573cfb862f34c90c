"""The scripts in examples/ run for real at small sizes: each trains (its loss falls) on the sparse path.

Each is started the way its docstring tells a user to (torchrun, mpiexec, plain
python, Lightning's own launcher) on 2 CPU ranks; the checks read what rank 0
prints: the loss per epoch, and the bytes sent next to a dense allreduce's.
"""

import ast
import importlib.util
import math
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import engines
import readme

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
SCRIPTS = sorted(p.name for p in EXAMPLES.glob("*.py"))
EPOCHS = 3
#: The scripts' own default, which the README's lines run.
DEFAULT_EPOCHS = 5


def launch(*cmd: str, timeout: float = 120) -> str:
    """Run a launcher's command line on CPU, one thread per rank; its stdout, once it exited 0."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    # Its own process group, so that a hung run's ranks are killed with it, not only the launcher.
    proc = subprocess.Popen(cmd, cwd=EXAMPLES.parent, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{' '.join(cmd)} timed out after {timeout} s\n{out}\n{err[-3000:]}")
    assert proc.returncode == 0, f"{' '.join(cmd)} exited {proc.returncode}\n{out}\n{err[-3000:]}"
    return out


def torchrun(script: str, *args: str) -> str:
    return launch(sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                  str(EXAMPLES / script), "--epochs", str(EPOCHS), *args)


def check_trained(out: str, epochs: int = EPOCHS) -> None:
    """One loss per epoch, all finite, the last below the first."""
    losses = [float(v) for v in re.findall(r"^epoch \d+ loss (\S+)$", out, re.M)]
    assert len(losses) == epochs, out
    assert all(math.isfinite(v) for v in losses) and losses[-1] < losses[0], out


def check_sparse(out: str) -> None:
    """What was sent is a fraction of what a dense allreduce sends (with the hook: buckets did go sparse)."""
    sent, dense = map(float, re.search(r"sent (\S+) MB per rank \(a dense allreduce: (\S+) MB\)", out).groups())
    assert 0 < sent < dense / 4, out
    hook = re.search(r"^hook: \d+ steps, (\d+) buckets by oktopk", out, re.M)
    assert hook is None or int(hook.group(1)) > 0, out


@pytest.mark.parametrize("script", SCRIPTS)
def test_example_is_a_script(script):
    """Each example has a docstring (summary line, then how to run it) and runs main() as a script."""
    tree = ast.parse((EXAMPLES / script).read_text())
    doc = ast.get_docstring(tree)
    assert doc and doc.splitlines()[1] == "", script
    assert re.search(r"^    (python|torchrun|mpiexec) ", doc, re.M), script
    assert any(isinstance(node, ast.FunctionDef) and node.name == "main" for node in tree.body), script
    assert "if __name__ == \"__main__\":" in (EXAMPLES / script).read_text(), script


@pytest.mark.parametrize("script", ["ddp_torchrun.py", "ddp_mpiexec.py", "lightning_ddp.py", "fsdp_torchrun.py"])
def test_hook_is_three_marked_lines(script):
    """Adding the hook to a DDP script takes three lines, each marked for the reader."""
    marked = [line for line in (EXAMPLES / script).read_text().splitlines() if line.endswith("  # sparsecomm")]
    assert len(marked) == 3, marked


def readme_line(script: str, launcher: str = "") -> str:
    """The README's line that runs ``script`` (the one starting with ``launcher`` if several do)."""
    (line,) = [line for line in readme.shell_lines() if f"examples/{script}" in line and line.startswith(launcher)
               and (launcher or not line.startswith("sparsecomm emulate"))]
    return line


#: The unit of work (pytest-xdist group) of the README's example lines: the tests below read what
#: those lines printed, run once per worker by ``readme_run``, which ``test_readme.py`` shares.
same_worker_as_the_readme = pytest.mark.xdist_group(readme.group(readme_line("ddp_torchrun.py")))


def as_the_readme_runs(script: str, readme_run, launcher: str = "") -> str:
    """What the README's line for ``script`` printed: its stdout, once it exited 0."""
    line = readme_line(script, launcher)
    done = readme_run(line)
    assert done.returncode == 0, f"{line} exited {done.returncode}\n{done.stdout}\n{done.stderr[-3000:]}"
    return done.stdout


@same_worker_as_the_readme
@pytest.mark.slow
@pytest.mark.gloo
def test_ddp_torchrun(readme_run):
    out = as_the_readme_runs("ddp_torchrun.py", readme_run)
    check_trained(out, DEFAULT_EPOCHS)
    check_sparse(out)


@same_worker_as_the_readme
@pytest.mark.slow
@pytest.mark.mpi
@pytest.mark.skipif(engines.mpiexec() is None, reason="mpi4py/mpiexec not installed")
def test_ddp_mpiexec(readme_run):
    out = as_the_readme_runs("ddp_mpiexec.py", readme_run)
    check_trained(out, DEFAULT_EPOCHS)
    check_sparse(out)


@same_worker_as_the_readme
@pytest.mark.slow
@pytest.mark.gloo
@pytest.mark.parametrize("schedule", ["mgwfbp", "pipesgd"])
def test_schedule_no_ddp(schedule, readme_run):
    if schedule == "mgwfbp":  # the script's default: the README's line
        out = as_the_readme_runs("schedule_no_ddp.py", readme_run)
        check_trained(out, DEFAULT_EPOCHS)
        assert re.search(r"after [1-9]\d* plan\(s\)", out), out
    else:
        out = torchrun("schedule_no_ddp.py", "--schedule", schedule)
        check_trained(out)
    check_sparse(out)


@pytest.mark.slow
@pytest.mark.gloo
def test_schedule_no_ddp_world_of_one():
    """Plain python, no launcher: a process group of one rank, the same code path."""
    check_trained(launch(sys.executable, str(EXAMPLES / "schedule_no_ddp.py"), "--epochs", str(EPOCHS)))


@same_worker_as_the_readme
@pytest.mark.slow
@pytest.mark.gloo
def test_lightning_ddp(readme_run):
    # Looked up, not imported: importing lightning here imports triton.language before a later
    # test's TRITON_INTERPRET, and the interpreted kernels then fail (the script imports it).
    if importlib.util.find_spec("lightning") is None:
        pytest.skip("PyTorch Lightning not installed (pip install lightning)")
    # Exit status 0 required: the abort at exit it once had (a DDP reducer in Lightning's
    # reference cycles freed during finalisation) is gone, the script frees them first.
    out = as_the_readme_runs("lightning_ddp.py", readme_run)
    check_trained(out, DEFAULT_EPOCHS)
    check_sparse(out)


def check_fsdp(out: str, mode: str) -> None:
    """What FSDP's sparse reduction sent is a fraction of a dense reduction's."""
    sent, dense = map(float, re.search(rf"sparsecomm.fsdp \({mode}\): \d+ steps; sent (\S+) MB per rank "
                                       r"\(a dense reduction: (\S+) MB\)", out).groups())
    assert 0 < sent < dense / 4, out


@same_worker_as_the_readme
@pytest.mark.slow
@pytest.mark.gloo
def test_fsdp_torchrun(readme_run):
    out = as_the_readme_runs("fsdp_torchrun.py", readme_run)
    check_trained(out, DEFAULT_EPOCHS)
    check_fsdp(out, "flat")


@same_worker_as_the_readme
@pytest.mark.slow
@pytest.mark.gloo
def test_fsdp_torchrun_hsdp(readme_run):
    """The README's HSDP line: 2 emulated nodes of 2 ranks (root); else the same ranks on torchrun."""
    if os.geteuid() == 0:
        out = as_the_readme_runs("fsdp_torchrun.py", readme_run, launcher="sparsecomm emulate")
        check_trained(out, DEFAULT_EPOCHS)
    else:
        out = launch(sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
                     str(EXAMPLES / "fsdp_torchrun.py"), "--epochs", str(EPOCHS), "--shard", "2")
        check_trained(out)
    check_fsdp(out, "hsdp")
