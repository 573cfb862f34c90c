"""Synthetic gradients (tools/synthetic.py): seeded per rank and step, the kinds they claim to be."""

from __future__ import annotations

import itertools

import pytest
import torch

from sparsecomm.tools.synthetic import KINDS, drifting, gradient, repeating


@pytest.mark.parametrize("kind", KINDS)
def test_seeded_by_rank_and_step(kind):
    a = gradient(1, 3, 5000, kind)
    assert torch.equal(a, gradient(1, 3, 5000, kind)) and a.shape == (5000,)
    assert not torch.equal(a, gradient(2, 3, 5000, kind)) and not torch.equal(a, gradient(1, 4, 5000, kind))
    assert gradient(1, 3, 100, kind, dtype=torch.bfloat16).dtype == torch.bfloat16


def test_skewed_holds_its_large_entries_in_the_first_tenth():
    g = gradient(0, 0, 10_000, "skewed").abs()
    assert g[:1000].mean() > 20 * g[1000:].mean()


def test_an_unknown_kind_is_named():
    with pytest.raises(ValueError, match="unknown gradient kind 'flat'"):
        gradient(0, 0, 10, "flat")


def test_drifting_moves_slowly_and_hands_out_fresh_tensors():
    xs = list(itertools.islice(drifting(0, 10_000), 4))
    assert all(x is not y for x, y in zip(xs, xs[1:]))
    corr = torch.corrcoef(torch.stack([xs[0], xs[1]]))[0, 1]
    assert corr > 0.99  # x = 0.9 x + 0.1 noise: consecutive calls nearly the same
    assert torch.equal(next(drifting(3, 100)), next(drifting(3, 100)))


def test_repeating_comes_back_every_period():
    xs = list(itertools.islice(repeating(0, 1000, period=3), 7))
    assert torch.equal(xs[0], xs[3]) and torch.equal(xs[1], xs[4]) and not torch.equal(xs[0], xs[1])
    xs[0].zero_()  # a caller's changes do not reach the next period
    assert xs[6].abs().sum() > 0
