"""A steady call's structure on a GPU, counted on the CPU: host syncs, device operations.

Each count comes from :func:`sparsecomm.tools.audit.audit_steady` (the torch
kernel path taking a CUDA run's branches, the simulated world, error feedback,
the plain call, n = 20,000, density 1%, after 120 calls), the busiest rank's. The budgets are what
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
    "oktopk": {1: (1, 48), 3: (4, 183), 8: (4, 368)},
    "topka": {1: (4, 53), 3: (7, 104), 8: (7, 164)},
    "topkdsa": {1: (5, 53), 3: (9, 167), 8: (9, 357)},
    "gtopk": {1: (4, 53), 3: (14, 157), 8: (17, 207)},
    "gaussiank": {1: (7, 37), 3: (10, 88), 8: (10, 148)},
    "cltk": {1: (4, 29), 3: (5, 28), 8: (5, 28)},
    "dense": {1: (2, 21), 3: (3, 20), 8: (3, 20)},
}

@pytest.mark.parametrize("P", [1, 3, 8])
@pytest.mark.parametrize("algorithm", sorted(BUDGET))
def test_a_steady_call_stays_within_its_budget(algorithm, P):
    syncs, ops = BUDGET[algorithm][P]
    per_rank = audit_steady(algorithm, P)
    worst = max((calls[0] for calls in per_rank), key=lambda a: (a.n_syncs, a.n_ops))
    assert worst.n_syncs <= syncs, worst.summary()["sync_sites"]
    assert max(calls[0].n_ops for calls in per_rank) <= ops


def test_every_algorithm_has_a_budget():
    assert set(BUDGET) == set(sparsecomm.registry.names())
