"""Data-parallel training without DDP: a sparsecomm schedule around a model and its optimizer.

    torchrun --nproc-per-node 2 examples/schedule_no_ddp.py                     # MG-WFBP
    torchrun --nproc-per-node 2 examples/schedule_no_ddp.py --schedule pipesgd
    python examples/schedule_no_ddp.py                                          # a world of one

MG-WFBP (``--schedule mgwfbp``) reduces groups of layers on a communication thread
as backward produces their gradients; it profiles the first steps, then merges layers
into the groups its model of compute and communication says finish first. Pipe-SGD
(``--schedule pipesgd``) reduces each step's whole gradient while the next step
computes, and applies it one step late. Either sends only ``--density`` of the
entries (Ok-Topk by default, with error feedback).

Where to clip differs: MG-WFBP's allreduces start during backward, so the gradients
are clipped after ``synchronize()`` (clipping between backward and it raises
``sparsecomm.ScheduleError``, since the change would be lost); Pipe-SGD reduces what
``step()`` finds, so the local gradients are clipped before it.

gloo on CPU; NCCL on GPU, one GPU per process (LOCAL_RANK). Rank 0 prints the loss per
epoch (averaged over ranks), the held-out accuracy, the bytes the schedule sent and,
for MG-WFBP, its groups.
"""

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from sparsecomm.schedules import MGWFBP, PipeSGD


def make_data(train: int, test: int, seed: int = 0) -> tuple[TensorDataset, TensorDataset]:
    """A learnable 10-class problem: the label is the argmax of a fixed random linear map of x, plus noise.

    Every rank draws the same data from the same seed; the sampler gives each its share.
    """
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(train + test, 64, generator=g)
    teacher = torch.randn(64, 10, generator=g)
    y = (x @ teacher + 0.5 * torch.randn(train + test, 10, generator=g)).argmax(1)
    return TensorDataset(x[:train], y[:train]), TensorDataset(x[train:], y[train:])


def make_model(hidden: int) -> nn.Module:
    return nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                         nn.Linear(hidden, 10))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedule", choices=["mgwfbp", "pipesgd"], default="mgwfbp")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--density", type=float, default=0.01, help="fraction of gradient entries sent")
    parser.add_argument("--algorithm", default="oktopk", help="any of sparsecomm.algorithms()")
    parser.add_argument("--clip", type=float, default=1.0, help="gradient norm clipping (0: none)")
    parser.add_argument("--batch", type=int, default=64, help="per rank")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--momentum", type=float, default=0.9,
                        help="lower it if Pipe-SGD diverges: its one step of staleness acts as extra momentum")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--samples", type=int, default=4096)
    args = parser.parse_args()

    cuda = torch.cuda.is_available()
    backend = "nccl" if cuda else "gloo"
    if "RANK" in os.environ:  # started by torchrun (or any launcher that sets its variables)
        dist.init_process_group(backend)
    else:  # plain python: a world of one, the same code path
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)

    model = make_model(args.hidden).to(device)
    with torch.no_grad():  # every rank starts from rank 0's parameters, as DDP would make it
        for t in model.state_dict().values():
            dist.broadcast(t, 0)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
    # Collective: every rank builds its schedule at the same point (each makes an engine, a
    # communication thread over its own duplicate of the process group).
    if args.schedule == "mgwfbp":
        sched = MGWFBP(model, optimizer, algorithm=args.algorithm, density=args.density)
    else:
        sched = PipeSGD(model, optimizer, algorithm=args.algorithm, density=args.density, warmup_steps=10)

    train, test = make_data(args.samples, 1024)
    sampler = DistributedSampler(train, shuffle=True, seed=0)
    loader = DataLoader(train, batch_size=args.batch, sampler=sampler)
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        totals = torch.zeros(2, device=device)  # sum of losses, samples
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            # Keeping the gradients (zeroed, not None) lets backward accumulate straight into
            # the schedule's buffers, which they are views of after a step: nothing is copied.
            optimizer.zero_grad(set_to_none=False)
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            if args.schedule == "pipesgd":
                if args.clip:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
                sched.step()  # submits this step's gradient, applies the previous step's
            else:
                sched.synchronize()  # waits for the groups: .grad now holds the reduced gradients
                if args.clip:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
                optimizer.step()
            totals += torch.stack([loss.detach() * len(y), torch.tensor(float(len(y)), device=device)])
        dist.all_reduce(totals)
        if rank == 0:
            print(f"epoch {epoch + 1} loss {(totals[0] / totals[1]).item():.4f}", flush=True)

    if args.schedule == "pipesgd":
        sched.flush()  # apply the last step's gradient, still in flight, before evaluating
    model.eval()
    with torch.no_grad():
        x, y = test.tensors
        accuracy = (model(x.to(device)).argmax(1) == y.to(device)).float().mean().item()
    sent = sched.engine.comm.stats.bytes_sent  # everything the schedule's engine sent, this rank
    steps = args.epochs * len(loader)
    if rank == 0:
        n = sum(p.numel() for p in model.parameters())
        dense = steps * 4 * n * 2 * (world - 1) / world  # a ring allreduce of fp32 per step
        print(f"test accuracy {accuracy:.3f}")
        print(f"{args.schedule}: {steps} steps; sent {sent / 1e6:.2f} MB per rank "
              f"(a dense allreduce: {dense / 1e6:.2f} MB)")
        if args.schedule == "mgwfbp":
            print(f"mgwfbp groups (layers, last first): {sched.groups} after {sched.plans} plan(s)")
    sched.close()  # stops the communication thread (every job was waited for above)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
