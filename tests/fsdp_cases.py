"""Bodies of the FSDP2 tests (``tests/test_fsdp.py``), one per gloo world, importable by name:
a small model sharded with ``fully_shard``, plain FSDP/HSDP against ``sparsecomm.fsdp.enable``."""

from __future__ import annotations

import pickle

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import sparsecomm
import sparsecomm.fsdp
import sparsecomm.optim


class Net(torch.nn.Module):
    """Two blocks and a head that only even steps use (a parameter without a gradient)."""

    def __init__(self) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(0)  # every replica starts equal
        self.a, self.b, self.head = torch.nn.Linear(5, 7), torch.nn.Linear(7, 3), torch.nn.Linear(3, 3)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(0.4 * torch.randn(p.shape, generator=gen))

    def forward(self, x: torch.Tensor, step: int, detach: bool = False) -> torch.Tensor:
        y = self.b(torch.tanh(self.a(x)))
        if detach:  # only the head trains: a gradient's NaN stays where it is
            y = y.detach()
        return self.head(y) if step % 2 == 0 else y


def build(size: int, mode: str | None, hsdp: bool = False, mp: bool = False, frozen: bool = False, **kw):
    """The model sharded (flat: over every rank; HSDP: 2 x size/2, replicas on the first
    dimension; at size 2 one rank a shard, one GPU a node) and, with ``mode`` (an algorithm),
    made sparse; None: plain FSDP/HSDP. ``frozen``: the first block's bias does not train."""
    mp_policy = MixedPrecisionPolicy(reduce_dtype=torch.bfloat16) if mp else MixedPrecisionPolicy()
    mesh = init_device_mesh("cpu", (2, size // 2), mesh_dim_names=("replicate", "shard")) if hsdp else \
        init_device_mesh("cpu", (size,))
    target = mesh["shard"] if hsdp and mode is not None else mesh
    net = Net()
    net.a.bias.requires_grad_(not frozen)
    for m in (net.a, net.b, net.head):
        fully_shard(m, mesh=target, mp_policy=mp_policy)
    fully_shard(net, mesh=target, mp_policy=mp_policy)
    state = None
    if mode is None:  # the rule enable() sets: an unused parameter's gradient is zeros, not None
        net.set_reduce_scatter_unused_params(True)
    else:
        group = mesh["replicate"].get_group() if hsdp else None
        state = sparsecomm.fsdp.enable(net, algorithm=mode, replicate_group=group, **kw)
    return net, state


def batch(rank: int, step: int, micro: int = 0) -> torch.Tensor:
    return torch.randn(4, 5, generator=torch.Generator().manual_seed(1000 * rank + 10 * step + micro))


def full(net) -> torch.Tensor:
    return torch.cat([p.full_tensor().reshape(-1).float() for p in net.parameters()])


def train(net, rank: int, steps: int, accumulate: int = 1, hsdp: bool = False, start: int = 0, opt=None):
    """SGD with momentum; ``accumulate`` micro-batches a step, the others without a sync
    (flat: ``set_requires_gradient_sync``; HSDP: ``set_requires_all_reduce``)."""
    opt = opt or torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    for step in range(start, start + steps):
        opt.zero_grad()
        for micro in range(accumulate):
            last = micro == accumulate - 1
            (net.set_requires_all_reduce if hsdp else net.set_requires_gradient_sync)(last)
            net(batch(rank, step, micro), step).pow(2).sum().backward()
        opt.step()
    return opt


def equals_plain(rank: int, size: int, hsdp: bool) -> tuple:
    """Density 1 against plain FSDP/HSDP: 3 steps, and 3 steps of 4 micro-batches; unused head
    on odd steps. (TopkDSA's and TopkA's selections are exact: density 1 sends every entry.)"""
    mode = "topka" if hsdp else "topkdsa"
    out = []
    for accumulate in (1, 4):
        plain, _ = build(size, None, hsdp)
        train(plain, rank, 3, accumulate, hsdp)
        sparse, state = build(size, mode, hsdp, density=1.0)
        train(sparse, rank, 3, accumulate, hsdp)
        out.append((full(plain), full(sparse), state.totals["calls"]))
    # Dense warm-up steps are FSDP's own reductions: three of them, at any density, are plain.
    plain, _ = build(size, None, hsdp)
    train(plain, rank, 3, 1, hsdp)
    warm, state = build(size, "oktopk", hsdp, density=0.1, warmup_steps=3)
    train(warm, rank, 3, 1, hsdp)
    out.append((full(plain), full(warm), state.totals["dense_calls"]))
    # A frozen parameter: no gradient, no place in the layout; the checkpoint names the others.
    plain, _ = build(size, None, hsdp, frozen=True)
    train(plain, rank, 3, 1, hsdp)
    sparse, state = build(size, mode, hsdp, density=1.0, frozen=True)
    train(sparse, rank, 3, 1, hsdp)
    out.append((full(plain), full(sparse), sorted(state.state_dict()["residuals"])))
    # A compressor travels: bfloat16 values at density 1 are near plain, not equal to it.
    near, _ = build(size, mode, hsdp, density=1.0, compressor="bf16")
    train(near, rank, 3, 1, hsdp)
    out.append((out[0][0], full(near), None))
    # A parameter unfrozen after enable(): refused at the next reduction, on every rank.
    late, state = build(size, mode, hsdp, density=1.0, frozen=True)
    late.a.bias.requires_grad_(True)
    try:
        train(late, rank, 1, 1, hsdp)
        out.append("trained")
    except ValueError as exc:
        out.append(str(exc))
    return out


def conservation(rank: int, size: int, hsdp: bool, algorithm: str) -> dict:
    """Per module: what each call was fed (flat: the rank-major P x shard input; HSDP: the
    node's reduced shard), what it returned, and the residuals at the end."""
    net, state = build(size, algorithm, hsdp, density=0.1)
    fed, got = {}, {}
    if hsdp:
        real = state.all_reduce

        def recording(m, shard):
            fed[m.key] = fed.get(m.key, 0) + shard.double()
            real(m, shard)
            got[m.key] = got.get(m.key, 0) + shard.double()
        state.all_reduce = recording
    else:
        real = state.reduce_scatter

        def recording(m, out, flat, group):
            fed[m.key] = fed.get(m.key, 0) + flat.double()
            real(m, out, flat, group)
            got[m.key] = got.get(m.key, 0) + out.double()
        state.reduce_scatter = recording
    train(net, rank, 4, 1, hsdp)
    residuals = {k: (st.residual.double() if st.residual is not None else None) for k, st in state.states.items()}
    return {"fed": fed, "got": got, "residuals": residuals, "bytes": state.totals["bytes_sent"]}


def resume(rank: int, size: int, hsdp: bool, residual_dtype) -> bool:
    """4 steps straight against 2, a checkpoint (the sharded model, the optimizer, the sparse
    state, through pickle), a fresh model, 2 more: the same parameters bit for bit."""
    algorithm = "oktopk"
    straight, _ = build(size, algorithm, hsdp, density=0.1, residual_dtype=residual_dtype)
    train(straight, rank, 4, 1, hsdp)
    first, state = build(size, algorithm, hsdp, density=0.1, residual_dtype=residual_dtype)
    opt = train(first, rank, 2, 1, hsdp)
    saved = pickle.loads(pickle.dumps({"model": {k: v.to_local().clone() for k, v in first.state_dict().items()},
                                       "opt": opt.state_dict(), "sparse": state.state_dict()}))
    again, fresh = build(size, algorithm, hsdp, density=0.1, residual_dtype=residual_dtype)
    with torch.no_grad():
        for k, v in again.state_dict().items():
            v.to_local().copy_(saved["model"][k])
    opt2 = torch.optim.SGD(again.parameters(), lr=0.1, momentum=0.9)
    opt2.load_state_dict(saved["opt"])
    fresh.load_state_dict(saved["sparse"])
    train(again, rank, 2, 1, hsdp, start=2, opt=opt2)
    return bool(torch.equal(full(again), full(straight)))


def non_finite(rank: int, size: int, hsdp: bool, scaler: bool) -> dict:
    """Rank 1's input holds a NaN at step 2 (every module's gradient is then NaN on rank 1; at
    odd steps the head is unused): every rank raises NonFiniteError after the
    backward (or, with a GradScaler, skips the step); parameters and residuals unchanged;
    the next steps train."""
    sc = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8) if scaler else None
    net, state = build(size, "oktopk", hsdp, density=0.2, scaler=sc)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    log = []
    for step in range(4):
        opt.zero_grad()
        x = batch(rank, step)
        if step == 2 and rank == 1:
            x[0, 0] = float("nan")
        before = full(net)
        residuals = [None if st.residual is None else st.residual.clone() for st in state.states.values()]
        try:
            loss = net(x, step).pow(2).sum()
            if sc is None:
                loss.backward()
                opt.step()
            else:
                sc.scale(loss).backward()
                sc.step(opt)
                sc.update()
            outcome = "trained"
        except sparsecomm.NonFiniteError:
            outcome = "raised"
        # (a refused call takes the gradient back out of the residual: to one rounding of the
        # sum, whose size the scale sets)
        kept = all(a is None or torch.allclose(a, st.residual, rtol=1e-6, atol=1e-6 * (sc.get_scale() if sc else 1))
                   for a, st in zip(residuals, state.states.values()))
        log.append((outcome, bool(torch.equal(before, full(net))), kept))
    out = {"log": log, "final": full(net), "finite": bool(torch.isfinite(full(net)).all())}
    if sc is None:  # a backward that died before its end left a raise queued: the next one still raises
        state._raising = True
        x = batch(rank, 4)
        if rank == 1:
            x[0, 0] = float("nan")
        try:
            net(x, 4).pow(2).sum().backward()
            out["after_a_failed_backward"] = "silent"
        except sparsecomm.NonFiniteError:
            out["after_a_failed_backward"] = "raised"
    return out


def shard_nan(rank: int, size: int) -> list[str]:
    """HSDP without a scaler: a NaN in one entry of rank 1's head gradient reaches one shard
    only (after the node's dense reduce-scatter); every rank still raises, and the next step
    trains on every rank."""
    net, _ = build(size, "oktopk", True, density=0.5)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    seen = []
    for step in (0, 2):
        opt.zero_grad()
        weight = torch.ones(4, 3)
        if step == 0 and rank == 1:
            weight[0, 0] = float("nan")  # the head's first row and bias entry: shard 0's
        try:
            (net(batch(rank, step), step, detach=True) * weight).sum().backward()
            opt.step()
            seen.append("trained")
        except sparsecomm.NonFiniteError:
            seen.append("raised")
    return seen


def mixed_precision(rank: int, size: int, hsdp: bool) -> tuple:
    """bf16 reductions (MixedPrecisionPolicy): density 1 against plain, to bf16's rounding;
    density 0.1 trains, finite."""
    plain, _ = build(size, None, hsdp, mp=True)
    train(plain, rank, 3, 1, hsdp)
    dense, _ = build(size, "topka" if hsdp else "topkdsa", hsdp, mp=True, density=1.0)
    train(dense, rank, 3, 1, hsdp)
    sparse, state = build(size, "oktopk", hsdp, mp=True, density=0.1)
    train(sparse, rank, 3, 1, hsdp)
    return full(plain), full(dense), full(sparse), state.totals["calls"]


def refusals(rank: int, size: int) -> list[str]:
    """What enable refuses, every rank alike: one message each."""
    seen = []

    def attempt(make):
        try:
            make()
            seen.append("accepted")
        except ValueError as exc:
            seen.append(str(exc))

    attempt(lambda: build(size, "topka"))  # the flat mode runs no allgather algorithm
    attempt(lambda: build(size, "oktopk", warmup_steps=rank))  # ranks that would pair dense with sparse calls
    mesh = init_device_mesh("cpu", (2, size // 2), mesh_dim_names=("replicate", "shard"))

    def native_2d():
        net = Net()
        fully_shard(net, mesh=mesh)
        sparsecomm.fsdp.enable(net, replicate_group=mesh["replicate"].get_group())
    attempt(native_2d)

    def replicas_apart():
        net = Net()
        if rank >= size // 2:
            with torch.no_grad():
                net.a.bias.add_(1.0)
        fully_shard(net, mesh=mesh["shard"])
        sparsecomm.fsdp.enable(net, replicate_group=mesh["replicate"].get_group())
    attempt(replicas_apart)

    def user_factor():
        net = Net()
        fully_shard(net, mesh=init_device_mesh("cpu", (size,)))
        net.set_gradient_divide_factor(3.0)
        sparsecomm.fsdp.enable(net)
    attempt(user_factor)
    attempt(lambda: sparsecomm.fsdp.enable(Net()))  # not sharded

    def sharded(optimizer):
        net = Net()
        fully_shard(net, mesh=init_device_mesh("cpu", (size,)))
        optimizer(net.parameters())
    attempt(lambda: sharded(sparsecomm.optim.DeMo))  # full-size momentum of each rank's own gradient
    attempt(lambda: sharded(sparsecomm.optim.SparseAdamW))
    return seen


def diloco(rank: int, size: int) -> dict:
    """Outer steps across the replicas of an FSDP group (2 x size/2): FSDP shards and reduces
    densely inside each replica every inner step, DiLoCo syncs the replicas' shards every 3.
    Per outer step, this rank's shard; and what moved the outer shard, the residual, and the
    pseudo-gradients fed (outer_lr 1: SparseLoCo's rule)."""
    from sparsecomm.optim import DiLoCo

    mesh = init_device_mesh("cpu", (2, size // 2), mesh_dim_names=("replicate", "shard"))
    net = Net()
    for m in (net.a, net.b, net.head):
        fully_shard(m, mesh=mesh["shard"])
    fully_shard(net, mesh=mesh["shard"])
    net.set_reduce_scatter_unused_params(True)
    inner = torch.optim.AdamW(net.parameters(), lr=0.01)
    outer = DiLoCo(net, inner, sync_every=3, density=0.2, outer_lr=1.0, group=mesh["replicate"].get_group())
    start = outer.anchor.clone()
    local = lambda: torch.cat([p.to_local().detach().reshape(-1) for p in net.parameters()])  # noqa: E731
    fed, shards, losses = torch.zeros_like(start), [], []
    for step in range(9):
        inner.zero_grad()
        loss = net(batch(rank, step), 0).pow(2).sum()
        loss.backward()
        losses.append(loss.item())
        inner.step()
        outer.inner_steps += 1
        if outer.inner_steps % 3 == 0:
            fed += outer.anchor - local()
            outer.sync()
            shards.append(local().clone())
    return {"shards": shards, "moved": start - outer.anchor, "residual": outer.residual.clone(), "fed": fed,
            "losses": losses}


def suite(rank: int, size: int, hsdp: bool) -> dict:
    """Every case of one world (a spawn of gloo ranks costs seconds: one per world)."""
    out = {"equals": equals_plain(rank, size, hsdp), "conservation": conservation(rank, size, hsdp, "oktopk"),
           "resume": {str(dt): resume(rank, size, hsdp, dt) for dt in (None, torch.bfloat16)},
           "non_finite": {scaler: non_finite(rank, size, hsdp, scaler) for scaler in (False, True)},
           "mixed_precision": mixed_precision(rank, size, hsdp)}
    if hsdp:
        out["shard_nan"] = shard_nan(rank, size)
        out["refusals"] = refusals(rank, size)
        out["diloco"] = diloco(rank, size)
    return out
