"""Every schedule in training loops as users write them: refusals, skipped batches, freezing,
accumulation, checkpoints and a loss scaler (bodies in ``loop_cases.py``).

The property suite draws seeded sequences of those events and checks, for every
schedule: identical parameters on every rank; conservation (what was applied,
plus every residual and carried result, equals the gradients fed, less those of
refused calls and of batches dropped before any call took them); and a run
restarted from checkpoints equals the uninterrupted one bit for bit.
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch

import sparsecomm
from sparsecomm.schedules import SCHEDULES, PipeSGD

import engines
import loop_cases

SEEDS = int(os.environ.get("SPARSECOMM_LOOP_SEEDS", "3"))
NAMES = sorted(SCHEDULES)


def check(out: list[dict], P: int) -> None:
    """Identical parameters on every rank, and conservation (float64: to rounding)."""
    for i in range(len(out[0]["params"])):
        for o in out:
            assert torch.equal(o["params"][i], out[0]["params"][i]), f"parameter {i} differs across ranks"
        fed = sum(o["fed"][i] for o in out)
        kept = sum(o["held"][i] for o in out) + P * out[0]["carried"][i]
        torch.testing.assert_close(P * out[0]["applied"][i] + kept, fed, rtol=1e-9, atol=1e-11)


def run(P: int, name: str, algorithm: str, events: list[str], **kw) -> list[dict]:
    return sparsecomm.simulate(P, lambda r: loop_cases.run_loop(r, P, name, algorithm, events, **kw),
                               timeout=60).results


@pytest.mark.parametrize("name", NAMES)
def test_a_refused_call_loses_nothing_else(name):
    # Rank 1's gradient of layer 2 is NaN at step 1: its call is refused on every rank; the
    # other calls of that step had debited their residuals, and their results are carried.
    out = run(2, name, "oktopk", ["plain", "refuse 1 2", "plain", "plain"])
    assert [o["errors"] for o in out] == [[out[0]["errors"][0]]] * 2
    assert "NonFiniteError" in out[0]["errors"][0]
    check(out, 2)
    assert float(sum(o["dropped"][2].abs().sum() for o in out)) > 0  # the refused gradient was left out


@pytest.mark.parametrize("name", NAMES)
def test_a_backward_that_raised_is_skipped_and_training_goes_on(name):
    # The skip-the-batch-on-OOM pattern: the backward raises on every rank, the loop zeroes the
    # gradients and goes on. Calls the backward started are finished and carried.
    out = run(2, name, "oktopk", ["plain", "abort", "plain", "plain"])
    assert all(o["errors"] == ["1 RuntimeError"] for o in out), [o["errors"] for o in out]
    check(out, 2)


@pytest.mark.parametrize("name", NAMES)
def test_gradient_accumulation_under_no_sync(name):
    out = run(3, name, "oktopk", ["accumulate", "plain", "accumulate", "accumulate"])
    assert all(o["errors"] == [] for o in out)
    check(out, 3)


@pytest.mark.parametrize("name", NAMES)
def test_dense_accumulation_equals_reducing_the_summed_gradient(name):
    # Exact against accumulating then reducing: two micro-batches under no_sync() and one
    # step give what one allreduce of the local sum gives, on every rank.
    out = run(2, name, "dense", ["accumulate"] + (["plain"] if name == "pipesgd" else []))
    ref = [sum(o["fed"][i] for o in out) / 2 for i in range(len(out[0]["fed"]))]
    for i, r in enumerate(ref):
        torch.testing.assert_close(out[0]["applied"][i], r, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("name", NAMES)
def test_frozen_and_thawed_layers_keep_ranks_together(name):
    out = run(2, name, "oktopk", ["plain", "freeze", "plain", "plain", "thaw", "plain"])
    assert all(o["errors"] == [] for o in out)
    check(out, 2)


@pytest.mark.parametrize("name", NAMES)
def test_a_layer_frozen_after_construction_does_not_move(name):
    # No weight decay or momentum on zeros: a frozen layer's .grad is None, as under DDP.
    def body(rank: int):
        net = loop_cases.model()
        opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9, weight_decay=0.1)
        sched = SCHEDULES[name](net, opt, **loop_cases.options(name, "oktopk"))
        first = list(net.parameters())[:2]
        for step in range(6):
            if step == 2:
                for p in first:
                    p.requires_grad_(False)
            opt.zero_grad(set_to_none=False)
            x, y = loop_cases.batch(rank, step)
            torch.nn.functional.cross_entropy(net(x), y).backward()
            sched.step()
            if step == 2:  # DeAR and Pipe-SGD apply the last gradient from before the freeze here
                frozen = [p.detach().clone() for p in first]
        sched.finish()
        sched.close()
        return [torch.equal(a, b) for a, b in zip(first, frozen)]

    assert sparsecomm.simulate(2, body, timeout=60).results == [[True, True]] * 2


@pytest.mark.parametrize("name", NAMES)
def test_an_optimizer_over_other_parameters_is_refused(name):
    net = loop_cases.model()
    extra = torch.nn.Parameter(torch.zeros(3))
    opt = torch.optim.SGD(list(net.parameters()) + [extra], lr=0.1)
    with pytest.raises(ValueError, match="not the model's"):
        sparsecomm.simulate(1, lambda r: SCHEDULES[name](net, opt, **loop_cases.options(name, "dense")))


GATHER = {"pipesgd": "_gather", "dear": "_flat"}  # where each schedule reads the gradients


@pytest.mark.parametrize("name", NAMES)
def test_a_rank_that_cannot_gather_its_gradients_is_refused_on_every_rank(name):
    # Rank 1 fails to gather (a parameter left on the meta device, say): its call still takes part
    # in the collective check, so every rank raises InputError at once instead of waiting it out.
    def body(rank: int):
        net = loop_cases.model()
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        sched = SCHEDULES[name](net, opt, **loop_cases.options(name, "oktopk"))
        if rank == 1:
            def broken(*args):
                raise RuntimeError("Tensor on device meta is not on the expected device cpu")
            setattr(sched, GATHER.get(name, "_gather"), broken)
        try:
            for step in range(2):
                opt.zero_grad()
                x, y = loop_cases.batch(rank, step)
                torch.nn.functional.cross_entropy(net(x), y).backward()
                sched.step()
            sched.finish()
        except sparsecomm.InputError as exc:
            return str(exc)
        finally:
            sched.close()
        return "no error"

    for msg in sparsecomm.simulate(2, body, timeout=20).results:
        assert "bad input on rank 1" in msg, msg


@pytest.mark.parametrize("name", NAMES)
def test_a_loss_scaler_skips_an_overflowing_step_on_every_rank(name):
    # Rank 0's last layer overflows (Inf) at step 2: the scaler skips that step on every rank and
    # halves its scale; no residual holds an Inf; the steps after train on, identical everywhere.
    out = run(2, name, "oktopk", ["plain", "plain", "overflow 0", "plain", "plain"], scaler_scale=2.0 ** 8)
    for o in out:
        assert o["errors"] == [], o["errors"]
        lag = 1 if name in ("dear", "pipesgd") else 0  # they apply (and find the Inf) a step later
        assert o["scales"][1 + lag] == 2.0 ** 8 and o["scales"][2 + lag] == 2.0 ** 7, o["scales"]
        assert all(bool(torch.isfinite(h).all()) for h in o["held"])
        assert all(bool(torch.isfinite(p).all()) for p in o["params"])
        for a, b in zip(o["params"], out[0]["params"]):
            assert torch.equal(a, b)


@pytest.mark.parametrize("name", NAMES)
def test_a_moving_loss_scale_changes_nothing(name, monkeypatch):
    # Residuals, parked residuals, carried results and results in flight are in the scaler's
    # units: a scale that doubles every step (powers of two: exact in float64) must give the
    # bits of one that never moves, through freezing, thawing, a refusal, an aborted batch, a
    # restart and finish(). (TopkA: Ok-Topk's reused thresholds do not follow the scale.)
    # MG-WFBP plans from measured times, so the two runs could group the layers differently
    # (other selections, other bits): here its plan is fixed, one group (no trial to time).
    monkeypatch.setattr(sparsecomm.schedules.mgwfbp, "plan_merge",
                        lambda times, sizes, a, b, method: [list(range(len(sizes)))])
    events = ["plain", "plain", "freeze", "plain", "refuse 1 3", "thaw", "plain", "abort", "plain", "restart",
              "plain", "plain"]
    runs = [run(2, name, "topka", events, scaler_scale=2.0 ** 8, growth_interval=g) for g in (1, 10 ** 6)]
    assert runs[0][0]["scales"][-1] > runs[1][0]["scales"][-1]  # the scale did move in the first
    for moving, still in zip(*runs):
        for a, b in zip(moving["params"], still["params"]):
            assert torch.equal(a, b)


def test_pipesgd_keeps_the_job_submitted_with_a_refused_one():
    # Step t's job was submitted before step t-1's error was raised: it is applied at t+1.
    out = run(2, "pipesgd", "dense", ["plain", "refuse 0 0", "plain", "plain"])
    assert out[0]["errors"] == ["2 NonFiniteError"]
    check(out, 2)


def test_pipesgd_checkpoint_of_another_algorithm_keeps_its_own_settings():
    def body(rank: int):
        net = loop_cases.model()
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        a = PipeSGD(net, opt, algorithm="topka", density=0.3)
        for step in range(3):
            x, y = loop_cases.batch(rank, step)
            opt.zero_grad()
            torch.nn.functional.cross_entropy(net(x), y).backward()
            a.step()
        saved = a.state_dict()
        a.close()
        b = PipeSGD(net, opt, algorithm="oktopk", density=0.2)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            b.load_state_dict(saved)
        kept = type(b.state).__name__, b.state.density, torch.equal(b.state.residual, saved["algorithm_state"].residual)
        b.close()
        return kept, [str(w.message) for w in caught]

    for kept, caught in sparsecomm.simulate(2, body, timeout=60).results:
        assert kept[0] != "TopkAState" and kept[1] == 0.2 and kept[2], kept
        assert any("residuals carry over" in m for m in caught), caught


@pytest.mark.parametrize("name", NAMES)
def test_a_checkpoint_of_another_model_is_refused_at_load(name):
    def body(rank: int):
        net = loop_cases.model()
        sched = SCHEDULES[name](net, torch.optim.SGD(net.parameters(), lr=0.1), **loop_cases.options(name, "dense"))
        saved = sched.state_dict()
        sched.close()
        other = torch.nn.Linear(6, 3).double()
        twin = SCHEDULES[name](other, torch.optim.SGD(other.parameters(), lr=0.1),
                               **loop_cases.options(name, "dense"))
        try:
            twin.load_state_dict(saved)
        except ValueError as exc:
            return str(exc)
        finally:
            twin.close()
        return "loaded"

    for msg in sparsecomm.simulate(1, body, timeout=30).results:
        assert "another model" in msg, msg


def _check_property(results: list[dict], P: int, name: str) -> None:
    check([r["resumed"] for r in results], P)
    check([r["straight"] for r in results], P)
    if name != "mgwfbp":  # MG-WFBP plans from measured times: two runs may plan differently
        for r in results:
            for a, b in zip(r["resumed"]["params"], r["straight"]["params"]):
                assert torch.equal(a, b), (r["events"], "the restarted run left the uninterrupted one")


@pytest.mark.parametrize("seed", range(SEEDS))
@pytest.mark.parametrize("name", NAMES)
def test_training_loop_property_in_the_simulated_world(name, seed):
    P = 2 + seed % 2
    results = sparsecomm.simulate(P, lambda r: loop_cases.property_case(r, P, name, "oktopk", seed),
                                  timeout=120).results
    _check_property(results, P, name)


@pytest.mark.parametrize("name", NAMES)
def test_auto_chooses_per_call_and_keeps_every_rule(name):
    # algorithm="auto": each call (group) gets the algorithm sparsecomm.choose picks for its
    # size, and keeps it; freezing the first layer regroups and chooses again, residuals moving
    # with their layers, from sparse groups into dense ones too. Refusals, a skipped batch and
    # a restart keep the property: identical ranks, nothing lost, restarted = uninterrupted.
    P, events = 3, ["plain", "refuse 1 2", "plain", "freeze", "plain", "restart", "thaw", "plain", "abort", "plain"]
    results = sparsecomm.simulate(P, lambda r: loop_cases.property_case(r, P, name, "auto", 0, events=events),
                                  timeout=120).results
    _check_property(results, P, name)
    for r in results:
        assert r["resumed"]["errors"][0].endswith("NonFiniteError"), r["resumed"]["errors"]  # (DeAR, Pipe-SGD: a step late)
        chosen = r["resumed"]["chosen"]
        assert chosen and all(algorithm == sparsecomm.choose(n, 0.2, P, torch.float64, network=loop_cases.AUTO_NETWORK)
                              for n, algorithm in chosen), chosen
        if name in ("wfbp", "dear"):  # calls of several sizes: both kinds
            assert {algorithm for _, algorithm in chosen} == {"dense", "oktopk"}, chosen


def test_auto_regrouped_residuals_go_with_their_dense_calls():
    # One sparse group of every layer, then a group per layer: the small layers' calls go dense
    # under auto, and their residuals from the sparse group are sent with their first dense call
    # (not held forever); the large layer's stays with its own sparse state.
    from sparsecomm.schedules import GroupSchedule

    def body(rank):
        net = loop_cases.model()
        sched = GroupSchedule(net, torch.optim.SGD(net.parameters(), lr=loop_cases.LR), algorithm="auto",
                              density=0.2, network=loop_cases.AUTO_NETWORK)
        out = []
        for step in range(2):
            x, y = loop_cases.batch(rank, step)
            torch.nn.functional.cross_entropy(net(x), y).backward()
            sched.step()
            out.append([(st.algorithm, float(st.residual.abs().sum())) for _, st in loop_cases.calls("wfbp", sched)])
            if step == 0:
                sched.set_groups([[i] for i in range(len(sched.params) - 1, -1, -1)])
                out.append([(st.algorithm, float(st.residual.abs().sum())) for _, st in loop_cases.calls("wfbp", sched)])
        sched.close()
        return out

    for first, moved, after in sparsecomm.simulate(3, body, timeout=60).results:
        assert [a for a, _ in first] == ["oktopk"] and first[0][1] > 0
        assert [a for a, _ in moved] == ["dense", "dense", "dense", "oktopk", "dense", "dense"], moved
        assert sum(r for a, r in moved if a == "dense") > 0  # the layers' residuals moved to their own calls
        assert all(r == 0 for a, r in after if a == "dense"), after  # sent
        assert all(r > 0 for a, r in after if a == "oktopk"), after


@pytest.fixture(scope="module")
def gloo_loops():
    """Every schedule's case on one launch of three gloo ranks (a launch costs seconds)."""
    return engines.run_gloo(3, loop_cases.property_cases, "oktopk", 100, AUTO_ON_GLOO)


#: The schedules whose calls differ in size in loop_cases' model, where "auto" mixes dense and sparse.
AUTO_ON_GLOO = ("wfbp", "dear")


@pytest.mark.slow
@pytest.mark.gloo
@pytest.mark.parametrize("name", NAMES + [f"{name}+auto" for name in AUTO_ON_GLOO])
def test_training_loop_property_on_gloo(name, gloo_loops):
    _check_property([o[name] for o in gloo_loops], 3, name.split("+")[0])


@pytest.mark.slow
@pytest.mark.mpi
@pytest.mark.skipif(engines.mpiexec() is None, reason="mpi4py/mpiexec not installed")
def test_training_loop_property_on_mpi():
    out = engines.run_mpi(3, "loops")
    for name in NAMES:
        _check_property([o[name] for o in out], 3, name)



@pytest.mark.parametrize("name", NAMES)
def test_a_disabled_scaler_is_no_scaler(name):
    # GradScaler(enabled=False), the usual fp32 switch, must not turn a refusal into an Inf step.
    def body(rank: int):
        net = loop_cases.model()
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        scaler = torch.amp.GradScaler("cpu", enabled=False)
        sched = SCHEDULES[name](net, opt, scaler=scaler, **loop_cases.options(name, "dense"))
        caught = None
        for step in range(3):
            opt.zero_grad()
            x, y = loop_cases.batch(rank, step)
            loss = torch.nn.functional.cross_entropy(net(x), y)
            try:
                (loss * (float("nan") if step == 1 and rank == 0 else 1.0)).backward()
                sched.step()
            except sparsecomm.NonFiniteError as exc:
                caught = caught or f"{step} {type(exc).__name__}"
        try:
            sched.finish()
        except sparsecomm.NonFiniteError as exc:
            caught = caught or f"end {type(exc).__name__}"
        sched.close()
        return caught, all(bool(torch.isfinite(p).all()) for p in net.parameters())

    for caught, finite in sparsecomm.simulate(2, body, timeout=30).results:
        assert caught is not None and finite, (caught, finite)


@pytest.mark.parametrize("name", NAMES)
def test_fp16_autocast_overflows_are_skipped_alike_and_training_goes_on(name):
    # A real fp16 run: autocast on CPU, a loss scale far too high. The backward overflows (Inf in
    # the float32 gradients) until the scale has dropped far enough; every rank skips the same
    # steps, no residual holds an Inf, and the steps after train, identical on every rank.
    def body(rank: int):
        net = loop_cases.model().float()
        opt = torch.optim.SGD(net.parameters(), lr=0.05)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 24, growth_interval=1000)
        sched = SCHEDULES[name](net, opt, scaler=scaler, **loop_cases.options(name, "oktopk"))
        start = [p.detach().clone() for p in net.parameters()]
        scales = []
        for step in range(14):
            opt.zero_grad()
            x, y = loop_cases.batch(rank, step)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = torch.nn.functional.cross_entropy(net(x.float()), y)
            scaler.scale(loss).backward()
            sched.step()
            if name not in ("dear", "pipesgd"):  # those two drive their scaler
                scaler.update()
            scales.append(scaler.get_scale())
        sched.finish()
        held = loop_cases.held(name, sched)
        sched.close()
        moved = any(not torch.equal(a, b) for a, b in zip(start, net.parameters()))
        return ([p.detach().clone() for p in net.parameters()], scales, moved,
                all(bool(torch.isfinite(h).all()) for h in held.values()))

    out = sparsecomm.simulate(2, body, timeout=60).results
    for params, scales, moved, finite in out:
        assert scales == out[0][1] and scales[-1] < 2.0 ** 24 and moved and finite, (scales, moved, finite)
        assert all(bool(torch.isfinite(p).all()) for p in params)
        assert all(torch.equal(a, b) for a, b in zip(params, out[0][0]))


class _Checkpointed(torch.nn.Module):
    """Two blocks under reentrant activation checkpointing; ``shared``: the same block twice."""

    def __init__(self, shared: bool) -> None:
        super().__init__()
        net = loop_cases.model()
        self.inp, self.b1, self.out = net[0], net[2], net[4]
        self.b2 = self.b1 if shared else torch.nn.Linear(12, 12).double()
        if not shared:
            self.b2.load_state_dict(self.b1.state_dict())

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        h = torch.relu(self.inp(x))
        h = checkpoint(lambda t: torch.relu(self.b1(t)), h, use_reentrant=True)
        h = checkpoint(lambda t: torch.relu(self.b2(t)), h, use_reentrant=True)
        return self.out(h)


@pytest.mark.parametrize("name", NAMES)
def test_reentrant_checkpoints_reduce_once_and_a_weight_they_share_is_refused_loudly(name):
    # Reentrant checkpoints run inner backwards: a schedule must reduce each gradient once. A
    # weight shared by two of them gets its gradient twice in one backward; a schedule whose
    # calls start in backward refuses it (it took that gradient for an aborted backward's and
    # applied twice), Pipe-SGD reduces what step() finds and takes it.
    def body(rank: int, shared: bool):
        net = _Checkpointed(shared)
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        sched = SCHEDULES[name](net, opt, **loop_cases.options(name, "dense"))
        try:
            for step in range(2):
                opt.zero_grad()
                x, y = loop_cases.batch(rank, step)
                torch.nn.functional.cross_entropy(net(x.requires_grad_()), y).backward()
                sched.step()
            sched.finish()
        except sparsecomm.ScheduleError as exc:
            return str(exc)
        finally:
            sched.close()
        return [p.detach().clone() for p in net.parameters()]

    def plain(rank: int):  # the same steps, gradients averaged by hand
        net = _Checkpointed(False)
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        for step in range(2):
            opt.zero_grad()
            x, y = loop_cases.batch(rank, step)
            torch.nn.functional.cross_entropy(net(x), y).backward()
            for p in net.parameters():
                p.grad = sparsecomm.allreduce(p.grad, algorithm="dense", op="avg")
            opt.step()
        return [p.detach().clone() for p in net.parameters()]

    got = sparsecomm.simulate(2, lambda r: body(r, False), timeout=30).results
    want = sparsecomm.simulate(2, plain, timeout=30).results
    lagged = name in ("dear", "pipesgd")  # their updates come a step late: compare what finish() left
    for g, w in zip(got, want):
        assert not isinstance(g, str), g
        if not lagged:
            for a, b in zip(g, w):
                torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)
    shared = sparsecomm.simulate(2, lambda r: body(r, True), timeout=30).results
    if name == "pipesgd":
        assert all(not isinstance(s, str) for s in shared)
    else:
        assert all(isinstance(s, str) and "twice in one backward" in s for s in shared), shared


def test_a_sparse_checkpoint_loaded_into_a_dense_schedule_sends_its_residuals():
    # The dense schedule's settings win (no error feedback without a compressor), but the saved
    # residuals are gradient not sent yet: its next call sends them, none is left behind.
    from sparsecomm.schedules import SyncEASGD

    def body(rank):
        net = loop_cases.model()
        sparse = SyncEASGD(net, torch.optim.SGD(net.parameters(), lr=loop_cases.LR), algorithm="oktopk", density=0.2)
        x, y = loop_cases.batch(rank, 0)
        torch.nn.functional.cross_entropy(net(x), y).backward()
        sparse.step()
        saved = sparse.state_dict()
        owed = saved["states"][0].residual.clone()
        sparse.close()
        dense = SyncEASGD(net, torch.optim.SGD(net.parameters(), lr=loop_cases.LR), algorithm="dense", density=1.0)
        with pytest.warns(UserWarning, match="residuals carry over"):
            dense.load_state_dict(saved)
        loaded = dense._states[0].residual.clone()
        x, y = loop_cases.batch(rank, 1)
        torch.nn.functional.cross_entropy(net(x), y).backward()
        dense.step()
        left = dense._states[0].residual
        dense.close()
        return torch.equal(loaded, owed) and bool(owed.any()), float(left.abs().sum())

    for same, left in sparsecomm.simulate(2, body, timeout=60).results:
        assert same and left == 0


@pytest.mark.parametrize("name", NAMES)
def test_auto_with_options_or_an_unknown_network_is_refused_at_construction(name):
    # Options belong to one algorithm, and a bad profile would fail only at the first group.
    net = loop_cases.model()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="algorithm_options"):
        SCHEDULES[name](net, opt, algorithm="auto", algorithm_options={"tau": 4})
    with pytest.raises(ValueError, match="no-such-network"):
        SCHEDULES[name](net, opt, algorithm="auto", network="no-such-network")
