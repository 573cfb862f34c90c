"""Convergence comparison on real data: DDP training with sparsecomm's hooks, or a schedule.

Two tasks (:mod:`sparsecomm.tools.tasks`; nothing is downloaded): ``digits``, a
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

import copy
import math
import time
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from .. import registry, schedules
from ..api import allreduce
from ..comm import resolve
from ..comm.sim import single_rank
from ..compress import COMPRESSORS
from ..errors import NonFiniteError
from ..hooks import SparseHookState, sparse_allreduce_hook
from ..network import PROFILES, resolve_network
from ..optim import DeMo, DiLoCo, SparseAdamW, local_gradient_hook
from ..schedules import SCHEDULES as REGISTERED_SCHEDULES
from . import output
from .launch import preload, spawn
from .tasks import get_task

__all__ = ["FULL_CONFIGS", "QUICK_CONFIGS", "QUICK_EPOCHS", "FULL_EPOCHS", "config_settings", "OWN_METHODS",
           "RECOMMENDED_DEMO", "PUBLISHED_DEMO", "DEMO_LR_SCALE", "CURVE_PROFILES", "SCHEDULES", "parse_config", "check_warmup",
           "train_rank", "run",
           "measure_compute", "measure_local_cost", "time_to_accuracy", "format_time_to_accuracy",
           "format_results", "plot"]

#: Network profiles the evaluation curve models the communication on (time to accuracy).
CURVE_PROFILES = ("1gbe", "10gbe", "pizdaint")

#: ``--schedule`` choices.
SCHEDULES = ("none", *REGISTERED_SCHEDULES)

#: What ``sparsecomm train`` runs without ``--configs``: DDP's own allreduce, every registered
#: sparse algorithm at 1%, the naive hook under AdamW, and 8-bit dense.
#: ``sparsecomm train --full``: every algorithm, the hook and a compressed dense, 30 epochs.
FULL_CONFIGS = ("dense", *(a for a in registry.names() if a != "dense"), "oktopk-hook", "dense-q8")
FULL_EPOCHS = 30
#: The plain ``sparsecomm train``, a first run of about a minute: dense against Ok-Topk.
QUICK_CONFIGS = ("dense", "oktopk")
QUICK_EPOCHS = {"digits": 10, "lm": 2}
DENSITY = 0.01
#: The configuration suffixes that name an optimizer communicating itself (no schedule, no hook).
OWN_METHODS = ("diloco", "demo", "sparseadamw")
#: What a plain sparse configuration runs under AdamW, the recommended method: DeMo with the
#: ``"rms"`` update rule and a momentum decay of 0.99 (the algorithm carrying the components).
#: On the LM at 800 steps over Ok-Topk it ended 1.017x, 0.971x and 1.063x dense's loss (seeds 0,
#: 1, 2), where the rms rule at DeMo's decay of 0.999 ended 1.059x, 0.960x and 1.010x (level over
#: three seeds) and DeMo's own sign rule 1.112x at its best rate; at 200 steps 0.99 leads (0.997x
#: against 1.030x; results.md section 8): what one component a chunk leaves behind fades in ~100
#: steps instead of lingering for ~1000. A ``-demo`` configuration is DeMo as published (the sign rule, 0.999);
#: ``demo_options`` override either.
RECOMMENDED_DEMO = {"update": "rms", "decay": 0.99}
#: What a ``-demo`` configuration runs: DeMo as published, the sign rule.
PUBLISHED_DEMO = {"update": "sign"}
#: DeMo's rate without ``--lr``, as a share of the task's AdamW rate, by update rule. The sign
#: step moves every entry by the whole rate (AdamW's by less): half the rate was its best on the
#: LM at 800 steps (1.11x, where the whole rate ended 1.16x and a quarter 1.26x). The rms rule
#: is at Adam's scale: the whole rate. The value rule's rate is in the gradient's units (0.1 on
#: the LM): pass one.
DEMO_LR_SCALE = {"sign": 0.5, "rms": 1.0, "value": 1.0}


def config_settings(config: str) -> dict | None:
    """The hook settings a configuration name stands for (None: DDP's own dense allreduce).

    "dense", or ALGORITHM[-COMPRESSOR][-hook|-diloco|-demo|-sparseadamw] for any registered
    algorithm and compressor: a sparse algorithm at density 1% (``oktopk``, ``topka-q8``), dense
    with a compressor (``dense-q8``). Under SGD a sparse configuration is the DDP hook; under
    AdamW it trains with the recommended AdamW method, decoupled momentum with the rms rule
    (:class:`sparsecomm.optim.DeMo` in place of AdamW, :data:`RECOMMENDED_DEMO`, the algorithm
    carrying the components; measured in ``docs/results.md`` section 8). The suffixes name one method whatever the
    optimizer: ``-hook`` the DDP hook in front of the task's own optimizer (under AdamW: error
    feedback on the gradient, then torch's AdamW, the naive path); ``-diloco`` low-communication
    training, the task's optimizer for ``sync_every`` steps a round without communication, then
    an outer step on the pseudo-gradient reduced by the algorithm
    (:class:`sparsecomm.optim.DiLoCo`; ``dense-diloco`` is DiLoCo itself); ``-demo`` decoupled
    momentum (``topka-demo`` is DeMo itself); ``-sparseadamw`` AdamW with local moments and the
    momentum through the algorithm (:class:`sparsecomm.optim.SparseAdamW`). ValueError for
    anything else.
    """
    if config == "dense":
        return None
    base, dash, suffix = config.rpartition("-")
    method = suffix if dash and suffix in OWN_METHODS + ("hook",) else ""
    diloco = method == "diloco"
    name = base if method else config
    algorithm, dash, compressor = name.partition("-")
    known = (algorithm in registry.names() and (not dash or compressor in COMPRESSORS)
             and not (algorithm == "dense" and (method not in ("", "diloco") or not (compressor or diloco))))
    if not known:
        raise ValueError(f"unknown configuration {config!r}: dense, or ALGORITHM[-COMPRESSOR][-hook|-diloco|-demo|"
                         f"-sparseadamw] with an algorithm of {registry.names()} and a compressor of {COMPRESSORS} "
                         "(dense takes a compressor or -diloco only)")
    settings: dict = {"algorithm": algorithm}
    if algorithm != "dense":
        settings["density"] = DENSITY
    if compressor:
        settings["compressor"] = compressor
    if method:
        settings[method] = True
    return settings


def parse_config(name: str) -> tuple[str, str | None]:
    """(configuration, schedule or None) of ``"oktopk"`` or ``"oktopk/pipesgd"``; ValueError if unknown."""
    config, _, schedule = name.partition("/")
    if schedule and schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule in {name!r}: /schedule is one of {SCHEDULES}")
    own = own_optimizer(config)
    if own and schedule:
        raise ValueError(f"{name!r}: a -{own} configuration is its own optimizer's communication, under no schedule")
    return config, schedule or None


def own_optimizer(config: str) -> str | None:
    """One of :data:`OWN_METHODS` when ``config`` names it by its suffix, else None."""
    settings = config_settings(config) or {}
    return next((k for k in OWN_METHODS if settings.get(k)), None)


def check_warmup(schedule: str, warmup_steps: int) -> None:
    """ValueError unless ``warmup_steps`` means something under ``schedule`` (the DDP hook or Pipe-SGD)."""
    if warmup_steps and schedule not in ("none", "pipesgd"):
        raise ValueError("warmup_steps applies to the DDP hook (dense steps first) and to Pipe-SGD "
                         "(synchronous steps first) only")


def _schedule(name: str, model: torch.nn.Module, opt: torch.optim.Optimizer, settings: dict | None,
              warmup_steps: int = 0):
    cls = schedules.SCHEDULES[name]
    settings = settings or {"algorithm": "dense", "density": 1.0}
    options = {"tau": 32, "tau_prime": 64} if settings["algorithm"] == "oktopk" else {}
    extra = {"warmup_steps": warmup_steps} if name == "pipesgd" else {}
    return cls(model, opt, algorithm=settings["algorithm"], density=settings.get("density", 1.0),
               compressor=settings.get("compressor"), algorithm_options=options, **extra)


def train_rank(rank: int, size: int, config: str, epochs: int = 30, batch: int = 16, lr: float | None = None,
               network: str = "10gbe", seed: int = 0, progress: bool = False, schedule: str = "none",
               task: str = "digits", optimizer: str | None = None, warmup_steps: int = 0,
               momentum: float = 0.9, adamw_options: dict | None = None, eval_every: int = 10,
               diloco_options: dict | None = None, demo_options: dict | None = None) -> dict:
    """Train one configuration on this rank (torch.distributed must be initialised).

    ``lr``, ``optimizer`` ("sgd" with momentum, or "adamw"): None takes the
    task's (a cosine decay over the run follows; the LM task warms up over its
    first 5% of steps); ``momentum``: SGD's. ``warmup_steps``: with the DDP hook, so many dense
    steps before the sparse ones (DGC's warm-up); with Pipe-SGD, so many
    synchronous steps before the pipelined ones (the paper's warm-up).

    With AdamW, a plain sparse configuration (not ``*-hook``) without a schedule trains with
    the recommended method, :class:`sparsecomm.optim.DeMo` with :data:`RECOMMENDED_DEMO` (DDP
    then communicates nothing: ``local_gradient_hook``). A ``-sparseadamw`` configuration trains
    with :class:`sparsecomm.optim.SparseAdamW`: ``warmup_steps`` (default 10) are its dense steps
    and ``adamw_options`` its other keyword arguments. The metric is also evaluated every
    ``eval_every`` steps (``curve``: the step, the metric, and the modelled communication
    seconds so far on each profile of :data:`CURVE_PROFILES`). A ``-diloco`` configuration
    takes :class:`~sparsecomm.optim.DiLoCo`'s keyword arguments from ``diloco_options``
    (``sync_every`` default 10); it is evaluated on the outer model. A ``-demo`` configuration
    trains with :class:`~sparsecomm.optim.DeMo` as published (the sign rule) in place of the
    task's optimizer (its weight decay; without ``lr``, the task's rate times
    :data:`DEMO_LR_SCALE` of the update rule), with ``demo_options`` its other keyword arguments;
    the record's ``demo_options`` are the ones it ran with.
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}; choose from {SCHEDULES}")
    check_warmup(schedule, warmup_steps)


    net = resolve_network(network)
    ethernet = {"modelled_1gbe": PROFILES["1gbe"], "modelled_10gbe": PROFILES["10gbe"]}
    job = get_task(task, seed)
    settings = config_settings(config)
    kind = optimizer or job.default_optimizer
    own = own_optimizer(config)
    if own and schedule != "none":
        raise ValueError(f"a -{own} configuration runs without a schedule")
    diloco, sparse_adamw = own == "diloco", own == "sparseadamw"
    # Under AdamW a plain sparse configuration runs the recommended method, DeMo's rms rule.
    demo = own == "demo" or (kind == "adamw" and settings is not None and own is None and schedule == "none"
                             and not settings.get("hook") and settings["algorithm"] != "dense")
    plain = job.model(seed)
    model = DDP(plain) if schedule == "none" else plain
    steps_per_epoch = job.steps_per_epoch(size, batch)
    total_steps = epochs * steps_per_epoch
    state = None
    if sparse_adamw:
        model.register_comm_hook(None, local_gradient_hook)
        options = {"tau": 32, "tau_prime": 64} if settings["algorithm"] == "oktopk" else {}
        opt = SparseAdamW(model.parameters(), lr=job.lr if lr is None else lr, **job.adamw_settings,
                          density=settings["density"], algorithm=settings["algorithm"],
                          compressor=settings.get("compressor"), algorithm_options=options,
                          warmup_steps=warmup_steps or 10, **(adamw_options or {}))
        warmup_steps = opt.warmup_steps
    elif diloco or demo:
        model.register_comm_hook(None, local_gradient_hook)  # the optimizer communicates itself
    elif settings is not None and schedule == "none":
        options = {"tau": 32, "tau_prime": 64} if settings["algorithm"] == "oktopk" else {}
        state = SparseHookState(model, settings["algorithm"], settings.get("density", 1.0),
                                compressor=settings.get("compressor"), min_bucket_elements=0,
                                algorithm_options=options, warmup_steps=warmup_steps)
        model.register_comm_hook(state, sparse_allreduce_hook)
    if demo:  # the recommendation, or (-demo) DeMo as published
        demo_options = {**(RECOMMENDED_DEMO if own is None else PUBLISHED_DEMO), **(demo_options or {})}
        scale = DEMO_LR_SCALE.get(demo_options["update"], 1.0)  # an unknown rule: DeMo says so
        opt = DeMo(model.parameters(), lr=job.lr * scale if lr is None else lr,
                   algorithm=settings["algorithm"], compressor=settings.get("compressor"),
                   density=settings["density"],
                   weight_decay=job.adamw_settings["weight_decay"], **demo_options)
    elif not sparse_adamw:
        opt = job.optimizer(model.parameters(), job.lr if lr is None else lr, optimizer, momentum)
    outer = None
    if diloco:
        outer_kw = {"sync_every": 10, "density": settings.get("density", 1.0), **(diloco_options or {})}
        outer = DiLoCo(plain, opt, algorithm=settings["algorithm"], compressor=settings.get("compressor"),
                       **outer_kw)
    if diloco or demo:
        own_comm = resolve()
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
    curve: dict[str, list] = {"step": [], job.metric: [], **{name: [] for name in CURVE_PROFILES}}
    on_curve = dict.fromkeys(CURVE_PROFILES, 0.0)
    step = 0
    label = config if schedule == "none" else f"{config}/{schedule}"
    bar = output.progress(total=epochs, show=progress and rank == 0, desc=label, unit="epoch")
    for epoch in range(epochs):
        total_loss = 0.0
        for x, y in job.batches(rank, size, batch, epoch):
            t0 = time.perf_counter()
            # Before forward: schedules start allreduces during backward (DeAR also in forward).
            before = sched_comm.engine.comm.stats.snapshot() if sched_comm is not None else None
            opt.zero_grad()
            try:
                loss = job.loss(model, x, y)
                loss.backward()
                if outer is not None:
                    before = own_comm.stats.snapshot()
                    outer.step()
                elif demo:
                    before = own_comm.stats.snapshot()
                    opt.step()
                elif sched_comm is None:
                    opt.step()
                else:
                    sched_comm.step()  # waits for this step's allreduces (Pipe-SGD: the last step's)
            except NonFiniteError as exc:  # every rank raises it alike: the run diverged, say where
                raise NonFiniteError(f"{label} diverged at step {step + 1} (a gradient held NaN or Inf on "
                                     f"rank(s) {exc.ranks}); a lower --lr may train", exc.ranks) from exc
            sched.step()
            wall = time.perf_counter() - t0
            if sparse_adamw:
                call = opt.last_call
                traffic = [(call["messages"], call["bytes_sent"])]
                hook_s = call["seconds"]
                if not call["dense"]:
                    selected.append(call["selected"] / max(call["k"], 1))
            elif outer is not None or demo:  # nothing, or the outer step's allreduce; DeMo's one
                delta = own_comm.stats - before
                traffic = [(delta.messages_sent, delta.bytes_sent)]
                hook_s = 0.0
            elif sched_comm is not None:  # every allreduce of the step, as if none overlapped
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
            for name in CURVE_PROFILES:
                on_curve[name] += sum(PROFILES[name].time(m, nb) for m, nb in traffic)
            step += 1
            if eval_every and step % eval_every == 0:  # a schedule's updates in flight stay in flight
                curve["step"].append(step)
                curve[job.metric].append(_evaluate(job, plain, outer) if rank == 0 else math.nan)
                for name in CURVE_PROFILES:
                    curve[name].append(on_curve[name])
        if sched_comm is not None:
            sched_comm.finish()  # evaluate with every update applied (Pipe-SGD's last, DeAR's pending)
        ruined = _nonfinite_ranks(plain, rank, size)
        if ruined:  # DDP's own allreduce checks nothing: a run that diverged would go on, scored on NaN
            raise NonFiniteError(f"{label} diverged by step {step}: the parameters hold NaN or Inf on rank(s) "
                                 f"{ruined}; a lower --lr may train", ruined)
        score = _evaluate(job, plain, outer) if rank == 0 else math.nan  # rank 0's record is the one returned
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
            "lr": opt.param_groups[0]["initial_lr"],  # the peak rate (the schedule's factor 1)
            "metric": job.metric,
            "higher_is_better": job.higher_is_better,
            "ranks": size, "epochs": epochs, "steps_per_epoch": steps_per_epoch, "params": n_params,
            "bytes_per_step": float(sent), "network": net.name,
            "selected_per_k": {"mean": sum(selected) / len(selected), "min": min(selected)} if selected else None,
            "path": "SparseAdamW" if sparse_adamw else ("DiLoCo" if outer is not None else "DeMo" if demo else (
                "hook" if state is not None else ("schedule" if sched_comm is not None else "ddp"))),
            "diloco_options": diloco_options if outer is not None else None,
            "demo_options": demo_options if demo else None,
            "adamw_options": adamw_options if sparse_adamw else None,
            "curve": curve, **history}


def _evaluate(job: Any, model: torch.nn.Module, outer: "DiLoCo | None") -> float:
    """The task's metric of ``model``; under DiLoCo mid-round, of the outer model (a copy)."""
    if outer is None or outer.synced:
        return job.evaluate(model)
    synced = copy.deepcopy(model)
    torch.nn.utils.vector_to_parameters(outer.anchor.clone(), [p for p in synced.parameters() if p.requires_grad])
    return job.evaluate(synced)


def measure_compute(task: str = "digits", batch: int = 16, optimizer: str | None = None,
                    steps: int = 10, seed: int = 0) -> float:
    """Seconds of one training step without communication (forward, backward, the
    task's torch optimizer) in this process: the same figure for every configuration
    of a comparison, so loopback traffic is never counted as compute."""
    job = get_task(task, seed)
    model = job.model(seed)
    opt = job.optimizer(model.parameters(), job.lr, optimizer)
    times = []
    for i, (x, y) in enumerate(job.batches(0, 1, batch, 0)):
        if i == steps + 2:
            break
        t0 = time.perf_counter()
        opt.zero_grad()
        job.loss(model, x, y).backward()
        opt.step()
        if i >= 2:  # the first steps allocate
            times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def _nonfinite_ranks(model: torch.nn.Module, rank: int, size: int) -> list[int]:
    """The ranks whose parameters hold NaN or Inf (collective: every rank gets the same list)."""
    flags = torch.zeros(size, dtype=torch.int32)
    flags[rank] = int(not all(bool(torch.isfinite(p).all()) for p in model.parameters()))
    dist.all_reduce(flags)
    return torch.nonzero(flags).flatten().tolist()


def measure_local_cost(config: str, n: int, calls: int = 10, seed: int = 0) -> float:
    """Seconds of one call of the configuration's allreduce on one rank (error feedback,
    selection, packing; every collective returns at once): the local cost a step adds.
    0 for DDP's dense allreduce."""
    settings = config_settings(config)
    if settings is None:
        return 0.0

    options = {"tau": 32, "tau_prime": 64} if settings["algorithm"] == "oktopk" else {}
    st = registry.get(settings["algorithm"]).state_class(settings.get("density", 1.0), **options)
    comm = single_rank()
    g = torch.Generator().manual_seed(seed)
    times = []
    for i in range(calls + 2):
        flat = torch.randn(n, generator=g)
        t0 = time.perf_counter()
        allreduce(flat, state=st, compressor=settings.get("compressor"), comm=comm)
        if i >= 2:
            times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def run(configs: list[str], ranks: int = 4, epochs: int = 30, compute_per_step: float | None = None,
        **kwargs: Any) -> list[dict]:
    """Run each configuration on ``ranks`` local gloo processes; rank 0's records.

    Keyword arguments go to :func:`train_rank` (batch, lr, network, seed, schedule, task,
    optimizer, adamw_options, eval_every, diloco_options, demo_options). A configuration may name its own schedule,
    ``"oktopk/pipesgd"``; the others take ``schedule`` (default none). Each record also
    holds ``compute_per_step`` (:func:`measure_compute`, measured once, before the runs,
    unless given: a comparison made of several calls measures it once) and ``local_per_step`` (:func:`measure_local_cost`), the terms of the modelled time
    that :func:`time_to_accuracy` adds to the modelled communication.
    """
    runs = []
    for name in configs:
        config, schedule = parse_config(name)
        runs.append((config, {**kwargs, **({"schedule": schedule} if schedule else {})}))
    task = kwargs.get("task", "digits")
    compute = compute_per_step
    if compute is None:
        compute = measure_compute(task, kwargs.get("batch", 16), kwargs.get("optimizer"), seed=kwargs.get("seed", 0))
    n = sum(p.numel() for p in get_task(task).model().parameters())
    # A -diloco configuration makes its call once a round (every sync_every steps).
    every = [((config_settings(c) or {}).get("diloco") and (kw.get("diloco_options") or {}).get("sync_every", 10))
             or 1 for c, kw in runs]
    local = [measure_local_cost(config, n) / k for (config, _), k in zip(runs, every)]
    # One set of processes trains every configuration in turn: each configuration builds its
    # model, optimizer and states anew from the seed, and a launch per configuration cost
    # seconds of process start each. Training runs for long: the collectives' own timeouts
    # catch a dead peer.
    preload("torch._dynamo")  # (DDP imports it in every rank)
    records = spawn(ranks, _train_spawned, runs, epochs, timeout=7 * 86400)[0]
    return [{**r, "compute_per_step": compute, "local_per_step": cost} for r, cost in zip(records, local)]


def time_to_accuracy(results: list[dict]) -> list[dict]:
    """When each run first reaches the dense run's marks, in steps and modelled seconds.

    1. The marks: dense's metric at 25/50/75% of its run, its final metric within 2%
       ("1.02x": a loss at most 1.02 times, an accuracy at least 0.98 times), and
       its final metric itself (1.00x).
    2. For each run, the first evaluation (``curve``) at or past each mark.
    3. Its modelled time on each profile of :data:`CURVE_PROFILES`: steps x (compute per
       step + the algorithm's local cost per step) + the modelled communication so far.

    Returns one dict per run: config, and per mark (its name: "dense@25%", ...,
    "1.02x", "1.00x") {"value", "step", and a time per profile}, step and times None when
    it never got there. Empty without a dense run or without curves.
    """
    dense = next((r for r in results if r["config"].split("/")[0] == "dense" and r.get("curve")), None)
    if dense is None:
        return []
    metric, higher = dense["metric"], dense.get("higher_is_better", True)
    curve = dense["curve"]
    final = curve[metric][-1]
    marks = {}
    for frac in (25, 50, 75):
        i = max(0, math.ceil(len(curve["step"]) * frac / 100) - 1)
        marks[f"dense@{frac}%"] = curve[metric][i]
    marks["1.02x"] = final * (0.98 if higher else 1.02)
    marks["1.00x"] = final
    rows = []
    for r in results:
        c = r.get("curve")
        if not c:
            continue
        per_step = r.get("compute_per_step", 0.0) + r.get("local_per_step", 0.0)
        row: dict[str, Any] = {"config": r["config"]}
        for mark, value in marks.items():
            hit = next((i for i, m in enumerate(c[metric]) if (m >= value if higher else m <= value)), None)
            entry: dict[str, Any] = {"value": value, "step": None if hit is None else c["step"][hit]}
            for name in CURVE_PROFILES:
                entry[name] = None if hit is None else c["step"][hit] * per_step + c[name][hit]
            row[mark] = entry
        rows.append(row)
    return rows


def format_time_to_accuracy(rows: list[dict], profile: str = "1gbe") -> str:
    """The table of :func:`time_to_accuracy`: step / modelled seconds on ``profile`` per mark."""
    if not rows:
        return ""
    marks = [k for k in rows[0] if k != "config"]
    head = f"{'time to accuracy (' + profile + ')':<24}" + "".join(f"{m + ' ' + format(rows[0][m]['value'], '.4f'):>22}"
                                                           for m in marks)
    lines = [head, f"{'config':<24}" + "".join(f"{'step / seconds':>22}" for _ in marks)]
    for row in rows:
        cells = []
        for m in marks:
            e = row[m]
            cells.append(f"{'never':>22}" if e["step"] is None else f"{e['step']:>10} / {e[profile]:>9.1f}")
        lines.append(f"{row['config']:<24}" + "".join(cells))
    return "\n".join(lines)


def _train_spawned(rank: int, size: int, runs: list[tuple[str, dict]], epochs: int) -> list[dict]:
    return [train_rank(rank, size, name, epochs, progress=True, **kwargs) for name, kwargs in runs]


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
        c = r.get("curve")
        if c and c["step"]:  # evaluated every few steps; the modelled time of time_to_accuracy
            per_step = r.get("compute_per_step", 0.0) + r.get("local_per_step", 0.0)
            axes[0].plot(c["step"], c[metric], label=r["config"])
            for ax, key in zip(axes[1:], ("1gbe", "10gbe")):
                ax.plot([s * per_step + m for s, m in zip(c["step"], c[key])], c[metric], label=r["config"])
            continue
        steps = r.get("steps") or [(e + 1) * r.get("steps_per_epoch", 1) for e in range(len(r[metric]))]
        axes[0].plot(steps, r[metric], label=r["config"])
        for ax, key in zip(axes[1:], ("modelled_1gbe", "modelled_10gbe")):
            if key in r:
                ax.plot([c + m for c, m in zip(r["compute_seconds"], r[key])], r[metric], label=r["config"])
    dense = next((r for r in results if r["config"].split("/")[0] == "dense"), None)
    if dense is not None and dense.get("curve"):  # the marks of time_to_accuracy
        final = dense["curve"][metric][-1]
        for ax in axes:
            ax.axhline(final, color="k", lw=0.6, ls=":")
            ax.axhline(final * (0.98 if dense.get("higher_is_better", True) else 1.02), color="k", lw=0.6, ls="--")
    axes[0].set_xlabel("step")
    axes[1].set_xlabel("compute + local cost + modelled communication on 1 Gbit/s (s)")
    axes[2].set_xlabel("compute + local cost + modelled communication on 10 Gbit/s (s)")
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
