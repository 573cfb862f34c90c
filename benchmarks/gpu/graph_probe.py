"""What stops a steady world-size-1 call from being captured in a CUDA graph, per algorithm.

1. Warm a state up with error feedback on a drifting gradient (thresholds settle).
2. Capture one more call with ``torch.cuda.graph``, under ``set_sync_debug_mode("error")``
   so that the first host synchronisation raises where it is made.
3. Print, per algorithm, whether capture succeeded (and whether a replay equals an
   eager call on the same input), else the innermost sparsecomm line that stopped it.

    python benchmarks/gpu/graph_probe.py [--n 25000000] [--warmup 40]
"""

from __future__ import annotations

import argparse
import copy
import os
import traceback

import torch

import sparsecomm


def _where(exc: BaseException) -> str:
    """The innermost frame inside this project, and the error's first line."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if "sparsecomm" in f.filename or "kernels" in f.filename]
    at = f"{os.path.relpath(frames[-1].filename)}:{frames[-1].lineno}" if frames else "?"
    return f"{at}: {type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"


def probe(name: str, n: int, warmup: int) -> str:
    """One algorithm's capture attempt, as a line of the table."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    g = torch.randn(n, generator=gen, device="cuda")
    noise = torch.empty_like(g)
    out = torch.empty_like(g)
    state = sparsecomm.registry.get(name).state_class(0.01, error_feedback=True)
    for _ in range(warmup):
        g.mul_(0.9).add_(torch.randn(n, generator=gen, device="cuda", out=noise), alpha=0.1)
        sparsecomm.allreduce(g, state=state, out=out)
    g.mul_(0.9).add_(torch.randn(n, generator=gen, device="cuda", out=noise), alpha=0.1)
    eager_state = copy.deepcopy(state)
    want = sparsecomm.allreduce(g, state=eager_state).clone()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.cuda.graph(graph):
            sparsecomm.allreduce(g, state=state, out=out)
    except Exception as exc:  # noqa: BLE001 - the point is to report whatever stops capture
        return f"| {name} | no | {_where(exc)} |"
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph.replay()
    torch.cuda.synchronize()
    return f"| {name} | yes | replay equals eager: {torch.equal(out, want)} |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=25_000_000)
    parser.add_argument("--warmup", type=int, default=40)
    args = parser.parse_args()
    print(f"CUDA graph capture of a steady call, world size 1, n = {args.n}, density 1%, "
          f"{torch.cuda.get_device_name()}")
    print("| algorithm | captured | what stopped it |\n|---|---|---|")
    for name in sparsecomm.algorithms():
        try:
            print(probe(name, args.n, args.warmup), flush=True)
        except Exception as exc:  # noqa: BLE001
            print(f"| {name} | error before capture | {_where(exc)} |", flush=True)
        torch.cuda.synchronize()


if __name__ == "__main__":
    main()
