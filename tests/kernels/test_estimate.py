"""The estimated threshold off the host (kernels/estimate.py): the sampled count, one read."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gpu_paths import HAVE_NUMBA, backend_params, interpreter_only, runner

from sparsecomm import kernels
from sparsecomm.kernels import dispatch
from sparsecomm.kernels.estimate import COUNT_TILE, count_on_device_torch


def _counted(x: torch.Tensor, thresholds: list[float], every: int) -> list[int]:
    """The entries at or above each threshold in the tiles starting at multiples of ``every`` tiles."""
    mag = x.abs().float().numpy()
    read = np.concatenate([mag[t0:t0 + COUNT_TILE] for t0 in range(0, mag.size, COUNT_TILE * every)])
    return [int((read >= np.float32(t)).sum()) for t in thresholds]


@pytest.mark.parametrize("backend", backend_params("count_on_device"))
@pytest.mark.parametrize("every", [1, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_count_on_device_reads_one_tile_in_every(backend, monkeypatch, every, dtype):
    run = runner(backend, monkeypatch)
    n = 8 * COUNT_TILE * 5 + 1234  # a ragged last tile
    x = torch.randn(n, generator=torch.Generator().manual_seed(8)).to(dtype)
    x[COUNT_TILE + 7] = 100.0  # in a tile that every = 8 does not read
    th = [2.0, 0.5, 2.0, 1e-30, 50.0]  # any order, repeats
    got = run("count_on_device", x, torch.tensor(th), every)
    assert got[:len(th)].tolist() == _counted(x, th, every)
    assert (got[4] == 1) == (every == 1)


def test_the_estimate_off_the_host_equals_the_numba_estimate():
    # The same candidates (order statistics of the same sample) and the same tiles counted:
    # the same threshold, whichever backend counts and wherever the candidates were taken.
    x = torch.randn(300_001, generator=torch.Generator().manual_seed(1))
    x[::5] = 0
    for k in (1, 1_000, 30_000, 200_000):
        with dispatch.gpu_path():
            device = kernels.estimate_threshold(x, k)
        if HAVE_NUMBA:
            assert device == kernels.estimate_threshold(x, k, backend="cpu"), k
        every = max(1, min(8, k // 20_000))
        counts = count_on_device_torch(x, torch.tensor([device], dtype=torch.float32), every)
        assert 0.5 * k <= int(counts[0]) * every <= 2 * k or k == 1


def test_an_all_zero_tensor_estimates_the_smallest_float_off_the_host_too():
    x = torch.zeros(100_000)
    x[7] = 3.0
    with dispatch.gpu_path():
        assert kernels.estimate_threshold(x, 10) == kernels.estimate_threshold(x, 10, backend="torch")


@interpreter_only
def test_the_estimate_on_a_gpu_reads_once_and_an_eighth_of_the_tensor():
    from sparsecomm.tools.audit import audit

    n = 64 * COUNT_TILE * 8
    x = torch.randn(n, generator=torch.Generator().manual_seed(2))
    want = kernels.estimate_threshold(x, 200_000, backend="cpu") if HAVE_NUMBA else None
    with audit(kernels="triton") as counts:
        got = kernels.estimate_threshold(x, 200_000)
    assert counts.n_syncs == 1, counts.summary()["sync_sites"]
    (launch,) = [t for t in counts.trace if t[0] == "count_above_kernel"]
    every, tiles = launch[2][5], launch[2][6]
    assert every == 8 and tiles * COUNT_TILE * every == n  # 64 tiles of 4096 read: n / 8
    assert want is None or got == want


@pytest.mark.parametrize("tile", [1, 3, 4096])
@pytest.mark.parametrize("every", [1, 2, 8])
def test_entries_read_counts_the_tiles_a_sampled_count_reads(tile, every):
    # (the count scales by n / entries_read: a wrong share biases every estimate)
    for n in [0, 1, tile - 1, tile, tile + 1, tile * every, tile * every + 1, 7 * tile * every - 1, 100_003]:
        read = (torch.arange(max(n, 0)) // tile) % every == 0
        assert kernels.estimate.entries_read(n, every, tile) == int(read.sum()), (n, every, tile)
