"""Digests of every algorithm's results and residuals over a run: compare two revisions bit for bit.

For every registered algorithm, world sizes 1, 3, 5 (merged parts) and 9, 12
(the region accumulator), compressors none, fp16 and q8: 40 error-feedback
calls on a drifting gradient with a jump, then one ``sparse_allreduce``; one
SHA-256 prefix per rank of every result, residual, index, value, contributed
set and sent value. Run it on two revisions and ``diff`` the outputs (set
``SPARSECOMM_KERNELS=torch`` for the torch kernel path)::

    PYTHONPATH=/path/to/old python benchmarks/bit_for_bit.py > old.txt
    PYTHONPATH=/path/to/new python benchmarks/bit_for_bit.py > new.txt
"""

from __future__ import annotations

import hashlib

import torch

import sparsecomm
from sparsecomm.comm.sim import simulate


def digests(algorithm: str, P: int, compressor: str | None, n: int = 6000, calls: int = 40) -> list[str]:
    """Per rank, a digest of everything the run produced."""
    def rank_fn(rank: int) -> str:
        gen = torch.Generator().manual_seed(100 + rank)
        g = torch.randn(n, generator=gen)
        st = sparsecomm.registry.get(algorithm).state_class(0.02, error_feedback=True)
        h = hashlib.sha256()
        for i in range(calls):
            g.mul_(0.9).add_(torch.randn(n, generator=gen), alpha=0.1)
            if i == 17:
                g[5] += 50.0  # a jump: thresholds move, buffers overflow
            out = sparsecomm.allreduce(g, state=st, compressor=compressor)
            h.update(out.numpy().tobytes())
            h.update(st.residual.numpy().tobytes())
        r = sparsecomm.sparse_allreduce(g, state=st, compressor=compressor)
        for t in (r.indexes, r.values, r.contributed, r.sent):
            if t is not None:
                h.update(t.numpy().tobytes())
        return h.hexdigest()[:16]

    return simulate(P, rank_fn).results


def main() -> None:
    for algorithm in sparsecomm.registry.names():
        for P in (1, 3, 5, 9, 12):
            for compressor in (None, "fp16", "q8"):
                n = 6000 if P <= 5 else 20000
                print(algorithm, P, compressor, " ".join(digests(algorithm, P, compressor, n)), flush=True)


if __name__ == "__main__":
    main()
