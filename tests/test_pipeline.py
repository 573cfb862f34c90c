"""begin_allreduce: an allreduce in two halves equals the whole call (results, residuals, thresholds)."""

from __future__ import annotations

import pytest
import torch

import sparsecomm
from sparsecomm import registry
from sparsecomm.tools.synthetic import drifting

ALGORITHMS = sparsecomm.algorithms()
STEPS = 6


def _grads(rank: int, size: int, n: int, steps: int, dtype: torch.dtype) -> list[list[torch.Tensor]]:
    """``steps`` drifting gradients for each of two tensors, different on every rank."""
    return [[x.to(dtype) for _, x in zip(range(steps), drifting(rank, m))] for m in (n, n // 3 + 1)]


def _state(algorithm: str, density: float):
    options = {"tau": 3, "tau_prime": 4} if algorithm == "oktopk" else {}
    spec = registry.get(algorithm)
    if algorithm == "dense":
        return spec.state_class(1.0, error_feedback=True)
    return spec.state_class(density, **options)


def _both(rank: int, size: int, algorithm: str, compressor, dtype: torch.dtype, n: int, density: float):
    """Whole calls on one pair of states; on another, two tensors' first halves in one order and
    their second halves in the other (DeAR's order), step after step."""
    grads = _grads(rank, size, n, STEPS, dtype)
    whole = [_state(algorithm, density) for _ in grads]
    halves = [_state(algorithm, density) for _ in grads]
    split_seen = []
    for t in range(STEPS):
        ref = [sparsecomm.allreduce(g[t], state=st, op="avg", compressor=compressor)
               for g, st in zip(grads, whole)]
        outs = [torch.empty_like(g[t]) for g in grads]
        pending = [None, None]
        for i in (1, 0):  # backward: the last tensor first
            pending[i] = sparsecomm.begin_allreduce(grads[i][t], state=halves[i], op="avg",
                                                    compressor=compressor, out=outs[i])
        split_seen.append([p.split for p in pending])
        got = [p.finish() for p in pending]  # forward: the first tensor first
        for a, b in zip(ref, got):
            yield t, a, b
        yield "result", got
        for a, b in zip(whole, halves):
            yield t, a.residual, b.residual
            yield t, getattr(a, "local_threshold", None), getattr(b, "local_threshold", None)
            yield t, getattr(a, "global_threshold", None), getattr(b, "global_threshold", None)
    yield "split", split_seen


def _run(rank, size, algorithm, compressor, dtype, n, density):
    return list(_both(rank, size, algorithm, compressor, dtype, n, density))


def _check(results, algorithm, compressor, size, exact):
    for rank_items in results:
        split_seen = [item[1] for item in rank_items if item[0] == "split"][0]
        expect_split = registry.get(algorithm).split is not None
        assert split_seen == [[expect_split] * 2] * STEPS
        for t, a, b in (item for item in rank_items if item[0] not in ("split", "result")):
            if a is None or isinstance(a, float):
                assert a == b, (t, a, b)
            elif exact:
                assert torch.equal(a, b), (t, (a - b).abs().max())
            else:
                torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    # Every rank ends with the same results.
    per_rank = [[item[1] for item in rank_items if item[0] == "result"] for rank_items in results]
    for other in per_rank[1:]:
        for a, b in zip(per_rank[0], other):
            assert all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("P", [1, 2, 3, 5])
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_halves_equal_the_whole_call(algorithm, P):
    results = sparsecomm.simulate(P, _run, P, algorithm, None, torch.float32, 2000, 0.02).results
    # Dense without a compressor halves into reduce-scatter + all-gather: other sums' order.
    _check(results, algorithm, None, P, exact=not (algorithm == "dense" and P > 1))


@pytest.mark.parametrize("compressor", ["q8", "fp16"])
@pytest.mark.parametrize("algorithm", ["oktopk", "topkdsa", "dense"])
def test_halves_equal_the_whole_call_compressed(algorithm, compressor):
    results = sparsecomm.simulate(4, _run, 4, algorithm, compressor, torch.float32, 3001, 0.01).results
    _check(results, algorithm, compressor, 4, exact=True)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_halves_equal_the_whole_call_16bit(dtype):
    results = sparsecomm.simulate(3, _run, 3, "oktopk", None, dtype, 1500, 0.05).results
    _check(results, "oktopk", None, 3, exact=True)


def test_finish_twice_is_an_error_and_bad_input_raises_at_begin():
    def body(rank):
        p = sparsecomm.begin_allreduce(torch.ones(10), density=1.0)
        assert torch.equal(p.finish(), torch.ones(10) * 2)
        with pytest.raises(RuntimeError, match="finished already"):
            p.finish()
        bad = torch.ones(10) if rank == 0 else torch.ones(11)
        with pytest.raises(sparsecomm.InputError, match="element count"):
            sparsecomm.begin_allreduce(bad, density=0.5)
        return True

    assert sparsecomm.simulate(2, body, timeout=30).results == [True, True]
