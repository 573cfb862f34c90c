"""``algorithm="auto"``: the traffic model against the simulated world, the choice, and the
calls, states and hook that use it."""

from __future__ import annotations

import json
import pickle

import pytest
import torch

import sparsecomm
from sparsecomm import choice
from sparsecomm.hooks import SparseHookState, sparse_allreduce_hook
from sparsecomm.tools.calibrate import traffic as simulated_traffic

from test_hooks import FakeBucket, _params


def test_each_algorithms_traffic_model_is_registered_beside_it():
    # One place per formula: choice.traffic reads the registry, so a candidate (or a projection's
    # algorithm) without a model is refused by name, not modelled by another's.
    for name in sparsecomm.algorithms():
        model = sparsecomm.registry.get(name).traffic
        assert (model is None) == (name in ("topkdsa", "gaussiank")), name
        if model is not None:
            assert model.__module__ == sparsecomm.registry.get(name).fn.__module__, name
            assert choice.traffic(name, 1000, 10, 1, 4) == choice.Traffic(0.0, 0.0)  # one rank sends nothing
    with pytest.raises(ValueError, match="no traffic model for 'topkdsa'"):
        choice.traffic("topkdsa", 1000, 10, 4, 4)


@pytest.mark.parametrize("algorithm", choice.CANDIDATES)
@pytest.mark.parametrize("P", [2, 3, 4, 5, 8])
def test_the_traffic_model_follows_the_simulated_world(algorithm, P):
    # The choice is only as good as its counts: messages and bytes of a steady call's busiest
    # rank, within 30% of what the simulated world counts, at a small and a large k.
    for n in (20_000, 200_000):
        messages, nbytes = simulated_traffic(algorithm, None, P, n, 0.01)
        model = choice.traffic(algorithm, n, sparsecomm.state.topk_count(0.01, n), P, 4)
        assert model.messages == pytest.approx(messages, rel=0.3), (n, model, messages)
        assert model.bytes == pytest.approx(nbytes, rel=0.3), (n, model, nbytes)


def test_small_tensors_go_dense_and_large_ones_sparse():
    assert sparsecomm.choose(10_000, 0.01, 4, network="10gbe") == "dense"
    assert sparsecomm.choose(25_000_000, 0.01, 4, network="10gbe") in ("oktopk", "oktopk2d")
    assert sparsecomm.choose(25_000_000, 0.01, 4, network="1gbe") in ("oktopk", "oktopk2d")
    # One rank sends nothing: the cheapest local work wins.
    assert sparsecomm.choose(25_000_000, 0.01, 1) == "dense"
    # Many ranks: the grid's fewer messages (a BERT-large gradient on 10 Gbit/s, as modelled in
    # docs/results.md section 17); a high latency and a small tensor: dense's log2 P messages.
    assert sparsecomm.choose(340_000_000, 0.01, 1024, network="10gbe") == "oktopk2d"
    assert sparsecomm.choose(2_000_000, 0.01, 1024, network=(1e-3, 1e-10)) == "dense"


def test_a_calibrated_profile_brings_its_local_costs(tmp_path, monkeypatch):
    monkeypatch.setenv("SPARSECOMM_PROFILES", str(tmp_path))
    (tmp_path / "slowsparse.json").write_text(json.dumps(
        {"name": "slowsparse", "alpha": 30e-6, "beta": 1 / 1.25e9,
         "local_s_per_element": {"oktopk": 1e-6, "oktopk2d": 1e-6}, "local_s_per_call": {}}))
    assert sparsecomm.choose(25_000_000, 0.01, 4, network="10gbe") != "dense"
    assert sparsecomm.choose(25_000_000, 0.01, 4, network="slowsparse") == "dense"


@pytest.mark.parametrize("P", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("network", ["10gbe", "1gbe"])
def test_auto_is_the_chosen_algorithm_bit_for_bit(P, network, monkeypatch):
    monkeypatch.setenv("SPARSECOMM_AUTO_NETWORK", network)
    n = 60_000

    def body(rank):
        g = torch.randn(n, generator=torch.Generator().manual_seed(rank))
        name = sparsecomm.choose(n, 0.01, P, comm=sparsecomm.resolve())
        return name, sparsecomm.allreduce(g, 0.01, algorithm="auto"), sparsecomm.allreduce(g, 0.01, algorithm=name)

    got = sparsecomm.simulate(P, body).results
    assert len({name for name, _, _ in got}) == 1
    for name, auto, chosen in got:
        assert torch.equal(auto, chosen) and torch.equal(auto, got[0][1])


def test_a_state_keeps_the_algorithm_chosen_for_it(monkeypatch):
    def body(rank):
        g = torch.randn(200_000, generator=torch.Generator().manual_seed(rank))
        st = sparsecomm.auto_state(g, 0.01, network="1gbe")
        first = type(st).__name__
        monkeypatch.setenv("SPARSECOMM_AUTO_NETWORK", "1:0")  # a network on which dense would win now
        assert sparsecomm.choose(g.numel(), 0.01, 2, comm=sparsecomm.resolve()) == "dense"
        for _ in range(3):
            sparsecomm.allreduce(g, algorithm="auto", state=st)
        return first, st.last.algorithm, st.iteration

    for first, used, calls in sparsecomm.simulate(2, body).results:
        assert first == "OkTopkState" and used == "oktopk" and calls == 3


def test_ranks_that_choose_differently_are_refused_on_every_rank(monkeypatch):
    real = choice.profile

    def per_rank(network=None, comm=None):  # rank 1 models a network of its own
        return real("1:0" if comm is not None and comm.rank == 1 else "1gbe", comm)

    monkeypatch.setattr(choice, "profile", per_rank)
    got = sparsecomm.simulate(3, lambda r: sparsecomm.allreduce(torch.ones(200_000), algorithm="auto"),
                              return_exceptions=True).results
    assert all(isinstance(e, sparsecomm.InputError) and "algorithm differs across ranks" in str(e) for e in got), got


def test_a_bad_network_profile_is_refused_with_its_name(monkeypatch):
    monkeypatch.setenv("SPARSECOMM_AUTO_NETWORK", "no-such-network")
    got = sparsecomm.simulate(2, lambda r: sparsecomm.allreduce(torch.ones(1000), algorithm="auto"),
                              return_exceptions=True).results
    assert all(isinstance(e, sparsecomm.InputError) and "no-such-network" in str(e) for e in got), got
    with pytest.raises(ValueError, match="no-such-network"):
        SparseHookState(torch.nn.Linear(2, 2), "auto")


def test_the_hook_chooses_per_bucket_and_its_checkpoint_keeps_the_choice():
    sizes = [100_000, 1_000]

    def body(rank):
        params = _params(sizes, rank)
        model = torch.nn.Module()
        model.ps = torch.nn.ParameterList(params)
        st = SparseHookState(model, "auto", 0.01, min_bucket_elements=0, network="1gbe")
        for _ in range(3):
            sparse_allreduce_hook(st, FakeBucket(params[:1], 0, False)).wait()
            sparse_allreduce_hook(st, FakeBucket(params[1:], 1, True)).wait()
        chosen = {key: type(s).__name__ for key, s in st.layout_states.items()}
        again = SparseHookState(model, "auto", 0.01, min_bucket_elements=0, network="1gbe")
        again.load_state_dict(pickle.loads(pickle.dumps(st.state_dict())))
        kept = {key: (type(s).__name__, s.iteration) for key, s in again.layout_states.items()}
        return chosen, kept

    for chosen, kept in sparsecomm.simulate(2, body).results:
        assert chosen == {(0,): "OkTopkState", (1,): "DenseState"}
        assert kept == {(0,): ("OkTopkState", 3), (1,): ("DenseState", 3)}
    with pytest.raises(ValueError, match="algorithm_options"):
        SparseHookState(torch.nn.Linear(2, 2), "auto", algorithm_options={"tau": 4})


@pytest.mark.parametrize("algorithm,G", [("gtopk", 1), ("topka", 1), ("cltk", 1), ("oktopk2l", 2), ("oktopk2l", 4)])
@pytest.mark.parametrize("P", [4, 8])
def test_the_projections_traffic_model_follows_the_simulated_world(algorithm, G, P, monkeypatch):
    # The baselines' and two-level Ok-Topk's formulas (benchmarks/two_level_projection.py), within
    # 30% of the simulated world's busiest rank; two levels: nodes of G from the launcher's variable.
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(G))
    n = 200_000
    simulated_traffic.cache_clear()  # (it remembers by algorithm and size, not by G)
    messages, nbytes = simulated_traffic(algorithm, None, P, n, 0.01)
    model = choice.traffic(algorithm, n, sparsecomm.state.topk_count(0.01, n), P, 4, G)
    assert model.messages + model.intra_messages == pytest.approx(messages, rel=0.3), (model, messages)
    assert model.bytes + model.intra_bytes == pytest.approx(nbytes, rel=0.3), (model, nbytes)
    if G > 1:  # the dense reduce-scatter within the node is most of it
        assert model.intra_bytes > 10 * model.bytes
