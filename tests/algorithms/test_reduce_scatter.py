"""The sparse reduce-scatter (``sparsecomm.reduce_scatter``): each rank's shard of the sum of
every rank's selection, at P = 1 to 8; nothing lost with error feedback; refusals on every rank."""

from __future__ import annotations

import pytest
import torch

import sparsecomm

N = 240  # divisible by 1, 2, 3, 4, 5 and 8


def _grad(rank: int, step: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(N, generator=torch.Generator().manual_seed(100 * rank + step)).to(dtype)


def _reference_shards(grads: list[torch.Tensor], k: int) -> list[torch.Tensor]:
    """Every rank's exact top-k of |g| (its own selection), summed, cut into P shards."""
    total = torch.zeros(N, dtype=torch.float64)
    for g in grads:
        keep = g.double().abs().topk(k).indices
        total[keep] += g.double()[keep]
    return list(total.chunk(len(grads)))


@pytest.mark.parametrize("P", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("algorithm", ["oktopk", "topkdsa"])
def test_each_rank_gets_its_shard_of_the_sum_of_every_selection(P, algorithm):
    def body(rank):
        g = _grad(rank)
        return g, sparsecomm.reduce_scatter(g, density=0.1, algorithm=algorithm)

    out = sparsecomm.simulate(P, body).results
    expected = _reference_shards([g for g, _ in out], k=24)
    for (_, shard), want in zip(out, expected):
        assert shard.shape == (N // P,) and shard.dtype == torch.float32
        torch.testing.assert_close(shard.double(), want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("P", [2, 3, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_density_one_is_the_dense_reduce_scatter(P, dtype):
    def body(rank):
        g = _grad(rank, dtype=dtype)
        return g, sparsecomm.reduce_scatter(g, density=1.0, op="avg")

    out = sparsecomm.simulate(P, body).results
    total = sum(g.double() for g, _ in out) / P
    tol = 1e-6 if dtype == torch.float32 else 2e-2
    for r, (_, shard) in enumerate(out):
        assert shard.dtype == dtype
        torch.testing.assert_close(shard.double(), total.chunk(P)[r], rtol=tol, atol=tol)


def test_k_one_and_ties():
    # One entry a rank; ties among equal magnitudes resolve to one entry each, never more.
    def body(rank):
        g = torch.ones(N) * (rank + 1)
        return sparsecomm.reduce_scatter(g, density=1 / N, algorithm="topkdsa")

    out = sparsecomm.simulate(3, body).results
    whole = torch.cat(out)
    assert int(whole.count_nonzero()) <= 3 and float(whole.sum()) == pytest.approx(1 + 2 + 3)


@pytest.mark.parametrize("P", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("algorithm", ["oktopk", "topkdsa"])
def test_nothing_is_lost_with_error_feedback(P, algorithm):
    # Over several calls: every shard received plus every residual equals every gradient fed in.
    def body(rank):
        st = sparsecomm.OkTopkState(0.05, tau=2) if algorithm == "oktopk" else sparsecomm.TopkDSAState(0.05)
        fed, got = torch.zeros(N, dtype=torch.float64), torch.zeros(N // P, dtype=torch.float64)
        for step in range(5):
            g = _grad(rank, step)
            fed += g.double()
            got += sparsecomm.reduce_scatter(g, state=st).double()
        return fed, got, st.residual.double(), st.last.bytes_sent

    out = sparsecomm.simulate(P, body).results
    fed = sum(o[0] for o in out)
    torch.testing.assert_close(torch.cat([o[1] for o in out]) + sum(o[2] for o in out), fed, rtol=1e-6, atol=1e-5)
    if P > 1:
        assert all(o[3] > 0 for o in out)


def test_bad_input_is_refused_on_every_rank():
    def body(rank, case):
        g = _grad(rank)
        kw = {}
        if case == "nan" and rank == 1:
            g[7] = float("nan")
        if case == "algorithm" and rank == 0:
            kw["algorithm"] = "topka"
        if case == "shards":
            g = g[:N - 1]
        st = None if kw else sparsecomm.OkTopkState(0.1)
        try:
            sparsecomm.reduce_scatter(g, state=st, **kw)
        except sparsecomm.InputError as exc:
            return type(exc).__name__, str(exc), None if st is None else st.residual
        return "passed", "", None

    for case, words in (("nan", "NaN or Inf"), ("algorithm", "rank 0: unknown algorithm"),
                        ("shards", "equal shards")):
        for name, msg, residual in sparsecomm.simulate(3, lambda r: body(r, case)).results:
            assert name in ("InputError", "NonFiniteError") and words in msg, (case, msg)
            assert msg.startswith("sparsecomm.reduce_scatter: "), msg
            assert residual is None or not residual.any()  # a refused call kept nothing of the gradient


@pytest.mark.parametrize("P", [4, 8, 16])
def test_the_flat_designs_traffic_model_follows_the_simulated_counts(P):
    # What sparsecomm.fsdp's projection assumes of the sparse reduce-scatter, against the bytes
    # and messages a steady call sends in the simulated world (one level: all "between nodes").
    from sparsecomm.fsdp import design_traffic

    n, density = 96_000, 0.01

    def body(rank):
        st = sparsecomm.OkTopkState(density)
        for step in range(4):
            sparsecomm.reduce_scatter(torch.randn(n, generator=torch.Generator().manual_seed(10 * rank + step)),
                                      state=st)
        return st.last.bytes_sent, st.last.messages_sent

    out = sparsecomm.simulate(P, body).results
    model = design_traffic("flat", n, density, P, ranks_per_node=1)
    assert model.intra_bytes == 0 and model.intra_messages == 0
    assert abs(max(b for b, _ in out) / model.bytes - 1) < 0.3
    assert max(m for _, m in out) == model.messages == 2 * (P - 1)
