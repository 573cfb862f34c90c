"""Alpha-beta network profiles used to model communication time.

A message of ``m`` bytes costs ``alpha + beta * m`` seconds. The profiles are the
approximate public figures of the papers README (section 6); pass your own
``(alpha, beta)`` pair for another network, or fit one to measurements with
``sparsecomm calibrate --save`` and use it by name.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from .errors import InputFileError

__all__ = ["Network", "PROFILES", "resolve_network", "profile_dir", "load_profile"]


@dataclass(frozen=True)
class Network:
    """Per-message latency ``alpha`` (s) and per-byte time ``beta`` (s/byte)."""

    alpha: float
    beta: float
    name: str = "custom"

    def __post_init__(self) -> None:
        if not (self.alpha >= 0 and self.beta >= 0):
            raise ValueError(f"network: alpha and beta must be >= 0, got {self.alpha}, {self.beta}")

    def time(self, messages: int, nbytes: int) -> float:
        """Modelled seconds for ``messages`` messages carrying ``nbytes`` bytes in all."""
        return messages * self.alpha + nbytes * self.beta


PROFILES: dict[str, Network] = {
    "pizdaint": Network(1.5e-6, 1 / 10e9, "pizdaint"),  # Cray Aries, ~10 GB/s injection
    "1gbe": Network(50e-6, 1 / 125e6, "1gbe"),
    "10gbe": Network(30e-6, 1 / 1.25e9, "10gbe"),
    "56gbib": Network(2e-6, 1 / 6e9, "56gbib"),
    "100gbib": Network(1.5e-6, 1 / 12e9, "100gbib"),
}


def profile_dir() -> str:
    """Where named profiles live: ``$SPARSECOMM_PROFILES``, else ~/.config/sparsecomm/networks."""
    return os.environ.get("SPARSECOMM_PROFILES") or os.path.join(os.path.expanduser("~"), ".config",
                                                                  "sparsecomm", "networks")


def load_profile(path: str, name: str = "custom") -> Network:
    """The Network in a profile file written by ``sparsecomm calibrate --save``.

    InputFileError (a ValueError) naming the file if it cannot be read or is not a profile.
    """
    try:
        with open(path, encoding="utf-8") as f:
            d = json.load(f)
    except OSError as exc:
        raise InputFileError(f"{path}: cannot read ({exc.strerror or exc})") from None
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise InputFileError(f"{path}: not JSON") from None
    try:
        return Network(float(d["alpha"]), float(d["beta"]), d.get("name", name))
    except (TypeError, KeyError, ValueError):
        raise InputFileError(f"{path}: not a network profile (numbers alpha and beta)") from None


def _saved_profile(name: str) -> Network | None:
    """A profile saved by name or given as a .json path; None if there is no such file."""
    path = name if name.endswith(".json") else os.path.join(profile_dir(), f"{name}.json")
    if not os.path.exists(path):
        return None
    return load_profile(path, name)


def resolve_network(network: "str | tuple[float, float] | Network | None") -> Network | None:
    """A Network from a profile name (built in, or saved by ``sparsecomm calibrate --save``), a
    profile's .json path, "alpha:beta", an (alpha, beta) pair or a Network; None stays None."""
    if network is None or isinstance(network, Network):
        return network
    if isinstance(network, str) and ":" in network:  # "alpha:beta" from a command line
        alpha, beta = network.split(":", 1)
        try:
            return Network(float(alpha), float(beta), network)
        except ValueError:
            raise ValueError(f"network {network!r}: alpha:beta must be two numbers >= 0 "
                             "(seconds per message, seconds per byte)") from None
    if isinstance(network, str):
        if network.lower() in PROFILES:
            return PROFILES[network.lower()]
        saved = _saved_profile(network)
        if saved is not None:
            return saved
        raise ValueError(f"unknown network profile {network!r}; known: {sorted(PROFILES)}, a profile saved "
                         "by `sparsecomm calibrate --save` (or its .json path), or a custom (alpha, beta) pair")
    alpha, beta = network
    return Network(float(alpha), float(beta))
