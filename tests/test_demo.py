"""Decoupled momentum (``sparsecomm.optim.DeMo``): against a hand-written DeMo on 2 and 3 ranks
(its DCT written out as sums of cosines), equal replicas after every step, both error-feedback
rules, NaN steps, a GradScaler, bfloat16 models, checkpoints, refusals."""

from __future__ import annotations

import io
import math

import pytest
import torch

import engines
import sparsecomm
from sparsecomm.demo import dct_matrix
from sparsecomm.optim import DeMo

STEPS, CHUNK, TOPK = 4, 16, 3


def _model(dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    gen = torch.Generator().manual_seed(0)  # every replica starts from the same weights
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(0.3 * torch.randn(p.shape, generator=gen))
    return net.to(dtype)


def _backward(net, rank, step, poison=False):
    gen = torch.Generator().manual_seed(1000 * rank + step)
    x, y = torch.randn(12, 8, generator=gen), torch.randint(0, 4, (12,), generator=gen)
    loss = torch.nn.functional.cross_entropy(net(x.to(next(net.parameters()).dtype)).float(), y)
    (loss * (float("nan") if poison else 1.0)).backward()


def _flat(net) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).float() for p in net.parameters()])


def _run(rank, steps=STEPS, poison_at=None, ddp=False, trace=None, chunk=CHUNK, **kw):
    net = _model()
    opt = DeMo(net.parameters(), lr=0.01, chunk=chunk, topk=TOPK, **kw)
    if ddp:  # DDP hands each rank its own gradient: DeMo reduces
        from torch.nn.parallel import DistributedDataParallel

        from sparsecomm.optim import local_gradient_hook

        forward = DistributedDataParallel(net)
        forward.register_comm_hook(None, local_gradient_hook)
    errors = []
    for step in range(steps):
        opt.zero_grad()
        _backward(forward if ddp else net, rank, step, poison=poison_at == (rank, step))
        try:
            opt.step()
        except sparsecomm.NonFiniteError:
            errors.append(step)
        if trace is not None:
            trace.append(_flat(net))
    return net, opt, errors


def _cosines(size: int) -> list[list[float]]:
    """The orthonormal DCT-II written out, entry by entry (float64)."""
    return [[math.sqrt((1 if k == 0 else 2) / size) * math.cos(math.pi * (2 * i + 1) * k / (2 * size))
             for i in range(size)] for k in range(size)]


def _chunk_order(net, tile) -> list[list[int]]:
    """Per parameter, the flat index of each entry of its chunks, chunk by chunk, each row-major
    (-1: padding), written out: 2-D tiles where the parameter, seen as (its first dimension, the
    rest), divides into h x w tiles; runs of h * w entries otherwise."""
    h, w = tile
    orders = []
    for p in net.parameters():
        rows = p.shape[0]
        cols = p.numel() // rows
        if h > 1 and p.dim() >= 2 and rows % h == 0 and cols % w == 0:
            orders.append([(tr * h + i) * cols + tc * w + j for tr in range(rows // h) for tc in range(cols // w)
                           for i in range(h) for j in range(w)])
        else:
            padded = math.ceil(p.numel() / (h * w)) * h * w
            orders.append([i if i < p.numel() else -1 for i in range(padded)])
    return orders


def _reference(P, update, lr=0.01, decay=0.999, weight_decay=0.0, variance_decay=0.95, eps=1e-8,
               tile=(1, CHUNK)):
    """DeMo by hand (float64): every rank's momentum, its top components per chunk (the DCT of
    a chunk's rows and of its columns: D_h X D_w^T), their average gathered from every rank,
    the sign (or value, or value over the root of its bias-corrected running mean square) step
    on the one shared model."""
    net = _model()
    h, w = tile
    cos_h, cos_w = (torch.tensor(_cosines(side), dtype=torch.float64) for side in tile)
    orders = _chunk_order(net, tile)
    length = sum(len(o) for o in orders)

    def laid_out(tensors):
        return torch.tensor([float(t.reshape(-1)[i]) if i >= 0 else 0.0
                             for t, order in zip(tensors, orders) for i in order], dtype=torch.float64)

    def coefficients(flat):
        return torch.stack([cos_h @ c.reshape(h, w) @ cos_w.T for c in flat.reshape(-1, h * w)]).reshape(-1, h * w)

    def entries(coeffs):
        return torch.stack([cos_h.T @ c.reshape(h, w) @ cos_w for c in coeffs]).reshape(-1)

    momenta = [torch.zeros(length, dtype=torch.float64) for _ in range(P)]
    mean_square = torch.zeros(length, dtype=torch.float64)
    for step in range(STEPS):
        total = torch.zeros(length // (h * w), h * w, dtype=torch.float64)
        for r in range(P):
            net.zero_grad()
            _backward(net, r, step)
            momenta[r] = decay * momenta[r] + laid_out([p.grad for p in net.parameters()])
            coeffs = coefficients(momenta[r])
            picked = torch.zeros_like(coeffs)
            for row in range(coeffs.shape[0]):
                top = torch.argsort(coeffs[row].abs(), descending=True)[:TOPK]
                picked[row, top] = coeffs[row, top]
            momenta[r] = momenta[r] - entries(picked)  # DeMo's feedback
            total += picked
        step_dir = entries(total / P)
        if update == "sign":
            step_dir = step_dir.sign()
        if update == "rms":
            mean_square = variance_decay * mean_square + (1 - variance_decay) * step_dir ** 2
            step_dir = step_dir / ((mean_square / (1 - variance_decay ** (step + 1))).sqrt() + eps)
        with torch.no_grad():
            at = 0
            for p, order in zip(net.parameters(), orders):
                p.mul_(1 - lr * weight_decay)
                flat = p.view(-1)
                for k, i in enumerate(order):
                    if i >= 0:
                        flat[i] -= lr * float(step_dir[at + k])
                at += len(order)
    return _flat(net)


def test_the_dct_is_the_cosine_sums_and_orthonormal():
    d = dct_matrix(CHUNK, torch.float64)
    torch.testing.assert_close(d, torch.tensor(_cosines(CHUNK), dtype=torch.float64))
    torch.testing.assert_close(d @ d.T, torch.eye(CHUNK, dtype=torch.float64))
    # A smooth chunk's energy sits in its first coefficients: what makes top-k of a momentum meaningful.
    smooth = torch.linspace(0, 1, CHUNK, dtype=torch.float64)
    energy = (d @ smooth) ** 2
    assert energy[:2].sum() > 0.99 * energy.sum()


@pytest.mark.parametrize("P,update,tile", [(P, u, (1, CHUNK)) for P in (2, 3) for u in ("sign", "value", "rms")]
                         + [(1, "rms", (1, CHUNK)), (5, "rms", (1, CHUNK)), (2, "rms", (2, 4)), (3, "value", (2, 4)),
                            (3, "sign", (4, 4)), (1, "rms", (4, 4)), (5, "rms", (2, 4))])
def test_topka_carries_demo_itself(P, update, tile):
    # Checks DeMo's own error feedback (each rank removes what it extracted): with TopkA the
    # allreduce sends every extracted component, so its residual stays zero. Chunks of 16
    # entries, or 2-D tiles of 2 x 4 and 4 x 4 (the weights tiled, the biases in folded runs).
    def body(rank):
        trace = []
        net, opt, _ = _run(rank, update=update, weight_decay=0.1, trace=trace,
                           chunk=tile if tile[0] > 1 else tile[1])
        assert opt.tiled == [tile[0] > 1, False, tile[0] > 1, False]
        return _flat(net), opt.residual.abs().max().item(), trace

    out = sparsecomm.simulate(P, body).results
    expected = _reference(P, update, weight_decay=0.1, tile=tile)
    for got, leftover, trace in out:
        assert torch.equal(got, out[0][0])  # every replica the same, bit for bit
        assert all(torch.equal(a, b) for a, b in zip(trace, out[0][2]))  # and after every step
        assert len(trace) == STEPS and leftover == 0.0
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("P", [2, 3, 5])
def test_oktopk_by_default_has_room_for_every_ranks_components(P):
    # By default Ok-Topk's k (a count of the sum's entries) is P x each rank's components: it
    # carries DeMo itself up to its threshold estimates, leaving under a quarter of what it
    # leaves with room for one rank's (conserved either way: the test below).
    def leftover(rank, **kw):
        _, opt, _ = _run(rank, algorithm="oktopk", update="value", **kw)
        assert opt.sparse_state.density == pytest.approx(kw.get("reduce_density", P * TOPK / CHUNK))
        return opt.residual.abs().sum().item()

    default = sum(sparsecomm.simulate(P, lambda r: leftover(r)).results)
    one_ranks = sum(sparsecomm.simulate(P, lambda r: leftover(r, reduce_density=TOPK / CHUNK)).results)
    assert default < 0.25 * one_ranks


def _conserved_run(P, chunk=CHUNK, **kw):
    """DeMo's value update at lr 1 on P ranks, what every rank extracted recorded.

    Checks the allreduce's error feedback: summed over ranks and steps, the extracted
    components equal what moved the model (minus P times the parameters' change) plus what
    the allreduce's residuals hold; and every replica is the same after every step. Returns
    the residuals' sum, in the parameters' basis."""
    def body(rank):
        net = _model()
        start = _flat(net)
        opt = DeMo(net.parameters(), lr=1.0, chunk=chunk, topk=TOPK, update="value", **kw)
        extracted = torch.zeros(opt.n)
        real = opt._extract

        def recording(m):
            q, support = real(m)
            extracted.add_(q)
            return q, support

        opt._extract = recording
        trace = []
        for step in range(STEPS):
            opt.zero_grad()
            _backward(net, rank, step)
            opt.step()
            trace.append(_flat(net))
        # Where each parameter's entries lie in the chunks, in the parameter's order.
        keep = torch.cat([a + torch.tensor(order).argsort(stable=True)[len(order) - p.numel():]
                          for a, p, order in zip(opt.offsets, opt.params, _chunk_order(net, opt.tile))])
        residual = torch.zeros(opt.n) if opt.residual is None else opt.residual
        return opt.to_entries(extracted)[keep], opt.to_entries(residual)[keep], _flat(net) - start, trace

    out = sparsecomm.simulate(P, body).results
    moved = out[0][2]
    for _, _, m, trace in out:
        assert torch.equal(m, moved) and all(torch.equal(a, b) for a, b in zip(trace, out[0][3]))
    left = sum(o[1] for o in out)
    torch.testing.assert_close(sum(o[0] for o in out), -P * moved + left, rtol=1e-5, atol=1e-5)
    return left


@pytest.mark.parametrize("P,chunk", [(1, CHUNK), (2, CHUNK), (3, CHUNK), (5, CHUNK), (3, (2, 4)), (2, (4, 4))])
def test_oktopk_carries_the_summed_components_and_loses_nothing(P, chunk):
    # The allreduce's error feedback: with room for one rank's components, what Ok-Topk's
    # global selection left stays in each rank's residual; with 2-D tiles too.
    size = chunk if isinstance(chunk, int) else chunk[0] * chunk[1]
    left = _conserved_run(P, algorithm="oktopk", reduce_density=TOPK / size, chunk=chunk)
    if P > 1:
        assert left.abs().max() > 0  # the global selection did leave something


#: Carriers whose selection sends every rank's extracted components at the default density
#: (each rank's own top-k, or everything): DeMo itself, with nothing left in their residual.
EXACT_CARRIERS = ("topka", "topkdsa", "dense")


@pytest.mark.parametrize("algorithm", sparsecomm.algorithms())
def test_every_algorithm_carries_the_components_and_loses_nothing(algorithm):
    # At P = 3 and the default density (room for every rank's components).
    left = _conserved_run(3, algorithm=algorithm)
    if algorithm in EXACT_CARRIERS:
        assert float(left.abs().max()) == 0.0


@pytest.mark.parametrize("kw", [{}, {"algorithm": "oktopk", "reduce_density": TOPK / CHUNK}], ids=["topka", "oktopk"])
def test_a_nan_step_is_skipped_on_every_rank_and_training_goes_on(kw):
    # Ok-Topk with room for one rank's components leaves some in its residual: the refused
    # call must hand that residual back bit for bit, not up to a rounding.
    def body(rank):
        net, opt, errors = _run(rank, steps=2, **kw)
        before = (_flat(net), opt.momentum.clone(), opt.residual.clone())
        assert kw.get("algorithm") != "oktopk" or bool(opt.residual.ne(0).any())
        opt.zero_grad()
        _backward(net, rank, 2, poison=rank == 1)
        try:
            opt.step()
            raised = False
        except sparsecomm.NonFiniteError:
            raised = True
        same = all(torch.equal(a, b) for a, b in zip(before, (_flat(net), opt.momentum, opt.residual)))
        opt.zero_grad()
        _backward(net, rank, 3)
        opt.step()
        return raised, same, opt.skipped, _flat(net)

    out = sparsecomm.simulate(2, body).results
    for raised, same, skipped, final in out:
        assert raised and same and skipped == 1
        assert torch.equal(final, out[0][3]) and bool(torch.isfinite(final).all())


def test_a_grad_scaler_skips_an_overflow_everywhere():
    def body(rank):
        net = _model()
        opt = DeMo(net.parameters(), lr=0.01, chunk=CHUNK, topk=TOPK)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
        moved = []
        for step in range(3):
            opt.zero_grad()
            gen = torch.Generator().manual_seed(1000 * rank + step)
            x, y = torch.randn(12, 8, generator=gen), torch.randint(0, 4, (12,), generator=gen)
            loss = torch.nn.functional.cross_entropy(net(x), y) * (float("inf") if (rank, step) == (0, 1) else 1)
            scaler.scale(loss).backward()
            before = _flat(net)
            scaler.step(opt)
            scaler.update()
            moved.append(not torch.equal(before, _flat(net)))
        return moved, _flat(net)

    out = sparsecomm.simulate(2, body).results
    for moved, final in out:
        assert moved == [True, False, True]
        assert torch.equal(final, out[0][1])
    # The scaled, then unscaled, gradient steps as the plain one does (sign of the same components).
    plain = sparsecomm.simulate(2, lambda r: _flat(_run(r, steps=1)[0])).results
    scaled = sparsecomm.simulate(2, lambda r: _scaled_first_step(r)).results
    torch.testing.assert_close(scaled[0], plain[0])


def test_gradients_clipped_after_a_grad_scaler_unscales_them_step_as_clipped_plain_ones():
    # DeMo allows clipping each rank's own gradient: unscale_, clip, scaler.step must equal
    # clip and step without a scaler (scaling by a power of two is exact), and the clip bites.
    clip = 0.05

    def body(rank, scaled):
        net = _model()
        # The value update: a gradient unscaled twice, or not at all, would move it.
        opt = DeMo(net.parameters(), lr=0.01, chunk=CHUNK, topk=TOPK, update="value")
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10) if scaled else None
        norms = []
        for step in range(3):
            opt.zero_grad()
            gen = torch.Generator().manual_seed(1000 * rank + step)
            x, y = torch.randn(12, 8, generator=gen), torch.randint(0, 4, (12,), generator=gen)
            loss = torch.nn.functional.cross_entropy(net(x), y)
            if scaled:
                scaler.scale(loss).backward()
                scaler.unscale_(opt)
                norms.append(float(torch.nn.utils.clip_grad_norm_(net.parameters(), clip)))
                scaler.step(opt)
                scaler.update()
            else:
                loss.backward()
                norms.append(float(torch.nn.utils.clip_grad_norm_(net.parameters(), clip)))
                opt.step()
        return _flat(net), norms

    plain = sparsecomm.simulate(2, lambda r: body(r, False)).results
    scaled = sparsecomm.simulate(2, lambda r: body(r, True)).results
    for (a, norms), (b, scaled_norms) in zip(plain, scaled):
        assert torch.equal(a, b) and norms == scaled_norms
        assert min(norms) > 2 * clip  # every step was clipped
    unclipped = sparsecomm.simulate(2, lambda r: _flat(_run(r, steps=3, update="value")[0])).results
    assert not torch.equal(unclipped[0], plain[0][0])


def _scaled_first_step(rank):
    net = _model()
    opt = DeMo(net.parameters(), lr=0.01, chunk=CHUNK, topk=TOPK)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    gen = torch.Generator().manual_seed(1000 * rank)
    x, y = torch.randn(12, 8, generator=gen), torch.randint(0, 4, (12,), generator=gen)
    scaler.scale(torch.nn.functional.cross_entropy(net(x), y)).backward()
    scaler.step(opt)
    return _flat(net)


def test_parameter_groups_keep_their_own_rates_and_decays():
    def body(rank):
        grouped, plain = _model(), _model()
        first = list(grouped[0].parameters())
        opt = DeMo([{"params": first, "weight_decay": 0.1},
                    {"params": list(grouped[2].parameters()), "lr": 0.0}], lr=0.01, chunk=CHUNK, topk=TOPK)
        ref = DeMo(plain.parameters(), lr=0.01, weight_decay=0.1, chunk=CHUNK, topk=TOPK)
        for net, o in ((grouped, opt), (plain, ref)):
            _backward(net, rank, 0)
            o.step()
        moved = all(torch.equal(a, b) for a, b in zip(first, plain[0].parameters()))
        still = all(torch.equal(a, b) for a, b in zip(grouped[2].parameters(), _model()[2].parameters()))
        return moved and still and not torch.equal(first[0], _model()[0].weight)

    assert sparsecomm.simulate(2, body).results == [True, True]


def test_a_bfloat16_model_trains_and_its_replicas_stay_equal():
    def body(rank):
        net = _model(torch.bfloat16)
        start = _flat(net)
        opt = DeMo(net.parameters(), lr=0.01, chunk=CHUNK, topk=TOPK)
        for step in range(STEPS):
            opt.zero_grad()
            _backward(net, rank, step)
            opt.step()
        assert all(p.dtype == torch.bfloat16 for p in net.parameters()) and opt.momentum.dtype == torch.float32
        return _flat(net), start

    out = sparsecomm.simulate(2, body).results
    for final, start in out:
        assert torch.equal(final, out[0][0]) and not torch.equal(final, start)


@pytest.mark.parametrize("update", ["sign", "rms"])
def test_a_checkpoint_resumes_bit_for_bit(update):
    def body(rank):
        kw = {"algorithm": "oktopk", "reduce_density": TOPK / CHUNK, "update": update}  # a residual to carry
        net, opt, _ = _run(rank, steps=2, **kw)
        buffer = io.BytesIO()  # through torch.save and torch.load's default (weights_only)
        torch.save({"opt": opt.state_dict(), "model": net.state_dict()}, buffer)
        buffer.seek(0)
        saved = torch.load(buffer)
        for step in range(2, STEPS):
            opt.zero_grad()
            _backward(net, rank, step)
            opt.step()
        def resumed_run():
            again = _model()
            again.load_state_dict(saved["model"])
            resumed = DeMo(again.parameters(), lr=0.01, chunk=CHUNK, topk=TOPK, **kw)
            resumed.load_state_dict(saved["opt"])
            for step in range(2, STEPS):
                resumed.zero_grad()
                _backward(again, rank, step)
                resumed.step()
            return again, resumed

        again, resumed = resumed_run()
        third, once_more = resumed_run()  # the same checkpoint again: the same run (loading copies it)
        assert bool(opt.residual.ne(0).any())
        return (torch.equal(_flat(again), _flat(net)) and torch.equal(resumed.momentum, opt.momentum)
                and torch.equal(resumed.residual, opt.residual) and torch.equal(_flat(third), _flat(net))
                and torch.equal(once_more.residual, opt.residual))

    assert sparsecomm.simulate(2, body).results == [True, True]
    net = _model()
    other = DeMo(net.parameters(), chunk=8)
    with pytest.raises(ValueError, match="chunks of 16"):
        other.load_state_dict(DeMo(_model().parameters(), chunk=16).state_dict())
    with pytest.raises(ValueError, match="chunks of 2 x 4 .* chunks of 8 "):  # as many entries, other chunks
        other.load_state_dict(DeMo(_model().parameters(), chunk=(2, 4)).state_dict())
    with pytest.raises(ValueError, match="another rule"):
        DeMo(net.parameters(), update="rms").load_state_dict(DeMo(_model().parameters()).state_dict())


def test_replicas_that_start_apart_and_bad_settings_are_refused():
    def body(rank):
        net = _model()
        if rank == 1:
            with torch.no_grad():
                net[0].bias.add_(1.0)
        opt = DeMo(net.parameters())
        _backward(net, rank, 0)
        try:
            opt.step()
        except ValueError as exc:
            return str(exc)
        return "stepped"

    for msg in sparsecomm.simulate(2, body).results:
        assert "parameters differ at the start" in msg, msg

    def unlike(rank, **kw):  # one rank's DeMo made with other settings: refused on both
        net = _model()
        opt = DeMo(net.parameters(), **{"chunk": CHUNK, "topk": TOPK, **(kw if rank == 1 else {})})
        _backward(net, rank, 0)
        with pytest.raises(ValueError, match=f"settings differ \\({next(iter(kw))}\\)"):
            opt.step()

    for kw in ({"update": "rms"}, {"decay": 0.99}, {"lr": 0.5}, {"topk": 2}, {"chunk": (4, 4)},
               {"algorithm": "oktopk"}):
        sparsecomm.simulate(2, unlike, **kw)
    params = list(_model().parameters())
    for kw, match in (({"chunk": 0}, "chunk"), ({"chunk": 8, "topk": 9}, "topk"), ({"update": "adam"}, "update"),
                      ({"decay": 1.0}, "decay"), ({"lr": -1.0}, "lr"),
                      ({"update": "rms", "variance_decay": 1.0}, "variance_decay"), ({"eps": 0.0}, "eps"),
                      ({"density": 2.0}, "density"),
                      ({"reduce_density": 0.0}, "density"), ({"chunk": (2, 0)}, "chunk"),
                      ({"chunk": (2, 4, 1)}, "chunk"), ({"chunk": (2, 4), "topk": 9}, "topk"),
                      ({"algorithm": "nope"}, "nope")):
        with pytest.raises(ValueError, match=match):
            DeMo(params, **kw)
    assert DeMo(params, chunk=128, density=0.01).topk == 1 and DeMo(params, chunk=64, density=0.05).topk == 3
    assert DeMo(params, chunk=(64, 64), density=0.01).topk == 41  # a tile's entries count


def _gloo_body(rank, size):
    net, opt, _ = _run(rank, algorithm="oktopk")
    under_ddp, _, _ = _run(rank, algorithm="oktopk", ddp=True)
    rms, _, _ = _run(rank, algorithm="oktopk", update="rms")
    return _flat(net), opt.sparse_state.last.bytes_sent, _flat(under_ddp), _flat(rms)


@pytest.mark.slow
@pytest.mark.gloo
def test_on_gloo_at_three_ranks_every_replica_ends_equal_with_and_without_ddp():
    out = engines.run_gloo(3, _gloo_body)
    assert all(torch.equal(flat, out[0][0]) for flat, _, _, _ in out) and all(b > 0 for _, b, _, _ in out)
    assert all(torch.equal(ddp, flat) for flat, _, ddp, _ in out)  # the same bits under DDP's local hook
    assert all(torch.equal(rms, out[0][3]) for _, _, _, rms in out)  # "rms": v is the same everywhere
