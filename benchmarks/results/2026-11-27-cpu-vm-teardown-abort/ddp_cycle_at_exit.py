"""A gloo abort at interpreter exit, without sparsecomm: a DDP model that a reference cycle keeps
alive past ``destroy_process_group()`` (as a Lightning Trainer, its strategy and its model hold
one another) is freed by the interpreter's last collection, during finalisation.

    torchrun --standalone --nproc-per-node 2 ddp_cycle_at_exit.py            # aborts now and then
    torchrun --standalone --nproc-per-node 2 ddp_cycle_at_exit.py collect    # frees it first: never

Aborting prints "terminate called without an active exception" after both ranks printed "done".
"""

import gc
import os
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

dist.init_process_group("gloo")
torch.manual_seed(0)
model = DDP(torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10)))
holder = {"model": model}
holder["self"] = holder  # the cycle
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(20):
    opt.zero_grad()
    model(torch.randn(64, 256)).sum().backward()
    opt.step()
if sys.argv[1:] == ["collect"]:
    del model, holder, opt
    gc.collect()
dist.barrier()
dist.destroy_process_group()
print("done", os.environ["RANK"], flush=True)
