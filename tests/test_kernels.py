"""Local kernels against straightforward references."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

import sparsecomm
from sparsecomm import kernels
from sparsecomm.algorithms.distselect import global_topk_mask

from reference import ref_topk


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(-5, 5), min_size=1, max_size=300), st.integers(1, 400))
def test_topk_indexes_matches_reference(values, k):
    v = torch.tensor(values, dtype=torch.float32)
    got = kernels.topk_indexes(v.abs(), k)
    assert got.tolist() == ref_topk(v.numpy(), k).tolist()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_kth_largest(dtype):
    x = torch.randn(10_001, generator=torch.Generator().manual_seed(0)).to(dtype).abs()
    for k in (1, 17, 10_001):
        assert kernels.kth_largest(x, k) == float(torch.sort(x.float(), descending=True).values[k - 1])
    with pytest.raises(ValueError):
        kernels.kth_largest(x, 0)


def test_topk_of_candidates_keeps_lowest_index_ties():
    idx = torch.tensor([3, 5, 8, 9, 20])
    mag = torch.tensor([1.0, 2.0, 1.0, 1.0, 0.0])
    assert kernels.topk_of_candidates(idx, mag, 2).tolist() == [0, 1]
    assert kernels.topk_of_candidates(idx, mag, 9).tolist() == [0, 1, 2, 3]


def test_select_above_skips_zeros():
    mag = torch.tensor([0.0, 1.0, 0.5, 0.0, 2.0])
    assert kernels.select_above(mag, 0.5).tolist() == [1, 2, 4]
    assert kernels.select_above(mag, 0.0).tolist() == [1, 2, 4]


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("value_dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_records_round_trip(index_dtype, value_dtype):
    idx = torch.tensor([0, 7, 2**31 - 2 if index_dtype == torch.int32 else 2**40])
    val = torch.tensor([1.5, -2.25, 3.0]).to(value_dtype)
    rec = kernels.pack_records(idx, val, index_dtype, value_dtype)
    assert rec.shape == (3, kernels.record_bytes(index_dtype, value_dtype))
    back_idx, back_val = kernels.unpack_records(rec, index_dtype, value_dtype)
    assert back_idx.tolist() == idx.tolist() and torch.equal(back_val, val)
    # Records can be cut anywhere and re-joined (what data balancing does).
    joined = torch.cat([rec[:1], rec[1:]])
    assert torch.equal(kernels.unpack_records(joined, index_dtype, value_dtype)[1], val)
    empty = kernels.pack_records(idx[:0], val[:0], index_dtype, value_dtype)
    assert kernels.unpack_records(empty, index_dtype, value_dtype)[0].numel() == 0


def test_index_dtype_widens_for_huge_regions():
    assert kernels.index_dtype_for(2**31 - 1) == torch.int32
    assert kernels.index_dtype_for(2**31) == torch.int64
    assert kernels.index_dtype_for(3 * 2**31) == torch.int64


def test_split_and_scatter_add():
    idx = torch.tensor([0, 3, 4, 9, 10, 15])
    assert kernels.split_by_boundaries(idx, torch.tensor([0, 4, 4, 10, 16])) == [0, 2, 2, 4, 6]
    out = kernels.scatter_add(torch.zeros(4), torch.tensor([1, 1, 3]), torch.tensor([1.0, 2.0, 5.0]))
    assert out.tolist() == [0, 3, 0, 5]


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


@pytest.mark.parametrize("m,n", [(0, 10), (1, 1), (50, 1000), (5000, 300), (300, 300)])
def test_unique_indexes_matches_unique(m, n):
    # both branches: short lists (sort) and long lists next to n (mask)
    idx = torch.randint(0, n, (m,), generator=torch.Generator().manual_seed(m + n))
    assert torch.equal(kernels.unique_indexes(idx, n), torch.unique(idx))


def test_isin_sorted_matches_isin():
    gen = torch.Generator().manual_seed(3)
    for m, k in ((0, 5), (5, 0), (100, 30), (1000, 1000)):
        values = torch.randint(0, 300, (m,), generator=gen)
        sorted_set = torch.unique(torch.randint(0, 300, (k,), generator=gen))
        assert torch.equal(kernels.isin_sorted(values, sorted_set), torch.isin(values, sorted_set))
        mark = torch.zeros(300, dtype=torch.bool)  # every value is below 300
        assert torch.equal(kernels.isin_sorted(values, sorted_set, mark=mark), torch.isin(values, sorted_set))
        assert not mark.any()  # left all zero for the next caller


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
