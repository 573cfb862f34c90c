"""The same bodies on real engines: gloo (torch.multiprocessing) and MPI (mpiexec -n 4).

Ok-Topk results must equal the simulated world's *bitwise*: every backend runs
the same algorithm code on the same data, and the only floating-point
arithmetic (the scatter-add of each region) happens in the same order
(destination-rotation step order) everywhere. Dense results are compared to a
tolerance: the backend's own allreduce may add in another order.
"""

from __future__ import annotations

import time

import pytest
import torch

import sparsecomm
from sparsecomm.comm import resolve

import cases
import engines

P = 4


def _comm_case(rank, size):
    return cases.check_comm(resolve())


def _allreduce_case(rank, size):
    return cases.allreduce_cases(rank, size)


def _oktopk_reuse_case(rank, size):
    return cases.oktopk_reuse_cases(rank, size)


def _bad_input_case(rank, size):
    return cases.bad_input_cases(rank, size)


def _dead_peer_case(rank, size):
    from sparsecomm.comm.torchdist import TorchCommunicator

    # A group of its own: the default group, which the launcher's teardown barrier uses, stays
    # clean (an allreduce left pending on it held that barrier for its 30 s timeout).
    comm = TorchCommunicator(timeout=3).dup()
    if rank == size - 1:
        time.sleep(6)  # never joins the call
        return "absent"
    t0 = time.monotonic()
    try:
        sparsecomm.allreduce(torch.randn(100), 0.1, comm=comm)
    except sparsecomm.CommTimeoutError as exc:
        return str(exc), time.monotonic() - t0
    return "no error"


@pytest.fixture(scope="module")
def simulated():
    return sparsecomm.simulate(P, lambda r: cases.allreduce_cases(r, P)).results


def compare_with_simulation(real, simulated):
    for rank in range(P):
        assert real[rank].keys() == simulated[rank].keys()
        for name, value in real[rank].items():
            if name == "dense" or (name.startswith("cltk/") and not name.endswith("residual")):
                # The backend's own allreduce sums (CLT-k's k values too): in its order, not the sim's.
                torch.testing.assert_close(value, simulated[rank][name], rtol=1e-5, atol=1e-5)
            else:
                assert torch.equal(value, simulated[rank][name]), f"{name} differs on rank {rank}"
        for name in real[rank]:
            if not name.endswith("residual"):
                assert torch.equal(real[rank][name], real[0][name]), f"{name}: rank {rank} != rank 0"


@pytest.fixture(scope="module")
def simulated_comm_stats():
    return sparsecomm.simulate(P, lambda r: cases.check_comm(resolve())).results


def _gloo_cases(rank, size):
    """The communicator, allreduce and bad-input cases on one launch (a launch costs seconds);
    the communicator's first, while its counters hold its traffic alone."""
    out = {"comm": _comm_case(rank, size), "allreduce": _allreduce_case(rank, size)}
    t0 = time.monotonic()
    out["bad_input"] = _bad_input_case(rank, size)
    out["bad_input_seconds"] = time.monotonic() - t0
    return out


@pytest.fixture(scope="module")
def gloo4():
    runs = engines.run_gloo(P, _gloo_cases)
    return {name: [run[name] for run in runs] for name in runs[0]}


@pytest.mark.slow
@pytest.mark.gloo
def test_gloo_communicator(simulated_comm_stats, gloo4):
    stats = gloo4["comm"]
    # Traffic is counted by the documented formulas on every backend; gloo's allgatherv
    # goes point to point, unpadded, so it moves no more than they say.
    for rank, (got, want) in enumerate(zip(stats, simulated_comm_stats)):
        assert got == want, rank


@pytest.mark.slow
@pytest.mark.gloo
def test_gloo_allreduce_equals_simulation(simulated, gloo4):
    compare_with_simulation(gloo4["allreduce"], simulated)


@pytest.mark.slow
@pytest.mark.gloo
def test_gloo_bad_input_raises_on_every_rank(gloo4):
    msgs = gloo4["bad_input"]
    assert max(gloo4["bad_input_seconds"]) < 60  # every refusal, none waiting for a timeout
    for rank_msgs in msgs:
        cases.check_bad_input_messages(rank_msgs)
    assert "the tensor is on meta, which the torch:gloo communicator cannot use" in msgs[0]["meta"]


@pytest.fixture(scope="module")
def gloo_dead_peer():
    return engines.run_gloo(P, _dead_peer_case)


@pytest.mark.slow
@pytest.mark.gloo
def test_gloo_dead_peer_times_out(gloo_dead_peer):
    assert gloo_dead_peer[-1] == "absent"
    for rank, result in enumerate(gloo_dead_peer[:-1]):
        # A string here is "no error": the call returned without the last rank.
        assert isinstance(result, tuple), (rank, result)
        msg, seconds = result
        assert msg.startswith(f"rank {rank}: allgather timed out after 3 s on torch:gloo"), msg
        assert 0.9 * 3 <= seconds < 10, seconds  # waited its timeout, not the group's 120 s


needs_mpi = pytest.mark.skipif(engines.mpiexec() is None, reason="mpi4py/mpiexec not installed "
                               "(pip install 'sparsecomm[mpi]')")


@pytest.mark.slow
@pytest.mark.mpi
@needs_mpi
def test_mpi_communicator(simulated_comm_stats, mpi4):
    assert mpi4["comm"] == simulated_comm_stats  # MPI moves what the formulas count


@pytest.mark.slow
@pytest.mark.mpi
@needs_mpi
def test_mpi_allreduce_equals_simulation(simulated, mpi4):
    assert mpi4["resolve"] == ["mpi"] * P
    compare_with_simulation(mpi4["allreduce"], simulated)


@pytest.mark.slow
@pytest.mark.mpi
@needs_mpi
def test_mpi_bad_input_raises_on_every_rank(mpi4):
    msgs = mpi4["bad_input"]
    for rank_msgs in msgs:
        cases.check_bad_input_messages(rank_msgs)
    assert "the tensor is on meta, which the mpi communicator cannot use" in msgs[0]["meta"]


# ---- Ok-Topk reusing its thresholds, at world sizes that are not powers of two --------------
def check_reuse_equals_simulation(real: list, P: int) -> None:
    """Every call, residual and threshold bitwise as the simulated world's, the same on every rank."""
    simulated = sparsecomm.simulate(P, lambda r: cases.oktopk_reuse_cases(r, P)).results
    for rank in range(P):
        got, want = real[rank], simulated[rank]
        assert got.keys() == want.keys() and got["thresholds"] == want["thresholds"], rank
        for name, value in got.items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(value, want[name]), f"{name} differs on rank {rank}"
                if name != "residual":
                    assert torch.equal(value, real[0][name]), f"{name}: rank {rank} != rank 0"
    # The case is not vacuous: the threshold moved to a rung, and a call selected exactly.
    assert {"global_moved", "global_corrected"} <= real[0]["events"], real[0]["events"]


@pytest.mark.slow
@pytest.mark.gloo
def test_gloo_oktopk_reusing_thresholds_equals_simulation_at_3_ranks():
    check_reuse_equals_simulation(engines.run_gloo(3, _oktopk_reuse_case), 3)


@pytest.mark.slow
@pytest.mark.mpi
@needs_mpi
def test_mpi_oktopk_reusing_thresholds_equals_simulation_at_5_ranks():
    check_reuse_equals_simulation(engines.run_mpi(5, "oktopk_reuse"), 5)
