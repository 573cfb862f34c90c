"""Ok-Topk for nodes of several ranks: dense inside the node, sparse between nodes.

Today's clusters are nodes of G = 4-8 GPUs joined by a fast fabric (NVLink, 150 GB/s a
GPU) and a slower network between nodes (a NIC of 25 GB/s a GPU, or Ethernet). Flat
Ok-Topk sends every message over the network as if every rank had a node of its own,
and its critical path grows with P. ``oktopk2l`` uses the node:

* the node's G ranks sum their gradients densely over the fast fabric (a reduce-scatter:
  local rank l holds shard l, n/G elements, of the node's sum);
* the ranks holding the same shard, one a node, run Ok-Topk over the network on it: P/G
  ranks, n/G elements, ceil(k/G) entries;
* the node's ranks all-gather the shards' results over the fast fabric.

Per rank and call, with N = P/G nodes, m = n/G and k' = ceil(k/G):

==================  ==================================  ==================================
exchange            words (received)                    messages (critical path)
==================  ==================================  ==================================
node reduce-scatter m (G - 1) = n (G - 1) / G, fabric   ceil(log2 G)
Ok-Topk on a shard  2k'(N - 1)/N to 6k'(N - 1)/N        about 4 (N - 1) + its allreduces
node all-gather     the other shards' results (k' each) G - 1 (two small allgathers)
==================  ==================================  ==================================

Against flat Ok-Topk over P ranks: the network carries k/G words a rank instead of k,
in about 4 N messages instead of 4 P, and the fabric carries the dense reduce-scatter.
With ``grid=True`` the shard's Ok-Topk runs on a grid of the nodes (``oktopk2d``'s
exchanges, two hops each): about 6 (c + r - 2) messages between nodes (c = ceil(sqrt N)
columns, r rows) instead of 4 (N - 1), about 1.4 times the data, the same result bit for
bit: for thousands of ranks, where the 4 N messages cost more than the bytes.

Semantics (``tests/reference.py``'s ``ref_oktopk2l``): with S_j the sum of node j's
accumulators, shard l of the result is Ok-Topk's exact result over the N nodes' shards
S_j[l], with k' entries. With error feedback the residual of shard l of node j lives on
its local rank l (the owner): every rank adds its whole accumulator to the node's sum,
and what the shard's Ok-Topk did not deliver (its residual) comes back to the owner's
residual alone, so results plus residuals keep every gradient.

Ranks per node G: the state's ``ranks_per_node``, else the simulated world's two-level
network, else the launcher's (``LOCAL_WORLD_SIZE``, ``OMPI_COMM_WORLD_LOCAL_SIZE``,
``MPI_LOCALNRANKS``, ``SLURM_NTASKS_PER_NODE``), else 1 (flat Ok-Topk). Ranks g G to
g G + G - 1 must share node g, as torchrun, Slurm and mpiexec place them by default.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

from .. import kernels
from ..comm.base import Communicator, launcher_node_size
from ..compress import Compressor
from ..network import Traffic
from ..registry import register
from ..result import PhaseRecorder, SparseResult
from ..state import Compensated, PhaseStats, Preselection, State
from .exchange import peak_bits, peak_of
from .oktopk import OkTopkState, _Reduced, oktopk_gather, oktopk_reduce, oktopk_traffic, oktopk_volume
from .oktopk_grid import oktopk2d_traffic, oktopk2d_volume, on_grid

__all__ = ["OkTopkTwoLevelState", "oktopk2l", "oktopk2l_volume", "node_levels"]


class OkTopkTwoLevelState(OkTopkState):
    """Ok-Topk's state (every setting and field, for the shard's Ok-Topk between nodes), and:

    Args:
        ranks_per_node: G, the ranks of a node (None: found as the module docstring says).
        grid: run the shard's Ok-Topk between nodes on a grid of the nodes (module docstring).
        Every other argument: :class:`~sparsecomm.algorithms.oktopk.OkTopkState`'s.

    The residual is the tensor's size, zero outside this rank's shard (module docstring).
    """

    grid = False  # (a state pickled before the setting existed runs flat)

    def __init__(self, density: float = 0.01, tau: int = 32, tau_prime: int = 64,
                 error_feedback: bool = True, balanced: bool = True,
                 balance_factor: float = 4.0, count_bounds: tuple[float, float] = (2 / 3, 4 / 3),
                 window: int = 4, local_select: str = "exact", global_select: str = "auto",
                 ranks_per_node: int | None = None, grid: bool = False, bucket: int | None = None) -> None:
        super().__init__(density, tau, tau_prime, error_feedback, balanced, balance_factor, count_bounds,
                         self._renamed("bucket", bucket, window), local_select, global_select)
        if ranks_per_node is not None and (isinstance(ranks_per_node, bool) or not isinstance(ranks_per_node, int)
                                           or ranks_per_node < 1):
            raise ValueError(f"ranks_per_node must be an integer >= 1 or None, got {ranks_per_node!r}")
        if not isinstance(grid, bool):
            raise ValueError(f"grid must be True or False, got {grid!r}")
        self.ranks_per_node, self.grid = ranks_per_node, grid

    # Ok-Topk's fused accumulate-and-select reads the rank's own accumulator; here the
    # selection runs on the node's sum, after the reduce-scatter: accumulate plainly.
    def compensate(self, flat: torch.Tensor, zero_out: torch.Tensor | None = None) -> Compensated:
        return State.compensate(self, flat, zero_out)

    def fuses_next(self) -> bool:
        return State.fuses_next(self)

    @classmethod
    def exact(cls, density: float) -> "OkTopkTwoLevelState":
        return cls(density, tau=1, tau_prime=1, error_feedback=False)


def node_levels(comm: Communicator, ranks_per_node: int | None) -> tuple[Communicator, Communicator]:
    """(the node's ranks, the ranks of the same local rank on every node) of ``comm``.

    1. G: ``ranks_per_node``, else ``comm.node_size``, else the launcher's, else 1.
    2. One allgather: every rank must have found the same G, and G must divide P
       (else ValueError on every rank, naming what each found).
    3. Two splits: node g = ranks g G .. g G + G - 1; across = the ranks r with r mod G = l.
    Kept on ``comm`` per G: later calls communicate nothing.
    """
    G = ranks_per_node or comm.node_size or launcher_node_size() or 1
    kept = comm.__dict__.setdefault("_node_levels", {})
    if G in kept:
        return kept[G]
    found = comm.allgather(torch.tensor([G], dtype=torch.int64, device=comm.control_device)).reshape(-1).tolist()
    P = comm.size
    if len(set(found)) > 1 or P % G:
        raise ValueError(f"oktopk2l: the ranks per node must be the same on every rank and divide the world "
                         f"size {P}; the ranks found {found} (pass ranks_per_node= to the state, or set "
                         "LOCAL_WORLD_SIZE)")
    node = comm.split(comm.rank // G, comm.rank % G)
    across = comm.split(comm.rank % G, comm.rank // G)
    kept[G] = (node, across)
    return node, across


def oktopk2l_volume(n: int, k: int, P: int, G: int = 1, grid: bool = False) -> tuple[float, float]:
    """Words received per rank: n(G-1)/G + 2k(G-1)/G within the node, Ok-Topk's for n/G
    entries and k/G selected among P/G ranks between nodes.

    The node's dense reduce-scatter and all-gather of results, and Ok-Topk's volume on a shard
    (on a grid of the nodes: oktopk2d's; module docstring)."""
    N, m, kk = P // G, -(-n // G), -(-k // G)
    lo, hi = (oktopk2d_volume if grid else oktopk_volume)(m, kk, N) if N > 1 else (0.0, 0.0)
    node = m * (G - 1) + 2 * kk * (G - 1)  # the reduce-scatter (G - 1 shards of m), and G - 1 shards' entries
    return node + lo, node + hi


@dataclass
class _Half:
    """oktopk2l after the node's reduce-scatter and the shard's Ok-Topk steps 1-4."""

    acc: torch.Tensor
    shard: torch.Tensor  # this rank's shard of the node's sum (m entries)
    reduced: _Reduced
    node: Communicator
    across: Communicator
    limit: float  # the largest |value| no overflow check refuses (``registry``: ``limit``)


def oktopk2l_reduce(acc: torch.Tensor, k: int, comm: Communicator, state: OkTopkTwoLevelState,
                    codec: Compressor, preselected: Preselection | None = None, *,
                    limit: float = math.inf) -> _Half:
    """Steps 1-3 of :func:`oktopk2l`: the levels, the node's reduce-scatter, the shard's Ok-Topk
    up to its global selection (``oktopk_reduce`` among the nodes)."""
    node, across = node_levels(comm, state.ranks_per_node)
    if state.grid:
        across = on_grid(across)
    G, n = node.size, acc.numel()
    m = -(-n // G)
    before, t0 = comm.stats.snapshot(), time.perf_counter()
    if G == 1:
        shard = acc
    else:
        padded = acc
        if m * G != n:  # the last shard is short: pad with zeros, which are never selected
            padded = state.workspace("padded", m * G, acc.dtype, acc.device)
            padded[:n].copy_(acc)
            padded[n:].zero_()
        shard = node.reduce_scatter(padded, out=state.workspace("shard", m, acc.dtype, acc.device))
    phase = PhaseStats(seconds=time.perf_counter() - t0)
    phase += comm.stats - before
    reduced = oktopk_reduce(shard, min(m, -(-k // G)), across, state, codec, None)
    stats = reduced.stats
    stats.algorithm, stats.n, stats.k = "oktopk2l", n, k
    stats.phases = {"node_reduce_scatter": phase, **stats.phases}
    return _Half(acc, shard, reduced, node, across, limit)


def oktopk2l_gather(h: _Half, comm: Communicator) -> SparseResult:
    """Steps 4-5 of :func:`oktopk2l`: the shard's allgatherv among the nodes, the node's
    all-gather of the shards' results, the owner's residual."""
    inner = oktopk_gather(h.reduced, h.across)
    node, stats, dtype, state = h.node, inner.stats, h.shard.dtype, h.reduced.state
    G, l, m, n = node.size, node.rank, h.shard.numel(), h.acc.numel()
    with PhaseRecorder(comm, stats).phase("node_allgather"):
        indexes, values = inner.indexes, inner.values
        if G > 1:
            # The shards' counts and peaks (float32 bits) in one allgather: the peak bounds the
            # result, so settling the residual (step 5) reads nothing more.
            head = torch.cat([torch.tensor([indexes.numel()], dtype=torch.int64, device=values.device),
                              peak_bits(values.abs()).to(torch.int64)])
            rows = node.allgather(head.to(node.control_device)).reshape(G, 2).tolist()
            counts, peak = [row[0] for row in rows], peak_of([row[1] for row in rows], dtype)
            index_dtype = torch.int32 if m * G < 2**31 else torch.int64
            width = torch.empty((), dtype=index_dtype).element_size()
            idx = (indexes + l * m).to(index_dtype)
            record = torch.cat([idx.reshape(-1, 1).view(torch.uint8), values.reshape(-1, 1).view(torch.uint8)], dim=1)
            got = node.allgatherv(record, counts)
            indexes = got[:, :width].contiguous().view(index_dtype).reshape(-1).to(torch.int64)
            values = got[:, width:].contiguous().view(dtype).reshape(-1)
        else:
            peak = inner.bound
    stats.global_selected = indexes.numel()
    if not state.error_feedback:
        return SparseResult(n=n, indexes=indexes, values=values, contributed=None, sent=h.acc, stats=stats,
                            bound=peak)
    # The owner's residual of its shard: the node's sum less what reached the result (as
    # received; ``sent`` is zero where the selection missed), plus the re-encoding errors.
    left = h.shard.clone() if G == 1 else h.shard  # (G > 1: this call's workspace)
    if inner.contributed is None:
        left.sub_(inner.sent.to(dtype))
    elif inner.contributed.numel():
        kernels.scatter_add(left, inner.contributed, inner.sent, unique=True, subtract=True)
    if inner.kept_idx is not None and inner.kept_idx.numel():
        kernels.scatter_add(left, inner.kept_idx, inner.kept_val, unique=True)
    start = l * m
    end = max(start, min(start + m, n))
    left = left[:end - start]
    if peak is None:
        peak = float(values.abs().max()) if values.numel() else 0.0
    if peak < h.limit:
        # Settled: acc (the residual) becomes the shard's residual, zero elsewhere. (The
        # result cannot be refused for overflow, which would keep acc as it was.)
        h.acc[:start].zero_()
        h.acc[end:].zero_()
        h.acc[start:end].copy_(left)
        return SparseResult(n=n, indexes=indexes, values=values, contributed=None, sent=None, stats=stats,
                            settled=True, bound=peak)
    # A result that may be refused: the update takes acc less this, which leaves the shard's
    # residual (to one rounding) and zero elsewhere; a refusal keeps acc whole.
    sent = h.acc.clone()
    sent[start:end] -= left
    return SparseResult(n=n, indexes=indexes, values=values, contributed=None, sent=sent, stats=stats)


def oktopk2l_traffic(n: int, k: int, P: int, value_bytes: float, ranks_per_node: int = 1,
                     grid: bool = False) -> Traffic:
    """G = ``ranks_per_node`` ranks a node: within the node a dense reduce-scatter in the work
    dtype (ceil(log2 G) messages, 4 n (G - 1) / G bytes) and an all-gather of the shards'
    results (2 (G - 1) messages, 8 k (G - 1) / G bytes and 16 a peer); between nodes Ok-Topk's
    traffic on n/G entries, ceil(k/G) selected, P/G ranks (``grid``: Ok-Topk's grid's). One
    rank a node: Ok-Topk's."""
    G = ranks_per_node
    if G <= 1:
        return oktopk_traffic(n, k, P, value_bytes)
    m, kk, nodes = -(-n // G), -(-k // G), P // G
    across = (Traffic(0.0, 0.0) if nodes <= 1 else
              (oktopk2d_traffic if grid else oktopk_traffic)(m, kk, nodes, value_bytes))
    return Traffic(across.messages, across.bytes, math.ceil(math.log2(G)) + 2.0 * (G - 1),
                   4.0 * n * (G - 1) / G + 8.0 * kk * (G - 1) + 16.0 * (G - 1))


@register("oktopk2l", OkTopkTwoLevelState, split=(oktopk2l_reduce, oktopk2l_gather), volume=oktopk2l_volume,
          traffic=oktopk2l_traffic, global_k=True)
def oktopk2l(acc: torch.Tensor, k: int, comm: Communicator, state: OkTopkTwoLevelState,
             codec: Compressor, preselected: Preselection | None = None, *, limit: float = math.inf) -> SparseResult:
    """Two-level Ok-Topk on nodes of G ranks: a dense reduce-scatter within the node, Ok-Topk
    between nodes on each shard (P/G ranks, n/G entries, k/G selected), the shards' results
    gathered within the node.

    1. The levels (:func:`node_levels`): the node's G ranks, and the P/G ranks holding
       the same shard on every node.
    2. Node reduce-scatter: local rank l gets shard l (m = ceil(n/G) entries, the last
       padded with zeros) of the sum of its node's accumulators.
    3. Ok-Topk among the nodes on the shard, with ceil(k/G) entries: local selection,
       boundaries, split and reduce, global selection (this state's thresholds); with
       ``state.grid`` its exchanges in two hops on a grid of the nodes.
    4. Its allgatherv among the nodes; then every shard's result to the whole node: an
       allgather of counts and an allgatherv of (index, value) records, in shard order,
       so the indexes come sorted.
    5. Residual: every rank gave its whole accumulator; the owner of shard l keeps the
       shard's residual (the node's sum less what reached the result, plus the
       re-encoding errors of its values), written into ``acc`` (the residual) when the
       result is bounded below ``limit`` (settled), else left to the update.

    Args and Returns: those of :func:`~sparsecomm.algorithms.oktopk.oktopk`; ``codec``
    applies to the values between nodes (the node's sums travel in the work dtype).
    """
    return oktopk2l_gather(oktopk2l_reduce(acc, k, comm, state, codec, preselected, limit=limit), comm)
