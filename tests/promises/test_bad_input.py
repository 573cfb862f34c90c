"""Bad input raises a clear error on every rank, quickly, never a hang."""

from __future__ import annotations

import contextlib
import importlib
import math
import pickle
import time

import pytest
import torch

import sparsecomm
from sparsecomm import kernels
from sparsecomm.errors import CommTimeoutError, InputError, PeerError

import cases

P = 4


def every_rank_raises(make_call, expected=InputError, match=None, P=P, timeout=8.0):
    """Run make_call(rank) on P simulated ranks; every rank must raise ``expected`` within 10 s."""
    t0 = time.monotonic()
    res = sparsecomm.simulate(P, make_call, timeout=timeout, return_exceptions=True)
    assert time.monotonic() - t0 < 10
    for r, exc in enumerate(res.results):
        assert isinstance(exc, expected), f"rank {r} returned {exc!r}"
        if match:
            assert match in str(exc), f"rank {r}: {exc}"
    return res.results


def good(rank):
    return torch.randn(100, generator=torch.Generator().manual_seed(rank))


@pytest.mark.parametrize("bad_rank", [None, 2])
def test_integer_tensor(bad_rank):
    def call(rank):
        t = torch.arange(100) if bad_rank in (None, rank) else good(rank)
        return sparsecomm.allreduce(t, 0.1)

    errs = every_rank_raises(call, match="unsupported dtype")
    assert "int64 is not supported" in str(errs[bad_rank or 0])


def test_each_problem_code_has_one_message_its_peers_name():
    from sparsecomm.check import Problem

    messages = [p.message for p in Problem]
    assert len(set(messages)) == len(messages) and all(messages)
    assert Problem.describe(99) == "error"


def test_a_sparse_tensor_on_one_rank_is_named_as_such_on_the_others():
    # A layout problem has its own code: the peers say what it was, not "the check raised".
    def call(rank):
        t = good(rank).to_sparse() if rank == 1 else good(rank)
        return sparsecomm.allreduce(t, 0.1)

    errs = every_rank_raises(call, match="rank 1: not a dense (strided) tensor")
    assert "layout torch.sparse_coo" in str(errs[1])


@pytest.mark.parametrize("density", [0, 0.0, 1.5, -0.1, math.nan, math.inf, "0.1"])
def test_bad_density(density):
    every_rank_raises(lambda r: sparsecomm.allreduce(good(r), density), match=f"in (0, 1], got {density!r}")


def test_density_differs_across_ranks():
    every_rank_raises(lambda r: sparsecomm.allreduce(good(r), 0.1 if r else 0.2),
                      match="density differs")


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_nonfinite_gradient_on_one_rank(value):
    def call(rank):
        t = good(rank)
        if rank == 1:
            t[17] = value
        return sparsecomm.allreduce(t, 0.1)

    errors = every_rank_raises(call, expected=sparsecomm.NonFiniteError, match="NaN or Inf on rank(s) [1]")
    # Its own type (an InputError still), naming the ranks: what AMP's skipped steps key on.
    assert all(isinstance(e, sparsecomm.InputError) and e.ranks == [1] for e in errors)
    assert pickle.loads(pickle.dumps(errors[0])).ranks == [1]


@pytest.mark.parametrize("gpu_branches", [False, True])
@pytest.mark.parametrize("algorithm", ["oktopk", "topka", "gtopk", "dense", "cltk", "gaussiank"])
@pytest.mark.parametrize("bad", ["nan", "inf", "overflowing sum"])
def test_rejected_call_leaves_the_residual_and_the_next_call_goes_on(algorithm, bad, gpu_branches, monkeypatch):
    # In steady state the finite check comes from the fused accumulate-and-select pass, which
    # runs before the ranks agree to reject the call: the rejected gradient must come back
    # out of the residual (up to the rounding of one add), and no entry may be lost. On a
    # GPU's branches the plain accumulating pass (Dense, CLT-k, Gaussiank) leaves its count
    # on the device, and the check's row carries it unread.
    n, steps = 3000, 4
    if gpu_branches:  # the torch kernels, as a GPU without Triton runs them
        monkeypatch.setenv("SPARSECOMM_KERNELS", "torch")

    def grad(rank, step):
        return torch.randn(n, generator=torch.Generator().manual_seed(100 * rank + step))

    def rejected_then_on(rank):
        st = sparsecomm.registry.get(algorithm).state_class(0.05, error_feedback=True)
        for step in range(steps):
            sparsecomm.allreduce(grad(rank, step), state=st)
        assert st.fuses_next(), "the next call should be the fused pass"
        before, it = st.residual.clone(), st.iteration
        g = grad(rank, 99)
        if rank == 1:
            if bad == "overflowing sum":
                st.residual[7] = torch.finfo(torch.float32).max
                before = st.residual.clone()
                g[7] = torch.finfo(torch.float32).max
            else:
                g[7] = float(bad)
        err = cases.input_error(sparsecomm.allreduce, g, state=st)
        after = st.residual.clone()
        out = sparsecomm.allreduce(grad(rank, 5), state=st)  # goes on
        return rank, err, before, after, it == st.iteration - 1, bool(torch.isfinite(out).all())

    def body(rank):
        with kernels.dispatch.gpu_path() if gpu_branches else contextlib.nullcontext():
            return rejected_then_on(rank)

    words = "overflows on rank(s) [1]" if bad == "overflowing sum" else "NaN or Inf on rank(s) [1]"
    for rank, err, before, after, counted_once, finite in sparsecomm.simulate(P, body).results:
        assert err is not None and words in err, err
        if rank == 1:
            assert after[7] == before[7]  # the non-finite sum never reached the residual
        torch.testing.assert_close(after, before, rtol=1e-6, atol=1e-6)
        assert counted_once and finite


def test_fused_pass_that_raises_on_one_rank_raises_on_every_rank():
    # The fused pass runs before the collective check: an error in it must reach every rank.
    def body(rank):
        st = sparsecomm.OkTopkState(0.05)
        for step in range(3):
            sparsecomm.allreduce(good(rank + step), state=st)
        assert st.fuses_next()
        if rank == 2:
            def broken(flat, zero_out=None):
                raise RuntimeError("kernel launch failed")
            st.compensate = broken
        return sparsecomm.allreduce(good(rank), state=st)

    errs = every_rank_raises(body, match="rank 2: the error-feedback accumulation failed")
    assert "kernel launch failed" in str(errs[2])


def test_shape_differs_across_ranks():
    every_rank_raises(lambda r: sparsecomm.allreduce(torch.randn(100 + (r == 3)), 0.1),
                      match="element count differs")
    every_rank_raises(lambda r: sparsecomm.allreduce(torch.randn(10, 10) if r else torch.randn(100), 0.1),
                      match="shape differs")


def test_dtype_differs_across_ranks():
    every_rank_raises(lambda r: sparsecomm.allreduce(good(r).to(torch.float16 if r == 1 else torch.float32), 0.1),
                      match="dtype differs")


def test_empty_tensor():
    every_rank_raises(lambda r: sparsecomm.allreduce(torch.empty(0), 0.1), match="empty")


def test_unknown_algorithm_and_op():
    every_rank_raises(lambda r: sparsecomm.allreduce(good(r), 0.1, algorithm="nope"),
                      match="unknown algorithm")
    every_rank_raises(lambda r: sparsecomm.allreduce(good(r), 0.1, op="max"),
                      match="op must be 'sum' or 'avg', got 'max'")


def test_state_of_the_wrong_algorithm_or_tensor():
    every_rank_raises(lambda r: sparsecomm.allreduce(good(r), 0.1, algorithm="oktopk",
                                                     state=sparsecomm.DenseState(0.1)),
                      match="OkTopkState")

    def reuse(rank):
        st = sparsecomm.OkTopkState(0.1)
        sparsecomm.allreduce(good(rank), state=st)
        return sparsecomm.allreduce(torch.randn(50), state=st)

    every_rank_raises(reuse, match="one state per tensor")


def test_dead_peer_times_out_naming_the_operation():
    def call(rank):
        if rank == 3:
            return None  # gone: never joins (a rank blocked while holding its turn is
            # test_failures_are_reported's case; here the others must name the collective they wait in)
        return sparsecomm.allreduce(good(rank), 0.1)

    t0 = time.monotonic()
    res = sparsecomm.simulate(P, call, timeout=2, return_exceptions=True)
    assert time.monotonic() - t0 < 10
    # The first rank to time out names the operation and the missing rank; the others
    # either time out too or are released at once by its failure.
    for r in range(3):
        exc = res.results[r]
        assert isinstance(exc, (CommTimeoutError, PeerError))
        assert "timed out" in str(exc) and "allgather" in str(exc) and "[3]" in str(exc)
    assert any(isinstance(res.results[r], CommTimeoutError) for r in range(3))


def test_peer_exception_does_not_hang_others():
    def call(rank):
        if rank == 0:
            raise RuntimeError("boom on rank 0")
        return sparsecomm.allreduce(good(rank), 0.1)

    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="boom on rank 0"):
        sparsecomm.simulate(P, call, timeout=30)
    assert time.monotonic() - t0 < 10


@pytest.mark.parametrize("kwargs, match", [
    ({"density": 0}, "density"), ({"tau": 0}, "tau"), ({"tau_prime": 1.5}, "tau_prime"),
    ({"window": True}, "window"), ({"balance_factor": 0.5}, "balance_factor"),
    ({"count_bounds": (1.2, 2)}, "count_bounds"), ({"error_feedback": "yes"}, "error_feedback"),
])
def test_state_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        sparsecomm.OkTopkState(**kwargs)


def test_a_renamed_setting_works_under_its_old_name_with_a_warning_and_old_checkpoints_load():
    # OkTopkState(bucket=) and TopkDSAState(bucket=) are window= now ("bucket" is DDP's word).
    for cls in (sparsecomm.OkTopkState, sparsecomm.TopkDSAState):
        with pytest.warns(DeprecationWarning, match="is now window="):
            st = cls(0.05, bucket=2)
        assert st.window == 2 and "bucket" not in st.settings()
        with pytest.raises(ValueError, match="window"):
            cls(0.05, bucket=0)
        old = st.__getstate__()
        old["bucket"] = old.pop("window")  # as a checkpoint from before the rename holds it
        back = cls.__new__(cls)
        back.__setstate__(old)
        assert back.window == 2 and back.settings() == st.settings()


def test_state_pickles_with_its_residual():
    def call(rank):
        st = sparsecomm.OkTopkState(0.05, tau=4)
        for _ in range(3):
            sparsecomm.allreduce(good(rank), state=st)
        return st

    st = sparsecomm.simulate(2, call).results[1]
    copy = pickle.loads(pickle.dumps(st))
    assert copy.iteration == 3 and torch.equal(copy.residual, st.residual)
    assert copy.local_threshold == st.local_threshold and torch.equal(copy.boundaries, st.boundaries)


def test_a_sum_that_the_wire_makes_nan_in_a_reusing_call_raises_on_every_rank():
    # fp16 on the wire turns +-1e5 into +-inf, and their sum is NaN: the reused global
    # threshold's counts and its selection must agree about that entry (a mismatch would
    # break the allgatherv), and the call must end in the collective non-finite check.
    def body(rank):
        st = sparsecomm.OkTopkState(0.05, tau=100)
        for step in range(3):
            sparsecomm.allreduce(good(rank + step), state=st, compressor="fp16", op="sum")
        assert st.global_threshold is not None  # the next call reuses it
        g = good(rank + 3)
        g[7] = 1e5 if rank % 2 == 0 else -1e5
        return sparsecomm.allreduce(g, state=st, compressor="fp16", op="sum")

    every_rank_raises(body, match="reduced result overflows", P=2)


def _steady(rank, calls=3, **kwargs):
    """An Ok-Topk state whose next call carries the check in its split (see ``check.CarriedCheck``)."""
    st = sparsecomm.OkTopkState(0.05, **kwargs)
    for step in range(calls):
        sparsecomm.allreduce(good(rank + step), state=st)
    return st


def _fields(st):
    return {name: value for name, value in vars(st).items() if isinstance(value, (int, float, str, type(None)))}


def test_a_call_refused_by_the_check_its_split_carries_leaves_the_state_as_it_was():
    # The carried check runs after the local selection, which moves the state's thresholds:
    # a refusal must leave them as a check made first would, and the residual too.
    def body(rank, refused):
        st = _steady(rank)
        if refused:
            g = good(rank + 9)
            if rank == 1:
                g[7] = math.nan
            err = cases.input_error(sparsecomm.allreduce, g, state=st)
            assert err is not None and "NaN or Inf on rank(s) [1]" in err, err
        fields, residual = _fields(st), st.residual.clone()
        out = sparsecomm.allreduce(good(rank + 10), state=st)
        return fields, residual, out, st.last.events

    refused = sparsecomm.simulate(P, lambda rank: body(rank, True)).results
    never = sparsecomm.simulate(P, lambda rank: body(rank, False)).results
    for (fields, residual, out, events), (want, want_residual, want_out, _) in zip(refused, never):
        assert events.get("check_carried") == 1
        assert fields == want
        torch.testing.assert_close(residual, want_residual, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(out, want_out, rtol=1e-5, atol=1e-5)


def test_ranks_that_run_different_algorithms_while_one_carries_the_check_all_raise():
    def body(rank):
        if rank == 3:
            st = sparsecomm.TopkAState(0.05)
            for step in range(3):
                sparsecomm.allreduce(good(rank + step), state=st)
            return sparsecomm.allreduce(good(rank), state=st)
        return sparsecomm.allreduce(good(rank), state=_steady(rank))

    every_rank_raises(body, match="algorithm differs")


def test_a_rank_whose_state_is_a_step_ahead_raises_with_its_peers_not_a_hang():
    # As if rank 3 loaded another step's checkpoint: its call repartitions (the check comes
    # first), its peers' calls carry the check in the split. Both are the first collective.
    def body(rank):
        st = _steady(rank, tau_prime=4)
        st.iteration += rank == 3
        return sparsecomm.allreduce(good(rank), state=st)

    every_rank_raises(body, match="settings differ across ranks: iteration")


def test_an_error_before_the_carried_check_reaches_every_rank(monkeypatch):
    module = importlib.import_module("sparsecomm.algorithms.oktopk")

    real = module.local_select

    def broken(acc, k, st, *args):
        if getattr(st, "broken", False):
            raise RuntimeError("kernel launch failed")
        return real(acc, k, st, *args)

    monkeypatch.setattr(module, "local_select", broken)

    def body(rank):
        st = _steady(rank)
        st.broken = rank == 2
        return sparsecomm.allreduce(good(rank), state=st)

    errs = every_rank_raises(body, match="rank 2: the algorithm failed before the check")
    assert "kernel launch failed" in str(errs[2])
