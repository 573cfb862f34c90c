"""Where a steady call's time goes on a GPU: the profiler's kernels, by device time.

1. Warm up each subject (a steady world-size-1 call with error feedback on a drifting
   gradient, the exact threshold, the estimated threshold) at ``--n`` entries.
2. Profile ``--calls`` more, each ended by a device synchronisation.
3. Print, per subject: wall time per call, device time per call (the kernels' sum), and the
   kernels that take the most device time; the gap between the two times is launch and
   host time, the part a CUDA graph or fewer launches removes.

    python benchmarks/gpu/profile_call.py [--n 100000000] [--algorithms oktopk topka]
"""

from __future__ import annotations

import argparse
import time
from typing import Callable

import torch

import sparsecomm
from sparsecomm import kernels


def _profile(name: str, step: Callable[[], object], calls: int, rows: int) -> None:
    from torch.profiler import ProfilerActivity, profile  # imported here: GPU runs only

    for _ in range(5):
        step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        step()
        torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) / calls
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            step()
            torch.cuda.synchronize()
    kernels_ = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    device = sum(e.self_device_time_total for e in kernels_) / calls / 1e3
    launches = sum(e.count for e in kernels_) / calls
    print(f"\n{name}: {wall * 1e3:.3f} ms a call (synchronised), device busy {device:.3f} ms, "
          f"{launches:.0f} kernels and copies a call")
    for e in sorted(kernels_, key=lambda e: -e.self_device_time_total)[:rows]:
        print(f"  {e.self_device_time_total / calls / 1e3:8.3f} ms  x{e.count / calls:4.1f}  {e.key[:110]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=100_000_000)
    parser.add_argument("--calls", type=int, default=10)
    parser.add_argument("--rows", type=int, default=12)
    parser.add_argument("--algorithms", nargs="+", default=["oktopk", "topka", "gaussiank"])
    args = parser.parse_args()
    n, k = args.n, max(1, args.n // 100)
    print(f"profile on {torch.cuda.get_device_name()}, n = {n}, density 1%")
    gen = torch.Generator(device="cuda").manual_seed(0)
    g = torch.randn(n, generator=gen, device="cuda")
    noise, out = torch.empty_like(g), torch.empty_like(g)
    _profile("add (r.add_(g))", lambda: out.add_(g), args.calls, 3)
    for name in args.algorithms:
        state = sparsecomm.registry.get(name).state_class(0.01, error_feedback=True)

        def step(state=state) -> None:
            g.mul_(0.9).add_(torch.randn(n, generator=gen, device="cuda", out=noise), alpha=0.1)
            sparsecomm.allreduce(g, state=state, out=out)

        for _ in range(40):  # thresholds and residual settle
            step()
        _profile(f"{name} steady call (with the gradient's update, 3 kernels)", step, args.calls, args.rows)
    _profile("exact threshold (kernels.kth_largest)", lambda: kernels.kth_largest(g, k, use_abs=True),
             args.calls, args.rows)
    _profile("estimated threshold (kernels.estimate_threshold)", lambda: kernels.estimate_threshold(g, k),
             args.calls, args.rows)


if __name__ == "__main__":
    main()
