"""Training loops as users write them, driven through every schedule (bodies for sim, gloo and MPI).

:func:`run_loop` trains a small float64 MLP with plain SGD under one schedule
through a sequence of *events*, one per step, the same on every rank:

* ``plain``: one batch.
* ``refuse r L``: rank r's gradient of layer L is NaN: the call holding L is
  refused on every rank, the loop catches the ``InputError`` and goes on.
* ``abort``: the backward raises on every rank after every gradient was
  accumulated (the usual skip-the-batch pattern: catch, ``zero_grad``, go on).
* ``accumulate``: two micro-batches, the first under ``sched.no_sync()``.
* ``restart``: checkpoint (model, optimizer, schedule), build all three anew, load.
* ``freeze`` / ``thaw``: the first layer stops / starts training.
* ``overflow r``: with a loss scaler, rank r's gradient holds Inf (an fp16 overflow).

It returns what the checks need: final parameters, and the conservation
terms (gradients fed, those dropped with a refused call or an aborted batch,
what was applied, what the residuals and carries still hold).
"""

from __future__ import annotations

import io
import random

import torch

from sparsecomm.network import Network
from sparsecomm.schedules import SCHEDULES

LR = 0.05
SIZES = [(6, 12), (12, 12), (12, 3)]
EVENTS = ("plain", "refuse", "abort", "accumulate", "restart", "freeze", "thaw")
# Schedules whose calls start during backward: an aborted backward's gradients are carried;
# Pipe-SGD reduces what step() finds, so an aborted batch is dropped (zero_grad clears it).
STARTS_IN_BACKWARD = {"wfbp", "synceasgd", "mgwfbp", "dear"}


#: A network on which ``algorithm="auto"`` sends this model's calls of 144 elements and more
#: sparse and the smaller ones dense, at P = 3 (latency-bound: each message costs 1 ms).
AUTO_NETWORK = Network(alpha=1e-3, beta=1e-4, name="slow")


def model() -> torch.nn.Module:
    """The same weights on every rank, from a generator of its own: simulated ranks are threads,
    and an engine thread drawing from torch's global generator would race a seeded build."""
    layers = []
    for i, (a, b) in enumerate(SIZES):
        layers += [torch.nn.Linear(a, b)] + ([torch.nn.ReLU()] if i < len(SIZES) - 1 else [])
    net = torch.nn.Sequential(*layers).double()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) / p.shape[-1] ** 0.5)
    return net


def options(name: str, algorithm: str) -> dict:
    kw: dict = {"algorithm": algorithm, "density": 1.0 if algorithm == "dense" else 0.2}
    if algorithm == "oktopk":
        kw["algorithm_options"] = {"tau": 2, "tau_prime": 3}
    if algorithm == "auto":
        kw["network"] = AUTO_NETWORK
    if name == "mgwfbp":
        kw.update(profile_steps=2, calibration_sizes=(16, 256), calibration_rounds=1)
    if name == "dear":
        kw["buffer_bytes"] = 1200  # several groups
    return kw


def build(name: str, algorithm: str, scaler=None):
    net = model()
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    return net, opt, SCHEDULES[name](net, opt, scaler=scaler, **options(name, algorithm))


def batch(rank: int, step: int, micro: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10_000 * rank + 10 * step + micro)
    return torch.randn(8, SIZES[0][0], generator=g, dtype=torch.float64), torch.randint(0, 3, (8,), generator=g)


class _RaiseAtEnd(torch.autograd.Function):
    """Identity forward; its backward raises. Made before the layers, it runs after every
    gradient was accumulated (AccumulateGrad nodes go first)."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        raise RuntimeError("out of memory (simulated)")


def members(name: str, sched, index: int, params: list) -> list[int]:
    """Indexes (in ``params``) of the parameters reduced in one call with ``params[index]``."""
    p = params[index]
    if name == "pipesgd":
        group = sched.params
    elif name == "dear":
        group = next((ps for ps in sched.params if any(q is p for q in ps)), [])
    else:
        gi = sched._group_of[sched._index[id(p)]]
        group = [sched.params[i] for i in sched.groups[gi]]
    return [i for i, q in enumerate(params) if any(q is r for r in group)]


def calls(name: str, sched) -> list[tuple[list, object]]:
    """The schedule's calls: (the parameters it reduces, its algorithm state)."""
    if name == "pipesgd":
        return [(sched.params, sched.state)]
    if name == "dear":
        return list(zip(sched.params, sched.states))
    return [([sched.params[i] for i in g], st) for g, st in zip(sched.groups, sched._states)]


def held(name: str, sched) -> dict[int, torch.Tensor]:
    """Every residual and carried result the schedule holds, by ``id`` of its parameter,
    carried results counted ``size`` times over by the caller (they are averaged)."""
    shapes = {id(p): p.shape for p in sched.model.parameters()}
    out: dict[int, torch.Tensor] = {k: v.clone().view(shapes[k]).double() for k, v in sched._memory.parked.items()}
    for ps, st in calls(name, sched):
        r, offset = getattr(st, "residual", None), 0
        for p in ps:
            if r is not None:
                out[id(p)] = out.get(id(p), 0) + r[offset:offset + p.numel()].view_as(p).double()
            offset += p.numel()
    return out


def run_loop(rank: int, size: int, name: str, algorithm: str, events: list[str], scaler_scale: float | None = None,
             growth_interval: int = 2000):
    """Train through ``events`` (see the module docstring); the conservation terms and parameters."""
    scaler = None if scaler_scale is None else torch.amp.GradScaler("cpu", init_scale=scaler_scale,
                                                                      growth_interval=growth_interval)
    net, opt, sched = build(name, algorithm, scaler)
    start = [p.detach().clone() for p in net.parameters()]
    n = len(start)
    fed = [torch.zeros_like(p) for p in start]
    dropped = [torch.zeros_like(p) for p in start]
    step_fed = [torch.zeros_like(p) for p in start]
    errors: list[str] = []
    scales: list[float] = []

    def watch(params):
        def record(i):
            def hook(g: torch.Tensor) -> None:  # returns None: the gradient goes on unchanged
                step_fed[i].add_(g)
            return hook
        for i, p in enumerate(params):
            p.register_hook(record(i))

    def fold(drop: list[int]) -> None:
        for i in range(n):
            (dropped if i in drop else fed)[i].add_(step_fed[i])
            step_fed[i].zero_()

    watch(net.parameters())
    for step, event in enumerate(events):
        kind, *args = event.split()
        params = list(net.parameters())
        if kind == "restart":
            if name != "pipesgd":  # its checkpoint holds the gradient in flight, applied at the next step
                try:
                    sched.finish()
                except Exception as exc:  # noqa: BLE001 - the last step's refusal surfaces here
                    errors.append(f"{step} {type(exc).__name__}")
            buf = io.BytesIO()
            torch.save({"model": net.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict()}, buf)
            sched.close()
            buf.seek(0)
            saved = torch.load(buf)
            net, opt, sched = build(name, algorithm, scaler)
            watch(net.parameters())  # before the checkpoint may freeze some
            net.load_state_dict(saved["model"])
            opt.load_state_dict(saved["opt"])
            sched.load_state_dict(saved["sched"])
            params = list(net.parameters())
            kind = "plain"
        if kind in ("freeze", "thaw"):
            for p in params[:2]:
                p.requires_grad_(kind == "thaw")
            kind = "plain"
        drop: list[int] = []
        injected = []
        if kind in ("refuse", "overflow") and int(args[0]) % size == rank:
            layer = int(args[1]) if kind == "refuse" else n - 1
            if params[layer].requires_grad:
                bad = float("nan") if kind == "refuse" else float("inf")
                injected.append(params[layer].register_hook(lambda g, bad=bad: g * bad))
        try:
            opt.zero_grad()
            micro = 2 if kind == "accumulate" else 1
            for m in range(micro):
                x, y = batch(rank, step, m)
                if kind == "abort":
                    x = _RaiseAtEnd.apply(x.requires_grad_())
                loss = torch.nn.functional.cross_entropy(net(x), y)
                if scaler is not None:
                    loss = scaler.scale(loss)
                if m < micro - 1:
                    with sched.no_sync():
                        loss.backward()
                else:
                    loss.backward()
            sched.step()
            if scaler is not None and name not in ("dear", "pipesgd"):  # those two drive their scaler
                scaler.update()
        except Exception as exc:  # noqa: BLE001 - the loop skips the batch, as users' loops do
            errors.append(f"{step} {type(exc).__name__}")
            if kind == "abort" and name not in STARTS_IN_BACKWARD:
                drop = list(range(n))
        finally:
            for h in injected:
                h.remove()
        if kind == "refuse" and params[int(args[1])].requires_grad:  # the layout this step used
            drop = members(name, sched, int(args[1]), params)
        if scaler is not None:
            scales.append(float(scaler.get_scale()))
        fold(drop)
    try:
        sched.finish()
    except Exception as exc:  # noqa: BLE001 - the last step's refusal surfaces here
        errors.append(f"end {type(exc).__name__}")
    final = [p.detach().clone() for p in net.parameters()]
    kept = held(name, sched)
    chosen = [(sum(p.numel() for p in ps), st.algorithm) for ps, st in calls(name, sched) if ps]
    carried = {k: v.clone() for k, v in sched._memory.carry.values.items()}  # (Pipe-SGD's stays empty)
    ids = [id(p) for p in net.parameters()]
    sched.close()
    return {"params": final, "fed": fed, "dropped": dropped,
            "applied": [(a - b) / LR for a, b in zip(start, final)],
            "held": [kept.get(k, torch.zeros_like(p)).double() for k, p in zip(ids, final)],
            "carried": [carried[k].view(p.shape).double() if k in carried else torch.zeros_like(p).double()
                        for k, p in zip(ids, final)],
            "errors": errors, "scales": scales, "chosen": chosen}


def random_events(seed: int, steps: int, size: int) -> list[str]:
    """A seeded sequence of events (the same on every rank), every kind likely to appear."""
    rng = random.Random(seed)
    out, frozen = [], False
    for _ in range(steps):
        kind = rng.choice(EVENTS + ("plain",))
        if kind == "refuse":
            kind = f"refuse {rng.randrange(size)} {rng.randrange(len(SIZES) * 2)}"
        if kind in ("freeze", "thaw"):
            kind = "thaw" if frozen else "freeze"
            frozen = not frozen
        out.append(kind)
    return out


def property_cases(rank: int, size: int, algorithm: str, seed: int, auto_names: tuple = ()) -> dict:
    """:func:`property_case` for every schedule, by name, and for ``auto_names`` with
    ``algorithm="auto"`` (by ``"<name>+auto"``): one launch of the ranks for all."""
    out = {name: property_case(rank, size, name, algorithm, seed) for name in sorted(SCHEDULES)}
    out.update({f"{name}+auto": property_case(rank, size, name, "auto", seed) for name in auto_names})
    return out


def property_case(rank: int, size: int, name: str, algorithm: str, seed: int, steps: int = 10,
                  events: list[str] | None = None) -> dict:
    """One seeded case (or ``events``): the loop with its restarts, and the same loop without them."""
    events = random_events(seed, steps, size) if events is None else events
    resumed = run_loop(rank, size, name, algorithm, events)
    straight = run_loop(rank, size, name, algorithm, [e if e != "restart" else "plain" for e in events])
    return {"events": events, "resumed": resumed, "straight": straight}
