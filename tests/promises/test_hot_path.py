"""A steady call's structure on a GPU, counted on the CPU: host syncs, device operations.

Each count comes from :func:`sparsecomm.tools.audit.audit_steady` (the torch
kernel path taking a CUDA run's branches, the simulated world, error feedback,
the plain call, n = 1e5, density 1%), the busiest rank's. The budgets are what
the code makes today (``benchmarks/audit_calls.py`` prints the table): a
change that adds a synchronisation or lengthens the chain fails here, and one
that removes some lowers the budget in the same commit.
"""

from __future__ import annotations

import pytest

import sparsecomm
from sparsecomm.tools.audit import audit_steady

#: algorithm -> {P: (host syncs, device operations)} per steady call, at most.
BUDGET = {
    "oktopk": {1: (3, 59), 3: (5, 179), 8: (5, 364)},
    "topka": {1: (6, 48), 3: (9, 99), 8: (9, 159)},
    "topkdsa": {1: (7, 48), 3: (11, 162), 8: (11, 352)},
    "gtopk": {1: (6, 48), 3: (16, 154), 8: (17, 201)},
    "gaussiank": {1: (11, 52), 3: (14, 103), 8: (14, 163)},
    "cltk": {1: (4, 30), 3: (5, 29), 8: (5, 29)},
    "dense": {1: (2, 21), 3: (3, 20), 8: (3, 20)},
}


@pytest.mark.parametrize("P", [1, 3, 8])
@pytest.mark.parametrize("algorithm", sorted(BUDGET))
def test_a_steady_call_stays_within_its_budget(algorithm, P):
    syncs, ops = BUDGET[algorithm][P]
    per_rank = audit_steady(algorithm, P, n=100_000)
    worst = max((calls[0] for calls in per_rank), key=lambda a: (a.n_syncs, a.n_ops))
    assert worst.n_syncs <= syncs, worst.summary()["sync_sites"]
    assert max(calls[0].n_ops for calls in per_rank) <= ops


def test_every_algorithm_has_a_budget():
    assert set(BUDGET) == set(sparsecomm.registry.names())
