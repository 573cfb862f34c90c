"""``sparsecomm emulate``: ranks in network namespaces behind tbf-shaped ports.

The tests that make namespaces need root and iproute2 and are skipped without
them; each leaves no namespace behind, whatever the ranks did.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import textwrap
import threading
import time

import pytest

import readme
from sparsecomm.tools import emulate


def _cannot_emulate() -> str | None:
    """Why this machine cannot make an emulated cluster, or None if it can."""
    if os.geteuid() != 0:
        return "needs root (network namespaces)"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "needs iproute2 (ip and tc)"
    return None


needs_netns = pytest.mark.skipif(_cannot_emulate() is not None, reason=_cannot_emulate() or "")

# A prefix of its own, so a test never removes the namespaces of a real run (which use "sc").
PREFIX = "sct"
# One worker runs them all, one at a time, and the README's emulated lines too: two at once
# share the prefix's namespaces, and ``ip netns`` calls of two runs race on /run/netns's mount.
pytestmark = pytest.mark.xdist_group(readme.group(next(line for line in readme.shell_lines()
                                                       if line.startswith("sparsecomm emulate"))))


def _leftovers() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith(PREFIX)]


def _script(tmp_path, body: str) -> list[str]:
    path = tmp_path / "rank.py"
    path.write_text(textwrap.dedent(body))
    return [sys.executable, str(path)]


@pytest.fixture
def no_leftovers():
    yield
    assert _leftovers() == [], "namespaces left behind"


@needs_netns
@pytest.mark.slow
def test_two_clusters_of_one_prefix_take_turns(tmp_path, capfd, no_leftovers):
    # A run removes its prefix's leftovers first: a second run at once took the first's
    # namespaces for leftovers and deleted them under its ranks. Now the second waits.
    cmd = _script(tmp_path, """
        import time
        import torch
        import torch.distributed as dist

        dist.init_process_group("gloo")
        time.sleep(1.0)  # long enough for the other run to try its start meanwhile
        x = torch.ones(4)
        dist.all_reduce(x)
        assert x.tolist() == [2.0] * 4, x
        dist.destroy_process_group()
    """)
    codes: list[int] = []
    runs = [threading.Thread(target=lambda: codes.append(emulate.run(2, "1gbit", cmd, timeout=60, prefix=PREFIX)))
            for _ in range(2)]
    for t in runs:
        t.start()
    for t in runs:
        t.join(120)
    assert codes == [0, 0]
    assert f"waiting for the cluster of prefix {PREFIX!r}" in capfd.readouterr().err


@needs_netns
@pytest.mark.slow
def test_gloo_allreduce_over_two_namespaces(tmp_path, capfd, no_leftovers):
    cmd = _script(tmp_path, """
        import os
        import torch
        import torch.distributed as dist

        dist.init_process_group("gloo")
        rank, size = dist.get_rank(), dist.get_world_size()
        assert (rank, size) == (int(os.environ["RANK"]), 2), (rank, size)
        assert os.environ["SPARSECOMM_LAUNCHER"] == "emulate"
        assert os.environ["SPARSECOMM_NETWORK"] == "emulated 1gbit tbf, P=2"
        x = torch.tensor([float(rank + 1)] * 4)
        dist.all_reduce(x)
        assert x.tolist() == [3.0] * 4, x
        print(f"rank {rank} of {size} ok {x[0].item():g}", flush=True)
        dist.destroy_process_group()
    """)
    assert emulate.run(2, "1gbit", cmd, timeout=60, prefix=PREFIX, logs=tmp_path / "logs") == 0
    assert "rank 0 of 2 ok 3" in capfd.readouterr().out
    assert "rank 1 of 2 ok 3" in (tmp_path / "logs" / "rank1.log").read_text()


@needs_netns
@pytest.mark.slow
def test_failing_rank_is_named_and_the_others_stopped(tmp_path, capfd, no_leftovers):
    cmd = _script(tmp_path, """
        import os, sys, time
        if os.environ["RANK"] == "1":
            print("rank 1 gives up", flush=True)
            sys.exit(3)
        time.sleep(60)
    """)
    t0 = time.monotonic()
    assert emulate.run(2, "1gbit", cmd, timeout=60, prefix=PREFIX) == 3
    assert time.monotonic() - t0 < 20, "rank 0 was not stopped"
    err = capfd.readouterr().err
    assert "rank 1 failed with exit status 3" in err
    assert "rank 1 gives up" in err  # the tail of its log


@needs_netns
@pytest.mark.slow
def test_timeout_kills_every_rank(tmp_path, capfd, no_leftovers):
    cmd = _script(tmp_path, "import time\ntime.sleep(60)\n")
    t0 = time.monotonic()
    assert emulate.run(2, "1gbit", cmd, timeout=1.0, prefix=PREFIX) == emulate.EXIT_TIMEOUT
    assert time.monotonic() - t0 < 15
    assert "timed out after 1 s; killing ranks still running: 0, 1" in capfd.readouterr().err


@needs_netns
@pytest.mark.slow
def test_tc_failure_is_a_clear_message(tmp_path, capfd, no_leftovers):
    # A rate tc rejects fails like a kernel without tbf does: at the first qdisc, torn down, exit 2.
    assert emulate.run(2, "99999999999tbit", ["true"], timeout=5, prefix=PREFIX) == 2
    err = capfd.readouterr().err
    assert "tc could not shape sctv0 with tbf" in err and "Traceback" not in err


def test_not_root_is_a_clear_message_and_exit_2(monkeypatch, capfd):
    monkeypatch.setattr(emulate.netns, "_is_root", lambda: False)
    assert emulate.run(2, "1gbit", ["true"], timeout=5) == 2
    assert "needs root" in capfd.readouterr().err
    parser = argparse.ArgumentParser()
    emulate.add_arguments(parser)
    args = parser.parse_args(["--ranks", "2", "--rate", "1gbit", "--", "python", "-c", "pass"])
    assert args.command[-3:] == ["python", "-c", "pass"]
    assert emulate.main(args) == 2
    assert "run it as root or use --launcher spawn" in capfd.readouterr().err


def test_bad_input_is_a_clear_message(monkeypatch, capfd):
    monkeypatch.setattr(emulate.netns, "_is_root", lambda: True)
    monkeypatch.setattr(shutil, "which", lambda tool: None)
    assert emulate.run(2, "1gbit", ["true"], timeout=5) == 2
    assert "needs iproute2" in capfd.readouterr().err
    monkeypatch.undo()
    monkeypatch.setattr(emulate.netns, "_is_root", lambda: True)
    for P, rate in ((0, "1gbit"), (300, "1gbit"), (2, "fast")):
        with pytest.raises(emulate.EmulateError):
            emulate.preflight(P, rate)


@needs_netns
@pytest.mark.slow
def test_shaping_limits_the_measured_rate(tmp_path, capfd, no_leftovers):
    # 12.5 MB at 1 Gbit/s cannot take less than 0.1 s; unshaped veths move it in ~10 ms.
    cmd = _script(tmp_path, """
        import time
        import torch
        import torch.distributed as dist

        dist.init_process_group("gloo")
        rank = dist.get_rank()
        big, ack = torch.zeros(12_500_000, dtype=torch.uint8), torch.zeros(1)
        for _ in range(2):  # the first round warms the connection up
            dist.barrier()
            t0 = time.perf_counter()
            if rank == 0:
                dist.send(big, 1)
                dist.recv(ack, 1)  # returns only once rank 1 has all of it
            else:
                dist.recv(big, 0)
                dist.send(ack, 0)
            elapsed = time.perf_counter() - t0
        if rank == 0:
            print(f"ELAPSED {elapsed:.4f}", flush=True)
        dist.destroy_process_group()
    """)
    assert emulate.run(2, "1gbit", cmd, timeout=60, prefix=PREFIX) == 0
    out = capfd.readouterr().out
    elapsed = float(out.split("ELAPSED ")[1].split()[0])
    assert 0.08 < elapsed < 5, f"12.5 MB took {elapsed} s at 1gbit"


def _mpiexec() -> str | None:
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        return None
    local = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    return local if os.path.exists(local) else shutil.which("mpiexec")


@needs_netns
@pytest.mark.skipif(_mpiexec() is None, reason="needs mpi4py and MPICH's mpiexec")
@pytest.mark.slow
@pytest.mark.mpi
def test_mpi_ranks_cross_the_shaped_ports(tmp_path, capfd, no_leftovers):
    # Shared memory between the ranks (UCX's default on one machine) would move this in ~10 ms.
    cmd = _script(tmp_path, """
        import os, time
        import numpy as np
        from mpi4py import MPI

        c = MPI.COMM_WORLD
        assert c.size == 2 and "RANK" not in os.environ
        assert os.environ["SPARSECOMM_NETWORK"] == "emulated 1gbit tbf, P=2"
        x = np.full(4, c.rank + 1.0)
        c.Allreduce(MPI.IN_PLACE, x)
        assert (x == 3).all(), x
        big, ack = np.zeros(12_500_000, dtype=np.uint8), np.zeros(1)
        for _ in range(2):
            c.Barrier()
            t0 = time.perf_counter()
            if c.rank == 0:
                c.Send(big, 1)
                c.Recv(ack, 1)
            else:
                c.Recv(big, 0)
                c.Send(ack, 0)
            elapsed = time.perf_counter() - t0
        if c.rank == 0:
            print(f"ELAPSED {elapsed:.4f}", flush=True)
    """)
    assert emulate.run(2, "1gbit", cmd, timeout=60, prefix=PREFIX, mpi=True) == 0
    elapsed = float(capfd.readouterr().out.split("ELAPSED ")[1].split()[0])
    assert 0.08 < elapsed < 5, f"12.5 MB took {elapsed} s at 1gbit"

    fail = _script(tmp_path, """
        import sys, time
        from mpi4py import MPI

        if MPI.COMM_WORLD.rank == 1:
            print("rank 1 gives up", flush=True)
            sys.exit(3)
        time.sleep(60)
    """)
    assert emulate.run(2, "1gbit", fail, timeout=60, prefix=PREFIX, mpi=True) == 3
    err = capfd.readouterr().err
    assert "rank 1 failed with exit status 3" in err and "rank 1 gives up" in err


@needs_netns
@pytest.mark.slow
def test_ranks_of_a_node_share_its_namespace_and_two_level_ok_topk_runs(tmp_path, no_leftovers):
    """Two nodes of two ranks: a node's ranks share a namespace (its one shaped port), the
    launcher's variables say so, and two-level Ok-Topk finds its nodes from them."""
    cmd = _script(tmp_path, f"""
        import json, os
        import torch
        import torch.distributed as dist
        import sparsecomm

        dist.init_process_group("gloo")
        rank = dist.get_rank()
        g = torch.Generator().manual_seed(rank)
        x = torch.randn(10_000, generator=g)
        st = sparsecomm.OkTopkTwoLevelState(0.01, tau=1, tau_prime=1, error_feedback=False)
        out = sparsecomm.allreduce(x, state=st)
        with open(os.path.join({str(tmp_path)!r}, f"{{rank}}.json"), "w") as f:
            json.dump({{"netns": os.readlink("/proc/self/ns/net"), "local": os.environ["LOCAL_RANK"],
                       "local_size": os.environ["LOCAL_WORLD_SIZE"], "label": os.environ["SPARSECOMM_NETWORK"],
                       "node_bytes": st.last.phases["node_reduce_scatter"].bytes_received,
                       "out": out.tolist()}}, f)
        dist.destroy_process_group()
    """)
    assert emulate.run(4, "1gbit", cmd, timeout=120, prefix=PREFIX, ranks_per_node=2) == 0
    import json

    got = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(4)]
    assert [g["local"] for g in got] == ["0", "1", "0", "1"] and {g["local_size"] for g in got} == {"2"}
    assert got[0]["netns"] == got[1]["netns"] != got[2]["netns"] == got[3]["netns"]
    assert {g["label"] for g in got} == {"emulated 1gbit tbf, P=4, 2 a node"}
    assert all(g["node_bytes"] == 4 * 5_000 for g in got)  # a node of two: half the tensor each way
    assert all(g["out"] == got[0]["out"] for g in got)


def test_ranks_that_do_not_fill_their_nodes_are_a_clear_message(capfd):
    assert emulate.run(3, "1gbit", ["true"], timeout=5, prefix=PREFIX, ranks_per_node=2) == 2
    assert "not a multiple of --ranks-per-node 2" in capfd.readouterr().err
