"""Plain PyTorch DDP training with sparsecomm's sparse allreduce as DDP's communication hook.

    torchrun --nproc-per-node 2 examples/ddp_torchrun.py
    torchrun --nproc-per-node 2 examples/ddp_torchrun.py --epochs 10 --density 0.01
    torchrun --nproc-per-node 2 examples/ddp_torchrun.py --algorithm dense   # the same hook, dense

An ordinary DDP script (an MLP on a synthetic 10-class problem, so nothing is
downloaded): the hook is the three lines marked ``# sparsecomm``; delete them and
it is plain DDP again. gloo on CPU; NCCL on GPU, one GPU per process (LOCAL_RANK).
Rank 0 prints the loss per epoch (averaged over ranks), the held-out accuracy, and
what the hook sent compared with a dense allreduce.
"""

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from sparsecomm.hooks import SparseHookState, sparse_allreduce_hook  # sparsecomm


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
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--density", type=float, default=0.01, help="fraction of gradient entries sent")
    parser.add_argument("--algorithm", default="oktopk", help="any of sparsecomm.algorithms(); 'dense' to compare")
    parser.add_argument("--warmup-steps", type=int, default=10, help="dense steps before sparsifying")
    parser.add_argument("--batch", type=int, default=64, help="per rank")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--samples", type=int, default=4096)
    args = parser.parse_args()

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")  # rank, size and address from torchrun's env
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)

    model = DDP(make_model(args.hidden).to(device), device_ids=[local_rank] if cuda else None)
    state = SparseHookState(model, args.algorithm, density=args.density, warmup_steps=args.warmup_steps)  # sparsecomm
    model.register_comm_hook(state, sparse_allreduce_hook)  # sparsecomm
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)

    train, test = make_data(args.samples, 1024)
    sampler = DistributedSampler(train, shuffle=True, seed=0)
    loader = DataLoader(train, batch_size=args.batch, sampler=sampler)
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)  # a different shuffle each epoch, the same on every rank
        model.train()
        totals = torch.zeros(2, device=device)  # sum of losses, samples
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            totals += torch.stack([loss.detach() * len(y), torch.tensor(float(len(y)), device=device)])
        dist.all_reduce(totals)
        if rank == 0:
            print(f"epoch {epoch + 1} loss {(totals[0] / totals[1]).item():.4f}", flush=True)

    model.eval()
    with torch.no_grad():
        x, y = test.tensors
        accuracy = (model.module(x.to(device)).argmax(1) == y.to(device)).float().mean().item()
    if rank == 0:
        n = sum(p.numel() for p in model.parameters())
        print(f"test accuracy {accuracy:.3f}")
        # What the hook sent, next to what DDP's dense allreduce would have.
        hook = state.totals
        dense = hook["steps"] * 4 * n * 2 * (world - 1) / world  # a ring allreduce of fp32 per step
        print(f"hook: {hook['steps']} steps, {hook['sparse_buckets']} buckets by {args.algorithm}, "
              f"{hook['dense_buckets']} dense (warm-up or small); sent {hook['bytes_sent'] / 1e6:.2f} MB "
              f"per rank (a dense allreduce: {dense / 1e6:.2f} MB)")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
