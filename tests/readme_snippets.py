"""Run the README's Python snippets in order, as a reader would paste them into one session.

    python tests/readme_snippets.py RESULT.json SCRATCH

The snippets use names a reader's script already has (a gradient, a model, its DDP wrapper, an
optimizer, data, a loss, a scaler, a checkpoint path): :data:`FIXTURES` makes small ones, anew
before each snippet, in one namespace that carries what earlier snippets defined (the API
snippet reuses the quick start's ``state``). Everything runs on a torch.distributed world of one
gloo rank, as a script started with plain ``python`` under DDP would. Writes, per snippet, None
or the traceback it raised.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from readme import python_blocks  # noqa: E402

#: The names the snippets take from the reader's own script, made small.
FIXTURES = """
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

torch.manual_seed(0)
grad = torch.randn(100_000)                                     # a small gradient
grad_of = lambda rank: torch.randn(100_000, generator=torch.Generator().manual_seed(rank))
model = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.ReLU(), torch.nn.Linear(256, 4))
ddp_model = DDP(model)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
loss_fn = torch.nn.functional.cross_entropy
data = [(torch.randn(16, 32), torch.randint(0, 4, (16,))) for _ in range(10)]   # two DiLoCo rounds
x, y = data[0]
loss = loss_fn(model(x), y)
scaler = torch.amp.GradScaler("cpu")
path = "checkpoint.pt"
"""


def main(result: str, folder: str) -> int:
    os.chdir(folder)
    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    namespace: dict = {}
    outcome = []
    for block in python_blocks():
        try:
            exec(compile(FIXTURES, "<fixtures>", "exec"), namespace)
            exec(compile(block.text, f"README.md:{block.line}", "exec"), namespace)
            outcome.append(None)
        except BaseException:  # noqa: BLE001 - reported per snippet
            outcome.append(traceback.format_exc())
    Path(result).write_text(json.dumps(outcome))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
