"""PyTorch Lightning's DDP strategy with sparsecomm's sparse allreduce as its communication hook.

    pip install lightning
    python examples/lightning_ddp.py                       # Lightning starts 2 processes (CPU: gloo)
    python examples/lightning_ddp.py --devices 4 --epochs 10 --density 0.01
    torchrun --nproc-per-node 2 examples/lightning_ddp.py  # or any launcher Lightning detects

The hook goes to ``DDPStrategy(ddp_comm_state=..., ddp_comm_hook=...)`` (the lines
marked ``# sparsecomm``). Lightning registers a strategy's hook on CUDA devices only;
on CPU the small callback below registers it (the same call Lightning makes), so the
script runs the sparse path on either. Rank 0 prints the loss per epoch (averaged
over ranks) and what the hook sent compared with a dense allreduce.
"""

import argparse
import gc

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.strategies import DDPStrategy
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from sparsecomm.hooks import SparseHookState, sparse_allreduce_hook  # sparsecomm


def make_data(train: int, test: int, seed: int = 0) -> tuple[TensorDataset, TensorDataset]:
    """A learnable 10-class problem: the label is the argmax of a fixed random linear map of x, plus noise.

    Every rank draws the same data from the same seed; Lightning's sampler gives each its share.
    """
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(train + test, 64, generator=g)
    teacher = torch.randn(64, 10, generator=g)
    y = (x @ teacher + 0.5 * torch.randn(train + test, 10, generator=g)).argmax(1)
    return TensorDataset(x[:train], y[:train]), TensorDataset(x[train:], y[train:])


class Classifier(L.LightningModule):
    """An MLP trained with SGD; logs the epoch's mean loss over every rank."""

    def __init__(self, hidden: int, lr: float) -> None:
        super().__init__()
        self.lr = lr
        self.net = nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                                 nn.Linear(hidden, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss, on_step=False, on_epoch=True, sync_dist=True)
        return loss

    def on_train_epoch_end(self) -> None:
        if self.trainer.is_global_zero:
            print(f"epoch {self.current_epoch + 1} loss {self.trainer.callback_metrics['train_loss']:.4f}",
                  flush=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


class CommHookOnCPU(L.Callback):
    """Register the DDP communication hook where Lightning's DDPStrategy does not: off CUDA."""

    def __init__(self, state, hook) -> None:
        self.state, self.hook = state, hook

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # The strategy has wrapped the model in DDP by now, and no backward has run yet.
        if trainer.strategy.root_device.type != "cuda":
            trainer.strategy.model.register_comm_hook(self.state, self.hook)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--devices", type=int, default=2, help="processes (CPU) or GPUs")
    parser.add_argument("--density", type=float, default=0.01, help="fraction of gradient entries sent")
    parser.add_argument("--algorithm", default="oktopk", help="any of sparsecomm.algorithms(); 'dense' to compare")
    parser.add_argument("--warmup-steps", type=int, default=10, help="dense steps before sparsifying")
    parser.add_argument("--batch", type=int, default=64, help="per rank")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--samples", type=int, default=4096)
    args = parser.parse_args()

    model = Classifier(args.hidden, args.lr)
    state = SparseHookState(model, args.algorithm, density=args.density, warmup_steps=args.warmup_steps)  # sparsecomm
    strategy = DDPStrategy(ddp_comm_state=state, ddp_comm_hook=sparse_allreduce_hook)  # sparsecomm
    trainer = L.Trainer(accelerator="auto", devices=args.devices, strategy=strategy, max_epochs=args.epochs,
                        callbacks=[CommHookOnCPU(state, sparse_allreduce_hook)],
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    train, _ = make_data(args.samples, 1024)
    trainer.fit(model, DataLoader(train, batch_size=args.batch, shuffle=True))

    if trainer.is_global_zero:
        world = trainer.world_size
        n = sum(p.numel() for p in model.parameters())
        # What the hook sent, next to what DDP's dense allreduce would have.
        hook = state.totals
        dense = hook["steps"] * 4 * n * 2 * (world - 1) / world  # a ring allreduce of fp32 per step
        print(f"hook: {hook['steps']} steps, {hook['sparse_buckets']} buckets by {args.algorithm}, "
              f"{hook['dense_buckets']} dense (warm-up or small); sent {hook['bytes_sent'] / 1e6:.2f} MB "
              f"per rank (a dense allreduce: {dense / 1e6:.2f} MB)")
    # Lightning leaves the process group up, and its trainer, strategy and model hold one another
    # (a reference cycle), DDP's reducer with them: left to the interpreter's last collection at
    # exit, gloo's teardown there aborted the process now and then ("terminate called without an
    # active exception"; reproduced without Lightning or sparsecomm in
    # benchmarks/results/2026-11-27-cpu-vm-teardown-abort). Free them while Python is whole, then
    # meet (a rank tearing down while its peer still talks to it aborts too) and destroy.
    del trainer, strategy, model, state
    gc.collect()
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
