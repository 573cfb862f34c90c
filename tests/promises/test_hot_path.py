"""A steady call's structure on a GPU, counted on the CPU: host syncs, device operations.

Each count comes from :func:`sparsecomm.tools.audit.audit_steady` (the torch
kernel path taking a CUDA run's branches, the simulated world, error feedback,
the plain call, n = 20,000, density 1%, after 120 calls), the busiest rank's. The budgets are what
the code makes today (``benchmarks/audit_calls.py`` prints the table): a
change that adds a synchronisation or lengthens the chain fails here, and one
that removes some lowers the budget in the same commit.
"""

from __future__ import annotations

import functools

import pytest
import torch

import sparsecomm
from sparsecomm.tools.audit import audit_steady as _audit_steady

from gpu_paths import interpreter_only


@functools.lru_cache(maxsize=None)
def audit_steady(algorithm: str, P: int, **options):
    """``tools.audit.audit_steady``, once per arguments in a test process: the budget and the
    reads per phase check the same audit (each takes seconds: 120 calls in the simulated world)."""
    return _audit_steady(algorithm, P, **options)


#: One unit of work (pytest-xdist): the tests that share an audit run where it was made.
pytestmark = pytest.mark.xdist_group(__name__)

#: algorithm -> {P: (host syncs, device operations)} per steady call, at most. (The split's
#: parts go out as one alltoallv: one copy of them into its buffer on a device.)
BUDGET = {
    "oktopk": {1: (1, 48), 3: (3, 182), 8: (3, 367)},  # (the Triton chain: TRITON_BUDGET)
    "oktopk2d": {1: (1, 48), 3: (3, 182), 8: (3, 367)},  # (its two hops are host work)
    # (here one rank a node: Ok-Topk's steps without its fused pass, which reads a rank's own
    # accumulator where the two-level call selects from the node's sum; nodes of two in test_twolevel.py)
    "oktopk2l": {1: (3, 39), 3: (6, 177), 8: (6, 362)},
    "topka": {1: (1, 49), 3: (3, 106), 8: (3, 166)},
    "topkdsa": {1: (1, 49), 3: (4, 168), 8: (4, 358)},
    "gtopk": {1: (1, 49), 3: (12, 162), 8: (15, 212)},
    "gaussiank": {1: (2, 54), 3: (3, 113), 8: (3, 173)},
    "cltk": {1: (2, 39), 3: (2, 40), 8: (2, 40)},
    "dense": {1: (2, 21), 3: (2, 22), 8: (2, 22)},
}

@pytest.mark.parametrize("P", [1, 3, 8])
@pytest.mark.parametrize("algorithm", sorted(BUDGET))
def test_a_steady_call_stays_within_its_budget(algorithm, P):
    syncs, ops = BUDGET[algorithm][P]
    per_rank = audit_steady(algorithm, P)
    worst = max((calls[0] for calls in per_rank), key=lambda a: (a.n_syncs, a.n_ops))
    assert worst.n_syncs <= syncs, worst.summary()["sync_sites"]
    assert max(calls[0].n_ops for calls in per_rank) <= ops
    if algorithm in ("oktopk", "oktopk2d"):  # every buffer sized by its bound: nothing allocated by a size read from data
        assert all(calls[0].n_dynamic == 0 for calls in per_rank), [calls[0].dynamic for calls in per_rank]


#: gTopk reads the header of every message on its way up and down the tree, and the size of
#: every merge: a read per tree level and per merge, beyond one a phase.
READS_PER_LEVEL = {"gtopk"}


@pytest.mark.parametrize("P", [1, 3])
@pytest.mark.parametrize("algorithm", sorted(set(BUDGET) - READS_PER_LEVEL))
def test_a_steady_call_reads_the_device_at_most_once_a_phase_and_once_more(algorithm, P):
    def phases(rank):
        st = sparsecomm.registry.get(algorithm).state_class(0.01)
        for step in range(5):
            sparsecomm.allreduce(torch.randn(20_000, generator=torch.Generator().manual_seed(100 * rank + step)),
                                 state=st)
        return len(set(st.last.phases) - {"accumulate"})

    allowed = max(sparsecomm.simulate(P, phases).results) + 1
    assert max(calls[0].n_syncs for calls in audit_steady(algorithm, P)) <= allowed


def test_every_algorithm_has_a_budget():
    assert set(BUDGET) == set(sparsecomm.registry.names())


#: The chain an H100 runs (``audit(kernels="triton")``: Triton's kernels, each launch one
#: operation, torch where an operation has none), Ok-Topk's steady call: (syncs, operations).
#: Goals: at most 20 operations at P = 1, 60 + 2 (P - 1) per rank at P = 3 and 8 (P = 8 makes
#: 74, measured by ``benchmarks/audit_calls.py``: over two minutes in the interpreter). P = 3
#: includes the copy of the split's parts into the alltoallv's buffer.
TRITON_BUDGET = {1: (1, 14), 3: (3, 58)}


@interpreter_only
@pytest.mark.parametrize("P", [pytest.param(1), pytest.param(3, marks=pytest.mark.slow)])
def test_the_triton_chain_of_a_steady_oktopk_call_is_short(P):
    syncs, ops = TRITON_BUDGET[P]
    per_rank = audit_steady("oktopk", P, kernels="triton")
    for calls in per_rank:
        assert calls[0].n_syncs <= syncs, calls[0].summary()["sync_sites"]
        assert calls[0].n_ops <= ops, calls[0].ops
        assert calls[0].ops["triton.ef_select_kernel"] == calls[0].ops["triton.tally_kernel"] == 1
        assert calls[0].n_dynamic == 0


@pytest.mark.parametrize("algorithm", ["oktopk", "topka"])
def test_host_messages_are_packed_without_an_index_a_byte(algorithm, monkeypatch):
    # The exchange's messages are bytes at arbitrary offsets. Packed by gathering and scattering
    # each byte through an int64 index (``segments.positions`` over bytes), the parts of a call
    # at P = 2 took 3-5x as long on MPI and gloo as one message at a time; the host path writes
    # them in one compiled pass. Counted here: index elements ``kernels.message`` makes per byte
    # the call packs (the reference, pack_messages_torch, makes more than one).
    pytest.importorskip("numba")
    from sparsecomm.kernels import message

    made = []
    real = message.positions

    def counted(*args, **kwargs):
        out = real(*args, **kwargs)
        made.append(out.numel())
        return out

    monkeypatch.setattr(message, "positions", counted)

    def body(rank: int) -> None:
        st = sparsecomm.registry.get(algorithm).state_class(0.01)
        gen = torch.Generator().manual_seed(rank)
        for _ in range(4):
            sparsecomm.allreduce(torch.randn(200_000, generator=gen), state=st)

    sim = sparsecomm.simulate(2, body)
    sent = sum(s["bytes_sent"] for s in sim.stats)
    assert sent > 0
    assert sum(made) <= sent / 16, (sum(made), sent)
