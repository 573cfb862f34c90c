"""``algorithm="auto"``: per tensor size, the algorithm with the lowest modelled time.

The candidates (:data:`CANDIDATES`) are the algorithms whose result is the exact global
top-k of the summed selections (Ok-Topk, and Ok-Topk on a grid of ranks, which gives the
same result bit for bit), and dense for tensors too small for a sparse call to pay.

A call's modelled time on the busiest rank (the calibration's model, ``tools.calibrate``):

    T = alpha * M + beta * B + gamma_a * n + delta_a

* M, B: the critical-path messages and bytes of a steady call, from the algorithm's traffic
  model (``register(traffic=)``, read by :func:`traffic`; fitted to the simulated world's
  counts, which ``tests/test_choice.py`` holds them to).
* alpha, beta: the network profile (:func:`profile`): ``network=``, else the
  ``SPARSECOMM_AUTO_NETWORK`` variable, else the simulated world's network, else ``10gbe``.
  A profile saved by ``sparsecomm calibrate --save`` also brings its measured local costs.
* gamma_a, delta_a: local seconds per element and per call of algorithm a; without a
  calibrated profile, :data:`LOCAL_ADDS` times an add per element on the tensor's device
  plus :data:`LOCAL_CALL_S`.

The choice depends only on values every rank shares (size, density, P, dtype,
compressor) and on the profile: ranks given different profiles can choose differently,
and then the collective input check, which compares the algorithm, refuses the call on
every rank instead of letting them run different algorithms. A state is made for the
algorithm chosen and stays with it (:func:`sparsecomm.api.auto_state`; the DDP hook makes one per
bucket), so thresholds and residuals are never stranded by a switch.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from . import registry
from .compress import get_compressor
from .network import PROFILES, Network, TwoLevel, Traffic, profile_dir, resolve_network
from .state import check_density, topk_count

__all__ = ["AUTO", "CANDIDATES", "LOCAL_ADDS", "LOCAL_CALL_S", "ADD_S_PER_ELEMENT", "Traffic", "Profile",
           "traffic", "profile", "modelled_times", "choose", "validated"]

#: The name users pass.
AUTO = "auto"
#: What ``auto`` chooses among.
CANDIDATES = ("oktopk", "oktopk2d", "dense")
#: Local work per element, in adds of the tensor (``r.add_(g)``), when no calibrated profile
#: says: Ok-Topk's steady call is 3.2 adds on the CPU VM at 25M (docs/results.md section 1)
#: and about 4 on an H100 at 100M, the same as dense's there (section 18); dense reduces
#: what it receives, about one add.
LOCAL_ADDS = {"dense": 1.0, "oktopk": 3.2, "oktopk2d": 3.2}
#: Seconds per element of an add of float32 (``benchmarks/test_steady_state.py``'s ``add`` row:
#: 12.7 ms at 25M on the 2-core VM, 0.41 ms at 100M on an H100).
ADD_S_PER_ELEMENT = {"cpu": 0.5e-9, "cuda": 4.1e-12}
#: Seconds of fixed work per call (Python, launches): a steady Ok-Topk call at n = 2,000 on
#: the CPU VM takes 0.7 ms; dense's call is shorter.
LOCAL_CALL_S = {"dense": 0.2e-3, "oktopk": 0.7e-3, "oktopk2d": 0.8e-3}


@dataclass(frozen=True)
class Profile:
    """A network (alpha s/message, beta s/byte) and, when calibrated, local costs per algorithm."""

    network: "Network | TwoLevel"
    local_s_per_element: dict = field(default_factory=dict)
    local_s_per_call: dict = field(default_factory=dict)


def traffic(algorithm: str, n: int, k: int, P: int, value_bytes: float, ranks_per_node: int = 1,
            grid: bool = False) -> Traffic:
    """Critical-path messages and bytes of a steady call of ``algorithm`` on the busiest rank:
    its registered model (``register(traffic=)``, beside the algorithm; ValueError without one).

    Each model is fitted to the simulated world at P = 2 to 16 (``tests/test_choice.py`` holds
    them within 30%) and, for Ok-Topk and its grid, checked against its counts at P = 64 to
    1024 (``benchmarks/results/2026-11-26-cpu-vm-oktopk2d-at-scale/rows.csv``: within 21%).
    ``ranks_per_node`` and ``grid`` are the two-level algorithm's (``oktopk2l``); the others
    ignore them.
    """
    model = registry.get(algorithm).traffic
    if model is None:
        raise ValueError(f"no traffic model for {algorithm!r}")
    if P <= 1:
        return Traffic(0.0, 0.0)
    return model(n, k, P, value_bytes, ranks_per_node, grid)


def profile(network: Any = None, comm: Any = None) -> "Profile":
    """The profile ``auto`` models with: ``network`` (a name, a saved profile's name or
    path, "alpha:beta", a pair or a Network), else ``$SPARSECOMM_AUTO_NETWORK``, else the
    simulated world's network (``comm``), else ``10gbe``. A saved calibrated profile
    brings its local costs too. A Profile is returned as it is."""
    if isinstance(network, Profile):
        return network
    if network is None:
        network = os.environ.get("SPARSECOMM_AUTO_NETWORK") or None
    if network is None and comm is not None:
        network = getattr(getattr(comm, "_world", None), "network", None)
    if network is None:
        network = "10gbe"
    local = _calibrated_locals(network) if isinstance(network, str) else ({}, {})
    return Profile(resolve_network(network), *local)


def _calibrated_locals(name: str) -> tuple[dict, dict]:
    """The local costs a profile saved by ``sparsecomm calibrate --save`` holds, if any."""
    if name.lower() in PROFILES or ":" in name:
        return {}, {}
    path = name if name.endswith(".json") else os.path.join(profile_dir(), f"{name}.json")
    try:
        with open(path, encoding="utf-8") as f:
            saved = json.load(f)
    except (OSError, ValueError):
        return {}, {}
    return dict(saved.get("local_s_per_element") or {}), dict(saved.get("local_s_per_call") or {})


def modelled_times(n: int, density: float, P: int, dtype: torch.dtype = torch.float32,
                   compressor: Any = None, prof: Profile | None = None, device: str = "cpu") -> dict[str, float]:
    """Modelled seconds of one steady call of each candidate (see the module docstring)."""
    prof = prof or profile()
    codec = get_compressor(compressor, dtype)
    value_bytes = codec.value_bits / 8
    k = topk_count(density, n)
    add = ADD_S_PER_ELEMENT.get(device, ADD_S_PER_ELEMENT["cpu"]) * torch.empty(0, dtype=dtype).element_size() / 4
    times = {}
    for name in CANDIDATES:
        label = name if compressor is None else f"{name}+{compressor}"
        t = traffic(name, n, k, P, value_bytes)
        per_element = prof.local_s_per_element.get(label, LOCAL_ADDS[name] * add)
        per_call = prof.local_s_per_call.get(label, LOCAL_CALL_S[name])
        times[name] = t.time(prof.network) + per_element * n + per_call
    return times


def choose(n: int, density: float, P: int, dtype: torch.dtype = torch.float32, compressor: Any = None,
           network: Any = None, device: str = "cpu", comm: Any = None) -> str:
    """The candidate with the lowest modelled time (ties go to the earlier in :data:`CANDIDATES`).

    Args:
        n: elements of the tensor (the DDP hook: of the bucket).
        density: the fraction selected.
        P: ranks.
        dtype, compressor: the tensor's dtype and how values travel.
        network: see :func:`profile`.
        device: ``tensor.device.type`` (the local costs' scale).
        comm: the communicator (a simulated world's network is the default profile).

    Returns:
        An algorithm name.
    """
    check_density(density)
    times = modelled_times(n, density, P, dtype, compressor, profile(network, comm), device)
    return min(CANDIDATES, key=lambda name: (times[name], CANDIDATES.index(name)))


def validated(algorithm: str, options: dict | None, network: Any) -> str:
    """The algorithm whose State checks a hook's or schedule's options: ``algorithm``, or for
    ``"auto"`` Ok-Topk, after refusing options (they belong to one algorithm) and a bad profile
    (now, not at the first bucket)."""
    if algorithm != AUTO:
        return algorithm
    if options:
        raise ValueError("algorithm='auto' chooses per bucket: algorithm_options belong to one "
                         "algorithm, so leave them out (or name the algorithm)")
    profile(network)
    return "oktopk"
