"""GPU kernels compile for real GPUs without one: Triton AOT for sm_80/sm_90, CUDA C with nvcc.

Registers and spills are printed (run with ``-s``) so regressions show up in logs.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess

import pytest

NVCC = shutil.which("nvcc") or next((p for p in ("/usr/local/cuda/bin/nvcc",) if os.path.exists(p)), None)
HAVE_TRITON = importlib.util.find_spec("triton") is not None

_SELECT_SIG = {"g_ptr": "*{g}", "r_ptr": "*{r}", "out_idx_ptr": "*i64", "out_val_ptr": "*{r}",
               "status_ptr": "*i64", "ticket_ptr": "*i32", "n": "i64", "scale": "{r}", "th": "{r}",
               "capacity": "i64", "ZERO": "constexpr", "BLOCK": "constexpr"}
_HIST_SIG = {"x_ptr": "*{x}", "n": "i64", "prefix_ptr": "*i32", "hist_ptr": "*i32",
             "KEY_BITS": "constexpr", "SHIFT": "constexpr", "FIRST": "constexpr", "BLOCK": "constexpr"}


def _triton_compile(kernel, sig, consts, arch, warps):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    return triton.compile(ASTSource(kernel, sig, consts), target=GPUTarget("cuda", arch, 32),
                          options={"num_warps": warps})


@pytest.mark.skipif(not HAVE_TRITON, reason="triton not installed")
@pytest.mark.parametrize("arch", [80, 90])
@pytest.mark.parametrize("g,r", [("fp32", "fp32"), ("bf16", "fp32"), ("fp16", "fp32"), ("fp64", "fp64")])
def test_triton_ef_select_compiles(arch, g, r):
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("TRITON_INTERPRET=1 in this process: kernels are not compilable objects")
    from sparsecomm.kernels import _triton_impl as impl
    from sparsecomm.kernels.triton_kernels import SELECT_BLOCK, SELECT_WARPS

    sig = {k: v.format(g=g, r=r) for k, v in _SELECT_SIG.items()}
    for zero in (True, False):
        k = _triton_compile(impl.ef_select_kernel, sig, {"ZERO": zero, "BLOCK": SELECT_BLOCK}, arch,
                            SELECT_WARPS)
        assert k.asm["cubin"] and ".target sm_%d" % arch in k.asm["ptx"]
        assert "atom.global" in k.asm["ptx"]  # the ticket and the look-back


@pytest.mark.skipif(not HAVE_TRITON, reason="triton not installed")
@pytest.mark.parametrize("arch", [80, 90])
@pytest.mark.parametrize("x,bits", [("fp32", 32), ("bf16", 16), ("fp16", 16)])
def test_triton_radix_hist_compiles(arch, x, bits):
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("TRITON_INTERPRET=1 in this process: kernels are not compilable objects")
    from sparsecomm.kernels import _triton_impl as impl
    from sparsecomm.kernels.triton_kernels import HIST_BLOCK, HIST_WARPS

    sig = {k: v.format(x=x) for k, v in _HIST_SIG.items()}
    for first in (True, False):
        k = _triton_compile(impl.radix_hist_kernel, sig,
                            {"KEY_BITS": bits, "SHIFT": 0 if bits == 16 else 16, "FIRST": first,
                             "BLOCK": HIST_BLOCK}, arch, HIST_WARPS)
        assert k.asm["cubin"]


@pytest.mark.skipif(NVCC is None, reason="nvcc not found")
@pytest.mark.parametrize("arch", [80, 90])
def test_cuda_source_compiles(arch, tmp_path):
    from sparsecomm.kernels.cupy_kernels import CUDA_SOURCE

    src = tmp_path / "k.cu"
    src.write_text(CUDA_SOURCE)
    out = subprocess.run([NVCC, f"-arch=sm_{arch}", "-cubin", "--resource-usage", "-std=c++17",
                          "-o", str(tmp_path / "k.cubin"), str(src)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    usage = re.findall(r"Function properties for (\w+)\n.*?(\d+) bytes spill stores, (\d+) bytes spill loads\n"
                       r".*?Used (\d+) registers", out.stdout + out.stderr, re.S)
    names = {u[0] for u in usage}
    assert {"ef_select_f32_f32", "ef_select_bf16_f32", "radix_hist_u32", "radix_hist_u16"} <= names
    for name, st, ld, regs in usage:
        print(f"sm_{arch} {name}: {regs} registers, spill stores {st} B, loads {ld} B")
        assert int(st) == 0 and int(ld) == 0
        assert int(regs) <= 64  # 256 threads x 64 regs: 4 blocks/SM still fit in 64k registers
