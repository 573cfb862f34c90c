"""Sharded training with sparse reductions: plain FSDP2/HSDP against ``sparsecomm.fsdp.enable``.

    python benchmarks/fsdp_study.py --task lm --steps 200 --out DIR          # loss, bytes, memory
    python benchmarks/fsdp_study.py --task mlp --optimizer sgd --steps 30 --out DIR   # 25M parameters
    python benchmarks/fsdp_study.py --project --out DIR     # the traffic model at P = 64 ... 4096
    sparsecomm emulate --ranks 4 --ranks-per-node 2 --rate 1gbit -- \
        python benchmarks/fsdp_study.py --task mlp --optimizer sgd --steps 12 --configs hsdp --emulated --out DIR

Each configuration runs in its own gloo world (``--ranks``, 4 by default: flat over 4, or HSDP as
2 replicas of 2 shards) so that each process's memory high-water mark (``VmHWM``) is its own.
Per configuration: the final loss (LM: the task's validation loss, evaluated on every rank,
which FSDP needs; MLP: the training loss of the last 10 steps), the bytes each rank sent in the
sparse calls (plain: the dense reductions' bytes, computed), the peak memory per rank, and the
step's wall time. Writes ``fsdp_study.json`` and ``fsdp_study.md`` in ``--out``.

``--emulated``: the ranks are the emulated cluster's (``sparsecomm emulate`` starts this script
on every rank), one configuration a call; rank 0 adds a row to ``emulated.json`` and
``emulated.md``: the step's wall time (the last ``steps - 2``) and the bytes that left its node
(its network namespace's interfaces, ``/proc/net/dev``: headers and retransmissions included).

Configurations (``--configs``): ``plain`` (FSDP over every rank), ``flat`` (the sparse
reduce-scatter, fp32 residual), ``flat-bf16`` (bf16 residual), ``plain-hsdp`` (FSDP2's native
2-D mesh), ``hsdp`` (custom HSDP: Ok-Topk between the replicas), ``diloco-hsdp`` (FSDP inside each
replica, ``sparsecomm.optim.DiLoCo`` across them: the optimizer's steps alone for 5 steps, then an
outer step at 5% through Ok-Topk).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

CONFIGS = ("plain", "flat", "flat-bf16", "plain-hsdp", "hsdp", "diloco-hsdp")


def _vm_hwm_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _node_tx_bytes() -> int:
    """Bytes sent by this network namespace's interfaces other than loopback (a node's port)."""
    with open("/proc/net/dev") as f:
        rows = [line.split(":", 1) for line in f if ":" in line]
    return sum(int(fields.split()[8]) for name, fields in rows if name.strip() != "lo")


def _model(task: str, width: int, seed: int):
    if task == "lm":
        from sparsecomm.tools.tasks import get_task
        job = get_task("lm", seed)
        return job, job.model(seed)
    torch.manual_seed(seed)
    layers = [torch.nn.Linear(64, width), torch.nn.ReLU()]
    for _ in range(5):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    layers.append(torch.nn.Linear(width, 10))
    return None, torch.nn.Sequential(*layers)


def _rank(rank: int, size: int, config: str, task: str, steps: int, optimizer: str, density: float, width: int,
          lr: float | None) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import sparsecomm.fsdp

    hsdp = config.endswith("hsdp")
    mesh = init_device_mesh("cpu", (2, size // 2) if hsdp else (size,),
                            mesh_dim_names=("replicate", "shard") if hsdp else ("shard",))
    job, model = _model(task, width, seed=0)
    target = mesh if config == "plain-hsdp" else mesh["shard"]
    # FSDP's usual unit: each block of a ModuleList (the LM's transformer layers: their attention
    # reads its out_proj's weight without calling it, so a layer is one unit), else each layer
    # with parameters (the MLP); the root takes the rest.
    blocks = [b for m in model.modules() if isinstance(m, torch.nn.ModuleList) for b in m]
    targets = blocks or [m for m in model.modules() if m is not model and any(True for _ in m.parameters(recurse=False))]
    for m in targets:
        fully_shard(m, mesh=target)
    fully_shard(model, mesh=target)
    state = outer = None
    if config in ("flat", "flat-bf16", "hsdp"):
        state = sparsecomm.fsdp.enable(model, density=density, residual_dtype=torch.bfloat16 if config == "flat-bf16"
                                       else None, replicate_group=mesh["replicate"].get_group() if hsdp else None)
    lr = lr if lr is not None else (job.lr if job is not None and optimizer == "adamw" else 0.05)
    opt = (torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.01) if optimizer == "adamw"
           else torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9))
    if config == "diloco-hsdp":
        from sparsecomm.optim import DiLoCo

        outer = DiLoCo(model, opt, sync_every=5, density=0.05, group=mesh["replicate"].get_group())
    n = sum(p.numel() for p in model.parameters())
    losses, t0, tx0, step = [], None, 0, 0
    gen = torch.Generator().manual_seed(1000 + rank)
    teacher = torch.randn(64, 10, generator=torch.Generator().manual_seed(7))
    epoch = 0
    while step < steps:
        batches = job.batches(rank, size, 16, epoch) if job is not None else (
            (x, (x @ teacher).argmax(1)) for x in (torch.randn(32, 64, generator=gen) for _ in range(50)))
        for x, y in batches:
            if step == 2:
                t0, tx0 = time.perf_counter(), _node_tx_bytes()  # (the first steps warm up)
            opt.zero_grad()
            loss = job.loss(model, x, y) if job is not None else torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            (outer or opt).step()
            losses.append(loss.item())
            step += 1
            if step == steps:
                break
        epoch += 1
    seconds = (time.perf_counter() - t0) / max(1, steps - 2)
    node_tx = (_node_tx_bytes() - tx0) / max(1, steps - 2)
    final = job.evaluate(model) if job is not None else sum(losses[-10:]) / len(losses[-10:])
    sent = (state.totals["bytes_sent"] / steps if state is not None else outer.state.totals["bytes_sent"] / steps
            if outer is not None else _dense_bytes(config, n, size))
    return {"config": config, "loss": final, "bytes_per_step": sent, "vm_hwm_mb": _vm_hwm_mb(),
            "seconds_per_step": seconds, "node_tx_per_step": node_tx, "params": n, "ranks": size}


def _dense_bytes(config: str, n: int, size: int) -> float:
    """What a rank sends a step in plain FSDP's reduce-scatter over every rank (a ring, float32),
    or, for HSDP, in the allreduce of its shard across the 2 replicas only: the within-node
    reduce-scatter is the same dense one in both HSDP rows, and the sparse rows count only their
    sparse calls (the across-replica allreduce, or the flat mode's reduce-scatter)."""
    if config.endswith("hsdp"):  # (plain-hsdp)
        return 4 * 2 * (n / (size // 2)) * (2 - 1) / 2
    return 4 * n * (size - 1) / size


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--task", default="lm", choices=["lm", "mlp"])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--optimizer", default="adamw", choices=["adamw", "sgd"])
    ap.add_argument("--density", type=float, default=0.01)
    ap.add_argument("--width", type=int, default=2240, help="mlp: hidden width (2240: 25M parameters)")
    ap.add_argument("--lr", type=float, default=None)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--project", action="store_true",
                    help="only write projection.md: sparsecomm.fsdp.project at P = 64 ... 4096 (no training)")
    ap.add_argument("--emulated", action="store_true",
                    help="run as one rank of `sparsecomm emulate` (one configuration); rank 0 writes emulated.*")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    if args.project:
        write_projection(args.out, args.density)
        return
    if args.emulated:
        run_emulated(args)
        return
    from sparsecomm.tools.launch import spawn

    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "fsdp_study.json")
    rows = json.load(open(path)) if os.path.exists(path) else []
    for config in args.configs.split(","):
        key = (args.task, args.optimizer, args.steps, config)
        if any((r["task"], r["optimizer"], r["steps"], r["config"]) == key for r in rows):
            continue
        per_rank = spawn(args.ranks, _rank, config, args.task, args.steps, args.optimizer, args.density, args.width,
                         args.lr, threads=1)
        row = dict(per_rank[0], task=args.task, optimizer=args.optimizer, steps=args.steps, density=args.density,
                   vm_hwm_mb=max(r["vm_hwm_mb"] for r in per_rank),
                   bytes_per_step=max(r["bytes_per_step"] for r in per_rank))
        rows.append(row)
        json.dump(rows, open(path, "w"), indent=1)
        print(f"# {config}: loss {row['loss']:.4f}, {row['bytes_per_step']:,.0f} B/step, "
              f"{row['vm_hwm_mb']:.0f} MB, {row['seconds_per_step']:.3f} s/step", flush=True)
    for r in rows:  # (the dense rows' bytes are computed: the formula of the running code)
        if r["config"].startswith("plain"):
            r["bytes_per_step"] = _dense_bytes(r["config"], r["params"], r["ranks"])
    lines = ["| task | optimizer | steps | config | final loss | ÷ plain | bytes a rank a step | ÷ plain | peak MB a rank "
             "(VmHWM) | s a step |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ratio = _ratio_to_plain(r, rows, ("task", "optimizer", "steps"))
        lines.append(f"| {r['task']} ({r['params'] / 1e6:.2f}M) | {r['optimizer']} | {r['steps']} | {r['config']} | "
                     f"{r['loss']:.4f} | {ratio('loss')} | {r['bytes_per_step']:,.0f} | {ratio('bytes_per_step')} | "
                     f"{r['vm_hwm_mb']:.0f} | {r['seconds_per_step']:.3f} |")
    open(os.path.join(args.out, "fsdp_study.md"), "w").write("\n".join(lines) + "\n")
    print("\n".join(lines))


def _ratio_to_plain(r: dict, rows: list[dict], same: tuple[str, ...]):
    """A function of a field: ``r``'s value of it over its plain row's (plain FSDP, or native HSDP
    for an HSDP row; the one that agrees on ``same``), formatted; "" without one."""
    plain = "plain-hsdp" if r["config"].endswith("hsdp") else "plain"
    base = next((b for b in rows if b["config"] == plain and all(b[k] == r[k] for k in same)), None)
    return lambda field: f"{r[field] / base[field]:.3f}" if base and base[field] else ""


def run_emulated(args: argparse.Namespace) -> None:
    """One configuration on the emulated cluster's ranks; rank 0 adds its row to emulated.json/.md."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    (config,) = args.configs.split(",")
    row = _rank(rank, size, config, args.task, args.steps, args.optimizer, args.density, args.width, args.lr)
    rows = [None] * size
    dist.all_gather_object(rows, row)
    dist.destroy_process_group()
    if rank != 0:
        return
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "emulated.json")
    table = json.load(open(path)) if os.path.exists(path) else []
    network = os.environ.get("SPARSECOMM_NETWORK", "unknown")
    table.append(dict(row, task=args.task, optimizer=args.optimizer, steps=args.steps, density=args.density,
                      network=network, seconds_per_step=max(r["seconds_per_step"] for r in rows),
                      node_tx_per_step=max(r["node_tx_per_step"] for r in rows)))
    json.dump(table, open(path, "w"), indent=1)
    lines = ["| network | config | s a step | ÷ plain | MB leaving a node a step | ÷ plain | bytes a rank a step "
             "(the reductions) |", "|---|---|---|---|---|---|---|"]
    for r in table:
        ratio = _ratio_to_plain(r, table, ("network", "task"))
        lines.append(f"| {r['network']} | {r['config']} | {r['seconds_per_step']:.3f} | {ratio('seconds_per_step')} | "
                     f"{r['node_tx_per_step'] / 1e6:.2f} | {ratio('node_tx_per_step')} | {r['bytes_per_step']:,.0f} |")
    open(os.path.join(args.out, "emulated.md"), "w").write("\n".join(lines) + "\n")
    print(lines[0], lines[-1], sep="\n", flush=True)


def write_projection(out: str, density: float) -> None:
    """projection.md: each design's modelled reduction time a step (``sparsecomm.fsdp.project``)
    for a 25M-entry model and BERT-large's 336M, on nodes of 8 (nvl8: NDR between nodes;
    nvl8-10gbe: 10 Gbit/s Ethernet shared by the node) and nodes of 4 on 1 Gbit/s Ethernet."""
    from sparsecomm.fsdp import DESIGNS, project
    from sparsecomm.network import PROFILES, Network, TwoLevel

    eth = TwoLevel(PROFILES["nvl8"].intra, Network(50e-6, 4 / 125e6, "1gbe/4"), 4, "4-a-node-1gbe")
    lines = ["# Modelled gradient reduction a step, by sharded design (sparsecomm.fsdp.project)", "",
             f"Density {density}; Ok-Topk between replicas (sparse-hsdp). Seconds, and ÷ plain FSDP's.", ""]
    for n in (25_000_000, 336_000_000):
        for net in ("nvl8", "nvl8-10gbe", eth):
            rows = project(n, density, (64, 256, 1024, 4096), net)
            name = rows[0]["network"]
            lines += [f"## n = {n:,}, {name}", "", "| P | " + " | ".join(DESIGNS) + " |",
                      "|---|" + "---|" * len(DESIGNS)]
            for P in sorted({r["P"] for r in rows}):
                cells = [next(r for r in rows if r["P"] == P and r["design"] == d) for d in DESIGNS]
                lines.append(f"| {P} | " + " | ".join(f"{c['seconds']:.4f} ({c['vs_fsdp']:.3f})" for c in cells) + " |")
            lines.append("")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "projection.md"), "w") as f:
        f.write("\n".join(lines))


if __name__ == "__main__":
    main()
