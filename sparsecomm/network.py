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

__all__ = ["Network", "TwoLevel", "PROFILES", "resolve_network", "profile_dir", "load_profile", "ranks_per_node"]


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


@dataclass(frozen=True)
class TwoLevel:
    """A machine of nodes of ``ranks_per_node`` ranks (ranks ``g G .. g G + G - 1`` share node g):
    a message between two ranks of a node costs ``intra``'s alpha and beta, one between nodes
    ``inter``'s (each rank's own share of its node's link).

    Where one network is asked for (``alpha``, ``beta``, ``time``: a collective over ranks of
    several nodes), it answers as ``inter``, the slower link any such exchange crosses.
    """

    intra: Network
    inter: Network
    ranks_per_node: int
    name: str = "custom"

    def __post_init__(self) -> None:
        if isinstance(self.ranks_per_node, bool) or not isinstance(self.ranks_per_node, int) or self.ranks_per_node < 1:
            raise ValueError(f"network: ranks_per_node must be an integer >= 1, got {self.ranks_per_node!r}")

    @property
    def alpha(self) -> float:
        return self.inter.alpha

    @property
    def beta(self) -> float:
        return self.inter.beta

    def time(self, messages: int, nbytes: int) -> float:
        return self.inter.time(messages, nbytes)

    def between(self, a: int, b: int) -> Network:
        """The link from rank ``a`` to rank ``b``."""
        return self.intra if a // self.ranks_per_node == b // self.ranks_per_node else self.inter

    def spanning(self, ranks: "list[int] | range") -> Network:
        """The network of a collective over ``ranks``: ``intra`` when they share one node."""
        nodes = {r // self.ranks_per_node for r in ranks}
        return self.intra if len(nodes) <= 1 else self.inter


def ranks_per_node(network: "Network | TwoLevel | None") -> int | None:
    """G of a two-level network, None for one level."""
    return network.ranks_per_node if isinstance(network, TwoLevel) else None


PROFILES: dict[str, "Network | TwoLevel"] = {
    "pizdaint": Network(1.5e-6, 1 / 10e9, "pizdaint"),  # Cray Aries, ~10 GB/s injection
    "1gbe": Network(50e-6, 1 / 125e6, "1gbe"),
    "10gbe": Network(30e-6, 1 / 1.25e9, "10gbe"),
    "56gbib": Network(2e-6, 1 / 6e9, "56gbib"),
    "100gbib": Network(1.5e-6, 1 / 12e9, "100gbib"),
    # Nodes of 8 GPUs: NVLink within (~150 GB/s a GPU, ~3 us), a 200 Gbit/s NIC a GPU between
    # (25 GB/s, ~5 us): today's 8-GPU nodes (H100 with NVLink 4 and NDR InfiniBand).
    "nvl8": TwoLevel(Network(3e-6, 1 / 150e9, "nvlink"), Network(5e-6, 1 / 25e9, "ndr200"), 8, "nvl8"),
    # The same nodes on 10 Gbit/s Ethernet shared by the node's 8 ranks.
    "nvl8-10gbe": TwoLevel(Network(3e-6, 1 / 150e9, "nvlink"), Network(30e-6, 8 / 1.25e9, "10gbe/8"), 8,
                           "nvl8-10gbe"),
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


def resolve_network(network: "str | tuple[float, float] | Network | TwoLevel | None") -> "Network | TwoLevel | None":
    """A Network from a profile name (built in, or saved by ``sparsecomm calibrate --save``), a
    profile's .json path, "alpha:beta", an (alpha, beta) pair or a Network; None stays None."""
    if network is None or isinstance(network, (Network, TwoLevel)):
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


@dataclass(frozen=True)
class Traffic:
    """Critical-path messages and bytes of the busiest rank in one steady call; ``intra_*``:
    the part of them that stays within a node (two-level algorithms only)."""

    messages: float
    bytes: float
    intra_messages: float = 0.0
    intra_bytes: float = 0.0

    def time(self, network: Network | TwoLevel) -> float:
        """Modelled seconds on ``network``: the node's part on a two-level network's ``intra``
        link, everything else (all of it on one level) on the network's ``inter`` one."""
        if isinstance(network, TwoLevel):
            return network.inter.time(self.messages, self.bytes) + network.intra.time(self.intra_messages,
                                                                                      self.intra_bytes)
        return network.time(self.messages + self.intra_messages, self.bytes + self.intra_bytes)
