"""Calibration of the network model: the fit, saved profiles, the projection (small runs)."""

from __future__ import annotations

import json

import pytest

from sparsecomm.tools import calibrate
from sparsecomm.tools.calibrate import Point, Profile, compare, fit, model, traffic
from sparsecomm.tools.cli import main
from sparsecomm.network import resolve_network

N = 40_000


def test_traffic_is_the_workloads_critical_path_and_extrapolates_in_n():
    P = 4
    msgs, nbytes = traffic("dense", None, P, N, n_sim=N)
    assert nbytes == pytest.approx(2 * (P - 1) / P * N * 4, rel=0.01)
    # Extrapolated from n_sim/2 and n_sim, the dense bytes are exact (linear in n, no constant).
    _, big = traffic("dense", None, P, 4 * N, n_sim=N)
    assert big == pytest.approx(2 * (P - 1) / P * 4 * N * 4, rel=0.01)
    m_ok, b_ok = traffic("oktopk", None, P, N, n_sim=N)
    assert m_ok > msgs and b_ok < nbytes / 10


def _synthetic_points(truth: dict[str, Profile]) -> list[Point]:
    """Measured times made by the model itself from known parameters (two networks, one device)."""
    pts = []
    for machine, prof in truth.items():
        for label in ("dense", "oktopk", "topka"):
            for P, sharing in ((2, 1.0), (4, 2.0)):
                for n in (N // 8, N, 2 * N):
                    M, B = traffic(label, None, P, n, n_sim=N)
                    t = model(prof, label, M, B, n, sharing)
                    pts.append(Point(machine, label, P, n, 0.01, t, M, B, sharing, "cpu"))
    return pts


def test_fit_recovers_known_alpha_beta_and_local_costs():
    local = {"dense": 1e-9, "oktopk": 6e-9, "topka": 4e-9}
    call = {"dense": 0.2e-3, "oktopk": 2e-3, "topka": 1e-3}
    truth = {"net 1g": Profile("a", 50e-6, 8 / 1e9, local, call),
             "net 10g": Profile("b", 20e-6, 0.8 / 1e9, local, call)}
    pts = _synthetic_points(truth)
    got = fit(pts, {"net 1g": "one", "net 10g": "ten"})
    for machine, prof in truth.items():
        g = got[machine]
        assert g.beta == pytest.approx(prof.beta, rel=1e-3)
        assert g.alpha == pytest.approx(prof.alpha, rel=0.05, abs=1e-6)
        for label, gamma in local.items():
            assert g.local_s_per_element[label] == pytest.approx(gamma, rel=1e-2)
            assert g.local_s_per_call[label] == pytest.approx(call[label], rel=0.05)
    assert got["net 1g"].name == "one"
    assert max(abs(r["error_pct"]) for r in compare(pts, got)) < 1


def test_saved_profile_is_found_by_name_and_path(tmp_path, monkeypatch):
    monkeypatch.setenv("SPARSECOMM_PROFILES", str(tmp_path))
    path = Profile("mycluster", 3e-6, 1 / 5e9, {"oktopk": 1e-9}).save()
    assert path == str(tmp_path / "mycluster.json")
    for ref in ("mycluster", path):
        net = resolve_network(ref)
        assert net.alpha == 3e-6 and net.beta == pytest.approx(1 / 5e9)
    assert Profile.load(path).local_s_per_element == {"oktopk": 1e-9}
    with pytest.raises(ValueError, match="sparsecomm calibrate --save"):
        resolve_network("nosuchprofile")


def test_calibrate_command_on_bench_files(tmp_path, monkeypatch, capsys):
    """Measured (sim) files in, a fit, the comparison, a saved profile and a projection out."""
    monkeypatch.setenv("SPARSECOMM_PROFILES", str(tmp_path / "profiles"))
    files = []
    for P in (2, 3):
        path = str(tmp_path / f"P{P}.json")
        assert main(["bench", "--launcher", "sim", "--ranks", str(P), "--n", "20000", "--steps", "2",
                     "--warmup", "1", "--algorithms", "oktopk,dense", "--json", path]) == 0
        files.append(path)
    out = tmp_path / "cal"
    assert main(["calibrate", *files, "--names", "simnet", "--save", "--project", "8", "--n-sim", "20000",
                 "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "## simnet" in text and "worst |modelled/measured - 1|" in text and "projection with simnet" in text
    data = json.loads((out / "calibration.json").read_text())
    assert {r["P"] for r in data["comparison"]} == {2, 3}
    assert {r["P"] for r in data["projection"]} == {2, 3, 8}
    assert (out / "calibration.png").stat().st_size > 10_000
    assert resolve_network("simnet").name == "simnet"
    assert calibrate.Profile.load(str(tmp_path / "profiles" / "simnet.json")).sources == sorted(files)
    # A re-fit reuses the projection's traffic instead of simulating again.
    calibrate.traffic.cache_clear()
    assert calibrate.reuse_traffic(str(out / "calibration.json")) == len(data["projection"])
    assert main(["calibrate", *files, "--project", "8", "--n-sim", "20000",
                 "--traffic-from", str(out / "calibration.json")]) == 0
    assert calibrate.traffic.cache_info().currsize == 4  # the fit's points only: 2 algorithms x P = 2, 3
