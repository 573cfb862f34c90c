"""Write whole pickles of the DDP hook's state (a user's ``pickle.dump(state)``) with the code of
the checkout it runs from.

    python tests/data/make_hook_pickles.py tests/data/hook_pickles_<revision>.pkl

Each rank of a simulated world of 2 drives :class:`sparsecomm.hooks.SparseHookState` through
steps that leave every part of its memory: a held layout with its Ok-Topk state and residuals,
a residual parked when its layout was dropped, the carried results of a refused step. It pickles
the state, then makes two more steps. The fixture holds each rank's pickle, its residuals and
carried results, the gradients of those steps and their results. A later revision unpickles the
state (its parameters are named by ``id`` in the process that pickled it, so it goes on through
its ``state_dict()`` in a hook of a new model) and makes the same steps: the same results, bit
for bit (``tests/test_hooks.py``).
"""

import pickle
import sys

import torch

import sparsecomm
from sparsecomm.hooks import SparseHookState, sparse_allreduce_hook

SIZES = (600, 400, 200)


class Bucket:
    """The part of ``dist.GradBucket`` the hook reads."""

    def __init__(self, params, grads, index, last):
        self._params, self._index, self._last = params, index, last
        self._buffer = torch.cat([g.reshape(-1) for g in grads])

    def buffer(self):
        return self._buffer

    def parameters(self):
        return self._params

    def index(self):
        return self._index

    def is_last(self):
        return self._last


def grads(rank: int, step: int) -> list:
    gen = torch.Generator().manual_seed(1000 * rank + step)
    return [torch.randn(n, generator=gen) for n in SIZES]


def run_step(state, params, g, buckets) -> list:
    """One step of ``buckets`` (parameter positions each), in order; the results or the error."""
    futures = [sparse_allreduce_hook(state, Bucket([params[i] for i in b], [g[i] for i in b], k, k == len(buckets) - 1))
               for k, b in enumerate(buckets)]
    out = []
    for f in futures:
        try:
            out.append(f.wait().clone())
        except sparsecomm.InputError as exc:
            out.append(type(exc).__name__)
    return out


def steps_after():
    """The two steps a resumed state makes: DDP's rebuilt buckets."""
    return [[(1,), (2, 0)], [(1,), (2, 0)]]


def rank_run(rank: int) -> dict:
    params = [torch.nn.Parameter(torch.zeros(n)) for n in SIZES]
    model = torch.nn.Module()
    model.ps = torch.nn.ParameterList(params)
    state = SparseHookState(model, "oktopk", 0.05, min_bucket_elements=500)
    run_step(state, params, grads(rank, 0), [(0, 1, 2)])  # one layout of all three, its residuals
    bad = grads(rank, 1)
    bad[1][5] = float("nan") if rank == 1 else bad[1][5]
    # DDP's rebuilt buckets become layouts; (0, 1, 2)'s residuals go to them. (1,) is small, so
    # dense: it would send 1's residual, but it is refused on every rank, so the residual stays
    # parked, and the result of (2, 0), which went through, is carried.
    run_step(state, params, bad, [(1,), (2, 0)])
    blob, residuals, carried = pickle.dumps(state), state.residuals(), state.carried()
    after = [grads(rank, 3 + s) for s in range(len(steps_after()))]
    results = [run_step(state, params, g, b) for g, b in zip(after, steps_after())]
    return {"pickle": blob, "residuals": residuals, "carried": carried, "grads": after, "results": results}


def main(path: str) -> None:
    ranks = sparsecomm.simulate(2, rank_run, timeout=60).results
    with open(path, "wb") as f:
        pickle.dump({"sizes": SIZES, "steps": steps_after(), "ranks": ranks}, f)


if __name__ == "__main__":
    main(sys.argv[1])
