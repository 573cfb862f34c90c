"""Write a checkpoint fixture with the code of the checkout it runs from.

    python tests/data/make_states.py tests/data/states_<revision>.pt

For every registered algorithm, on a simulated world of 2 ranks: three error-feedback
calls (density 2%, op="avg"), then the state as saved before a fourth call, and digests
of the fourth call's result and of each rank's residual after it. A later revision that
loads the file and makes the fourth call must give the same digests
(``tests/promises/test_checkpoints.py``).
"""

import copy
import hashlib
import sys

import torch

import sparsecomm


def grad(rank: int, step: int, n: int = 1000) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(n, generator=g) * (1 + (torch.arange(n) % 7 == 0) * 5)


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().numpy().tobytes()).hexdigest()


def main(path: str) -> None:
    out = {}
    for alg in sparsecomm.algorithms():
        def body(rank: int):
            st = sparsecomm.registry.get(alg).state_class(0.02, error_feedback=True)
            for step in range(3):
                sparsecomm.allreduce(grad(rank, step), state=st, op="avg")
            saved = copy.deepcopy(st)
            res = sparsecomm.allreduce(grad(rank, 3), state=st, op="avg")
            return saved, res, st.residual.clone()

        results = sparsecomm.simulate(2, body).results
        out[alg] = {"states": [r[0] for r in results], "result": digest(results[0][1]),
                    "residuals": [digest(r[2]) for r in results]}
    torch.save(out, path)


if __name__ == "__main__":
    main(sys.argv[1])
