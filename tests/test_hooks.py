"""The DDP communication hook on real gloo ranks, and its state on the simulated world."""

from __future__ import annotations

import pickle
import warnings
from pathlib import Path

import engines
import hook_cases
import pytest
import torch
from conservation import assert_conserved

import sparsecomm
from sparsecomm.hooks import SparseHookState, sparse_allreduce_hook

P = 4


DENSITY_ONE = ["oktopk", "topka", "dense", "oktopk2l"]


SEVERAL_BUCKETS = [
    ("shuffled", 0.01, False, 6),  # the rebuilt buckets hold other parameter sets than the initial ones
    ("mlp", 0.02, True, 6),
    ("shuffled", 0.01, True, 2),  # taken before the rebuilt buckets became the layouts
    ("shuffled", 0.01, False, 3),  # taken the step they did
]
ACCUMULATIONS = [("dense", 1.0), ("oktopk", 1.0), ("oktopk", 0.05)]
#: The gloo cases of this module (``hook_cases.<case>(*args)``) by world size, each size's on
#: one launch of its ranks (a launch of 3 or 4 gloo processes costs seconds on two cores).
LAUNCHES = {
    P: [("equals_ddp_each", (tuple(DENSITY_ONE),)), ("conservation", ()), ("save_restore", ()),
        ("nan_gradient", ("none",)), ("nan_gradient", ("disabled",)), ("dense_after_rebuild", ())],
    3: ([("save_restore", args) for args in SEVERAL_BUCKETS]
        + [(case, (overlap,)) for case in ("refusal_carry", "amp_scaler") for overlap in (False, True)]
        + [("accumulate", args) for args in ACCUMULATIONS]
        + [("conservation", (6, "dense", "q8")), ("overlap_equals_sync", ())]),
}


@pytest.fixture(scope="module")
def launched():
    """Every rank's result of each case of :data:`LAUNCHES`, by (world size, case, args); a
    size's cases run at its first use."""
    done: dict = {}

    def get(size: int, case: str, args: tuple = ()) -> list:
        if (size, case, args) not in done:
            calls = LAUNCHES[size]
            runs = engines.run_gloo(size, hook_cases.several, calls, timeout=600)
            done.update({(size, c, a): [run[i] for run in runs] for i, (c, a) in enumerate(calls)})
        return done[(size, case, args)]

    return get


@pytest.fixture(scope="module")
def density_one(launched):
    return launched(P, "equals_ddp_each", (tuple(DENSITY_ONE),))


@pytest.mark.slow
@pytest.mark.gloo
@pytest.mark.parametrize("algorithm", DENSITY_ONE)
def test_density_one_equals_ddp_allreduce(algorithm, density_one):
    for worst, totals in (o[algorithm] for o in density_one):
        assert worst < 1e-5  # summation order differs from gloo's ring; nothing else
        # The model fits one bucket: the hook, not DDP's own allreduce, reduced it each step.
        assert totals["steps"] == 3 and totals["sparse_buckets"] == 3 and totals["dense_buckets"] == 0


@pytest.mark.slow
@pytest.mark.gloo
def test_residual_conservation_across_bucket_rebuilds(launched):
    out = launched(P, "conservation")
    n_params = len(out[0]["fed"])
    for i in range(n_params):
        assert_conserved(out[0]["results"][i], [o["residuals"][i] for o in out], [o["fed"][i] for o in out],
                         rtol=1e-4)
        for o in out:
            assert torch.equal(o["results"][i], out[0]["results"][i])  # Ok-Topk: bitwise on every rank
    # DDP rebuilt its buckets after the first step into other parameter sets, so
    # residuals had to move between layouts; the hook holds the final ones, and
    # reduces them in the rebuilt buckets' own order (no copies).
    layouts = out[0]["layouts"]
    sets = [{frozenset(b) for b in step} for step in layouts]
    assert len(layouts) == 15 and sets[0] != sets[1] and set(layouts[1:]) == {layouts[-1]}
    assert any(list(b) != sorted(b) for b in layouts[-1])  # the rebuilt order is not model order
    assert out[0]["state_layouts"] == set(layouts[-1]) and out[0]["sparse"] == sum(map(len, layouts))


@pytest.mark.slow
@pytest.mark.gloo
def test_a_sparse_residual_goes_with_its_parameters_dense_bucket_after_ddps_rebuild(launched):
    # Real DDP: the embedding table's first step is reduced sparsely with the large layers; its
    # rebuilt bucket holds it alone, below min_bucket_elements, reduced dense from then on. Its
    # residual from the first step is sent with the first dense call, not held forever.
    out = launched(P, "dense_after_rebuild")
    for o in out:
        first, last = o["reductions"][0], o["reductions"][-1]
        assert any(0 in layout and not dense for layout, dense in first), first  # (the setting holds)
        assert ((0,), True) in last, last
        assert o["residual"] is None or not o["residual"].any()
        assert torch.equal(o["result"], out[0]["result"])
    torch.testing.assert_close(out[0]["result"], sum(o["fed"] for o in out), rtol=1e-5, atol=1e-6)


@pytest.mark.slow
@pytest.mark.gloo
def test_dense_q8_hook_keeps_its_quantisation_error(launched):
    # A compressed dense hook has error feedback too: what q8 rounds away stays in the
    # residuals, so results plus residuals are every gradient fed (3 ranks: not a power of 2).
    out = launched(3, "conservation", (6, "dense", "q8"))
    residual_mass = 0.0
    for i in range(len(out[0]["fed"])):
        residual_mass += float(sum(o["residuals"][i] for o in out).abs().sum())
        assert_conserved(out[0]["results"][i], [o["residuals"][i] for o in out], [o["fed"][i] for o in out],
                         rtol=1e-4)
        for o in out:
            assert torch.equal(o["results"][i], out[0]["results"][i])
    assert residual_mass > 0  # the rounding was kept, not dropped


@pytest.mark.slow
@pytest.mark.gloo
def test_overlapping_hook_equals_the_synchronous_one(launched):
    out = launched(3, "overlap_equals_sync")
    for o in out:
        sync, ovl = o[False], o[True]
        assert all(torch.equal(a, b) for a, b in zip(sync["params"], ovl["params"]))
        assert sync["residuals"].keys() == ovl["residuals"].keys()
        assert all(torch.equal(sync["residuals"][i], ovl["residuals"][i]) for i in sync["residuals"])
        assert sync["totals"] == ovl["totals"] and ovl["totals"]["sparse_buckets"] > 0
        assert ovl["totals"]["dense_buckets"] > 0 and ovl["threads"] == "torch:gloo"
        assert all(torch.equal(a, b) for a, b in zip(o[True]["params"], out[0][True]["params"]))


@pytest.mark.slow
@pytest.mark.gloo
def test_checkpoint_resumes_identically(launched):
    for same in launched(P, "save_restore"):
        assert same == [True] * 4


def launched_once(size: int, case: str, argsets: list[tuple]) -> dict:
    """Every rank's result of ``hook_cases.<case>(*args)`` by args, all on one launch of the ranks."""
    runs = engines.run_gloo(size, hook_cases.each, case, argsets)
    return {args: [run[i] for run in runs] for i, args in enumerate(argsets)}


@pytest.fixture(scope="module")
def several_buckets(launched):
    return {args: launched(3, "save_restore", args) for args in SEVERAL_BUCKETS}


@pytest.mark.slow
@pytest.mark.gloo
@pytest.mark.parametrize("args", SEVERAL_BUCKETS)
def test_checkpoint_resumes_identically_with_several_buckets(args, several_buckets):
    # The resumed run's first step has DDP's initial buckets: they are staged into the
    # saved layouts, whose saved states reduce them as the uninterrupted run did.
    for same in several_buckets[args]:
        assert same == [True] * 4


@pytest.mark.slow
@pytest.mark.gloo
@pytest.mark.parametrize("scaler", ["none", "disabled"])
def test_nan_gradient_fails_on_every_rank(scaler, launched):
    # A disabled GradScaler is no scaler: it steps the optimizer as it is, so an Inf result
    # would reach every parameter of every rank. The NaN must raise instead, and no step is taken.
    for out in launched(P, "nan_gradient", (scaler,)):
        assert "NonFiniteError" in out["error"] and "NaN or Inf on rank(s) [1]" in out["error"], out
        assert out["kept"], out


class FakeBucket:
    """Duck-typed dist.GradBucket for driving the hook without DDP."""

    def __init__(self, params, index=0, last=True):
        self._params, self._index, self._last = params, index, last

    def buffer(self):
        return torch.cat([p.grad.reshape(-1) for p in self._params])

    def parameters(self):
        return self._params

    def gradients(self):
        return [p.grad for p in self._params]

    def index(self):
        return self._index

    def is_last(self):
        return self._last


def _params(sizes, rank, step=0):
    ps = [torch.nn.Parameter(torch.zeros(s)) for s in sizes]
    for i, p in enumerate(ps):
        p.grad = torch.randn(sizes[i], generator=torch.Generator().manual_seed(100 * rank + 10 * step + i))
    return ps


def test_bucket_size_differing_across_ranks_is_bad_input():
    def body(rank):
        params = _params([100, 50 + (rank == 2)], rank)
        model = torch.nn.Module()
        model.ps = torch.nn.ParameterList(params)
        st = SparseHookState(model, "oktopk", 0.1, min_bucket_elements=0)
        return sparse_allreduce_hook(st, FakeBucket(params)).wait()

    res = sparsecomm.simulate(3, body, return_exceptions=True).results
    assert all(isinstance(e, sparsecomm.InputError) and "differs across ranks" in str(e) for e in res)


def test_new_layout_inherits_residuals_and_state_pickles():
    def body(rank):
        params = _params([300, 200, 100], rank)
        model = torch.nn.Module()
        model.ps = torch.nn.ParameterList(params)
        st = SparseHookState(model, "topka", 0.05, min_bucket_elements=0, warmup_steps=1)
        sparse_allreduce_hook(st, FakeBucket(params))  # warm-up: dense, no residual
        assert st.totals["dense_buckets"] == 1 and not st.residuals()
        sparse_allreduce_hook(st, FakeBucket(params))  # one bucket of all three
        before = st.residuals()
        # Re-bucketed: a step of one bucket of two of them, in another order. It is staged
        # into the held layout, which never completes, so at the step's end it becomes a
        # layout of its own. Residuals follow their parameters.
        sparse_allreduce_hook(st, FakeBucket([params[2], params[0]], 0, True)).wait()
        after = st.residuals()
        assert torch.equal(after[1], before[1])  # not in the new bucket: untouched
        for i in (0, 2):
            # Entries this call did not send keep residual + gradient: the new layout
            # started from the parameter's own residual, not from zeros or a neighbour's.
            kept = after[i] != 0
            assert kept.sum() > 0.8 * params[i].numel() and before[i].count_nonzero() > 0.8 * params[i].numel()
            assert torch.equal(after[i][kept], (before[i] + params[i].grad)[kept])
        assert set(st.layout_states) == {(2, 0)}  # keyed by the layout: the new bucket's own order
        copy = pickle.loads(pickle.dumps(st))
        assert copy.residuals().keys() == after.keys()
        assert all(torch.equal(copy.residuals()[i], after[i]) for i in after)
        return copy.step

    assert sparsecomm.simulate(2, body).results == [3, 3]


@pytest.mark.parametrize("algorithm, min_elements", [("oktopk", 5000), ("auto", 0)])
def test_a_residual_whose_parameter_goes_to_a_dense_layout_is_sent_with_its_next_call(algorithm, min_elements):
    # Step 1 reduces both parameters in one sparse layout: each keeps a residual. Then DDP's
    # rebuilt buckets put the small one alone, reduced dense (below min_bucket_elements, or
    # auto's choice for its size on 1 Gbit/s): its residual goes with that call (op="sum":
    # the result is every rank's gradient plus residual) instead of waiting forever. A refused
    # call leaves it waiting, a checkpoint keeps it waiting, and the next call sends it.
    sizes = [100_000, 1_000]

    def hook(model):
        return SparseHookState(model, algorithm, 0.01, min_bucket_elements=min_elements, network="1gbe", op="sum")

    def step(st, params, grads):
        for p, g in zip(params, grads):
            p.grad = g.clone()
        futures = [sparse_allreduce_hook(st, FakeBucket(params[:1], 0, False)),
                   sparse_allreduce_hook(st, FakeBucket(params[1:], 1, True))]
        return [f.wait()[:] if not isinstance(f, Exception) else f for f in futures]

    def body(rank):
        params = _params(sizes, rank)
        model = torch.nn.Module()
        model.ps = torch.nn.ParameterList(params)
        st = hook(model)
        sparse_allreduce_hook(st, FakeBucket(params, 0, True)).wait()
        owed = st.residuals()[1].clone()
        grads = [p.grad.clone() for p in _params(sizes, rank, step=1)]
        poisoned = [g.clone() for g in grads]
        poisoned[1][0] = float("nan") if rank == 1 else 0.0  # refused on every rank
        with pytest.raises(sparsecomm.InputError):
            step(st, params, poisoned)
        assert torch.equal(st.residuals()[1], owed)  # refused: still waiting
        again = hook(model)
        again.load_state_dict(pickle.loads(pickle.dumps(st.state_dict())))
        assert torch.equal(again.residuals()[1], owed)
        result = step(again, params, grads)[1]
        left = again.residuals().get(1)
        assert left is None or not left.any()  # sent: nothing of it waits
        return owed + grads[1], result

    out = sparsecomm.simulate(2, body).results
    expected = sum(sent for sent, _ in out)
    for _, result in out:
        torch.testing.assert_close(result, expected, rtol=1e-6, atol=1e-5)


def _hook_after_steps(sizes, algorithm, density, steps=3):
    params = _params(sizes, 0)
    model = torch.nn.Module()
    model.ps = torch.nn.ParameterList(params)
    st = SparseHookState(model, algorithm, density, min_bucket_elements=0)
    for _ in range(steps):
        sparse_allreduce_hook(st, FakeBucket(params)).wait()
    return st, model, params


def test_checkpoint_with_other_settings_keeps_this_hooks_settings_and_the_residuals():
    # A hook built for dense at 1.0 that loads an Ok-Topk 5% checkpoint reduces with dense at
    # 1.0 (it reduced with Ok-Topk at 5% before), and says so; the residuals carry over.
    saved, model, params = _hook_after_steps([300, 200], "oktopk", 0.05)
    ckpt = pickle.loads(pickle.dumps(saved.state_dict()))
    hook = SparseHookState(model, "topka", 0.2, min_bucket_elements=0)
    with pytest.warns(UserWarning, match="OkTopkState.*TopkAState"):
        hook.load_state_dict(ckpt)
    assert all(torch.equal(hook.residuals()[i], saved.residuals()[i]) for i in (0, 1))
    sparse_allreduce_hook(hook, FakeBucket(params)).wait()
    (state,) = hook.layout_states.values()
    assert type(state) is sparsecomm.TopkAState and state.density == 0.2
    # The same settings: the saved state itself goes on, no warning.
    same = SparseHookState(model, "oktopk", 0.05, min_bucket_elements=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        same.load_state_dict(pickle.loads(pickle.dumps(saved.state_dict())))
    assert [st.iteration for st in same.layout_states.values()] == [3]


def test_a_state_pickled_by_an_earlier_version_goes_on_bit_for_bit():
    # tests/data/make_hook_pickles.py pickled each rank's whole state with the code of 31f8aa1,
    # whose hook kept its layouts and checkpoints in attributes of its own: a held Ok-Topk layout,
    # a residual parked by a refused dense call, a refused step's carried results. Unpickled here,
    # it holds the same memory, and through its state_dict() a hook of a new model makes the
    # steps that followed with the same results, bit for bit.
    with open(Path(__file__).resolve().parent / "data" / "hook_pickles_31f8aa1.pkl", "rb") as f:
        fixture = pickle.load(f)

    def body(rank):
        saved = fixture["ranks"][rank]
        old = pickle.loads(saved["pickle"])
        mine, carried = old.residuals(), old.carried()
        assert mine.keys() == saved["residuals"].keys() and carried.keys() == saved["carried"].keys()
        assert all(torch.equal(mine[i], saved["residuals"][i]) for i in mine)
        assert all(torch.equal(carried[i], saved["carried"][i]) for i in carried) and carried
        params = [torch.nn.Parameter(torch.zeros(n)) for n in fixture["sizes"]]
        model = torch.nn.Module()
        model.ps = torch.nn.ParameterList(params)
        hook = SparseHookState(model, "oktopk", 0.05, min_bucket_elements=500)
        hook.load_state_dict(old.state_dict())
        for grads, buckets, expected in zip(saved["grads"], fixture["steps"], saved["results"]):
            futures = []
            for k, b in enumerate(buckets):
                for i in b:
                    params[i].grad = grads[i].clone()
                futures.append(sparse_allreduce_hook(hook, FakeBucket([params[i] for i in b], k, k == len(buckets) - 1)))
            got = [f.wait() for f in futures]
            assert all(torch.equal(a, b) for a, b in zip(got, expected)), "not the earlier version's results"
        return len(saved["results"])

    assert sparsecomm.simulate(2, body).results == [2, 2]


def test_checkpoint_of_another_model_is_refused_at_load():
    saved, _, _ = _hook_after_steps([300, 200, 100], "oktopk", 0.05)
    for sizes, match in (([300, 200], "parameter 2; this model has 2 parameters"),
                         ([300, 250, 100], "parameter 1 has 200 elements; this model's has 250")):
        _, model, _ = _hook_after_steps(sizes, "oktopk", 0.05, steps=0)
        with pytest.raises(ValueError, match=match):
            SparseHookState(model, "oktopk", 0.05).load_state_dict(saved.state_dict())


def test_state_validation():
    model = torch.nn.Linear(3, 3)
    with pytest.raises(ValueError, match="unknown algorithm"):
        SparseHookState(model, "nope")
    with pytest.raises(ValueError, match="op must be 'avg' or 'sum', got 'max'"):
        SparseHookState(model, op="max")
    with pytest.raises(ValueError, match="warmup_steps"):
        SparseHookState(model, warmup_steps=-1)
    with pytest.raises(ValueError, match="tau"):
        SparseHookState(model, algorithm_options={"tau": 0})


def test_a_bucket_order_that_repeats_becomes_the_layout():
    # DDP's first step has buckets in model order, later ones in gradient-ready order; a
    # resumed run has the initial order for one step again. The state keeps its layout
    # (and thresholds) for one step in another order, by copying, and takes the order
    # over when it comes twice in a row, so that the rebuilt buckets reduce in place.
    sizes = [300, 200, 100]

    def body(rank):
        params = _params(sizes, rank)
        model = torch.nn.Module()
        model.ps = torch.nn.ParameterList(params)
        st = SparseHookState(model, "oktopk", 0.05, min_bucket_elements=0, op="sum")
        fed = [torch.zeros(s, dtype=torch.float64) for s in sizes]
        got = [torch.zeros(s, dtype=torch.float64) for s in sizes]

        def call(order):
            out = sparse_allreduce_hook(st, FakeBucket([params[i] for i in order])).wait()
            for i, part in zip(order, out.split([sizes[i] for i in order])):
                fed[i] += params[i].grad.double()
                got[i] += part.double()

        call([0, 1, 2])
        first = st.layout_states[(0, 1, 2)]
        call([2, 1, 0])  # once: copied into the layout (0, 1, 2)
        assert set(st.layout_states) == {(0, 1, 2)} and st.layout_states[(0, 1, 2)] is first and first.iteration == 2
        call([2, 1, 0])  # twice in a row: the new layout
        assert set(st.layout_states) == {(2, 1, 0)} and st.layout_states[(2, 1, 0)].iteration == 1
        assert not st._layouts.buffers  # reduced in place: no copy buffer kept
        rebuilt = st.layout_states[(2, 1, 0)]
        call([0, 1, 2])  # a resumed run's first step: copied, the layout stays
        call([2, 1, 0])
        assert set(st.layout_states) == {(2, 1, 0)} and st.layout_states[(2, 1, 0)] is rebuilt and rebuilt.iteration == 3
        call([0, 1, 2])  # an order that alternates never takes over
        assert st.layout_states[(2, 1, 0)] is rebuilt and set(st._layouts.buffers) == {(2, 1, 0)}
        call([0, 1])  # other sets: the old layout, and its copy buffer, go
        assert set(st.layout_states) == {(0, 1)} and not st._layouts.buffers
        return fed, got, st.residuals()

    res = sparsecomm.simulate(3, body).results
    for i in range(3):  # nothing lost over the moves: every rank's results plus all residuals = all fed
        fed = sum(f[i] for f, _, _ in res)
        left = sum(r[i].double() for _, _, r in res)
        for _, got, _ in res:
            torch.testing.assert_close(got[i] + left, fed, rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def refusals(launched):
    return {(overlap,): launched(3, "refusal_carry", (overlap,)) for overlap in (False, True)}


@pytest.mark.slow
@pytest.mark.gloo
@pytest.mark.parametrize("overlap", [False, True])
def test_refused_step_loses_nothing_and_ddp_goes_on(overlap, refusals):
    # A NaN in rank 1's gradient of one layer at step 3, several buckets. The loop catches
    # the NonFiniteError (its own type, on every rank: not DDP's RuntimeError), zero_grads
    # and skips the step; DDP's next iterations work. The step's other reductions gave up
    # their residuals: their results are carried into the next step, so everything fed but
    # the refused layout's gradients is applied or still in a residual, on every rank alike.
    out = refusals[(overlap,)]
    for o in out:
        assert o["errors"] == [(3, "NonFiniteError", [1])]
        assert o["refused"][3] and not any(o["refused"][s] for s in o["refused"] if s != 3)
        assert o["totals"]["refused_steps"] == 1 and o["totals"]["steps"] == 8
        assert all(torch.equal(a, b) for a, b in zip(o["params"], out[0]["params"]))
        assert all(not c.any() for c in o["carried"])  # applied at step 4
    n = len(out[0]["fed"])
    assert len(out[0]["refused"][3]) < n  # some reductions of the refused step went through
    for i in range(n):
        assert_conserved(out[0]["applied"][i], [o["residuals"][i] for o in out], [o["fed"][i] for o in out],
                         rtol=1e-4)


FATAL = [(overlap, error) for error in ("CommTimeoutError", "PeerError") for overlap in (False, True)]


@pytest.fixture(scope="module")
def fatal():
    return launched_once(2, "fatal_error", FATAL)


@pytest.mark.slow
@pytest.mark.gloo
@pytest.mark.parametrize("overlap, error", FATAL)
def test_a_broken_communicator_raises_its_own_error_at_every_later_step(overlap, error, fatal):
    # Raised inside the hook, DDP's reducer asserted at every later iteration; with
    # overlap, DDP could not cast the failed future's value ("Unable to cast ... to Tensor").
    for seen in fatal[(overlap, error)]:
        assert seen[:2] == ["ok", "ok"] and seen[2].startswith(f"{error}: simulated"), seen
        assert "simulated" in seen[2] and seen[3:] == [seen[2]] * 2, seen


@pytest.fixture(scope="module")
def scaled(launched):
    return {(overlap,): launched(3, "amp_scaler", (overlap,)) for overlap in (False, True)}


@pytest.mark.slow
@pytest.mark.gloo
@pytest.mark.parametrize("overlap", [False, True])
def test_grad_scaler_skips_the_overflowing_step_on_every_rank(overlap, scaled):
    # With scaler=, a NaN in one rank's gradient is no error: the refused layout's results are
    # Inf on every rank, so GradScaler skips the step everywhere and halves its scale. The
    # step's other results are carried; residuals and carried results follow the scale (down
    # after the skip, up every growth_interval steps), so in unscaled units nothing is lost.
    out = scaled[(overlap,)]
    s0 = 2.0 ** 12
    for o in out:
        assert o["scales"] == [s0, s0, s0, 2 * s0, 2 * s0, s0, s0, s0, 2 * s0, 2 * s0]
        assert o["skipped"] == [False] * 4 + [True] + [False] * 5
        assert o["refused"][4] and not any(o["refused"][s] for s in o["refused"] if s != 4)
        assert all(o["finite_residuals"]) and o["totals"]["refused_steps"] == 1
        assert all(torch.equal(a, b) for a, b in zip(o["params"], out[0]["params"]))
        assert all(not c.any() for c in o["carried"])
    for i in range(len(out[0]["fed"])):
        assert_conserved(out[0]["applied"][i], [o["residuals"][i] for o in out], [o["fed"][i] for o in out],
                         rtol=1e-4)


@pytest.fixture(scope="module")
def accumulations(launched):
    return {args: launched(3, "accumulate", args) for args in ACCUMULATIONS}


@pytest.mark.slow
@pytest.mark.gloo
@pytest.mark.parametrize("algorithm, density", ACCUMULATIONS)
def test_no_sync_accumulation_equals_one_reduction_of_the_accumulated_gradient(algorithm, density, accumulations):
    for o in accumulations[(algorithm, density)]:
        assert o["no_sync"]["steps"] == o["local"]["steps"] == 4  # one hook step per optimizer step
        for a, b in zip(o["no_sync"]["grads"], o["local"]["grads"]):
            assert all(torch.equal(x, y) for x, y in zip(a, b))
        if density == 1.0:  # and DDP's own allreduce, to the summation order
            for a, b in zip(o["no_sync"]["grads"], o["ddp"]["grads"]):
                for x, y in zip(a, b):
                    torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-5)
