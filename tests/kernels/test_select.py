"""Selection kernels (kernels/select.py) against straightforward references."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from sparsecomm import kernels

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
