"""Bodies of the DDP hook tests, run on gloo ranks (importable by spawned processes)."""

from __future__ import annotations

import io

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from sparsecomm.hooks import SparseHookState, sparse_allreduce_hook


class Shuffled(torch.nn.Module):
    """Layers registered in an order different from their use, so DDP's rebuilt
    buckets (in gradient-ready order) differ from its initial ones."""

    def __init__(self) -> None:
        super().__init__()
        self.last = torch.nn.Linear(64, 10)
        self.first = torch.nn.Linear(20, 64)
        self.middle = torch.nn.Linear(64, 64)

    def forward(self, x):
        return self.last(torch.relu(self.middle(torch.relu(self.first(x)))))


def mlp() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(20, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))


def _model(make, seed=0):
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return make()


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(32, 20, generator=g), torch.randint(0, 10, (32,), generator=g)


def _step(model, opt, rank, step):
    x, y = batch(rank, step)
    device = next(model.parameters()).device
    x, y = x.to(device), y.to(device)
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    grads = [p.grad.clone() for p in model.parameters()]
    opt.step()
    return grads


def equals_ddp(rank: int, size: int, algorithm: str, device: str = "cpu") -> tuple[float, dict]:
    """Largest gradient difference between DDP's allreduce and the hook at density 1,
    and the hook's totals (a hook DDP never called would match DDP too)."""
    ref = DDP(_model(mlp).to(device))
    hooked = DDP(_model(mlp).to(device))
    state = SparseHookState(hooked, algorithm, 1.0, min_bucket_elements=0)
    hooked.register_comm_hook(state, sparse_allreduce_hook)
    o1 = torch.optim.SGD(ref.parameters(), lr=0.1)
    o2 = torch.optim.SGD(hooked.parameters(), lr=0.1)
    worst = 0.0
    for step in range(3):
        for a, b in zip(_step(ref, o1, rank, step), _step(hooked, o2, rank, step)):
            worst = max(worst, float((a - b).abs().max()))
    return worst, dict(state.totals)


def conservation(rank: int, size: int, steps: int = 15, algorithm: str = "oktopk", compressor=None) -> dict:
    """Local gradients fed to the hook, results, residuals and layouts seen, over many steps."""
    model = DDP(_model(Shuffled), bucket_cap_mb=0.01)  # several small buckets
    state = SparseHookState(model, algorithm, 0.05, min_bucket_elements=0, compressor=compressor,
                            algorithm_options={"tau": 4, "tau_prime": 8} if algorithm == "oktopk" else None)
    params = list(model.parameters())
    fed = [torch.zeros_like(p, dtype=torch.float64) for p in params]
    results = [torch.zeros_like(p, dtype=torch.float64) for p in params]
    layouts, step_layout = [], set()  # per step, its buckets' parameters in bucket order

    def recording_hook(st, bucket):
        for p, g in zip(bucket.parameters(), bucket.gradients()):
            fed[st._param_index[id(p)]] += g.double()
        step_layout.add(tuple(st._param_index[id(p)] for p in bucket.parameters()))
        if bucket.is_last():
            layouts.append(frozenset(step_layout))
            step_layout.clear()
        return sparse_allreduce_hook(st, bucket)

    model.register_comm_hook(state, recording_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(steps):
        for i, g in enumerate(_step(model, opt, rank, step)):
            results[i] += g.double() * size  # the hook averaged: the sum is size times that
    residuals = state.residuals()
    res = [residuals.get(i, torch.zeros(p.numel())).double().view_as(p) for i, p in enumerate(params)]
    return {"fed": fed, "results": results, "residuals": res, "layouts": layouts,
            "state_layouts": set(state.buckets), "sparse": state.totals["sparse_buckets"]}


def save_restore(rank: int, size: int, make: str = "mlp", cap_mb: float | None = None, overlap: bool = False,
                 at: int = 6) -> list:
    """Gradients of 4 steps after a checkpoint taken after ``at`` steps: continued vs restored
    from the checkpoint, with DDP buckets of ``cap_mb`` (None: DDP's default, one bucket)."""
    caps = {} if cap_mb is None else {"bucket_cap_mb": cap_mb}

    def build():
        model = DDP(_model({"mlp": mlp, "shuffled": Shuffled}[make]), **caps)
        state = SparseHookState(model, "oktopk", 0.02, min_bucket_elements=0, overlap=overlap,
                                algorithm_options={"tau": 3, "tau_prime": 5})
        model.register_comm_hook(state, sparse_allreduce_hook)
        return model, state, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    model, state, opt = build()
    for step in range(at):
        _step(model, opt, rank, step)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "hook": state.state_dict()}, buf)
    continued = [_step(model, opt, rank, step) for step in range(at, at + 4)]
    buf.seek(0)
    ckpt = torch.load(buf)  # torch's defaults (weights_only=True): what users do
    model2, state2, opt2 = build()
    model2.load_state_dict(ckpt["model"])
    opt2.load_state_dict(ckpt["opt"])
    state2.load_state_dict(ckpt["hook"])
    restored = [_step(model2, opt2, rank, step) for step in range(at, at + 4)]
    return [all(torch.equal(a, b) for a, b in zip(c, r)) for c, r in zip(continued, restored)]


def nan_gradient(rank: int, size: int) -> str:
    model = DDP(_model(mlp))
    state = SparseHookState(model, "oktopk", 0.05, min_bucket_elements=0)
    model.register_comm_hook(state, sparse_allreduce_hook)
    x, y = batch(rank, 0)
    if rank == 1:
        x[0, 0] = float("nan")
    try:
        torch.nn.functional.cross_entropy(model(x), y).backward()
    except Exception as exc:  # noqa: BLE001 - DDP may wrap the hook's error
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def overlap_equals_sync(rank: int, size: int, steps: int = 6) -> dict:
    """Parameters after ``steps`` with the overlapping hook and with the synchronous one.

    Several buckets (rebuilt after step 1), a dense warm-up step, dense small
    buckets and Ok-Topk ones with error feedback: the engine must change nothing.
    """
    out = {}
    for overlap in (False, True):
        model = DDP(_model(Shuffled), bucket_cap_mb=0.01)
        state = SparseHookState(model, "oktopk", 0.05, warmup_steps=1, min_bucket_elements=700,
                                algorithm_options={"tau": 3, "tau_prime": 4}, overlap=overlap)
        model.register_comm_hook(state, sparse_allreduce_hook)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        for step in range(steps):
            _step(model, opt, rank, step)
        out[overlap] = {"params": [p.detach().clone() for p in model.parameters()],
                        "residuals": state.residuals(), "totals": dict(state.totals),
                        "threads": state._engine.comm.name if overlap else None}
    return out
