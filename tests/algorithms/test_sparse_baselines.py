"""TopkA, TopkDSA, gTopk, Gaussiank, CLT-k and Dense against their reference semantics."""

from __future__ import annotations

import contextlib
import importlib

import pytest
import torch
from conservation import assert_conserved
from gpu_paths import HAVE_TRITON
from reference import (k_of, ref_cltk, ref_gaussian_selection, ref_gtopk, ref_sum_of_selected, ref_topk)

import sparsecomm
from sparsecomm.tools.audit import triton_view

#: The sparse algorithms besides Ok-Topk (which has its own files).
SPARSE = [a for a in sparsecomm.algorithms() if a not in ("dense", "oktopk")]


def run(algorithm, grads, density, **kw):
    return sparsecomm.simulate(len(grads), lambda r: sparsecomm.allreduce(
        grads[r], density, algorithm=algorithm, **kw), timeout=30).results


def int_grads(P, n, seed=0, levels=20, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(-levels, levels + 1, (n,), generator=gen).to(dtype) for _ in range(P)]


@pytest.mark.parametrize("P", [1, 2, 3, 5, 8])
def test_topka_is_the_sum_of_every_local_topk(P):
    grads = int_grads(P, 3001, P)
    res = run("topka", grads, 0.02)
    expected = ref_sum_of_selected(grads, [torch.from_numpy(ref_topk(g.numpy(), k_of(0.02, 3001))) for g in grads])
    for out in res:
        assert torch.equal(out, expected)


@pytest.mark.parametrize("P", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("n,density,levels", [(3001, 0.02, 20), (401, 1 / 401, 3), (401, 1.0, 3), (500, 0.3, 1)])
def test_cltk_sums_every_rank_at_the_leaders_topk(P, n, density, levels):
    # Small integers (ties everywhere; levels=1: mostly zeros, fewer nonzero than k), k = 1 and
    # k = n; the leader rotates: call c is led by rank c mod P. Every rank, bit for bit.
    calls = P + 1
    grads = [int_grads(P, n, 10 * c + P, levels) for c in range(calls)]

    def body(rank):
        st = sparsecomm.registry.get("cltk").state_class(density, error_feedback=False)
        return [sparsecomm.allreduce(grads[c][rank], state=st).clone() for c in range(calls)]

    res = sparsecomm.simulate(P, body, timeout=30).results
    for c in range(calls):
        expected = ref_cltk(grads[c], density, c % P)
        for out in res:
            assert torch.equal(out[c], expected), (c, P)


@pytest.mark.parametrize("levels", [3, 1000, 0])
@pytest.mark.parametrize("k", [1, 7, 150, 200, 1000])
def test_cltk_leaders_selection_on_a_gpus_path_reads_nothing_and_matches_the_hosts(k, levels):
    # Sizes known in advance: above the k-th largest, then the first ties by index; with
    # fewer than k nonzero entries (levels 0: all zero) the lowest-index zeros fill up.
    module = importlib.import_module("sparsecomm.algorithms.cltk")

    gen = torch.Generator().manual_seed(k + levels)
    acc = torch.randint(-levels, levels + 1, (1000,), generator=gen).float()
    acc[torch.rand(1000, generator=gen) < 0.5] = 0  # ties at zero, and under k nonzero for large k
    want = module._top_k_exactly(acc, k)
    with sparsecomm.kernels.dispatch.gpu_path():
        got = module._top_k_exactly(acc, k)
    assert torch.equal(got, want) and got.numel() == k


def test_cltk_sends_k_indexes_once_and_k_values_in_one_allreduce():
    # O(k) volume with fixed sizes: a binomial broadcast of k int64 indexes from the leader
    # (P - 1 messages), then a ring allreduce of k float32 values (2 (P - 1) / P of them sent
    # per rank); no counts agreed. check=False: the collective input check is not the algorithm's.
    n, density, P = 10_000, 0.01, 4
    k = k_of(density, n)

    def body(rank):
        g = torch.randn(n, generator=torch.Generator().manual_seed(rank))
        sparsecomm.allreduce(g, density, algorithm="cltk", check=False)

    stats = sparsecomm.simulate(P, body, timeout=30).stats
    assert sum(s["bytes_sent"] for s in stats) == (P - 1) * 8 * k + 2 * (P - 1) * 4 * k


@pytest.mark.parametrize("P", [1, 2, 3, 5, 8])
def test_gaussiank_is_the_sum_of_gaussian_selections(P):
    grads = int_grads(P, 4000, P, levels=1000)
    res = run("gaussiank", grads, 0.01)
    expected = ref_sum_of_selected(grads, [ref_gaussian_selection(g, 0.01) for g in grads])
    for out in res:
        assert torch.equal(out, expected)


def test_gaussiank_lowers_the_threshold_on_light_tailed_data():
    g = torch.rand(20_000, generator=torch.Generator().manual_seed(0)) * 2 - 1  # uniform: no tail
    st = sparsecomm.GaussiankState(0.01)
    sparsecomm.allreduce(g, state=st)
    assert st.last.events["lowered"] > 0 and st.last.local_selected >= 0.75 * 200


@pytest.mark.parametrize("path", ["torch", "triton"])
@pytest.mark.parametrize("data", ["integers", "uniform", "normal", "sparse", "zeros", "one entry"])
@pytest.mark.parametrize("P", [1, 3])
def test_gaussiank_on_a_gpus_path_selects_what_the_hosts_loop_selects(P, data, path, monkeypatch):
    # A CUDA run's path counts a ladder of every lowering (Triton's count kernel, 16 rungs a
    # pass; without Triton one histogram) and reads the device once (``_select_on_device``):
    # the same selections, lowerings and sums.
    if path == "triton" and (torch.cuda.is_available() or not HAVE_TRITON):
        pytest.skip("runs Triton's interpreter on CPU tensors: needs triton, and no GPU")
    gen = torch.Generator().manual_seed(P)
    n = {"one entry": 1, "normal": 50_000}.get(data, 4000)
    grads = {"normal": lambda: [torch.randn(n, generator=gen) for _ in range(P)],
             "integers": lambda: int_grads(P, n, P, levels=1000),
             "uniform": lambda: [torch.rand(n, generator=gen) * 2 - 1 for _ in range(P)],
             "sparse": lambda: [torch.randn(n, generator=gen) * (torch.rand(n, generator=gen) < 0.005)
                                for _ in range(P)],
             "zeros": lambda: [torch.zeros(n) for _ in range(P)],
             "one entry": lambda: [torch.randn(1, generator=gen) for _ in range(P)]}[data]()

    def body(rank, gpu):
        forced = "triton" if path == "triton" else None
        with sparsecomm.kernels.dispatch.gpu_path(forced) if gpu else contextlib.nullcontext():
            st = sparsecomm.GaussiankState(0.01, error_feedback=False)
            return sparsecomm.allreduce(grads[rank], state=st), st.last.events["lowered"], st.last.local_selected

    host = sparsecomm.simulate(P, lambda r: body(r, False)).results
    if path == "torch":
        monkeypatch.setenv("SPARSECOMM_KERNELS", "torch")
    with triton_view(path == "triton"):
        gpu = sparsecomm.simulate(P, lambda r: body(r, True)).results
    for (a, lowered_a, kept_a), (b, lowered_b, kept_b) in zip(host, gpu):
        assert torch.equal(a, b) and lowered_a == lowered_b and kept_a == kept_b
    if data == "uniform":
        assert host[0][1] > 0  # the lowering ran


@pytest.mark.parametrize("P", [1, 2, 3, 5, 6, 7, 8])
def test_gtopk_follows_its_tree(P):
    grads = int_grads(P, 2000, P)
    res = run("gtopk", grads, 0.02)
    expected = ref_gtopk(grads, 0.02)
    for out in res:
        assert torch.equal(out, expected)


@pytest.mark.parametrize("P", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("density", [0.01, 0.8])  # dense above ~2/3 filled (16-bit offsets)
def test_topkdsa_equals_topka_before_and_after_switching_to_dense(P, density):
    grads = int_grads(P, 2000, P)

    def body(rank):
        st = sparsecomm.TopkDSAState(density, error_feedback=False)
        out = sparsecomm.allreduce(grads[rank], state=st)
        return out, st.last.events["dense_regions"]

    res = sparsecomm.simulate(P, body).results
    expected = run("topka", grads, density)[0]
    for out, dense_regions in res:
        assert torch.equal(out, expected)
        assert dense_regions == (P if density > 0.5 else 0)


@pytest.mark.parametrize("algorithm", SPARSE + ["dense"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_16_bit_values(algorithm, dtype):
    grads = int_grads(3, 777, 1, levels=50, dtype=dtype)
    res = run(algorithm, grads, 0.05)
    for out in res:
        assert out.dtype == dtype and torch.equal(out, res[0])
    fp32 = run(algorithm, [g.float() for g in grads], 0.05)[0]
    assert torch.equal(res[0].float(), fp32)  # small integers are exact in 16 bits


@pytest.mark.parametrize("algorithm", SPARSE + ["oktopk", "dense"])
@pytest.mark.parametrize("P,compressor", [(1, None), (1, "q8"), (3, None), (5, None)])
def test_error_feedback_conserves_everything(algorithm, P, compressor):
    # P = 1 too: TopkA, TopkDSA and gTopk take shortcuts there (no exchange, no tree).
    steps, n = 12, 3000

    def body(rank):
        st = sparsecomm.registry.get(algorithm).state_class(0.02, error_feedback=True)
        fed = torch.zeros(n, dtype=torch.float64)
        results = torch.zeros(n, dtype=torch.float64)
        for s in range(steps):
            g = torch.randn(n, generator=torch.Generator().manual_seed(100 * rank + s))
            fed += g.double()
            results += sparsecomm.allreduce(g, state=st, compressor=compressor).double()
        return fed, results, st.residual.double()

    out = sparsecomm.simulate(P, body).results
    for o in out:
        assert torch.equal(o[1], out[0][1])
    assert_conserved(out[0][1], [o[2] for o in out], [o[0] for o in out], rtol=1e-4)


def test_gtopk_contributions_dropped_mid_tree_stay_in_the_residual():
    # P = 3, k = 1: rank 1 merges into rank 0 in round 0, rank 2 in round 1. Rank 1's
    # entry at index 0 loses round 0, then index 0 comes back through rank 2 and wins:
    # rank 1's value is not in the result, so it must stay in rank 1's residual.
    grads = [torch.tensor([0.0, 5.0, 0.0, 0.0]),   # rank 0: index 1
             torch.tensor([3.0, 0.0, 0.0, 0.0]),   # rank 1: index 0, dropped at round 0 (5 > 3)
             torch.tensor([9.0, 0.0, 0.0, 0.0])]   # rank 2: index 0 wins round 1 (9 > 5)

    def body(rank):
        st = sparsecomm.GTopkState(0.25, error_feedback=True)
        out = sparsecomm.allreduce(grads[rank], state=st)
        return out, st.residual

    res = sparsecomm.simulate(3, body).results
    assert res[0][0].tolist() == [9.0, 0.0, 0.0, 0.0]  # rank 1's 3.0 did not make it
    assert res[1][1].tolist() == [3.0, 0.0, 0.0, 0.0]  # so it stays in rank 1's residual
    assert res[0][1].tolist() == [0.0, 5.0, 0.0, 0.0]
    assert res[2][1].tolist() == [0.0, 0.0, 0.0, 0.0]
