"""Modelled times and traffic of the sparse algorithms in the simulated world: compare two revisions.

For Ok-Topk, TopkDSA, TopkA and Gaussiank at P = 2 ... 64: four error-feedback calls on a
drifting gradient (n = 20,011 a rank, density 1%) with the ``pizdaint`` network model; one
line per run with every rank's modelled clock (``repr``: to the bit) and its bytes and
messages sent and received. Run it on two revisions and ``diff`` the outputs::

    PYTHONPATH=/path/to/old python benchmarks/modelled_times.py > old.txt
    PYTHONPATH=/path/to/new python benchmarks/modelled_times.py > new.txt
"""

from __future__ import annotations

import torch

import sparsecomm


def body(rank: int, algorithm: str, n: int) -> None:
    st = sparsecomm.registry.get(algorithm).state_class(0.01, error_feedback=True)
    gen = torch.Generator().manual_seed(rank)
    g = torch.randn(n, generator=gen)
    for _ in range(4):
        g = 0.9 * g + 0.1 * torch.randn(n, generator=gen)
        sparsecomm.allreduce(g, algorithm=algorithm, state=st)


def main() -> None:
    for algorithm in ["oktopk", "topkdsa", "topka", "gaussiank"]:
        for P in [2, 3, 5, 8, 9, 12, 16, 33, 64]:
            r = sparsecomm.simulate(P, body, algorithm, 20011, network="pizdaint", timeout=600)
            print(algorithm, P, " ".join(repr(t) for t in r.time),
                  " ".join(f"{s['bytes_received']},{s['messages_received']},{s['bytes_sent']},{s['messages_sent']}"
                           for s in r.stats), flush=True)


if __name__ == "__main__":
    main()
