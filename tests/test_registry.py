"""The algorithm registry (registry.py): names, lookups, what each registration declares."""

from __future__ import annotations

import pytest

import sparsecomm
from sparsecomm import registry
from sparsecomm.algorithms.dense import DenseState


def test_names_are_sorted_and_every_one_resolves():
    names = registry.names()
    assert names == sorted(names) == sparsecomm.algorithms()
    for name in names:
        spec = registry.get(name)
        assert spec.name == name and spec.state_class.algorithm == name and spec.summary


def test_an_unknown_name_lists_the_known_ones():
    with pytest.raises(ValueError, match="unknown algorithm 'nope'; registered: .*oktopk"):
        registry.get("nope")


def test_every_built_in_algorithm_declares_its_volume():
    for name in registry.names():
        low, high = registry.get(name).volume(1 << 20, 10_486, 8)
        assert 0 < low <= high, name


def test_only_an_algorithm_that_settles_early_takes_the_limit():
    assert [n for n in registry.names() if registry.get(n).takes_limit] == ["dense", "oktopk2l"]


def test_a_second_registration_of_a_name_is_refused():
    with pytest.raises(ValueError, match="already registered"):
        registry.register("dense", DenseState)(lambda *a: None)


def test_halves_must_agree_on_the_limit():
    def whole(acc, k, comm, state, codec, preselected, *, limit=0.0): ...
    def first(acc, k, comm, state, codec, preselected): ...
    def second(half, comm): ...

    with pytest.raises(ValueError, match="must both take limit="):
        registry.register("halves-disagree", DenseState, split=(first, second))(whole)
    assert "halves-disagree" not in registry.names()


@pytest.mark.parametrize("P,levels", [(1, 0), (2, 1), (3, 2), (4, 2), (5, 3), (256, 8)])
def test_tree_levels(P, levels):
    assert registry.tree_levels(P) == levels
