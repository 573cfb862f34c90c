"""The audit counts what a GPU run would launch and wait for, on the CPU."""

import os
import sys

import pytest
import torch

from sparsecomm.comm.sim import current_sim_comm, simulate
from sparsecomm.kernels import dispatch
from sparsecomm.tools.audit import audit, audit_steady

from gpu_paths import interpreter_only

x = torch.arange(1.0, 7.0)

SYNCS = {
    "item": lambda: x[0].item(),
    "tolist": lambda: x.tolist(),
    "cpu": lambda: x.cpu(),
    "numpy": lambda: x.numpy(),
    "bool": lambda: bool(x[0] > 0),
    "int": lambda: int(x[0]),
    "float": lambda: float(x[0]),
    "index": lambda: [0, 1][torch.tensor(1)],
    "nonzero": lambda: torch.nonzero(x > 2),
    "boolean_index": lambda: x[x > 2],
    "repeat_interleave": lambda: torch.repeat_interleave(torch.tensor([1, 2])),
    "bincount": lambda: torch.bincount(torch.tensor([0, 3])),
    "unique": lambda: torch.unique(x),
    "masked_select": lambda: torch.masked_select(x, x > 2),
}


@pytest.mark.parametrize("name", SYNCS)
def test_each_host_read_counts_once(name):
    with audit() as counts:
        SYNCS[name]()
    assert counts.n_syncs == 1, counts.summary()
    assert list(counts.sites) == [next(iter(counts.sites))] and "test_audit.py" in next(iter(counts.sites))


def test_operations_count_launches_not_views_or_allocations():
    with audit() as counts:
        y = x.view(2, 3).t().reshape(-1)  # views (reshape of a transpose copies: one launch)
        torch.empty(5)
        torch.add(x, 1)
        torch.repeat_interleave(torch.arange(2), torch.tensor([1, 2]), output_size=3)  # sized: no sync
    assert counts.n_syncs == 0 and counts.n_dynamic == 0
    assert counts.ops["add"] == 1 and counts.ops["repeat_interleave"] == 1 and "empty" not in counts.ops
    assert counts.ops["clone"] + counts.ops["_unsafe_view"] + counts.ops["copy_"] >= 1, counts.ops
    assert y.numel() == 6


def test_size_from_data_outputs_are_dynamic_allocations_and_change_the_trace():
    traces = []
    for cut in (2, 4):
        with audit() as counts:
            x[x > cut]
        assert counts.n_dynamic == 1
        traces.append(counts)
    assert not traces[0].replayable_with(traces[1])


def test_host_side_work_counts_as_nothing():
    with audit() as counts:
        with dispatch.host_side():
            torch.exp(torch.arange(3.0)).tolist()
    assert counts.n_ops == counts.n_syncs == 0


def test_the_kernels_host_reads_go_through_one_counted_function():
    with audit() as counts:
        assert dispatch.to_host(torch.tensor([5, 6])) == [5, 6]
    assert counts.n_syncs == 1 and counts.syncs["cpu"] == 1


def test_the_audit_takes_the_gpu_branches():
    assert dispatch.checks_values(x)
    with audit():
        assert not dispatch.checks_values(x)
    assert dispatch.checks_values(x)


def test_communicator_work_counts_apart():
    def rank(r):
        t = torch.ones(4) * r
        with audit() as counts:
            current_sim_comm().allreduce(t, "sum")
        return counts

    for counts in simulate(2, rank).results:
        assert counts.n_ops == 0 and counts.n_syncs == 0 and counts.comm_ops >= 1


def test_audit_restores_the_kernel_choice(monkeypatch):
    monkeypatch.setenv("SPARSECOMM_KERNELS", "cpu")
    with audit():
        assert os.environ["SPARSECOMM_KERNELS"] == "torch"
    assert os.environ["SPARSECOMM_KERNELS"] == "cpu"




@interpreter_only
def test_the_triton_view_counts_each_launch_once_and_nothing_inside_it():
    # The chain an H100 runs: the fused select is one launch however many programs the
    # interpreter steps through on the host; its wrapper's allocations and read still count.
    from sparsecomm import kernels

    from sparsecomm.kernels.efselect import ef_select_torch

    g, r = torch.randn(40_000), torch.randn(40_000)
    ri, rv, rr = torch.empty(40_000, dtype=torch.int64), torch.empty(40_000), r.clone()
    want = ef_select_torch(g, rr, 1.5, 40_000, 1.0, True, ri, rv)
    with audit(kernels="triton") as counts:
        idx, val, count = kernels.ef_select(g, r, 1.5, 40_000)
    assert counts.ops["triton.ef_select_kernel"] == 1
    assert counts.n_syncs == 1 and counts.syncs["cpu"] == 1  # the count's one read
    assert counts.n_ops <= 3, counts.ops  # the status memset, the launch (nothing the interpreter does)
    assert ("ef_select_kernel", (3,)) == counts.trace[-1][:2]  # with its grid, for the replay check
    assert count == want and torch.equal(idx[:count], ri[:want]) and torch.equal(r, rr)


@interpreter_only
def test_the_triton_view_runs_triton_where_an_op_has_it_and_torch_elsewhere():
    JIT = "sparsecomm.kernels._triton_jit"
    before = sys.modules.get(JIT)
    with audit(kernels="triton"):
        assert type(sys.modules[JIT].ef_select_kernel).__name__ == "InterpretedFunction"
        assert dispatch.OPS["ef_select"].choice(x, x) == "triton"
        assert dispatch.OPS["bucketize"].choice(x, x) == "torch"  # (numba's on the CPU otherwise)
        assert not dispatch.in_host_memory(x)
        with dispatch.gpu_path():  # a block inside keeps the choice
            assert dispatch.OPS["ef_select"].choice(x, x) == "triton"
    assert dispatch.OPS["bucketize"].choice(x, x) != "triton"
    assert sys.modules.get(JIT) is before  # the interpreted kernels were for the block only


def test_steady_calls_are_audited_on_every_rank():
    per_rank = audit_steady("dense", 2, n=1000, warmup=1, calls=2)
    assert len(per_rank) == 2 and all(len(calls) == 2 for calls in per_rank)
    for calls in per_rank:
        assert calls[0].n_ops > 0 and calls[0].replayable_with(calls[1])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="torch.cuda.is_available() is False")
def test_on_a_gpu_the_sync_debug_mode_sees_no_more_syncs_than_the_audit():
    # The audit's view of a CUDA call (its kernels as they are: Triton/CuPy where present)
    # against what CUDA itself reports for the same steady call, world size 1.
    import sparsecomm
    from sparsecomm.tools.audit import cuda_crosscheck

    gen = torch.Generator(device="cuda").manual_seed(0)
    g = torch.randn(1_000_000, generator=gen, device="cuda")
    st = sparsecomm.OkTopkState(0.01)
    for _ in range(120):
        g.mul_(0.9).add_(torch.randn(g.numel(), generator=gen, device="cuda"), alpha=0.1)
        sparsecomm.allreduce(g, state=st)
    with audit(kernels=None) as counts:
        sparsecomm.allreduce(g, state=st)
    seen = cuda_crosscheck(lambda: sparsecomm.allreduce(g, state=st))
    assert seen["syncs"] <= max(counts.n_syncs, 1), (seen, counts.summary())
    assert seen["kernels"] > 0
