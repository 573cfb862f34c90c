"""Convergence comparison on real data: DDP training with sparsecomm's hooks.

The data set is scikit-learn's bundled handwritten digits (1,797 8x8 images,
shipped inside the package: nothing is downloaded). A small MLP (85,002
parameters) is trained with DDP on ``ranks`` gloo processes, once per
configuration: DDP's default dense allreduce, sparse allreduces at 1% density,
and compressed dense allreduces. Every run records loss and test accuracy per
epoch, bytes sent per rank per step, the measured compute time (everything
but the hook's communication; noisy on a shared machine) and the *modelled*
communication time: what the step's messages and bytes would take on a
network profile (alpha-beta), since loopback on one machine says nothing
about a cluster. The modelled time is a pure function of the traffic, so runs
compare fairly however loaded the machine was.

``schedule`` (``sparsecomm train --schedule``): instead of the DDP hook, one
of :mod:`sparsecomm.schedules` (WFBP, SyncEASGD, MG-WFBP, Pipe-SGD) around
the plain model reduces the gradients with the configuration's algorithm
("dense": the dense algorithm). The modelled time then adds up every
allreduce's messages and bytes as if none overlapped (an upper bound).
"""

from __future__ import annotations

import math
import sys
import time
from typing import Any

import torch

from .output import pyplot

__all__ = ["CONFIGS", "SCHEDULES", "train_rank", "run", "format_results", "plot"]

#: ``--schedule`` choices.
SCHEDULES = ("none", "wfbp", "synceasgd", "mgwfbp", "dear", "pipesgd")

#: name -> hook settings (None: DDP's own dense allreduce).
CONFIGS: dict[str, dict | None] = {
    "dense": None,
    "oktopk": {"algorithm": "oktopk", "density": 0.01},
    "topka": {"algorithm": "topka", "density": 0.01},
    "gtopk": {"algorithm": "gtopk", "density": 0.01},
    "gaussiank": {"algorithm": "gaussiank", "density": 0.01},
    "dense-q4": {"algorithm": "dense", "compressor": "q4"},
    "dense-fp16": {"algorithm": "dense", "compressor": "fp16"},
    "oktopk-q8": {"algorithm": "oktopk", "density": 0.01, "compressor": "q8"},
}


def _data(seed: int = 0):
    from sklearn.datasets import load_digits

    d = load_digits()
    x = torch.tensor(d.data, dtype=torch.float32) / 16.0
    y = torch.tensor(d.target, dtype=torch.int64)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    x, y = x[perm], y[perm]
    cut = int(0.8 * len(x))
    return (x[:cut], y[:cut]), (x[cut:], y[cut:])


def _model(seed: int = 0) -> torch.nn.Module:
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(),
                                   torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))


def _schedule(name: str, model: torch.nn.Module, opt: torch.optim.Optimizer, settings: dict | None):
    from . import schedules

    cls = {"wfbp": schedules.WFBP, "synceasgd": schedules.SyncEASGD, "mgwfbp": schedules.MGWFBP,
           "dear": schedules.DeAR, "pipesgd": schedules.PipeSGD}[name]
    settings = settings or {"algorithm": "dense", "density": 1.0}
    options = {"tau": 32, "tau_prime": 64} if settings["algorithm"] == "oktopk" else {}
    return cls(model, opt, algorithm=settings["algorithm"], density=settings.get("density", 1.0),
               compressor=settings.get("compressor"), algorithm_options=options)


def train_rank(rank: int, size: int, config: str, epochs: int = 30, batch: int = 16, lr: float = 0.05,
               network: str = "10gbe", seed: int = 0, progress: bool = False, schedule: str = "none") -> dict:
    """Train one configuration on this rank (torch.distributed must be initialised)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}; choose from {SCHEDULES}")
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from .hooks import SparseHookState, sparse_allreduce_hook
    from .network import resolve_network
    from .schedules import DeAR

    net = resolve_network(network)
    (xtr, ytr), (xte, yte) = _data(seed)
    per_rank = len(xtr) // size
    xs, ys = xtr[rank * per_rank:(rank + 1) * per_rank], ytr[rank * per_rank:(rank + 1) * per_rank]
    settings = CONFIGS[config]
    model = DDP(_model(seed)) if schedule == "none" else _model(seed)
    steps_per_epoch = per_rank // batch
    state = None
    if settings is not None and schedule == "none":
        options = {"tau": 32, "tau_prime": 64} if settings["algorithm"] == "oktopk" else {}
        state = SparseHookState(model, settings["algorithm"], settings.get("density", 1.0),
                                compressor=settings.get("compressor"), min_bucket_elements=0,
                                algorithm_options=options)
        model.register_comm_hook(state, sparse_allreduce_hook)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    sched_comm = _schedule(schedule, model, opt, settings) if schedule != "none" else None
    # Cosine decay: the last epochs are quiet, so final accuracies compare runs, not noise.
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=epochs * steps_per_epoch)
    n_params = sum(p.numel() for p in model.parameters())
    history: dict[str, list] = {"loss": [], "accuracy": [], "modelled_seconds": [],
                                "compute_seconds": []}
    modelled, compute, bytes_steps = 0.0, 0.0, []
    for epoch in range(epochs):
        perm = torch.randperm(per_rank, generator=torch.Generator().manual_seed(1000 * epoch + rank))
        total_loss = 0.0
        for s in range(steps_per_epoch):
            idx = perm[s * batch:(s + 1) * batch]
            t0 = time.perf_counter()
            # Before forward: schedules start allreduces during backward (DeAR also in forward).
            before = sched_comm.engine.comm.stats.snapshot() if sched_comm is not None else None
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(xs[idx]), ys[idx])
            loss.backward()
            if sched_comm is None:
                opt.step()
            else:
                sched_comm.step()  # waits for this step's allreduces (Pipe-SGD: the last step's)
            sched.step()
            wall = time.perf_counter() - t0
            if sched_comm is not None:  # every allreduce of the step, as if none overlapped
                delta = sched_comm.engine.comm.stats - before
                nbytes = delta.bytes_sent
                comm_s = net.time(delta.messages_sent, delta.bytes_sent)
                hook_s = 0.0
            elif state is None:  # DDP's own ring allreduce: 2n(P-1)/P floats, 2(P-1) messages
                nbytes = 2 * n_params * 4 * (size - 1) / size
                comm_s = net.time(2 * (size - 1), nbytes)
                hook_s = 0.0
            else:
                buckets = state.stats[-2] if len(state.stats) > 1 else []
                nbytes = sum(b["bytes_sent"] for b in buckets)
                comm_s = sum(net.time(b["messages"], b["bytes_sent"]) for b in buckets)
                hook_s = sum(b["seconds"] for b in buckets)
            modelled += comm_s
            compute += max(wall - hook_s, 0.0)
            bytes_steps.append(nbytes)
            total_loss += loss.item()
        if sched_comm is not None and hasattr(sched_comm, "flush"):
            sched_comm.flush()  # Pipe-SGD: evaluate with every gradient applied
        if isinstance(sched_comm, DeAR):
            sched_comm.synchronize()  # DeAR: the last updates wait for a forward
        with torch.no_grad():
            acc = float((getattr(model, "module", model)(xte).argmax(1) == yte).float().mean())
        history["loss"].append(total_loss / steps_per_epoch)
        history["accuracy"].append(acc)
        history["modelled_seconds"].append(modelled)
        history["compute_seconds"].append(compute)
        if progress and rank == 0:
            bar = "#" * int(30 * (epoch + 1) / epochs)
            print(f"\r  {config:<11} [{bar:<30}] epoch {epoch + 1}/{epochs} acc {acc:.3f}",
                  end="", flush=True, file=sys.stderr)
    if progress and rank == 0:
        print(file=sys.stderr)
    if sched_comm is not None:
        sched_comm.close()
    sent = torch.tensor([sum(bytes_steps) / len(bytes_steps)], dtype=torch.float64)
    dist.all_reduce(sent, op=dist.ReduceOp.MAX)
    return {"config": config if schedule == "none" else f"{config}/{schedule}", "schedule": schedule,
            "ranks": size, "epochs": epochs, "params": n_params,
            "bytes_per_step": float(sent), "network": net.name, **history}


def run(configs: list[str], ranks: int = 4, epochs: int = 30, **kwargs: Any) -> list[dict]:
    """Run each configuration on ``ranks`` local gloo processes; rank 0's records.

    Keyword arguments go to :func:`train_rank` (batch, lr, network, seed).
    """
    from .launch import spawn

    unknown = [c for c in configs if c not in CONFIGS]
    if unknown:
        raise ValueError(f"unknown configuration(s) {unknown}; known: {list(CONFIGS)}")
    return [spawn(ranks, _train_spawned, name, epochs, kwargs)[0] for name in configs]


def _train_spawned(rank: int, size: int, name: str, epochs: int, kwargs: dict) -> dict:
    return train_rank(rank, size, name, epochs, progress=True, **kwargs)


def format_results(results: list[dict]) -> str:
    """Final table: accuracy, bytes per rank per step and its ratio to dense, times."""
    dense = next((r for r in results if r["config"].split("/")[0] == "dense"), None)
    net = results[0]["network"]
    lines = [f"{'config':<12} {'final acc':>9} {'best acc':>9} {'bytes/rank/step':>16} "
             f"{'vs dense':>9} {'comm s (' + net + ')':>16} {'compute s':>10}"]
    for r in results:
        ratio = r["bytes_per_step"] / dense["bytes_per_step"] if dense else math.nan
        lines.append(f"{r['config']:<12} {r['accuracy'][-1]:>9.4f} {max(r['accuracy']):>9.4f} "
                     f"{r['bytes_per_step']:>16,.0f} {ratio:>9.4f} {r['modelled_seconds'][-1]:>16.3f} "
                     f"{r['compute_seconds'][-1]:>10.2f}")
    return "\n".join(lines)


def plot(results: list[dict], path: str) -> None:
    """Test accuracy vs epoch and vs modelled time, one line per configuration."""
    plt = pyplot()
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    for r in results:
        epochs = range(1, len(r["accuracy"]) + 1)
        a.plot(epochs, r["accuracy"], label=r["config"])
        b.plot(r["modelled_seconds"], r["accuracy"], label=r["config"])
    a.set_xlabel("epoch")
    b.set_xlabel(f"modelled communication time (s) on {results[0]['network']}")
    b.set_xscale("log")
    for ax in (a, b):
        ax.set_ylabel("test accuracy")
        ax.set_ylim(0.5, 1.0)
        ax.grid(True, alpha=0.3)
    a.legend(fontsize=8)
    fig.suptitle(f"digits MLP ({results[0]['params']:,} parameters), {results[0]['ranks']} ranks")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
