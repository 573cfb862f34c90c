"""The optimizers over one flat layout of their parameters (``DeMo``, ``SparseAdamW``): what
``sparsecomm.flat_optim`` gives both, checked through each."""

from __future__ import annotations

import pytest
import torch

import sparsecomm
from sparsecomm.optim import DeMo, SparseAdamW

#: Each optimizer as a user makes it, with a decoupled decay.
MAKERS = {
    "DeMo": lambda params: DeMo(params, lr=0.01, weight_decay=0.1, chunk=16, topk=3, update="rms"),
    "SparseAdamW": lambda params: SparseAdamW(params, lr=0.01, weight_decay=0.1, warmup_steps=1),
}


def _model(dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(0.3 * torch.randn(p.shape, generator=gen))
    return net.to(dtype)


@pytest.mark.parametrize("name", sorted(MAKERS))
def test_a_bfloat16_weight_takes_the_step_and_the_decay_rounded_once(name):
    # Decay and step in float32 and rounded once: a bfloat16 weight moves as its float32 twin
    # (same weights, same gradient) rounded, entry for entry.
    def body(rank):
        gen = torch.Generator().manual_seed(7)
        low, twin = _model(torch.bfloat16), _model()
        with torch.no_grad():
            for a, b in zip(low.parameters(), twin.parameters()):
                b.copy_(a.float())
                a.grad = torch.randn(a.shape, generator=gen).to(torch.bfloat16)
                b.grad = a.grad.float()
        for net in (low, twin):
            MAKERS[name](net.parameters()).step()
        moved = not torch.equal(next(low.parameters()), _model(torch.bfloat16)[0].weight)
        return moved and all(torch.equal(a, b.to(torch.bfloat16)) for a, b in zip(low.parameters(), twin.parameters()))

    assert sparsecomm.simulate(1, body).results == [True]


@pytest.mark.parametrize("name", sorted(MAKERS))
def test_the_parameters_are_fixed_when_the_optimizer_is_made(name):
    net = _model()
    net[2].bias.requires_grad_(False)
    opt = MAKERS[name](net.parameters())
    with pytest.raises(ValueError, match=f"{name}: parameter groups are fixed"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(3))]})
    net[2].bias.requires_grad_(True)  # unfrozen after the optimizer was made: no place in its layout

    def body(rank):
        net(torch.ones(2, 8)).sum().backward()
        with pytest.raises(ValueError, match=rf"{name}: a parameter of shape \(4,\) requires a gradient now"):
            opt.step()

    sparsecomm.simulate(1, body)
