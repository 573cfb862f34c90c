"""Local ranks (tools/launch.py): which launcher's variable names the local rank; results collected."""

from __future__ import annotations

import pytest

from sparsecomm.tools import launch

VARS = ("LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "PMI_LOCAL_RANK", "SLURM_LOCALID")


def test_local_rank_reads_the_launchers_variables_in_order(monkeypatch):
    for var in VARS:
        monkeypatch.delenv(var, raising=False)
    assert launch.local_rank() == 0
    monkeypatch.setenv("SLURM_LOCALID", "3")
    assert launch.local_rank() == 3
    monkeypatch.setenv("LOCAL_RANK", "1")  # torchrun's wins over Slurm's
    assert launch.local_rank() == 1


def test_collect_returns_results_in_rank_order_and_names_a_missing_rank(tmp_path):
    for rank in (1, 0):
        assert launch.save_result(str(tmp_path), rank, lambda r=rank: {"rank": r})
    assert launch.collect(str(tmp_path), 2) == [{"rank": 0}, {"rank": 1}]
    assert launch.collect(str(tmp_path), 3, missing_ok=True)[2] is None
    with pytest.raises(RuntimeError):
        launch.collect(str(tmp_path), 3)


def _imported(rank, size, names):
    import sys

    return [name in sys.modules for name in names]


@pytest.mark.slow
@pytest.mark.gloo
def test_ranks_start_with_the_preloaded_modules_imported():
    # conftest preloads torch._dynamo (DDP imports it in every rank); a module nobody imports
    # (a rank starts from the fork server, not a fresh interpreter) stays out.
    assert "torch._dynamo" in launch._PRELOAD
    for got in launch.spawn(2, _imported, ["torch._dynamo", "sparsecomm", "tabnanny"], threads=1):
        assert got == [True, True, False], got
