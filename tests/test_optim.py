"""SparseAdamW: torch's AdamW through the warm-up, a hand-written reference after it,
identical ranks, conservation, refused steps, the loss scaler, checkpoints, DDP."""

from __future__ import annotations

import copy
import io
import math

import pytest
import torch

import sparsecomm
from sparsecomm.optim import COMPRESS_MODES, SparseAdamW, local_gradient_hook
from reference import ref_cltk

with torch.random.fork_rng():
    torch.manual_seed(0)
    _MODEL = torch.nn.Sequential(torch.nn.Linear(12, 24), torch.nn.Tanh(), torch.nn.Linear(24, 5))

BETAS, EPS, WD, LR = (0.9, 0.95), 1e-8, 0.01, 1e-2
MODES = [("local", c) for c in ("preconditioned", "momentum")] + [("frozen", c) for c in COMPRESS_MODES]


def _batch(rank: int, step: int):
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(16, 12, generator=g), torch.randint(0, 5, (16,), generator=g)


def _backward(model, rank, step):
    x, y = _batch(rank, step)
    model.zero_grad(set_to_none=True)
    torch.nn.functional.cross_entropy(model(x), y).backward()


def _flat(model) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _opt(model, **kw):
    kw = {"lr": LR, "betas": BETAS, "eps": EPS, "weight_decay": WD, "density": 0.1, **kw}
    return SparseAdamW(model.parameters(), comm=sparsecomm.comm.sim.current_sim_comm(), **kw)


@pytest.mark.parametrize("P", [1, 3])
def test_warmup_steps_are_torch_adamw_on_the_averaged_gradient(P):
    steps = 5

    def body(rank):
        model = copy.deepcopy(_MODEL)
        opt = _opt(model, warmup_steps=steps)
        for s in range(steps):
            _backward(model, rank, s)
            opt.step()
        return _flat(model)

    out = sparsecomm.simulate(P, body).results
    ref = copy.deepcopy(_MODEL)
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    for s in range(steps):
        grads = []
        for r in range(P):
            _backward(ref, r, s)
            grads.append([p.grad.clone() for p in ref.parameters()])
        for i, p in enumerate(ref.parameters()):
            p.grad = sum(g[i] for g in grads) / P
        opt.step()
    for o in out:
        torch.testing.assert_close(o, _flat(ref), rtol=1e-5, atol=1e-6)


def _reference(P: int, steps: int, warmup: int, variance: str, compress: str, density: float,
               interval: int = 0, masking: bool = False) -> torch.Tensor:
    """The class docstring written out, with CLT-k's exact semantics (leader = sparse call mod P)."""
    b1, b2 = BETAS
    model = copy.deepcopy(_MODEL)
    params = list(model.parameters())
    n = sum(p.numel() for p in params)
    w = _flat(model).clone()
    m, v = torch.zeros(n), torch.zeros(n)
    v_rank = [None] * P
    u = [None] * P
    res = [torch.zeros(n) for _ in range(P)]
    denom = None
    calls = 0

    def set_w(vec):
        off = 0
        with torch.no_grad():
            for p in params:
                p.copy_(vec[off:off + p.numel()].view_as(p))
                off += p.numel()

    def dn(vv, t, floor):
        root = (vv / (1 - b2 ** t)).sqrt()
        if floor:
            off = 0
            for p in params:
                part = root[off:off + p.numel()]
                part.clamp_(min=0.1 * float(part.mean()))
                off += p.numel()
        return root + EPS

    def sparse_avg(vectors):
        nonlocal calls
        acc = [res[r] + vectors[r] for r in range(P)]
        total = ref_cltk(acc, density, calls % P)
        idx = total != 0
        for r in range(P):
            res[r] = acc[r].clone()
            res[r][idx] = 0.0
        calls += 1
        return total / P

    for t in range(1, steps + 1):
        grads = []
        for r in range(P):
            set_w(w)
            _backward(model, r, t - 1)
            grads.append(torch.cat([p.grad.reshape(-1) for p in params]))
        refresh = variance == "frozen" and interval and t > warmup and (t - warmup) % interval == 0
        if t <= warmup or refresh:
            g = sum(grads) / P
        if t <= warmup:
            m = b1 * m + (1 - b1) * g
            v = b2 * v + (1 - b2) * g * g
            d = (m / (1 - b1 ** t)) / dn(v, t, False)
        else:
            if denom is None:
                denom = dn(v, t - 1, variance == "frozen")
                m = m / denom
                u = [m.clone() for _ in range(P)]
                v_rank = [v.clone() for _ in range(P)]
            if refresh:
                bb = b2 ** interval
                v = bb * v + (1 - bb) * g * g
                new = dn(v, t, True)
                factor = denom / new
                denom = new
                if compress != "gradient":  # the gradient's residual has no new units
                    res = [x * factor for x in res]
                m = b1 * (m * factor) + (1 - b1) * g / new
                d = m / (1 - b1 ** t)
            else:
                if variance == "local":
                    v_rank = [b2 * v_rank[r] + (1 - b2) * grads[r] ** 2 for r in range(P)]
                    dens = [dn(v_rank[r], t, False) for r in range(P)]
                else:
                    dens = [denom] * P
                if compress == "gradient":
                    r_ = sparse_avg(grads) / denom
                elif compress == "preconditioned":
                    r_ = sparse_avg([grads[r] / dens[r] for r in range(P)])
                else:
                    u = [b1 * u[r] + (1 - b1) * grads[r] / dens[r] for r in range(P)]
                    r_ = sparse_avg(u)
                    if masking:  # every rank contributed at the leader's indexes
                        u = [torch.where(res[r] == 0, torch.zeros_like(u[r]), u[r]) for r in range(P)]
                if compress == "momentum":
                    d = r_ / (1 - b1 ** t)
                else:
                    m = b1 * m + (1 - b1) * r_
                    d = m / (1 - b1 ** t)
        w = w * (1 - LR * WD) - LR * d
    return w


@pytest.mark.parametrize("P", [2, 3])
@pytest.mark.parametrize("variance,compress", MODES + [("frozen-refresh", "preconditioned"),
                                                        ("frozen-refresh", "gradient"),
                                                        ("local-masked", "momentum")])
def test_follows_the_hand_written_reference(P, variance, compress):
    steps, warmup, density = 9, 3, 0.1
    interval = 3 if variance == "frozen-refresh" else 0
    masking = variance == "local-masked"
    variance = variance.split("-")[0]

    def body(rank):
        model = copy.deepcopy(_MODEL)
        opt = _opt(model, algorithm="cltk", density=density, warmup_steps=warmup, variance=variance,
                   compress=compress, variance_interval=interval, momentum_masking=masking)
        for s in range(steps):
            _backward(model, rank, s)
            opt.step()
        return _flat(model)

    out = sparsecomm.simulate(P, body).results
    ref = _reference(P, steps, warmup, variance, compress, density, interval, masking)
    for o in out:
        torch.testing.assert_close(o, ref, rtol=1e-4, atol=1e-6)


def _recording(opt):
    """Record every sparse reduction's input and result (for conservation)."""
    fed, got = [], []
    inner = opt._reduce

    def reduce(flat, sparse):
        if sparse:
            fed.append(flat.clone())
        out = inner(flat, sparse)
        if sparse:
            got.append(out.clone())
        return out

    opt._reduce = reduce
    return fed, got


@pytest.mark.parametrize("P", [1, 3, 4, 5])
@pytest.mark.parametrize("variance,compress", MODES)
def test_identical_ranks_and_nothing_lost(P, variance, compress):
    """Every rank ends with the same parameters; what was sent plus the residuals equals
    everything fed to the sparse allreduces (in their units)."""

    def body(rank):
        model = copy.deepcopy(_MODEL)
        opt = _opt(model, algorithm="oktopk", density=0.05, warmup_steps=2, variance=variance, compress=compress,
                   algorithm_options={"tau": 3, "tau_prime": 6})
        fed, got = _recording(opt)
        for s in range(10):
            _backward(model, rank, s)
            opt.step()
        return _flat(model), sum(fed).double(), sum(got).double(), opt.residual().double()

    out = sparsecomm.simulate(P, body).results
    for o in out:
        assert torch.equal(o[0], out[0][0])
        assert torch.equal(o[2], out[0][2])  # the results are the same on every rank
    fed = sum(o[1] for o in out)
    torch.testing.assert_close(out[0][2] * P + sum(o[3] for o in out), fed, rtol=1e-5, atol=1e-5)


def test_a_bfloat16_residual_loses_only_its_rounding():
    P = 3

    def body(rank, dtype):
        model = copy.deepcopy(_MODEL)
        opt = _opt(model, density=0.05, warmup_steps=2, residual_dtype=dtype,
                   algorithm_options={"tau": 3, "tau_prime": 6})
        fed, got = _recording(opt)
        for s in range(10):
            _backward(model, rank, s)
            opt.step()
        assert opt.flat_state["residual"] is None or opt.flat_state["residual"].dtype == torch.bfloat16
        return _flat(model), sum(fed).double(), sum(got).double(), opt.residual().double()

    out = sparsecomm.simulate(P, body, torch.bfloat16).results
    fed = sum(o[1] for o in out)
    lost = (out[0][2] * P + sum(o[3] for o in out) - fed).abs()
    # bfloat16 keeps 8 bits: each rounding is within 2^-8 of the residual's size.
    scale = sum(o[3].abs() for o in out) + sum(o[1].abs() for o in out) / 10
    assert lost.max() > 0  # the rounding is really there
    assert (lost <= 8 * 2 ** -8 * scale + 1e-7).all()
    full = sparsecomm.simulate(P, body, torch.float32).results
    assert not torch.equal(out[0][0], full[0][0])
    # A rounded residual may flip a selection here and there: close on average, not bit for bit.
    assert float((out[0][0] - full[0][0]).abs().mean()) < 0.01 * float(full[0][0].abs().mean())


def _state(opt, model):
    return (_flat(model).clone(), opt.flat_state["m"].clone(), opt.flat_state["v"].clone(), opt.residual(),
            opt.flat_state["step"])


@pytest.mark.parametrize("P", [2, 3])
@pytest.mark.parametrize("at", [1, 6])  # in the warm-up, after it
def test_a_nonfinite_gradient_on_one_rank_skips_the_step_on_every_rank(P, at):
    def body(rank):
        model = copy.deepcopy(_MODEL)
        opt = _opt(model, warmup_steps=3)
        raised = []
        for s in range(9):
            _backward(model, rank, s)
            if s == at and rank == P - 1:
                next(model.parameters()).grad[0, 0] = math.nan
            before = _state(opt, model)
            try:
                opt.step()
            except sparsecomm.NonFiniteError as exc:
                raised.append((s, exc.ranks))
                after = _state(opt, model)
                assert all(torch.equal(a, b) for a, b in zip(before[:3], after[:3])) and before[4] == after[4]
                # The allreduce rolls its residual back by subtracting what it added: to rounding.
                torch.testing.assert_close(after[3], before[3], rtol=1e-6, atol=1e-6)
        return raised, _flat(model)

    out = sparsecomm.simulate(P, body).results
    for raised, params in out:
        assert raised == [(at, [P - 1])]
        assert torch.equal(params, out[0][1])


def test_a_grad_scaler_skips_an_overflowing_step_on_every_rank():
    P = 3

    def body(rank):
        model = copy.deepcopy(_MODEL)
        opt = _opt(model, warmup_steps=2)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
        skipped = []
        for s in range(7):
            x, y = _batch(rank, s)
            opt.zero_grad()
            scaler.scale(torch.nn.functional.cross_entropy(model(x), y)).backward()
            if s == 4 and rank == 0:
                next(model.parameters()).grad[0, 0] = math.inf
            before = _state(opt, model)
            scaler.step(opt)
            scaler.update()
            if torch.equal(before[0], _flat(model)):
                skipped.append(s)
        return skipped, _flat(model), scaler.get_scale()

    out = sparsecomm.simulate(P, body).results
    for skipped, params, _ in out:
        assert skipped == [4]
        assert torch.equal(params, out[0][1])
    assert out[0][2] == 2.0 ** 7 and out[1][2] == 2.0 ** 8  # each rank's scaler saw its own overflow


def test_a_loss_scale_changes_nothing():
    """Gradients scaled by the GradScaler are unscaled before they are sent: the run equals the
    unscaled one to rounding."""
    P = 2

    def body(rank, scaled):
        model = copy.deepcopy(_MODEL)
        opt = _opt(model, warmup_steps=2)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, enabled=scaled)
        for s in range(6):
            x, y = _batch(rank, s)
            opt.zero_grad()
            scaler.scale(torch.nn.functional.cross_entropy(model(x), y)).backward()
            scaler.step(opt)
            scaler.update()
        return _flat(model)

    a = sparsecomm.simulate(P, body, True).results[0]
    b = sparsecomm.simulate(P, body, False).results[0]
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("variance,compress", MODES)
def test_a_checkpoint_resumes_bit_for_bit(variance, compress):
    P = 3

    def body(rank, restart):
        model = copy.deepcopy(_MODEL)
        kw = {"warmup_steps": 2, "variance": variance, "compress": compress,
              "residual_dtype": torch.bfloat16 if compress == "momentum" else torch.float32}
        opt = _opt(model, **kw)
        for s in range(10):
            if s == restart:
                buf = io.BytesIO()
                torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
                buf.seek(0)
                saved = torch.load(buf, weights_only=False)
                model = copy.deepcopy(_MODEL)
                model.load_state_dict(saved["model"])
                opt = _opt(model, **kw)
                opt.load_state_dict(saved["opt"])
            _backward(model, rank, s)
            opt.step()
        return _flat(model)

    plain = sparsecomm.simulate(P, body, -1).results
    for restart in (1, 5):
        resumed = sparsecomm.simulate(P, body, restart).results
        assert all(torch.equal(a, b) for a, b in zip(plain, resumed))


@pytest.mark.parametrize("saved_dtype,loaded_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                                      (torch.float32, torch.bfloat16)])
def test_a_state_dict_in_memory_is_a_copy_and_loads_into_either_residual_dtype(saved_dtype, loaded_dtype):
    # No torch.save between: the saver trains on, the dict stays; loaded twice, the same run
    # twice; a residual saved in one dtype is where the loader keeps its own (and keeps feeding back).
    def body(rank):
        model = copy.deepcopy(_MODEL)
        opt = _opt(model, warmup_steps=1, compress="preconditioned", residual_dtype=saved_dtype)
        for s in range(3):
            _backward(model, rank, s)
            opt.step()
        saved, weights = opt.state_dict(), copy.deepcopy(model.state_dict())
        residual = opt.residual().clone()
        _backward(model, rank, 3)
        opt.step()
        runs = []
        for _ in range(2):
            again = copy.deepcopy(_MODEL)
            again.load_state_dict(weights)
            loaded = _opt(again, warmup_steps=1, compress="preconditioned", residual_dtype=loaded_dtype)
            loaded.load_state_dict(saved)
            expect = residual if loaded_dtype == torch.float32 else residual.to(torch.bfloat16).float()
            assert torch.equal(loaded.residual(), expect) and bool(residual.ne(0).any())
            for s in (3, 4):
                _backward(again, rank, s)
                loaded.step()
            runs.append((_flat(again), loaded.residual()))
        moved = not torch.equal(runs[0][1], residual)  # the residual kept changing after the load
        return torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1]) and moved

    assert sparsecomm.simulate(2, body).results == [True, True]


def test_a_parameter_frozen_later_stays_put_and_the_others_keep_their_places():
    # One step, the first layer's bias frozen after the optimizer was made, against the same
    # step with that bias's gradient absent: every other parameter moves the same.
    def body(rank, freeze):
        model = copy.deepcopy(_MODEL)
        opt = _opt(model, warmup_steps=0)
        bias = list(model.parameters())[1]
        before = bias.detach().clone()
        _backward(model, rank, 0)
        if freeze:
            bias.requires_grad_(False)
        bias.grad = None
        opt.step()
        others = [p.detach().clone() for p in model.parameters() if p is not bias]
        return others, torch.equal(bias, before)

    frozen = sparsecomm.simulate(2, body, True).results
    plain = sparsecomm.simulate(2, body, False).results
    for (others, still), (ref, _) in zip(frozen, plain):
        assert still and all(torch.equal(a, b) for a, b in zip(others, ref))


def test_other_settings_and_replicas_that_start_apart_are_refused():
    def unlike(rank, **kw):
        model = copy.deepcopy(_MODEL)
        opt = _opt(model, **(kw if rank == 1 else {}))
        _backward(model, rank, 0)
        with pytest.raises(ValueError, match=f"settings differ \\(.*{next(iter(kw))}"):
            opt.step()

    for kw in ({"lr": 0.5}, {"density": 0.2}, {"compress": "preconditioned"}, {"warmup_steps": 3}):
        sparsecomm.simulate(2, unlike, **kw)

    def apart(rank):
        model = copy.deepcopy(_MODEL)
        with torch.no_grad():
            next(model.parameters()).add_(rank)
        opt = _opt(model)
        _backward(model, rank, 0)
        with pytest.raises(ValueError, match="parameters differ"):
            opt.step()

    sparsecomm.simulate(2, apart)


def test_another_models_state_is_refused():
    opt = SparseAdamW(copy.deepcopy(_MODEL).parameters())
    other = SparseAdamW(torch.nn.Linear(3, 3).parameters())
    with pytest.raises(ValueError, match="a state of 12 elements in 1 groups, this optimizer has 437 in 1"):
        opt.load_state_dict(other.state_dict())


@pytest.mark.parametrize("kwargs,match", [
    ({"compress": "sign"}, "compress must be one of"),
    ({"variance": "global"}, "variance must be one of"),
    ({"variance": "frozen", "warmup_steps": 0}, "warmup_steps must be an integer >= 1 with variance='frozen'"),
    ({"warmup_steps": -1}, "warmup_steps must be an integer >= 0"),
    ({"compress": "gradient"}, "need variance='frozen'"),
    ({"variance_interval": 5}, "need variance='frozen'"),
    ({"variance": "frozen", "variance_interval": 5}, "with 'momentum' a refresh would step each rank"),
    ({"residual_dtype": torch.float16}, "residual_dtype must be"),
    ({"compress": "preconditioned", "momentum_masking": True}, "True needs compress='momentum'"),
    ({"betas": (0.9, 1.0)}, "betas must lie in"),
    ({"lr": -1.0}, "must be >= 0"),
    ({"algorithm": "oktopk", "algorithm_options": {"error_feedback": False}}, "with error feedback"),
])
def test_bad_settings_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SparseAdamW(copy.deepcopy(_MODEL).parameters(), **kwargs)


def test_groups_share_betas():
    m = copy.deepcopy(_MODEL)
    with pytest.raises(ValueError, match="betas and eps must be the same"):
        SparseAdamW([{"params": m[0].parameters()}, {"params": m[2].parameters(), "betas": (0.8, 0.9)}])


def _ddp_worker(rank, size):
    from torch.nn.parallel import DistributedDataParallel as DDP

    plain = copy.deepcopy(_MODEL)
    ddp = DDP(copy.deepcopy(_MODEL))
    ddp.register_comm_hook(None, local_gradient_hook)
    opts = [SparseAdamW(m.parameters(), lr=LR, warmup_steps=2, density=0.1) for m in (plain, ddp)]
    for s in range(6):
        for m, opt in zip((plain, ddp), opts):
            _backward(m, rank, s)
            opt.step()
    return _flat(plain), _flat(ddp.module)


@pytest.mark.slow
@pytest.mark.gloo
def test_under_ddp_with_the_local_gradient_hook_on_gloo():
    """DDP with the hook hands each rank its own gradient: the same bits as no DDP, on every rank."""
    from sparsecomm.tools.launch import spawn

    out = spawn(3, _ddp_worker, timeout=300)
    for plain, ddp in out:
        assert torch.equal(plain, ddp)
        assert torch.equal(plain, out[0][0])


def test_the_density_warmup_selects_more_first_and_loses_nothing():
    """DGC's warm-up: four geometric stages from start_density down to density; the residual
    moves from stage to stage, so conservation holds across them."""
    P, n = 3, sum(p.numel() for p in _MODEL.parameters())

    def body(rank):
        model = copy.deepcopy(_MODEL)
        opt = _opt(model, algorithm="topka", density=0.01, warmup_steps=2, density_warmup=8, start_density=0.16)
        fed, got = _recording(opt)
        ks = []
        for s in range(12):
            _backward(model, rank, s)
            opt.step()
            ks.append(opt.last_call["k"] if not opt.last_call["dense"] else None)
        return _flat(model), sum(fed).double(), sum(got).double(), opt.residual().double(), ks

    out = sparsecomm.simulate(P, body).results
    expected = [math.ceil(d * n) for d in (0.16, 0.16, 0.08, 0.08, 0.04, 0.04, 0.02, 0.02, 0.01, 0.01)]
    assert out[0][4] == [None, None, *expected]
    for o in out:
        assert torch.equal(o[0], out[0][0])
    fed = sum(o[1] for o in out)
    torch.testing.assert_close(out[0][2] * P + sum(o[3] for o in out), fed, rtol=1e-5, atol=1e-5)


def test_momentum_masking_is_on_by_default_where_it_applies():
    params = copy.deepcopy(_MODEL).parameters
    assert SparseAdamW(params()).momentum_masking is True  # compress="momentum", the default
    assert SparseAdamW(params(), compress="preconditioned").momentum_masking is False
    assert SparseAdamW(params(), momentum_masking=False).momentum_masking is False
