"""The ``sparsecomm`` command line: ``python -m sparsecomm``, arguments checked at the door, progress bars.

Bad arguments end every command with argparse's usage error (exit status 2,
the last line naming the argument) and bad input files with one line naming
the file, never a traceback, and before anything is written or any rank starts.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import pty
import select
import shutil
import struct
import subprocess
import sys
from pathlib import Path
import termios
import time

import engines
import pytest

from sparsecomm.tools import cli, train

PY = [sys.executable, "-m", "sparsecomm"]
# A study small enough to run in a couple of seconds in a fresh interpreter.
TINY_STUDY = ["study", "volume", "--ranks", "2", "--n", "2000", "--tau", "1", "--kinds", "gaussian",
              "--algorithms", "dense,oktopk"]


def _subcommands() -> list[str]:
    (action,) = [a for a in cli.build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return list(action.choices)


def _usage_error(argv: list[str], capsys) -> str:
    """Run ``sparsecomm argv`` in-process, expecting exit status 2; the last line of stderr."""
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err.strip().splitlines()[-1]


def _run(argv: list[str], cwd, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=120, **kwargs)


# -- python -m sparsecomm ----------------------------------------------------------------------------

def test_python_m_sparsecomm_is_the_sparsecomm_command(tmp_path):
    names = _subcommands()
    assert len(names) >= 6
    out = _run([*PY, "--help"], tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("usage: sparsecomm ")
    assert "{" + ",".join(names) + "}" in out.stdout
    script = shutil.which("sparsecomm")
    if script is not None:  # the console script, where installed, says exactly the same
        assert _run([script, "--help"], tmp_path).stdout == out.stdout


SMALL_BENCH = ["--ranks", "2", "--n", "20000", "--steps", "2", "--warmup", "1"]


def _bench_ran(proc: subprocess.CompletedProcess, ranks: int) -> None:
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert f"P={ranks} " in proc.stdout and "oktopk" in proc.stdout and "dense" in proc.stdout, proc.stdout


@pytest.mark.slow
@pytest.mark.gloo
@pytest.mark.parametrize("launcher", ["spawn", "sim"])
def test_bench_runs_with_its_own_launchers_in_a_fresh_process(launcher, tmp_path):
    # The default launcher pickles the arguments for the ranks it spawns: a parser among them
    # crashed the README's first command ("Can't pickle local object ...") while every
    # in-process and --launcher sim test passed. The console script itself, as typed.
    script = shutil.which("sparsecomm") or pytest.skip("the sparsecomm console script is not installed")
    argv = [script, "bench", *SMALL_BENCH] + (["--launcher", launcher] if launcher != "spawn" else [])
    _bench_ran(subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=300), 2)


@pytest.mark.slow
@pytest.mark.parametrize("launcher", [pytest.param("torchrun", marks=pytest.mark.gloo),
                                      pytest.param("mpiexec", marks=pytest.mark.mpi)])
def test_bench_runs_under_an_external_launcher(launcher, tmp_path):
    if launcher == "mpiexec" and engines.mpiexec() is None:
        pytest.skip("mpi4py/mpiexec not installed")
    start = ([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
             if launcher == "torchrun" else [engines.mpiexec(), "-n", "2", sys.executable])
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    # (Not --n: torchrun's argparse takes it, even after the module, for an abbreviation of its own.)
    proc = subprocess.run([*start, "-m", "sparsecomm", "bench", "--launcher", "external", "--steps", "2",
                           "--warmup", "1"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env)
    _bench_ran(proc, 2)


def test_bad_arguments_print_no_traceback_from_the_real_command(tmp_path):
    for argv in ([*PY, "bench", "--ranks", "0"], [*PY, "report", "missing.json"]):
        proc = _run(argv, tmp_path)
        assert proc.returncode == 2 and proc.stdout == ""
        assert "Traceback" not in proc.stderr
    assert proc.stderr == "sparsecomm report: missing.json: no such file\n"


# -- arguments checked at the door -------------------------------------------------------------------

@pytest.mark.parametrize("argv, argument", [
    (["--ranks", "0"], "--ranks"),
    (["--ranks", "two"], "--ranks"),
    (["--n", "-5"], "--n"),
    (["--density", "2"], "--density"),
    (["--density", "0"], "--density"),
    (["--density", "nan"], "--density"),
    (["--steps", "0"], "--steps"),
    (["--warmup", "-1"], "--warmup"),
    (["--kind", "uniform"], "--kind"),
    (["--algorithms", "oktopk,nosuch"], "--algorithms"),
    (["--algorithms", "oktopk,,dense"], "--algorithms"),
    (["--compressors", "none,q3"], "--compressors"),
    (["--launcher", "ssh"], "--launcher"),
    (["--json", "no/such/folder/rows.json"], "--json"),
])
def test_bench_rejects_bad_arguments(argv, argument, capsys):
    line = _usage_error(["bench", *argv], capsys)
    assert line.startswith(f"sparsecomm bench: error: argument {argument}")


def test_bench_lists_come_from_the_registries(capsys):
    from sparsecomm import algorithms
    from sparsecomm.compress import COMPRESSORS

    assert f"choose from {', '.join(algorithms())}" in _usage_error(["bench", "--algorithms", "x"], capsys)
    assert ", ".join(COMPRESSORS) in _usage_error(["bench", "--compressors", "x"], capsys)


@pytest.mark.parametrize("argv, argument", [
    (["volume", "--ranks", "0"], "--ranks"),
    (["volume", "--ranks", "1,2"], "--ranks"),  # one rank has no traffic to compare
    (["volume", "--ranks", "2,x"], "--ranks"),
    (["volume", "--n", "0"], "--n"),
    (["volume", "--density", "2"], "--density"),
    (["volume", "--tau", "0"], "--tau"),
    (["volume", "--kinds", "gaussian,cauchy"], "--kinds"),
    (["volume", "--algorithms", "oktopk,nosuch"], "--algorithms"),
    (["bert", "--networks", "pizdaint,nosuchnet"], "--networks"),
    (["bert", "--networks", "1e-6:fast"], "--networks"),
    (["bert", "--target-n", "-1"], "--target-n"),
    (["sideways"], "what"),
])
def test_study_rejects_bad_arguments(argv, argument, capsys, tmp_path):
    out = tmp_path / "study"
    line = _usage_error(["study", *argv, "--out", str(out)], capsys)
    assert line.startswith(f"sparsecomm study: error: argument {argument}")
    assert not out.exists()


def test_study_out_must_be_a_folder(tmp_path, capsys):
    (tmp_path / "taken").write_text("")
    line = _usage_error(["study", "volume", "--out", str(tmp_path / "taken")], capsys)
    assert line.startswith("sparsecomm study: error: argument --out") and "not a folder" in line


@pytest.fixture
def no_training(monkeypatch):
    """Any attempt to train fails the test: bad arguments must stop ``train`` before a rank starts."""
    def refuse(*args, **kwargs):
        pytest.fail("train started with bad arguments", pytrace=False)

    monkeypatch.setattr(train, "run", refuse)


@pytest.mark.parametrize("argv, argument", [
    (["--ranks", "0"], "--ranks"),
    (["--epochs", "0"], "--epochs"),
    (["--batch", "-1"], "--batch"),
    (["--lr", "0"], "--lr"),
    (["--momentum", "1"], "--momentum"),
    (["--warmup-steps", "-1"], "--warmup-steps"),
    (["--configs", "dense,nosuch"], "--configs"),
    (["--configs", "oktopk/nosuch"], "--configs"),
    (["--schedule", "nosuch"], "--schedule"),
    (["--task", "imagenet"], "--task"),
    (["--optimizer", "lion"], "--optimizer"),
    (["--network", "nosuchnet"], "--network"),
    (["--eval-every", "-1"], "--eval-every"),
    (["--seed", "x"], "--seed"),
    # A combination no single type sees: warm-up steps under a schedule that has none.
    (["--configs", "dense,oktopk/wfbp", "--warmup-steps", "5"], "--warmup-steps"),
    (["--schedule", "dear", "--warmup-steps", "5"], "--warmup-steps"),
    (["--sync-every", "0"], "--sync-every"),
    (["--configs", "oktopk-diloco/dear"], "--configs"),
    (["--configs", "oktopk-diloco", "--schedule", "dear"], "--schedule"),
    (["--configs", "topka-demo/wfbp"], "--configs"),
    (["--configs", "topka-demo", "--schedule", "pipesgd"], "--schedule"),
    (["--configs", "dense-demo"], "--configs"),
])
def test_train_rejects_bad_arguments_before_training(argv, argument, capsys, tmp_path, no_training):
    out = tmp_path / "train"
    line = _usage_error(["train", *argv, "--out", str(out)], capsys)
    assert line.startswith(f"sparsecomm train: error: argument {argument}")
    assert not out.exists()


def test_train_writes_nothing_when_every_configuration_failed(tmp_path, capsys, monkeypatch):
    def diverge(configs, **kwargs):
        raise RuntimeError(f"{configs[0]}: loss is NaN")

    monkeypatch.setattr(train, "run", diverge)
    out = tmp_path / "train"
    assert cli.main(["train", "--configs", "dense,oktopk", "--out", str(out)]) == 1
    captured = capsys.readouterr()
    assert "# oktopk failed: oktopk: loss is NaN" in captured.out
    assert "every configuration failed (dense, oktopk); nothing written" in captured.err
    assert not out.exists()


#: A complete allreduce row, spoilt one field at a time below.
_ROW = {"algorithm": "oktopk", "n": 1000, "ranks": 2, "density": 0.01, "time_ms": 1.5, "sent_per_rank": 80}


@pytest.fixture
def bad_files(tmp_path):
    """name -> (path, what the one-line error must say) for each kind of unusable input file."""
    files = {
        "missing": ("missing.json", None, "no such file"),
        "corrupt": ("corrupt.json", '{"rows": [', "not JSON (line 1: Expecting value)"),
        "text": ("notes.txt", "measured on Tuesday\n", "not JSON (line 1: Expecting value)"),
        "binary": ("blob.json", b"\xff\xfe\x00\x01", "not JSON (not UTF-8 text)"),
        "not a benchmark": ("other.json", json.dumps({"profiles": []}), "not a sparsecomm benchmark file"),
        "bad row": ("row.json", json.dumps({"rows": [{"algorithm": "oktopk", "n": 10}]}), "row 1 has no 'density'"),
        "old list format": ("list.json", json.dumps([{"algorithm": "oktopk", "n": 10, "ranks": 2, "time_ms": 1}]),
                            "row 1 has no 'density'"),
        "wrong type": ("type.json", json.dumps({"rows": [{**_ROW, "ranks": "two"}]}), "row 1 has ranks = 'two'"),
        "zero time": ("zero.json", json.dumps({"rows": [{**_ROW, "time_ms": 0}]}), "row 1 has time_ms = 0"),
        "bad environment": ("env.json", json.dumps({"rows": [_ROW], "sparsecomm": {"nodes": "x"}}),
                            "its environment has nodes = 'x'"),
    }
    out = {}
    for name, (file, content, message) in files.items():
        path = tmp_path / file
        if isinstance(content, bytes):
            path.write_bytes(content)
        elif content is not None:
            path.write_text(content)
        out[name] = (str(path), message)
    return out


@pytest.mark.parametrize("command", ["report", "calibrate"])
@pytest.mark.parametrize("kind", ["missing", "corrupt", "text", "binary", "not a benchmark", "bad row",
                                  "old list format", "wrong type", "zero time", "bad environment"])
def test_report_and_calibrate_name_the_bad_file(command, kind, bad_files, tmp_path, capsys):
    path, message = bad_files[kind]
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exc:
        cli.main([command, path, "--out", str(out)])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"sparsecomm {command}: {path}: ") and err.count("\n") == 1  # one line
    assert message in err and "Traceback" not in err
    assert not out.exists()


@pytest.mark.parametrize("argv, argument", [
    (["--n-sim", "1"], "--n-sim"),
    (["--project", "-1"], "--project"),
    (["--project-n", "0"], "--project-n"),
    (["--names", "a,,b"], "--names"),
])
def test_calibrate_rejects_bad_arguments(argv, argument, bad_files, capsys):
    line = _usage_error(["calibrate", bad_files["missing"][0], *argv], capsys)
    assert line.startswith(f"sparsecomm calibrate: error: argument {argument}")


def test_calibrate_names_a_bad_traffic_file(bad_files, capsys):
    path, _ = bad_files["not a benchmark"]
    assert _usage_error(["calibrate", path, "--traffic-from", path], capsys) == (
        f'sparsecomm calibrate: {path}: not a sparsecomm calibration file (no "projection" list of rows)')


@pytest.mark.parametrize("argv, argument", [
    (["--ranks", "0"], "--ranks"),
    (["--ranks", "300"], "--ranks"),
    (["--ranks", "2", "--rate", "fast"], "--rate"),
    (["--ranks", "2", "--timeout", "0"], "--timeout"),
    (["--ranks", "2", "--threads", "0"], "--threads"),
    (["--ranks", "2", "--port", "70000"], "--port"),
])
def test_emulate_rejects_bad_arguments(argv, argument, capsys):
    line = _usage_error(["emulate", *argv, "--", "true"], capsys)
    assert line.startswith(f"sparsecomm emulate: error: argument {argument}")


# -- progress bars -----------------------------------------------------------------------------------

def _on_a_terminal(argv: list[str], cwd) -> str:
    """Run ``argv`` with stderr on a pseudo-terminal 100 columns wide; what it drew there."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
    proc = subprocess.Popen(argv, cwd=cwd, stdout=subprocess.DEVNULL, stderr=slave)
    os.close(slave)
    drawn, deadline = b"", time.monotonic() + 120
    while time.monotonic() < deadline:
        if select.select([master], [], [], 0.5)[0]:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # the terminal is closed once the command has exited
                chunk = b""
            if not chunk:
                break
            drawn += chunk
        elif proc.poll() is not None:
            break
    os.close(master)
    assert proc.wait(timeout=10) == 0
    return drawn.decode(errors="replace")


def test_progress_only_on_a_terminal(tmp_path):
    piped = _run([*PY, *TINY_STUDY, "--out", str(tmp_path / "piped")], tmp_path)
    assert piped.returncode == 0, piped.stderr
    assert "# sparsecomm study volume" in piped.stdout and "oktopk" in piped.stdout
    assert piped.stderr == ""  # no bar, no carriage returns, nothing at all
    drawn = _on_a_terminal([*PY, *TINY_STUDY, "--out", str(tmp_path / "tty")], tmp_path)
    assert "study: 100%" in drawn and "2/2" in drawn and "\r" in drawn


@pytest.mark.slow
@pytest.mark.gloo
def test_compare_revisions_times_two_trees_side_by_side(tmp_path):
    # The guard the README asks for on hot-path changes: the committed tree against the working
    # tree, one tiny gloo round (the tool's own figures are for a quiet machine, not for tests).
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "compare_revisions.py"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    proc = subprocess.run([sys.executable, str(script), "HEAD", "WORK", "--engines", "gloo", "--ranks", "2",
                           "--rounds", "1", "--calls", "3", "--keep", "2", "--elements", "20000"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {line.split("|")[1].strip(): line for line in proc.stdout.splitlines() if line.startswith("| ")}
    assert {"split_reduce", "allgatherv", "accumulate", "call"} <= set(rows), proc.stdout
    assert "WORK / HEAD" in proc.stdout
    bad = subprocess.run([sys.executable, str(script), "no-such-revision"], capture_output=True, text=True)
    assert bad.returncode == 2 and "not a revision" in bad.stderr and "Traceback" not in bad.stderr
