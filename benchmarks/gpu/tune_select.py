"""Tile sizes and warps of the Triton fused select and radix select on this GPU, against CuPy and torch.

    python benchmarks/gpu/tune_select.py [n ...]        (default 25M and 100M)

For each configuration: median time of 20 calls between device events (the
residual restored, untimed, before each), the selected count checked against
torch, and the bytes of the floor (read g and r, write r, write the selected
records) over the device's copy bandwidth measured in the same run. Then the
exact k-th largest (radix select: histogram tile and grid) against torch.topk.
"""

from __future__ import annotations

import statistics
import sys

import torch

from sparsecomm import kernels
from sparsecomm.kernels import triton_backend


def median_ms(fn, setup, rounds=20) -> float:
    times = []
    for i in range(rounds + 2):
        setup()
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        if i >= 2:
            times.append(a.elapsed_time(b))
    return statistics.median(times)


def main() -> None:
    sizes = [int(s) for s in sys.argv[1:]] or [25_000_000, 100_000_000]
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    print(f"{'n':>11} {'path':<8} {'BLOCK':>6} {'warps':>5} {'ms':>8} {'% copy bw':>9}")
    for n in sizes:
        gen = torch.Generator(device="cuda").manual_seed(0)
        r0 = torch.randn(n, generator=gen, device="cuda")
        g = torch.randn(n, generator=gen, device="cuda").mul_(0.1)
        k = n // 100
        th = kernels.kth_largest((r0 + g).abs(), k)
        want = int(((r0 + g).abs() >= th).sum())
        cap = 2 * k
        r = r0.clone()
        oi = torch.empty(cap, dtype=torch.int64, device="cuda")
        ov = torch.empty(cap, dtype=torch.float32, device="cuda")
        src = torch.empty(3 * n, device="cuda")
        dst = torch.empty_like(src)
        copy_ms = median_ms(lambda: dst.copy_(src), lambda: None)
        copy_bw = 2 * src.numel() * 4 / copy_ms
        floor = 12 * n + 12 * want

        def run(path, block="", warps=""):
            def call():
                return kernels.ef_select(g, r, th, cap, out_idx=oi, out_val=ov, backend=path)

            ms = median_ms(call, lambda: r.copy_(r0))
            r.copy_(r0)
            _, _, c = call()
            assert c == want, (path, block, warps, c, want)
            print(f"{n:>11} {path:<8} {block:>6} {warps:>5} {ms:>8.3f} {100 * floor / ms / copy_bw:>8.0f}%",
                  flush=True)

        for path in ("cupy", "torch"):
            try:
                run(path)
            except Exception as exc:  # noqa: BLE001 - a path that cannot run here is reported
                print(f"{n:>11} {path:<8} failed: {exc}")
        for block in (1024, 2048, 4096, 8192, 16384):
            for warps in (4, 8, 16):
                if block // (32 * warps) < 4:
                    continue
                triton_backend.SELECT_BLOCK, triton_backend.SELECT_WARPS = block, warps
                run("triton", block, warps)
        triton_backend.SELECT_BLOCK, triton_backend.SELECT_WARPS = 2048, 8
        mag = r0.abs()
        ref = float(torch.topk(mag, k).values.min())
        topk_ms = median_ms(lambda: torch.topk(mag, k), lambda: None)
        print(f"{n:>11} {'topk':<8} {'':>6} {'':>5} {topk_ms:>8.3f}   (torch.topk, the yardstick of the selects)")
        for path in ("cupy", "torch"):
            try:
                ms = median_ms(lambda: kernels.kth_largest(mag, k, backend=path), lambda: None)
                assert kernels.kth_largest(mag, k, backend=path) == ref
                print(f"{n:>11} {path:<8} {'':>6} {'':>5} {ms:>8.3f}   kth_largest, {topk_ms / ms:.1f}x torch.topk")
            except Exception as exc:  # noqa: BLE001
                print(f"{n:>11} {path:<8} failed: {exc}")
        for block in (1024, 4096, 16384):
            for programs in (264, 1056, 4224):
                triton_backend.HIST_BLOCK, triton_backend.HIST_PROGRAMS = block, programs
                ms = median_ms(lambda: kernels.kth_largest(mag, k, backend="triton"), lambda: None)
                assert kernels.kth_largest(mag, k, backend="triton") == ref
                print(f"{n:>11} {'triton':<8} {block:>6} {programs:>5} {ms:>8.3f}   kth_largest "
                      f"(HIST_BLOCK, HIST_PROGRAMS), {topk_ms / ms:.1f}x torch.topk", flush=True)
        triton_backend.HIST_BLOCK, triton_backend.HIST_PROGRAMS = 4096, 1024


if __name__ == "__main__":
    main()
