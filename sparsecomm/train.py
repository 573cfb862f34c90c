"""Convergence comparison on real data: DDP training with sparsecomm's hooks, or a schedule.

Two tasks (:mod:`sparsecomm.tasks`; nothing is downloaded): ``digits``, a
small MLP on scikit-learn's bundled handwritten digits (test accuracy), and
``lm``, a byte-level transformer language model of about 2.5 million
parameters on the Python standard library's own source files (validation
loss). Each configuration trains on ``ranks`` gloo processes: DDP's default
dense allreduce, sparse allreduces at 1% density, and compressed dense
allreduces. Every run records its metric and training loss per epoch, bytes
sent per rank per step, the measured compute time (everything but the
hook's communication; noisy on a shared machine) and the *modelled*
communication time: what the step's messages and bytes would take on a
network profile (alpha-beta), since loopback on one machine says nothing
about a cluster; also on 1 and 10 Gbit/s Ethernet (``modelled_1gbe``,
``modelled_10gbe``). The modelled time is a pure function of the traffic, so
runs compare fairly however loaded the machine was.

``schedule`` (``sparsecomm train --schedule``): instead of the DDP hook, one
of :mod:`sparsecomm.schedules` (WFBP, SyncEASGD, MG-WFBP, DeAR, Pipe-SGD)
around the plain model reduces the gradients with the configuration's
algorithm ("dense": the dense algorithm). The modelled time then adds up
every allreduce's messages and bytes as if none overlapped (an upper bound).
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch

from . import output
from .schedules import SCHEDULES as REGISTERED_SCHEDULES
from .tasks import get_task

__all__ = ["CONFIGS", "SCHEDULES", "parse_config", "check_warmup", "train_rank", "run", "format_results", "plot"]

#: ``--schedule`` choices.
SCHEDULES = ("none", *REGISTERED_SCHEDULES)

#: name -> hook settings (None: DDP's own dense allreduce).
CONFIGS: dict[str, dict | None] = {
    "dense": None,
    "oktopk": {"algorithm": "oktopk", "density": 0.01},
    "topka": {"algorithm": "topka", "density": 0.01},
    "gtopk": {"algorithm": "gtopk", "density": 0.01},
    "gaussiank": {"algorithm": "gaussiank", "density": 0.01},
    "cltk": {"algorithm": "cltk", "density": 0.01},
    "dense-q4": {"algorithm": "dense", "compressor": "q4"},
    "dense-fp16": {"algorithm": "dense", "compressor": "fp16"},
    "oktopk-q8": {"algorithm": "oktopk", "density": 0.01, "compressor": "q8"},
}


def parse_config(name: str) -> tuple[str, str | None]:
    """(configuration, schedule or None) of ``"oktopk"`` or ``"oktopk/pipesgd"``; ValueError if unknown."""
    config, _, schedule = name.partition("/")
    if config not in CONFIGS or (schedule and schedule not in SCHEDULES):
        raise ValueError(f"unknown configuration {name!r}; known: {list(CONFIGS)}, each optionally "
                         f"followed by /schedule, one of {SCHEDULES}")
    return config, schedule or None


def check_warmup(schedule: str, warmup_steps: int) -> None:
    """ValueError unless ``warmup_steps`` means something under ``schedule`` (the DDP hook or Pipe-SGD)."""
    if warmup_steps and schedule not in ("none", "pipesgd"):
        raise ValueError("warmup_steps applies to the DDP hook (dense steps first) and to Pipe-SGD "
                         "(synchronous steps first) only")


def _schedule(name: str, model: torch.nn.Module, opt: torch.optim.Optimizer, settings: dict | None,
              warmup_steps: int = 0):
    from . import schedules

    cls = schedules.SCHEDULES[name]
    settings = settings or {"algorithm": "dense", "density": 1.0}
    options = {"tau": 32, "tau_prime": 64} if settings["algorithm"] == "oktopk" else {}
    extra = {"warmup_steps": warmup_steps} if name == "pipesgd" else {}
    return cls(model, opt, algorithm=settings["algorithm"], density=settings.get("density", 1.0),
               compressor=settings.get("compressor"), algorithm_options=options, **extra)


def train_rank(rank: int, size: int, config: str, epochs: int = 30, batch: int = 16, lr: float | None = None,
               network: str = "10gbe", seed: int = 0, progress: bool = False, schedule: str = "none",
               task: str = "digits", optimizer: str | None = None, warmup_steps: int = 0,
               momentum: float = 0.9) -> dict:
    """Train one configuration on this rank (torch.distributed must be initialised).

    ``lr``, ``optimizer`` ("sgd" with momentum, or "adamw"): None takes the
    task's (a cosine decay over the run follows; the LM task warms up over its
    first 5% of steps); ``momentum``: SGD's. ``warmup_steps``: with the DDP hook, so many dense
    steps before the sparse ones (DGC's warm-up); with Pipe-SGD, so many
    synchronous steps before the pipelined ones (the paper's warm-up).
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}; choose from {SCHEDULES}")
    check_warmup(schedule, warmup_steps)
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from .hooks import SparseHookState, sparse_allreduce_hook
    from .network import PROFILES, resolve_network

    net = resolve_network(network)
    ethernet = {"modelled_1gbe": PROFILES["1gbe"], "modelled_10gbe": PROFILES["10gbe"]}
    job = get_task(task, seed)
    settings = CONFIGS[config]
    plain = job.model(seed)
    model = DDP(plain) if schedule == "none" else plain
    steps_per_epoch = job.steps_per_epoch(size, batch)
    total_steps = epochs * steps_per_epoch
    state = None
    if settings is not None and schedule == "none":
        options = {"tau": 32, "tau_prime": 64} if settings["algorithm"] == "oktopk" else {}
        state = SparseHookState(model, settings["algorithm"], settings.get("density", 1.0),
                                compressor=settings.get("compressor"), min_bucket_elements=0,
                                algorithm_options=options, warmup_steps=warmup_steps)
        model.register_comm_hook(state, sparse_allreduce_hook)
    opt = job.optimizer(model.parameters(), job.lr if lr is None else lr, optimizer, momentum)
    sched_comm = _schedule(schedule, model, opt, settings, warmup_steps) if schedule != "none" else None
    # Cosine decay: the last epochs are quiet, so final metrics compare runs, not noise.
    warmup = max(1, total_steps // 20) if task == "lm" else 0

    def lr_factor(t: int) -> float:
        if t < warmup:
            return (t + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * (t - warmup) / max(1, total_steps - warmup)))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor)
    n_params = sum(p.numel() for p in model.parameters())
    history: dict[str, list] = {"loss": [], job.metric: [], "modelled_seconds": [], "compute_seconds": [],
                                "steps": [], **{name: [] for name in ethernet}}
    modelled, compute, bytes_steps, selected = 0.0, 0.0, [], []
    on_ethernet = dict.fromkeys(ethernet, 0.0)
    label = config if schedule == "none" else f"{config}/{schedule}"
    bar = output.progress(total=epochs, show=progress and rank == 0, desc=label, unit="epoch")
    for epoch in range(epochs):
        total_loss = 0.0
        for x, y in job.batches(rank, size, batch, epoch):
            t0 = time.perf_counter()
            # Before forward: schedules start allreduces during backward (DeAR also in forward).
            before = sched_comm.engine.comm.stats.snapshot() if sched_comm is not None else None
            opt.zero_grad()
            loss = job.loss(model, x, y)
            loss.backward()
            if sched_comm is None:
                opt.step()
            else:
                sched_comm.step()  # waits for this step's allreduces (Pipe-SGD: the last step's)
            sched.step()
            wall = time.perf_counter() - t0
            if sched_comm is not None:  # every allreduce of the step, as if none overlapped
                delta = sched_comm.engine.comm.stats - before
                traffic = [(delta.messages_sent, delta.bytes_sent)]
                hook_s = 0.0
            elif state is None:  # DDP's own ring allreduce: 2n(P-1)/P floats, 2(P-1) messages
                traffic = [(2 * (size - 1), 2 * n_params * 4 * (size - 1) / size)]
                hook_s = 0.0
            else:
                buckets = state.stats[-2] if len(state.stats) > 1 else []
                traffic = [(b["messages"], b["bytes_sent"]) for b in buckets]
                hook_s = sum(b["seconds"] for b in buckets)
                wanted = sum(math.ceil(settings.get("density", 1.0) * b["numel"]) for b in buckets if not b["dense"])
                if wanted:  # the global result's size against k: a threshold that undershoots slows training
                    selected.append(sum(b["selected"] for b in buckets if not b["dense"]) / wanted)
            modelled += sum(net.time(m, nb) for m, nb in traffic)
            for name, profile in ethernet.items():
                on_ethernet[name] += sum(profile.time(m, nb) for m, nb in traffic)
            compute += max(wall - hook_s, 0.0)
            bytes_steps.append(sum(nb for _, nb in traffic))
            total_loss += loss.item()
        if sched_comm is not None:
            sched_comm.finish()  # evaluate with every update applied (Pipe-SGD's last, DeAR's pending)
        score = job.evaluate(plain) if rank == 0 else math.nan  # rank 0's record is the one returned
        history["loss"].append(total_loss / steps_per_epoch)
        history[job.metric].append(score)
        history["modelled_seconds"].append(modelled)
        history["compute_seconds"].append(compute)
        history["steps"].append((epoch + 1) * steps_per_epoch)
        for name in ethernet:
            history[name].append(on_ethernet[name])
        bar.set_postfix_str(f"{job.metric} {score:.4f}", refresh=False)
        bar.update()
    bar.close()
    if sched_comm is not None:
        sched_comm.close()
    sent = torch.tensor([sum(bytes_steps) / len(bytes_steps)], dtype=torch.float64)
    dist.all_reduce(sent, op=dist.ReduceOp.MAX)
    return {"config": label, "schedule": schedule,
            "task": task, "optimizer": optimizer or job.default_optimizer, "warmup_steps": warmup_steps,
            "momentum": momentum if (optimizer or job.default_optimizer) == "sgd" else None,
            "metric": job.metric,
            "higher_is_better": job.higher_is_better,
            "ranks": size, "epochs": epochs, "steps_per_epoch": steps_per_epoch, "params": n_params,
            "bytes_per_step": float(sent), "network": net.name,
            "selected_per_k": {"mean": sum(selected) / len(selected), "min": min(selected)} if selected else None,
            **history}


def run(configs: list[str], ranks: int = 4, epochs: int = 30, **kwargs: Any) -> list[dict]:
    """Run each configuration on ``ranks`` local gloo processes; rank 0's records.

    Keyword arguments go to :func:`train_rank` (batch, lr, network, seed, schedule, task).
    A configuration may name its own schedule, ``"oktopk/pipesgd"``; the
    others take ``schedule`` (default none).
    """
    from .launch import spawn

    runs = []
    for name in configs:
        config, schedule = parse_config(name)
        runs.append((config, {**kwargs, **({"schedule": schedule} if schedule else {})}))
    # Training runs for long: the collectives' own timeouts catch a dead peer.
    return [spawn(ranks, _train_spawned, config, epochs, options, timeout=7 * 86400)[0] for config, options in runs]


def _train_spawned(rank: int, size: int, name: str, epochs: int, kwargs: dict) -> dict:
    return train_rank(rank, size, name, epochs, progress=True, **kwargs)


def format_results(results: list[dict]) -> str:
    """Final table: the task's metric (final, best, against dense's), bytes per rank per step and
    its ratio to dense, times."""
    dense = next((r for r in results if r["config"].split("/")[0] == "dense"), None)
    net, metric = results[0]["network"], results[0].get("metric", "accuracy")
    higher = results[0].get("higher_is_better", True)
    best = max if higher else min
    short = {"accuracy": "acc", "val_loss": "val loss"}.get(metric, metric)
    lines = [f"{'config':<17} {'final ' + short:>14} {'best ' + short:>13} {'vs dense':>9} {'bytes/rank/step':>16} "
             f"{'vs dense':>9} {'comm s (' + net + ')':>16} {'compute s':>10}"]
    for r in results:
        ratio = r["bytes_per_step"] / dense["bytes_per_step"] if dense else math.nan
        final = r[metric][-1]
        vs = final / dense[metric][-1] if dense else math.nan
        lines.append(f"{r['config']:<17} {final:>14.4f} {best(r[metric]):>13.4f} {vs:>9.4f} "
                     f"{r['bytes_per_step']:>16,.0f} {ratio:>9.4f} {r['modelled_seconds'][-1]:>16.3f} "
                     f"{r['compute_seconds'][-1]:>10.2f}")
    return "\n".join(lines)


def plot(results: list[dict], path: str) -> None:
    """The task's metric against steps, and against modelled time on 1 and 10 Gbit/s Ethernet
    (measured compute plus the modelled communication, as if none overlapped), one line per
    configuration."""
    plt = output.pyplot()
    r0 = results[0]
    metric = r0.get("metric", "accuracy")
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    for r in results:
        steps = r.get("steps") or [(e + 1) * r.get("steps_per_epoch", 1) for e in range(len(r[metric]))]
        axes[0].plot(steps, r[metric], label=r["config"])
        for ax, key in zip(axes[1:], ("modelled_1gbe", "modelled_10gbe")):
            if key in r:
                ax.plot([c + m for c, m in zip(r["compute_seconds"], r[key])], r[metric], label=r["config"])
    axes[0].set_xlabel("step")
    axes[1].set_xlabel("compute + modelled communication on 1 Gbit/s (s)")
    axes[2].set_xlabel("compute + modelled communication on 10 Gbit/s (s)")
    for ax in axes:
        ax.set_ylabel({"accuracy": "test accuracy", "val_loss": "validation loss (nats/byte)"}.get(metric, metric))
        if metric == "accuracy":
            ax.set_ylim(0.5, 1.0)
        ax.grid(True, alpha=0.3)
    axes[0].legend(fontsize=8)
    what = {"digits": "digits MLP", "lm": "byte-level transformer LM"}.get(r0.get("task", "digits"), "model")
    fig.suptitle(f"{what} ({r0['params']:,} parameters), {r0['ranks']} ranks")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
