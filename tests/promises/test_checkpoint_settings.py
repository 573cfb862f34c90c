"""A checkpoint made with other settings, loaded into every object that keeps algorithm states.

One table of cases (another algorithm, density, options, or several at once) against every
object: the DDP hook, each schedule, ``SparseAdamW`` and ``SparseGradientReducer``. In each:
the new object's own settings hold (the states it calls with after the load are its own), the
residuals carry over (what it holds right after the load is what was saved), and a warning
names what differed. The same settings resume with no warning.
"""

from __future__ import annotations

import warnings
from typing import Any

import loop_cases
import pytest
import torch

import sparsecomm
from sparsecomm import registry
from sparsecomm.hooks import SparseHookState, sparse_allreduce_hook
from sparsecomm.optim import SparseAdamW, SparseGradientReducer
from sparsecomm.schedules import SCHEDULES
from sparsecomm.state import State

#: (name, the saved object's settings, the new object's settings).
CASES = [
    ("algorithm", {"algorithm": "oktopk", "density": 0.2}, {"algorithm": "topka", "density": 0.2}),
    ("density", {"algorithm": "oktopk", "density": 0.2}, {"algorithm": "oktopk", "density": 0.1}),
    ("options", {"algorithm": "oktopk", "density": 0.2, "algorithm_options": {"tau": 2, "tau_prime": 3}},
     {"algorithm": "oktopk", "density": 0.2, "algorithm_options": {"tau": 5, "tau_prime": 7}}),
    ("algorithm and density", {"algorithm": "topka", "density": 0.05}, {"algorithm": "oktopk", "density": 0.2}),
    ("same", {"algorithm": "oktopk", "density": 0.2}, {"algorithm": "oktopk", "density": 0.2}),
]
OBJECTS = ["hook", *sorted(SCHEDULES), "SparseAdamW", "SparseGradientReducer"]
STEPS = 3


def _states(checkpoint: Any) -> list[State]:
    """Every algorithm state a checkpoint (a state dict) holds, wherever it keeps them."""
    if isinstance(checkpoint, State):
        return [checkpoint]
    if isinstance(checkpoint, dict):
        return [s for v in checkpoint.values() for s in _states(v)]
    if isinstance(checkpoint, (list, tuple)):
        return [s for v in checkpoint for s in _states(v)]
    return []


def _residual_mass(checkpoint: dict) -> float:
    """The sum of every residual a checkpoint holds: its states' own and those kept per parameter
    (the hook's ``residuals``, the schedules' ``parked``), in float64."""
    total = sum(float(s.residual.double().sum()) for s in _states(checkpoint) if s.residual is not None)
    for key in ("residuals", "parked"):
        total += sum(float(r.double().sum()) for r in checkpoint.get(key, {}).values())
    flat = checkpoint.get("flat_state", {}).get("residual")  # SparseAdamW's bfloat16 residual
    return total + (0.0 if flat is None else float(flat.double().sum()))


class Trained:
    """One object of ``OBJECTS`` over a small model on this rank: build it, train it a step."""

    def __init__(self, kind: str, settings: dict, rank: int) -> None:
        self.kind, self.rank = kind, rank
        self.net = loop_cases.model()
        params = list(self.net.parameters())
        self.opt: Any = torch.optim.SGD(params, lr=loop_cases.LR)
        self.reducer: Any = None
        if kind == "hook":  # driven without DDP: the buckets the hook is given are the whole model
            self.obj = SparseHookState(self.net, min_bucket_elements=0, **settings)
        elif kind in SCHEDULES:
            self.obj = SCHEDULES[kind](self.net, self.opt, **{**loop_cases.options(kind, "dense"), **settings})
        elif kind == "SparseAdamW":
            self.obj = self.opt = SparseAdamW(params, lr=1e-3, warmup_steps=0, **settings)
        else:
            self.obj = SparseGradientReducer(params, **settings)

    def step(self, step: int) -> None:
        x, y = loop_cases.batch(self.rank, step)
        self.opt.zero_grad()
        torch.nn.functional.cross_entropy(self.net(x), y).backward()
        if self.kind == "hook":
            params = list(self.net.parameters())
            sparse_allreduce_hook(self.obj, _Bucket(params)).wait()
        elif self.kind in SCHEDULES:
            self.obj.step()
            return
        elif self.kind == "SparseGradientReducer":
            self.obj.reduce()
        self.opt.step()

    def checkpoint(self) -> dict:
        if self.kind in ("dear",):
            self.obj.synchronize()
        return self.obj.state_dict()

    def close(self) -> None:
        if self.kind in SCHEDULES:
            self.obj.close()


class _Bucket:
    """The one bucket of a model, as DDP's GradBucket shows it to a hook."""

    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        self._params = params

    def buffer(self) -> torch.Tensor:
        return torch.cat([p.grad.reshape(-1) for p in self._params])

    def parameters(self) -> list[torch.nn.Parameter]:
        return self._params

    def index(self) -> int:
        return 0

    def is_last(self) -> bool:
        return True


def _across(kind: str, saved_settings: dict, own_settings: dict, rank: int) -> dict:
    a = Trained(kind, saved_settings, rank)
    for step in range(STEPS):
        a.step(step)
    saved = a.checkpoint()
    a.close()
    # Read before the load: a loaded state goes on in place (the checkpoint's objects advance).
    saved_mass, saved_iterations = _residual_mass(saved), [s.iteration for s in _states(saved)]
    b = Trained(kind, own_settings, rank)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        b.obj.load_state_dict(saved)
    loaded = _residual_mass(b.checkpoint())
    b.step(STEPS)
    used = _states(b.checkpoint())
    b.close()
    return {"saved_mass": saved_mass, "loaded_mass": loaded,
            "warnings": [str(w.message) for w in caught if issubclass(w.category, UserWarning)],
            "used": [(type(s), s.density, s.settings()) for s in used],
            "saved_iterations": saved_iterations, "iterations": [s.iteration for s in used]}


def _differences(saved: dict, own: dict) -> list[tuple[str, str]]:
    """What a warning must name: for each setting that differs, the saved and the own value as
    the states print them."""
    names = []
    if saved["algorithm"] != own["algorithm"]:
        names.append((registry.get(saved["algorithm"]).state_class.__name__,
                      registry.get(own["algorithm"]).state_class.__name__))
    if saved["density"] != own["density"]:
        names.append((f"('density', {saved['density']!r})", f"('density', {own['density']!r})"))
    for key, value in own.get("algorithm_options", {}).items():
        old = saved.get("algorithm_options", {}).get(key)
        if old != value:
            names.append((f"('{key}', {old!r})", f"('{key}', {value!r})"))
    return names


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("kind", OBJECTS)
def test_a_checkpoint_of_other_settings_keeps_the_new_objects_settings_and_the_residuals(kind, case):
    name, saved_settings, own_settings = case
    results = sparsecomm.simulate(2, lambda r: _across(kind, saved_settings, own_settings, r), timeout=60).results
    own_class = registry.get(own_settings["algorithm"]).state_class
    for out in results:
        # Residuals carry over: nothing of the saved gradient memory is lost in the load.
        assert out["loaded_mass"] == pytest.approx(out["saved_mass"], rel=1e-12, abs=1e-12), out
        assert out["saved_mass"] != 0  # (there was something to carry)
        # The object's own settings hold in every state it called with after the load.
        assert out["used"], out
        for cls, density, settings in out["used"]:
            assert cls is own_class and density == own_settings["density"], (cls, density)
            for key, value in own_settings.get("algorithm_options", {}).items():
                assert settings[key] == value, (key, settings)
        if name == "same":  # the saved states go on: no warning, their iterations continue
            assert out["warnings"] == [], out["warnings"]
            assert min(out["iterations"]) > min(out["saved_iterations"]), out
            continue
        # One warning, naming each setting that differed, with both values.
        assert len(out["warnings"]) >= 1 and "residuals carry over" in out["warnings"][0], out["warnings"]
        for old, new in _differences(saved_settings, own_settings):
            assert old in out["warnings"][0] and new in out["warnings"][0], (old, new, out["warnings"][0])
