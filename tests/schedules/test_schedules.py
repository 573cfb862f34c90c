"""Every schedule around a model and an optimizer: exact, on the simulated world, gloo and MPI."""

from __future__ import annotations

import contextlib
import inspect

import pytest
import torch

import sparsecomm
from sparsecomm.schedules import MGWFBP, WFBP, SyncEASGD
from sparsecomm.schedules.engine import grads_in

import engines

STEPS = 5
MG_FAST = {"profile_steps": 2, "calibration_sizes": (64, 4096), "calibration_rounds": 1}


def _model() -> torch.nn.Module:
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64),
                                   torch.nn.ReLU(), torch.nn.Linear(64, 10))


def _optimizer(kind: str, params):
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    return torch.optim.Adam(params, lr=0.01)


def _loss(model, rank: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * rank + step)
    x, y = torch.randn(16, 20, generator=g), torch.randint(0, 10, (16,), generator=g)
    return torch.nn.functional.cross_entropy(model(x), y)


def _train(model, opt, sched, rank: int, steps: int = STEPS, set_to_none: bool = True) -> None:
    """``steps`` steps of the test loss under ``sched`` (its ``step()`` ends each).

    ``set_to_none=False``: gradients are zeroed in place (Pipe-SGD's backward then accumulates
    into its gather buffer: the gradients are views of the last result).
    """
    for step in range(steps):
        opt.zero_grad(set_to_none=set_to_none)
        _loss(model, rank, step).backward()
        sched.step()


def _reference(rank: int, kind: str, groups, algorithm: str, density: float,
               as_given: bool = False, compressor=None) -> list[torch.Tensor]:
    """The same groups reduced synchronously, one sparsecomm.allreduce each, in order.

    A group's layers are laid out last first (as GroupSchedule does), or ``as_given``
    (DeAR: forward order). The layout matters bit for bit: it moves Ok-Topk's regions,
    so sums are added in another order.
    """
    model = _model()
    opt = _optimizer(kind, model.parameters())
    params = list(model.parameters())
    states = [sparsecomm.registry.get(algorithm).state_class(density, error_feedback=True)
              if algorithm != "dense" else sparsecomm.DenseState() for _ in groups]
    for step in range(STEPS):
        opt.zero_grad()
        _loss(model, rank, step).backward()
        for g, st in zip(groups, states):
            layers = list(g) if as_given else sorted(g, reverse=True)
            flat = torch.cat([params[i].grad.reshape(-1) for i in layers])
            out = sparsecomm.allreduce(flat, density, algorithm=algorithm, state=st, op="avg",
                                       compressor=compressor)
            offset = 0
            for i in layers:
                params[i].grad.copy_(out[offset:offset + params[i].numel()].view_as(params[i]))
                offset += params[i].numel()
        opt.step()
    return [p.detach().clone() for p in params]


def _scheduled(rank: int, kind: str, cls, algorithm: str, density: float, set_to_none: bool = True, **kw):
    model = _model()
    opt = _optimizer(kind, model.parameters())
    sched = cls(model, opt, algorithm=algorithm, density=density, **kw)
    _train(model, opt, sched, rank, set_to_none=set_to_none)
    groups = [list(g) for g in sched.groups]
    sched.close()
    return [p.detach().clone() for p in model.parameters()], groups, sched


@pytest.mark.parametrize("kind", ["sgd", "adam"])
@pytest.mark.parametrize("cls", [WFBP, SyncEASGD])
@pytest.mark.parametrize("algorithm,density", [("dense", 1.0), ("oktopk", 0.05), ("topka", 0.1)])
@pytest.mark.parametrize("P,set_to_none", [(1, True), (3, True), (3, False)])
def test_schedule_equals_the_synchronous_calls(P, set_to_none, kind, cls, algorithm, density, monkeypatch):
    from sparsecomm.schedules import groups

    gathered_in_place = []
    monkeypatch.setattr(groups, "grads_in", lambda *a: gathered_in_place.append(grads_in(*a)) or gathered_in_place[-1])

    def body(rank: int):
        got, groups, _ = _scheduled(rank, kind, cls, algorithm, density, set_to_none)
        want = _reference(rank, kind, groups, algorithm, density)
        return all(torch.equal(a, b) for a, b in zip(got, want)), got

    out = sparsecomm.simulate(P, body, timeout=60).results
    assert all(same for same, _ in out)
    for _, params in out:  # every rank the same model
        assert all(torch.equal(a, b) for a, b in zip(params, out[0][1]))
    # After a step the gradients are views of the results; zeroed in place, every later step's
    # backward accumulates into them and the gather copies nothing.
    groups = len(list(_model().parameters())) if cls is WFBP else 1
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
            _loss(model, rank, 2 * step).backward()
        _loss(model, rank, 2 * step + 1).backward()

    def body(rank: int):
        model = _model()
        opt = _optimizer("sgd", model.parameters())
        sched = cls(model, opt, algorithm="oktopk", density=0.05)
        for step in range(STEPS):
            accumulate(model, opt, rank, step, sched)
            sched.step()
        groups = [list(g) for g in sched.groups]
        sched.close()
        got = [p.detach().clone() for p in model.parameters()]
        ref = _model()
        ropt = _optimizer("sgd", ref.parameters())
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
            results[name] = _scheduled(rank, kind, cls, "dense", 1.0, **kw)
        model = _model()
        opt = _optimizer(kind, model.parameters())
        for step in range(STEPS):
            opt.zero_grad()
            _loss(model, rank, step).backward()
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


def test_mgwfbp_plans_every_rank_alike_and_groups_are_contiguous():
    def body(rank: int):
        _, groups, sched = _scheduled(rank, "sgd", MGWFBP, "oktopk", 0.05, profile_steps=2,
                                      calibration_sizes=(256, 8192), calibration_rounds=1)
        return groups, sched.a, sched.b, sched.backward_times

    out = sparsecomm.simulate(3, body, timeout=120).results
    for groups, a, b, times in out:
        assert groups == out[0][0] and times == out[0][3]
        assert a is not None and b is not None and a >= 0 and b >= 0
        assert sorted(i for g in groups for i in g) == list(range(6))


def test_bad_groups_are_refused():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = SyncEASGD(model, opt, algorithm="dense", density=1.0)
    with pytest.raises(ValueError, match="cover"):
        sched.set_groups([[0, 1]])
    with pytest.raises(ValueError, match="contiguous"):
        sched.set_groups([[0, 2], [1, 3, 4, 5]])
    sched.close()


#: What :func:`schedule_cases` returns on every rank.
CASES_PASS = {"wfbp": True, "dear": True, "pipesgd": True, "views": True, "dear_skip": True}


def schedule_cases(rank: int, size: int) -> dict[str, bool]:
    """Ok-Topk under WFBP, DeAR (halves apart), Pipe-SGD, SyncEASGD with gradient views and DeAR
    with a skipped layer, each against its reference, on whatever world this runs in (the gloo
    and MPI tests, and the simulated world)."""
    from sparsecomm.schedules import PipeSGD

    torch.set_num_threads(1)
    out = {}
    got, groups, _ = _scheduled(rank, "adam", WFBP, "oktopk", 0.05)
    out["wfbp"] = all(torch.equal(a, b) for a, b in zip(got, _reference(rank, "adam", groups, "oktopk", 0.05)))
    got, groups = _dear_run(rank, "sgd", "oktopk", 0.05, 5_000)
    want = _reference(rank, "sgd", groups, "oktopk", 0.05, as_given=True)
    out["dear"] = all(torch.equal(a, b) for a, b in zip(got, want))
    model = _model()
    opt = _optimizer("sgd", model.parameters())
    sched = PipeSGD(model, opt, warmup_steps=1, algorithm="oktopk", density=0.05)
    _train(model, opt, sched, rank)
    sched.flush()
    sched.close()
    want = _stale_reference(rank, "sgd", "oktopk", 0.05, None, 1, STEPS)
    out["pipesgd"] = all(torch.equal(p.detach(), b) for p, b in zip(model.parameters(), want))
    # The gradients as views of the results, the backward accumulating into them.
    got, groups, _ = _scheduled(rank, "sgd", SyncEASGD, "oktopk", 0.05, set_to_none=False)
    out["views"] = all(torch.equal(a, b) for a, b in zip(got, _reference(rank, "sgd", groups, "oktopk", 0.05)))
    # DeAR with a layer skipped on some steps, on some ranks.
    skip = _dear_skip_run(rank, "oktopk", 0.05)
    out["dear_skip"] = all(torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(skip["dear"], skip["plain"]))
    return out


def _schedule_case(rank, size):
    return schedule_cases(rank, size)


def test_schedules_in_the_simulated_world():
    assert sparsecomm.simulate(4, schedule_cases, 4, timeout=120).results == [
        {"wfbp": True, "dear": True, "pipesgd": True, "views": True, "dear_skip": True}] * 4


@pytest.mark.slow
@pytest.mark.gloo
def test_schedules_on_gloo():
    assert engines.run_gloo(2, _schedule_case) == [CASES_PASS] * 2


@pytest.mark.slow
@pytest.mark.mpi
@pytest.mark.skipif(engines.mpiexec() is None, reason="mpi4py/mpiexec not installed")
def test_schedules_on_mpi():
    assert engines.run_mpi(4, "schedules") == [CASES_PASS] * 4


def test_mgwfbp_fits_from_its_own_jobs_or_else_calibrates():
    def body(rank: int):
        found = {}
        for name, make in (("jobs", _model),  # layers of several sizes: the fit uses the jobs' times
                           ("probe", lambda: torch.nn.Sequential(*[torch.nn.Linear(32, 32, bias=False)
                                                                   for _ in range(4)]))):
            with torch.random.fork_rng():
                torch.manual_seed(0)
                model = make()
            opt = torch.optim.SGD(model.parameters(), lr=0.01)
            sched = MGWFBP(model, opt, algorithm="oktopk", density=0.05, profile_steps=2,
                           calibration_sizes=(100, 5000), calibration_rounds=1)
            probed = []
            real = sched.calibrate
            sched.calibrate = lambda: probed.append(True) or real()
            for step in range(4):
                opt.zero_grad()
                x = torch.randn(8, 20 if name == "jobs" else 32, generator=torch.Generator().manual_seed(step))
                model(x).square().mean().backward()
                sched.step()
            found[name] = (sched.plans, bool(probed), len(sched._fit_points))
            sched.close()
        return found

    for found in sparsecomm.simulate(2, body, timeout=60).results:
        assert found["jobs"][0] == 1 and not found["jobs"][1] and found["jobs"][2] == 6
        assert found["probe"][0] == 1 and found["probe"][1]


def test_mgwfbp_replans_on_every_rank_when_one_rank_drifts():
    # Rank 0's backward becomes 20x slower after the first plan: the ranks agree on the
    # profile first, so both re-plan (a rank deciding alone would strand the other).
    def body(rank: int):
        model = _model()
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        sched = MGWFBP(model, opt, algorithm="dense", density=1.0, profile_steps=2, verify=False)
        # Synthetic profiles: measured ones in the simulated world include the ranks' turn-taking,
        # noise that could hide (or fake) the drift.
        sched._layer_times = lambda: [(0.02 if rank == 0 and sched.plans else 0.001)] * 6
        for step in range(9):
            opt.zero_grad()
            _loss(model, rank, step).backward()
            sched.step()
        out = sched.plans, [list(g) for g in sched.groups], sched.backward_times
        sched.close()
        return out

    out = sparsecomm.simulate(2, body, timeout=30).results
    assert out[0] == out[1] and out[0][0] >= 2


def test_mgwfbp_keeps_one_group_when_its_plan_measures_slower_and_moves_every_residual():
    # The model (synthetic backward times) plans several groups; the synthetic step clock says
    # they take twice one group's step. The ranks agree, keep one group, and no residual is lost.
    def body(rank: int):
        model = _model()
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        sched = MGWFBP(model, opt, algorithm="oktopk", density=0.05, profile_steps=2)
        # Backward runs slower under one group than it was profiled under WFBP: no drift for
        # that alone (it is the baseline once kept), so no second plan.
        sched._layer_times = lambda: [0.02 if len(sched.groups) == 1 else 0.01] * 6
        sched.a, sched.b = 1e-4, 1e-9  # cheap allreduces: the optimum overlaps, several groups
        sched._fit_points = [(1, 1e-4), (10**6, 1e-3 + 1e-4)]
        clock = [0.0]

        def now() -> float:
            clock[0] += 2.0 if len(sched.groups) > 1 else 1.0
            return clock[0]

        sched._now = now
        moved = []
        set_groups = sched.set_groups

        def watched(groups):  # every switch must carry every layer's residual over, bit for bit
            before = sched._layer_residuals()
            set_groups(groups)
            after = sched._layer_residuals()
            moved.append(len(before) == 6 and before.keys() == after.keys()
                         and all(torch.equal(before[i], after[i]) for i in before))

        sched.set_groups = watched
        for step in range(18):
            opt.zero_grad()
            _loss(model, rank, step).backward()
            sched.step()
        out = sched.plans, [list(g) for g in sched.groups], [(len(g), t) for g, t in sched.trials], moved
        sched.close()
        return out

    out = sparsecomm.simulate(2, body, timeout=60).results
    assert out[0] == out[1]
    plans, groups, trials, moved = out[0]
    assert plans == 1 and groups == [list(range(5, -1, -1))]
    assert len(trials) == 2 and trials[0][0] > 1 and trials[1] == (1, 1.0) and trials[0][1] == 2.0
    assert moved == [True, True]  # WFBP -> the plan -> one group (the last candidate stays)


# ---- Pipe-SGD ---------------------------------------------------------------------------
def _stale_reference(rank: int, kind: str, algorithm: str, density: float, compressor, warmup: int,
                     steps: int) -> list[torch.Tensor]:
    """Hand-written one-step-stale SGD: step t (t >= warmup) applies the sum of step t-1."""
    model = _model()
    opt = _optimizer(kind, model.parameters())
    params = list(model.parameters())
    st = sparsecomm.registry.get(algorithm).state_class(density, error_feedback=True) \
        if algorithm != "dense" else sparsecomm.registry.get("dense").state_class(1.0)

    def apply(flat):
        offset = 0
        for p in params:
            p.grad.copy_(flat[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
        opt.step()

    previous = None
    for step in range(steps):
        opt.zero_grad()
        _loss(model, rank, step).backward()
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        out = sparsecomm.allreduce(flat, state=st, op="avg", compressor=compressor)
        if step < warmup:
            apply(out)
            continue
        if previous is not None:
            apply(previous)
        previous = out
    if previous is not None:
        apply(previous)
    return [p.detach().clone() for p in params]


@pytest.mark.parametrize("kind", ["sgd", "adam"])
@pytest.mark.parametrize("algorithm,density,compressor", [("dense", 1.0, None), ("oktopk", 0.05, None),
                                                          ("topka", 0.1, "q8"), ("dense", 1.0, "q4")])
@pytest.mark.parametrize("P,warmup,set_to_none", [(1, 0, True), (3, 2, True), (3, 2, False), (2, 0, False)])
def test_pipesgd_equals_a_one_step_stale_reference(P, warmup, set_to_none, kind, algorithm, density, compressor,
                                                    monkeypatch):
    from sparsecomm.schedules import PipeSGD, pipesgd

    gathered_in_place = []
    monkeypatch.setattr(pipesgd, "grads_in", lambda *a: gathered_in_place.append(grads_in(*a)) or gathered_in_place[-1])

    def body(rank: int):
        model = _model()
        opt = _optimizer(kind, model.parameters())
        sched = PipeSGD(model, opt, warmup_steps=warmup, algorithm=algorithm, density=density,
                        compressor=compressor)
        _train(model, opt, sched, rank, STEPS + 1, set_to_none=set_to_none)
        # The gradients are views of the last result, the next step's gather buffer.
        assert grads_in(sched.params, sched._buffers[sched.step_count % 3])
        sched.flush()
        sched.close()
        got = [p.detach().clone() for p in model.parameters()]
        want = _stale_reference(rank, kind, algorithm, density, compressor, warmup, STEPS + 1)
        return all(torch.equal(a, b) for a, b in zip(got, want))

    assert all(sparsecomm.simulate(P, body, timeout=60).results)
    # Zeroed in place, steps max(warmup, 1) + 1 .. STEPS find the gradients in their buffer
    # (the first two of a run without warm-up have fresh ones, the first pipelined step the
    # warm-up's last result).
    assert sum(gathered_in_place) == (P * (STEPS - max(warmup, 1)) if not set_to_none else 0)


@pytest.mark.parametrize("schedule", ["pipesgd", "wfbp", "synceasgd", "dear"])
def test_results_go_to_buffers_of_their_own_that_the_fused_pass_zeroes(schedule, zero_out_calls):
    # A schedule's result never lands in its own input (Pipe-SGD rotates three buffers, the
    # group schedules and DeAR keep a result buffer per group), so the fused pass may zero the output
    # on its way (kernels.ef_select's zero_out). The references above hold the values; this
    # holds the path.
    zeroing = zero_out_calls
    cls = sparsecomm.schedules.SCHEDULES[schedule]

    def body(rank: int):
        model = _model()
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        sched = cls(model, opt, algorithm="topka", density=0.05)
        _train(model, opt, sched, rank, 6)
        sched.finish()
        sched.close()
        return True

    assert all(sparsecomm.simulate(2, body).results)
    assert zeroing and all(zeroing)  # every fused call (TopkA fuses once its first call set the guide)


def test_pipesgd_checkpoint_keeps_the_gradient_in_flight():
    import io

    from sparsecomm.schedules import PipeSGD

    def run(rank: int, resume_at: int | None):
        model = _model()
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        sched = PipeSGD(model, opt, algorithm="oktopk", density=0.05)
        for step in range(6):
            if step == resume_at:  # save everything, rebuild from scratch, load
                blob = io.BytesIO()
                torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict()},
                           blob)
                sched.close()
                blob.seek(0)
                saved = torch.load(blob, weights_only=False)
                model = _model()
                model.load_state_dict(saved["model"])
                opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
                opt.load_state_dict(saved["opt"])
                sched = PipeSGD(model, opt, algorithm="oktopk", density=0.05)
                sched.load_state_dict(saved["sched"])
                assert saved["sched"]["in_flight"] is not None
            opt.zero_grad()
            _loss(model, rank, step).backward()
            sched.step()
        sched.flush()
        sched.close()
        return [p.detach().clone() for p in model.parameters()]

    def body(rank: int):
        straight, resumed = run(rank, None), run(rank, 3)
        return all(torch.equal(a, b) for a, b in zip(straight, resumed))

    assert all(sparsecomm.simulate(2, body, timeout=60).results)


# ---- DeAR -------------------------------------------------------------------------------
def _dear_run(rank: int, kind: str, algorithm: str, density: float, buffer_bytes: int, compressor=None,
              set_to_none: bool = True):
    from sparsecomm.schedules import DeAR

    model = _model()
    opt = _optimizer(kind, model.parameters())
    sched = DeAR(model, opt, algorithm=algorithm, density=density, buffer_bytes=buffer_bytes,
                 compressor=compressor)
    index = {id(p): i for i, p in enumerate(model.parameters())}
    groups = [[index[id(p)] for p in ps] for ps in reversed(sched.params)]  # reduction order
    _train(model, opt, sched, rank, set_to_none=set_to_none)
    sched.synchronize()
    sched.close()
    return [p.detach().clone() for p in model.parameters()], groups


@pytest.mark.parametrize("kind", ["sgd", "adam"])
@pytest.mark.parametrize("P", [1, 3, 4])
def test_dear_dense_equals_plain_data_parallel(P, kind):
    def body(rank: int):
        got, groups = _dear_run(rank, kind, "dense", 1.0, 5_000)  # a group per layer
        want = _reference(rank, kind, [list(range(6))], "dense", 1.0)
        return got, want, len(groups)

    for got, want, n_groups in sparsecomm.simulate(P, body, timeout=60).results:
        assert n_groups == 3
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", ["sgd", "adam"])
@pytest.mark.parametrize("algorithm,density,compressor", [
    ("oktopk", 0.05, None), ("oktopk", 0.05, "q8"), ("topkdsa", 0.05, None),  # halves apart
    ("dense", 1.0, "q8"), ("topka", 0.1, None)])  # dense q8: halves apart; TopkA: whole in backward
@pytest.mark.parametrize("set_to_none", [True, False])
def test_dear_sparse_equals_the_synchronous_calls_of_its_groups(kind, algorithm, density, compressor, set_to_none):
    def body(rank: int):
        got, groups = _dear_run(rank, kind, algorithm, density, 5_000, compressor, set_to_none)
        want = _reference(rank, kind, groups, algorithm, density, as_given=True, compressor=compressor)
        return all(torch.equal(a, b) for a, b in zip(got, want))

    assert all(sparsecomm.simulate(3, body, timeout=60).results)


def test_dear_updates_wait_for_the_next_forward():
    from sparsecomm.schedules import DeAR

    def body(rank: int):
        model = _model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        sched = DeAR(model, opt, algorithm="dense", buffer_bytes=16_000)
        before = [p.detach().clone() for p in model.parameters()]
        _loss(model, rank, 0).backward()
        sched.step()
        unchanged = all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
        sched.synchronize()
        changed = all(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
        sched.close()
        return unchanged and changed

    assert all(sparsecomm.simulate(2, body, timeout=30).results)


@pytest.mark.parametrize("algorithm,halves", [("oktopk", True), ("topkdsa", True), ("dense", True),
                                              ("topka", False)])
def test_dear_gathers_in_the_next_forward(algorithm, halves, monkeypatch):
    """Algorithms with two halves send their gather in the second phase (queued by step(),
    applied in the next forward); the others send everything in backward's first phase."""
    from sparsecomm.pipeline import Pending
    from sparsecomm.schedules import DeAR

    finish, seconds = Pending.finish, []

    def spy(self):  # runs on the engine's thread, the only user of its communicator
        comm = self._started.call.comm
        before = comm.stats.bytes_sent
        out = finish(self)
        seconds.append((self.split, comm.stats.bytes_sent - before))
        return out

    monkeypatch.setattr(Pending, "finish", spy)

    def body(rank: int):
        model = _model()
        sched = DeAR(model, torch.optim.SGD(model.parameters(), lr=0.1), algorithm=algorithm,
                     density=0.05 if algorithm != "dense" else 1.0, buffer_bytes=5_000)
        _loss(model, rank, 0).backward()
        sched.step()
        sched.synchronize()
        after = [st.iteration for st in sched.states]
        sched.close()
        return after

    results = sparsecomm.simulate(3, body, timeout=30).results
    for after in results:
        assert after == [1] * len(after) and len(after) > 1
    assert len(seconds) == 3 * len(results[0])
    assert all(split == halves and (sent > 0) == halves for split, sent in seconds)


def test_dear_raises_a_failed_call_once_at_the_next_step_and_goes_on():
    # step() does not wait for the first halves, so a refused call (NaN gradients) is found by
    # the next forward's first update: that step applies nothing, and the error is raised once,
    # by the next step(), after that batch's forward and backward went on; then training goes on.
    from sparsecomm.schedules import DeAR

    def body(rank: int):
        model = _model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        sched = DeAR(model, opt, algorithm="oktopk", density=0.05, buffer_bytes=5_000)
        _train(model, opt, sched, rank, 2)
        sched.synchronize()
        opt.zero_grad()
        loss = _loss(model, rank, 2)
        (loss * (float("nan") if rank == 1 else 1.0)).backward()  # one rank's gradients are NaN
        sched.step()  # returns: the refusal is on the engine's thread
        before = [p.detach().clone() for p in model.parameters()]
        opt.zero_grad()
        _loss(model, rank, 3).backward()  # the forward finds the refusal, applies nothing, goes on
        unchanged = all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
        with pytest.raises(sparsecomm.InputError, match="NaN|Inf|finite"):
            sched.step()
        sched.synchronize()  # nothing left to raise
        _train(model, opt, sched, rank, 2)
        sched.synchronize()
        sched.close()
        finite = all(bool(torch.isfinite(p).all()) for p in model.parameters())
        return unchanged, finite, [p.detach().clone() for p in model.parameters()]

    out = sparsecomm.simulate(3, body, timeout=60).results
    for unchanged, finite, params in out:
        assert unchanged and finite  # every group's call was refused: no update was applied
        assert all(torch.equal(a, b) for a, b in zip(params, out[0][2]))


def test_dear_tunes_its_fusion_size_and_regrouping_keeps_every_residual():
    from sparsecomm.schedules import DeAR

    def body(rank: int):
        model = _model()
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        sched = DeAR(model, opt, algorithm="oktopk", density=0.05, buffer_bytes="auto", tune_trials=4,
                     tune_steps=2, tune_range=(2_000, 40_000))
        seen = set()
        for step in range(9):
            opt.zero_grad()
            _loss(model, rank, step).backward()
            sched.step()
            seen.add(len(sched.groups))
            if step == 4:  # regrouping by hand: every parameter keeps its residual, bit for bit
                sched.synchronize()
                before = {id(p): r for ps, st in zip(sched.params, sched.states) if st.residual is not None
                          for p, r in zip(ps, st.residual.split([q.numel() for q in ps]))}
                sched.regroup(sched.buffer_bytes)
                after = {id(p): r for ps, st in zip(sched.params, sched.states) if st.residual is not None
                         for p, r in zip(ps, st.residual.split([q.numel() for q in ps]))}
                assert before.keys() == after.keys() and before
                assert all(torch.equal(before[k], after[k]) for k in before)
        sched.synchronize()
        sched.close()
        return sched.trials, sched.buffer_bytes, sched.tuning, [p.detach().clone() for p in model.parameters()]

    out = sparsecomm.simulate(2, body, timeout=60).results
    trials, chosen, still_tuning, params = out[0]
    assert len(trials) == 4 and not still_tuning
    assert chosen == min(trials, key=lambda t: t[1])[0]
    assert all(2_000 <= size <= 40_000 for size, _ in trials)
    for o in out:  # every rank tried the same sizes, chose the same, holds the same model
        assert o[0] == trials and o[1] == chosen
        assert all(torch.equal(a, b) for a, b in zip(o[3], params))


def _dear_against_layers(rank: int, make, steps: int, buffer_bytes: int, algorithm: str = "dense",
                         density: float = 1.0, before=None) -> dict:
    """DeAR and its reference on ``make()``'s model: each module's own parameters (a shared one
    counts for the first module holding it) reduced as one synchronous call after every backward
    (no gradient: zeros), then the step. ``before(model, step, rank)`` runs before each forward.
    Returns both runs' parameters and DeAR's group sizes (in parameters)."""
    from sparsecomm.schedules import DeAR

    out = {}
    for name in ("dear", "plain"):
        with torch.random.fork_rng():
            torch.manual_seed(0)
            model = make()
        params = list(model.parameters())
        opt = torch.optim.SGD(params, lr=0.05, momentum=0.9)
        sched = DeAR(model, opt, algorithm=algorithm, density=density, buffer_bytes=buffer_bytes) \
            if name == "dear" else None
        seen, layers = set(), []
        for m in model.modules():
            own = [p for p in m.parameters(recurse=False) if id(p) not in seen]
            seen.update(id(p) for p in own)
            if own:
                layers.append(own)
        states = [sparsecomm.registry.get(algorithm).state_class(density) for _ in layers]
        for step in range(steps):
            if before is not None:
                before(model, step, rank)
            opt.zero_grad()
            _loss(model, rank, step).backward()
            if sched is not None:
                sched.step()
                continue
            for ps, st in zip(layers, states):
                flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in ps])
                red = sparsecomm.allreduce(flat, density, algorithm=algorithm, state=st, op="avg")
                for p, r in zip(ps, red.split([p.numel() for p in ps])):
                    p.grad = r.view_as(p).clone()
            opt.step()
        if sched is not None:
            sched.synchronize()
            out["groups"] = [len(ps) for ps in sched.params]
            sched.close()
        out[name] = [p.detach().clone() for p in params]
    return out


def test_dear_updates_a_group_before_any_of_its_modules_runs():
    # Modules registered in another order than they run (and one reused): every group is
    # updated before its first module to run, once, and the result equals plain data parallelism.

    class Shuffled(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.last = torch.nn.Linear(64, 10)
            self.first = torch.nn.Linear(20, 64)
            self.middle = torch.nn.Linear(64, 64)

        def forward(self, x):
            h = torch.relu(self.middle(torch.relu(self.first(x))))
            return self.last(torch.relu(self.middle(h)))  # middle twice

    for out in sparsecomm.simulate(2, _dear_against_layers, Shuffled, 4, 6_000, timeout=60).results:
        assert len(out["groups"]) == 2
        for a, b in zip(out["dear"], out["plain"]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


class _Skipping(torch.nn.Module):
    """A model whose middle layer runs only on some steps, and on some ranks (``use``)."""

    def __init__(self):
        super().__init__()
        self.first, self.middle, self.last = torch.nn.Linear(20, 64), torch.nn.Linear(64, 64), torch.nn.Linear(64, 10)
        self.use = True

    def forward(self, x):
        h = torch.relu(self.first(x))
        if self.use:
            h = h + torch.relu(self.middle(h))
        return self.last(h)


def _dear_skip_run(rank: int, algorithm: str, density: float) -> dict:
    """:func:`_dear_against_layers` on :class:`_Skipping`, its middle layer skipped on steps where
    (step + rank) % 3 == 1."""
    def skip(model, step, rank):
        model.use = (step + rank) % 3 != 1

    return _dear_against_layers(rank, _Skipping, 7, 5_000, algorithm, density, before=skip)


@pytest.mark.parametrize("algorithm,density", [("dense", 1.0), ("oktopk", 0.05)])
def test_dear_updates_a_group_whose_modules_skip_a_forward(algorithm, density):
    # The middle group's update from the step before has no pre-hook to apply it on a skipped
    # step, and must go in before its next first phase reuses its buffers (it used to be zeroed
    # there: a lost update). Its gradient is reduced as zeros where it did not run. The
    # reference: each layer's allreduce after every backward, then the step.
    results = sparsecomm.simulate(3, _dear_skip_run, algorithm, density, timeout=60).results
    for out in results:
        assert len(out["groups"]) == 3
        for a, b in zip(out["dear"], out["plain"]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        assert all(torch.equal(a, b) for a, b in zip(out["dear"], results[0]["dear"]))


@pytest.mark.parametrize("cls", ["WFBP", "SyncEASGD", "MGWFBP", "DeAR"])
def test_gradients_changed_after_their_allreduce_started_are_refused_not_lost(cls):
    # Clipping between backward and step(), or a second backward, would be left out of what was
    # reduced: a ScheduleError says so, once the step is complete (the reduced gradients are in
    # place, every rank made the same calls), and training goes on.
    import sparsecomm.schedules as schedules

    def body(rank: int):
        model = _model()
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        kw = dict(MG_FAST) if cls == "MGWFBP" else {}
        sched = getattr(schedules, cls)(model, opt, algorithm="oktopk", density=0.05, **kw)
        _train(model, opt, sched, rank, 2)
        opt.zero_grad()
        _loss(model, rank, 2).backward()
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
        _train(model, opt, sched, rank, 2)  # goes on
        opt.zero_grad()
        _loss(model, rank, 3).backward()
        with pytest.raises(sparsecomm.ScheduleError, match="second backward"):
            _loss(model, rank, 4).backward()
        sched.close()
        return [p.detach().clone() for p in model.parameters()]

    out = sparsecomm.simulate(2, body, timeout=60).results
    assert all(torch.equal(a, b) for a, b in zip(out[0], out[1]))  # the refused step's result was applied alike


@pytest.mark.parametrize("cls", [WFBP, SyncEASGD])
def test_synchronize_then_clip_then_step_clips_the_reduced_gradients(cls):
    # As under DDP: synchronize(), clip, optimizer.step(); a step() after synchronize() only steps
    # the optimizer (nothing is reduced twice). The reference: the same groups' synchronous calls.
    def body(rank: int):
        out = {}
        for name in ("scheduled", "reference"):
            model = _model()
            params = list(model.parameters())
            opt = torch.optim.SGD(params, lr=0.05, momentum=0.9)
            sched = cls(model, opt, algorithm="oktopk", density=0.05) if name == "scheduled" else None
            L = len(params)
            groups = [[i] for i in range(L - 1, -1, -1)] if cls is WFBP else [list(range(L - 1, -1, -1))]
            assert sched is None or sched.groups == groups
            states = [sparsecomm.OkTopkState(0.05) for _ in groups]
            for step in range(4):
                opt.zero_grad(set_to_none=step % 2 == 0)
                _loss(model, rank, step).backward()
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


@pytest.mark.parametrize("cls", ["WFBP", "SyncEASGD", "MGWFBP", "DeAR"])
def test_gradients_that_share_one_buffer_are_not_taken_for_changed(cls):
    # Views of one buffer share one version counter: the backward accumulating into later
    # layers' views (a user's flat gradient buffer; a schedule's own views after a regrouping)
    # is no change to a group read earlier. Only the end of backward is compared with step().
    import sparsecomm.schedules as schedules

    def body(rank: int):
        model = _model()
        params = list(model.parameters())
        flat = torch.zeros(sum(p.numel() for p in params))
        offset = 0
        for p in params:
            p.grad = flat[offset:offset + p.numel()].view_as(p)
            offset += p.numel()
        opt = torch.optim.SGD(params, lr=0.05)
        kw = dict(MG_FAST) if cls == "MGWFBP" else {}
        sched = getattr(schedules, cls)(model, opt, algorithm="oktopk", density=0.05, **kw)
        _train(model, opt, sched, rank, 2, set_to_none=False)
        if cls == "MGWFBP":  # its own re-plans and trials regroup it
            _train(model, opt, sched, rank, 10, set_to_none=False)
            assert sched.plans >= 1
        elif cls == "DeAR":  # regroup, then back to a group per layer
            sched.synchronize()
            sched.regroup(1 << 30)
            _train(model, opt, sched, rank, 2, set_to_none=False)
            sched.synchronize()
            sched.regroup(1)
        else:  # one group (every gradient a view of its result), then a group per layer again
            sched.set_groups([list(range(len(params) - 1, -1, -1))])
            _train(model, opt, sched, rank, 2, set_to_none=False)
            sched.set_groups([[i] for i in range(len(params) - 1, -1, -1)])
        _train(model, opt, sched, rank, 2, set_to_none=False)
        if cls == "DeAR":
            sched.synchronize()
        groups = len(sched.groups)
        sched.close()
        return groups, [p.detach().clone() for p in params]

    out = sparsecomm.simulate(2, body, timeout=60).results
    assert out[0][0] > 1 or cls == "MGWFBP"
    assert all(torch.equal(a, b) for a, b in zip(out[0][1], out[1][1]))


def _oktopk_wfbp():
    """The test model, plain SGD and Ok-Topk 5% under WFBP."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    return model, opt, WFBP(model, opt, algorithm="oktopk", density=0.05)


@pytest.mark.parametrize("set_to_none", [False, True])
def test_a_gradient_hook_that_changes_a_group_being_read_is_refused(set_to_none):
    # An in-place change after a group was submitted (a post-accumulate hook registered after
    # the schedule's) would race the job (the gradients are views of its buffer) or be lost
    # (they were copied into it).
    def body(rank: int):
        model, opt, sched = _oktopk_wfbp()
        _train(model, opt, sched, rank, 2, set_to_none=set_to_none)
        first = next(model.parameters())

        def prune(p):
            p.grad.mul_(0.5)

        handle = first.register_post_accumulate_grad_hook(prune)
        opt.zero_grad(set_to_none=set_to_none)
        _loss(model, rank, 2).backward()
        with pytest.raises(sparsecomm.ScheduleError, match="during backward"):
            sched.step()
        handle.remove()
        sched.close()
        return True

    assert all(sparsecomm.simulate(2, body, timeout=60).results)


def test_dear_reduces_and_updates_a_tied_weight_once():
    # The classifier is tied to the middle layer's weight: it belongs to the middle layer's group
    # only (before, it was in two groups, reduced and stepped twice).

    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.first, self.middle = torch.nn.Linear(20, 64), torch.nn.Linear(64, 64)
            self.head = torch.nn.Linear(64, 64, bias=False)
            self.head.weight = self.middle.weight

        def forward(self, x):
            h = torch.relu(self.first(x))
            h = h + torch.relu(self.middle(h))
            return self.head(h)[:, :10]

    for out in sparsecomm.simulate(2, _dear_against_layers, Tied, 5, 1, timeout=60).results:
        assert out["groups"] == [2, 2]
        for a, b in zip(out["dear"], out["plain"]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_dear_catches_up_in_backward_on_a_group_used_without_its_module():
    # On odd steps the middle layer's parameters are used without calling the module: no
    # pre-hook applies its pending update, so it goes in during backward, before the group's
    # next first phase (the forward used the weights one update old). Every step's update is
    # applied once, on every rank alike.
    from sparsecomm.schedules import DeAR

    class Functional(_Skipping):
        def forward(self, x):
            h = torch.relu(self.first(x))
            if self.use:
                h = h + torch.relu(self.middle(h))
            else:
                h = h + torch.relu(torch.nn.functional.linear(h, self.middle.weight, self.middle.bias))
            return self.last(h)

    def body(rank: int):
        with torch.random.fork_rng():
            torch.manual_seed(0)
            model = Functional()
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        sched = DeAR(model, opt, algorithm="oktopk", density=0.05, buffer_bytes=1)
        applied, during_backward = [0] * len(sched.groups), []
        apply, catch_up = sched._apply, sched._catch_up

        def counting_apply(gi, flat):
            applied[gi] += flat is not None
            return apply(gi, flat)

        def spying_catch_up(gi):
            in_hook = any(f.function == "_on_grad" for f in inspect.stack())  # a post-accumulate hook
            during_backward.append(in_hook and gi)
            return catch_up(gi)

        sched._apply, sched._catch_up = counting_apply, spying_catch_up
        for step in range(6):
            model.use = step % 2 == 0
            opt.zero_grad()
            _loss(model, rank, step).backward()
            sched.step()
        sched.synchronize()
        sched.close()
        return applied, during_backward, [p.detach().clone() for p in model.parameters()]

    out = sparsecomm.simulate(2, body, timeout=60).results
    for applied, during_backward, params in out:
        assert applied == [6, 6, 6]
        assert during_backward == [1, 1, 1]  # the middle group, after each odd step's forward
        assert all(torch.equal(a, b) for a, b in zip(params, out[0][2]))


@pytest.mark.parametrize("explicit", [False, True])
def test_a_rank_without_a_backward_still_takes_part(explicit):
    # A rank with nothing to learn from on one step still calls step() (or synchronize() and
    # the optimizer): it reduces zeros with the others, who would otherwise wait for it.
    def body(rank: int):
        model, opt, sched = _oktopk_wfbp()
        for step in range(4):
            opt.zero_grad()
            if not (rank == 1 and step == 2):
                _loss(model, rank, step).backward()
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
        model = _model()
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        sched = MGWFBP(model, opt, algorithm="oktopk", density=0.05, **MG_FAST)
        _train(model, opt, sched, rank, 2)
        opt.zero_grad()
        (_loss(model, rank, 2) * (float("nan") if rank == 1 else 1.0)).backward()
        with pytest.raises(sparsecomm.InputError):
            sched.step()
        _train(model, opt, sched, rank, 8)
        sched.close()
        return [p.detach().clone() for p in model.parameters()]

    out = sparsecomm.simulate(2, body, timeout=60).results
    assert all(bool(torch.isfinite(p).all()) for p in out[0])
    assert all(torch.equal(a, b) for a, b in zip(out[0], out[1]))


def _mixed_model(layer: int = 4) -> torch.nn.Module:
    """The test model with one layer in bfloat16 (the last: a mixed-precision head)."""
    model = _model()
    model[layer].to(torch.bfloat16)
    return model


def _mixed_loss(model, rank: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * rank + step)
    x, y = torch.randn(16, 20, generator=g), torch.randint(0, 10, (16,), generator=g)
    for layer in model:  # each layer in its own dtype
        x = layer(x.to(next(layer.parameters()).dtype) if list(layer.parameters()) else x)
    return torch.nn.functional.cross_entropy(x.float(), y)


@pytest.mark.parametrize("cls", [SyncEASGD, WFBP])
def test_a_group_of_mixed_dtypes_reduces_each_gradient_in_the_widest(cls):
    # One group holding float32 layers and a bfloat16 one: its buffer takes float32 (it took
    # the first gradient's dtype, and the float32 layers were cast to bfloat16 and back).
    def body(rank: int):
        model = _mixed_model()
        sched = cls(model, _optimizer("sgd", model.parameters()), algorithm="dense", density=1.0)
        _mixed_loss(model, rank, 0).backward()
        sched.synchronize()
        got = [p.grad.clone() for p in model.parameters()]
        sched.close()
        twin = _mixed_model()
        _mixed_loss(twin, rank, 0).backward()
        want = [sparsecomm.allreduce(p.grad.float(), 1.0, algorithm="dense", op="avg").to(p.dtype)
                for p in twin.parameters()]
        return got, want

    for got, want in sparsecomm.simulate(2, body).results:
        for g, w in zip(got, want):
            assert g.dtype == w.dtype
            torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-7)


def test_dear_and_pipesgd_buffers_take_the_widest_dtype():
    from sparsecomm.schedules import DeAR, PipeSGD

    def body(rank: int):
        dtypes = []
        for cls in (PipeSGD, DeAR):
            model = _mixed_model(layer=0)  # the first gradient is bfloat16
            sched = cls(model, _optimizer("sgd", model.parameters()), algorithm="dense", density=1.0)
            for step in range(2):
                _mixed_loss(model, rank, step).backward()
                sched.step()
            dtypes.append({b.dtype for b in sched._buffers if b is not None})
            sched.close()
        return dtypes

    for dtypes in sparsecomm.simulate(2, body).results:
        assert dtypes == [{torch.float32}, {torch.float32}], dtypes
