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


def equals_ddp_each(rank: int, size: int, algorithms: list[str]) -> dict[str, tuple[float, dict]]:
    """:func:`equals_ddp` for each algorithm, on one launch of the ranks."""
    return {algorithm: equals_ddp(rank, size, algorithm) for algorithm in algorithms}


def each(rank: int, size: int, case: str, argsets: list[tuple]) -> list:
    """The case named ``case`` (a function of this module) once per tuple of arguments, in
    order, on one launch of the ranks: a launch costs seconds, the cases share nothing."""
    return [globals()[case](rank, size, *args) for args in argsets]


def several(rank: int, size: int, calls: list[tuple[str, tuple]]) -> list:
    """Each ``(case, args)`` in order, on one launch of the ranks (as :func:`each`, mixed cases)."""
    return [globals()[case](rank, size, *args) for case, args in calls]


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


def embedded() -> torch.nn.Module:
    """A 64 x 256 embedding table (16,384 weights, its gradient ready last) under large layers."""
    return torch.nn.Sequential(torch.nn.Embedding(64, 256), torch.nn.Flatten(), torch.nn.Linear(2048, 1024),
                               torch.nn.ReLU(), torch.nn.Linear(1024, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 10))


def dense_after_rebuild(rank: int, size: int, steps: int = 4) -> dict:
    """The table's gradient fed, its results and residual, and every step's reductions: DDP's
    first step reduces it with the large layers (sparse); its rebuilt 4 MB buckets hold it
    alone, below ``min_bucket_elements`` (dense)."""
    model = DDP(_model(embedded), bucket_cap_mb=4)
    state = SparseHookState(model, "oktopk", 0.01, min_bucket_elements=20_000)
    table = next(model.parameters())
    fed, result = torch.zeros_like(table, dtype=torch.float64), torch.zeros_like(table, dtype=torch.float64)

    def recording_hook(st, bucket):
        for p, g in zip(bucket.parameters(), bucket.gradients()):
            if p is table:
                fed.add_(g.double())
        return sparse_allreduce_hook(st, bucket)

    model.register_comm_hook(state, recording_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(rank)
    for _ in range(steps):
        x, y = torch.randint(0, 64, (16, 8), generator=g), torch.randint(0, 10, (16,), generator=g)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        result.add_(table.grad.double() * size)  # the hook averaged: the sum is size times that
        opt.step()
    residual = state.residuals().get(0)
    return {"fed": fed, "result": result, "residual": None if residual is None else residual.view_as(table),
            "reductions": [[(d["layout"], d["dense"]) for d in s] for s in state.stats if s]}


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
            "state_layouts": set(state.layout_states), "sparse": state.totals["sparse_buckets"]}


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


def nan_gradient(rank: int, size: int, scaler: str = "none") -> dict:
    """Rank 1's batch holds a NaN. ``scaler``: "none", or "disabled" (``GradScaler(enabled=False)``,
    what a script passes when AMP is switched off by a flag), which must be no scaler. The error
    the backward raised, and whether the parameters after the loop's ``scaler.step`` are unchanged."""
    model = DDP(_model(mlp))
    amp = torch.amp.GradScaler("cpu", enabled=False) if scaler == "disabled" else None
    state = SparseHookState(model, "oktopk", 0.05, min_bucket_elements=0, scaler=amp)
    model.register_comm_hook(state, sparse_allreduce_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    before = [p.detach().clone() for p in model.parameters()]
    x, y = batch(rank, 0)
    if rank == 1:
        x[0, 0] = float("nan")
    error = "no error"
    try:
        loss = torch.nn.functional.cross_entropy(model(x), y)
        (amp.scale(loss) if amp is not None else loss).backward()
        amp.step(opt) if amp is not None else opt.step()
    except Exception as exc:  # noqa: BLE001 - DDP may wrap the hook's error
        error = f"{type(exc).__name__}: {exc}"
    return {"error": error, "kept": all(torch.equal(b, p) for b, p in zip(before, model.parameters()))}


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


def _poison(param: torch.nn.Parameter):
    """A tensor hook making one entry of ``param``'s gradient NaN (remove the handle after backward)."""

    def hook(g):
        g = g.clone()
        g.view(-1)[0] = float("nan")
        return g

    return param.register_hook(hook)


class Recorder:
    """Wraps the hook: every local gradient fed to it, per step and parameter (float64)."""

    def __init__(self, state: SparseHookState, params: list) -> None:
        self.state, self.params, self.steps = state, params, [{}]

    def hook(self, st, bucket):
        for p, g in zip(bucket.parameters(), bucket.gradients()):
            self.steps[-1][st._param_index[id(p)]] = g.double().clone()
        if bucket.is_last():
            self.steps.append({})
        return sparse_allreduce_hook(st, bucket)


def refused_layouts(state: SparseHookState, step: int) -> set:
    """Parameters of the reductions refused at hook step ``step``."""
    return {i for row in state.stats[step] if row["refused"] for i in row["layout"]}


def refusal_carry(rank: int, size: int, overlap: bool, steps: int = 8, bad_step: int = 3) -> dict:
    """A NaN in one rank's gradient of one layer at one step, several buckets; the loop catches the
    error, zero_grads and goes on. Fed gradients, applied results, residuals, carried, errors."""
    import sparsecomm

    model = DDP(_model(Shuffled), bucket_cap_mb=0.01)
    state = SparseHookState(model, "oktopk", 0.05, min_bucket_elements=0, overlap=overlap,
                            algorithm_options={"tau": 3, "tau_prime": 4})
    params = list(model.parameters())
    rec = Recorder(state, params)
    model.register_comm_hook(state, rec.hook)
    opt = torch.optim.SGD(params, lr=0.05)
    applied = [torch.zeros_like(p, dtype=torch.float64) for p in params]
    errors, counted = [], []
    for step in range(steps):
        handle = _poison(model.module.middle.weight) if step == bad_step and rank == 1 % size else None
        x, y = batch(rank, step)
        opt.zero_grad()
        try:
            torch.nn.functional.cross_entropy(model(x), y).backward()
        except sparsecomm.InputError as exc:
            errors.append((step, type(exc).__name__, getattr(exc, "ranks", None)))
            opt.zero_grad()
            continue
        finally:
            if handle is not None:
                handle.remove()
        for a, p in zip(applied, params):
            a += p.grad.double() * size
        counted.append(step)
        opt.step()
    refused = {s: refused_layouts(state, s) for s in range(steps)}
    fed = [{i: (torch.zeros_like(g) if i in refused[s] else g) for i, g in rec.steps[s].items()} for s in range(steps)]
    fed = [sum(f[i] for f in fed) for i in range(len(params))]
    residuals, carried = state.residuals(), state.carried()
    zeros = [torch.zeros(p.numel(), dtype=torch.float64) for p in params]
    return {"fed": fed, "applied": applied, "errors": errors, "refused": refused,
            "residuals": [residuals.get(i, zeros[i]).double().view_as(p) for i, p in enumerate(params)],
            "carried": [carried.get(i, zeros[i]).double().view_as(p) * size for i, p in enumerate(params)],
            "params": [p.detach().clone() for p in params], "totals": dict(state.totals)}


def fatal_error(rank: int, size: int, overlap: bool, error: str) -> list:
    """Every rank's allreduce raises ``error`` (a timeout, a dead peer) at the third step's second
    reduction (several buckets): what each backward raised, per step."""
    import sparsecomm
    import sparsecomm.hooks as hooks

    model = DDP(_model(Shuffled), bucket_cap_mb=0.01)
    state = SparseHookState(model, "oktopk", 0.05, min_bucket_elements=0, overlap=overlap)
    model.register_comm_hook(state, sparse_allreduce_hook)
    real = hooks.allreduce

    def failing(*args, **kwargs):
        if state.step == 2 and len(state.stats[-1]) == 1:
            raise getattr(sparsecomm, error)(f"simulated {error} on rank {rank}")
        return real(*args, **kwargs)

    hooks.allreduce = failing
    try:
        seen = []
        for step in range(5):
            x, y = batch(rank, step)
            model.zero_grad()
            try:
                torch.nn.functional.cross_entropy(model(x), y).backward()
                seen.append("ok")
            except Exception as exc:  # noqa: BLE001 - what reached the loop is the result
                seen.append(f"{type(exc).__name__}: {exc}")
        return seen
    finally:
        hooks.allreduce = real


def amp_scaler(rank: int, size: int, overlap: bool, steps: int = 10, bad_step: int = 4) -> dict:
    """A GradScaler (CPU, float32: the scale itself makes the units) drives the loop; rank 1's
    gradient of one layer holds a NaN at ``bad_step``. Per step: the scale, whether the scaler
    skipped; the unscaled fed and applied sums; residuals and carried results at the end."""
    model = DDP(_model(Shuffled), bucket_cap_mb=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 12, growth_interval=3)
    state = SparseHookState(model, "oktopk", 0.05, min_bucket_elements=0, overlap=overlap, scaler=scaler,
                            algorithm_options={"tau": 3, "tau_prime": 4})
    params = list(model.parameters())
    rec = Recorder(state, params)
    model.register_comm_hook(state, rec.hook)
    opt = torch.optim.SGD(params, lr=0.05)
    applied = [torch.zeros_like(p, dtype=torch.float64) for p in params]
    scales, skipped, finite_residuals = [], [], []
    for step in range(steps):
        handle = _poison(model.module.middle.weight) if step == bad_step and rank == 1 % size else None
        x, y = batch(rank, step)
        opt.zero_grad()
        scales.append(scaler.get_scale())
        scaler.scale(torch.nn.functional.cross_entropy(model(x), y)).backward()  # never raises here
        if handle is not None:
            handle.remove()
        scaler.unscale_(opt)
        if all(bool(torch.isfinite(p.grad).all()) for p in params):
            for a, p in zip(applied, params):
                a += p.grad.double() * size
        before = [p.detach().clone() for p in params]
        scaler.step(opt)
        scaler.update()
        skipped.append(all(torch.equal(b, p) for b, p in zip(before, params)))
        finite_residuals.append(all(bool(torch.isfinite(r).all()) for r in state.residuals().values()))
    refused = {s: refused_layouts(state, s) for s in range(steps)}
    fed = [sum((torch.zeros_like(g) if i in refused[s] else g) / scales[s]
               for s in range(steps) for j, g in rec.steps[s].items() if j == i) for i in range(len(params))]
    residuals, carried = state.residuals(), state.carried()
    last = state._memory.scale.value  # the units of what the state holds: the scale of its last step
    zeros = [torch.zeros(p.numel(), dtype=torch.float64) for p in params]
    return {"fed": fed, "applied": applied, "scales": scales, "skipped": skipped, "refused": refused,
            "finite_residuals": finite_residuals, "last_scale": last,
            "residuals": [residuals.get(i, zeros[i]).double().view_as(p) / last for i, p in enumerate(params)],
            "carried": [carried.get(i, zeros[i]).double().view_as(p) * size / last for i, p in enumerate(params)],
            "params": [p.detach().clone() for p in params], "totals": dict(state.totals)}


def accumulate(rank: int, size: int, algorithm: str, density: float, micro: int = 3, steps: int = 4) -> dict:
    """Gradient accumulation: ``micro - 1`` backwards under ``no_sync()`` and a last one outside it,
    against the same hook fed the locally accumulated gradient in one backward (grads set
    beforehand, as autograd accumulates them), and, hookless, DDP's own allreduce."""
    def build(hooked=True):
        model = DDP(_model(Shuffled), bucket_cap_mb=0.01)
        state = None
        if hooked:
            state = SparseHookState(model, algorithm, density, min_bucket_elements=0,
                                    algorithm_options={"tau": 2, "tau_prime": 3} if algorithm == "oktopk" else None)
            model.register_comm_hook(state, sparse_allreduce_hook)
        return model, state, torch.optim.SGD(model.parameters(), lr=0.05)

    def loss(model, step, j):
        x, y = batch(rank, 100 * step + j)
        return torch.nn.functional.cross_entropy(model(x), y)

    out = {}
    for name in ("no_sync", "local", "ddp"):
        model, state, opt = build(hooked=name != "ddp")
        grads = []
        for step in range(steps):
            opt.zero_grad()
            if name == "local":  # the same sums, accumulated outside DDP
                for j in range(micro - 1):
                    gs = torch.autograd.grad(loss(model.module, step, j), list(model.parameters()))
                    for p, g in zip(model.parameters(), gs):
                        p.grad = g if p.grad is None else p.grad.add_(g)
            else:
                with model.no_sync():
                    for j in range(micro - 1):
                        loss(model, step, j).backward()
            loss(model, step, micro - 1).backward()
            grads.append([p.grad.clone() for p in model.parameters()])
            opt.step()
        out[name] = {"grads": grads, "steps": state.totals["steps"] if state else None}
    return out


def loop_plan(seed: int, steps: int) -> dict:
    """A random training loop (the same on every rank): per step "train", "skip" (no batch) or
    ("refuse", rank, parameter) (a NaN in that rank's gradient of that parameter); restarts
    (checkpoint, then a new DDP, state and optimizer) after some steps; the hook's settings."""
    import random

    rng = random.Random(seed)
    plan = []
    for _ in range(steps):
        u = rng.random()
        plan.append("skip" if u < 0.15 else ("refuse", rng.randrange(3), rng.randrange(6)) if u < 0.35 else "train")
    # A checkpoint resumes bit for bit once the hook has made two steps (DDP rebuilt its buckets).
    trained = [s for s, kind in enumerate(plan) if kind != "skip"]
    restarts = sorted(rng.sample([s for s in range(steps - 1) if s >= trained[1]], 2)) if len(trained) > 2 else []
    settings = {"algorithm": rng.choice(["oktopk", "topka"]), "density": rng.choice([0.02, 0.1]),
                "warmup_steps": rng.choice([0, 1]), "min_bucket_elements": rng.choice([0, 700]),
                "overlap": rng.random() < 0.5}
    return {"plan": plan, "restarts": restarts, "settings": settings}


def property_loop(rank: int, size: int, seed: int, steps: int = 9, lr: float = 0.05) -> dict:
    """Run :func:`loop_plan`'s loop twice, without and with its restarts: per-step parameters of
    both, and for the uninterrupted run what conservation needs."""
    import sparsecomm

    case = loop_plan(seed, steps)
    settings = dict(case["settings"])
    algorithm, density = settings.pop("algorithm"), settings.pop("density")
    if algorithm == "oktopk":
        settings["algorithm_options"] = {"tau": 2, "tau_prime": 3}

    def build():
        model = DDP(_model(Shuffled), bucket_cap_mb=0.01)
        state = SparseHookState(model, algorithm, density, **settings)
        rec = Recorder(state, list(model.parameters()))
        model.register_comm_hook(state, rec.hook)
        return model, state, torch.optim.SGD(model.parameters(), lr=lr), rec

    runs = {}
    for name, restarts in (("straight", []), ("restarted", case["restarts"])):
        model, state, opt, rec = build()
        first = [p.detach().clone() for p in model.parameters()]
        history, fed, errors = [], None, []
        for step, kind in enumerate(case["plan"]):
            if kind != "skip":
                handle = None
                if kind != "train" and kind[1] % size == rank:
                    handle = _poison(list(model.parameters())[kind[2]])
                x, y = batch(rank, step)
                opt.zero_grad()
                try:
                    torch.nn.functional.cross_entropy(model(x), y).backward()
                    opt.step()
                except sparsecomm.InputError as exc:
                    errors.append((step, type(exc).__name__))
                    opt.zero_grad()
                finally:
                    if handle is not None:
                        handle.remove()
            history.append([p.detach().clone() for p in model.parameters()])
            if step in restarts:
                buf = io.BytesIO()
                torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "hook": state.state_dict()}, buf)
                buf.seek(0)
                ckpt = torch.load(buf)
                model, state, opt, rec = build()
                model.load_state_dict(ckpt["model"])
                opt.load_state_dict(ckpt["opt"])
                state.load_state_dict(ckpt["hook"])
        runs[name] = {"history": history, "errors": errors}
        if name == "straight":
            n = len(first)
            refused = [refused_layouts(state, s) for s in range(len(rec.steps) - 1)]
            fed = [sum(g for s, f in enumerate(rec.steps[:-1]) for j, g in f.items() if j == i and i not in refused[s])
                   for i in range(n)]
            residuals, carried = state.residuals(), state.carried()
            zeros = [torch.zeros(p.numel(), dtype=torch.float64) for p in first]
            runs[name].update(
                fed=[f if isinstance(f, torch.Tensor) else torch.zeros_like(p, dtype=torch.float64)
                     for f, p in zip(fed, first)],
                applied=[(a.double() - b.double()) / lr * size for a, b in zip(first, history[-1])],
                residuals=[residuals.get(i, zeros[i]).double().view_as(p) for i, p in enumerate(first)],
                carried=[carried.get(i, zeros[i]).double().view_as(p) * size for i, p in enumerate(first)],
                totals=dict(state.totals))
    return {"case": case, **runs}
