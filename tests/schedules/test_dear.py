"""DeAR (schedules/dear.py, dear_tuner.py): halves apart, updates in the next forward, its tuner."""

from __future__ import annotations

import inspect

import pytest
import torch

import sparsecomm

from schedule_cases import Skipping, dear_against_layers, loss_of, make_model, run_dear, run_dear_skipping, synchronous_reference, train_steps


@pytest.mark.parametrize("kind", ["sgd", "adam"])
@pytest.mark.parametrize("P", [1, 3, 4])
def test_dear_dense_equals_plain_data_parallel(P, kind):
    def body(rank: int):
        got, groups = run_dear(rank, kind, "dense", 1.0, 5_000)  # a group per layer
        want = synchronous_reference(rank, kind, [list(range(6))], "dense", 1.0)
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
        got, groups = run_dear(rank, kind, algorithm, density, 5_000, compressor, set_to_none)
        want = synchronous_reference(rank, kind, groups, algorithm, density, as_given=True, compressor=compressor)
        return all(torch.equal(a, b) for a, b in zip(got, want))

    assert all(sparsecomm.simulate(3, body, timeout=60).results)


def test_dear_updates_wait_for_the_next_forward():
    from sparsecomm.schedules import DeAR

    def body(rank: int):
        model = make_model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        sched = DeAR(model, opt, algorithm="dense", buffer_bytes=16_000)
        before = [p.detach().clone() for p in model.parameters()]
        loss_of(model, rank, 0).backward()
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
        model = make_model()
        sched = DeAR(model, torch.optim.SGD(model.parameters(), lr=0.1), algorithm=algorithm,
                     density=0.05 if algorithm != "dense" else 1.0, buffer_bytes=5_000)
        loss_of(model, rank, 0).backward()
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
        model = make_model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        sched = DeAR(model, opt, algorithm="oktopk", density=0.05, buffer_bytes=5_000)
        train_steps(model, opt, sched, rank, 2)
        sched.synchronize()
        opt.zero_grad()
        loss = loss_of(model, rank, 2)
        (loss * (float("nan") if rank == 1 else 1.0)).backward()  # one rank's gradients are NaN
        sched.step()  # returns: the refusal is on the engine's thread
        before = [p.detach().clone() for p in model.parameters()]
        opt.zero_grad()
        loss_of(model, rank, 3).backward()  # the forward finds the refusal, applies nothing, goes on
        unchanged = all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
        with pytest.raises(sparsecomm.InputError, match="NaN|Inf|finite"):
            sched.step()
        sched.synchronize()  # nothing left to raise
        train_steps(model, opt, sched, rank, 2)
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
        model = make_model()
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        sched = DeAR(model, opt, algorithm="oktopk", density=0.05, buffer_bytes="auto", tune_trials=4,
                     tune_steps=2, tune_range=(2_000, 40_000))
        seen = set()
        for step in range(9):
            opt.zero_grad()
            loss_of(model, rank, step).backward()
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

    for out in sparsecomm.simulate(2, dear_against_layers, Shuffled, 4, 6_000, timeout=60).results:
        assert len(out["groups"]) == 2
        for a, b in zip(out["dear"], out["plain"]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("algorithm,density", [("dense", 1.0), ("oktopk", 0.05)])
def test_dear_updates_a_group_whose_modules_skip_a_forward(algorithm, density):
    # The middle group's update from the step before has no pre-hook to apply it on a skipped
    # step, and must go in before its next first phase reuses its buffers (it used to be zeroed
    # there: a lost update). Its gradient is reduced as zeros where it did not run. The
    # reference: each layer's allreduce after every backward, then the step.
    results = sparsecomm.simulate(3, run_dear_skipping, algorithm, density, timeout=60).results
    for out in results:
        assert len(out["groups"]) == 3
        for a, b in zip(out["dear"], out["plain"]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        assert all(torch.equal(a, b) for a, b in zip(out["dear"], results[0]["dear"]))


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

    for out in sparsecomm.simulate(2, dear_against_layers, Tied, 5, 1, timeout=60).results:
        assert out["groups"] == [2, 2]
        for a, b in zip(out["dear"], out["plain"]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_dear_catches_up_in_backward_on_a_group_used_without_its_module():
    # On odd steps the middle layer's parameters are used without calling the module: no
    # pre-hook applies its pending update, so it goes in during backward, before the group's
    # next first phase (the forward used the weights one update old). Every step's update is
    # applied once, on every rank alike.
    from sparsecomm.schedules import DeAR

    class Functional(Skipping):
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
            loss_of(model, rank, step).backward()
            sched.step()
        sched.synchronize()
        sched.close()
        return applied, during_backward, [p.detach().clone() for p in model.parameters()]

    out = sparsecomm.simulate(2, body, timeout=60).results
    for applied, during_backward, params in out:
        assert applied == [6, 6, 6]
        assert during_backward == [1, 1, 1]  # the middle group, after each odd step's forward
        assert all(torch.equal(a, b) for a, b in zip(params, out[0][2]))
