"""Two-level Ok-Topk (``oktopk2l``): its reference at every (P, G), nothing lost, G found and agreed."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

import sparsecomm
from conservation import assert_conserved
from reference import ref_oktopk, ref_oktopk2l
from sparsecomm.algorithms import OkTopkTwoLevelState
from sparsecomm.network import PROFILES, Network, TwoLevel

#: (P, G): one node, one rank a node, nodes of 2, 3, 4; non-powers of two among them.
LAYOUTS = [(1, 1), (2, 1), (2, 2), (3, 3), (4, 2), (5, 1), (6, 2), (6, 3), (8, 2), (8, 4), (9, 3), (12, 4)]


def run(grads, density, G, steps=1, compressor=None, **state_kw):
    """Every rank's results (one a step, the gradient times the step's number) and final
    residual; stateless calls without ``state_kw`` (G from the simulated network)."""

    def body(rank):
        state = OkTopkTwoLevelState(density, ranks_per_node=G, **state_kw) if state_kw else None
        outs = [sparsecomm.allreduce(grads[rank] * (step + 1), density, algorithm="oktopk2l", state=state,
                                     compressor=compressor) for step in range(steps)]
        return outs, (state.residual.clone() if state is not None else None)

    return sparsecomm.simulate(len(grads), body, timeout=30,
                               network=TwoLevel(PROFILES["1gbe"], PROFILES["1gbe"], G)).results


def _grads(P, n, seed, levels=30, zero_frac=0.0):
    gen = np.random.default_rng(seed)
    out = []
    for _ in range(P):
        v = gen.integers(-levels, levels + 1, size=n).astype(np.float32)
        v[gen.random(n) < zero_frac] = 0
        out.append(torch.from_numpy(v))
    return out


@pytest.mark.parametrize("P,G", LAYOUTS)
@pytest.mark.parametrize("n,density", [(1, 1.0), (7, 0.3), (1000, 0.01), (1001, 1e-9), (513, 1.0), (4099, 0.05)])
def test_stateless_call_matches_the_reference(P, G, n, density):
    grads = _grads(P, n, seed=P * 131 + G * 7 + n)
    results = run(grads, density, G)
    expected = ref_oktopk2l(grads, density, G)
    for rank, (outs, _) in enumerate(results):
        assert torch.equal(outs[0], expected), f"rank {rank} of P = {P}, G = {G}"


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(LAYOUTS), st.integers(1, 2000), st.one_of(st.just(1.0), st.floats(1e-4, 1.0)),
       st.integers(1, 40), st.sampled_from([0.0, 0.5, 1.0]), st.integers(0, 2**31 - 1))
def test_ties_zeros_and_sizes_match_the_reference(layout, n, density, levels, zero_frac, seed):
    (P, G) = layout
    grads = _grads(P, n, seed, levels, zero_frac)
    results = run(grads, density, G)
    expected = ref_oktopk2l(grads, density, G)
    assert all(torch.equal(outs[0], expected) for outs, _ in results)


def test_one_rank_a_node_is_ok_topk():
    grads = _grads(5, 3000, seed=3)
    assert torch.equal(run(grads, 0.01, 1)[0][0][0], ref_oktopk(grads, 0.01))


@pytest.mark.parametrize("P,G", [(2, 2), (4, 2), (6, 3), (8, 4), (9, 3)])
@pytest.mark.parametrize("compressor", [None, "fp16", "q8"])
def test_nothing_is_lost_with_error_feedback(P, G, compressor):
    """Over steps with reused thresholds: results plus residuals keep every gradient; the
    residual lives on the shard's owner (zero outside this rank's shard)."""
    n, steps = 2003, 6
    grads = [torch.randn(n, generator=torch.Generator().manual_seed(s)) for s in range(P)]
    results = run(grads, 0.02, G, steps=steps, compressor=compressor, tau=3, tau_prime=4)
    outs = [o for o, _ in results]
    for rank in range(P):
        for step in range(steps):
            assert torch.equal(outs[rank][step], outs[0][step])
    delivered = sum(outs[0])
    fed = [grads[r] * sum(range(1, steps + 1)) for r in range(P)]
    assert_conserved(delivered, [res for _, res in results], fed)
    m = -(-n // G)
    for rank, (_, res) in enumerate(results):
        lo = (rank % G) * m
        outside = torch.cat([res[:lo], res[lo + m:]])
        assert not outside.any(), f"rank {rank} keeps residual outside its shard"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_inputs_match_the_reference(dtype):
    grads = [g.to(dtype) for g in _grads(4, 999, seed=9, levels=8)]
    expected = ref_oktopk2l(grads, 0.05, 2)
    for outs, _ in run(grads, 0.05, 2):
        assert outs[0].dtype == dtype and torch.equal(outs[0], expected)


def test_ranks_per_node_from_the_simulated_network():
    grads = _grads(8, 600, seed=5)
    two_level = TwoLevel(Network(1e-6, 1e-10), Network(1e-5, 1e-9), 4)

    def body(rank):
        return sparsecomm.allreduce(grads[rank], 0.05, algorithm="oktopk2l")

    got = sparsecomm.simulate(8, body, network=two_level).results
    assert torch.equal(got[0], ref_oktopk2l(grads, 0.05, 4))
    assert not torch.equal(ref_oktopk2l(grads, 0.05, 4), ref_oktopk2l(grads, 0.05, 1))  # (G matters here)


def test_ranks_per_node_from_the_launcher(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    grads = _grads(4, 600, seed=6)
    got = sparsecomm.simulate(4, lambda r: sparsecomm.allreduce(grads[r], 0.05, algorithm="oktopk2l")).results
    assert torch.equal(got[0], ref_oktopk2l(grads, 0.05, 2))


@pytest.mark.parametrize("found", [[2, 2, 4, 4], [3, 3, 3, 3]])
def test_ranks_per_node_that_disagree_or_do_not_divide_are_refused_on_every_rank(found):
    def body(rank):
        state = OkTopkTwoLevelState(0.1, ranks_per_node=found[rank])
        return sparsecomm.allreduce(torch.ones(40), state=state, check=False)

    res = sparsecomm.simulate(4, body, return_exceptions=True, timeout=20).results
    for r in res:
        assert isinstance(r, ValueError) and "ranks per node" in str(r), r


def test_mismatched_ranks_per_node_settings_are_refused_by_the_check():
    def body(rank):
        return sparsecomm.allreduce(torch.ones(40), state=OkTopkTwoLevelState(0.1, ranks_per_node=1 + rank % 2))

    res = sparsecomm.simulate(2, body, return_exceptions=True, timeout=20).results
    assert all(isinstance(r, sparsecomm.InputError) and "ranks_per_node" in str(r) for r in res), res


def test_the_network_carries_a_gth_of_flat_ok_topk():
    """Between nodes: about k/G entries a rank; the fabric carries the dense reduce-scatter."""
    P, G, n, d = 8, 4, 40_000, 0.01
    grads = [torch.randn(n, generator=torch.Generator().manual_seed(s)) for s in range(P)]

    def body(rank, algorithm):
        out = sparsecomm.sparse_allreduce(grads[rank], d, algorithm=algorithm, check=False)
        return {name: p.bytes_received for name, p in out.stats.phases.items()}

    net = TwoLevel(PROFILES["1gbe"], PROFILES["1gbe"], G)
    two = sparsecomm.simulate(P, body, "oktopk2l", network=net).results
    flat = sparsecomm.simulate(P, body, "oktopk", network=net).results
    between = max(sum(v for name, v in ph.items() if not name.startswith("node_")) for ph in two)
    flat_bytes = max(sum(ph.values()) for ph in flat)
    assert between < flat_bytes / 2
    assert min(ph["node_reduce_scatter"] for ph in two) == 4 * (n // G) * (G - 1)


@pytest.mark.parametrize("P,G", [(4, 4), (8, 4), (8, 2), (9, 3)])
def test_the_registered_volume_bounds_the_words_each_rank_receives(P, G):
    """The formula the README's table shows (``oktopk2l_volume``, node part and Ok-Topk's) holds
    the simulated world's counts: words received per rank, headers and counts aside (2%)."""
    n, d = 40_000, 0.01
    grads = [torch.randn(n, generator=torch.Generator().manual_seed(s)) for s in range(P)]

    def body(rank):
        out = sparsecomm.sparse_allreduce(grads[rank], d, algorithm="oktopk2l", check=False)
        return out.stats.bytes_received / 4

    words = sparsecomm.simulate(P, body, network=TwoLevel(PROFILES["1gbe"], PROFILES["1gbe"], G)).results
    low, high = sparsecomm.registry.get("oktopk2l").volume(n, sparsecomm.state.topk_count(d, n), P, G)
    assert 0.98 * low <= min(words) and max(words) <= 1.02 * high, (low, words, high)


@pytest.mark.parametrize("P,G", [(6, 2), (8, 2), (10, 2), (16, 2), (9, 3), (7, 1)])
@pytest.mark.parametrize("compressor", [None, "q8"])
def test_on_a_grid_of_nodes_results_and_residuals_are_the_flat_ones_bit_for_bit(P, G, compressor):
    # grid=True: the shard's Ok-Topk between nodes in two hops on a grid of the N = P/G nodes
    # (3 to 8 of them here, non-squares among them): the same parts reach the same ranks.
    grads = _grads(P, 3001, seed=P * 17 + G)
    flat = run(grads, 0.02, G, steps=3, compressor=compressor, tau=2, tau_prime=3)
    grid = run(grads, 0.02, G, steps=3, compressor=compressor, tau=2, tau_prime=3, grid=True)
    for (outs, residual), (grid_outs, grid_residual) in zip(flat, grid):
        assert all(torch.equal(a, b) for a, b in zip(outs, grid_outs))
        assert torch.equal(residual, grid_residual)


@pytest.mark.parametrize("grid", ["yes", 1, None])
def test_a_grid_setting_that_is_not_a_bool_is_refused(grid):
    with pytest.raises(ValueError, match="grid must be True or False"):
        OkTopkTwoLevelState(0.01, grid=grid)


def test_a_grid_of_nodes_sends_fewer_messages_between_nodes():
    P, G, n, d = 32, 2, 20_000, 0.01
    grads = [torch.randn(n, generator=torch.Generator().manual_seed(s)) for s in range(P)]

    def body(rank, grid):
        state = OkTopkTwoLevelState(d, error_feedback=False, ranks_per_node=G, grid=grid)
        out = sparsecomm.sparse_allreduce(grads[rank], d, algorithm="oktopk2l", state=state, check=False)
        return sum(p.messages_sent for name, p in out.stats.phases.items() if not name.startswith("node_"))

    net = TwoLevel(PROFILES["1gbe"], PROFILES["1gbe"], G)
    flat = max(sparsecomm.simulate(P, body, False, network=net).results)
    grid = max(sparsecomm.simulate(P, body, True, network=net).results)
    assert grid < 0.85 * flat, (grid, flat)  # N = 16 nodes, a 4 x 4 grid: 102 against 132


def test_modelled_time_on_a_two_level_network_beats_flat_ok_topk():
    P, n, d = 16, 200_000, 0.01
    grads = [torch.randn(n, generator=torch.Generator().manual_seed(s)) for s in range(P)]
    net = TwoLevel(Network(3e-6, 1 / 150e9), Network(30e-6, 8 / 1.25e9), 8)

    def body(rank, algorithm):
        return sparsecomm.allreduce(grads[rank], d, algorithm=algorithm, check=False)

    two = max(sparsecomm.simulate(P, body, "oktopk2l", network=net).time)
    flat = max(sparsecomm.simulate(P, body, "oktopk", network=net).time)
    assert two < flat


@pytest.mark.parametrize("P", [4, 8])
def test_a_steady_call_in_nodes_of_two_reads_the_host_once_a_phase(P, monkeypatch):
    """Structure, not speed: host reads (synchronisations on a GPU) and operations per steady
    call, with nodes of two: the check, the local selection (3), the split's sizes (2), the
    global selection, the node's counts."""
    from sparsecomm.tools.audit import audit_steady

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    per_rank = audit_steady("oktopk2l", P)
    assert max(calls[0].n_syncs for calls in per_rank) <= 7, per_rank[0][0].summary()["sync_sites"]
    assert max(calls[0].n_ops for calls in per_rank) <= {4: 150, 8: 225}[P]


def test_a_checkpoint_in_nodes_of_two_resumes_bit_for_bit(tmp_path):
    grads = [torch.randn(3001, generator=torch.Generator().manual_seed(s)) for s in range(4)]

    def body(rank):
        st = OkTopkTwoLevelState(0.02, tau=2, tau_prime=3, ranks_per_node=2)
        for step in range(4):
            sparsecomm.allreduce(grads[rank] * (step + 1), state=st)
        torch.save(st, tmp_path / f"{rank}.pt")
        back = torch.load(tmp_path / f"{rank}.pt")  # weights_only=True
        return [sparsecomm.allreduce(grads[rank] * 5, state=s) for s in (st, back)]

    for went_on, resumed in sparsecomm.simulate(4, body).results:
        assert torch.equal(went_on, resumed)


@pytest.mark.parametrize("compressor", [None, "q8"])
def test_the_two_halves_equal_the_whole_call(compressor):
    """DeAR runs the halves apart: ``begin_allreduce`` then ``finish`` is the call, bit for bit."""
    grads = [torch.randn(2000, generator=torch.Generator().manual_seed(s)) for s in range(6)]

    def body(rank, split):
        st = OkTopkTwoLevelState(0.05, tau=2, ranks_per_node=3)
        outs = []
        for step in range(4):
            g = grads[rank] * (step + 1)
            if split:
                outs.append(sparsecomm.begin_allreduce(g, state=st, compressor=compressor).finish())
            else:
                outs.append(sparsecomm.allreduce(g, state=st, compressor=compressor))
        return outs, st.residual.clone()

    whole = sparsecomm.simulate(6, body, False).results
    halves = sparsecomm.simulate(6, body, True).results
    for (a, ra), (b, rb) in zip(whole, halves):
        assert all(torch.equal(x, y) for x, y in zip(a, b)) and torch.equal(ra, rb)


def test_a_result_refused_for_overflow_keeps_every_input_in_the_residual():
    """A sum past float16's range is refused on every rank; the residual then holds the
    input (as for every algorithm), and nothing was settled before the refusal."""
    big = torch.full((64,), 40000.0, dtype=torch.float16)

    def body(rank):
        st = OkTopkTwoLevelState(0.5, ranks_per_node=2)
        try:
            sparsecomm.allreduce(big, state=st)
        except sparsecomm.InputError as exc:
            return str(exc), st.residual.clone()
        return "no error", None

    for msg, residual in sparsecomm.simulate(4, body).results:
        assert "overflows" in msg and torch.equal(residual, big.float())


def test_dear_runs_its_halves_apart_as_the_synchronous_calls_of_its_groups(monkeypatch):
    """A schedule takes two-level Ok-Topk like any algorithm: DeAR (the reduction in backward,
    the gather before the next forward) on a model in nodes of two, bit for bit the
    synchronous calls of its groups."""
    from schedule_cases import run_dear, synchronous_reference

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")

    def body(rank):
        got, groups = run_dear(rank, "sgd", "oktopk2l", 0.05, 5_000)
        want = synchronous_reference(rank, "sgd", groups, "oktopk2l", 0.05, as_given=True)
        return all(torch.equal(a, b) for a, b in zip(got, want))

    assert all(sparsecomm.simulate(4, body, timeout=60).results)
