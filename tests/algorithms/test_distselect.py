"""Ok-Topk's exact distributed top-k (algorithms/distselect.py): every method selects the same entries."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import sparsecomm
from sparsecomm.algorithms.distselect import global_topk_mask

from reference import ref_topk


@pytest.mark.parametrize("method", ["auto", "radix", "gather"])
@pytest.mark.parametrize("P", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_distributed_select_equals_gathered_select(P, dtype, method):
    gen = np.random.default_rng(P)
    pieces = [torch.from_numpy(gen.integers(0, 6, size=gen.integers(0, 200)).astype(np.float64)).to(dtype)
              for _ in range(P)]
    whole = torch.cat(pieces)
    for k in (1, 7, 50, 10_000):
        expected = set(ref_topk(whole.numpy(), k).tolist())

        def body(rank):
            mask, counts, th = global_topk_mask(pieces[rank], k, sparsecomm.comm.resolve(), method,
                                                candidates_at_most=sum(p.numel() for p in pieces))
            offset = sum(p.numel() for p in pieces[:rank])
            return (torch.nonzero(mask).flatten() + offset).tolist(), counts

        res = sparsecomm.simulate(P, body).results
        got = set(i for idx, _ in res for i in idx)
        assert got == expected
        assert all(c == res[0][1] for _, c in res) and sum(res[0][1]) == len(expected)


@pytest.mark.parametrize("P", [1, 3, 6])
def test_exact_global_select_methods_agree_bit_for_bit(P):
    # Ties everywhere (small integers) and real magnitudes: same mask, counts and threshold.
    gen = torch.Generator().manual_seed(P)
    pieces = [torch.randint(0, 5, (int(torch.randint(0, 300, (1,), generator=gen)),), generator=gen).float()
              for _ in range(P)]
    pieces += [torch.randn(257, generator=gen).abs() for _ in range(P)]
    for k in (1, 13, 200, 5000):
        for group in (pieces[:P], pieces[P:]):
            def body(rank):
                comm = sparsecomm.comm.resolve()
                cap = sum(p.numel() for p in group)
                return [global_topk_mask(group[rank], k, comm, m, cap) for m in ("radix", "gather", "auto")]

            for radix, gather, auto in sparsecomm.simulate(P, body).results:
                for other in (gather, auto):
                    assert torch.equal(radix[0], other[0]) and radix[1] == other[1] and radix[2] == other[2]


def test_auto_gathers_few_candidates_in_two_rounds():
    """At k = 201, P = 6 the radix rounds' 16 KiB dwarfed the candidates; auto gathers them."""
    P, k = 6, 201
    pieces = [torch.randn(201, generator=torch.Generator().manual_seed(r)).abs() for r in range(P)]

    def body(rank):
        comm = sparsecomm.comm.resolve()
        before = comm.stats.snapshot()
        global_topk_mask(pieces[rank], k, comm, "radix")
        mid = comm.stats.snapshot()
        global_topk_mask(pieces[rank], k, comm, "auto", candidates_at_most=P * 268)
        return mid - before, comm.stats.snapshot() - mid

    for radix, auto in sparsecomm.simulate(P, body).results:
        assert auto.bytes_received < radix.bytes_received / 2, (auto, radix)
        assert auto.messages_received < radix.messages_received, (auto, radix)


def test_auto_keeps_radix_where_gathering_costs_more():
    from sparsecomm.algorithms.distselect import gather_is_cheaper

    assert gather_is_cheaper(6 * 268, 4, 32, 6)           # k = 201, P = 6: 6.4 KB < 16 KiB
    assert not gather_is_cheaper(64 * 2666, 4, 32, 64)    # T up to 680 KB: radix
    assert not gather_is_cheaper(100, 4, 32, 256)         # few bytes, but 2 x 255 messages
