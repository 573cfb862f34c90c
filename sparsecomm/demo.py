"""Decoupled momentum (DeMo): each rank keeps its own momentum; only its fast DCT components travel.

    opt = sparsecomm.optim.DeMo(model.parameters(), lr=1e-3, chunk=64, topk=1)
    loss_fn(model(x), y).backward()       # each rank's own gradient (under DDP:
    opt.step()                            #   ddp.register_comm_hook(None, local_gradient_hook))

DeMo (Peng, Quesnelle, Kingma, 2024) lets each rank's momentum drift from its peers' and
exchanges, each step, only the part of it that moves fast. The momentum is cut into chunks
of ``chunk`` entries and each chunk is seen in the DCT-II basis, where a smooth signal's
energy sits in a few coefficients (in the coordinate basis each rank's largest entries barely
overlap); the ``topk`` largest coefficients of every chunk are the fast components. Each step,
on every rank:

1. m = decay * m + g (this rank's own gradient, float32).
2. X = DCT(m), chunk by chunk; Q = the ``topk`` largest |X| of each chunk (the rest zero).
3. m -= IDCT(Q): what was extracted leaves this rank's momentum (DeMo's error feedback).
4. A = the average over ranks of Q, by the sparse allreduce (``algorithm``).
5. w -= lr * (sign(IDCT(A)) + weight_decay * w) (``update="sign"``, the method's), or
   lr * IDCT(A) (``update="value"``), or lr * IDCT(A) / (sqrt(v) + eps) (``update="rms"``:
   v a running mean of IDCT(A)^2 with decay ``variance_decay``, bias-corrected as Adam's).

Why a third rule: the sign gives every entry the same step, whether its component carried one
step's gradient or a hundred steps' backlog; the value keeps that difference but inherits the
gradient's scale (an lr per model) and its heavy tail. ``"rms"`` keeps the difference at
Adam's scale: the lr of AdamW applies. A is the same on every rank, so v is too.

Two error-feedback rules meet here, and they are different things:

* **DeMo's** (step 3): each rank removes what it *extracted* from its own momentum, whether or
  not it reached the others. What it kept decays there with ``decay``.
* **The allreduce's**: with ``error_feedback`` (default) the allreduce keeps, in its own
  residual, whatever its selection did not send, and adds it to the next step's Q. With
  ``algorithm="topka"`` (the default, and DeMo's own exchange: an allgather of every rank's
  components) the selection is exact at k = topk per chunk, sends every extracted component
  and that residual stays zero: the method as published. Ok-Topk selects a global top-k of
  the *summed* components (O(k) traffic); by default its k has room for every rank's
  components (``reduce_density``), which carries the method too, up to its threshold
  estimates; with less, it is a different method, whose leftovers wait in the allreduce's
  residual without decaying.

Chunks are 1-D runs of each parameter's flattened entries (``chunk=64``: row-major, along the
input dimension of a Linear weight), or 2-D tiles (``chunk=(h, w)``, as the published method
cuts matrices): a parameter of two dimensions or more, seen as (its first dimension, the
rest), whose sides divide by h and w is cut into h x w tiles, each transformed by the DCT of
its rows and of its columns (D_h X D_w^T: the 2-D DCT-II); any other parameter is cut into
runs of h * w entries, each folded row-major into h x w and transformed alike. Every
parameter is padded to a whole number of chunks. Memory, full size on every rank: the
momentum (float32, padded), the allreduce's residual, and with ``update="rms"`` v.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Iterator

import torch

from .api import allreduce
from .check import check_replicas_equal, refuse_sharded, setting_code
from .comm import resolve
from .errors import NonFiniteError
from .flat_optim import FlatLayoutOptimizer
from . import registry
from .memory import StateMaker, adopt_state, snapshot
from .state import State, check_density

__all__ = ["DeMo", "UPDATE_RULES", "dct_matrix"]

#: How :class:`DeMo` turns the reduced components into a step.
UPDATE_RULES = ("sign", "value", "rms")


def dct_matrix(size: int, dtype: torch.dtype = torch.float32, device: Any = None) -> torch.Tensor:
    """The orthonormal DCT-II matrix D (``size`` x ``size``): X = D x, x = D^T X.

    D[k, i] = s_k cos(pi (2i + 1) k / (2 size)), s_0 = sqrt(1 / size), s_k = sqrt(2 / size);
    made in float64, then cast.
    """
    i = torch.arange(size, dtype=torch.float64)
    k = i.reshape(-1, 1)
    d = torch.cos(math.pi * (2 * i + 1) * k / (2 * size)) * math.sqrt(2.0 / size)
    d[0] /= math.sqrt(2.0)
    return d.to(dtype=dtype, device=device)


def _tile(chunk: Any) -> tuple[int, int]:
    """(h, w) of a chunk: ``(1, chunk)`` for an integer, the pair itself for a pair (ValueError otherwise)."""
    sides = chunk if isinstance(chunk, (tuple, list)) and len(chunk) == 2 else (1, chunk)
    if any(isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in sides):
        raise ValueError(f"DeMo: chunk must be an integer >= 1 or a pair (h, w) of them, got {chunk!r}")
    return int(sides[0]), int(sides[1])


def _shown(tile: tuple[int, int]) -> str:
    return str(tile[1]) if tile[0] == 1 else f"{tile[0]} x {tile[1]}"


def _tileable(shape: torch.Size, tile: tuple[int, int]) -> bool:
    """Whether a parameter of ``shape`` is cut into 2-D tiles: two dimensions or more, seen as
    (the first, the rest), each side a multiple of the tile's (a 1-D chunk needs no tiling)."""
    h, w = tile
    if h == 1 or len(shape) < 2:
        return False
    rows = shape[0]
    return rows % h == 0 and (math.prod(shape) // rows) % w == 0


def _to_chunks(t: torch.Tensor, tile: tuple[int, int]) -> torch.Tensor:
    """A tileable tensor's entries tile by tile, each tile row-major (flat)."""
    h, w = tile
    rows = t.shape[0]
    return t.reshape(rows // h, h, -1, w).permute(0, 2, 1, 3).reshape(-1)


def _from_chunks(flat: torch.Tensor, shape: torch.Size, tile: tuple[int, int]) -> torch.Tensor:
    """Inverse of :func:`_to_chunks`: the tensor of ``shape`` whose tiles ``flat`` lists."""
    h, w = tile
    rows = shape[0]
    return flat.view(rows // h, -1, h, w).permute(0, 2, 1, 3).reshape(shape)


@contextlib.contextmanager
def _ieee_matmuls() -> Iterator[None]:
    """float32 matmuls in full precision inside (TF32, when a script turns it on, would round
    the DCT to about 1e-3: the momentum would then lose other components than those sent)."""
    was = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(was)


class DeMo(FlatLayoutOptimizer):
    """Decoupled momentum over the sparse allreduce (see the module docstring).

    Args:
        params: the parameters or parameter groups (``lr``, ``weight_decay`` per group);
            every rank's must be equal at the start (checked at the first step: one allgather
            of a digest).
        lr, weight_decay: the step (sign units with ``update="sign"``) and decoupled decay.
        decay: the momentum's decay (DeMo's 0.999).
        chunk: entries of a chunk (the DCT's length), or ``(h, w)``: 2-D tiles of h x w entries.
        topk: components a chunk sends each step (None: ``max(1, round(density * h * w))``).
        density: used only to derive ``topk`` when it is None.
        update: ``"sign"`` (the method's), ``"value"`` or ``"rms"`` (:data:`UPDATE_RULES`).
        variance_decay, eps: ``"rms"``'s running mean of the squared step and its floor.
        algorithm: the registered algorithm that carries the components: ``"topka"``
            (DeMo's allgather) or any other (``"oktopk"``: the global top-k of their sum).
        reduce_density: the components' allreduce's density. None: room for what every rank
            extracted, so that any algorithm carries DeMo itself: topk / chunk for one whose k is
            each rank's (TopkA), P times that for one whose k counts the sum's entries
            (``global_k``: Ok-Topk; its thresholds are estimates, so a few components may still
            wait in its residual). Less makes a global selection pick among the ranks'
            components (the rest wait, undecayed, in the allreduce's residual).
        compressor, error_feedback, algorithm_options, group, comm: the components'
            allreduce, as in ``sparsecomm.allreduce``.

    Every rank calls ``step()`` every step (it communicates) and holds the same parameters
    after it. A gradient with NaN/Inf on any rank skips the step on every rank (nothing
    changes: parameters, momentum, residual): silently under a ``torch.amp.GradScaler``
    (``scaler.step(opt)``; each rank unscales its own gradient), else by raising
    :class:`sparsecomm.NonFiniteError` on every rank. Gradient clipping applies to each
    rank's own gradient before ``step()`` (``clip_grad_norm_`` as usual): the method allows
    it, the ranks' norms simply differ. ``state_dict()`` is per rank (the momentum is).
    A bfloat16 or float16 parameter takes its decay and step in float32, rounded once (a
    decay under half its last place still vanishes: keep float32 weights for long runs).
    The parameters are fixed when the optimizer is made: ``add_param_group`` and a parameter
    that turns trainable later are refused (ValueError); one that is frozen later stays put.
    """

    _step_supports_amp_scaling = True  # GradScaler calls step() always; the ranks decide together

    def __init__(self, params: Any, lr: float = 1e-3, *, decay: float = 0.999, chunk: int | tuple[int, int] = 64,
                 topk: int | None = None, density: float = 0.01, reduce_density: float | None = None,
                 update: str = "sign", variance_decay: float = 0.95, eps: float = 1e-8,
                 weight_decay: float = 0.0, algorithm: str = "topka", compressor: Any = None,
                 error_feedback: bool = True, algorithm_options: dict | None = None,
                 group: Any = None, comm: Any = None) -> None:
        if not lr >= 0 or not weight_decay >= 0:
            raise ValueError(f"DeMo: lr and weight_decay must be >= 0, got {lr}, {weight_decay}")
        if not 0 <= decay < 1:
            raise ValueError(f"DeMo: decay must lie in [0, 1), got {decay}")
        tile = _tile(chunk)
        chunk = tile[0] * tile[1]
        if topk is None:
            topk = max(1, round(check_density(density) * chunk))
        if isinstance(topk, bool) or not isinstance(topk, int) or not 1 <= topk <= chunk:
            raise ValueError(f"DeMo: topk must be an integer in [1, chunk = {chunk}], got {topk!r}")
        if update not in UPDATE_RULES:
            raise ValueError(f"DeMo: update must be one of {UPDATE_RULES}, got {update!r}")
        if not 0 <= variance_decay < 1 or not eps > 0:
            raise ValueError(f"DeMo: variance_decay must lie in [0, 1) and eps be > 0, got {variance_decay}, {eps}")
        super().__init__(params, {"lr": lr, "weight_decay": weight_decay})
        self.params = [p for g in self.param_groups for p in g["params"] if p.requires_grad]
        if not self.params:
            raise ValueError("DeMo: no parameter requires a gradient")
        refuse_sharded(self.params, "DeMo")
        self.decay, self.chunk, self.tile, self.topk, self.update = float(decay), chunk, tile, topk, update
        self.variance_decay, self.eps = float(variance_decay), float(eps)
        self.compressor, self.group, self.comm, self.algorithm = compressor, group, comm, algorithm
        if reduce_density is None:  # room for what every rank extracted (a global k: P ranks' worth)
            spread = self._comm().size if registry.get(algorithm).global_k else 1
            reduce_density = min(1.0, topk / chunk * spread)
        reduce_density = check_density(reduce_density)
        self._maker = StateMaker(algorithm, reduce_density, algorithm_options, error_feedback, compressor, None,
                                 dense_keeps_residual=True)
        device = self.params[0].device
        #: Where each parameter starts in the padded flat layout (whole chunks each).
        self.offsets = [0]
        for p in self.params:
            self.offsets.append(self.offsets[-1] + math.ceil(p.numel() / chunk) * chunk)
        self.n = self.offsets[-1]
        self._start = {id(p): at for p, at in zip(self.params, self.offsets)}  # a parameter's place
        #: Per parameter: whether it is cut into 2-D tiles (else into runs, folded).
        self.tiled = [_tileable(p.shape, tile) for p in self.params]
        self.momentum = torch.zeros(self.n, dtype=torch.float32, device=device)
        #: ``"rms"``'s running mean of the squared step (the same on every rank); None otherwise.
        self.variance = torch.zeros(self.n, dtype=torch.float32, device=device) if update == "rms" else None
        self.basis = dct_matrix(tile[1], torch.float32, device)  # along each row of a chunk (a 1-D one: all)
        self.basis_rows = dct_matrix(tile[0], torch.float32, device)  # down each column of a 2-D tile
        self.sparse_state: State = self._maker.new(self.n, torch.float32, device, self._comm())
        self.steps = 0
        self.skipped = 0  # steps skipped for a NaN/Inf on some rank
        self._checked = False

    def _comm(self) -> Any:
        return resolve(group=self.group, comm=self.comm)

    def _gather(self) -> torch.Tensor:
        """This rank's gradients in the padded layout (float32; zeros for a parameter without
        one and in the padding), unscaled when a GradScaler left them scaled."""
        flat = torch.zeros(self.n, dtype=torch.float32, device=self.momentum.device)
        for p, start, tiled in zip(self.params, self.offsets, self.tiled):
            if p.grad is not None:
                flat[start:start + p.numel()] = _to_chunks(p.grad, self.tile) if tiled else p.grad.reshape(-1)
        scale = getattr(self, "grad_scale", None)
        if scale is not None:
            flat.div_(scale.to(flat.device))
        return flat

    def extract(self, m: torch.Tensor) -> torch.Tensor:
        """The fast components of ``m``: per chunk the ``topk`` largest |DCT coefficients|,
        the others zero (flat, in the coefficient basis). NaN counts as the largest."""
        return self._extract(m)[0]

    def _extract(self, m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`extract`, and where its components lie (flat positions, ``topk`` a chunk)."""
        h, w = self.tile
        with _ieee_matmuls():
            if h == 1:
                coeffs = m.view(-1, w) @ self.basis.T
            else:  # D_h X D_w^T, tile by tile, flattened row-major
                coeffs = (self.basis_rows @ m.view(-1, h, w) @ self.basis.T).reshape(-1, h * w)
        keep = coeffs.abs().topk(self.topk, dim=1).indices
        q = torch.zeros_like(coeffs).scatter_(1, keep, coeffs.gather(1, keep)).reshape(-1)
        firsts = torch.arange(0, m.numel(), coeffs.shape[1], device=m.device).unsqueeze(1)
        return q, keep.add_(firsts).reshape(-1)

    def to_entries(self, coeffs: torch.Tensor) -> torch.Tensor:
        """The inverse DCT of flat coefficients, chunk by chunk (flat, padded layout)."""
        h, w = self.tile
        with _ieee_matmuls():
            if h == 1:
                return (coeffs.view(-1, w) @ self.basis).reshape(-1)
            return (self.basis_rows.T @ coeffs.view(-1, h, w) @ self.basis).reshape(-1)

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        """One DeMo step (the module docstring's 1-5); collective."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._refuse_unfrozen()
        if not self._checked:
            # Ranks that step by other rules would drift apart, or pair unmatched collectives.
            check_replicas_equal(torch.cat([p.detach().reshape(-1).float() for p in self.params]),
                                 self._comm(), "DeMo", {
                                     "entries": self.n, "chunk": self.tile[0] * 65536 + self.tile[1],
                                     "topk": self.topk, "decay": self.decay, "update": setting_code(self.update),
                                     "variance_decay": self.variance_decay, "eps": self.eps,
                                     "algorithm": setting_code(self.algorithm),
                                     "lr": sum(g["lr"] for g in self.param_groups),
                                     "weight_decay": sum(g["weight_decay"] for g in self.param_groups)})
            self._checked = True
        m = self.momentum.mul(self.decay).add_(self._gather())  # out of place: a skipped step keeps the old
        q, support = self._extract(m)
        # A refused call takes q back out of the allreduce's residual, exact up to one rounding
        # an entry; q touches it only at q's support, kept here to restore it bit for bit.
        held = self.sparse_state.residual
        kept = None if held is None else held[support]
        try:
            average = allreduce(q, state=self.sparse_state, op="avg", compressor=self.compressor,
                                group=self.group, comm=self.comm)
        except NonFiniteError:
            if kept is not None and self.sparse_state.residual is not None:
                self.sparse_state.residual[support] = kept.to(self.sparse_state.residual.device)
            self.skipped += 1
            if getattr(self, "found_inf", None) is not None:  # a GradScaler drives the step: skip alike
                return loss
            raise
        self.momentum = m.sub_(self.to_entries(q))
        direction = self.to_entries(average)
        if self.update == "sign":
            direction.sign_()
        elif self.update == "rms":
            b = self.variance_decay
            self.variance.mul_(b).addcmul_(direction, direction, value=1 - b)
            direction.div_(self.variance.div(1 - b ** (self.steps + 1)).sqrt_().add_(self.eps))
        for g in self.param_groups:
            for p in g["params"]:
                if not p.requires_grad:
                    continue
                at = self._start[id(p)]
                part = direction[at:at + p.numel()]
                part = _from_chunks(part, p.shape, self.tile) if _tileable(p.shape, self.tile) else part.view_as(p)
                self._step_weight(p, part, g["lr"], g["weight_decay"])
        self.steps += 1
        return loss

    @property
    def residual(self) -> torch.Tensor | None:
        """What the components' allreduce has not sent yet (this rank's; coefficient basis)."""
        return self.sparse_state.residual

    def state_dict(self) -> dict:
        """This rank's state: the param groups, the momentum, the allreduce's state, the counts."""
        return {"param_groups": [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups],
                "momentum": self.momentum.clone(),
                "variance": None if self.variance is None else self.variance.clone(),
                "sparse_state": snapshot(self.sparse_state), "steps": self.steps,
                "skipped": self.skipped, "n": self.n, "chunk": self.chunk, "tile": self.tile}

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore :meth:`state_dict` of the same parameters and chunk (ValueError otherwise;
        this optimizer's other settings win)."""
        tile = tuple(state_dict.get("tile", (1, state_dict.get("chunk"))))
        if (state_dict.get("n"), tile) != (self.n, self.tile) or \
                len(state_dict["param_groups"]) != len(self.param_groups):
            raise ValueError(f"DeMo.load_state_dict: a state of {state_dict.get('n')} entries in chunks of "
                             f"{_shown(tile)} over {len(state_dict['param_groups'])} groups; this optimizer has "
                             f"{self.n} in chunks of {_shown(self.tile)} over {len(self.param_groups)}")
        if self.variance is not None and state_dict.get("variance") is None:
            raise ValueError('DeMo.load_state_dict: this optimizer\'s update="rms" needs the running mean '
                             'of the squared step; the state was saved under another rule')
        for g, saved in zip(self.param_groups, state_dict["param_groups"]):
            g.update(saved)
        self.momentum = state_dict["momentum"].clone().to(self.momentum.device)
        if self.variance is not None:
            self.variance = state_dict["variance"].clone().to(self.momentum.device)
        self.steps, self.skipped = state_dict["steps"], state_dict["skipped"]
        self.sparse_state = adopt_state(state_dict["sparse_state"], self.sparse_state, "DeMo",
                                        self._maker.like(state_dict["sparse_state"]))
