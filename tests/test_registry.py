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


def test_the_readme_table_of_algorithms_is_the_registry_s():
    # Made from the registrations (python -m sparsecomm.tools.tables --write README.md): a row
    # cannot drift from the algorithm's docstring, volume or traffic model.
    from pathlib import Path

    from sparsecomm.tools import tables

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")
    assert tables.replace_table(readme, tables.algorithm_table()) == readme, (
        "README.md's algorithm table is stale: run python -m sparsecomm.tools.tables --write README.md")
    rows = tables.algorithm_table().splitlines()[2:]
    assert [r.split("`")[1] for r in rows] == ["oktopk"] + [n for n in registry.names() if n != "oktopk"]


def test_the_table_tool_writes_between_the_markers_and_refuses_a_file_without_them(tmp_path, capsys):
    from sparsecomm.tools import tables

    page = tmp_path / "page.md"
    page.write_text(f"intro\n{tables.BEGIN}\nold rows\n{tables.END}\nafter\n", encoding="utf-8")
    assert tables.main(["--write", str(page)]) == 0
    text = page.read_text(encoding="utf-8")
    assert text.startswith("intro\n") and text.endswith("after\n") and "old rows" not in text
    assert tables.algorithm_table() in text
    page.write_text("no markers here\n", encoding="utf-8")
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_:
        tables.main(["--write", str(page)])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and len(err.strip().splitlines()) == 1 and "markers" in err


def test_every_volume_docstring_states_its_formula_first():
    for name in registry.names():
        doc = registry.first_paragraph(registry.get(name).volume.__doc__)
        assert doc.startswith("Words received per rank: ") and len(doc) < 200, (name, doc)
