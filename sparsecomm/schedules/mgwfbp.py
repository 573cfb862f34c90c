"""MG-WFBP: the group schedule whose groups come from a merge plan profiled and fitted online.

    sched = sparsecomm.schedules.MGWFBP(model, optimizer, algorithm="oktopk", density=0.01)

The groups are those of :func:`sparsecomm.schedules.plan_merge`, planned from
per-layer backward times profiled over the first steps (averaged across ranks)
and the a, b of T(M) = a + b M fitted from this algorithm's and compressor's
allreduces of several sizes on the engine's communicator; rank 0 plans and
broadcasts. Until then it runs as WFBP. Everything else (readiness, the
engine, the training-loop rules) is :class:`~sparsecomm.schedules.groups.GroupSchedule`'s.
"""

from __future__ import annotations

import copy
import time
from typing import Any, Sequence

import torch

from ..api import allreduce
from ..comm import Communicator
from .groups import GroupSchedule
from .planner import fit_linear, plan_merge, plan_time

__all__ = ["MGWFBP"]


class MGWFBP(GroupSchedule):
    """MG-WFBP: layers merged by the exact plan of :func:`plan_merge`, profiled and fitted online.

    1. The first ``profile_steps`` steps run as WFBP (the first one is warm-up).
       Each records every layer's backward time (the gap between consecutive
       gradients becoming ready) and every group's allreduce time on the
       communication thread, with this algorithm, compressor and state, on the
       real gradients, competing with backward as it will.
    2. The ranks average the backward times and take the slowest rank's
       allreduce times (one allreduce each); a and b of T(M) = a + b M are
       fitted to those (:func:`fit_linear`). Fewer than two distinct sizes:
       allreduces of ``calibration_sizes`` are timed instead.
    3. Rank 0 plans (``method``), broadcasts, every rank switches to the plan.
    4. ``verify``: the model assumes communication never slows computation,
       which does not hold where the communication thread's local work
       (selection, packing) shares the cores with backward (a CPU run). So the
       plan is then measured against one group for everything (SyncEASGD)
       over ``profile_steps`` steps each (the first of each is warm-up), the
       slowest rank's mean step time deciding, and the faster is kept
       (``trials``). On the emulated CPU cluster Ok-Topk's plan took 1.9x
       SyncEASGD's step at P = 2 while the model predicted it faster.
    5. Every ``profile_steps`` steps after, the profile is taken and agreed
       again; a mean backward time that moved by more than ``replan_drift``
       from the plan's profile (after a trial: from the first profile under
       the groups kept) re-plans (with the
       allreduce times of the groups in use added to the fit). Decided from
       the agreed values, so every rank decides alike.

    Args:
        profile_steps: steps per profile (>= 2).
        calibration_sizes: element counts for the fallback fit (default: the
            smallest and the median layer, a quarter of the model and all of it).
        calibration_rounds: timed calls per size in the fallback fit.
        method: ``"optimal"`` or ``"mgwfbp"`` (the paper's Algorithm 1).
        replan_drift: the relative change of the backward time that re-plans.
        verify: measure the plan against one group and keep the faster (step 4).

    Attributes: ``backward_times``, ``a``, ``b`` (the model), ``plans`` (how
    many were made), ``trials`` ((groups, seconds per step) measured in step 4),
    ``predicted`` (the plan's end of the last allreduce from the start of
    backward, :func:`plan_time`).
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *,
                 profile_steps: int = 5, calibration_sizes: Sequence[int] | None = None,
                 calibration_rounds: int = 3, method: str = "optimal", replan_drift: float = 0.25,
                 verify: bool = True, **options: Any) -> None:
        super().__init__(model, optimizer, None, **options)
        if profile_steps < 2:
            raise ValueError(f"profile_steps must be >= 2, got {profile_steps}")
        self.profile_steps, self.method, self.replan_drift = profile_steps, method, replan_drift
        self.sizes = [p.numel() for p in self.params]
        if calibration_sizes is None:
            ordered, total = sorted(self.sizes), sum(self.sizes)
            calibration_sizes = sorted({ordered[0], ordered[len(ordered) // 2], max(1, total // 4), total})
            if len(calibration_sizes) < 2:
                calibration_sizes = [max(1, total // 2), total + 1]
        self.calibration_sizes, self.calibration_rounds = list(calibration_sizes), calibration_rounds
        self._profile: list[list[float]] = []
        self._jobs_seen: list[list[tuple[int, float]]] = []
        self._fit_points: list[tuple[int, float]] = []
        self.a: float | None = None
        self.b: float | None = None
        self.backward_times: list[float] | None = None
        self.plans = 0
        self.verify = verify
        self.trials: list[tuple[list[list[int]], float]] = []
        self.predicted: float | None = None
        self._trial: dict | None = None
        self._last_end: float | None = None
        self._baseline: float | None = None  # total backward first profiled under the groups a trial kept
        self._rebase = False  # take that profile next

    def _default_groups(self) -> list[list[int]]:
        return [[i] for i in range(len(self.params) - 1, -1, -1)]  # WFBP until a plan is made

    def set_groups(self, groups: Sequence[Sequence[int]]) -> None:
        """As :meth:`GroupSchedule.set_groups`; a profile under way restarts under the new groups."""
        super().set_groups(groups)
        self._profile, self._jobs_seen = [], []

    def _retrain(self, flags: tuple) -> None:
        """As :meth:`GroupSchedule._retrain`; the plan was for other layers: profile and plan anew
        (the allreduce times fitted so far still hold)."""
        super()._retrain(flags)
        self.sizes = [p.numel() for p in self.params]
        self.backward_times, self.predicted, self._trial = None, None, None
        self._baseline, self._rebase = None, False

    _PLAN_FIELDS = ("a", "b", "backward_times", "plans", "trials", "predicted", "_trial", "_fit_points",
                    "_baseline", "_rebase", "_profile", "_jobs_seen", "sizes")

    def _extra_state(self) -> dict:
        """The plan and what it came from, and the profile under way (so every rank plans at the
        same step after a restart)."""
        return {"plan": copy.deepcopy({name: getattr(self, name) for name in self._PLAN_FIELDS})}

    def _load_extra_state(self, d: dict) -> None:
        for name, value in copy.deepcopy(d["plan"]).items():
            setattr(self, name, value)

    def _now(self) -> float:
        """The clock that times whole steps (step 4)."""
        return time.perf_counter()

    def _layer_times(self) -> list[float]:
        """This step's backward time per layer: the gap since the gradient ready just before
        (0 for a layer that got no gradient)."""
        order = sorted(self._ready_at, key=self._ready_at.get)
        times = [0.0] * len(self.params)
        prev = self._t0
        for i in order:
            times[i] = self._ready_at[i] - prev
            prev = self._ready_at[i]
        return times

    def _after_step(self) -> None:
        # Every rank counts the same steps and makes the same collective calls: whether to
        # plan is decided from the agreed profile, never from this rank's own timings.
        now = self._now()
        step_seconds, self._last_end = (None if self._last_end is None else now - self._last_end), now
        if self._trial is not None:
            self._trial_step(step_seconds)
            return
        self._profile.append(self._layer_times())
        self._jobs_seen.append(list(self.job_timings))
        if len(self._profile) <= self.profile_steps:  # the first step of a profile is warm-up
            return
        recent, jobs = self._profile[1:], self._jobs_seen[1:]
        self._profile, self._jobs_seen = [], []
        mean = [sum(t[i] for t in recent) / len(recent) for i in range(len(self.params))]
        job_means = [sum(step[g][1] for step in jobs) / len(jobs) for g in range(len(jobs[0]))]
        backward, job_times = self._agree(mean, job_means)
        if self.backward_times is not None:
            # After a trial, drift is measured against the first profile under the groups it
            # kept: backward runs slower while allreduces overlap it on shared cores, so the
            # WFBP profile the plan came from is no baseline for one group's (that compare
            # re-planned, and re-ran the trials, every few steps on the emulated cluster).
            if self._rebase:
                self._rebase, self._baseline = False, sum(backward)
                return
            ref = sum(self.backward_times) if self._baseline is None else self._baseline
            if abs(sum(backward) - ref) <= self.replan_drift * ref:
                return
        self._plan(backward, [size for size, _ in jobs[0]], job_times)

    def _agree(self, local_times: list[float], job_times: list[float]) -> tuple[list[float], list[float]]:
        """Backward times averaged over ranks, allreduce times at the slowest rank's (collective)."""
        def agree(c: Communicator) -> torch.Tensor:
            t = c.allreduce(torch.tensor(local_times, dtype=torch.float64, device=c.control_device), "sum")
            j = c.allreduce(torch.tensor(job_times, dtype=torch.float64, device=c.control_device), "max")
            return torch.cat([t / c.size, j])

        agreed = self.engine.run(agree, what="agreeing on the profile").wait().tolist()
        return agreed[:len(local_times)], agreed[len(local_times):]

    def _plan(self, backward: list[float], job_sizes: list[int], job_times: list[float]) -> None:
        comm = self.engine.comm
        self.backward_times = backward
        self._fit_points += list(zip(job_sizes, job_times))
        sizes = [s for s, _ in self._fit_points]
        if len(set(sizes)) >= 2:
            self.a, self.b = fit_linear(sizes, [t for _, t in self._fit_points])
        elif self.a is None:
            self.a, self.b = self.calibrate()
        cuts = torch.zeros(len(self.params), dtype=torch.int64, device=comm.control_device)
        if comm.rank == 0:
            for gi, g in enumerate(plan_merge(self.backward_times, self.sizes, self.a, self.b, self.method)):
                cuts[g] = gi
        cuts = self.engine.run(lambda c: c.broadcast(cuts, 0), what="broadcasting the plan").wait().tolist()
        groups: dict[int, list[int]] = {}
        for i, gi in enumerate(cuts):
            groups.setdefault(gi, []).append(i)
        plan = [groups[gi] for gi in sorted(groups)]
        self.predicted = plan_time(plan, self.backward_times, self.sizes, self.a, self.b)
        self.plans += 1
        self._baseline = None
        self.set_groups(plan)
        one = [list(range(len(self.params) - 1, -1, -1))]
        if self.verify and len(plan) > 1:
            self._trial = {"candidates": [self.groups, one], "at": 0, "times": [], "seconds": []}

    def _trial_step(self, seconds: float | None) -> None:
        """Step 4: time this candidate's steps; after the last candidate keep the fastest."""
        t = self._trial
        t["times"].append(seconds)
        if len(t["times"]) <= self.profile_steps:  # the first step of a candidate is warm-up
            return
        local = sum(t["times"][1:]) / (len(t["times"]) - 1)
        worst = float(self.engine.run(lambda c: c.allreduce(torch.tensor([local], dtype=torch.float64,
                                                                         device=c.control_device), "max"),
                                      what="agreeing on a candidate plan's step time").wait()[0])
        candidate = [list(g) for g in t["candidates"][t["at"]]]
        t["seconds"].append(worst)
        self.trials.append((candidate, worst))
        t["at"], t["times"] = t["at"] + 1, []
        if t["at"] < len(t["candidates"]):
            self.set_groups(t["candidates"][t["at"]])
            return
        best = min(range(len(t["seconds"])), key=t["seconds"].__getitem__)
        self._trial = None
        self._profile, self._jobs_seen = [], []  # profiles resume under the groups kept
        self._rebase = True
        if best != len(t["candidates"]) - 1:  # the last candidate is the groups in use
            self.set_groups(t["candidates"][best])
        self.predicted = plan_time(self.groups, self.backward_times, self.sizes, self.a, self.b)

    def calibrate(self) -> tuple[float, float]:
        """a and b of this algorithm's allreduce (under ``"auto"``: of the one chosen at each size;
        seconds, seconds per element) from allreduces
        of ``calibration_sizes`` on the engine's communicator, a fresh drifting input each call
        (as gradients drift); the slowest rank's medians are fitted."""
        def measure(comm: Communicator) -> list[float]:
            out = []
            for n in self.calibration_sizes:
                gen = torch.Generator().manual_seed(comm.rank)
                x = torch.randn(n, generator=gen)
                state = self._memory.maker.new(n, x.dtype, x.device, comm)
                ts = []
                for r in range(self.calibration_rounds + 1):
                    x.mul_(0.9).add_(torch.randn(n, generator=gen), alpha=0.1)
                    comm.barrier()
                    t0 = time.perf_counter()
                    allreduce(x, state=state, compressor=self.compressor, comm=comm)
                    if r:  # the first call is warm-up
                        ts.append(time.perf_counter() - t0)
                out.append(sorted(ts)[len(ts) // 2])
            worst = comm.allreduce(torch.tensor(out, dtype=torch.float64, device=comm.control_device), "max")
            return worst.tolist()

        times = self.engine.run(measure, what="calibrating a and b").wait()
        return fit_linear(self.calibration_sizes, times)
