"""What the schedule tests share: a small model, its data, the synchronous references, and the
bodies every engine runs (simulated world, gloo, MPI)."""

from __future__ import annotations


import torch

import sparsecomm
from sparsecomm.schedules import WFBP, SyncEASGD


__all__ = ["STEPS", "MG_FAST", "make_model", "make_optimizer", "loss_of", "train_steps", "synchronous_reference", "run_scheduled", "CASES_PASS", "schedule_cases", "schedule_case", "stale_reference", "run_dear", "dear_against_layers", "Skipping", "run_dear_skipping", "oktopk_wfbp", "mixed_model", "mixed_loss"]


STEPS = 5


MG_FAST = {"profile_steps": 2, "calibration_sizes": (64, 4096), "calibration_rounds": 1}


def make_model() -> torch.nn.Module:
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64),
                                   torch.nn.ReLU(), torch.nn.Linear(64, 10))


def make_optimizer(kind: str, params):
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    return torch.optim.Adam(params, lr=0.01)


def loss_of(model, rank: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * rank + step)
    x, y = torch.randn(16, 20, generator=g), torch.randint(0, 10, (16,), generator=g)
    return torch.nn.functional.cross_entropy(model(x), y)


def train_steps(model, opt, sched, rank: int, steps: int = STEPS, set_to_none: bool = True) -> None:
    """``steps`` steps of the test loss under ``sched`` (its ``step()`` ends each).

    ``set_to_none=False``: gradients are zeroed in place (Pipe-SGD's backward then accumulates
    into its gather buffer: the gradients are views of the last result).
    """
    for step in range(steps):
        opt.zero_grad(set_to_none=set_to_none)
        loss_of(model, rank, step).backward()
        sched.step()


def synchronous_reference(rank: int, kind: str, groups, algorithm: str, density: float,
               as_given: bool = False, compressor=None) -> list[torch.Tensor]:
    """The same groups reduced synchronously, one sparsecomm.allreduce each, in order.

    A group's layers are laid out last first (as GroupSchedule does), or ``as_given``
    (DeAR: forward order). The layout matters bit for bit: it moves Ok-Topk's regions,
    so sums are added in another order.
    """
    model = make_model()
    opt = make_optimizer(kind, model.parameters())
    params = list(model.parameters())
    # Dense keeps a residual where a compressor rounds something away (q8), as the schedules do.
    states = [sparsecomm.registry.get(algorithm).state_class(density, error_feedback=True)
              if algorithm != "dense" else sparsecomm.DenseState(error_feedback=compressor is not None)
              for _ in groups]
    for step in range(STEPS):
        opt.zero_grad()
        loss_of(model, rank, step).backward()
        for g, st in zip(groups, states):
            layers = list(g) if as_given else sorted(g, reverse=True)
            flat = torch.cat([params[i].grad.reshape(-1) for i in layers])
            out = sparsecomm.allreduce(flat, density, algorithm=algorithm, state=st, op="avg",
                                       compressor=compressor)
            offset = 0
            for i in layers:
                params[i].grad.copy_(out[offset:offset + params[i].numel()].view_as(params[i]))
                offset += params[i].numel()
        opt.step()
    return [p.detach().clone() for p in params]


def run_scheduled(rank: int, kind: str, cls, algorithm: str, density: float, set_to_none: bool = True, **kw):
    model = make_model()
    opt = make_optimizer(kind, model.parameters())
    sched = cls(model, opt, algorithm=algorithm, density=density, **kw)
    train_steps(model, opt, sched, rank, set_to_none=set_to_none)
    groups = [list(g) for g in sched.groups]
    sched.close()
    return [p.detach().clone() for p in model.parameters()], groups, sched


#: What :func:`schedule_cases` returns on every rank.
CASES_PASS = {"wfbp": True, "dear": True, "pipesgd": True, "views": True, "dear_skip": True}


def schedule_cases(rank: int, size: int) -> dict[str, bool]:
    """Ok-Topk under WFBP, DeAR (halves apart), Pipe-SGD, SyncEASGD with gradient views and DeAR
    with a skipped layer, each against its reference, on whatever world this runs in (the gloo
    and MPI tests, and the simulated world)."""
    from sparsecomm.schedules import PipeSGD

    torch.set_num_threads(1)
    out = {}
    got, groups, _ = run_scheduled(rank, "adam", WFBP, "oktopk", 0.05)
    out["wfbp"] = all(torch.equal(a, b) for a, b in zip(got, synchronous_reference(rank, "adam", groups, "oktopk", 0.05)))
    got, groups = run_dear(rank, "sgd", "oktopk", 0.05, 5_000)
    want = synchronous_reference(rank, "sgd", groups, "oktopk", 0.05, as_given=True)
    out["dear"] = all(torch.equal(a, b) for a, b in zip(got, want))
    model = make_model()
    opt = make_optimizer("sgd", model.parameters())
    sched = PipeSGD(model, opt, warmup_steps=1, algorithm="oktopk", density=0.05)
    train_steps(model, opt, sched, rank)
    sched.flush()
    sched.close()
    want = stale_reference(rank, "sgd", "oktopk", 0.05, None, 1, STEPS)
    out["pipesgd"] = all(torch.equal(p.detach(), b) for p, b in zip(model.parameters(), want))
    # The gradients as views of the results, the backward accumulating into them.
    got, groups, _ = run_scheduled(rank, "sgd", SyncEASGD, "oktopk", 0.05, set_to_none=False)
    out["views"] = all(torch.equal(a, b) for a, b in zip(got, synchronous_reference(rank, "sgd", groups, "oktopk", 0.05)))
    # DeAR with a layer skipped on some steps, on some ranks.
    skip = run_dear_skipping(rank, "oktopk", 0.05)
    out["dear_skip"] = all(torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(skip["dear"], skip["plain"]))
    return out


def schedule_case(rank, size):
    return schedule_cases(rank, size)


# ---- Pipe-SGD ---------------------------------------------------------------------------
def stale_reference(rank: int, kind: str, algorithm: str, density: float, compressor, warmup: int,
                     steps: int) -> list[torch.Tensor]:
    """Hand-written one-step-stale SGD: step t (t >= warmup) applies the sum of step t-1."""
    model = make_model()
    opt = make_optimizer(kind, model.parameters())
    params = list(model.parameters())
    st = sparsecomm.registry.get(algorithm).state_class(density, error_feedback=True) \
        if algorithm != "dense" else sparsecomm.DenseState(1.0, error_feedback=compressor is not None)

    def apply(flat):
        offset = 0
        for p in params:
            p.grad.copy_(flat[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
        opt.step()

    previous = None
    for step in range(steps):
        opt.zero_grad()
        loss_of(model, rank, step).backward()
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        out = sparsecomm.allreduce(flat, state=st, op="avg", compressor=compressor)
        if step < warmup:
            apply(out)
            continue
        if previous is not None:
            apply(previous)
        previous = out
    if previous is not None:
        apply(previous)
    return [p.detach().clone() for p in params]


# ---- DeAR -------------------------------------------------------------------------------
def run_dear(rank: int, kind: str, algorithm: str, density: float, buffer_bytes: int, compressor=None,
              set_to_none: bool = True):
    from sparsecomm.schedules import DeAR

    model = make_model()
    opt = make_optimizer(kind, model.parameters())
    sched = DeAR(model, opt, algorithm=algorithm, density=density, buffer_bytes=buffer_bytes,
                 compressor=compressor)
    index = {id(p): i for i, p in enumerate(model.parameters())}
    groups = [[index[id(p)] for p in ps] for ps in reversed(sched.params)]  # reduction order
    train_steps(model, opt, sched, rank, set_to_none=set_to_none)
    sched.synchronize()
    sched.close()
    return [p.detach().clone() for p in model.parameters()], groups


def dear_against_layers(rank: int, make, steps: int, buffer_bytes: int, algorithm: str = "dense",
                         density: float = 1.0, before=None) -> dict:
    """DeAR and its reference on ``make()``'s model: each module's own parameters (a shared one
    counts for the first module holding it) reduced as one synchronous call after every backward
    (no gradient: zeros), then the step. ``before(model, step, rank)`` runs before each forward.
    Returns both runs' parameters and DeAR's group sizes (in parameters)."""
    from sparsecomm.schedules import DeAR

    out = {}
    for name in ("dear", "plain"):
        with torch.random.fork_rng():
            torch.manual_seed(0)
            model = make()
        params = list(model.parameters())
        opt = torch.optim.SGD(params, lr=0.05, momentum=0.9)
        sched = DeAR(model, opt, algorithm=algorithm, density=density, buffer_bytes=buffer_bytes) \
            if name == "dear" else None
        seen, layers = set(), []
        for m in model.modules():
            own = [p for p in m.parameters(recurse=False) if id(p) not in seen]
            seen.update(id(p) for p in own)
            if own:
                layers.append(own)
        states = [sparsecomm.registry.get(algorithm).state_class(density) for _ in layers]
        for step in range(steps):
            if before is not None:
                before(model, step, rank)
            opt.zero_grad()
            loss_of(model, rank, step).backward()
            if sched is not None:
                sched.step()
                continue
            for ps, st in zip(layers, states):
                flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in ps])
                red = sparsecomm.allreduce(flat, density, algorithm=algorithm, state=st, op="avg")
                for p, r in zip(ps, red.split([p.numel() for p in ps])):
                    p.grad = r.view_as(p).clone()
            opt.step()
        if sched is not None:
            sched.synchronize()
            out["groups"] = [len(ps) for ps in sched.params]
            sched.close()
        out[name] = [p.detach().clone() for p in params]
    return out


class Skipping(torch.nn.Module):
    """A model whose middle layer runs only on some steps, and on some ranks (``use``)."""

    def __init__(self):
        super().__init__()
        self.first, self.middle, self.last = torch.nn.Linear(20, 64), torch.nn.Linear(64, 64), torch.nn.Linear(64, 10)
        self.use = True

    def forward(self, x):
        h = torch.relu(self.first(x))
        if self.use:
            h = h + torch.relu(self.middle(h))
        return self.last(h)


def run_dear_skipping(rank: int, algorithm: str, density: float) -> dict:
    """:func:`dear_against_layers` on :class:`Skipping`, its middle layer skipped on steps where
    (step + rank) % 3 == 1."""
    def skip(model, step, rank):
        model.use = (step + rank) % 3 != 1

    return dear_against_layers(rank, Skipping, 7, 5_000, algorithm, density, before=skip)


def oktopk_wfbp():
    """The test model, plain SGD and Ok-Topk 5% under WFBP."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    return model, opt, WFBP(model, opt, algorithm="oktopk", density=0.05)


def mixed_model(layer: int = 4) -> torch.nn.Module:
    """The test model with one layer in bfloat16 (the last: a mixed-precision head)."""
    model = make_model()
    model[layer].to(torch.bfloat16)
    return model


def mixed_loss(model, rank: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * rank + step)
    x, y = torch.randn(16, 20, generator=g), torch.randint(0, 10, (16,), generator=g)
    for layer in model:  # each layer in its own dtype
        x = layer(x.to(next(layer.parameters()).dtype) if list(layer.parameters()) else x)
    return torch.nn.functional.cross_entropy(x.float(), y)
