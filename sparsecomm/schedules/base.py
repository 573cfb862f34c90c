"""What every schedule offers, and the checks of a training loop's setup they share.

:class:`Schedule` is the interface (``step``, ``synchronize``, ``no_sync``,
``state_dict``, ``load_state_dict``, ``close``) that WFBP, SyncEASGD, MG-WFBP,
DeAR and Pipe-SGD implement alike, so a training loop, a test or a benchmark
drives any of them the same way. The helpers below hold the rules they share:

* :func:`check_optimizer`: the optimizer steps only parameters of the model
  (one it steps that the schedule never reduces would drift apart across ranks).
* :func:`layer_settings`, :func:`check_layers`: what a checkpoint must match.
* :func:`refused_job`: the call a rank makes when it cannot gather its gradients.

What a schedule remembers about gradients between steps (residuals, carried results, the
loss scale, its algorithm states) is :mod:`sparsecomm.memory`'s, shared with the DDP hook
and the optimizers.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch

from ..api import allreduce
from ..errors import InputError

__all__ = ["Schedule", "check_optimizer", "optimizer_size", "layer_settings", "check_layers", "refused_job"]


class Schedule:
    """The interface every schedule implements (see each subclass for what its steps do).

    A training loop::

        for x, y in data:
            optimizer.zero_grad()
            loss_fn(model(x), y).backward()
            sched.step()
        sched.finish()                # before evaluating or saving
        torch.save({"model": model.state_dict(), "opt": optimizer.state_dict(),
                    "sched": sched.state_dict()}, path)

    With a loss scaler (``scaler=`` given to the schedule), ``scaler.scale(loss).backward()``,
    then ``sched.step()`` (which calls ``scaler.step(optimizer)``) and ``scaler.update()``.
    """

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer

    def step(self) -> None:
        """After backward: finish (or queue) this step's reductions and update the parameters."""
        raise NotImplementedError

    def synchronize(self) -> None:
        """Wait for what is in flight and bring the gradients (or updates) up to date."""
        raise NotImplementedError

    def finish(self) -> None:
        """Apply what earlier steps left in flight (Pipe-SGD's last gradient, DeAR's last updates),
        before evaluating, saving or stopping; the group schedules leave nothing after ``step()``."""
        raise NotImplementedError

    def state_dict(self) -> dict:
        """Everything a resumed run needs to continue bit for bit (residuals, thresholds, plans)."""
        raise NotImplementedError

    def load_state_dict(self, d: dict) -> None:
        """Restore :meth:`state_dict` (same model; this schedule's own settings win)."""
        raise NotImplementedError

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backwards inside accumulate locally and reduce nothing (as DDP's ``no_sync``); the
        first backward after it reduces the accumulated gradients."""
        self._accumulating = True
        try:
            yield
        finally:
            self._accumulating = False

    def close(self) -> None:
        """Remove the hooks and stop the engine (finishing its queued jobs)."""
        raise NotImplementedError

    def __enter__(self) -> "Schedule":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def check_optimizer(optimizer: torch.optim.Optimizer, model: torch.nn.Module, what: str) -> None:
    """Refuse an optimizer that steps a parameter the model does not hold.

    Such a parameter is never reduced: each rank would step it with its own
    gradient and the ranks drift apart silently. Frozen parameters of the model
    are fine (no gradient, no step).
    """
    mine = {id(p) for p in model.parameters()}
    extra = [p for pg in optimizer.param_groups for p in pg["params"] if id(p) not in mine]
    if extra:
        raise ValueError(f"{what}: the optimizer steps {len(extra)} parameter(s) that are not the model's "
                         f"(first of shape {tuple(extra[0].shape)}); the schedule reduces only the model's, so "
                         "the ranks would drift apart. Give the schedule a model holding every parameter "
                         "the optimizer steps.")


def optimizer_size(optimizer: torch.optim.Optimizer) -> int:
    """How many parameters the optimizer steps (a cheap sign of an ``add_param_group``)."""
    return sum(len(pg["params"]) for pg in optimizer.param_groups)


def layer_settings(params: list[torch.nn.Parameter]) -> list[tuple[int, ...]]:
    """The model's parameter shapes, which a checkpoint must match."""
    return [tuple(p.shape) for p in params]


def check_layers(saved: list, params: list[torch.nn.Parameter], what: str) -> None:
    """Refuse a checkpoint of another model (ValueError naming the first difference)."""
    mine = layer_settings(params)
    saved = [tuple(s) for s in saved]
    if saved != mine:
        where = next((i for i, (a, b) in enumerate(zip(saved, mine)) if a != b), min(len(saved), len(mine)))
        raise ValueError(f"{what}.load_state_dict: the checkpoint's model has {len(saved)} parameters, this one "
                         f"{len(mine)}; they differ from parameter {where} on (a checkpoint of another model?)")


def refused_job(engine: Any, problem: str, numel: int) -> Any:
    """The job a rank submits in place of a call it cannot make (its gradients cannot be gathered).

    It takes part in the call's collective check with a tensor the check refuses
    (on the meta device), so every rank raises InputError instead of the others
    waiting out the timeout; this rank's message says what went wrong here.
    """
    def refuse(comm: Any) -> None:
        try:
            allreduce(torch.empty(numel, device="meta"), comm=comm)
        except InputError as exc:
            raise InputError(f"{problem} ({exc})") from exc

    return engine.run(refuse, what="a call this rank could not gather")
