"""Plain PyTorch FSDP2 training whose gradients are reduced sparsely by sparsecomm.

    torchrun --nproc-per-node 2 examples/fsdp_torchrun.py
    torchrun --nproc-per-node 4 examples/fsdp_torchrun.py --shard 2    # custom HSDP: 2 replicas of 2 shards
    sparsecomm emulate --ranks 4 --ranks-per-node 2 -- python examples/fsdp_torchrun.py --shard 2
        # the same on 2 emulated nodes of 2 ranks, 1 Gbit/s between them (root)

An ordinary FSDP2 script (``fully_shard`` on each layer, then on the model; an MLP on a synthetic
10-class problem): sparsecomm is the three lines marked ``# sparsecomm``; delete them and it is
plain FSDP (or plain HSDP over a 2-D mesh) again. Without ``--shard`` every rank holds a shard
and the reduce-scatter is sparse (each rank keeps a full-size residual); with ``--shard S``
FSDP shards over S consecutive ranks (a node), reduces densely there, and the shards' replicas
on the other nodes are summed by a sparse allreduce (a shard-sized residual). gloo on CPU;
NCCL on GPU, one GPU per process. Rank 0 prints the loss per epoch, the held-out accuracy and
what was sent compared with a dense reduction.
"""

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import sparsecomm.fsdp  # sparsecomm


def make_data(train: int, test: int, seed: int = 0):
    """A learnable 10-class problem: the label is the argmax of a fixed random linear map of x, plus noise."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(train + test, 64, generator=g)
    teacher = torch.randn(64, 10, generator=g)
    y = (x @ teacher + 0.5 * torch.randn(train + test, 10, generator=g)).argmax(1)
    return (x[:train], y[:train]), (x[train:], y[train:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--density", type=float, default=0.01, help="fraction of gradient entries sent")
    parser.add_argument("--shard", type=int, default=0, help="ranks a shard group (custom HSDP); 0: every rank")
    parser.add_argument("--batch", type=int, default=64, help="per rank")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--samples", type=int, default=2048)
    args = parser.parse_args()

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    shard = args.shard or world
    mesh = init_device_mesh(device.type, (world // shard, shard), mesh_dim_names=("replicate", "shard"))

    torch.manual_seed(0)  # every replica starts from the same weights (FSDP broadcasts nothing)
    model = nn.Sequential(nn.Linear(64, args.hidden), nn.ReLU(), nn.Linear(args.hidden, args.hidden), nn.ReLU(),
                          nn.Linear(args.hidden, 10)).to(device)
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh["shard"])
    fully_shard(model, mesh=mesh["shard"])
    replicas = mesh["replicate"].get_group() if world > shard else None
    state = sparsecomm.fsdp.enable(model, density=args.density, replicate_group=replicas)  # sparsecomm
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)

    (x_train, y_train), (x_test, y_test) = make_data(args.samples, 1024)
    mine = torch.arange(rank, args.samples, world)  # each rank its share of the samples
    for epoch in range(args.epochs):
        order = mine[torch.randperm(len(mine), generator=torch.Generator().manual_seed(epoch))]
        totals = torch.zeros(2, device=device)
        for start in range(0, len(order), args.batch):
            idx = order[start:start + args.batch]
            x, y = x_train[idx].to(device), y_train[idx].to(device)
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            totals += torch.stack([loss.detach() * len(y), torch.tensor(float(len(y)), device=device)])
        dist.all_reduce(totals)
        if rank == 0:
            print(f"epoch {epoch + 1} loss {(totals[0] / totals[1]).item():.4f}", flush=True)

    with torch.no_grad():
        accuracy = (model(x_test.to(device)).argmax(1) == y_test.to(device)).float().mean().item()
    sent = torch.tensor([float(state.totals["bytes_sent"])], device=device)  # sparsecomm
    dist.all_reduce(sent, op=dist.ReduceOp.MAX)
    if rank == 0:
        n = sum(p.numel() for p in model.parameters())
        calls = state.totals["calls"] // len(state.modules)
        # A dense reduce-scatter sends (P - 1)/P of the gradient; a dense allreduce of a shard twice that.
        group = world // shard if world > shard else world
        dense = calls * 4 * (n / (1 if world == shard else shard)) * (group - 1) / group * (2 if world > shard else 1)
        print(f"test accuracy {accuracy:.3f}")
        print(f"sparsecomm.fsdp ({state.mode}): {calls} steps; sent {sent.item() / 1e6:.2f} MB per rank "
              f"(a dense reduction: {dense / 1e6:.2f} MB)")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
