"""Checkpoints written by an earlier revision load, and the run goes on bit for bit.

``tests/data/states_06b5d47.pt`` was written by ``tests/data/make_states.py`` at revision
06b5d47: every algorithm's State after three error-feedback calls on 2 simulated ranks, and
digests of what the fourth call gave then. Loading it with torch's defaults
(``weights_only=True``) and making the fourth call must give the same bits.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

import sparsecomm

DATA = Path(__file__).resolve().parents[1] / "data"


def _maker():
    spec = importlib.util.spec_from_file_location("make_states", DATA / "make_states.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


SAVED = torch.load(DATA / "states_06b5d47.pt")  # weights_only=True: torch's default


#: Registered after the file was written: a state of each goes through a checkpoint below.
ADDED_SINCE = {"oktopk2d", "oktopk2l"}


def test_the_file_holds_every_algorithm():
    assert sorted(SAVED) == sorted(set(sparsecomm.algorithms()) - ADDED_SINCE)


@pytest.mark.parametrize("algorithm", sorted(ADDED_SINCE))
def test_a_state_of_a_later_algorithm_goes_through_a_checkpoint(algorithm, tmp_path):
    make = _maker()

    def body(rank: int):
        st = sparsecomm.registry.get(algorithm).state_class(0.05)
        for step in range(3):
            sparsecomm.allreduce(make.grad(rank, step), state=st, op="avg")
        torch.save(st, tmp_path / f"{rank}.pt")
        back = torch.load(tmp_path / f"{rank}.pt")  # weights_only=True
        assert type(back) is type(st)
        return [make.digest(sparsecomm.allreduce(make.grad(rank, 3), state=s, op="avg")) for s in (st, back)]

    for went_on, resumed in sparsecomm.simulate(2, body).results:
        assert went_on == resumed


@pytest.mark.parametrize("algorithm", sorted(SAVED))
def test_a_saved_state_resumes_bit_for_bit(algorithm):
    make = _maker()
    saved = SAVED[algorithm]

    def body(rank: int):
        st = saved["states"][rank]
        assert isinstance(st, sparsecomm.registry.get(algorithm).state_class)
        res = sparsecomm.allreduce(make.grad(rank, 3), state=st, op="avg")
        return make.digest(res), make.digest(st.residual)

    results = sparsecomm.simulate(2, body).results
    assert results[0][0] == saved["result"]
    assert [r[1] for r in results] == saved["residuals"]
