"""MG-WFBP (schedules/mgwfbp.py): plans alike on every rank, fits its model, re-plans, keeps the faster plan."""

from __future__ import annotations


import torch

import sparsecomm
from sparsecomm.schedules import MGWFBP

from schedule_cases import loss_of, make_model, run_scheduled


def test_mgwfbp_plans_every_rank_alike_and_groups_are_contiguous():
    def body(rank: int):
        _, groups, sched = run_scheduled(rank, "sgd", MGWFBP, "oktopk", 0.05, profile_steps=2,
                                      calibration_sizes=(256, 8192), calibration_rounds=1)
        return groups, sched.a, sched.b, sched.backward_times

    out = sparsecomm.simulate(3, body, timeout=120).results
    for groups, a, b, times in out:
        assert groups == out[0][0] and times == out[0][3]
        assert a is not None and b is not None and a >= 0 and b >= 0
        assert sorted(i for g in groups for i in g) == list(range(6))


def test_mgwfbp_fits_from_its_own_jobs_or_else_calibrates():
    def body(rank: int):
        found = {}
        for name, make in (("jobs", make_model),  # layers of several sizes: the fit uses the jobs' times
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
        model = make_model()
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        sched = MGWFBP(model, opt, algorithm="dense", density=1.0, profile_steps=2, verify=False)
        # Synthetic profiles: measured ones in the simulated world include the ranks' turn-taking,
        # noise that could hide (or fake) the drift.
        sched._layer_times = lambda: [(0.02 if rank == 0 and sched.plans else 0.001)] * 6
        for step in range(9):
            opt.zero_grad()
            loss_of(model, rank, step).backward()
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
        model = make_model()
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
            loss_of(model, rank, step).backward()
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
