"""Communicator semantics and accounting in the simulated world, at many world sizes."""

from __future__ import annotations

import time

import pytest
import torch

import sparsecomm
from sparsecomm.comm import resolve
from sparsecomm.errors import CommTimeoutError

import cases


@pytest.mark.parametrize("P", [1, 2, 3, 4, 5, 8, 13])
def test_every_operation(P):
    sim = sparsecomm.simulate(P, lambda r: cases.check_comm(resolve()))
    assert len(sim.results) == P and sim.time is None


def test_accounting_follows_the_documented_formulas():
    P, m = 4, 1000

    def body(rank):
        c = resolve()
        c.allreduce(torch.zeros(m))
        after_allreduce = c.stats.snapshot()
        c.allgatherv(torch.zeros(rank + 1, 2), [1, 2, 3, 4])
        return after_allreduce, c.stats.snapshot()

    res = sparsecomm.simulate(P, body).results
    for rank, (ar, both) in enumerate(res):
        assert ar.bytes_sent == 2 * m * 4 * (P - 1) // P and ar.messages_sent == 4
        assert both.bytes_received - ar.bytes_received == (10 - (rank + 1)) * 2 * 4


def test_network_model_time():
    P, m = 4, 1 << 20

    def body(rank):
        resolve().allreduce(torch.zeros(m))

    for net in ("pizdaint", "10gbe", (1e-6, 1e-9)):
        sim = sparsecomm.simulate(P, body, network=net)
        alpha, beta = sparsecomm.network.resolve_network(net).alpha, sparsecomm.network.resolve_network(net).beta
        expected = 2 * 2 * alpha + 2 * m * 4 * (P - 1) / P * beta
        assert sim.time == pytest.approx([expected] * P)
    with pytest.raises(ValueError, match="unknown network"):
        sparsecomm.simulate(2, body, network="carrier-pigeon")


def test_mismatched_collectives_are_reported():
    def body(rank):
        c = resolve()
        if rank == 0:
            c.allreduce(torch.zeros(2))
        else:
            c.allgather(torch.zeros(2))

    with pytest.raises(ValueError, match="mismatched"):
        sparsecomm.simulate(2, body, timeout=5)


def test_unmatched_recv_times_out_naming_peer():
    def body(rank):
        if rank == 0:
            resolve().irecv(torch.empty(3), 1, tag=9).wait()

    t0 = time.monotonic()
    with pytest.raises(CommTimeoutError, match="recv .* from rank 1 \\(tag 9\\)"):
        sparsecomm.simulate(2, body, timeout=1)
    assert time.monotonic() - t0 < 5


def test_world_size_one_outside_simulation():
    c = resolve()
    assert c.size == 1 and c.rank == 0 and c.name == "self"
    x = torch.randn(10)
    assert torch.equal(sparsecomm.allreduce(x, 1.0), x)
    assert torch.equal(sparsecomm.allreduce(x, algorithm="dense"), x)


def test_sixty_four_ranks_one_million_elements():
    n = 1 << 20

    def body(rank):
        g = torch.randn(n, generator=torch.Generator().manual_seed(rank))
        out = sparsecomm.allreduce(g, 0.01)
        idx = out.nonzero().flatten()
        return idx, out[idx]

    sim = sparsecomm.simulate(64, body, network="pizdaint", timeout=300)
    idx0, val0 = sim.results[0]
    assert idx0.numel() == 10486  # k = ceil(0.01 * 2**20)
    for idx, val in sim.results:  # the whole result, bitwise, on every rank
        assert torch.equal(idx, idx0) and torch.equal(val, val0)
    assert all(t > 0 for t in sim.time)
