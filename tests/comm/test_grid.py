"""The grid communicator: all-to-all exchanges in two hops, the same bytes as one hop."""

from __future__ import annotations

import pytest
import torch

import sparsecomm
from sparsecomm.comm import resolve
from sparsecomm.comm.grid import GridCommunicator

import cases


@pytest.mark.parametrize("P", [1, 2, 3, 4, 5, 7, 8, 10, 13, 17, 24])
def test_every_exchange_gives_what_one_hop_gives(P):
    # Square and ragged grids (P = 10: 4 columns, a last row of 1 whose parts go round).
    gen = torch.Generator().manual_seed(P)
    sizes = torch.randint(0, 3, (P, P), generator=gen) * torch.randint(0, 50, (P, P), generator=gen)

    def body(rank):
        flat = resolve()
        grid = GridCommunicator(flat)
        send = torch.cat([torch.full((int(sizes[rank, j]),), (rank * 7 + j) % 256, dtype=torch.uint8)
                          for j in range(P)])
        assert torch.equal(grid.alltoallv(send, sizes[rank].tolist(), sizes[:, rank].tolist()),
                           flat.alltoallv(send, sizes[rank].tolist(), sizes[:, rank].tolist()))
        counts = [(i * 3) % 5 for i in range(P)]
        for dtype in (torch.float32, torch.bfloat16, torch.int64):
            t = torch.full((counts[rank], 2), rank, dtype=dtype)
            assert torch.equal(grid.allgatherv(t, counts), flat.allgatherv(t, counts))
        x = torch.tensor([rank, -rank])
        assert torch.equal(grid.allgather(x), flat.allgather(x))
        y = (torch.arange(P) * 100 + rank).reshape(P, 1)
        assert torch.equal(grid.alltoall(y), flat.alltoall(y))
        return cases.check_comm(grid)

    sparsecomm.simulate(P, body)


@pytest.mark.parametrize("P", [16, 64, 100])
def test_a_rank_sends_about_2_sqrt_p_messages_where_one_hop_sends_p(P):
    # An allgather and an alltoallv: one hop costs P - 1 messages a rank each; the grid about
    # 2 (sqrt(P) - 1) for the allgather and 3 (sqrt(P) - 1) for the alltoallv (its sizes first).
    s = GridCommunicator.columns(P)

    def body(rank):
        comm = resolve()
        grid = GridCommunicator(comm)
        before = comm.stats.snapshot()
        grid.allgather(torch.tensor([rank]))
        mid = comm.stats.snapshot()
        grid.alltoallv(torch.ones(P - 1, dtype=torch.uint8), [0 if j == rank else 1 for j in range(P)],
                       [0 if j == rank else 1 for j in range(P)])
        return mid - before, comm.stats.snapshot() - mid

    for gather, a2a in sparsecomm.simulate(P, body).results:
        assert gather.messages_sent <= 2 * (s - 1), gather
        assert a2a.messages_sent <= 3 * (s - 1) + 1, a2a
        assert gather.bytes_received == 8 * (P - 1)  # a ring's bytes
