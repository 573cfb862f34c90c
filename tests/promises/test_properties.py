"""The input-check property (``properties.py``) on random cases: simulated world, gloo, MPI.

Simulated world: hypothesis draws ``EXAMPLES`` cases per run (world sizes 1-8,
every algorithm, compressor, dtype and perturbation), shrinking any failure to
a small case. gloo and MPI: a fixed slice of seeded cases at P = 3 and 4.
"""

from __future__ import annotations

import os
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import sparsecomm

import engines
import properties

EXAMPLES = int(os.environ.get("SPARSECOMM_PROPERTY_EXAMPLES", "150"))
TIMEOUT = 10.0


def test_every_registered_algorithm_has_a_reference():
    from reference import REFERENCES

    assert sorted(REFERENCES) == sparsecomm.algorithms()


def outcome(value):
    if isinstance(value, BaseException):
        return "raised", f"{type(value).__name__}: {value}"
    return value


@settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(st.data())
def test_every_rank_raises_or_every_rank_agrees_with_the_reference(data):
    case = properties.build_case(properties.HypothesisDraw(data))
    t0 = time.monotonic()
    res = sparsecomm.simulate(case.P, lambda r: properties.rank_call(case, r), timeout=TIMEOUT,
                              return_exceptions=True)
    assert time.monotonic() - t0 < TIMEOUT, ("a rank waited out the timeout", case)
    properties.check(case, [outcome(v) for v in res.results])


def _seeded_cases(rank, size, seeds):
    out = []
    for seed in seeds:
        case = properties.build_case(properties.SeededDraw(seed), P=size)
        out.append(properties.rank_call(case, rank))
    return out


def check_seeded(results, size, seeds):
    for i, seed in enumerate(seeds):
        case = properties.build_case(properties.SeededDraw(seed), P=size)
        properties.check(case, [results[r][i] for r in range(size)])


SEEDS = list(range(40))


def test_seeded_slice_on_the_simulated_world():
    res = sparsecomm.simulate(3, _seeded_cases, 3, SEEDS, timeout=TIMEOUT).results
    check_seeded(res, 3, SEEDS)


@pytest.mark.slow
@pytest.mark.gloo
def test_seeded_slice_on_gloo():
    check_seeded(engines.run_gloo(3, _seeded_cases, SEEDS), 3, SEEDS)


@pytest.mark.slow
@pytest.mark.mpi
@pytest.mark.skipif(engines.mpiexec() is None, reason="mpi4py/mpiexec not installed")
def test_seeded_slice_on_mpi(mpi4):
    check_seeded(mpi4["properties"], 4, SEEDS)
