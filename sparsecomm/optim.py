"""Ok-Topk SGD for a model outside DDP: reduce the gradients with a sparse allreduce.

    reducer = sparsecomm.optim.SparseGradientReducer(model.parameters(), density=0.01)
    loss.backward()
    reducer.reduce()          # between backward and the optimizer step
    optimizer.step()

This is Algorithm 2 of the Ok-Topk paper with the learning rate applied by the
optimizer: acc = residual + g; (U, I) = sparse_allreduce(acc); residual = acc
with the entries this rank contributed (I) removed; the gradient becomes U / P.

Also here: :class:`SparseAdamW` (AdamW whose momentum travels through the sparse allreduce) and
:class:`DeMo` (``sparsecomm/demo.py``: decoupled momentum, each rank's fast DCT components) and
:class:`DiLoCo` (``sparsecomm/diloco.py``: outer steps of low-communication training).
"""

from __future__ import annotations

from typing import Any, Iterable

import torch

from . import registry
from .api import allreduce
from .check import check_replicas_equal, refuse_sharded, setting_code
from .comm import resolve
from .demo import DeMo
from .diloco import DiLoCo
from .errors import NonFiniteError
from .flat_optim import FlatLayoutOptimizer
from .memory import adopt_state, snapshot
from .state import State, check_density

__all__ = ["SparseGradientReducer", "SparseAdamW", "DeMo", "DiLoCo", "COMPRESS_MODES", "VARIANCE_MODES", "local_gradient_hook"]


class SparseGradientReducer:
    """Replace every parameter's gradient by the sparse allreduce of all of them.

    Args:
        params: the parameters (their gradients are flattened into one vector,
            so one allreduce covers the model, as in the paper).
        algorithm, density, compressor: as in ``sparsecomm.allreduce``.
        op: "avg" (default) or "sum".
        algorithm_options: extra keyword arguments of the algorithm's State.
        group, comm: which ranks.
    """

    def __init__(self, params: Iterable[torch.nn.Parameter], algorithm: str = "oktopk",
                 density: float = 0.01, *, op: str = "avg", compressor: Any = None,
                 algorithm_options: dict | None = None, group: Any = None, comm: Any = None) -> None:
        self.params = [p for p in params if p.requires_grad]
        if not self.params:
            raise ValueError("SparseGradientReducer: no parameter requires a gradient")
        if op not in ("avg", "sum"):
            raise ValueError(f"op must be 'avg' or 'sum', got {op!r}")
        self.algorithm, self.op, self.compressor = algorithm, op, compressor
        self.density, self.algorithm_options = density, dict(algorithm_options or {})
        self.state: State = self._new_state()
        self.group, self.comm = group, comm

    def _new_state(self) -> State:
        return registry.get(self.algorithm).state_class(self.density, **self.algorithm_options)

    def reduce(self) -> torch.Tensor:
        """All-reduce the gradients in place; returns the reduced flat vector."""
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        out = allreduce(flat, state=self.state, op=self.op, compressor=self.compressor,
                        group=self.group, comm=self.comm)
        offset = 0
        for p in self.params:
            n = p.numel()
            if not p.requires_grad:  # frozen since: its place stays, no gradient for an optimizer to take
                offset += n
                continue
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            p.grad.copy_(out[offset:offset + n].view_as(p))
            offset += n
        return out

    def state_dict(self) -> dict:
        return {"state": self.state}

    def load_state_dict(self, d: dict) -> None:
        """Restore a :meth:`state_dict`. This reducer's settings win: a state saved with another
        algorithm, density or options gives only its residual, with a warning."""
        self.state = adopt_state(d["state"], self._new_state(), "SparseGradientReducer")


#: What ``SparseAdamW`` sends after its dense warm-up, and where its second moment comes from.
COMPRESS_MODES = ("preconditioned", "gradient", "momentum")
VARIANCE_MODES = ("local", "frozen")


class SparseAdamW(FlatLayoutOptimizer):
    """AdamW whose ranks exchange a sparse allreduce of their preconditioned momentum.

    Naive error feedback under Adam fails: a coordinate receives its
    accumulated gradient in rare bursts, and Adam's second moment, fed those
    bursts, rescales them badly. Here Adam's preconditioning happens *before*
    the compression, on each rank, so the error feedback works in units of
    Adam's step, and the selection keeps the largest steps, not the largest
    gradients (Adam's step is large where the gradient is small but v smaller):

    1. Warm-up (``warmup_steps``): plain AdamW on the dense allreduce (average)
       of the gradients (v: the second moment of the averaged gradient).
    2. The second moment after it: ``variance="local"`` (default): each rank
       goes on with its own, v = beta2 v + (1 - beta2) g^2 of its own gradient
       (no communication; each rank's p below is then its own Adam step).
       ``"frozen"``: v stays as the warm-up left it, the same on every rank (1-bit
       Adam's and 0/1 Adam's frozen variance: the update is then linear in g);
       ``variance_interval`` N > 0 refreshes it every N-th step, a dense step that
       feeds the averaged gradient into v with weight 1 - beta2^N (m and the
       residual are re-expressed in the new units).
       denom = max(sqrt(v / (1 - beta2^t)), floor) + eps, where the floor (frozen
       only) is 0.1 x the tensor's mean sqrt(v): an entry whose gradient was zero
       through the warm-up would otherwise take a step 1/eps times too large.
    3. Each step, p = g / denom on every rank, and ``compress="momentum"``
       (default; DGC's momentum correction, 1-bit Adam's momentum compression):
       each rank keeps its own momentum u = beta1 u + (1 - beta1) p; r = sparse
       allreduce (average, error feedback) of u; u = 0 where this rank contributed
       (``momentum_masking``, on by default); w -= lr (r / (1 - beta1^t) +
       weight_decay w): the same on every rank. ``"preconditioned"``: r = sparse
       allreduce of p, then the shared momentum m = beta1 m + (1 - beta1) r and w -=
       lr (m / (1 - beta1^t) + weight_decay w). ``"gradient"`` (frozen only): as
       "preconditioned" with the allreduce carrying g itself (selection by |g|)
       and r / denom in place of r.

    Conservation (checked by the tests): what the ranks sent plus the residuals
    equals the sum of the preconditioned gradients (momentum: of the local
    momenta) fed in; with ``residual_dtype=torch.bfloat16`` the residual's memory
    halves and its rounding each step is what is lost.

    Args:
        params: the parameters or parameter groups (``lr``, ``weight_decay`` per group).
        lr, betas, eps, weight_decay: as ``torch.optim.AdamW`` (betas and eps shared by all groups).
        density: fraction of the entries each sparse allreduce selects.
        algorithm: a sparse algorithm of ``sparsecomm.algorithms()`` (default "oktopk").
        warmup_steps: dense AdamW steps first (frozen variance: >= 1, they estimate v).
        compress: one of :data:`COMPRESS_MODES`.
        variance: one of :data:`VARIANCE_MODES`.
        variance_interval: frozen variance only: 0 (never refreshed) or N.
        momentum_masking: zero this rank's momentum where it just contributed (DGC's
            momentum factor masking: a sent entry stops pushing); default (None): on with
            compress="momentum", the only mode it applies to. Over 800 LM steps it took the
            loss from 1.39x dense's to 1.31x (docs/results.md).
        density_warmup, start_density: the first ``density_warmup`` sparse steps select
            more, from ``start_density`` down to ``density`` in four geometric stages (DGC).
        residual_dtype: torch.float32 or torch.bfloat16 (kept between steps).
        compressor, algorithm_options, group, comm: as ``sparsecomm.allreduce``.

    Every rank must call ``step()`` at every step: it communicates. A step whose
    gradient holds NaN/Inf on any rank is skipped on every rank: with a
    ``torch.amp.GradScaler`` (``scaler.step(opt)``) silently, as AMP skips (each
    rank's scaler backs off from its own overflow only, so scales may differ by
    rank; each rank unscales its own gradient before sending, so results do not),
    and without one by raising :class:`sparsecomm.NonFiniteError` on every rank;
    either way nothing changes (parameters, moments; the residual up to one rounding an
    entry: the refused call takes the input back out of it). Under DDP,
    register :func:`local_gradient_hook` so DDP does not reduce the gradients
    itself. ``state_dict()`` is per rank (the residual and a local v are); it loads into
    either ``residual_dtype``. Every rank must make the optimizer alike (its settings and
    the replicas are compared at the first step: one allgather). A bfloat16 weight takes
    its decay and step in float32, rounded once. The parameters are fixed when it is made:
    ``add_param_group`` and a parameter unfrozen later are refused; one frozen later stays put.
    """

    _step_supports_amp_scaling = True  # GradScaler calls step() always; the ranks decide together

    def __init__(self, params: Any, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, *, density: float = 0.01,
                 algorithm: str = "oktopk", warmup_steps: int = 10, compress: str = "momentum",
                 variance: str = "local", variance_interval: int = 0, density_warmup: int = 0,
                 start_density: float = 0.25, momentum_masking: bool | None = None,
                 residual_dtype: torch.dtype = torch.float32, compressor: Any = None,
                 algorithm_options: dict | None = None, group: Any = None, comm: Any = None) -> None:
        if not 0.0 <= lr or not 0.0 <= eps or not 0.0 <= weight_decay:
            raise ValueError(f"lr, eps and weight_decay must be >= 0, got {lr}, {eps}, {weight_decay}")
        if not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"betas must lie in [0, 1), got {betas}")
        if compress not in COMPRESS_MODES:
            raise ValueError(f"compress must be one of {COMPRESS_MODES}, got {compress!r}")
        if variance not in VARIANCE_MODES:
            raise ValueError(f"variance must be one of {VARIANCE_MODES}, got {variance!r}")
        frozen = variance == "frozen"
        for name, value, low in (("warmup_steps", warmup_steps, int(frozen)),
                                 ("variance_interval", variance_interval, 0), ("density_warmup", density_warmup, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                where = " with variance='frozen'" if low else ""
                raise ValueError(f"{name} must be an integer >= {low}{where}, got {value!r}")
        if not frozen and (compress == "gradient" or variance_interval):
            raise ValueError("compress='gradient' and variance_interval need variance='frozen' (a rank's "
                             "own v would make each rank divide the shared result differently)")
        if variance_interval and compress == "momentum":
            raise ValueError("variance_interval needs compress='preconditioned' or 'gradient': with 'momentum' "
                             "a refresh would step each rank by its own momentum (the replicas would drift apart)")
        if residual_dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"residual_dtype must be torch.float32 or torch.bfloat16, got {residual_dtype}")
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})
        self.params = [p for g in self.param_groups for p in g["params"] if p.requires_grad]
        if not self.params:
            raise ValueError("SparseAdamW: no parameter requires a gradient")
        self._start: dict[int, int] = {}  # a parameter's place in the flat layout
        at = 0
        for p in self.params:
            self._start[id(p)], at = at, at + p.numel()
        self._checked = False  # replicas and settings compared across ranks at the first step
        refuse_sharded(self.params, "SparseAdamW")
        if len({(tuple(g["betas"]), g["eps"]) for g in self.param_groups}) > 1:
            raise ValueError("SparseAdamW: betas and eps must be the same in every parameter group")
        self.warmup_steps, self.compress, self.variance = warmup_steps, compress, variance
        self.variance_interval, self.residual_dtype = variance_interval, residual_dtype
        self.compressor, self.group, self.comm, self.algorithm = compressor, group, comm, algorithm
        self.density, self.density_warmup = check_density(density), density_warmup
        if momentum_masking is None:
            momentum_masking = compress == "momentum"
        if not isinstance(momentum_masking, bool) or (momentum_masking and compress != "momentum"):
            raise ValueError(f"momentum_masking must be True or False, and True needs compress='momentum', "
                             f"got {momentum_masking!r}")
        self.momentum_masking = momentum_masking
        self.start_density = max(check_density(start_density), self.density)
        self.algorithm_options = dict(algorithm_options or {})
        self._dense_state: State = registry.get("dense").state_class()
        self.sparse_state: State = self._state_at(warmup_steps + 1)
        if not self.sparse_state.error_feedback:
            raise ValueError("SparseAdamW needs an algorithm state with error feedback")
        #: The last reduction's traffic on this rank: dense or not, messages, bytes_sent,
        #: seconds, selected (global), k.
        self.last_call: dict[str, Any] | None = None
        self.n = sum(p.numel() for p in self.params)
        zeros = lambda: torch.zeros(self.n, dtype=torch.float32, device=self.params[0].device)  # noqa: E731
        # m: in gradient units during the warm-up, in preconditioned units after it (the
        # same on every rank); v: the same on every rank except with variance="local".
        self.flat_state: dict[str, Any] = {"step": 0, "m": zeros(), "v": zeros(), "denom": None,
                                           "u": None, "residual": None}

    # ---- helpers -----------------------------------------------------------
    def _gather(self) -> torch.Tensor:
        """This rank's gradients as one float32 vector (zeros for a parameter without one),
        unscaled when a GradScaler left them scaled."""
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).float()
                          for p in self.params])
        scale = getattr(self, "grad_scale", None)
        if scale is not None:
            flat.div_(scale.to(flat.device))
        return flat

    def _reduce(self, flat: torch.Tensor, sparse: bool) -> torch.Tensor:
        """The average over ranks of ``flat``: sparse (error feedback) or dense; records
        the call's traffic in ``last_call``."""
        kw = {"group": self.group, "comm": self.comm, "op": "avg"}
        if not sparse:
            out = allreduce(flat, state=self._dense_state, **kw)
            self._record(self._dense_state, dense=True)
            return out
        st = self.sparse_state
        stored = self.flat_state["residual"]
        if stored is not None:  # bfloat16 between steps, float32 inside the call
            st.residual = stored.float()
        try:
            out = allreduce(flat, state=st, compressor=self.compressor, **kw)
        finally:
            if self.residual_dtype == torch.bfloat16 and st.residual is not None:
                self.flat_state["residual"], st.residual = st.residual.to(torch.bfloat16), None
        self._record(st, dense=False)
        return out

    def _state_at(self, t: int) -> State:
        """A fresh algorithm state for step t: this optimizer's algorithm and options at step t's density."""
        return registry.get(self.algorithm).state_class(self._density_at(t), **self.algorithm_options)

    def _density_at(self, t: int) -> float:
        """Step t's density: from start_density down to density in four geometric stages over
        the density_warmup steps after the dense ones (DGC's warm-up), then density."""
        j = t - self.warmup_steps - 1
        if j >= self.density_warmup:
            return self.density
        stage = 4 * j // self.density_warmup
        return self.start_density * (self.density / self.start_density) ** (stage / 4)

    def _record(self, st: State, dense: bool) -> None:
        last = st.last
        self.last_call = {"dense": dense, "messages": last.messages_sent, "bytes_sent": last.bytes_sent,
                          "seconds": last.seconds, "selected": last.global_selected, "k": last.k}

    def residual(self) -> torch.Tensor:
        """This rank's error-feedback residual (float32 copy; zeros before the first sparse step)."""
        st = self.flat_state
        if st["residual"] is not None:
            return st["residual"].float()
        r = self.sparse_state.residual
        return torch.zeros(self.n, device=self.params[0].device) if r is None else r.clone()

    def _rescale_residual(self, factor: torch.Tensor) -> None:
        st = self.flat_state
        if st["residual"] is not None:
            st["residual"] = (st["residual"].float() * factor).to(torch.bfloat16)
        elif self.sparse_state.residual is not None:
            self.sparse_state.residual.mul_(factor)

    def _apply(self, direction: torch.Tensor) -> None:
        """w -= lr (direction + weight_decay w), group by group, each parameter at its place in
        the layout (one frozen since stays put)."""
        for g in self.param_groups:
            for p in g["params"]:
                if not p.requires_grad:
                    continue
                at = self._start[id(p)]
                self._step_weight(p, direction[at:at + p.numel()].view_as(p), g["lr"], g["weight_decay"])

    def _check_first(self) -> None:
        """Refuse a parameter unfrozen since the optimizer was made (no place in the layout), at
        every step; at the first, replicas or settings that differ across ranks (they would
        drift apart, or pair unmatched collectives). Before any collective, on every rank."""
        self._refuse_unfrozen()
        if self._checked:
            return
        g = self.param_groups
        check_replicas_equal(torch.cat([p.detach().reshape(-1).float() for p in self.params]),
                             self._comm(), "SparseAdamW", {
                                 "entries": self.n, "lr": sum(x["lr"] for x in g),
                                 "weight_decay": sum(x["weight_decay"] for x in g),
                                 "beta1": g[0]["betas"][0], "beta2": g[0]["betas"][1], "eps": g[0]["eps"],
                                 "density": self.density, "algorithm": setting_code(self.algorithm),
                                 "warmup_steps": self.warmup_steps, "compress": setting_code(self.compress),
                                 "variance": setting_code(self.variance), "variance_interval": self.variance_interval,
                                 "momentum_masking": float(self.momentum_masking)})
        self._checked = True

    def _comm(self) -> Any:
        return resolve(group=self.group, comm=self.comm)

    def _denom(self, v: torch.Tensor, t: int, floor: bool) -> torch.Tensor:
        beta2, eps = self.param_groups[0]["betas"][1], self.param_groups[0]["eps"]
        root = (v / (1 - beta2 ** t)).sqrt_()
        if floor:  # per parameter tensor: 0.1 x its mean sqrt(v)
            offset = 0
            for p in self.params:
                part = root[offset:offset + p.numel()]
                part.clamp_(min=0.1 * float(part.mean()))
                offset += p.numel()
        return root.add_(eps)

    # ---- the step ----------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        """One AdamW step on the reduced gradient (see the class docstring); collective."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._check_first()
        st = self.flat_state
        beta1, beta2 = self.param_groups[0]["betas"]
        t = st["step"] + 1
        frozen = self.variance == "frozen"
        flat = self._gather()
        if t <= self.warmup_steps:
            phase = "warmup"
        elif frozen and self.variance_interval and (t - self.warmup_steps) % self.variance_interval == 0:
            phase = "refresh"
        else:
            phase = "sparse"
        if phase == "sparse" and self.sparse_state.density != self._density_at(t):
            # A new stage of the density warm-up: a state of its own, the residual moves over.
            fresh = self._state_at(t)
            fresh.residual, self.sparse_state = self.sparse_state.residual, fresh
        if phase == "sparse" and st["denom"] is None:  # the first sparse step: m to preconditioned units
            st["denom"] = self._denom(st["v"], t - 1, floor=frozen) if t > 1 else torch.ones_like(st["v"])
            st["m"].div_(st["denom"])
            if self.compress == "momentum":
                st["u"] = st["m"].clone()
        v_new = None
        try:
            if phase == "sparse":
                if not frozen:  # this rank's own second moment, this step's denominators
                    v_new = st["v"].mul(beta2).addcmul_(flat, flat, value=1 - beta2)
                    denom = self._denom(v_new, t, floor=False)
                else:
                    denom = st["denom"]
                if self.compress == "gradient":
                    r = self._reduce(flat, sparse=True).div_(denom)
                elif self.compress == "preconditioned":
                    r = self._reduce(flat.div_(denom), sparse=True)
                else:
                    u = st["u"].mul(beta1).add_(flat.div_(denom), alpha=1 - beta1)
                    r = self._reduce(u, sparse=True)
                    if self.momentum_masking:  # DGC: what was sent stops pushing (its residual is 0)
                        kept = st["residual"] if st["residual"] is not None else self.sparse_state.residual
                        u.masked_fill_(kept == 0, 0.0)  # no copy of the residual
                    st["u"] = u
            else:
                r = self._reduce(flat, sparse=False)
        except NonFiniteError:
            if getattr(self, "found_inf", None) is not None:  # a GradScaler drives the step: skip alike
                return loss
            raise
        if v_new is not None:
            st["v"] = v_new
        if phase == "warmup":
            st["m"].mul_(beta1).add_(r, alpha=1 - beta1)
            st["v"].mul_(beta2).addcmul_(r, r, value=1 - beta2)
            direction = (st["m"] / (1 - beta1 ** t)) / self._denom(st["v"], t, floor=False)
        elif phase == "refresh":
            b = beta2 ** self.variance_interval
            st["v"].mul_(b).addcmul_(r, r, value=1 - b)
            new = self._denom(st["v"], t, floor=True)
            factor = st["denom"] / new
            st["denom"] = new
            if self.compress != "gradient":  # (its residual is in gradient units: no new units)
                self._rescale_residual(factor)
            target = "u" if self.compress == "momentum" else "m"
            st[target].mul_(factor).mul_(beta1).add_(r / new, alpha=1 - beta1)
            direction = st[target] / (1 - beta1 ** t)
        elif self.compress == "momentum":
            direction = r / (1 - beta1 ** t)
        else:
            st["m"].mul_(beta1).add_(r, alpha=1 - beta1)
            direction = st["m"] / (1 - beta1 ** t)
        self._apply(direction)
        st["step"] = t
        return loss

    def state_dict(self) -> dict:
        """This rank's state: the param groups, the flat moments, the algorithm's state (residual)."""
        return {"param_groups": [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups],
                "flat_state": {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in self.flat_state.items()},
                "sparse_state": snapshot(self.sparse_state), "n": self.n}

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore a :meth:`state_dict` of the same parameters (ValueError otherwise)."""
        if state_dict.get("n") != self.n or len(state_dict["param_groups"]) != len(self.param_groups):
            raise ValueError(f"SparseAdamW.load_state_dict: a state of {state_dict.get('n')} elements in "
                             f"{len(state_dict['param_groups'])} groups, this optimizer has {self.n} in "
                             f"{len(self.param_groups)}")
        for g, saved in zip(self.param_groups, state_dict["param_groups"]):
            g.update(saved)
        device = self.params[0].device
        self.flat_state = {k: (v.to(device, copy=True) if isinstance(v, torch.Tensor) else v)
                           for k, v in state_dict["flat_state"].items()}
        # This optimizer's settings win (a state of another algorithm, density or options gives
        # only its residual, with a warning): the state it would hold at the saved step.
        t = max(self.flat_state["step"], self.warmup_steps + 1)
        mine = self._state_at(t)
        self.sparse_state = adopt_state(state_dict["sparse_state"], mine, "SparseAdamW")
        # The residual where this optimizer keeps it (a checkpoint of the other residual_dtype).
        held = self.flat_state["residual"]
        if held is not None and self.residual_dtype != torch.bfloat16:
            self.sparse_state.residual, self.flat_state["residual"] = held.float(), None
        elif self.residual_dtype == torch.bfloat16 and self.sparse_state.residual is not None:
            self.flat_state["residual"] = self.sparse_state.residual.to(torch.bfloat16)
            self.sparse_state.residual = None
        self._checked = False  # the loaded replicas are compared at the next step


# Unannotated: DDP compares a hook's annotations with the real classes, and this
# module's annotations are strings.
def local_gradient_hook(state, bucket):  # type: ignore[no-untyped-def]
    """A DDP communication hook that communicates nothing: each rank keeps its own gradient,
    for an optimizer that reduces them itself (:class:`SparseAdamW`).

        ddp.register_comm_hook(None, sparsecomm.optim.local_gradient_hook)
    """
    fut = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut
