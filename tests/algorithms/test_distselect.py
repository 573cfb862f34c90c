"""Ok-Topk's exact distributed top-k (algorithms/distselect.py): every method selects the same entries."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import sparsecomm
from sparsecomm.algorithms.distselect import GATHER_BYTES_PER_K, global_topk_mask, radix_widths

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
    """At k = 201, P = 3 the candidates (at most 3.2 KB, 16 bytes a selected entry) travel in
    two allgathers: the radix select's eight rounds of 4-bit digits take eight times the messages."""
    P, k = 3, 201
    pieces = [torch.randn(201, generator=torch.Generator().manual_seed(r)).abs() for r in range(P)]

    def body(rank):
        comm = sparsecomm.comm.resolve()
        before = comm.stats.snapshot()
        global_topk_mask(pieces[rank], k, comm, "radix")
        mid = comm.stats.snapshot()
        global_topk_mask(pieces[rank], k, comm, "auto", candidates_at_most=P * 268)
        return mid - before, comm.stats.snapshot() - mid

    for radix, auto in sparsecomm.simulate(P, body).results:
        assert auto.messages_received * 8 <= radix.messages_received, (auto, radix)
        assert auto.bytes_received <= GATHER_BYTES_PER_K * k, (auto, radix)


def test_auto_keeps_radix_where_gathering_costs_more():
    from sparsecomm.algorithms.distselect import gather_is_cheaper

    assert gather_is_cheaper(3 * 268, 4, 32, 3, 201)           # k = 201, P = 3: 3.2 KB
    assert not gather_is_cheaper(6 * 268, 4, 32, 6, 201)       # 6.4 KB, 32 bytes an entry: radix
    assert not gather_is_cheaper(64 * 2666, 4, 32, 64, 2000)   # T up to 680 KB: radix
    assert not gather_is_cheaper(100, 4, 32, 256, 1)           # few bytes, but 2 x 255 messages


def test_radix_digits_are_sized_by_k():
    # The counts of the radix rounds grow with k (half a word per selected entry, at least
    # 128 words), in as few rounds as that allows; 8-bit digits (4 rounds) from k = 1792.
    for bits in (31, 63):
        for k in (1, 201, 256, 1000, 1791, 1792, 10**6):
            widths = radix_widths(bits, k)
            assert sum(widths) == bits and all(4 <= w <= 8 for w in widths[:-1]) and widths[-1] >= 3
            bins = sum(1 << w for w in widths)
            assert bins <= max(128, k // 2) or len(widths) == -(-bits // 4), (bits, k, widths)
            fewer = len(widths) - 1  # one round fewer would take more bins than the budget
            if fewer >= -(-bits // 8):
                base, extra = divmod(bits, fewer)
                assert (1 << (base + 1)) * extra + (1 << base) * (fewer - extra) > max(128, k // 2)
    assert radix_widths(31, 201) == [4, 4, 4, 4, 4, 4, 4, 3]
    assert radix_widths(31, 1000) == [7, 6, 6, 6, 6]
    assert radix_widths(31, 1792) == [8, 8, 8, 7]


@pytest.mark.parametrize("ties", [False, True])
def test_radix_sends_one_count_a_rank_unless_ties_are_split(ties):
    # Distinct magnitudes: every rank's count is all the final allgather carries (16 bits
    # each: at most k); ties at the k-th largest to split between ranks: (above, equal) pairs
    # of int32.
    P, k = 5, 60
    gen = torch.Generator().manual_seed(3)
    if ties:
        pieces = [torch.randint(1, 4, (40,), generator=gen).float() for _ in range(P)]
    else:
        pieces = [torch.rand(40, generator=gen) + 0.5 for _ in range(P)]
    whole = torch.cat(pieces)
    expected = set(ref_topk(whole.numpy(), k).tolist())

    def body(rank):
        comm = sparsecomm.comm.resolve()
        before = comm.stats.snapshot()
        mask, counts, _ = global_topk_mask(pieces[rank], k, comm, "radix", candidates_at_most=whole.numel())
        radix_bytes = sum(4 * 2 * (1 << w) * (P - 1) // P for w in radix_widths(31, k))
        return (torch.nonzero(mask).flatten() + 40 * rank).tolist(), counts, \
            (comm.stats - before).bytes_received - radix_bytes

    res = sparsecomm.simulate(P, body).results
    assert set(i for idx, _, _ in res for i in idx) == expected
    assert all(c == res[0][1] for _, c, _ in res)
    assert all(last == (8 if ties else 2) * (P - 1) for _, _, last in res), [r[2] for r in res]
