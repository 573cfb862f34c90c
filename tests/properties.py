"""The property behind every input check: all ranks raise InputError, or all agree and are right.

A case is a random call (world size, algorithm, compressor, dtype, size,
density, op, stateless or with error feedback) with, sometimes, one argument
perturbed on some ranks: op, density, dtype, shape, device (meta), a state
setting, the compressor, or a NaN/Inf value. The property:

* a perturbation that makes ranks disagree, or a non-finite value anywhere:
  every rank raises ``InputError`` (within the timeout, never a hang);
* otherwise every rank returns the same result, equal to an independent
  reference (``reference.py``) for exact calls, and with error feedback
  results plus residuals equal every gradient fed in (nothing lost).

Cases are built by :func:`build_case` from any ``draw`` with ``int``,
``choice`` and ``bool``: hypothesis's in the simulated world
(:class:`HypothesisDraw`), a seeded ``random.Random`` on gloo and MPI, where
every rank must build the same case (:class:`SeededDraw`).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

import torch

import sparsecomm

from reference import REFERENCES, ref_oktopk2l

ALGORITHMS = sparsecomm.algorithms()
# Exact on the small integers the cases use: results can be compared bit for bit.
EXACT_COMPRESSORS = [None, "fp16", "bf16", "trunc16"]
LOSSY_COMPRESSORS = ["q8", "q4", "q8s", "fp8"]
PERTURBATIONS = ["op", "density", "dtype", "shape", "meta", "state", "compressor", "nan", "inf"]
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
          "float64": torch.float64}


class SeededDraw:
    """``draw`` from a seed: the same sequence of choices on every rank."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)

    def int(self, lo: int, hi: int) -> int:
        return self.rng.randint(lo, hi)

    def choice(self, seq: list) -> Any:
        return seq[self.rng.randrange(len(seq))]

    def bool(self, p: float = 0.5) -> bool:
        return self.rng.random() < p


class HypothesisDraw:
    """``draw`` from hypothesis's ``data`` (shrinks to small failing cases)."""

    def __init__(self, data: Any) -> None:
        from hypothesis import strategies as st

        self.data, self.st = data, st

    def int(self, lo: int, hi: int) -> int:
        return self.data.draw(self.st.integers(lo, hi))

    def choice(self, seq: list) -> Any:
        return self.data.draw(self.st.sampled_from(seq))

    def bool(self, p: float = 0.5) -> bool:
        return self.data.draw(self.st.booleans())


@dataclass
class Case:
    P: int
    algorithm: str
    compressor: str | None
    dtype: str
    n: int
    density: float
    op: str
    steps: int  # 0: one stateless call; else calls with an error-feedback state
    seed: int
    perturb: str | None = None
    perturbed: list[int] = field(default_factory=list)  # ranks that differ
    node: int = 1  # two-level Ok-Topk's ranks per node (a divisor of P; 1 for the others)

    @property
    def must_fail(self) -> bool:
        return self.perturb is not None

    def describe(self) -> str:
        return repr(self)


def build_case(draw: Any, P: int | None = None) -> Case:
    """A random call; ``P`` fixed for real engines (their world size is given)."""
    P = P if P is not None else draw.int(1, 8)
    algorithm = draw.choice(ALGORITHMS)
    compressor = draw.choice(EXACT_COMPRESSORS + LOSSY_COMPRESSORS)
    dtype = draw.choice(list(DTYPES))
    n = draw.choice([1, 2, 7, 64, 257, 1000])
    density = draw.choice([1e-9, 0.01, 0.1, 0.5, 1.0])  # 1e-9: k = 1
    op = draw.choice(["sum", "avg"])
    steps = draw.choice([0, 0, 3])
    case = Case(P, algorithm, compressor, dtype, n, density, op, steps, draw.int(0, 2**31 - 1))
    if algorithm == "oktopk2l":
        case.node = draw.choice([g for g in range(1, P + 1) if P % g == 0])
    if draw.bool():
        perturb = draw.choice(PERTURBATIONS)
        if perturb == "state":
            case.steps = case.steps or 3  # a setting of the state: tau, or error feedback
        lonely = perturb in ("meta", "nan", "inf")  # wrong even on one rank of one
        if P > 1 or lonely:
            # A nonempty set of ranks; a difference needs a proper subset.
            first = draw.int(0, P - 1)
            count = draw.int(1, P if lonely else P - 1)
            case.perturb = perturb
            case.perturbed = sorted({(first + i) % P for i in range(count)})
    return case


def gradient(case: Case, rank: int, step: int) -> torch.Tensor:
    """Small integers with ties and zeros: sums are exact in every dtype and order."""
    gen = torch.Generator().manual_seed(case.seed + 7919 * rank + 104729 * step)
    g = torch.randint(-6, 7, (case.n,), generator=gen).to(torch.float64)
    g[torch.rand(case.n, generator=gen) < 0.3] = 0
    return g


def rank_call(case: Case, rank: int, comm: Any = None, device: str = "cpu") -> tuple[str, Any]:
    """Run the case on one rank: ("error", message) or ("ok", (results, residual, fed)).

    ``device``: where the rank's tensors live (results come back on the CPU).
    """
    mine = rank in case.perturbed
    dtype = DTYPES[case.dtype]
    density, op, compressor = case.density, case.op, case.compressor
    if mine and case.perturb == "op":
        op = "avg" if op == "sum" else "sum"
    if mine and case.perturb == "density":
        density = 0.3 if density != 0.3 else 0.2
    if mine and case.perturb == "dtype":
        dtype = torch.float64 if dtype != torch.float64 else torch.float32
    if mine and case.perturb == "compressor":
        compressor = "q2" if compressor != "q2" else None
    state = None
    if case.steps:
        kwargs: dict[str, Any] = {"error_feedback": not (mine and case.perturb == "state")}
        if case.algorithm in ("oktopk", "oktopk2d"):
            kwargs["tau"] = 3 if mine and case.perturb == "state" else 2
        if case.algorithm == "oktopk2l":
            kwargs["ranks_per_node"] = case.node
        state = sparsecomm.registry.get(case.algorithm).state_class(density, **kwargs)
    elif case.algorithm == "oktopk2l":  # a stateless call, with the case's ranks per node
        state = sparsecomm.OkTopkTwoLevelState(density, tau=1, tau_prime=1, error_feedback=False,
                                                          ranks_per_node=case.node)
    results, fed = [], torch.zeros(case.n, dtype=torch.float64)
    try:
        for step in range(max(1, case.steps)):
            g = gradient(case, rank, step)
            fed += g
            x = g.to(device, dtype)
            if mine and case.perturb in ("nan", "inf") and step == max(1, case.steps) - 1:
                x[case.seed % case.n] = float("nan") if case.perturb == "nan" else float("-inf")
            if mine and case.perturb == "shape":
                x = x.reshape(1, -1) if case.n > 1 else torch.cat([x, x])
            if mine and case.perturb == "meta":
                x = torch.empty_like(x, device="meta")
            out = sparsecomm.allreduce(x, density if state is None else None, algorithm=case.algorithm,
                                       op=op, state=state, compressor=compressor, comm=comm)
            results.append(out.reshape(-1).to("cpu", torch.float64))
    except sparsecomm.InputError as exc:
        return "error", str(exc)
    residual = None
    if state is not None and state.residual is not None:
        residual = state.residual.to(torch.float64).cpu()
    return "ok", (results, residual, fed)


def reference(case: Case) -> torch.Tensor | None:
    """The exact result of a stateless call with an exact compressor, or None."""
    if case.steps or case.compressor not in EXACT_COMPRESSORS:
        return None
    fp16_wire = case.compressor == "fp16" or (case.compressor is None and case.dtype == "float16")
    if case.op == "avg" and fp16_wire:
        return None  # values travel divided by P: rounded, so ties may order differently
    grads = [gradient(case, r, 0).to(torch.float32) for r in range(case.P)]
    out = (ref_oktopk2l(grads, case.density, case.node) if case.algorithm == "oktopk2l"
           else REFERENCES[case.algorithm](grads, case.density))
    out = out.to(torch.float64)
    return out / case.P if case.op == "avg" else out


def check(case: Case, outcomes: list[tuple[str, Any]]) -> None:
    """Assert the property over every rank's outcome of ``case``."""
    kinds = [kind for kind, _ in outcomes]
    if case.must_fail:
        assert kinds == ["error"] * case.P, (case, outcomes)
        return
    assert kinds == ["ok"] * case.P, (case, outcomes)
    first = outcomes[0][1][0]
    for _, (results, _, _) in outcomes:
        for a, b in zip(results, first):
            assert torch.equal(a, b), ("ranks disagree", case)
    expected = reference(case)
    if expected is not None:
        got = first[0]
        tol = 0.0 if case.op == "sum" else 1e-2 * (expected.abs().max().item() + 1)
        assert torch.allclose(got, expected, atol=tol, rtol=0), (case, got, expected)
    if case.steps and all(o[1][1] is not None for o in outcomes):
        fed = sum(o[1][2] for o in outcomes)
        residual = sum(o[1][1] for o in outcomes)
        delivered = sum(first) * (case.P if case.op == "avg" else 1)
        scale = fed.abs().max().item() + 1
        # 16-bit outputs round the delivered sums: nothing is lost beyond that rounding.
        tol = 1e-6 if case.dtype in ("float32", "float64") else 1e-2
        assert torch.allclose(delivered + residual, fed, atol=tol * scale * case.steps, rtol=0), case
