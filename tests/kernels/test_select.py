"""Selection kernels (kernels/select.py) against straightforward references."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from sparsecomm import kernels

from gpu_paths import interpreter_only
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


@pytest.mark.parametrize("k", [1, 3, 50, 399, 400, 1000])
def test_topk_of_candidates_of_positive_magnitudes_needs_no_count(k):
    # Every magnitude positive (candidates at or above a positive threshold), with ties: the
    # same positions as the general reference, from the sort alone.
    gen = torch.Generator().manual_seed(k)
    idx = torch.sort(torch.randperm(10_000, generator=gen)[:400]).values
    mag = torch.randint(1, 40, (400,), generator=gen).float()
    want = kernels.topk_of_candidates(idx, mag, k, backend="torch")
    for backend in ("torch", None):
        assert torch.equal(kernels.topk_of_candidates(idx, mag, k, positive=True, backend=backend), want)


def test_select_above_skips_zeros():
    mag = torch.tensor([0.0, 1.0, 0.5, 0.0, 2.0])
    assert kernels.select_above(mag, 0.5).tolist() == [1, 2, 4]
    assert kernels.select_above(mag, 0.0).tolist() == [1, 2, 4]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kind", ["gauss", "ties", "zeros", "missed"])
def test_triton_kth_largest_compacts_above_a_sampled_bound(monkeypatch, dtype, kind):
    # The bounded path (one pass above a sampled bound, then a radix select among the
    # candidates), forced on at a size the interpreter runs: exact whatever the data; a bound
    # the sample could not see (large values only between its positions), or one on a tie
    # that holds more than the buffer, costs the full radix select, counted as a miss.
    from gpu_paths import missing, runner
    from sparsecomm.kernels import triton_backend

    if missing("triton"):
        pytest.skip(missing("triton"))
    run = runner("triton", monkeypatch)
    monkeypatch.setattr(triton_backend, "BOUNDED_MIN", 0)
    monkeypatch.setattr(triton_backend, "BOUND_SAMPLE", 4096)
    monkeypatch.setattr(triton_backend, "BOUNDED", {"calls": 0, "misses": 0})
    n = 200_001
    x = torch.randn(n, generator=torch.Generator().manual_seed(9))
    if kind == "ties":
        x = x.round()
    elif kind == "zeros":
        x[x.abs() < 1.5] = 0  # most of the sample is zero: the bound for small k is 0
    elif kind == "missed":
        x = torch.rand(n, generator=torch.Generator().manual_seed(9))
        x[torch.arange(n) % (n // 4096) != 0] += 10  # the sample sees none of the large ones
    x = x.to(dtype)
    sorted_mag = torch.sort(x.abs().double(), descending=True).values
    for k in (1, 2_000, 20_000, n):
        assert run("kth_largest", x, k, False) == float(sorted_mag[k - 1]), (kind, k)
    stats = triton_backend.BOUNDED
    assert stats["calls"] == 3  # (k = n takes the radix select at once)
    if kind == "missed":
        assert stats["misses"] == 3
    elif kind != "ties":  # (five distinct magnitudes: a bound on a tie can hold more than the buffer)
        assert stats["misses"] == 0


@interpreter_only
def test_the_exact_threshold_on_a_gpu_reads_the_tensor_once(monkeypatch):
    # Counted as a GPU runs it (Triton's launches with their arguments): one launch over all
    # n entries (the compaction); the radix select's four over the candidates only; one read.
    import importlib.util

    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton not installed (its interpreter)")
    from sparsecomm.kernels import triton_backend
    from sparsecomm.tools.audit import audit

    monkeypatch.setattr(triton_backend, "BOUNDED_MIN", 0)
    monkeypatch.setattr(triton_backend, "BOUND_SAMPLE", 4096)
    n = 400_000
    x = torch.randn(n, generator=torch.Generator().manual_seed(3))
    with audit(kernels="triton") as counts:
        got = kernels.kth_largest(x.abs(), 1_000)
    assert got == float(torch.topk(x.abs(), 1_000).values[-1])
    over_n = [t for t in counts.trace if len(t) == 3 and n in t[2]]
    hist = [t for t in counts.trace if t[0] == "radix_hist_kernel"]
    assert [t[0] for t in over_n] == ["compact_above_kernel"]
    assert len(hist) == 4 and all(t[2][1] < n / 10 for t in hist)
    assert counts.n_syncs == 1, counts.summary()["sync_sites"]
