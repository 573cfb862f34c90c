"""Write a fixture of training-loop checkpoints with the code of the checkout it runs from.

    python tests/data/make_loops.py tests/data/loops_<revision>.pt

Every schedule (with Ok-Topk and with TopkA) and ``SparseAdamW`` on a simulated world of 2 ranks,
and the DDP hook on 2 gloo ranks, train through ``tests/loop_fixture.py``'s steps, which leave
every kind of gradient memory in the checkpoint: residuals, a frozen layer's parked residual and
a refused step's carried results. The fixture holds each rank's checkpoint and the digest of its
parameters after the steps that follow. A later revision that loads the checkpoints and makes
those steps must give the same digests (``tests/promises/test_loop_checkpoints.py``).
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import loop_fixture  # noqa: E402
import sparsecomm  # noqa: E402
from sparsecomm.schedules import SCHEDULES  # noqa: E402
from sparsecomm.tools.launch import spawn  # noqa: E402

ALGORITHMS = ("oktopk", "topka")


def main(path: str) -> None:
    out = {}
    for name in SCHEDULES:
        for algorithm in ALGORITHMS:
            runs = sparsecomm.simulate(2, lambda r: loop_fixture.schedule_loop(r, name, algorithm), timeout=60).results
            out[f"{name}/{algorithm}"] = {"checkpoints": [c for c, _ in runs], "digests": [str(d) for _, d in runs]}
    runs = sparsecomm.simulate(2, loop_fixture.adamw_loop, timeout=60).results
    out["sparse_adamw"] = {"checkpoints": [c for c, _ in runs], "digests": [str(d) for _, d in runs]}
    runs = spawn(2, loop_fixture.hook_loop, timeout=120, threads=1)
    out["hook"] = {"checkpoints": [c for c, _ in runs], "digests": [str(d) for _, d in runs]}
    torch.save(out, path)


if __name__ == "__main__":
    main(sys.argv[1])
