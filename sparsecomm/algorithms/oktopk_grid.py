"""Ok-Topk on a grid of ranks: the same result in O(sqrt(P)) messages a rank.

Ok-Topk's volume is O(k), but its split, its gathers and its counts reach every other
rank: P - 1 messages each on a rank's critical path, 4P a call. With a cluster's
alpha of 30 us that is 0.12 s a call at P = 1024 whatever the size of the gradient.
``oktopk2d`` runs the same algorithm on a :class:`~sparsecomm.comm.grid.GridCommunicator`:
the ranks as ceil(sqrt(P)) columns, every all-to-all exchange in two hops (a row, then
a column). Everything else (selection, boundaries, error feedback, the state) is
Ok-Topk's, and the result is Ok-Topk's bit for bit: the same parts reach the same
ranks, in the same order.

Per rank and call, with s = ceil(sqrt(P)) and k entries selected:

=====================  ======================  ===============================
exchange               Ok-Topk (messages)      oktopk2d (messages)
=====================  ======================  ===============================
split (the parts)      P - 1                   about 3 (s - 1): sizes, 2 hops
allgather (counts)     P - 1                   about 2 (s - 1)
allgatherv (result)    P - 1                   about 2 (s - 1)
=====================  ======================  ===============================

Volume: the gathers move the same bytes as a ring; each part of the split travels
twice, so a rank receives up to 2k(s - 1)/s split words instead of k(P - 1)/P, plus
the parts' sizes (s words from each row peer): between 3k(1 - 1/s) and
7k(1 - 1/s) words received a call (Ok-Topk: 2k(1 - 1/P) to 6k(1 - 1/P)).
"""

from __future__ import annotations

import math

import torch

from ..check import CarriedCheck
from ..comm.base import Communicator
from ..comm.grid import GridCommunicator
from ..compress import Compressor
from ..network import Traffic
from ..registry import register
from ..result import SparseResult
from ..state import Preselection
from .oktopk import (OkTopkState, _Reduced, control_bytes, oktopk, oktopk_data_bytes, oktopk_gather, oktopk_reduce,
                     oktopk_traffic)

__all__ = ["OkTopkGridState", "oktopk2d", "oktopk2d_volume", "on_grid"]


class OkTopkGridState(OkTopkState):
    """Ok-Topk's state (every setting and field), for the grid's exchanges."""


def on_grid(comm: Communicator) -> Communicator:
    """``comm`` as a grid of ranks (two ranks make no grid: ``comm`` itself)."""
    return comm if isinstance(comm, GridCommunicator) or comm.size <= 2 else GridCommunicator(comm)


def oktopk2d_volume(n: int, k: int, P: int) -> tuple[float, float]:
    """Words received per rank: 3k(1 - 1/s) to 7k(1 - 1/s), s = ceil(sqrt(P)).

    The module docstring derives it."""
    if P <= 2:
        return 2 * k * (P - 1) / P, 6 * k * (P - 1) / P
    s = GridCommunicator.columns(P)
    f = 1 - 1 / s
    return 3 * k * f, 7 * k * f


def oktopk2d_reduce(acc: torch.Tensor, k: int, comm: Communicator, state: OkTopkState, codec: Compressor,
                    preselected: Preselection | None = None, check: CarriedCheck | None = None) -> _Reduced:
    """Ok-Topk's first half (``oktopk_reduce``) on the grid."""
    return oktopk_reduce(acc, k, on_grid(comm), state, codec, preselected, check)


def oktopk2d_gather(r: _Reduced, comm: Communicator) -> SparseResult:
    """Ok-Topk's second half (``oktopk_gather``) on the grid."""
    return oktopk_gather(r, on_grid(comm))


#: The grid's data over Ok-Topk's (an entry travels twice, a part of it combined on the way).
GRID_DATA = 1.4


def oktopk2d_traffic(n: int, k: int, P: int, value_bytes: float, ranks_per_node: int = 1,
                     grid: bool = False) -> Traffic:
    """Ok-Topk's exchanges in two hops on a grid of c = ceil(sqrt P) columns and r = ceil(P / c)
    rows: 6 (c + r - 2) messages, :data:`GRID_DATA` times the data. Two ranks make no grid."""
    if P <= 2:
        return oktopk_traffic(n, k, P, value_bytes)
    cols = math.ceil(math.sqrt(P))
    rows = math.ceil(P / cols)
    return Traffic(6.0 * (cols + rows - 2), GRID_DATA * oktopk_data_bytes(k, P, value_bytes) + control_bytes(P))


@register("oktopk2d", OkTopkGridState, split=(oktopk2d_reduce, oktopk2d_gather), volume=oktopk2d_volume,
          traffic=oktopk2d_traffic, global_k=True)
def oktopk2d(acc: torch.Tensor, k: int, comm: Communicator, state: OkTopkState, codec: Compressor,
             preselected: Preselection | None = None, check: CarriedCheck | None = None) -> SparseResult:
    """Ok-Topk on a grid of sqrt(P) x sqrt(P) ranks: its split, gathers and counts in two hops
    (row, column); Ok-Topk's result bit for bit.

    1. Lay the ranks out as ceil(sqrt(P)) columns (``comm.grid.GridCommunicator``).
    2. Run :func:`~sparsecomm.algorithms.oktopk.oktopk` on it: its split goes row then
       column (each part relayed once), its allgathers gather a row then the rows.

    Args and Returns: those of ``oktopk``; the result is Ok-Topk's bit for bit.
    """
    return oktopk(acc, k, on_grid(comm), state, codec, preselected, check)
