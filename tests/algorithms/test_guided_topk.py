"""The exact local top-k found among candidates collected while accumulating (``GuidedTopkState.exact_topk``).

TopkA, gTopk and TopkDSA select the exact top-k of |residual + gradient| on
every call. With error feedback the accumulating pass also collects every
entry above a guide just below the last call's k-th largest; the top-k are
then picked among those few. That must change nothing: every call's result
and residual are bitwise those of a full selection over all n, on every rank,
through guide hits, misses (the k-th largest jumped above the guide) and
overflows (too many candidates for the buffer), with ties at the threshold.
"""

from __future__ import annotations

import pytest
import torch

import sparsecomm
from sparsecomm.algorithms.guided import GuidedTopkState

#: The algorithms whose states select the exact local top-k with a guide.
GUIDED = [a for a in sparsecomm.algorithms()
          if issubclass(sparsecomm.registry.get(a).state_class, GuidedTopkState)]
N = 3001


def _gradient(rank: int, step: int, kind: str, dtype: torch.dtype) -> torch.Tensor:
    """Step ``step`` of x <- 0.9 x + 0.1 noise (the steady-state benchmark's drifting workload), from x_0 = noise."""
    x = torch.randn(N, generator=torch.Generator().manual_seed(rank))
    for s in range(1, step + 1):
        x = 0.9 * x + 0.1 * torch.randn(N, generator=torch.Generator().manual_seed(1000 * rank + s))
    if kind == "ties":  # coarse values: many ties at the k-th largest
        x = torch.round(x * 4) / 4
    if kind == "jumps":  # the k-th largest leaps above the guide, then far below it (overflow)
        x = x * {12: 50.0, 13: 0.001, 16: 20.0}.get(step, 1.0)
    return x.to(dtype)


def _run(P: int, algorithm: str, density: float, kind: str, dtype: torch.dtype, guided: bool, steps: int = 20):
    def body(rank: int):
        state = sparsecomm.registry.get(algorithm).state_class(density, error_feedback=True)
        state.guided_topk = guided  # the instance attribute hides the class's
        outs, missed = [], []
        for step in range(steps):
            outs.append(sparsecomm.allreduce(_gradient(rank, step, kind, dtype), state=state))
            missed.append("local_recomputed" in state.last.events)
        return outs, state.residual.clone(), missed

    return sparsecomm.simulate(P, body, timeout=60).results


@pytest.mark.parametrize("algorithm", GUIDED)
@pytest.mark.parametrize("P,density,kind,dtype", [
    (1, 0.01, "drift", torch.float32),
    (3, 0.02, "ties", torch.float32),
    (4, 0.01, "jumps", torch.float32),
    (5, 0.05, "drift", torch.bfloat16),
    (2, 0.02, "ties", torch.float16),
    (3, 1 / N, "drift", torch.float32),  # k = 1
    (2, 1.0, "drift", torch.float32),  # k = n: nothing to guide
])
def test_guided_selection_changes_nothing(algorithm, P, density, kind, dtype):
    guided = _run(P, algorithm, density, kind, dtype, guided=True)
    full = _run(P, algorithm, density, kind, dtype, guided=False)
    for (g_outs, g_res, g_missed), (f_outs, f_res, f_missed) in zip(guided, full):
        for step, (a, b) in enumerate(zip(g_outs, f_outs)):
            assert torch.equal(a, b), f"call {step} differs"
        assert torch.equal(g_res, f_res)
        assert torch.equal(g_outs[-1], guided[0][0][-1])  # every rank the same
        assert not any(f_missed)  # a full selection is not a miss
        if density == 1.0:
            assert not any(g_missed)
        elif density * N > 1:
            # The guide served calls once the residuals settled (else this test would
            # compare two full selections)...
            assert g_missed[1:12].count(False) >= 4, g_missed
            if kind == "jumps":  # ...and missed where the data leapt up (too many candidates)
                assert g_missed[12] and g_missed[16], g_missed


def test_guide_survives_a_checkpoint():
    def body(rank: int):
        state = sparsecomm.TopkAState(0.02)
        for step in range(12):
            sparsecomm.allreduce(_gradient(rank, step, "drift", torch.float32), state=state)
        guide = state.topk_guide
        restored = pickle_round_trip(state)
        assert restored.topk_guide == guide and guide is not None
        a = sparsecomm.allreduce(_gradient(rank, 12, "drift", torch.float32), state=state)
        b = sparsecomm.allreduce(_gradient(rank, 12, "drift", torch.float32), state=restored)
        return torch.equal(a, b) and "local_recomputed" not in state.last.events

    assert all(sparsecomm.simulate(2, body).results)


def pickle_round_trip(obj):
    import pickle

    return pickle.loads(pickle.dumps(obj))


@pytest.mark.parametrize("shift", [0.7, 0.95, 1.0, 1.2, 1.5])
def test_the_next_guide_from_the_rungs_lands_near_the_2k_th_largest(shift):
    # The fused pass counts its candidates (every |acc| at or above the guide) at the guide's
    # rungs; the next guide comes from those counts alone: between rungs when at least 2k
    # are above the guide, extended below it when fewer.
    from sparsecomm.state import Preselection

    k = 1000
    mag = torch.randn(200_000, generator=torch.Generator().manual_seed(7)).abs()
    want = float(torch.sort(mag, descending=True).values[2 * k - 1])
    guide = want * shift
    cand = mag[mag >= guide]
    rungs = [guide * GuidedTopkState.GUIDE_STEP ** j for j in range(GuidedTopkState.GUIDE_RUNGS)]
    above = [int((cand >= r).sum()) for r in rungs]
    pre = Preselection(torch.arange(cand.numel()), cand.numel(), cand, rungs=rungs, above=above)
    got = GuidedTopkState(0.01)._guide_from_rungs(pre, k, 2 * k)
    if shift <= 1:  # between two rungs: close
        assert abs(got / want - 1) < 0.01, (got, want)
    else:  # extrapolated: what matters is that the next call's candidates hold k and fit
        assert k <= int((mag >= got).sum()) <= GuidedTopkState.GUIDE_CAPACITY * k, (got, want)
