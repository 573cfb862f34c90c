"""Test bodies shared by every backend (simulated, gloo, MPI).

Written once, valid at any world size: expected values derive from rank and
size. ``check_comm`` asserts communicator semantics; ``allreduce_cases``
returns results that the engine tests compare with the simulated world's.
"""

from __future__ import annotations

from typing import Any

import torch

import sparsecomm
from sparsecomm.comm import Communicator
from sparsecomm.errors import InputError


def check_comm(comm: Communicator) -> dict:
    """Assert every communicator operation's result; return the traffic counters."""
    P, r = comm.size, comm.rank
    g = comm.allgather(torch.tensor([r, r * r]))
    assert g.tolist() == [[i, i * i] for i in range(P)], g

    counts = _allgatherv_counts(P)  # includes ranks sending nothing
    mine = torch.full((counts[r], 2), float(r), dtype=torch.bfloat16)
    v = comm.allgatherv(mine, counts)
    expected = torch.cat([torch.full((counts[i], 2), float(i), dtype=torch.bfloat16) for i in range(P)])
    assert torch.equal(v, expected), v

    a = comm.alltoall((torch.arange(P) * 100 + r).reshape(P, 1))
    assert a.flatten().tolist() == [100 * r + i for i in range(P)], a

    # alltoallv: rank i sends (i + 2 j) % 3 bytes of value 16 i + j to rank j (some parts empty).
    def part(i: int, j: int) -> list[int]:
        return [(16 * i + j) % 256] * ((i + 2 * j) % 3)

    for window in (None, 2):
        send = torch.tensor(sum((part(r, j) for j in range(P)), []), dtype=torch.uint8)
        got = comm.alltoallv(send, [len(part(r, j)) for j in range(P)], [len(part(i, r)) for i in range(P)],
                             window=window)
        assert got.tolist() == sum((part(i, r) for i in range(P)), []), got

    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64):
        x = torch.tensor([r + 1, -r, 2 * r], dtype=dtype)
        assert comm.allreduce(x, "sum").tolist() == [P * (P + 1) // 2, -P * (P - 1) // 2, P * (P - 1)]
        assert comm.allreduce(x, "max").tolist() == [P, 0, 2 * (P - 1)]
        assert comm.allreduce(x, "min").tolist() == [1, -(P - 1), 0]
        assert x.tolist() == [r + 1, -r, 2 * r]  # input untouched
        into = torch.full_like(x, 99)  # out=: written there, input untouched
        assert comm.allreduce(x, "max", out=into) is into and into.tolist() == [P, 0, 2 * (P - 1)]
        assert x.tolist() == [r + 1, -r, 2 * r]
        assert comm.allreduce(x, "sum", out=x) is x  # in place
        assert x.tolist() == [P * (P + 1) // 2, -P * (P - 1) // 2, P * (P - 1)]

    rs = comm.reduce_scatter(torch.arange(2 * P, dtype=torch.float32) + r)
    assert rs.tolist() == [P * (2 * r + j) + P * (P - 1) / 2 for j in range(2)], rs
    # Floats whose sum depends on its order: rank order (q = 0, 1, ...), as the simulated world
    # and gloo's point-to-point reduce-scatter take it (MPI may take another: close then).
    xs = [torch.randn(5 * P, generator=torch.Generator().manual_seed(q)) for q in range(P)]
    want = xs[0][5 * r:5 * r + 5].clone()
    for q in range(1, P):
        want += xs[q][5 * r:5 * r + 5]
    rs = comm.reduce_scatter(xs[r])
    assert torch.equal(rs, want) or (comm.name == "mpi" and torch.allclose(rs, want)), (rs, want)
    into = torch.full((5,), 99.0)  # out=: written there, the input untouched
    assert comm.reduce_scatter(xs[r], out=into) is into and torch.equal(into, rs)
    assert torch.equal(xs[r], torch.randn(5 * P, generator=torch.Generator().manual_seed(r)))
    ag = comm.allgather_dense(torch.tensor([r, -r], dtype=torch.float32))
    assert ag.tolist() == [float(s * i) for i in range(P) for s in (1, -1)], ag
    into = torch.full((2 * P,), 99.0)
    assert comm.allgather_dense(torch.tensor([r, -r], dtype=torch.float32), out=into) is into
    assert torch.equal(into, ag)
    for bad in (torch.empty(3), torch.empty(5, dtype=torch.float64)):  # wrong length, wrong dtype
        try:
            comm.reduce_scatter(xs[r], out=bad)
        except ValueError as e:
            assert "out=" in str(e)
        else:
            raise AssertionError("reduce_scatter took a wrong out=")

    root = P - 1
    b = comm.broadcast(torch.tensor([r, 7], dtype=torch.float16), root)
    assert b.tolist() == [root, 7], b

    if P > 1:  # a ring in both directions with distinct tags
        nxt, prv = (r + 1) % P, (r - 1) % P
        up = torch.empty(3, dtype=torch.bfloat16)
        down = torch.empty(2, dtype=torch.int64)
        reqs = [comm.irecv(up, prv, tag=5), comm.irecv(down, nxt, tag=6),
                comm.isend(torch.full((3,), float(r), dtype=torch.bfloat16), nxt, tag=5),
                comm.isend(torch.tensor([r, P]), prv, tag=6)]
        for q in reqs:
            q.wait()
        assert up.tolist() == [float(prv)] * 3 and down.tolist() == [nxt, P]
    # split: the odd and the even ranks (keys in rank order, which torch.distributed's groups
    # keep), their traffic counted as this rank's.
    before = comm.stats.bytes_sent
    part = comm.split(r % 2, 10 * r)
    mates = [q for q in range(P) if q % 2 == r % 2]
    assert (part.size, part.rank) == (len(mates), mates.index(r)), (part.size, part.rank)
    assert part.allgather(torch.tensor([r])).reshape(-1).tolist() == mates
    assert part.allreduce(torch.tensor([float(r)])).item() == sum(mates)
    if part.size > 1:
        got = torch.empty(1, dtype=torch.int64)
        reqs = [part.irecv(got, (part.rank + 1) % part.size, tag=7),
                part.isend(torch.tensor([r]), (part.rank - 1) % part.size, tag=7)]
        for q in reqs:
            q.wait()
        assert got.item() == mates[(part.rank + 1) % part.size]
        assert part.stats is comm.stats and comm.stats.bytes_sent > before
    comm.barrier()
    stats = comm.stats.as_dict()
    if P > 1:
        assert stats["bytes_sent"] > 0 and stats["messages_sent"] > 0
    return stats


def _allgatherv_counts(size: int) -> list[int]:
    return [i % 3 for i in range(size)]


def inputs(rank: int, n: int, kind: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    gen = torch.Generator().manual_seed(12345 + 7919 * rank)
    if kind == "skewed":
        g = 0.01 * torch.randn(n, generator=gen)
        g[: n // 10] = torch.randn(n // 10, generator=gen)
    else:
        g = torch.randn(n, generator=gen)
    return g.to(dtype)


def allreduce_cases(rank: int, size: int, comm=None) -> dict[str, torch.Tensor]:
    """A representative subset of allreduce calls; returns named results."""
    out: dict[str, torch.Tensor] = {}
    n = 30_011
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        out[f"oktopk/exact/{dtype}"] = sparsecomm.allreduce(inputs(rank, n, "gaussian", dtype), 0.01, comm=comm)
    st = sparsecomm.OkTopkState(0.01, tau=3, tau_prime=4, error_feedback=True)
    for step in range(6):
        out[f"oktopk/ef/step{step}"] = sparsecomm.allreduce(inputs(rank + step, n, "gaussian"), state=st, comm=comm)
    out["oktopk/ef/residual"] = st.residual.clone()
    eq = sparsecomm.OkTopkState(0.01, tau=1, tau_prime=1, error_feedback=False, balanced=False)
    out["oktopk/equal-split-skewed"] = sparsecomm.allreduce(inputs(rank, n, "skewed"), state=eq, comm=comm)
    out["oktopk/avg"] = sparsecomm.allreduce(inputs(rank, 999, "gaussian").reshape(27, 37), 0.05, op="avg", comm=comm)
    out["dense"] = sparsecomm.allreduce(inputs(rank, n, "gaussian"), algorithm="dense", comm=comm)
    st = sparsecomm.DenseState(error_feedback=True)
    for step in range(3):  # from the second call on: the fused accumulation, settled while encoding
        out[f"dense/q8/step{step}"] = sparsecomm.allreduce(inputs(rank + step, n, "gaussian"), state=st,
                                                           algorithm="dense", compressor="q8", comm=comm)
    out["dense/q8/residual"] = st.residual.clone()
    out["dense/q4/avg"] = sparsecomm.allreduce(inputs(rank, n, "gaussian"), algorithm="dense", compressor="q4",
                                               op="avg", comm=comm)
    for name in ("oktopk", "topka", "dense"):  # float8 values, one scale agreed by every rank
        st = sparsecomm.registry.get(name).state_class(0.01 if name != "dense" else 1.0, error_feedback=True)
        for step in range(2):
            out[f"{name}/fp8/step{step}"] = sparsecomm.allreduce(inputs(rank + step, n, "skewed"), state=st,
                                                                 compressor="fp8", comm=comm)
        out[f"{name}/fp8/residual"] = st.residual.clone()
    for name in [a for a in sparsecomm.algorithms() if a not in ("dense", "oktopk")]:
        # (two-level Ok-Topk in nodes of two where it can: G = 2 sums commute, so every engine
        # agrees bit for bit; and never from the launcher's variables, which differ by engine)
        node = {"ranks_per_node": 2 if size % 2 == 0 else 1} if name == "oktopk2l" else {}
        st = sparsecomm.registry.get(name).state_class(0.01, error_feedback=True, **node)
        for step in range(2):
            out[f"{name}/step{step}"] = sparsecomm.allreduce(inputs(rank + step, n, "skewed"), state=st, comm=comm)
        out[f"{name}/residual"] = st.residual.clone()
    # Between one-rank nodes on a grid of the nodes (2 x 2 at P = 4): a grid over a split.
    st = sparsecomm.OkTopkTwoLevelState(0.01, ranks_per_node=1, grid=True)
    for step in range(2):
        out[f"oktopk2l/grid/step{step}"] = sparsecomm.allreduce(inputs(rank + step, n, "skewed"), state=st, comm=comm)
    out["topkdsa/dense-switch"] = sparsecomm.allreduce(inputs(rank, 3001, "gaussian"), 0.7,
                                                       algorithm="topkdsa", comm=comm)
    # Messages over several 65536-wide blocks (kernels.message), blocked and plain side by side:
    # rank 0 holds two nonzeros, too few for a header to pay.
    m = 200_003
    mixed = inputs(rank, m, "skewed") if rank else torch.zeros(m).index_fill_(0, torch.tensor([5, 150_000]), 1.0)
    for name in ("topka", "oktopk", "topkdsa"):
        out[f"{name}/mixed-messages"] = sparsecomm.allreduce(mixed, 0.01, algorithm=name, comm=comm)
    return out


def bad_input_cases(rank: int, size: int, comm=None) -> dict[str, str]:
    """Each bad call must raise InputError on every rank; returns the messages by case.

    One rank differing from the others (the last, or rank 0/1) is the hard
    case: that rank alone knows, and its peers must not be left waiting.
    """
    last = rank == size - 1

    def ok(n=10):
        return torch.randn(n, generator=torch.Generator().manual_seed(rank))

    def restored_state(iteration):  # as if ranks resumed from different checkpoints
        st = sparsecomm.OkTopkState(0.1, tau=2)
        st.iteration = iteration
        return st

    def steady(algorithm):  # a state whose next call carries the check in its first exchange
        st = sparsecomm.registry.get(algorithm).state_class(0.1)
        for step in range(3):
            sparsecomm.allreduce(ok(1000) + step, state=st, comm=comm)
        return st

    def steady_nan():
        g = ok(1000)
        g[7] = float("nan") if rank == 1 else g[7]
        return sparsecomm.allreduce(g, state=steady("oktopk"), comm=comm)

    def steady_algorithm():
        ok_state, topka_state = steady("oktopk"), steady("topka")
        return sparsecomm.allreduce(ok(1000), state=topka_state if last else ok_state, comm=comm)

    calls = {
        "integer": lambda: sparsecomm.allreduce(torch.arange(10) if rank == 0 else ok(), 0.1, comm=comm),
        "numel": lambda: sparsecomm.allreduce(ok(10 + last), 0.1, comm=comm),
        "dtype": lambda: sparsecomm.allreduce(ok().to(torch.float16 if rank else torch.float32), 0.1, comm=comm),
        "density0": lambda: sparsecomm.allreduce(ok(), 0.0, comm=comm),
        "density1.5": lambda: sparsecomm.allreduce(ok(), 1.5, comm=comm),
        "nan": lambda: sparsecomm.allreduce(torch.tensor([1.0, float("nan")]) if rank == 1 else torch.ones(2),
                                            0.5, comm=comm),
        "meta": lambda: sparsecomm.allreduce(torch.empty(10, device="meta") if rank == 0 else ok(), 0.5, comm=comm),
        "op": lambda: sparsecomm.allreduce(ok(), 0.5, op="avg" if last else "sum", comm=comm),
        "density-vs-state": lambda: sparsecomm.allreduce(ok(), 0.2 if last else 0.1,
                                                         state=sparsecomm.OkTopkState(0.1), comm=comm),
        "tau": lambda: sparsecomm.allreduce(ok(), state=sparsecomm.OkTopkState(0.1, tau=4 if last else 2),
                                            comm=comm),
        "iteration": lambda: sparsecomm.allreduce(ok(), state=restored_state(7 if last else 6), comm=comm),
        "compressor": lambda: sparsecomm.allreduce(ok(), 0.5, compressor="q8" if last else None, comm=comm),
        "steady nan": steady_nan,
        "steady algorithm": steady_algorithm,
    }
    # Every rank must be told which rank is at fault, or every rank's value.
    names_the_rank = {
        "integer": "bad input on rank 0: unsupported dtype",
        "numel": f"elements per rank: {[10] * (size - 1) + [11]}",
        "dtype": f"per rank: {['torch.float32'] + ['torch.float16'] * (size - 1)}",
        "density0": "bad input on " + ", ".join(f"rank {i}: invalid density" for i in range(size)),
        "meta": "bad input on rank 0: tensor on a device the communicator cannot use",
        "op": f"per rank: {['sum'] * (size - 1) + ['avg']}",
        "density-vs-state": f"bad input on rank {size - 1}: state does not fit the call",
        "tau": f"(rank {rank} has tau={4 if last else 2})",
        "iteration": f"(rank {rank} has iteration={7 if last else 6})",
    }
    msgs = {}
    for name, call in calls.items():
        try:
            call()
        except sparsecomm.InputError as exc:
            msgs[name] = str(exc)
        else:
            raise AssertionError(f"bad input {name!r} was accepted")
        if name in names_the_rank:
            assert names_the_rank[name] in msgs[name], (rank, name, msgs[name])
    return msgs


def check_bad_input_messages(msgs: dict[str, str]) -> None:
    """What every rank must have been told for each case of :func:`bad_input_cases`."""
    expected = {
        "integer": "unsupported dtype", "numel": "element count differs", "dtype": "dtype differs",
        "density0": "density", "density1.5": "density", "nan": "NaN or Inf on rank(s) [1]",
        "meta": "device the communicator cannot use", "op": "op differs across ranks (per rank: [",
        "density-vs-state": "state does not fit the call", "tau": "settings differ across ranks: tau",
        "iteration": "settings differ across ranks: iteration", "compressor": "compressor differs",
        "steady nan": "NaN or Inf on rank(s) [1]", "steady algorithm": "algorithm differs",
    }
    assert msgs.keys() == expected.keys(), msgs.keys()
    for name, words in expected.items():
        assert words in msgs[name], (name, msgs[name])


def engine_cases(rank: int, size: int, comm=None) -> dict[str, Any]:
    """Jobs on an asynchronous engine, raced by the caller's own collectives on the same ranks.

    Returns, by name: every job's result, the same calls made synchronously
    afterwards (they must be equal bit for bit), and what a bad job raised.
    """
    from sparsecomm.errors import InputError
    from sparsecomm.schedules import Engine

    n = 2003
    engine = Engine(comm=comm)
    user = sparsecomm.resolve(comm=comm)
    out: dict[str, Any] = {}
    plan = [("oktopk", "avg", None), ("topka", "sum", None), ("dense", "sum", "q8"), ("gtopk", "avg", "fp16")]
    states = {name: sparsecomm.registry.get(name).state_class(0.02, error_feedback=True) for name, _, _ in plan}
    jobs = []
    for step in range(3):
        for name, op, compressor in plan:
            g = inputs(rank + 7 * step, n, "skewed")
            jobs.append((f"{name}/{step}", engine.submit(g, state=states[name], op=op, compressor=compressor)))
        # The caller's own collectives on the user's communicator while the jobs run.
        out[f"caller/{step}"] = sparsecomm.allreduce(inputs(rank, 501, "gaussian"), 0.1, comm=user)
    for key, job in jobs:
        out[f"job/{key}"] = job.wait()
    # A job bad on one rank fails on every rank; the engine goes on.
    bad = torch.full((n,), float("nan")) if rank == size - 1 else inputs(rank, n, "gaussian")
    try:
        engine.submit(bad, density=0.1).wait()
        out["bad"] = "no error"
    except InputError as exc:
        out["bad"] = str(exc)
    out["after_bad"] = engine.submit(inputs(rank, n, "gaussian"), density=0.1).wait()
    engine.close()
    # The same calls, synchronously and in the same order, for the expected values.
    states = {name: sparsecomm.registry.get(name).state_class(0.02, error_feedback=True) for name, _, _ in plan}
    for step in range(3):
        for name, op, compressor in plan:
            g = inputs(rank + 7 * step, n, "skewed")
            out[f"sync/{name}/{step}"] = sparsecomm.allreduce(g, state=states[name], op=op,
                                                              compressor=compressor, comm=user)
    out["sync/after_bad"] = sparsecomm.allreduce(inputs(rank, n, "gaussian"), 0.1, comm=user)
    return out


def check_engine_cases(results: list[dict[str, Any]]) -> None:
    for rank, out in enumerate(results):
        for key, value in out.items():
            if key.startswith("job/"):
                assert torch.equal(value, out["sync/" + key[4:]]), (rank, key)
                assert torch.equal(value, results[0][key]), (rank, key)  # every rank the same
        assert torch.equal(out["after_bad"], out["sync/after_bad"])
        assert "NaN or Inf on rank(s) [%d]" % (len(results) - 1) in out["bad"], out["bad"]
        assert torch.equal(out["caller/2"], results[0]["caller/2"])


def oktopk_reuse_cases(rank: int, size: int, comm=None) -> dict:
    """Ok-Topk reusing its thresholds on a shrinking, drifting gradient (the global rungs).

    Returns each call's result, the residual, the thresholds after each call, and the
    global events seen, so a caller can check the rungs were exercised.
    """
    from sparsecomm.tools.synthetic import drifting

    n, calls = 20_011, 14
    grads = drifting(rank, n, shrink=0.97, shared_scale=True)
    st = sparsecomm.OkTopkState(0.01, tau=100, tau_prime=100)
    out: dict = {"thresholds": [], "events": set()}
    for t in range(calls):
        out[f"step{t}"] = sparsecomm.allreduce(next(grads), state=st, comm=comm)
        out["thresholds"].append((st.local_threshold, st.global_threshold))
        out["events"] |= {e for e in st.last.events if e.startswith("global")}
    out["residual"] = st.residual.clone()
    return out


def input_error(fn: Any, *args: Any, **kwargs: Any) -> str | None:
    """The message of the InputError that ``fn(*args, **kwargs)`` raises, or None if it returns."""
    try:
        fn(*args, **kwargs)
    except InputError as exc:
        return str(exc)
    return None
