"""DeAR's online choice of its fusion size (``DeAR(buffer_bytes="auto")``), by Bayesian optimisation."""

from __future__ import annotations

import time
from typing import Any, Protocol

import torch


class Tuned(Protocol):
    """What the tuner drives (a ``DeAR``): its engine, its fusion size and regrouping."""

    engine: Any
    buffer_bytes: int
    trials: list[tuple[int, float]]
    tuning: bool
    _tune: Any

    def regroup(self, buffer_bytes: int) -> None: ...

    def synchronize(self) -> None: ...

__all__ = ["FusionTuner", "Tuned"]


class FusionTuner:
    """DeAR's online choice of the fusion size by Bayesian optimisation (optuna's GP sampler).

    1. Trials of ``steps`` steps each; the first step of a trial is warm-up
       (new groups, new states), the others are timed from one ``step()`` to
       the next: forward, backward and every overlap included.
    2. The ranks agree on a trial's time (the slowest rank's mean, one
       allreduce); rank 0 tells the study and asks for the next size (log
       scale over ``tune_range``, expected improvement), broadcast to all.
    3. After ``trials`` trials, regroup with the best size and stop.
    """

    def __init__(self, dear: Tuned, trials: int, steps: int, bounds: tuple[int, int], seed: int) -> None:
        self.dear, self.trials_left, self.steps, self.bounds = dear, trials, steps, bounds
        self.study = self.trial = None
        if dear.engine.comm.rank == 0:
            try:
                import optuna  # optional: only the tuner needs it
            except ImportError as exc:
                raise ImportError("DeAR(buffer_bytes='auto') tunes with optuna: pip install optuna "
                                  "(or pip install 'sparsecomm[tune]')") from exc
            optuna.logging.set_verbosity(optuna.logging.WARNING)
            self.study = optuna.create_study(direction="minimize",
                                             sampler=optuna.samplers.GPSampler(seed=seed, n_startup_trials=3))
        self.count, self.last, self.times = 0, None, []

    def _ask(self) -> int:
        proposal = 0.0
        if self.study is not None:
            self.trial = self.study.ask()
            proposal = self.trial.suggest_float("buffer_bytes", *map(float, self.bounds), log=True)
        out = self.dear.engine.run(lambda c: c.broadcast(torch.tensor([proposal], dtype=torch.float64,
                                                                        device=c.control_device), 0),
                                   what="broadcasting DeAR's next fusion size").wait()
        return int(float(out[0]))

    def first(self) -> int:
        return self._ask()

    def after_step(self) -> None:
        now = time.perf_counter()
        if self.count > 0 and self.last is not None:  # the trial's first step is warm-up
            self.times.append(now - self.last)
        self.last, self.count = now, self.count + 1
        if self.count < self.steps:
            return
        local = sum(self.times) / max(1, len(self.times))
        worst = float(self.dear.engine.run(lambda c: c.allreduce(torch.tensor([local], dtype=torch.float64,
                                                                             device=c.control_device), "max"),
                                           what="agreeing on a DeAR trial's time").wait()[0])
        self.dear.trials.append((self.dear.buffer_bytes, worst))
        if self.study is not None:
            self.study.tell(self.trial, worst)
        self.trials_left -= 1
        self.count, self.last, self.times = 0, None, []
        self.dear.synchronize()  # regrouping needs nothing pending
        if self.trials_left > 0:
            self.dear.regroup(self._ask())
            return
        best = min(self.dear.trials, key=lambda t: t[1])[0]
        self.dear._tune = None
        self.dear.tuning = False
        self.dear.regroup(best)
