"""Estimated thresholds and payload helpers against their references.

The threshold counts of every backend are checked exactly in
``test_kernel_paths.py``; here the estimate as a whole, through the public
function, on the device each backend runs on.
"""

from __future__ import annotations

import pytest
import torch

from gpu_paths import backend_params

from sparsecomm import kernels
from sparsecomm.kernels import dispatch


def _inputs(n: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    t = torch.distributions.StudentT(torch.tensor(2.5))
    torch.manual_seed(0)
    return {"gauss": torch.randn(n, generator=gen),
            "student_t": t.sample((n,)),
            # slowly drifting scale along the vector, as across a model's layers
            "drifting": torch.randn(n, generator=gen) * torch.linspace(0.05, 3.0, n)}


@pytest.mark.parametrize("backend", backend_params("count_above"))
@pytest.mark.parametrize("density", [0.01, 0.001])
def test_estimate_within_5_percent(backend, density):
    device = "cuda" if backend in ("triton", "cupy") else "cpu"
    if not dispatch.available(backend, device):
        pytest.skip(f"{backend} needs a CUDA device: torch.cuda.is_available() is False")
    n = 1_000_000
    k = int(density * n)
    for name, x in _inputs(n).items():
        th = kernels.estimate_threshold(x.to(device), k, backend=backend)
        count = int((x.abs() >= th).sum())
        assert abs(count / k - 1) <= 0.05, (name, count, k)


def test_estimate_degenerate_inputs():
    x = torch.zeros(100_000)
    x[5] = 3.0
    assert (x.abs() >= kernels.estimate_threshold(x, 10)).sum() >= 1
    with pytest.raises(ValueError):
        kernels.estimate_threshold(x, 0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cast_values(dtype):
    v = torch.tensor([1.0, -2.5, 1e6, -1e6])
    out = kernels.cast_values(v, dtype)
    assert out.dtype == dtype and torch.isfinite(out).all()
    assert out[:2].float().tolist() == [1.0, -2.5]


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("stochastic", [False, True])
def test_quantize_round_trip(bits, stochastic):
    gen = torch.Generator().manual_seed(bits)
    v = torch.randn(5_003, generator=gen)
    v[:1024] = 0  # an all-zero chunk (scale 0) must decode to zeros
    packed, scales = kernels.quantize(v, bits, chunk=1024, stochastic=stochastic, generator=gen)
    assert packed.dtype == torch.uint8 and packed.numel() == -(-v.numel() * bits // 8)
    back = kernels.dequantize(packed, scales, bits, v.numel(), chunk=1024)
    step = scales.repeat_interleave(1024)[:v.numel()] / (2 ** (bits - 1) - 1)
    err = (back - v).abs()
    assert (err <= step * (1.0 if stochastic else 0.5) + 1e-6).all()
    assert back[:1024].abs().sum() == 0


def test_stochastic_rounding_is_unbiased():
    v = torch.full((200_000,), 0.3)
    v[0] = 1.0  # scale 1: 0.3 sits between levels
    packed, scales = kernels.quantize(v, 2, chunk=200_000, stochastic=True,
                                      generator=torch.Generator().manual_seed(0))
    back = kernels.dequantize(packed, scales, 2, v.numel(), chunk=200_000)
    assert abs(float(back[1:].mean()) - 0.3) < 0.01


@pytest.mark.parametrize("gap,dtype", [(1, torch.uint8), (255, torch.uint8), (256, torch.uint16),
                                       (70_000, torch.uint32), (2**33, torch.int64)])
def test_delta_round_trip(gap, dtype):
    idx = torch.tensor([7, 7 + gap, 8 + gap, 8 + 2 * gap])
    first, d = kernels.delta_encode(idx)
    assert first == 7 and d.dtype == dtype
    assert kernels.delta_decode(first, d).tolist() == idx.tolist()
    first, d = kernels.delta_encode(idx[:1])
    assert kernels.delta_decode(first, d).tolist() == [7]
    first, d = kernels.delta_encode(idx[:0])
    assert kernels.delta_decode(first, d).numel() == 0
    with pytest.raises(ValueError):
        kernels.delta_encode(idx.flip(0))


def test_count_above_and_codes_reject_bad_arguments():
    from sparsecomm.kernels import payload

    x = torch.randn(100)
    for bad in ([], [1.0, 2.0], [0.0], [-1.0]):
        with pytest.raises(ValueError, match="thresholds"):
            kernels.count_above(x, bad)
    assert kernels.count_above(torch.empty(0), [2.0, 1.0]).tolist() == [0, 0]
    with pytest.raises(ValueError, match="cannot hold"):
        payload.decode_codes(torch.zeros(3, dtype=torch.uint8), 4, 7, 1.0, torch.float32)
    with pytest.raises(ValueError, match="indexes but"):
        kernels.pack_records(torch.arange(3), torch.ones(2), torch.int32, torch.float32)
