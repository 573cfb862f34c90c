"""Optimizers' side of sparse training: the gradient reducer, and an AdamW that error feedback suits.

Ok-Topk SGD for a model outside DDP: reduce the gradients with a sparse allreduce.

    reducer = sparsecomm.optim.SparseGradientReducer(model.parameters(), density=0.01)
    loss.backward()
    reducer.reduce()          # between backward and the optimizer step
    optimizer.step()

This is Algorithm 2 of the Ok-Topk paper with the learning rate applied by the
optimizer: acc = residual + g; (U, I) = sparse_allreduce(acc); residual = acc
with the entries this rank contributed (I) removed; the gradient becomes U / P.
"""

from __future__ import annotations

import math
from typing import Any, Iterable

import torch

from . import registry
from .api import allreduce
from .state import State

__all__ = ["SparseGradientReducer", "FrozenVarianceAdamW"]


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
        self.state: State = registry.get(algorithm).state_class(density, **(algorithm_options or {}))
        self.group, self.comm = group, comm

    def reduce(self) -> torch.Tensor:
        """All-reduce the gradients in place; returns the reduced flat vector."""
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        out = allreduce(flat, state=self.state, op=self.op, compressor=self.compressor,
                        group=self.group, comm=self.comm)
        offset = 0
        for p in self.params:
            n = p.numel()
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            p.grad.copy_(out[offset:offset + n].view_as(p))
            offset += n
        return out

    def state_dict(self) -> dict:
        return {"state": self.state}

    def load_state_dict(self, d: dict) -> None:
        self.state = d["state"]


class FrozenVarianceAdamW(torch.optim.Optimizer):
    """AdamW whose second moment freezes after ``freeze_after`` steps, so that error feedback works.

    Error feedback sends a coordinate's residual when it has grown: a burst
    standing for many steps of gradient. Adam divides each coordinate by the
    root of its recent squared gradients, so the burst inflates that estimate
    and moves the weight by about one step, not the many it stands for: on
    the LM, Ok-Topk at 1% with AdamW ended 24% above dense's loss. With the
    second moment frozen, the update is momentum SGD with a fixed
    per-coordinate scale, linear in the gradient, which is what error
    feedback's guarantee covers (the idea of 1-bit Adam, Tang et al. 2021,
    applied to sparsified gradients).

    1. Steps 1..``freeze_after``: exactly AdamW (decoupled weight decay, bias
       corrections). Reduce these densely (the DDP hook's ``warmup_steps``,
       ``sparsecomm train --warmup-steps``), so the frozen moment measures the
       real gradients' scale.
    2. Later steps: p -= lr * wd * p; m = b1 m + (1 - b1) g;
       p -= lr / (1 - b1^t) * m / (sqrt(v / (1 - b2^T)) + eps), with v and
       T = ``freeze_after`` fixed.

    Args:
        params: parameters or parameter groups, as for any torch optimizer.
        lr, betas, eps, weight_decay: as for ``torch.optim.AdamW``.
        freeze_after: steps before the second moment freezes (>= 1).
    """

    def __init__(self, params: Any, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, *, freeze_after: int = 100) -> None:
        if not lr >= 0:
            raise ValueError(f"lr must be >= 0, got {lr}")
        if not (0 <= betas[0] < 1 and 0 <= betas[1] < 1):
            raise ValueError(f"betas must lie in [0, 1), got {betas}")
        if not eps >= 0 or not weight_decay >= 0:
            raise ValueError(f"eps and weight_decay must be >= 0, got {eps}, {weight_decay}")
        if isinstance(freeze_after, bool) or not isinstance(freeze_after, int) or freeze_after < 1:
            raise ValueError(f"freeze_after must be an integer >= 1 (steps of plain AdamW first), got {freeze_after!r}")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                                      freeze_after=freeze_after))

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        """One update of every parameter with a gradient (see the class docstring)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, (b1, b2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
            frozen_at = group["freeze_after"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("FrozenVarianceAdamW does not take sparse gradients")
                st = self.state[p]
                if not st:
                    st["step"] = 0
                    st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                st["step"] += 1
                t, m, v, g = st["step"], st["exp_avg"], st["exp_avg_sq"], p.grad
                p.mul_(1 - lr * wd)
                m.lerp_(g, 1 - b1)
                if t <= frozen_at:
                    v.mul_(b2).addcmul_(g, g, value=1 - b2)
                correction2 = 1 - b2 ** min(t, frozen_at)
                denom = (v.sqrt() / math.sqrt(correction2)).add_(eps)
                p.addcdiv_(m, denom, value=-lr / (1 - b1 ** t))
        return loss
