"""Low-communication training: inner steps without communication, outer steps over the sparse allreduce.

    inner = torch.optim.AdamW(model.parameters(), lr=1e-3)
    outer = sparsecomm.optim.DiLoCo(model, inner, sync_every=50, density=0.01)
    for x, y in batches:
        loss_fn(model(x), y).backward()
        outer.step()          # the inner step; every 50th also the outer step
        inner.zero_grad()

Each rank trains its replica alone for ``sync_every`` (H) inner steps. Then every rank
reduces its *pseudo-gradient* (the round's start minus where its replica got to) and every
replica restarts from the same outer model (DiLoCo). The pseudo-gradient is one large tensor
sent once per H steps: a sparse allreduce's best case, and the idea of SparseLoCo, which
sends its top 1-3% with error feedback in place of the outer momentum. Two outer rules:

* ``outer="sparseloco"``: outer model -= ``outer_lr`` * (the sparse average of pseudo-gradient
  + residual); what the selection left stays in this rank's residual (the allreduce's error
  feedback, every bit of it sent at a later round). SparseLoCo selects each rank's top-k and
  allgathers them (``algorithm="topka"``); Ok-Topk (the default) selects the global top-k of the
  summed pseudo-gradients instead, at O(k) traffic.
* ``outer="nesterov"``: DiLoCo's outer Nesterov momentum on the reduced pseudo-gradient (with
  ``algorithm="dense"``, DiLoCo itself).

Memory, each full size on every rank: the outer model (float32), with ``"nesterov"`` its
momentum, the sparse state's residual, and a copy of the inner optimizer's state at the round's
start (so that a round with a NaN/Inf is discarded whole).

Under FSDP2 each replica may be an FSDP group (``fully_shard`` over the ranks of a node, which
reduce densely every inner step) and ``group=`` the ranks that hold the same shards: the
pseudo-gradient, the outer model and the residual are then this rank's shard, and the outer
step syncs each shard across its replicas (custom HSDP at the outer step only).
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from .api import allreduce
from .check import check_replicas_equal, setting_code
from .comm import resolve
from .errors import NonFiniteError
from .memory import StateMaker, adopt_state, snapshot
from .state import State, check_density

__all__ = ["DiLoCo", "OUTER_RULES"]

#: The outer rules :class:`DiLoCo` runs.
OUTER_RULES = ("sparseloco", "nesterov")


class DiLoCo:
    """Outer steps on the pseudo-gradient of ``sync_every`` inner steps, reduced sparsely.

    Args:
        params: the model (or its parameters); every rank's must be equal at the start
            (checked at the first step: one allgather of a digest).
        inner: the inner optimizer over the same parameters (any torch optimizer); it keeps
            its own state, local to the rank.
        sync_every: inner steps a round (H).
        outer: ``"sparseloco"`` or ``"nesterov"`` (module docstring).
        outer_lr: the outer learning rate (SparseLoCo's default 1, DiLoCo's 0.7).
        outer_momentum: the Nesterov momentum (``"nesterov"`` only).
        algorithm, density, compressor, error_feedback, algorithm_options: the pseudo-gradient's
            allreduce, as in ``sparsecomm.allreduce`` (``"dense"``: every entry, no residual).
        group, comm: which ranks.

    After an outer step every rank holds the same parameters (the outer model): evaluate
    there (:attr:`synced`). A NaN/Inf in any rank's pseudo-gradient discards the round on
    every rank: each replica and its inner optimizer's state go back to the round's start
    (a copy of the inner state is kept for that; its settings, a scheduler's rate, stay as
    they are), the residual keeps what it held, bit for bit, and
    :class:`~sparsecomm.errors.NonFiniteError` is raised from :meth:`step`. Every rank must
    make DiLoCo alike (round length, outer rule and rate, algorithm, density: checked with
    the replicas at the first step), and a parameter frozen when it was made must stay
    frozen (refused otherwise). A bfloat16 replica's pseudo-gradient is taken from where it
    began, the float32 outer model rounded to its dtype.
    """

    def __init__(self, params: Any, inner: torch.optim.Optimizer, sync_every: int = 50, *,
                 outer: str = "sparseloco", outer_lr: float | None = None, outer_momentum: float = 0.9,
                 algorithm: str = "oktopk", density: float = 0.01, compressor: Any = None,
                 error_feedback: bool = True, algorithm_options: dict | None = None,
                 group: Any = None, comm: Any = None) -> None:
        if isinstance(params, torch.nn.Module):
            params = params.parameters()
        params = list(params)
        if any(not isinstance(p, torch.Tensor) for p in params):
            raise ValueError("DiLoCo: params must be the model or its parameters (the inner optimizer "
                             "holds the parameter groups)")
        self.params = [p for p in params if p.requires_grad]
        #: Parameters frozen when DiLoCo was made: one unfrozen later has no place in the outer model.
        self._frozen = [p for p in params if not p.requires_grad]
        if not self.params:
            raise ValueError("DiLoCo: no parameter requires a gradient")
        if isinstance(sync_every, bool) or not isinstance(sync_every, int) or sync_every < 1:
            raise ValueError(f"DiLoCo: sync_every must be an integer >= 1, got {sync_every!r}")
        if outer not in OUTER_RULES:
            raise ValueError(f"DiLoCo: outer must be one of {OUTER_RULES}, got {outer!r}")
        outer_lr = (1.0 if outer == "sparseloco" else 0.7) if outer_lr is None else float(outer_lr)
        if not outer_lr > 0 or not 0 <= outer_momentum < 1:
            raise ValueError(f"DiLoCo: outer_lr must be > 0 and outer_momentum in [0, 1), got {outer_lr}, "
                             f"{outer_momentum}")
        mine = {id(p) for g in inner.param_groups for p in g["params"]}
        if any(id(p) not in mine for p in self.params):
            raise ValueError("DiLoCo: the inner optimizer must step every parameter DiLoCo syncs")
        self.inner, self.sync_every, self.outer = inner, sync_every, outer
        self.algorithm, self.density = algorithm, float(density)
        self.outer_lr, self.outer_momentum = outer_lr, float(outer_momentum)
        self.group, self.comm = group, comm
        self.compressor = compressor
        maker = StateMaker(algorithm, check_density(density), algorithm_options, error_feedback, compressor, None,
                           dense_keeps_residual=True)
        self._maker = maker
        self.anchor = torch.cat([_local(p).reshape(-1).float() for p in self.params])
        self.state: State = maker.new(self.anchor.numel(), torch.float32, self.anchor.device, self._comm())
        self.momentum = torch.zeros_like(self.anchor) if outer == "nesterov" else None
        self.inner_steps = 0
        self.outer_steps = 0
        self.discarded = 0  # rounds discarded for a NaN/Inf
        self._checked = False  # the outer models are compared at the first step (after a load, the loaded ones)
        self._round_start: dict | None = None  # the inner optimizer's state where this round began

    @property
    def synced(self) -> bool:
        """Whether the parameters are the outer model (right after an outer step, or at the start)."""
        return self.inner_steps % self.sync_every == 0

    def _comm(self) -> Any:
        return resolve(group=self.group, comm=self.comm)

    def _check_replicas_equal(self) -> None:
        """Refuse outer models or settings that differ across ranks (nothing broadcasts
        parameters: replicas that start apart would never meet; other rates or rounds would
        drift apart or pair unmatched collectives); one allgather of a digest, at the first
        step and the first after a load. A parameter unfrozen since DiLoCo was made is refused
        at every step (the same on every rank, before any collective)."""
        if any(p.requires_grad for p in self._frozen):
            raise ValueError("DiLoCo: a parameter frozen when DiLoCo was made requires a gradient now (it has no "
                             "place in the outer model, and its replicas would drift apart); make a new DiLoCo "
                             "after unfreezing")
        if self._checked:
            return
        check_replicas_equal(self.anchor, self._comm(), "DiLoCo", {
            "sync_every": self.sync_every, "outer": setting_code(self.outer), "outer_lr": self.outer_lr,
            "outer_momentum": self.outer_momentum, "algorithm": setting_code(self.algorithm),
            "density": self.density, "entries": self.anchor.numel()})
        self._checked = True

    def step(self, closure: Any = None, scaler: Any = None) -> Any:
        """The inner optimizer's step; every ``sync_every``-th also the outer step (a collective).

        ``scaler``: a ``torch.amp.GradScaler`` whose scaled loss made the gradients: the inner
        step is ``scaler.step(inner)`` (skipped on this rank alone when its gradients overflowed,
        as AMP skips; the step still counts in the round) and ``scaler.update()`` follows.
        """
        self._check_replicas_equal()
        if self._round_start is None:
            self._round_start = copy.deepcopy(self.inner.state_dict())
        if scaler is not None:
            loss = scaler.step(self.inner, closure) if closure is not None else scaler.step(self.inner)
            scaler.update()
        else:
            loss = self.inner.step(closure) if closure is not None else self.inner.step()
        self.inner_steps += 1
        if self.inner_steps % self.sync_every == 0:
            self.sync()
        return loss

    def sync(self) -> None:
        """The outer step: reduce the pseudo-gradient, move the outer model, restart every replica there.

        1. delta = outer model - this replica (float32), averaged over the ranks by the sparse
           allreduce with error feedback (the state's residual).
        2. ``"sparseloco"``: outer model -= outer_lr * average; ``"nesterov"``:
           m = mu m + average, outer model -= outer_lr * (average + mu m).
        3. Every replica's parameters become the outer model.
        A NaN/Inf on any rank: every replica goes back to the round's start and
        NonFiniteError is raised (on every rank; the round's updates are discarded).
        """
        self._check_replicas_equal()
        flat = torch.cat([_local(p).reshape(-1).float() for p in self.params])
        delta = self._replica_start().sub_(flat)
        # A refused call takes delta back out of the residual only up to one rounding an entry:
        # the residual as it was, kept to restore it bit for bit (one copy a round).
        kept = None if self.state.residual is None else self.state.residual.clone()
        try:
            average = allreduce(delta, state=self.state, op="avg", compressor=self.compressor,
                                group=self.group, comm=self.comm)
        except NonFiniteError:
            self.discarded += 1
            if kept is not None and self.state.residual is not None:
                self.state.residual.copy_(kept)
            self._write(self.anchor)
            if self._round_start is not None:  # a NaN step left NaN in the inner state too
                # Its state only: the rates a scheduler set since the round began stay.
                now = self.inner.state_dict()
                self.inner.load_state_dict({**now, "state": self._round_start["state"]})
            self._round_start = None
            raise
        if self.momentum is None:
            self.anchor.sub_(average, alpha=self.outer_lr)
        else:
            self.momentum.mul_(self.outer_momentum).add_(average)
            self.anchor.sub_(average.add(self.momentum, alpha=self.outer_momentum), alpha=self.outer_lr)
        self._write(self.anchor)
        self.outer_steps += 1
        self._round_start = None

    def _replica_start(self) -> torch.Tensor:
        """Where every replica began the round: the outer model as its parameters hold it
        (rounded to a bfloat16 parameter's dtype), float32. The pseudo-gradient is taken from
        there: from the float32 outer model, each round would add that rounding to it (and
        under error feedback pile it up in the residual, then send it)."""
        parts, offset = [], 0
        for p in self.params:
            local = _local(p)
            part = self.anchor[offset:offset + local.numel()]
            parts.append(part if local.dtype == torch.float32 else part.to(local.dtype).float())
            offset += local.numel()
        return torch.cat(parts)

    def _write(self, flat: torch.Tensor) -> None:
        offset = 0
        with torch.no_grad():
            for p in self.params:
                local = _local(p)
                n = local.numel()
                local.copy_(flat[offset:offset + n].view_as(local))
                offset += n

    @property
    def residual(self) -> torch.Tensor | None:
        """What the pseudo-gradients' allreduce has not sent yet (this rank's)."""
        return self.state.residual

    def state_dict(self) -> dict:
        """Outer model, momentum, the allreduce's state and the counts (the inner optimizer's
        own ``state_dict`` is saved beside it). Taken anywhere in a round; resumes bit for bit."""
        return {"inner_steps": self.inner_steps, "outer_steps": self.outer_steps, "discarded": self.discarded,
                "anchor": self.anchor.clone(), "momentum": None if self.momentum is None else self.momentum.clone(),
                "state": snapshot(self.state), "inner_at_round_start": copy.deepcopy(self._round_start)}

    def load_state_dict(self, d: dict) -> None:
        """Restore :meth:`state_dict` (the same parameters; this object's settings win)."""
        if d["anchor"].numel() != self.anchor.numel():
            raise ValueError(f"DiLoCo.load_state_dict: a state of {d['anchor'].numel()} elements, these "
                             f"parameters have {self.anchor.numel()}")
        self.inner_steps, self.outer_steps, self.discarded = d["inner_steps"], d["outer_steps"], d["discarded"]
        self.anchor = d["anchor"].clone().to(self.anchor.device)
        if self.momentum is not None:
            saved = d.get("momentum")
            self.momentum = torch.zeros_like(self.anchor) if saved is None else saved.clone().to(self.anchor.device)
        self.state = adopt_state(d["state"], self.state, "DiLoCo", self._maker.like(d["state"]))
        self._round_start = copy.deepcopy(d.get("inner_at_round_start"))
        self._checked = False  # the loaded outer models are compared at the next step


def _local(p: torch.Tensor) -> torch.Tensor:
    """This rank's part of a parameter: an FSDP2 parameter's local shard (a DTensor's
    ``to_local()``, a view), else the parameter itself, detached."""
    to_local = getattr(p, "to_local", None)
    return (to_local() if to_local is not None else p).detach()
