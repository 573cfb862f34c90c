"""Low-communication training (``sparsecomm.optim.DiLoCo``): against a hand-written reference on
2 and 3 ranks, equal replicas after every outer step, nothing lost, NaN rounds, checkpoints."""

from __future__ import annotations

import io
import math

import pytest
import torch

import engines
import sparsecomm
from sparsecomm.optim import DiLoCo

H, STEPS = 3, 9


def _model() -> torch.nn.Module:
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    gen = torch.Generator().manual_seed(0)  # every replica starts from the same weights
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(0.3 * torch.randn(p.shape, generator=gen))
    return net


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(12, 8, generator=gen), torch.randint(0, 4, (12,), generator=gen)


def _inner_step(net, inner, rank, step, poison=False):
    x, y = _batch(rank, step)
    loss = torch.nn.functional.cross_entropy(net(x), y)
    (loss * (float("nan") if poison else 1.0)).backward()


def _flat(net) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in net.parameters()])


def _run(rank, steps=STEPS, poison_at=None, state=None, ddp=False, **kw):
    net = _model()
    inner = torch.optim.AdamW(net.parameters(), lr=0.01)
    outer = DiLoCo(net, inner, sync_every=H, **kw)
    forward = net
    if ddp:  # DDP must not reduce the inner steps' gradients
        from torch.nn.parallel import DistributedDataParallel

        from sparsecomm.optim import local_gradient_hook

        forward = DistributedDataParallel(net)
        forward.register_comm_hook(None, local_gradient_hook)
    if state is not None:
        outer.load_state_dict(state)
    errors, synced = [], []
    for step in range(steps):
        _inner_step(forward, inner, rank, step, poison=poison_at == (rank, step))
        try:
            outer.step()
        except sparsecomm.NonFiniteError as exc:
            errors.append((step, type(exc).__name__))
        inner.zero_grad()
        if outer.synced:
            synced.append(_flat(net).clone())
    return net, outer, errors, synced


def _rounds(P):
    """P replicas, each with its AdamW, by hand; yields them after every H inner steps (the
    caller restarts them from its outer model)."""
    nets = [_model() for _ in range(P)]
    inners = [torch.optim.AdamW(n.parameters(), lr=0.01) for n in nets]
    for step in range(STEPS):
        for r in range(P):
            _inner_step(nets[r], inners[r], r, step)
            inners[r].step()
            inners[r].zero_grad()
        if (step + 1) % H == 0:
            yield nets


def _restart(nets, anchor):
    for n in nets:
        torch.nn.utils.vector_to_parameters(anchor.clone(), n.parameters())


def _reference(P, outer, lr, mu=0.9):
    """DiLoCo by hand, dense: the average pseudo-gradient of H AdamW steps per replica."""
    anchor = _flat(_model()).clone()
    m = torch.zeros_like(anchor)
    for nets in _rounds(P):
        avg = sum(anchor - _flat(n) for n in nets) / P
        if outer == "nesterov":
            m = mu * m + avg
            anchor = anchor - lr * (avg + mu * m)
        else:
            anchor = anchor - lr * avg
        _restart(nets, anchor)
    return anchor


@pytest.mark.parametrize("P", [2, 3])
@pytest.mark.parametrize("outer", ["nesterov", "sparseloco"])
def test_dense_outer_steps_are_diloco(P, outer):
    out = sparsecomm.simulate(P, lambda r: _flat(_run(r, algorithm="dense", outer=outer, outer_lr=0.7)[0])).results
    expected = _reference(P, outer, 0.7)
    for got in out:
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
        assert torch.equal(got, out[0])


def _sparseloco_reference(P, density, lr):
    """SparseLoCo by hand (TopkA's selection: each rank's own top-k): every rank adds its
    pseudo-gradient to its residual, sends the k largest |entries| and keeps the rest; the
    outer model moves by lr times the average of what was sent."""
    anchor = _flat(_model()).clone()
    residual = [torch.zeros_like(anchor) for _ in range(P)]
    k = max(1, math.ceil(density * anchor.numel()))
    for nets in _rounds(P):
        total = torch.zeros_like(anchor)
        for r in range(P):
            acc = residual[r] + (anchor - _flat(nets[r]))
            top = torch.topk(acc.abs(), k).indices
            total[top] += acc[top]
            acc[top] = 0
            residual[r] = acc
        anchor = anchor - lr * total / P
        _restart(nets, anchor)
    return anchor, residual


@pytest.mark.parametrize("P", [2, 3])
def test_sparse_outer_steps_over_topka_are_sparseloco(P):
    def body(rank):
        net, outer, _, synced = _run(rank, algorithm="topka", density=0.05, outer_lr=0.8)
        return _flat(net), outer.residual.clone(), synced

    out = sparsecomm.simulate(P, body).results
    expected, residuals = _sparseloco_reference(P, 0.05, 0.8)
    for rank, (got, residual, synced) in enumerate(out):
        assert len(synced) == STEPS // H and all(torch.equal(a, b) for a, b in zip(synced, out[0][2]))
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(residual, residuals[rank], rtol=1e-5, atol=1e-6)
    assert 0 < (expected != _flat(_model())).sum() < expected.numel()  # sparse: not every entry moved


def test_inner_steps_send_nothing():
    # Between outer steps the ranks do not communicate: not a byte leaves a rank on an inner
    # step (the first step's check of the replicas is the one collective outside an outer step).
    def body(rank):
        comm = sparsecomm.resolve()
        net = _model()
        inner = torch.optim.AdamW(net.parameters(), lr=0.01)
        outer = DiLoCo(net, inner, sync_every=H, density=0.1)
        sent = []
        for step in range(STEPS):
            _inner_step(net, inner, rank, step)
            before = comm.stats.bytes_sent
            outer.step()
            inner.zero_grad()
            sent.append(comm.stats.bytes_sent - before)
        return sent

    for sent in sparsecomm.simulate(3, body).results:
        assert all(b > 0 for b in sent[H - 1::H]) and sent[0] > 0  # outer steps, and the first check
        assert all(b == 0 for i, b in enumerate(sent[1:], 1) if (i + 1) % H), sent


@pytest.mark.parametrize("P", [1, 2, 3, 5])
@pytest.mark.parametrize("algorithm", ["oktopk", "topka"])
def test_sparse_outer_steps_keep_replicas_equal_and_lose_nothing(P, algorithm):
    # What error feedback promises: over the run, what moved the outer model (outer_lr = 1)
    # plus every rank's residual, summed, equals every pseudo-gradient fed in.
    def body(rank):
        net = _model()
        start = _flat(net).clone()
        inner = torch.optim.AdamW(net.parameters(), lr=0.01)
        outer = DiLoCo(net, inner, sync_every=H, algorithm=algorithm, density=0.05, outer_lr=1.0)
        fed = torch.zeros_like(start)
        synced = []
        for step in range(STEPS):
            _inner_step(net, inner, rank, step)
            before = outer.anchor.clone()
            inner.step()
            if (step + 1) % H == 0:
                fed += before - _flat(net)
            outer.inner_steps += 1
            if outer.inner_steps % H == 0:
                outer.sync()
                synced.append(_flat(net).clone())
            inner.zero_grad()
        return fed, outer.residual.clone(), start - outer.anchor, synced

    out = sparsecomm.simulate(P, body).results
    moved = out[0][2]
    for _, _, m, synced in out:
        assert torch.equal(m, moved) and all(torch.equal(a, b) for a, b in zip(synced, out[0][3]))
    fed = sum(o[0] for o in out)
    kept = sum(o[1] for o in out)
    torch.testing.assert_close(P * moved + kept, fed, rtol=1e-5, atol=1e-5)
    assert 0 < moved.count_nonzero() < moved.numel()  # sparse: some entries moved, not all


def test_a_nan_round_is_discarded_on_every_rank_and_training_goes_on():
    def body(rank):
        net, outer, errors, synced = _run(rank, poison_at=(1, 4), density=0.1)
        return errors, outer.discarded, outer.outer_steps, _flat(net), synced

    def residual_kept(rank):
        # What the residual held after the round before the poisoned one is what the discard
        # leaves, bit for bit; the inner optimizer's state is the round's start, its rate the
        # scheduler's (a discard restores state, not settings).
        net = _model()
        inner = torch.optim.AdamW(net.parameters(), lr=0.01)
        schedule = torch.optim.lr_scheduler.ExponentialLR(inner, gamma=0.5)
        outer = DiLoCo(net, inner, sync_every=H, density=0.1)
        for step in range(2 * H):
            _inner_step(net, inner, rank, step, poison=(rank, step) == (1, 4))
            try:
                outer.step()
            except sparsecomm.NonFiniteError:
                pass
            inner.zero_grad()
            schedule.step()
            if step == H - 1:
                kept = outer.residual.clone()
                state = {k: v.clone() for k, v in inner.state[net[0].weight].items()}
        same_state = all(torch.equal(inner.state[net[0].weight][k], v) for k, v in state.items())
        return bool(kept.abs().sum() > 0) and outer.discarded == 1 and torch.equal(outer.residual, kept) \
            and same_state and inner.param_groups[0]["lr"] == 0.01 * 0.5 ** (2 * H)

    assert sparsecomm.simulate(2, residual_kept).results == [True, True]

    out = sparsecomm.simulate(2, body).results
    for errors, discarded, outer_steps, final, _ in out:
        assert errors == [(5, "NonFiniteError")] and discarded == 1 and outer_steps == 2
        assert torch.equal(final, out[0][3]) and bool(torch.isfinite(final).all())
    # The discarded round restarted every replica from the outer model it began at.
    for _, _, _, _, synced in out:
        assert torch.equal(synced[1], synced[0])


@pytest.mark.parametrize("rule", ["nesterov", "sparseloco"])
def test_a_checkpoint_resumes_bit_for_bit(rule):
    def body(rank):
        net, outer, _, _ = _run(rank, steps=5, density=0.1, outer=rule)
        buffer = io.BytesIO()  # through torch.save and torch.load's default (weights_only)
        torch.save({"outer": outer.state_dict(), "inner": outer.inner.state_dict(), "model": net.state_dict()},
                   buffer)
        buffer.seek(0)
        saved = torch.load(buffer)
        for step in range(5, STEPS):
            _inner_step(net, outer.inner, rank, step)
            outer.step()
            outer.inner.zero_grad()
        straight = _flat(net)
        def resumed_run():
            # The same outer state each time (loading copies it); torch's optimizers do not copy
            # theirs, hence a fresh model and inner state from the bytes.
            fresh = torch.load(io.BytesIO(buffer.getvalue()))
            again = _model()
            again.load_state_dict(fresh["model"])
            inner = torch.optim.AdamW(again.parameters(), lr=0.01)
            inner.load_state_dict(fresh["inner"])
            resumed = DiLoCo(again, inner, sync_every=H, density=0.1, outer=rule)
            resumed.load_state_dict(saved["outer"])
            for step in range(5, STEPS):
                _inner_step(again, inner, rank, step)
                resumed.step()
                inner.zero_grad()
            return _flat(again)

        return torch.equal(resumed_run(), straight) and torch.equal(resumed_run(), straight)

    assert sparsecomm.simulate(2, body).results == [True, True]


def test_replicas_that_start_apart_and_bad_settings_are_refused():
    def body(rank):
        net = _model()
        if rank == 1:
            with torch.no_grad():
                net[0].bias.add_(1.0)
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        outer = DiLoCo(net, opt)
        _inner_step(net, opt, rank, 0)
        try:
            outer.step()
        except ValueError as exc:
            return str(exc)
        return "stepped"

    for msg in sparsecomm.simulate(2, body).results:
        assert "parameters differ at the start" in msg, msg

    def unlike(rank, **kw):  # one rank's DiLoCo made with other settings
        net = _model()
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        outer = DiLoCo(net, opt, **{"sync_every": H, **(kw if rank == 1 else {})})
        _inner_step(net, opt, rank, 0)
        with pytest.raises(ValueError, match=f"settings differ \\({next(iter(kw))}\\)"):
            outer.step()

    for kw in ({"outer_lr": 0.5}, {"sync_every": 2}, {"outer": "nesterov", "outer_lr": 1.0}, {"algorithm": "topka"}):
        sparsecomm.simulate(2, unlike, **kw)

    def loaded_apart(rank):  # ranks that load different outer models are refused at the next step
        net = _model()
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        outer = DiLoCo(net, opt, sync_every=H)
        _inner_step(net, opt, rank, 0)
        outer.step()
        saved = outer.state_dict()
        saved["anchor"] = saved["anchor"] + rank
        outer.load_state_dict(saved)
        with pytest.raises(ValueError, match="parameters differ"):
            outer.step()

    sparsecomm.simulate(2, loaded_apart)

    def unfrozen(rank):  # a parameter frozen when DiLoCo was made, unfrozen later
        net = _model()
        net[2].bias.requires_grad_(False)
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        outer = DiLoCo(net, opt, sync_every=H)
        net[2].bias.requires_grad_(True)
        _inner_step(net, opt, rank, 0)
        with pytest.raises(ValueError, match="frozen when DiLoCo was made"):
            outer.step()

    sparsecomm.simulate(2, unfrozen)
    net = _model()
    sgd = torch.optim.SGD(net.parameters(), lr=0.1)
    for kw, match in (({"sync_every": 0}, "sync_every"), ({"outer": "adam"}, "outer must be"),
                      ({"outer_lr": -1.0}, "outer_lr"), ({"density": 2.0}, "density")):
        with pytest.raises(ValueError, match=match):
            DiLoCo(net, sgd, **kw)
    with pytest.raises(ValueError, match="inner optimizer must step every parameter"):
        DiLoCo(net, torch.optim.SGD(list(net.parameters())[:1], lr=0.1))
    with pytest.raises(ValueError, match="the model or its parameters"):
        DiLoCo([{"params": list(net.parameters())}], sgd)


def test_a_grad_scaler_skips_an_overflowing_inner_step_on_its_rank_and_the_round_goes_on():
    def body(rank):
        net = _model()
        inner = torch.optim.AdamW(net.parameters(), lr=0.01)
        outer = DiLoCo(net, inner, sync_every=H, density=0.1)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
        moved, synced = [], []
        for step in range(STEPS):
            x, y = _batch(rank, step)
            loss = torch.nn.functional.cross_entropy(net(x), y) * (float("inf") if (rank, step) == (1, 4) else 1)
            scaler.scale(loss).backward()
            before = _flat(net).clone()
            outer.step(scaler=scaler)
            inner.zero_grad()
            moved.append(not torch.equal(before, _flat(net)))
            if outer.synced:
                synced.append(_flat(net).clone())
        return moved, synced, outer.outer_steps, outer.discarded

    out = sparsecomm.simulate(2, body).results
    (moved0, synced0, steps0, discarded0), (moved1, synced1, steps1, _) = out
    assert moved1[4] is False and moved0[4] is True  # skipped on the overflowing rank only
    assert steps0 == steps1 == STEPS // H and discarded0 == 0
    assert all(torch.equal(a, b) and bool(torch.isfinite(a).all()) for a, b in zip(synced0, synced1))


def test_a_bfloat16_model_keeps_a_float32_outer_model_and_equal_replicas():
    def body(rank):
        net = _model().to(torch.bfloat16)
        inner = torch.optim.AdamW(net.parameters(), lr=0.01)
        outer = DiLoCo(net, inner, sync_every=H, density=0.1)
        start = _flat(net).float().clone()
        for step in range(STEPS):
            x, y = _batch(rank, step)
            torch.nn.functional.cross_entropy(net(x.to(torch.bfloat16)).float(), y).backward()
            outer.step()
            inner.zero_grad()
        assert outer.anchor.dtype == torch.float32 and all(p.dtype == torch.bfloat16 for p in net.parameters())
        return _flat(net).float(), outer.anchor.to(torch.bfloat16).float(), start

    out = sparsecomm.simulate(2, body).results
    for final, anchor, start in out:
        assert torch.equal(final, out[0][0]) and torch.equal(final, anchor) and not torch.equal(final, start)

    def still(rank, algorithm):
        # A float32 outer model off the bfloat16 grid, replicas that never move: the
        # pseudo-gradient is zero (taken from where the replicas began, the outer model
        # rounded), so nothing drifts, neither by rounding nor through the residual.
        net = torch.nn.Linear(64, 64, bias=False)
        with torch.no_grad():
            net.weight.copy_(torch.randn(64, 64, generator=torch.Generator().manual_seed(0)))
        net.to(torch.bfloat16)
        inner = torch.optim.SGD(net.parameters(), lr=0.1)
        outer = DiLoCo(net, inner, sync_every=1, density=0.01, algorithm=algorithm)
        off_grid = outer.anchor + torch.linspace(0, 1, outer.anchor.numel()) * 2.0 ** -9
        outer.anchor = off_grid.clone()
        with torch.no_grad():
            net.weight.copy_(off_grid.view(64, 64))  # the replicas where a round would start them
        for _ in range(20):
            net.weight.grad = torch.zeros_like(net.weight)
            outer.step()
        return torch.equal(outer.anchor, off_grid) and torch.equal(_flat(net), off_grid.to(torch.bfloat16))

    for algorithm in ("dense", "topka", "oktopk"):
        assert sparsecomm.simulate(2, still, algorithm).results == [True, True]


def _gloo_body(rank, size):
    plain, _, _, _ = _run(rank, algorithm="oktopk", density=0.2)
    under_ddp, _, _, _ = _run(rank, algorithm="oktopk", density=0.2, ddp=True)
    return _flat(plain), _flat(under_ddp)


@pytest.mark.slow
@pytest.mark.gloo
def test_on_gloo_under_ddp_with_the_local_hook_the_same_bits_as_without():
    out = engines.run_gloo(2, _gloo_body)
    assert all(torch.equal(plain, out[0][0]) and torch.equal(ddp, plain) for plain, ddp in out)
