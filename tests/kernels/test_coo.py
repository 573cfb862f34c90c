"""COO records, scatter-add and sorted-set kernels (kernels/coo.py) against straightforward references."""

from __future__ import annotations

import pytest
import torch

from sparsecomm import kernels



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
