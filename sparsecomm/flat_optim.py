"""What an optimizer over one flat layout of its parameters shares (``DeMo``, ``SparseAdamW``).

Such an optimizer keeps its state (momenta, residuals) as flat vectors in which each parameter
it was given has a fixed place (``self._start``: a parameter's id to its first entry). So:

1. The parameters are fixed when it is made: ``add_param_group`` is refused, and so is a
   parameter that turns trainable later (it has no place); one frozen later keeps its place
   and stays put.
2. A weight takes its decoupled decay and its step in float32 at least, rounded once: apart,
   a bfloat16 weight would drop every decay under half its last place and round twice.
"""

from __future__ import annotations

import torch

__all__ = ["FlatLayoutOptimizer"]


class FlatLayoutOptimizer(torch.optim.Optimizer):
    """Base of an optimizer whose state is one flat layout of its parameters (module docstring).

    A subclass sets ``self._start`` (a parameter's id to its place) in its ``__init__``."""

    def add_param_group(self, param_group: dict) -> None:
        """Refused once the optimizer is made (ValueError: make a new one over all groups)."""
        if hasattr(self, "_start"):
            who = type(self).__name__
            raise ValueError(f"{who}: parameter groups are fixed when the optimizer is made (its state is one "
                             f"flat layout of them); make a new {who} over all of them")
        super().add_param_group(param_group)

    def _refuse_unfrozen(self) -> None:
        """Refuse a parameter that requires a gradient now but did not when the optimizer was
        made: the same on every rank (whose models are the same), before any collective."""
        for g in self.param_groups:
            for p in g["params"]:
                if p.requires_grad and id(p) not in self._start:
                    who = type(self).__name__
                    raise ValueError(f"{who}: a parameter of shape {tuple(p.shape)} requires a gradient now but "
                                     f"did not when the optimizer was made (it has no place in the layout); make "
                                     f"a new {who} after unfreezing")

    @staticmethod
    def _step_weight(p: torch.Tensor, step: torch.Tensor, lr: float, weight_decay: float) -> None:
        """p <- p (1 - lr weight_decay) - lr step, in float32 at least, rounded to p's dtype once."""
        w = p if p.dtype in (torch.float32, torch.float64) else p.float()
        if weight_decay:
            w.mul_(1 - lr * weight_decay)
        w.add_(step.to(w.dtype), alpha=-lr)
        if w is not p:
            p.copy_(w)
