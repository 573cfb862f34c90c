"""The alpha-beta network model (network.py): profiles by name, saved profiles, bad input."""

from __future__ import annotations

import json

import pytest

from sparsecomm.errors import InputFileError
from sparsecomm.network import PROFILES, Network, load_profile, profile_dir, resolve_network


def test_a_message_costs_alpha_plus_beta_per_byte():
    assert Network(1e-5, 1e-9).time(3, 1000) == pytest.approx(3e-5 + 1e-6)


@pytest.mark.parametrize("spec", ["1gbe", "10GBE", "pizdaint"])
def test_built_in_profiles_by_name(spec):
    assert resolve_network(spec) is PROFILES[spec.lower()]


def test_pairs_and_alpha_beta_strings():
    assert resolve_network((2e-6, 1e-9)) == Network(2e-6, 1e-9)
    assert resolve_network("2e-6:1e-9") == Network(2e-6, 1e-9, "2e-6:1e-9")
    assert resolve_network(None) is None
    with pytest.raises(ValueError, match="alpha:beta must be two numbers"):
        resolve_network("fast:slow")
    with pytest.raises(ValueError, match="must be >= 0"):
        Network(-1.0, 0.0)


def test_saved_profiles_load_by_name_and_by_path(tmp_path, monkeypatch):
    monkeypatch.setenv("SPARSECOMM_PROFILES", str(tmp_path))
    assert profile_dir() == str(tmp_path)
    (tmp_path / "lab.json").write_text(json.dumps({"alpha": 4e-5, "beta": 2e-9, "name": "lab"}))
    assert resolve_network("lab") == Network(4e-5, 2e-9, "lab")
    assert resolve_network(str(tmp_path / "lab.json")) == Network(4e-5, 2e-9, "lab")
    with pytest.raises(ValueError, match="unknown network profile 'nowhere'"):
        resolve_network("nowhere")


@pytest.mark.parametrize("text,why", [("{", "not JSON"), ('{"alpha": "x"}', "not a network profile")])
def test_a_bad_profile_file_is_named(tmp_path, text, why):
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(InputFileError, match=why):
        load_profile(str(path))
