"""The group schedules (schedules/groups.py): WFBP and SyncEASGD equal the synchronous calls of their groups."""

from __future__ import annotations

import contextlib

import pytest
import torch

import sparsecomm
from sparsecomm.schedules import MGWFBP, WFBP, SyncEASGD
from sparsecomm.schedules.engine import grads_in

from schedule_cases import MG_FAST, STEPS, loss_of, make_model, make_optimizer, mixed_loss, mixed_model, oktopk_wfbp, run_scheduled, synchronous_reference, train_steps


@pytest.mark.parametrize("kind", ["sgd", "adam"])
@pytest.mark.parametrize("cls", [WFBP, SyncEASGD])
@pytest.mark.parametrize("algorithm,density", [("dense", 1.0), ("oktopk", 0.05), ("topka", 0.1)])
@pytest.mark.parametrize("P,set_to_none", [(1, True), (3, True), (3, False)])
def test_schedule_equals_the_synchronous_calls(P, set_to_none, kind, cls, algorithm, density, monkeypatch):
    from sparsecomm.schedules import groups

    gathered_in_place = []
    monkeypatch.setattr(groups, "grads_in", lambda *a: gathered_in_place.append(grads_in(*a)) or gathered_in_place[-1])

    def body(rank: int):
        got, groups, _ = run_scheduled(rank, kind, cls, algorithm, density, set_to_none)
        want = synchronous_reference(rank, kind, groups, algorithm, density)
        return all(torch.equal(a, b) for a, b in zip(got, want)), got

    out = sparsecomm.simulate(P, body, timeout=60).results
    assert all(same for same, _ in out)
    for _, params in out:  # every rank the same model
        assert all(torch.equal(a, b) for a, b in zip(params, out[0][1]))
    # After a step the gradients are views of the results; zeroed in place, every later step's
    # backward accumulates into them and the gather copies nothing.
    groups = len(list(make_model().parameters())) if cls is WFBP else 1
    assert len(gathered_in_place) == P * STEPS * groups
    assert sum(gathered_in_place) == (0 if set_to_none else P * (STEPS - 1) * groups)


@pytest.mark.parametrize("set_to_none", [True, False])
@pytest.mark.parametrize("cls", [WFBP, SyncEASGD])
def test_accumulated_micro_batches_equal_the_synchronous_calls_on_their_sum(cls, set_to_none):
    # Two micro-batches a step, the first under no_sync(): bit for bit what accumulating both
    # locally and then reducing each group synchronously (one sparsecomm.allreduce) gives.
    def accumulate(model, opt, rank, step, sched=None):
        opt.zero_grad(set_to_none=set_to_none)
        with sched.no_sync() if sched is not None else contextlib.nullcontext():
            loss_of(model, rank, 2 * step).backward()
        loss_of(model, rank, 2 * step + 1).backward()

    def body(rank: int):
        model = make_model()
        opt = make_optimizer("sgd", model.parameters())
        sched = cls(model, opt, algorithm="oktopk", density=0.05)
        for step in range(STEPS):
            accumulate(model, opt, rank, step, sched)
            sched.step()
        groups = [list(g) for g in sched.groups]
        sched.close()
        got = [p.detach().clone() for p in model.parameters()]
        ref = make_model()
        ropt = make_optimizer("sgd", ref.parameters())
        params = list(ref.parameters())
        states = [sparsecomm.registry.get("oktopk").state_class(0.05, error_feedback=True) for _ in groups]
        for step in range(STEPS):
            accumulate(ref, ropt, rank, step)
            for g, st in zip(groups, states):
                layers = sorted(g, reverse=True)
                out = sparsecomm.allreduce(torch.cat([params[i].grad.reshape(-1) for i in layers]), state=st, op="avg")
                offset = 0
                for i in layers:
                    params[i].grad.copy_(out[offset:offset + params[i].numel()].view_as(params[i]))
                    offset += params[i].numel()
            ropt.step()
        return all(torch.equal(a, b.detach()) for a, b in zip(got, params))

    assert sparsecomm.simulate(3, body, timeout=60).results == [True] * 3


@pytest.mark.parametrize("kind", ["sgd", "adam"])
def test_dense_schedules_equal_plain_data_parallel(kind):
    # Plain data parallelism: the averaged gradient of every rank, then the optimizer.
    P = 4

    def body(rank: int):
        results = {}
        for name, cls in (("wfbp", WFBP), ("synceasgd", SyncEASGD), ("mgwfbp", MGWFBP)):
            kw = MG_FAST if name == "mgwfbp" else {}
            results[name] = run_scheduled(rank, kind, cls, "dense", 1.0, **kw)
        model = make_model()
        opt = make_optimizer(kind, model.parameters())
        for step in range(STEPS):
            opt.zero_grad()
            loss_of(model, rank, step).backward()
            for p in model.parameters():
                p.grad.copy_(sparsecomm.allreduce(p.grad, 1.0, algorithm="dense", op="avg"))
            opt.step()
        plain = [p.detach().clone() for p in model.parameters()]
        return {name: r[0] for name, r in results.items()}, plain, results["mgwfbp"][2].plans

    for got, plain, plans in sparsecomm.simulate(P, body, timeout=120).results:
        assert plans >= 1  # MG-WFBP profiled, calibrated and planned during the run
        for name, params in got.items():
            for a, b in zip(params, plain):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6), name


def test_bad_groups_are_refused():
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = SyncEASGD(model, opt, algorithm="dense", density=1.0)
    with pytest.raises(ValueError, match="cover"):
        sched.set_groups([[0, 1]])
    with pytest.raises(ValueError, match="contiguous"):
        sched.set_groups([[0, 2], [1, 3, 4, 5]])
    sched.close()


@pytest.mark.parametrize("cls", [WFBP, SyncEASGD])
def test_synchronize_then_clip_then_step_clips_the_reduced_gradients(cls):
    # As under DDP: synchronize(), clip, optimizer.step(); a step() after synchronize() only steps
    # the optimizer (nothing is reduced twice). The reference: the same groups' synchronous calls.
    def body(rank: int):
        out = {}
        for name in ("scheduled", "reference"):
            model = make_model()
            params = list(model.parameters())
            opt = torch.optim.SGD(params, lr=0.05, momentum=0.9)
            sched = cls(model, opt, algorithm="oktopk", density=0.05) if name == "scheduled" else None
            L = len(params)
            groups = [[i] for i in range(L - 1, -1, -1)] if cls is WFBP else [list(range(L - 1, -1, -1))]
            assert sched is None or sched.groups == groups
            states = [sparsecomm.OkTopkState(0.05) for _ in groups]
            for step in range(4):
                opt.zero_grad(set_to_none=step % 2 == 0)
                loss_of(model, rank, step).backward()
                if sched is not None:
                    sched.synchronize()
                else:
                    for g, st in zip(groups, states):
                        flat = torch.cat([params[i].grad.reshape(-1) for i in g])
                        red = sparsecomm.allreduce(flat, 0.05, state=st, op="avg")
                        for i, r in zip(g, red.split([params[i].numel() for i in g])):
                            params[i].grad.copy_(r.view_as(params[i]))
                torch.nn.utils.clip_grad_norm_(params, 0.1)
                if sched is not None:
                    sched.step()
                else:
                    opt.step()
            if sched is not None:
                out["calls"] = [st.iteration for st in sched._states]
                sched.close()
            out[name] = [p.detach().clone() for p in params]
        return out

    for out in sparsecomm.simulate(2, body, timeout=60).results:
        assert out["calls"] == [4] * len(out["calls"])
        assert all(torch.equal(a, b) for a, b in zip(out["scheduled"], out["reference"]))


@pytest.mark.parametrize("set_to_none", [False, True])
def test_a_gradient_hook_that_changes_a_group_being_read_is_refused(set_to_none):
    # An in-place change after a group was submitted (a post-accumulate hook registered after
    # the schedule's) would race the job (the gradients are views of its buffer) or be lost
    # (they were copied into it).
    def body(rank: int):
        model, opt, sched = oktopk_wfbp()
        train_steps(model, opt, sched, rank, 2, set_to_none=set_to_none)
        first = next(model.parameters())

        def prune(p):
            p.grad.mul_(0.5)

        handle = first.register_post_accumulate_grad_hook(prune)
        opt.zero_grad(set_to_none=set_to_none)
        loss_of(model, rank, 2).backward()
        with pytest.raises(sparsecomm.ScheduleError, match="during backward"):
            sched.step()
        handle.remove()
        sched.close()
        return True

    assert all(sparsecomm.simulate(2, body, timeout=60).results)


@pytest.mark.parametrize("cls", [SyncEASGD, WFBP])
def test_a_group_of_mixed_dtypes_reduces_each_gradient_in_the_widest(cls):
    # One group holding float32 layers and a bfloat16 one: its buffer takes float32 (it took
    # the first gradient's dtype, and the float32 layers were cast to bfloat16 and back).
    def body(rank: int):
        model = mixed_model()
        sched = cls(model, make_optimizer("sgd", model.parameters()), algorithm="dense", density=1.0)
        mixed_loss(model, rank, 0).backward()
        sched.synchronize()
        got = [p.grad.clone() for p in model.parameters()]
        sched.close()
        twin = mixed_model()
        mixed_loss(twin, rank, 0).backward()
        want = [sparsecomm.allreduce(p.grad.float(), 1.0, algorithm="dense", op="avg").to(p.dtype)
                for p in twin.parameters()]
        return got, want

    for got, want in sparsecomm.simulate(2, body).results:
        for g, w in zip(got, want):
            assert g.dtype == w.dtype
            torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-7)
