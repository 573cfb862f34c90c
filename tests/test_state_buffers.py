"""Steady-state calls: results into ``out=``, scratch buffers, thresholds that follow drift.

Speed itself is measured in ``benchmarks/test_steady_state.py``; these tests
hold the behaviour the speed rests on.
"""

from __future__ import annotations

import io
import math

import pytest
import torch

import sparsecomm
from sparsecomm.errors import InputError
from sparsecomm.tools.synthetic import drifting

ALGORITHMS = sparsecomm.algorithms()


def grad(rank, step, n=3000):
    return torch.randn(n, generator=torch.Generator().manual_seed(1000 * rank + step))


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("P", [1, 3])
def test_out_receives_exactly_the_result(algorithm, P):
    def body(rank):
        fresh = sparsecomm.registry.get(algorithm).state_class(0.05)
        into = sparsecomm.registry.get(algorithm).state_class(0.05)
        inplace = sparsecomm.registry.get(algorithm).state_class(0.05)
        buf = torch.full((3000,), 7.0)
        rows = []
        for step in range(4):
            g = grad(rank, step)
            want = sparsecomm.allreduce(g, state=fresh, op="avg")
            got = sparsecomm.allreduce(g, state=into, op="avg", out=buf)
            h = g.clone()
            same = sparsecomm.allreduce(h, state=inplace, op="avg", out=h)  # in place
            rows.append((torch.equal(got, want), got is buf, torch.equal(h, want), same is h))
        return rows

    for rows in sparsecomm.simulate(P, body).results:
        assert all(all(r) for r in rows), rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("P", [1, 2, 5])
def test_out_zeroed_by_the_fused_pass_holds_exactly_the_result(algorithm, P, dtype, zero_out_calls):
    # A steady-state call's fused pass zeroes out= on its way, and the sparse result then
    # writes only its entries: out holds NaN before every call and must still end equal
    # to the call without out= (same states, same thresholds, same residuals).
    zeroing = zero_out_calls

    def body(rank):
        cls = sparsecomm.registry.get(algorithm).state_class
        plain, into = cls(0.05, error_feedback=True), cls(0.05, error_feedback=True)
        storage = torch.empty(3001, dtype=dtype)
        out = storage[1:] if P == 2 else storage[:3000]  # P = 2: at an offset, not 32-byte aligned
        same = []
        for _, x in zip(range(12), drifting(rank, 3000)):  # drifting: the thresholds are reused
            x = x.to(dtype)
            want = sparsecomm.allreduce(x, state=plain)
            out.fill_(float("nan"))
            got = sparsecomm.allreduce(x, state=into, out=out)
            same.append(got is out and torch.equal(got, want))
        return same, torch.equal(plain.residual, into.residual)

    for same, residuals in sparsecomm.simulate(P, body).results:
        assert all(same) and residuals, same
    # Every algorithm that selects in its accumulating pass took the zeroing path (CLT-k's
    # selection is the leader's alone, over all n, and two-level Ok-Topk's the node's sum's,
    # after its reduce-scatter: their passes only accumulate).
    if algorithm not in ("dense", "gaussiank", "cltk", "oktopk2l"):
        assert any(zeroing)


def test_out_that_does_not_fit_is_bad_input_on_every_rank():
    def body(rank):
        out = torch.empty(11 if rank == 1 else 10)
        try:
            sparsecomm.allreduce(torch.randn(10), 0.5, out=out)
        except InputError as exc:
            return str(exc)
        return "accepted"

    for msg in sparsecomm.simulate(3, body, timeout=5).results:
        assert "out= does not fit the tensor" in msg, msg


@pytest.mark.parametrize("algorithm", ["oktopk", "topkdsa", "topka", "gaussiank"])
def test_scratch_buffers_are_left_all_zero_and_stay_out_of_checkpoints(algorithm):
    def body(rank):
        st = sparsecomm.registry.get(algorithm).state_class(0.05)
        for step in range(3):
            sparsecomm.allreduce(grad(rank, step), state=st)
        scratch = dict(st.pool.scratch_buffers)
        buf = io.BytesIO()
        torch.save(st, buf)
        buf.seek(0)
        loaded = torch.load(buf)
        # The restored state makes its own scratch and continues identically.
        a = sparsecomm.allreduce(grad(rank, 9), state=st)
        b = sparsecomm.allreduce(grad(rank, 9), state=loaded)
        return scratch, "_pool" in loaded.__dict__, torch.equal(a, b)

    # Above MERGE_MAX_P ranks a region's parts go through the region-sized scratch accumulator.
    from sparsecomm.algorithms.exchange import MERGE_MAX_P

    for scratch, _, same in sparsecomm.simulate(MERGE_MAX_P + 1, body).results:
        assert scratch, "the algorithm used no scratch buffer"
        assert all(int(torch.count_nonzero(b)) == 0 for b in scratch.values())
        assert same


@pytest.mark.parametrize("P", [1, 3])
def test_dense_reuses_its_sum_buffer_and_hands_users_their_own_tensors(P):
    # A steady-state dense call reduces into a buffer its state keeps (no n-sized allocation);
    # what sparse_allreduce returns must still be the caller's: not that buffer (rewritten next
    # call) nor the residual (zeroed by the update), and checkpoints leave the buffer out.
    def body(rank):
        st = sparsecomm.DenseState(error_feedback=True)
        sums, sents, bufs = [], [], []
        for step in range(3):
            g = grad(rank, step)
            res = sparsecomm.sparse_allreduce(g, state=st)
            sums.append(res.values)
            sents.append(res.sent)
            bufs.append(st.buffers())
            assert float(st.residual.abs().max()) == 0.0  # everything was sent
        out = torch.empty(3000)
        first = sparsecomm.allreduce(grad(rank, 5), state=st, out=out)
        buf = io.BytesIO()
        torch.save(st, buf)
        buf.seek(0)
        return sums, sents, bufs, first is out, "_workspace" in torch.load(buf).__dict__

    for rank, (sums, sents, bufs, into_out, saved) in enumerate(sparsecomm.simulate(P, body).results):
        for step in range(3):
            want = sum(grad(r, step) for r in range(P))
            torch.testing.assert_close(sums[step], want)  # unchanged by the later calls
            assert torch.equal(sents[step], grad(rank, step))
        if P > 1:
            assert bufs[1] and all(a is b for a, b in zip(bufs[1], bufs[2]))  # the same buffer
        assert into_out and not saved  # the buffer is not in the checkpoint


def test_reused_threshold_follows_drift_without_corrections():
    """The steady-state benchmark's workload: x = 0.9 x + 0.1 randn each step, error feedback on."""
    n, density, tau, steps, warmup = 200_000, 0.01, 32, 30, 15

    def body(rank):
        st = sparsecomm.OkTopkState(density, tau=tau, tau_prime=64)
        rows = []
        for _, x in zip(range(steps), drifting(rank, n)):
            sparsecomm.allreduce(x, state=st)
            rows.append((st.last.local_selected, dict(st.last.events)))
        return rows

    k = math.ceil(density * n)
    for rows in sparsecomm.simulate(2, body).results:
        settled = rows[warmup:]
        for selected, events in settled:
            assert 2 * k / 3 <= selected <= 4 * k / 3, (selected, k)
            # No correction and no exact selection between the tau-periodic re-evaluations.
            assert not {"local_corrected", "local_overflowed", "local_under"} & events.keys(), events
            assert "local_recomputed" not in events


@pytest.mark.parametrize("algorithm", ["oktopk", "topka", "gtopk", "topkdsa"])
def test_fused_pass_is_the_finite_check(algorithm, monkeypatch):
    # A steady-state call reads the gradient once: the fused pass's output settles that it
    # is finite, so the separate check (a whole read of the tensor) must not run.
    from sparsecomm import check

    reads, overflowed = [], []
    real = check.all_finite
    monkeypatch.setattr(check, "all_finite", lambda t: reads.append(t.numel()) or real(t))
    counted_result = sparsecomm.state.Compensated.counted.__func__

    def spy_counted(cls, acc, sel, capacity, out_zeroed=False, rungs=None, threshold=None):
        overflowed.append(sel.count > capacity)  # the buffer cannot tell: the check must read
        return counted_result(cls, acc, sel, capacity, out_zeroed, rungs, threshold)

    monkeypatch.setattr(sparsecomm.state.Compensated, "counted", classmethod(spy_counted))

    def body(rank):
        st = sparsecomm.registry.get(algorithm).state_class(0.05, error_feedback=True)
        fused = 0
        for step in range(6):
            fused += st.fuses_next()
            sparsecomm.allreduce(grad(rank, step), state=st)
        return fused

    fused = sparsecomm.simulate(2, body).results
    assert all(f >= 4 for f in fused), fused
    # Only the calls that were not fused, or whose candidate buffer overflowed, read it.
    assert len(reads) == 2 * (6 - fused[0]) + sum(overflowed), (reads, overflowed)
    assert sum(overflowed) < len(overflowed) / 2


@pytest.mark.parametrize("values_dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("scale", [1.0, 0.5, 1 / 3, -1 / 7])
def test_a_dense_result_scales_into_out_and_checks_its_extremes_with_the_old_bits(values_dtype, dtype, scale):
    # to_dense(out=) multiplies straight into out, and count_nonfinite scales only the two
    # extremes (no n-sized temporary for op="avg"): the bits and the counts of the old way,
    # the product in at least float32, then the cast.
    from sparsecomm.result import SparseResult
    from sparsecomm.state import CallStats

    v = (torch.randn(10_007, generator=torch.Generator().manual_seed(3)) * 1000).to(values_dtype)
    v[5], v[9] = 7e4, -1e5  # beyond float16 once scaled by 1 or 1/2, within it by 1/3 and 1/7

    def result(values):
        return SparseResult(n=values.numel(), indexes=None, values=values, contributed=None, sent=None,
                            stats=CallStats())

    def old(values):
        return values.to(torch.promote_types(values.dtype, torch.float32)) * scale

    res = result(v)
    assert torch.equal(res.to_dense(dtype, scale, out=torch.empty(v.numel(), dtype=dtype)), old(v).to(dtype))
    assert torch.equal(res.to_dense(dtype, scale), old(v).to(dtype))
    assert res.count_nonfinite(dtype, scale) == int((~torch.isfinite(old(v).to(dtype))).sum())
    v[11] = float("nan")
    assert result(v).count_nonfinite(dtype, scale) == int((~torch.isfinite(old(v).to(dtype))).sum())


def test_a_state_whose_compensate_predates_zero_out_still_takes_out():
    # A user's State subclass written against compensate(self, flat) must keep working with
    # out=: the call then simply does not zero out in its pass.
    class Mine(sparsecomm.TopkAState):
        def compensate(self, flat):
            return super().compensate(flat)

    mine, plain = Mine(0.05, error_feedback=True), sparsecomm.TopkAState(0.05, error_feedback=True)
    out = torch.empty(3000)
    for step in range(5):
        g = grad(0, step)
        out.fill_(float("nan"))
        assert torch.equal(sparsecomm.allreduce(g, state=mine, out=out), sparsecomm.allreduce(g, state=plain))


def _drifting(rank, steps, n=3000):
    return (x for _, x in zip(range(steps), drifting(rank, n)))


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("P", [1, 3])
def test_plain_call_reuses_two_buffers_and_never_overwrites_a_live_result(algorithm, P):
    # The usual loop: `out = allreduce(g, state=s)` keeps the previous result alive through
    # the call, so two buffers serve it; results a caller still holds (the tensor, a view
    # of it, a .grad set to it) are never written again, and every result equals the out=
    # call's of a twin state.
    def body(rank):
        cls = sparsecomm.registry.get(algorithm).state_class
        plain, twin = cls(0.05, error_feedback=True), cls(0.05, error_feedback=True)
        into = torch.empty(3000)
        ptrs, kept, wanted, same = set(), [], [], []
        param = torch.nn.Parameter(torch.zeros(3000))
        for step, x in enumerate(_drifting(rank, 12)):
            out = sparsecomm.allreduce(x, state=plain)
            want = sparsecomm.allreduce(x, state=twin, out=into).clone()
            same.append(torch.equal(out, want))
            if step < 8:
                ptrs.add(out.data_ptr())
            if step == 8:
                kept.append(out.view(30, 100)), wanted.append(want.view(30, 100))  # a view held
            if step == 9:
                param.grad = out  # held as a gradient
                wanted.append(want)
        held = [torch.equal(k, w) for k, w in zip(kept + [param.grad], wanted)]
        return same, held, len(ptrs)

    for same, held, buffers in sparsecomm.simulate(P, body).results:
        assert all(same) and all(held), (same, held)
        assert buffers == 2, buffers  # the loop alone: two buffers, taken in turn


def test_plain_call_buffer_is_free_again_once_every_view_is_gone():
    state = sparsecomm.OkTopkState(0.05, error_feedback=True)
    xs = list(_drifting(0, 6))
    first = sparsecomm.allreduce(xs[0], state=state)
    ptr, view = first.data_ptr(), first.view(3, 1000)
    del first
    second = sparsecomm.allreduce(xs[1], state=state)
    assert second.data_ptr() != ptr  # the view still reads the first buffer
    del view, second
    third = sparsecomm.allreduce(xs[2], state=state)
    assert third.data_ptr() == ptr  # nothing refers to it now: taken again, not a fresh tensor
    arr = third.numpy()  # a NumPy array of the result holds it too
    del third
    assert sparsecomm.allreduce(xs[3], state=state).data_ptr() != ptr
    del arr
    # Buffers are transient: a checkpoint carries none of them.
    buf = io.BytesIO()
    torch.save(state, buf)
    assert "_pool" not in torch.load(io.BytesIO(buf.getvalue()), weights_only=True).__dict__


def test_plain_split_call_holds_its_buffer_until_finished():
    a, b = sparsecomm.OkTopkState(0.05, error_feedback=True), sparsecomm.OkTopkState(0.05, error_feedback=True)
    for x in _drifting(0, 6):
        pending = sparsecomm.begin_allreduce(x, state=a)
        other = sparsecomm.allreduce(x + 1, state=sparsecomm.OkTopkState(0.05))  # a stateless call between
        got = pending.finish()
        assert torch.equal(got, sparsecomm.allreduce(x, state=b)) and other.data_ptr() != got.data_ptr()


def test_plain_call_buffer_is_not_reused_while_a_storage_or_another_process_holds_it():
    state = sparsecomm.OkTopkState(0.05, error_feedback=True)
    xs = list(_drifting(0, 8))
    first = sparsecomm.allreduce(xs[0], state=state)
    storage, snap = first.untyped_storage(), first.clone()  # a storage object, no tensor
    del first
    for x in xs[1:4]:
        sparsecomm.allreduce(x, state=state)
    assert torch.equal(torch.empty(0).set_(storage), snap)
    del storage
    # Sent to another process (shared memory): that process's reads count nowhere here,
    # so the buffer leaves the set for good.
    shared = sparsecomm.allreduce(xs[4], state=state).share_memory_()
    ptr = shared.data_ptr()
    del shared
    assert all(sparsecomm.allreduce(x, state=state).data_ptr() != ptr for x in xs[5:])


def test_plain_call_under_inference_mode_leaves_no_inference_tensor_behind():
    state = sparsecomm.OkTopkState(0.05, error_feedback=True)
    xs = list(_drifting(0, 4))
    with torch.inference_mode():
        assert sparsecomm.allreduce(xs[0], state=state).is_inference()
    out = sparsecomm.allreduce(xs[1], state=state)
    assert not out.is_inference()
    out.mul_(0.5)  # an inference tensor refuses this outside inference mode
    w = torch.ones(3000, requires_grad=True)
    (out * w).sum().backward()


def test_plain_call_with_a_state_of_the_wrong_kind_is_bad_input():
    with pytest.raises(InputError, match="OkTopkState"):
        sparsecomm.allreduce(torch.randn(100), algorithm="oktopk", state="not a state")
