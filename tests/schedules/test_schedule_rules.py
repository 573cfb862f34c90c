"""Rules every schedule keeps (the Schedule interface): the same bits on every engine, gradients
changed under an allreduce refused, ranks without a backward, refusals, buffers of their own."""

from __future__ import annotations


import pytest
import torch

import sparsecomm
from sparsecomm.schedules import MGWFBP

import engines
from schedule_cases import CASES_PASS, MG_FAST, loss_of, make_model, make_optimizer, mixed_loss, mixed_model, oktopk_wfbp, schedule_case, schedule_cases, train_steps


def test_schedules_in_the_simulated_world():
    assert sparsecomm.simulate(4, schedule_cases, 4, timeout=120).results == [
        {"wfbp": True, "dear": True, "pipesgd": True, "views": True, "dear_skip": True}] * 4


@pytest.mark.slow
@pytest.mark.gloo
def test_schedules_on_gloo():
    assert engines.run_gloo(2, schedule_case) == [CASES_PASS] * 2


@pytest.mark.slow
@pytest.mark.mpi
@pytest.mark.skipif(engines.mpiexec() is None, reason="mpi4py/mpiexec not installed")
def test_schedules_on_mpi(mpi4):
    assert mpi4["schedules"] == [CASES_PASS] * 4


@pytest.mark.parametrize("schedule", ["pipesgd", "wfbp", "synceasgd", "dear"])
def test_results_go_to_buffers_of_their_own_that_the_fused_pass_zeroes(schedule, zero_out_calls):
    # A schedule's result never lands in its own input (Pipe-SGD rotates three buffers, the
    # group schedules and DeAR keep a result buffer per group), so the fused pass may zero the output
    # on its way (kernels.ef_select's zero_out). The references above hold the values; this
    # holds the path.
    zeroing = zero_out_calls
    cls = sparsecomm.schedules.SCHEDULES[schedule]

    def body(rank: int):
        model = make_model()
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        sched = cls(model, opt, algorithm="topka", density=0.05)
        train_steps(model, opt, sched, rank, 6)
        sched.finish()
        sched.close()
        return True

    assert all(sparsecomm.simulate(2, body).results)
    assert zeroing and all(zeroing)  # every fused call (TopkA fuses once its first call set the guide)


@pytest.mark.parametrize("cls", ["WFBP", "SyncEASGD", "MGWFBP", "DeAR"])
def test_gradients_changed_after_their_allreduce_started_are_refused_not_lost(cls):
    # Clipping between backward and step(), or a second backward, would be left out of what was
    # reduced: a ScheduleError says so, once the step is complete (the reduced gradients are in
    # place, every rank made the same calls), and training goes on.
    import sparsecomm.schedules as schedules

    def body(rank: int):
        model = make_model()
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        kw = dict(MG_FAST) if cls == "MGWFBP" else {}
        sched = getattr(schedules, cls)(model, opt, algorithm="oktopk", density=0.05, **kw)
        train_steps(model, opt, sched, rank, 2)
        opt.zero_grad()
        loss_of(model, rank, 2).backward()
        clip = rank == 0  # one rank only: the other must not be left waiting
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
        if clip:
            with pytest.raises(sparsecomm.ScheduleError, match="clip_grad_norm_"):
                sched.step()
        else:
            sched.step()
        if cls == "DeAR":
            sched.synchronize()
        train_steps(model, opt, sched, rank, 2)  # goes on
        opt.zero_grad()
        loss_of(model, rank, 3).backward()
        with pytest.raises(sparsecomm.ScheduleError, match="second backward"):
            loss_of(model, rank, 4).backward()
        sched.close()
        return [p.detach().clone() for p in model.parameters()]

    out = sparsecomm.simulate(2, body, timeout=60).results
    assert all(torch.equal(a, b) for a, b in zip(out[0], out[1]))  # the refused step's result was applied alike


@pytest.mark.parametrize("cls", ["WFBP", "SyncEASGD", "MGWFBP", "DeAR"])
def test_gradients_that_share_one_buffer_are_not_taken_for_changed(cls):
    # Views of one buffer share one version counter: the backward accumulating into later
    # layers' views (a user's flat gradient buffer; a schedule's own views after a regrouping)
    # is no change to a group read earlier. Only the end of backward is compared with step().
    import sparsecomm.schedules as schedules

    def body(rank: int):
        model = make_model()
        params = list(model.parameters())
        flat = torch.zeros(sum(p.numel() for p in params))
        offset = 0
        for p in params:
            p.grad = flat[offset:offset + p.numel()].view_as(p)
            offset += p.numel()
        opt = torch.optim.SGD(params, lr=0.05)
        kw = dict(MG_FAST) if cls == "MGWFBP" else {}
        sched = getattr(schedules, cls)(model, opt, algorithm="oktopk", density=0.05, **kw)
        train_steps(model, opt, sched, rank, 2, set_to_none=False)
        if cls == "MGWFBP":  # its own re-plans and trials regroup it
            train_steps(model, opt, sched, rank, 10, set_to_none=False)
            assert sched.plans >= 1
        elif cls == "DeAR":  # regroup, then back to a group per layer
            sched.synchronize()
            sched.regroup(1 << 30)
            train_steps(model, opt, sched, rank, 2, set_to_none=False)
            sched.synchronize()
            sched.regroup(1)
        else:  # one group (every gradient a view of its result), then a group per layer again
            sched.set_groups([list(range(len(params) - 1, -1, -1))])
            train_steps(model, opt, sched, rank, 2, set_to_none=False)
            sched.set_groups([[i] for i in range(len(params) - 1, -1, -1)])
        train_steps(model, opt, sched, rank, 2, set_to_none=False)
        if cls == "DeAR":
            sched.synchronize()
        groups = len(sched.groups)
        sched.close()
        return groups, [p.detach().clone() for p in params]

    out = sparsecomm.simulate(2, body, timeout=60).results
    assert out[0][0] > 1 or cls == "MGWFBP"
    assert all(torch.equal(a, b) for a, b in zip(out[0][1], out[1][1]))


@pytest.mark.parametrize("explicit", [False, True])
def test_a_rank_without_a_backward_still_takes_part(explicit):
    # A rank with nothing to learn from on one step still calls step() (or synchronize() and
    # the optimizer): it reduces zeros with the others, who would otherwise wait for it.
    def body(rank: int):
        model, opt, sched = oktopk_wfbp()
        for step in range(4):
            opt.zero_grad()
            if not (rank == 1 and step == 2):
                loss_of(model, rank, step).backward()
            if explicit:
                sched.synchronize()
                opt.step()
            else:
                sched.step()
        calls = [st.iteration for st in sched._states]
        sched.close()
        return calls, [p.detach().clone() for p in model.parameters()]

    out = sparsecomm.simulate(2, body, timeout=30).results
    for calls, params in out:
        assert calls == [4] * len(calls)
        assert all(torch.equal(a, b) for a, b in zip(params, out[0][1]))


def test_a_refused_call_leaves_the_schedule_ready_for_the_next_step():
    # NaN gradients on one rank: the allreduce refuses on every rank alike; every job is waited
    # for, the step is dropped, and the next steps go on (no "second backward").
    def body(rank: int):
        model = make_model()
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        sched = MGWFBP(model, opt, algorithm="oktopk", density=0.05, **MG_FAST)
        train_steps(model, opt, sched, rank, 2)
        opt.zero_grad()
        (loss_of(model, rank, 2) * (float("nan") if rank == 1 else 1.0)).backward()
        with pytest.raises(sparsecomm.InputError):
            sched.step()
        train_steps(model, opt, sched, rank, 8)
        sched.close()
        return [p.detach().clone() for p in model.parameters()]

    out = sparsecomm.simulate(2, body, timeout=60).results
    assert all(bool(torch.isfinite(p).all()) for p in out[0])
    assert all(torch.equal(a, b) for a, b in zip(out[0], out[1]))


def test_dear_and_pipesgd_buffers_take_the_widest_dtype():
    from sparsecomm.schedules import DeAR, PipeSGD

    def body(rank: int):
        dtypes = []
        for cls in (PipeSGD, DeAR):
            model = mixed_model(layer=0)  # the first gradient is bfloat16
            sched = cls(model, make_optimizer("sgd", model.parameters()), algorithm="dense", density=1.0)
            for step in range(2):
                mixed_loss(model, rank, step).backward()
                sched.step()
            dtypes.append({b.dtype for b in sched._buffers if b is not None})
            sched.close()
        return dtypes

    for dtypes in sparsecomm.simulate(2, body).results:
        assert dtypes == [{torch.float32}, {torch.float32}], dtypes
