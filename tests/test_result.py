"""SparseResult: the overflow check, its bound, and a contributed set marked rather than cut."""

from __future__ import annotations

import torch

import sparsecomm
from sparsecomm.result import SparseResult
from sparsecomm.state import CallStats


def _result(reached: torch.Tensor | None, sent: torch.Tensor, bound: float | None = None) -> SparseResult:
    idx = torch.tensor([2, 5, 7, 9])
    return SparseResult(n=12, indexes=idx, values=torch.tensor([1.0, -2.0, 3.0, 4.0]), contributed=idx,
                        sent=sent, stats=CallStats(), reached=reached, bound=bound)


def test_a_marked_contributed_set_updates_the_residual_as_the_cut_one_does_bit_for_bit():
    reached = torch.tensor([True, False, True, False])
    sent = torch.tensor([0.5, -1.5, 2.5, 3.5])
    marked = _result(reached, torch.where(reached, sent, torch.zeros(())))
    cut = _result(None, sent[reached])
    cut.contributed = cut.contributed[reached]
    st = sparsecomm.OkTopkState(0.5)
    acc = torch.arange(12.0) - 6.0
    acc[5] = -0.0  # a negative zero where nothing was sent stays one
    a, b = acc.clone(), acc.clone()
    st.update(a, marked, keep_errors=False)
    st.update(b, cut, keep_errors=False)
    assert torch.equal(a, b) and torch.equal(torch.signbit(a), torch.signbit(b))


def test_compact_cuts_to_the_reached_entries_once():
    reached = torch.tensor([False, True, True, False])
    r = _result(reached, torch.tensor([0.0, 1.0, 2.0, 0.0])).compact()
    assert r.contributed.tolist() == [5, 7] and r.sent.tolist() == [1.0, 2.0] and r.reached is None
    assert r.compact().contributed.tolist() == [5, 7]


def test_a_bound_settles_the_overflow_check_without_reading_only_when_it_proves_it():
    sent = torch.zeros(4)
    assert _result(None, sent, bound=4.0).count_nonfinite(torch.float16) == 0
    # A bound past the dtype's range proves nothing: the values themselves are checked.
    huge = _result(None, sent, bound=1e6)
    huge.values = torch.tensor([1.0, 7e4, 3.0, 4.0])
    assert huge.count_nonfinite(torch.float16) == 1


def test_sparse_allreduce_hands_the_user_the_exact_contributed_set():
    def body(rank):
        gen = torch.Generator().manual_seed(rank)
        st = sparsecomm.OkTopkState(0.05)
        for _ in range(3):
            r = sparsecomm.sparse_allreduce(torch.randn(2000, generator=gen), state=st)
        return r

    for r in sparsecomm.simulate(3, body).results:
        assert r.reached is None
        assert bool(torch.isin(r.contributed, r.indexes).all())  # only entries that reached the result
