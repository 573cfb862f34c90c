"""Ok-Topk SGD for a model outside DDP: reduce the gradients with a sparse allreduce.

    reducer = sparsecomm.optim.SparseGradientReducer(model.parameters(), density=0.01)
    loss.backward()
    reducer.reduce()          # between backward and the optimizer step
    optimizer.step()

This is Algorithm 2 of the Ok-Topk paper with the learning rate applied by the
optimizer: acc = residual + g; (U, I) = sparse_allreduce(acc); residual = acc
with the entries this rank contributed (I) removed; the gradient becomes U / P.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch

from . import registry
from .api import allreduce
from .state import State

__all__ = ["SparseGradientReducer"]


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
