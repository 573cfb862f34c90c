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


@pytest.mark.parametrize("P", [1, 2, 3, 5, 8, 13])
@pytest.mark.parametrize("window", [1, 2, 4, None])
def test_alltoallv_in_one_rendezvous_moves_counts_and_times_as_point_to_point_sends(P, window):
    # The simulated world's alltoallv (one gather over the world) against the backends' rotation
    # of isend/irecv: the same bytes, counters and modelled clocks, to the bit. Ranks enter at
    # different clocks (an allgather of unequal sizes first is not enough: a p2p send is).
    gen = torch.Generator().manual_seed(P)
    sizes = torch.randint(0, 4, (P, P), generator=gen) * torch.randint(0, 3000, (P, P), generator=gen)

    def body(rank, native):
        c = resolve()
        if P > 1:  # skew the clocks: rank r sends r * 1000 bytes to its neighbour first
            nxt, prv = (rank + 1) % P, (rank - 1) % P
            req = c.isend(torch.zeros(rank * 1000 + 1, dtype=torch.uint8), nxt, 7)
            c.irecv(torch.empty(prv * 1000 + 1, dtype=torch.uint8), prv, 7).wait()
            req.wait()
        send = torch.cat([torch.full((int(sizes[rank, j]),), (rank * 7 + j) % 256, dtype=torch.uint8)
                          for j in range(P)])
        before = c.stats.snapshot()
        ss, rs = sizes[rank].tolist(), sizes[:, rank].tolist()
        if native:
            got = c.alltoallv(send, ss, rs, window)
        else:
            got = sparsecomm.comm.Communicator._alltoallv(c, send, ss, rs, window or P)
        return got, c.stats - before, c.clock

    native = sparsecomm.simulate(P, body, True, network="pizdaint")
    p2p = sparsecomm.simulate(P, body, False, network="pizdaint")
    for rank, ((got, stats, clock), (want, want_stats, want_clock)) in enumerate(zip(native.results, p2p.results)):
        assert torch.equal(got, want) and got.numel() == int(sizes[:, rank].sum())
        assert stats == want_stats and clock == want_clock, (rank, stats, want_stats, clock, want_clock)


def test_alltoallv_refuses_sizes_the_ranks_disagree_on():
    def body(rank):
        c = resolve()
        send = torch.zeros(2, dtype=torch.uint8)
        return c.alltoallv(send, [1, 1], [2, 1] if rank else [1, 1])  # rank 1 expects 2 bytes from 0

    with pytest.raises(ValueError, match="alltoallv: rank 1 expects"):
        sparsecomm.simulate(2, body, timeout=5)


def test_an_exact_oktopk_call_posts_no_message_of_its_own_in_the_simulated_world(monkeypatch):
    # The split's parts travel in one alltoallv, which the simulated world moves without an
    # isend per part: P - 1 Python sends a rank made P = 1024 take minutes.
    def refuse(*_args, **_kwargs):
        raise AssertionError("a point-to-point send")

    monkeypatch.setattr(sparsecomm.comm.sim.SimCommunicator, "isend", refuse)

    def body(rank):
        st = sparsecomm.OkTopkState(0.01, tau=1, tau_prime=1, error_feedback=False)
        sparsecomm.allreduce(torch.randn(20_000, generator=torch.Generator().manual_seed(rank)), state=st)
        return st.last.events

    events = sparsecomm.simulate(16, body).results
    assert not any("balanced" in e for e in events)  # (a rebalance moves its slices by p2p)


def test_a_split_orders_its_part_by_key_and_shares_the_rank_s_clock():
    def body(rank):
        comm = sparsecomm.resolve()
        part = comm.split(rank % 2, -rank)  # reversed: the simulated world and MPI honour keys
        got = part.allgather(torch.tensor([rank])).reshape(-1).tolist()
        return got, part.rank, part.clock == comm.clock > 0

    res = sparsecomm.simulate(5, body, network="10gbe").results
    assert [r[0] for r in res] == [[4, 2, 0], [3, 1], [4, 2, 0], [3, 1], [4, 2, 0]]
    assert [r[1] for r in res] == [2, 1, 1, 0, 0] and all(r[2] for r in res)


def test_two_level_network_charges_each_message_by_its_ends_nodes():
    from sparsecomm.network import Network, TwoLevel

    net = TwoLevel(Network(1e-6, 0.0), Network(1e-3, 0.0), 2)  # nodes {0, 1} and {2, 3}

    def body(rank):
        comm = sparsecomm.resolve()
        buf = torch.empty(1)
        reqs = {0: lambda: [comm.irecv(buf, 1)],  # within node 0
                1: lambda: [comm.isend(torch.ones(1), 0), comm.irecv(buf, 2)],  # and from node 1
                2: lambda: [comm.isend(torch.ones(1), 1)],
                3: lambda: []}[rank]()
        for q in reqs:
            q.wait()
        return comm.clock

    assert sparsecomm.simulate(4, body, network=net).results[:2] == [pytest.approx(1e-6), pytest.approx(1e-3)]
