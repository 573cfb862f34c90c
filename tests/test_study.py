"""The volume study and the projection: small runs of the real code paths."""

from __future__ import annotations

import json
import math

import pytest

from sparsecomm import study
from sparsecomm.cli import main


@pytest.fixture(scope="module")
def rows():
    return study.volume_study([2, 3, 8, 16], study.ALGORITHMS, ["gaussian", "skewed"], n=50_000, tau=3)


def test_oktopk_stays_within_its_bound_in_steady_state(rows):
    for r in rows:
        if r.algorithm == "oktopk":
            control = 16 * 1024 + 512 * r.P  # exact-selection histograms and O(P) counts
            assert r.bytes_max <= r.formula + control, r
            assert r.bytes_max >= r.formula_low * 0.9, r


def test_measured_volumes_follow_table_1(rows):
    for r in rows:
        if r.algorithm in ("dense", "topka", "gtopk"):
            # Exactly k entries per rank (or n values): the formula is tight, up to
            # control words and gTopk's one mask byte per entry.
            assert 0.9 <= r.ratio <= 1.3, r
        if r.algorithm == "topkdsa":
            assert r.formula_low * 0.9 <= r.bytes_max <= r.formula * 1.1, r


def test_allgather_volume_grows_with_P_and_oktopk_does_not(rows):
    for kind in ("gaussian", "skewed"):
        by = {(r.algorithm, r.P): r.bytes_max for r in rows if r.kind == kind}
        assert by[("topka", 16)] > 5 * by[("topka", 2)]
        assert by[("oktopk", 16)] < 2.5 * by[("oktopk", 2)]
        assert by[("topka", 16)] > 3 * by[("oktopk", 16)]


def test_projection_ranks_oktopk_first_at_scale(rows):
    proj = study.project(rows, "pizdaint", study.BERT_ELEMENTS, kind="gaussian")
    at16 = {d["algorithm"]: d for d in proj if d["P"] == 16}
    assert at16["oktopk"]["ratio_to_oktopk"] == 1.0
    assert at16["dense"]["time_s"] > at16["oktopk"]["time_s"]
    assert at16["topka"]["time_s"] > at16["oktopk"]["time_s"]
    custom = study.project(rows, (1e-6, 1e-10), study.BERT_ELEMENTS, kind="gaussian")
    assert all(math.isfinite(d["time_s"]) for d in custom)


def test_commands_write_tables_and_plots(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    assert main(["study", "volume", "--ranks", "2,4", "--n", "5000", "--tau", "2",
                 "--kinds", "gaussian", "--out", str(tmp_path)]) == 0
    assert (tmp_path / "volume.png").stat().st_size > 10_000
    data = json.loads((tmp_path / "volume.json").read_text())
    assert {d["algorithm"] for d in data} == set(study.ALGORITHMS)
    assert main(["study", "bert", "--ranks", "4,8", "--n", "5000", "--tau", "2",
                 "--networks", "pizdaint,2e-6:1e-10", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "modelled time per call, 133,547,324 elements on pizdaint" in out
    assert (tmp_path / "bert_pizdaint.png").exists() and (tmp_path / "bert_2e-6:1e-10.png").exists()
