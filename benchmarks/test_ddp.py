"""The DDP suite: one training step (forward, backward with the hook, SGD step) with each hook.

"none" is the step without communication (``no_sync``), the floor every hook
is compared with (each hook's row also times it beside its own rounds, on the
same model, and its ratio is to that); then PyTorch's default, fp16 and PowerSGD (rank 1) hooks and
sparsecomm's hook with Ok-Topk 1% (synchronous and overlapping) and dense q8.
Needs torch.distributed: under torchrun it is the launcher's group; under
mpiexec/srun the ``torch_group`` fixture starts one over the same ranks.
Model: ``SPARSECOMM_BENCH_MODEL`` (default mlp, 25M parameters; also deep, cnn and small, see steps.py); ``SPARSECOMM_BENCH_WARMUP``
untimed steps first (default 30: the steady state, not error feedback's build-up). Every hook runs
with ``gradient_as_bucket_view=True`` (gradients live in the buckets, saving two
copies of the model per step, as a user tuning DDP would set it);
``SPARSECOMM_BENCH_BUCKET_VIEW=0`` measures DDP's default layout instead.

PowerSGD on gloo runs with a single bucket: its hook issues the second
allreduce of a bucket from a future's callback, and with several buckets the
ranks can issue those in different orders (seen here under mpiexec: gloo's
"Received data size doesn't match expected size" and an abort).
"""

from __future__ import annotations

import os

import pytest
import torch
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel as DDP

from sparsecomm.tools.bench import bench_device
from sparsecomm.hooks import SparseHookState, sparse_allreduce_hook

from steps import batches, model, time_steps


def _register(name: str, ddp: DDP, group) -> None:
    if name == "fp16":
        ddp.register_comm_hook(group, default_hooks.fp16_compress_hook)
    elif name == "powersgd r1":
        ddp.register_comm_hook(powerSGD_hook.PowerSGDState(process_group=group, matrix_approximation_rank=1,
                                                           start_powerSGD_iter=2), powerSGD_hook.powerSGD_hook)
    elif name.startswith("sparsecomm"):
        kw = {"sparsecomm oktopk 1%": {"algorithm": "oktopk", "density": 0.01},
              "sparsecomm oktopk 1% overlap": {"algorithm": "oktopk", "density": 0.01, "overlap": True},
              "sparsecomm dense q8": {"algorithm": "dense", "compressor": "q8"}}[name]
        ddp.register_comm_hook(SparseHookState(ddp, warmup_steps=0, group=group, **kw), sparse_allreduce_hook)


BUCKET_VIEW = os.environ.get("SPARSECOMM_BENCH_BUCKET_VIEW", "1") != "0"
#: Untimed steps first: error feedback's residuals build up and Ok-Topk's thresholds settle
#: over its first ~20 calls (which select exactly more often); training lives after that.
WARMUP = int(os.environ.get("SPARSECOMM_BENCH_WARMUP", "30"))
HOOKS = ["none", "ddp default", "fp16", "powersgd r1", "sparsecomm oktopk 1%", "sparsecomm oktopk 1% overlap",
         "sparsecomm dense q8"]


@pytest.mark.parametrize("hook", HOOKS)
def test_ddp_step(benchmark, comm, torch_group, hook):
    device = bench_device(comm)
    net = model("mlp").to(device)
    one_bucket = hook == "powersgd r1" and torch.distributed.get_backend(torch_group) == "gloo"
    ddp = DDP(net, device_ids=[device.index] if device.type == "cuda" else None, process_group=torch_group,
              bucket_cap_mb=1024 if one_bucket else 25, gradient_as_bucket_view=BUCKET_VIEW)
    if hook not in ("none", "ddp default"):
        _register(hook, ddp, torch_group)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    data = batches(net, comm.rank, device)

    def step(communicate: bool = hook != "none") -> None:
        x, y = data()
        opt.zero_grad(set_to_none=False)
        if communicate:
            torch.nn.functional.cross_entropy(ddp(x), y).backward()
        else:
            with ddp.no_sync():
                torch.nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()

    # Every hook's row also times the step without communication beside its rounds (the same
    # model and buffers, ``no_sync``): its /none is then one run's ratio.
    time_steps(benchmark, comm, "ddp", hook, step, warmup=WARMUP, device=device,
               beside=None if hook == "none" else lambda: step(False))
