"""FrozenVarianceAdamW: AdamW until it freezes, then a fixed-scale momentum step."""

from __future__ import annotations

import io
import math

import pytest
import torch

import sparsecomm
from sparsecomm.optim import FrozenVarianceAdamW


def _grads(step: int, shapes) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return [torch.randn(s, generator=g) for s in shapes]


def _run(opt_cls, steps: int, **kw) -> tuple[list[torch.Tensor], torch.optim.Optimizer]:
    with torch.random.fork_rng():
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(5, 3)), torch.nn.Parameter(torch.randn(7))]
    opt = opt_cls(params, lr=0.01, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, **kw)
    for step in range(steps):
        for p, g in zip(params, _grads(step, [p.shape for p in params])):
            p.grad = g
        opt.step()
    return [p.detach().clone() for p in params], opt


def test_until_it_freezes_it_is_adamw():
    got, _ = _run(FrozenVarianceAdamW, 6, freeze_after=6)
    want, _ = _run(torch.optim.AdamW, 6, foreach=False)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_after_it_freezes_the_second_moment_stays_and_the_step_is_the_fixed_scale_formula():
    params, opt = _run(FrozenVarianceAdamW, 4, freeze_after=3)
    p = opt.param_groups[0]["params"][0]
    st = opt.state[p]
    v3 = st["exp_avg_sq"].clone()
    m4 = st["exp_avg"].clone()
    g5 = _grads(4, [q.shape for q in opt.param_groups[0]["params"]])
    before = p.detach().clone()
    for q, g in zip(opt.param_groups[0]["params"], g5):
        q.grad = g
    opt.step()
    assert torch.equal(st["exp_avg_sq"], v3)  # frozen since step 3
    b1, b2, lr, wd, eps = 0.9, 0.95, 0.01, 0.1, 1e-8
    m5 = b1 * m4 + (1 - b1) * g5[0]
    want = before * (1 - lr * wd) - lr / (1 - b1 ** 5) * m5 / ((v3 / (1 - b2 ** 3)).sqrt() + eps)
    torch.testing.assert_close(p.detach(), want, rtol=1e-6, atol=1e-7)


def test_a_burst_moves_the_weight_by_the_steps_it_stands_for():
    # Error feedback sends s steps of gradient at once. Frozen, the update is linear in the
    # gradient: one burst of s * g moves a coordinate as far as s steps of g would (momentum
    # aside); AdamW's second moment swallows about half of it.
    def move(cls, burst: bool, **kw):
        p = torch.nn.Parameter(torch.zeros(1))
        opt = cls([p], lr=0.01, betas=(0.0, 0.95), weight_decay=0.0, **kw)
        for _ in range(20):  # warm-up: the same gradient every step
            p.grad = torch.ones(1)
            opt.step()
        start = float(p.detach())
        for t in range(8):
            p.grad = torch.full((1,), 8.0 if t == 7 else 0.0) if burst else torch.ones(1)
            opt.step()
        return float(p.detach()) - start

    frozen_burst, frozen_steady = move(FrozenVarianceAdamW, True, freeze_after=20), \
        move(FrozenVarianceAdamW, False, freeze_after=20)
    adam_burst, adam_steady = move(torch.optim.AdamW, True), move(torch.optim.AdamW, False)
    assert math.isclose(frozen_burst, frozen_steady, rel_tol=1e-4)
    assert abs(adam_burst) < 0.7 * abs(adam_steady)  # about half of it


def test_checkpoint_round_trip_and_bad_arguments():
    _, opt = _run(FrozenVarianceAdamW, 3, freeze_after=2)
    blob = io.BytesIO()
    torch.save(opt.state_dict(), blob)
    blob.seek(0)
    params = [torch.nn.Parameter(torch.zeros(5, 3)), torch.nn.Parameter(torch.zeros(7))]
    again = FrozenVarianceAdamW(params, freeze_after=99)
    again.load_state_dict(torch.load(blob))
    assert again.param_groups[0]["freeze_after"] == 2
    assert again.state[params[0]]["step"] == 3
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="freeze_after"):
            FrozenVarianceAdamW(params, freeze_after=bad)
    with pytest.raises(ValueError, match="betas"):
        FrozenVarianceAdamW(params, betas=(1.0, 0.9))


def test_it_trains_under_the_ddp_hook_in_the_simulated_world_alike_on_every_rank():
    # Dense warm-up steps while the moment is measured, then Ok-Topk: every rank holds the same model.
    def body(rank: int):
        with torch.random.fork_rng():
            torch.manual_seed(0)
            model = torch.nn.Sequential(torch.nn.Linear(20, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
        opt = FrozenVarianceAdamW(model.parameters(), lr=0.01, freeze_after=3)
        reducer = sparsecomm.optim.SparseGradientReducer(model.parameters(), density=0.1)
        g = torch.Generator().manual_seed(rank)
        for step in range(8):
            x, y = torch.randn(16, 20, generator=g), torch.randint(0, 4, (16,), generator=g)
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            if step < 3:
                for p in model.parameters():
                    p.grad.copy_(sparsecomm.allreduce(p.grad, 1.0, algorithm="dense", op="avg"))
            else:
                reducer.reduce()
            opt.step()
        return [p.detach().clone() for p in model.parameters()]

    out = sparsecomm.simulate(3, body, timeout=60).results
    assert all(torch.equal(a, b) for o in out for a, b in zip(o, out[0]))
    assert all(bool(torch.isfinite(p).all()) for p in out[0])
