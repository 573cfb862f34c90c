"""Gaussiank: a threshold from a Gaussian fit of the gradient, then TopkA's allgather.

The threshold costs two reductions (mean, standard deviation) instead of a
selection, but real gradients are not Gaussian: it usually selects fewer than
k entries, hence the lowering loop.
"""

from __future__ import annotations

from statistics import NormalDist

import torch

from .. import kernels
from ..check import CarriedCheck
from ..comm.base import Communicator
from ..compress import Compressor
from ..registry import register
from ..result import PhaseRecorder, SparseResult
from ..state import CallStats, Preselection, State
from .exchange import carry_or_run
from .topka import allgather_and_sum

__all__ = ["GaussiankState", "gaussiank", "gaussian_threshold"]

#: Each lowering step multiplies the threshold by this factor...
LOWER_FACTOR = 0.8
#: ...at most this many times.
MAX_LOWERINGS = 20


class GaussiankState(State):
    """State of Gaussiank: density and error feedback (default on, as in training)."""

    def __init__(self, density: float = 0.01, error_feedback: bool = True) -> None:
        super().__init__(density, error_feedback)


def gaussian_threshold(acc: torch.Tensor, density: float) -> float:
    """|mean| + z * std, with z the normal quantile leaving ``density`` in the two tails."""
    if acc.numel() > 1:  # one read for both
        mean, std = torch.stack([acc.mean(), acc.std()]).tolist()
    else:
        mean, std = float(acc.mean()), 0.0
    z = NormalDist().inv_cdf(1 - density / 2) if density < 1 else 0.0
    return abs(mean) + z * std


#: Thresholds counted in one pass (the GPU kernels' most).
_BATCH = 16


def _lowered_threshold(acc: torch.Tensor, k: int, th: float) -> tuple[float, int]:
    """Step 2 of :func:`gaussiank`: the threshold after the lowerings, and how many there were.

    The next thresholds th, 0.8 th, 0.64 th, ... are counted up to 16 at a time in one pass
    and one read (``kernels.count_above``), rather than one pass and one read each; the
    entries' nonzero count is read once, if a lowering needs it.
    """
    nonzero = None
    lowered = 0
    while th > 0 and lowered < MAX_LOWERINGS:
        ladder = [th]
        while len(ladder) < min(_BATCH, MAX_LOWERINGS - lowered) and 0 < ladder[-1] * LOWER_FACTOR:
            ladder.append(ladder[-1] * LOWER_FACTOR)
        for count in kernels.count_above(acc, ladder).tolist():  # no |acc| tensor
            if count >= 0.75 * k:
                return th, lowered
            if nonzero is None:
                nonzero = int(torch.count_nonzero(acc))
            if count >= nonzero:
                return th, lowered
            th *= LOWER_FACTOR
            lowered += 1
    return th, lowered


def _select_on_device(acc: torch.Tensor, k: int, density: float) -> tuple[torch.Tensor, int, float | None]:
    """Steps 1-3 of :func:`gaussiank` on the device, with one read: (indexes, lowerings, peak).

    1. The ladder th_j = th * 0.8^j, j = 0..20 (each the last times 0.8, as the host's loop
       multiplies), on the device.
    2. The counts at every rung, 16 rungs a pass (``kernels.count_on_device``: two passes
       over |acc|), and the nonzero entries; the first rung j < 20 holding 3k/4 or every
       nonzero entry, else rung 20.
    3. One read of (j, its count, the largest |acc|): the mask |acc| >= th_j has exactly
       that many entries, so the indexes need no read of their own.
    A CUDA run's path (:func:`_lowered_threshold` and ``select_above`` read the device four
    times); on the host the loop stays, which is what this one matches. (A histogram of
    bucketized |acc| counted all rungs in one pass, but its n atomic adds into 22 bins took
    39.6 ms at 100M on an H100, 88x an add: ``benchmarks/test_steady_state.py``.)
    """
    dt = acc.dtype
    # Float64 rungs do not fit the count kernel's float32; its torch reference is ~50 operations.
    if dt == torch.float64 or kernels.dispatch.OPS["count_on_device"].choice(acc, None, 1) != "triton":
        return _select_on_device_bucketized(acc, k, density)
    z = NormalDist().inv_cdf(1 - density / 2) if density < 1 else 0.0
    std = acc.std() if acc.numel() > 1 else torch.zeros((), dtype=dt, device=acc.device)
    steps = torch.full((MAX_LOWERINGS + 1,), LOWER_FACTOR, dtype=torch.float64, device=acc.device)
    steps[0] = acc.mean().double().abs() + z * std.double()
    least = torch.finfo(dt).smallest_normal * torch.finfo(dt).eps  # the smallest subnormal
    # th_0 >= th_1 >= ... >= th_20 in float32, compared with |acc| in float32: as the host's
    # kernels compare (fp16 and bf16 widened), not rounded to dt.
    rungs = torch.cumprod(steps, 0).clamp_(min=least).float()
    counts = torch.cat([kernels.count_on_device(acc, rungs[i:i + _BATCH])[:rungs[i:i + _BATCH].numel()]
                        for i in range(0, rungs.numel(), _BATCH)])
    stop = (counts >= 0.75 * k) | (counts >= torch.count_nonzero(acc))
    stop[MAX_LOWERINGS] = True
    j = torch.argmax(stop.to(torch.int8))  # the first rung that stops the lowering
    mag = acc.abs()
    peak = mag.max().to(torch.float64) if mag.numel() else torch.zeros((), dtype=torch.float64, device=acc.device)
    count = counts.index_select(0, j.reshape(1)).reshape(())  # (counts[j] would read j)
    lowered, count, top = torch.stack([j.double(), count.double(), peak]).tolist()  # the one read
    idx = kernels.nonzero((mag if dt == torch.float32 else mag.float()) >= rungs[int(lowered)], int(count))
    return idx, int(lowered), top


def _select_on_device_bucketized(acc: torch.Tensor, k: int, density: float
                                 ) -> tuple[torch.Tensor, int, float | None]:
    """:func:`_select_on_device` without the count kernel (no Triton, or float64, whose rungs
    float32 cannot hold): every rung counted from one histogram of |acc| bucketized by the
    ladder (few operations, but slow on a GPU: n atomic adds into 22 bins), the lowest rung
    counting the nonzero entries."""
    dt = acc.dtype
    z = NormalDist().inv_cdf(1 - density / 2) if density < 1 else 0.0
    std = acc.std() if acc.numel() > 1 else torch.zeros((), dtype=dt, device=acc.device)
    steps = torch.full((MAX_LOWERINGS + 1,), LOWER_FACTOR, dtype=torch.float64, device=acc.device)
    steps[0] = acc.mean().double().abs() + z * std.double()
    least = torch.finfo(dt).smallest_normal * torch.finfo(dt).eps  # the smallest subnormal
    # Compared in float32 (float64 for float64), as the host's kernels compare.
    wide = torch.float64 if dt == torch.float64 else torch.float32
    ladder = torch.cumprod(steps, 0).clamp_(min=least).to(wide)  # th_0 >= th_1 >= ... >= th_20
    edges = torch.cat([ladder.new_full((1,), least), ladder.flip(0)])  # ascending; th_j at 21 - j
    mag = acc.abs().to(wide)
    bucket = torch.bucketize(mag, edges, right=True)  # rungs at or below |acc|
    hist = torch.zeros(edges.numel() + 1, dtype=torch.int64, device=acc.device).index_add_(
        0, bucket, torch.ones_like(bucket))
    above = hist.flip(0).cumsum(0).flip(0)[1:]  # above[e]: entries at or above edges[e]
    counts = above[1:].flip(0)  # counts[j]: at or above th_j
    stop = (counts >= 0.75 * k) | (counts >= above[0])
    stop[MAX_LOWERINGS] = True
    j = torch.argmax(stop.to(torch.int8))  # the first rung that stops the lowering
    peak = mag.max().to(torch.float64) if mag.numel() else torch.zeros((), dtype=torch.float64, device=acc.device)
    count = counts.index_select(0, j.reshape(1)).reshape(())  # (counts[j] would read j)
    lowered, count, top = torch.stack([j.double(), count.double(), peak]).tolist()  # the one read
    idx = kernels.nonzero(bucket > edges.numel() - 1 - int(lowered), int(count))
    return idx, int(lowered), top


def gaussiank_volume(n: int, k: int, P: int) -> tuple[float, float]:
    """Words received per rank: about 2k(P-1).

    As TopkA: every peer's (about) k entries."""
    return 2 * k * (P - 1), 2 * k * (P - 1)


@register("gaussiank", GaussiankState, volume=gaussiank_volume)
def gaussiank(acc: torch.Tensor, k: int, comm: Communicator, state: GaussiankState,
              codec: Compressor, preselected: Preselection | None = None,
              check: CarriedCheck | None = None) -> SparseResult:
    """Gaussiank: a threshold from a Gaussian fit of the gradient; TopkA's allgather.

    1. th = |mean(acc)| + z * std(acc), z = Phi^-1(1 - density / 2).
    2. While fewer than 3k/4 nonzero entries have |acc| >= th (and lowering can
       still add entries), th *= 0.8, at most 20 times.
    3. Select the nonzero entries with |acc| >= th; allgather and sum as TopkA
       (whose exchange of counts carries the collective ``check``).
    There is no upper cap: the count is whatever the fitted threshold gives.
    """
    stats = CallStats(algorithm="gaussiank", n=acc.numel(), k=k)
    rec = PhaseRecorder(comm, stats)
    check = carry_or_run(check, codec)
    peak = None
    with rec.phase("local_select"):
        if kernels.dispatch.in_host_memory(acc):
            th, lowered = _lowered_threshold(acc, k, gaussian_threshold(acc, state.density))
            idx = kernels.select_above(acc, th, use_abs=True)
        else:
            idx, lowered, peak = _select_on_device(acc, k, state.density)
        stats.events["lowered"] = lowered
    return allgather_and_sum(acc, idx, comm, codec, stats, rec, state, check=check, peak=peak)
