"""The sparse reduce-scatter: exact union, or padded (an index may repeat with a zero sum)."""

from __future__ import annotations

import pytest
import torch

from sparsecomm import kernels
from sparsecomm.algorithms.exchange import equal_boundaries, split_and_reduce
from sparsecomm.comm.sim import current_sim_comm, simulate
from sparsecomm.compress import get_compressor

N = 5000


def _parts(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A sorted selection that overlaps every other rank's (the multiples of 7 below 700) and
    holds an exact cancellation with the next rank at index 1."""
    gen = torch.Generator().manual_seed(rank)
    idx = torch.cat([torch.arange(0, 700, 7), torch.randperm(N - 700, generator=gen)[:300] + 700,
                     torch.tensor([1])]).unique()
    vals = torch.randn(idx.numel(), generator=gen)
    vals[idx == 1] = 1.0 if rank % 2 == 0 else -1.0
    return idx, vals


@pytest.mark.parametrize("P", [2, 3, 9])
def test_the_padded_union_is_the_union_with_zero_sums_at_its_repeats(P):
    def body(rank):
        comm = current_sim_comm()
        idx, vals = _parts(rank)
        codec = get_compressor(None, torch.float32).for_call(rank, 0)
        starts = equal_boundaries(N, P, idx.device).tolist()
        index_dtype = kernels.index_dtype_for(N)
        exact = split_and_reduce(idx, codec.encode_shared(comm, vals), starts, comm, index_dtype,
                                 torch.float32, 2)
        # The GPU's path (a region accumulator) at every P: the one that pads.
        with kernels.dispatch.gpu_path():
            padded = split_and_reduce(idx, codec.encode_shared(comm, vals), starts, comm, index_dtype,
                                      torch.float32, 2, padded=True)
        return exact, padded

    for (rel, sums), (prel, psums) in simulate(P, body).results:
        assert torch.equal(prel, prel.sort().values)
        first = torch.ones_like(prel, dtype=torch.bool)
        first[1:] = prel[1:] != prel[:-1]
        assert torch.equal(prel[first], rel)  # the union, in order
        assert torch.equal(psums[first], sums)  # the same sums, bit for bit
        assert bool((psums[~first] == 0).all())  # every repeat carries zero
        if P > 1 and 0 in rel.tolist():
            assert (~first).any()  # the shared multiples of 7 did repeat
