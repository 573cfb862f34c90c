"""MG-WFBP's merge planning: which layers' gradients travel in one allreduce.

The model (MG-WFBP paper, section 3 of ``../shared/papers/README.md``):
layers 0..L-1 in forward order; backward computes layer L-1 first, so layer
l's gradient is ready at ``ready[l] = sum(backward_times[l:])`` after the
backward pass starts. Layers travel in contiguous groups, last layers first.
A group's allreduce starts when all its layers are ready (its lowest layer
is the last to be ready) and the previous group's allreduce has finished;
it takes ``a + b * (sum of its sizes)``. A plan's cost is the time at which
the last allreduce ends.

* :func:`plan_merge` with ``method="optimal"``: an exact dynamic programme
  over cut points, O(L^2). A group's end depends on the plan before it only
  through the time the channel frees up, and is non-decreasing in it, so the
  best plan for layers L-1..j ends each prefix as early as possible.
* ``method="mgwfbp"``: the paper's Algorithm 1 as printed (a greedy pass
  from the last layer). Not optimal: on random traces (uniform backward
  times and sizes, 2-12 layers) it ends later than the optimum in 8% of
  them (up to 4% later) when start-ups are below a tenth of a layer's
  transfer, and in about half (up to 35%) when they reach a whole one
  (``tests/schedules/test_planner.py``).
* :func:`plan_time` evaluates any plan under the model; :func:`fit_linear`
  fits a and b from measured (size, time) pairs.
"""

from __future__ import annotations

import math
from typing import Sequence

__all__ = ["plan_merge", "plan_time", "fit_linear", "METHODS"]

METHODS = ("optimal", "mgwfbp")


def _check(backward_times: Sequence[float], sizes: Sequence[float], a: float, b: float) -> int:
    L = len(backward_times)
    if L != len(sizes):
        raise ValueError(f"plan_merge: {L} backward times but {len(sizes)} sizes")
    if L == 0:
        raise ValueError("plan_merge: no layers")
    for name, values in (("backward_times", backward_times), ("sizes", sizes)):
        bad = [v for v in values if not (math.isfinite(v) and v >= 0)]
        if bad:
            raise ValueError(f"plan_merge: {name} must be finite and >= 0, got {bad[0]!r}")
    if not (math.isfinite(a) and math.isfinite(b) and a >= 0 and b >= 0):
        raise ValueError(f"plan_merge: a and b must be finite and >= 0, got a={a!r}, b={b!r}")
    return L


def _ready(backward_times: Sequence[float]) -> list[float]:
    """ready[j]: when layer j's gradient is ready, from the start of backward."""
    ready = [0.0] * len(backward_times)
    t = 0.0
    for j in range(len(backward_times) - 1, -1, -1):
        t += backward_times[j]
        ready[j] = t
    return ready


def plan_time(groups: Sequence[Sequence[int]], backward_times: Sequence[float], sizes: Sequence[float],
              a: float, b: float) -> float:
    """When the last allreduce of ``groups`` ends under the model (from the start of backward).

    ``groups`` must be contiguous ranges covering every layer once, listed in
    the order their allreduces start (the first holds layer L-1).
    """
    L = _check(backward_times, sizes, a, b)
    ready = _ready(backward_times)
    expect = L - 1
    free = 0.0
    for g in groups:
        layers = sorted(g, reverse=True)
        if not layers or layers[0] != expect or layers != list(range(expect, expect - len(layers), -1)):
            raise ValueError(f"plan_time: group {list(g)} is not the contiguous run of layers "
                             f"starting at {expect} (groups go from the last layer down)")
        expect -= len(layers)
        start = max(free, ready[layers[-1]])
        free = start + a + b * sum(sizes[j] for j in layers)
    if expect != -1:
        raise ValueError(f"plan_time: layers 0..{expect} are in no group")
    return free


def plan_merge(backward_times: Sequence[float], sizes: Sequence[float], a: float, b: float,
               method: str = "optimal") -> list[list[int]]:
    """Groups of layers (forward numbering 0..L-1) to allreduce together, in start order.

    1. ``ready[j]`` = backward_times[j] + ... + backward_times[L-1].
    2. ``optimal``: F(j) = the earliest end of a plan for layers L-1..j;
       F(j) = min over i >= j of max(F(i+1), ready[j]) + a + b * S(j..i),
       F(L) = 0. Back-track the minimising i's.
    3. ``mgwfbp``: the paper's Algorithm 1 (see :func:`_mgwfbp`).

    Args:
        backward_times: seconds of each layer's backward computation.
        sizes: each layer's gradient size in the unit ``b`` is per (bytes, elements).
        a, b: allreduce time T(M) = a + b M of the chosen algorithm and compressor.
        method: ``"optimal"`` (default) or ``"mgwfbp"``.

    Returns:
        A list of groups, each a list of layer indexes in descending order (the
        order their gradients become ready); the first group holds layer L-1.
    """
    L = _check(backward_times, sizes, a, b)
    if method == "optimal":
        return _optimal(backward_times, sizes, a, b, L)
    if method == "mgwfbp":
        return _mgwfbp(backward_times, sizes, a, b, L)
    raise ValueError(f"plan_merge: method must be one of {METHODS}, got {method!r}")


def _optimal(backward_times: Sequence[float], sizes: Sequence[float], a: float, b: float,
             L: int) -> list[list[int]]:
    ready = _ready(backward_times)
    best = [0.0] * (L + 1)  # best[j]: earliest end for layers L-1..j; best[L] = 0 (nothing sent)
    cut = [0] * L  # cut[j]: the group ending at layer j starts at layer cut[j] (>= j)
    for j in range(L - 1, -1, -1):
        size = 0.0
        best[j] = math.inf
        for i in range(j, L):  # the last group is layers i..j
            size += sizes[i]
            end = max(best[i + 1], ready[j]) + a + b * size
            if end < best[j]:  # strict: among equal plans, the one with the fewest layers last
                best[j], cut[j] = end, i
    groups, j = [], 0
    while j < L:
        groups.append(list(range(cut[j], j - 1, -1)))
        j = cut[j] + 1
    groups.reverse()
    return groups


def _mgwfbp(backward_times: Sequence[float], sizes: Sequence[float], a: float, b: float,
            L: int) -> list[list[int]]:
    """Algorithm 1 of MG-WFBP, 1-based as printed (layer j here is layer j-1 of the result).

    tau_b[L] = 0, tau_b[j] = tau_b[j+1] + t_b[j+1]; t_c[j] = a + b p[j];
    tau_c[L] = tau_b[L] + t_b[L], tau_c[j] = max(tau_c[j+1] + t_c[j+1], tau_b[j] + t_b[j]).
    For j = L down to 2: if tau_b[j-1] + t_b[j-1] - tau_c[j] < a, merge layer j into
    j-1 (t_c[j] = 0, p[j-1] += p[j], t_c[j-1] = a + b p[j-1]) and recompute tau_c.
    """
    tb = [0.0] + [float(t) for t in backward_times]  # 1-based
    p = [0.0] + [float(s) for s in sizes]
    tau_b = [0.0] * (L + 2)
    for j in range(L - 1, 0, -1):
        tau_b[j] = tau_b[j + 1] + tb[j + 1]
    tc = [0.0] + [a + b * p[j] for j in range(1, L + 1)]
    merged = [False] * (L + 1)  # merged[j]: layer j travels with layer j-1

    def comm_starts() -> list[float]:
        tau_c = [0.0] * (L + 2)
        tau_c[L] = tau_b[L] + tb[L]
        for j in range(L - 1, 0, -1):
            tau_c[j] = max(tau_c[j + 1] + tc[j + 1], tau_b[j] + tb[j])
        return tau_c

    tau_c = comm_starts()
    for j in range(L, 1, -1):
        if tau_b[j - 1] + tb[j - 1] - tau_c[j] < a:
            merged[j] = True
            tc[j] = 0.0
            p[j - 1] += p[j]
            tc[j - 1] = a + b * p[j - 1]
            tau_c = comm_starts()
    groups, current = [], []
    for j in range(L, 0, -1):
        current.append(j - 1)
        if not merged[j]:
            groups.append(current)
            current = []
    return groups


def fit_linear(sizes: Sequence[float], times: Sequence[float]) -> tuple[float, float]:
    """a, b of time = a + b * size, fitted to measured (size, time) pairs.

    Least squares of the *relative* error (weights 1 / time^2): timings over
    sizes from kilobytes to hundreds of megabytes vary by orders of magnitude,
    and a plain fit lets the large sizes' noise swamp the start-up a. A
    negative a or b is noise: it is clipped at 0 and the other refitted alone.
    """
    m = len(sizes)
    if m != len(times) or m < 2 or len(set(sizes)) < 2:
        raise ValueError("fit_linear: need at least two measurements at two different sizes")
    if any(not (t > 0 and math.isfinite(t)) for t in times):
        raise ValueError("fit_linear: times must be finite and > 0")
    w = [1.0 / (t * t) for t in times]
    sw = sum(w)
    sx = sum(wi * x for wi, x in zip(w, sizes))
    sy = sum(wi * y for wi, y in zip(w, times))
    sxx = sum(wi * x * x for wi, x in zip(w, sizes))
    sxy = sum(wi * x * y for wi, x, y in zip(w, sizes, times))
    det = sw * sxx - sx * sx
    b = (sw * sxy - sx * sy) / det
    a = (sy - b * sx) / sw
    if b < 0:
        return max(0.0, sy / sw), 0.0
    if a < 0:
        return 0.0, max(0.0, sxy / sxx)
    return a, b
