"""Ok-Topk with a state: threshold reuse, corrections, boundaries, wide indexes, statistics."""

from __future__ import annotations

import copy
import math

import pytest
import torch

import sparsecomm
from sparsecomm import kernels
from sparsecomm.check import row_words
from sparsecomm.tools.synthetic import digits_gradients, drifting, gradient, repeating

from reference import ref_oktopk


def run_steps(P, n, steps, kind, **state_kw):
    def body(rank):
        st = sparsecomm.OkTopkState(0.01, **state_kw)
        rows = []
        for s in range(steps):
            sparsecomm.allreduce(gradient(rank, s, n, kind), state=st)
            rows.append((st.last.local_selected, st.last.global_selected, dict(st.last.events)))
        return rows, st

    return sparsecomm.simulate(P, body).results


_EXACT = ("local_corrected", "local_recomputed", "local_overflowed", "local_estimate_fallback",
          "global_corrected", "global_recomputed", "global_under")


@pytest.mark.parametrize("P", [1, 3, 5])
@pytest.mark.parametrize("workload", ["drift", "repeat", "model", "digits"])
def test_reused_thresholds_hold_the_bounds_without_exact_selections(workload, P):
    # After a warm-up, every call that reuses thresholds keeps its local and global counts
    # within [2k/3, 4k/3] with a mean near k, and selects nothing exactly: on a gradient that
    # drifts, one whose noise repeats every 4 calls (the residual grows steadily), the layered
    # synthetic model, and a real MLP trained on digits over fixed batches.
    calls, warmup, n = 40, 10, 30_000
    recorded = digits_gradients(P, calls, width=160) if workload == "digits" else None

    def body(rank):
        grads = {"drift": lambda: drifting(rank, n), "repeat": lambda: repeating(rank, n),
                 "model": lambda: (gradient(rank, t, n) for t in range(calls)),
                 "digits": lambda: iter(recorded[rank])}[workload]()
        st = sparsecomm.OkTopkState(0.01)  # tau = 32: call 33 re-evaluates
        rows = []
        for t, g in enumerate(grads):
            if t == calls:
                break
            sparsecomm.allreduce(g, state=st)
            if t >= warmup and t % st.tau:
                rows.append((st.last.local_selected / st.last.k, st.last.global_selected / st.last.k,
                             sorted(set(st.last.events) & set(_EXACT)), st.last.k))
        return rows

    for rows in sparsecomm.simulate(P, body).results:
        k = rows[0][3]
        assert not [r for r in rows if r[2]], [r[2] for r in rows]
        for side in (0, 1):
            counts = [r[side] * k for r in rows]
            assert all(math.ceil(2 * k / 3) <= c <= 4 * k // 3 for c in counts), (side, counts)
            assert 0.9 <= sum(counts) / len(counts) / k <= 1.1, (side, sum(counts) / len(counts) / k)


def test_reused_thresholds_keep_counts_near_k_on_drifting_gradients():
    n, P = 50_000, 4
    k = math.ceil(0.01 * n)
    res = run_steps(P, n, 20, "model", tau=32, tau_prime=64)
    for rows, st in res:
        for local, glob, events in rows[1:]:
            assert 2 * k / 3 <= local <= 4 * k / 3
            assert 2 * k / 3 <= glob <= 4 * k / 3
        assert st.totals["local_recomputed"] == 1  # only the first call is exact
        assert st.totals.get("repartitioned") == 1


def test_estimated_local_threshold_stays_near_k():
    # local_select="estimate": every re-evaluation (each tau calls) takes a sampled
    # threshold; its count is within a few percent of k, and the bounds still hold.
    n, P, tau = 200_000, 3, 4
    k = math.ceil(0.01 * n)
    res = run_steps(P, n, 12, "model", tau=tau, tau_prime=8, local_select="estimate")
    for rows, st in res:
        recomputed = [local for local, _, events in rows if events.get("local_recomputed")]
        assert len(recomputed) >= 12 // tau
        for local in recomputed:
            assert abs(local - k) <= 0.05 * k
        for local, glob, _ in rows:
            assert 2 * k / 3 <= local <= 4 * k / 3 and glob <= 4 * k / 3
    import pickle

    assert pickle.loads(pickle.dumps(res[0][1])).local_select == "estimate"

    # Ties the sample cannot resolve: 1000 entries of 2.0 and 6000 of 1.0 for k = 2000.
    # The estimate lands between them and selects 1000 < 2k/3 every time; the exact
    # fallback must take over in the same call.
    def tied(rank):
        st = sparsecomm.OkTopkState(0.01, tau=2, tau_prime=2, local_select="estimate")
        counts = []
        for _ in range(3):
            g = torch.zeros(n)
            g[:1000] = 2.0
            g[1000:7000] = 1.0
            sparsecomm.allreduce(g, state=st)
            counts.append((st.last.local_selected, st.last.events.get("local_estimate_fallback", 0)))
        return counts

    for counts in sparsecomm.simulate(2, tied).results:
        assert counts[0] == (k, 1) and all(c >= 2 * k / 3 for c, _ in counts)
    try:
        sparsecomm.OkTopkState(0.01, local_select="sampled")
    except ValueError as e:
        assert "local_select" in str(e)
    else:
        raise AssertionError("an unknown local_select was accepted")


def test_far_off_threshold_is_capped_on_random_gradients():
    """The public reference selected 17x k one step after a recompute on random data."""
    n, P = 50_000, 3
    k = math.ceil(0.01 * n)
    res = run_steps(P, n, 10, "gaussian", tau=32, tau_prime=64)
    for rows, st in res:
        assert max(local for local, _, _ in rows) <= math.floor(4 * k / 3)
        assert max(glob for _, glob, _ in rows) <= math.floor(4 * k / 3)
        # the reused threshold was far off: a rung, a correction or a re-selection took over
        assert sum(st.totals.get(e, 0) for e in ("local_moved", "local_corrected", "local_reselected")) >= 1


@pytest.mark.parametrize("steady", [False, True])
def test_stats_account_every_byte(steady):
    P = 5

    def body(rank):
        c = sparsecomm.resolve()
        st = sparsecomm.OkTopkState(0.02) if steady else sparsecomm.OkTopkState(0.02, tau=1, tau_prime=1)
        for step in range(3 if steady else 0):
            sparsecomm.allreduce(gradient(rank, step, 20_000, "gaussian"), state=st)
        before = c.stats.snapshot()
        sparsecomm.allreduce(gradient(rank, 0, 20_000, "gaussian"), state=st)
        delta = c.stats - before
        return st.last, delta

    for last, delta in sparsecomm.simulate(P, body).results:
        phases = {"accumulate", "local_select", "repartition", "split_reduce", "global_select", "allgatherv"}
        assert set(last.phases) == phases
        # Everything but the input check's allgather is attributed to a phase, both ways; a
        # steady call's split carries the check (in its phase), in place of its alltoall.
        assert last.events.get("check_carried", 0) == steady
        check_bytes = 0 if steady else row_words(P) * 8 * (P - 1)  # int64s to and from each peer
        assert last.bytes_sent == delta.bytes_sent - check_bytes
        assert last.bytes_received == delta.bytes_received - check_bytes
        assert last.messages_sent == delta.messages_sent - (0 if steady else P - 1)
        assert sum(p.messages_received for p in last.phases.values()) == delta.messages_received - (0 if steady else P - 1)
        assert last.bytes_received > 0 and last.messages_sent > 0
        assert last.k == 400 and (steady or last.global_selected == 400)
        assert all(p.seconds >= 0 for p in last.phases.values())


def test_wide_index_path_gives_the_same_result(monkeypatch):
    """Regions of 2**31 elements or more switch COO indexes to int64, and messages go
    blocked (16-bit offsets) or plain by their size: force each path here."""
    grads = [torch.randint(-20, 21, (5000,), generator=torch.Generator().manual_seed(r)).float()
             for r in range(3)]

    def body(rank):
        res = sparsecomm.sparse_allreduce(grads[rank], 0.05)
        phases = res.stats.phases
        return res.to_dense(torch.float32), phases["split_reduce"].bytes_received, phases["allgatherv"].bytes_received

    packed = sparsecomm.simulate(3, body).results
    monkeypatch.setattr(kernels.message, "_blocks_pay", lambda counts, spans, index_dtype: counts < 0)
    narrow = sparsecomm.simulate(3, body).results
    monkeypatch.setattr(kernels, "index_dtype_for", lambda span: torch.int64)
    wide = sparsecomm.simulate(3, body).results
    for (w, w_split, w_gather), (n_, n_split, n_gather), (b, b_split, b_gather) in zip(wide, narrow, packed):
        assert torch.equal(w, n_) and torch.equal(b, n_)
        # The wide path was taken: a record's index takes 8 bytes instead of 4 next to
        # its 4-byte value, and the same records travel.
        assert n_gather > 0 and 2 * w_gather == 3 * n_gather
        assert w_split > n_split
        # Blocked: 2-byte offsets and one 4-byte header per message (a region < 65536 wide).
        assert b_gather == n_gather * 6 // 8 + 4 * 2 and b_split < n_split
    assert torch.equal(wide[0][0], ref_oktopk(grads, 0.05))


@pytest.mark.parametrize("P", [2, 3])
def test_world_size_change_repartitions(P):
    # No error feedback: every call selects from g itself, so the cut points are known.
    st = sparsecomm.OkTopkState(0.1, tau=100, tau_prime=100, error_feedback=False)
    g = torch.arange(1.0, 101.0)
    sparsecomm.allreduce(g, state=st)  # P = 1
    assert st.boundaries.tolist() == [0, 100]

    def body(rank):
        mine = copy.deepcopy(st)  # as if every rank resumed from the P = 1 checkpoint
        return sparsecomm.allreduce(g, state=mine), mine

    res = sparsecomm.simulate(P, body).results
    # tau_prime = 100 does not ask for new boundaries at call 2: the world size does. Every
    # rank selects indexes 90..99 (k = 10), so the balanced cut points are 90 + 10 j / P.
    expected = [0] + [90 + 10 * j // P for j in range(1, P)] + [100]
    for out, mine in res:
        assert mine.boundaries.tolist() == expected
        assert mine.last.events.get("repartitioned") == 1
        assert torch.equal(out, ref_oktopk([g] * P, 0.1))


@pytest.mark.parametrize("P", [2, 3, 5, 8])
def test_boundaries_split_the_ranks_selections_together_into_equal_parts(P):
    # Ranks select in very different places (rank r mostly in its own 1/P of the tensor,
    # plus a share everyone selects): averaging each rank's own cut points would not balance.
    from sparsecomm.algorithms.oktopk import _BINS_PER_REGION, _balanced_boundaries

    n = 100_003
    picks = []
    for r in range(P):
        gen = torch.Generator().manual_seed(r)
        own = torch.randint(r * n // P, (r + 1) * n // P, (400 * (r + 1),), generator=gen)
        shared = torch.randint(0, n // 10, (300,), generator=gen)
        picks.append(torch.unique(torch.cat([own, shared])))
    res = sparsecomm.simulate(P, lambda r: _balanced_boundaries(picks[r], n, sparsecomm.comm.resolve())).results
    assert all(torch.equal(b, res[0]) for b in res)  # every rank computes the same cuts
    bounds = res[0].tolist()
    assert bounds[0] == 0 and bounds[-1] == n and bounds == sorted(bounds)
    every = torch.cat(picks)
    T = every.numel()
    B = _BINS_PER_REGION * P
    densest_bin = int(torch.bincount(every * B // n, minlength=B).max())
    for j in range(P):
        got = int(((every >= bounds[j]) & (every < bounds[j + 1])).sum())
        assert abs(got - T / P) <= densest_bin, (j, got, T / P, densest_bin)


# ---- the reused global threshold: rungs, corrections, the lower bound --------------------
def _decaying_run(P, n=100_000, calls=40):
    """x = 0.9 x + 0.1 randn with a shared per-entry scale, shrinking 3% a call (early training)."""
    def body(rank):
        grads = drifting(rank, n, shrink=0.97, shared_scale=True)
        st = sparsecomm.OkTopkState(0.01)
        rows = []
        for _ in range(calls):
            sparsecomm.allreduce(next(grads), state=st)
            rows.append((st.last.local_selected, st.last.global_selected, "global_under" in st.last.events))
        return rows

    return sparsecomm.simulate(P, body).results


@pytest.mark.parametrize("P", [2, 3, 5])
def test_counts_hold_on_a_shrinking_gradient(P):
    # The global threshold reused from the last exact selection once selected 0.005 k on
    # every other call here; the local one, after a trend taken from an extrapolated
    # estimate, 0.17-0.21 k. The global count is now held within the bounds on every call,
    # unless the ranks' local selections together hold fewer entries (then it takes them all).
    k = math.ceil(0.01 * 100_000)
    for rows in _decaying_run(P):
        for _, glob, took_all in rows:
            assert glob <= 4 * k / 3 and (glob >= 2 * k / 3 or took_all), [g / k for _, g, _ in rows]
        assert min(local for local, _, _ in rows) >= 0.25 * k, [local / k for local, _, _ in rows]


def test_a_count_below_the_bounds_measures_the_next_threshold():
    # Exceedances crowded just above the reused threshold (as error feedback leaves them):
    # a tail fitted to them is steep, so the extrapolated threshold barely moved and the
    # next call selected 0.3 k again. The threshold is now measured from the data, and the
    # call itself selects again above it (one more read) rather than go on with 0.3 k.
    k, n = 1000, 100_000
    x = torch.rand(n, generator=torch.Generator().manual_seed(3)) * 0.5
    x[:300] = 1.0 + 0.01 * torch.rand(300)  # just above the reused threshold 1.0
    x[300:2300] = torch.linspace(0.7, 0.9, 2000)  # the k-th largest is ~0.83
    x = x[torch.randperm(n, generator=torch.Generator().manual_seed(4))]
    st = sparsecomm.OkTopkState(k / n, tau=100, error_feedback=False)
    st.local_threshold, st.iteration = 1.0, 1  # the second call reuses it
    sparsecomm.allreduce(x, state=st)
    assert "local_reselected" in st.last.events and "local_under" not in st.last.events
    assert 0.9 * k <= st.last.local_selected <= 1.1 * k, st.last.local_selected
    assert 0.9 * k <= int((x.abs() >= st.local_threshold).sum()) <= 1.1 * k, st.local_threshold


def test_an_all_zero_call_makes_the_next_one_select_exactly():
    # Nothing to measure a threshold from: the next call re-evaluates exactly, rather than
    # keep a threshold of ~0 that would take every nonzero entry as a candidate.
    k, n = 100, 10_000
    st = sparsecomm.OkTopkState(k / n, tau=100, error_feedback=False)
    st.local_threshold, st.iteration = 1.0, 1
    sparsecomm.allreduce(torch.zeros(n), state=st)
    assert st.local_stale and st.last.local_selected == 0
    sparsecomm.allreduce(torch.randn(n, generator=torch.Generator().manual_seed(0)), state=st)
    assert "local_recomputed" in st.last.events and st.last.local_selected == k


_T = 1.0  # the reused global threshold in the cases below; k = 100
_S = 1 / 80  # the grid's default spacing: rung j is _T * exp(j * _S), j = -8..8


@pytest.mark.parametrize("P", [1, 2, 3, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("case, levels, want_event, want_threshold, move, want_spacing", [
    # (magnitude, how many) around the reused threshold _T; the rest of the entries are 0.
    # want_threshold: what this call selects at or above; the next call's threshold goes on by
    # half the rungs it moved (``move``).
    ("stays", [(1.2, 30), (1.01, 60), (0.5, 500)], None, _T, 0, _S),
    # Every rung from -2 down counts 110: the nearest of the equally good ones. The total
    # falls from 110 to 50 between two rungs: the grid is too coarse to land near k, it halves.
    ("moves down", [(1.2, 30), (1.01, 20), (0.98, 60), (0.5, 500)], "global_moved", math.exp(-2 * _S), -2,
     _S / 2),
    ("moves up", [(1.2, 50), (1.04, 40), (1.01, 60)], "global_moved", math.exp(_S), 1, _S / 2),
    # Only the outermost rung fits: the data moves fast, so the grid widens.
    ("moves to the edge", [(1.2, 30), (1.109375, 60), (1.095, 100)], "global_moved", math.exp(8 * _S), 8,
     2 * _S),
    # The total jumps from 180 to 30 between two rungs: the grid is too coarse.
    ("corrected", [(1.2, 30), (0.99, 150)], "global_corrected", 0.99, None, _S / 2),
    # Every rung counts 200: k lies beyond the grid, which widens.
    ("beyond the grid", [(1.2, 200)], "global_corrected", 1.2, None, 2 * _S),
    # No threshold could fit, but every nonzero entry together fits under the cap: all of
    # them, the threshold and the grid as they were.
    ("too few", [(1.2, 20)], "global_all", _T, 0, _S),
])
def test_reused_global_threshold_takes_a_rung_or_selects_exactly(P, dtype, case, levels, want_event,
                                                                   want_threshold, move, want_spacing):
    from sparsecomm.algorithms.oktopk import _global_select
    from sparsecomm.state import CallStats

    k, n = 100, 3001
    mag = torch.zeros(n, dtype=dtype)
    # as the rung or the k-th largest lands in this dtype
    want_threshold = float(torch.tensor(want_threshold, dtype=dtype))
    want_next = want_threshold if move is None else want_threshold * math.exp(_S * move / 2)
    if case == "too few":
        want_next = _T
    at = torch.randperm(n, generator=torch.Generator().manual_seed(5))
    start = 0
    for value, count in levels:
        mag[at[start:start + count]] = value
        start += count
    cuts = [r * n // P for r in range(P + 1)]

    def body(rank):
        st = sparsecomm.OkTopkState(0.01, tau=100)
        st.global_threshold = _T
        assert st.global_spacing == _S
        stats = CallStats()
        mask, counts, peak = _global_select(mag[cuts[rank]:cuts[rank + 1]].clone(), k, st, 2,
                                            sparsecomm.comm.resolve(), stats)
        # A reusing call's one read brings the largest reduced magnitude of every rank.
        assert peak == float(mag.max()) or (peak is None and mag.dtype != torch.float32), (peak, mag.dtype)
        return mask, counts, st.global_threshold, stats.events, st.global_spacing

    res = sparsecomm.simulate(P, body).results
    mask = torch.cat([r[0] for r in res])
    if want_event in (None, "global_moved"):  # a threshold: everything at or above it
        want = mag >= torch.tensor(want_threshold, dtype=dtype)
        assert 2 * k / 3 <= int(want.sum()) <= 4 * k / 3
    else:  # the exact top-k, ties to the lower index (all nonzero ones when fewer)
        want = torch.zeros(n, dtype=torch.bool)
        want[kernels.topk_indexes(mag, k, use_abs=True)] = True
    assert torch.equal(mask, want), case
    for rank, (m, counts, th, events, spacing) in enumerate(res):
        assert counts == [int(r[0].sum()) for r in res]
        assert th == want_next
        assert th == res[0][2]  # every rank keeps the same threshold and grid
        assert spacing == want_spacing
        exact = {"global_corrected", "global_recomputed"} & events.keys()
        assert (want_event in events) if want_event else not events, events
        assert len(exact) <= 1 and (want_event in exact or not exact)


@pytest.mark.parametrize("P", [1, 2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_finer_grid_finds_the_next_threshold_without_selecting_exactly(P, dtype):
    # A cliff between two rungs: the first call selects exactly and halves the grid's spacing.
    # The next call's count jumps over the bounds again, but within half the old spacing:
    # the finer grid has a rung there, the old one (1.25%) would have selected exactly again.
    from sparsecomm.algorithms.oktopk import _global_select
    from sparsecomm.state import CallStats

    k, n = 100, 3001
    at = torch.randperm(n, generator=torch.Generator().manual_seed(6))
    calls = [[(1.2, 30), (0.99, 150)], [(1.2, 30), (0.999, 60), (0.992, 150)]]
    mags = []
    for levels in calls:
        mag, start = torch.zeros(n, dtype=dtype), 0
        for value, count in levels:
            mag[at[start:start + count]] = value
            start += count
        mags.append(mag)
    cuts = [r * n // P for r in range(P + 1)]

    def body(rank):
        st = sparsecomm.OkTopkState(0.01, tau=100)
        st.global_threshold = _T
        seen = []
        for t, mag in enumerate(mags, start=2):
            stats = CallStats()
            mask, _, _ = _global_select(mag[cuts[rank]:cuts[rank + 1]].clone(), k, st, t, sparsecomm.comm.resolve(),
                                        stats)
            seen.append((set(stats.events), st.global_spacing, st.global_threshold, mask))
        return seen

    for seen in sparsecomm.simulate(P, body).results:
        (ev1, s1, th1, _), (ev2, s2, th2, _) = seen
        assert ev1 == {"global_corrected"} and s1 == _S / 2 and th1 == float(torch.tensor(0.99, dtype=dtype))
        # ...and halves again (its neighbours count 240 and 90); the threshold goes on by half the move.
        assert ev2 == {"global_moved"} and s2 == _S / 4
        assert th2 == float(torch.tensor(th1 * math.exp(_S / 2), dtype=dtype)) * math.exp(_S / 4)
    mask2 = torch.cat([seen[1][3] for seen in sparsecomm.simulate(P, body).results])
    assert int(mask2.sum()) == 90  # the 30 at 1.2 and the 60 at 0.999


@pytest.mark.parametrize("case, levels, want_event, want_count, want_spacing", [
    # (magnitude, how many) around the reused local threshold 1.0 (k = 100), over noise below
    # 0.5. The ladder's rungs are exp(j / 80), j = -2..8: the lowest at 0.9753. The spacing
    # halves where neighbouring rungs' counts bracket k more than 1.5x apart (here 100 and 0),
    # and doubles where the chosen rung is an outer one.
    ("stays", [(1.001, 100)], None, 100, _S / 2),
    ("moves down", [(1.2, 40), (0.98, 60)], "local_moved", 100, 2 * _S),
    # Rungs 1 and 2 count 120: the nearest k, the lower one (nearer the predicted threshold).
    ("moves up", [(1.2, 60), (1.03, 60), (1.001, 60)], "local_moved", 120, _S / 2),
    # 180 at the two lowest rungs, 30 above: no rung fits, the exact top-k of the candidates.
    ("corrected", [(1.2, 30), *[(0.988 + 0.00008 * i, 1) for i in range(150)]], "local_corrected", 100, _S / 2),
    # 30 at every rung: the gradient fell below the ladder; a threshold measured from the
    # data selects once more (1000 entries spread over 0.8-0.9 put the k-th largest at ~0.893).
    ("reselected", [(1.001, 30), *[(0.8 + 0.0001 * i, 1) for i in range(1000)]], "local_reselected", None, _S),
])
def test_reused_local_threshold_takes_a_rung_corrects_or_selects_again(case, levels, want_event, want_count,
                                                                         want_spacing):
    k, n = 100, 20_000
    x = torch.rand(n, generator=torch.Generator().manual_seed(8)) * 0.5
    at = torch.randperm(n, generator=torch.Generator().manual_seed(9))
    start = 0
    for value, count in levels:
        x[at[start:start + count]] = value
        start += count
    st = sparsecomm.OkTopkState(k / n, tau=100, error_feedback=False)
    st.local_threshold, st.iteration = 1.0, 1  # the second call reuses it
    sparsecomm.allreduce(x, state=st)
    events = {e for e in st.last.events if e.startswith("local")}
    assert events == ({want_event} if want_event else set()), events
    got = st.last.local_selected
    assert got == want_count if want_count else 0.9 * k <= got <= 1.1 * k, got
    assert st.local_spacing == want_spacing
    # The next threshold is where this call's count crossed k.
    assert 0.8 * k <= int((x.abs() >= st.local_threshold).sum()) <= 1.25 * k, st.local_threshold


def test_a_gradient_jump_past_the_fused_buffer_selects_again_and_narrows_the_ladder():
    # The fused pass keeps 4k candidates; a threshold 100x too low finds far more. The call
    # then selects above a measured threshold (one more read), not exactly, and halves the
    # ladder's spacing (it reached too low).
    k, n = 100, 20_000
    gen = torch.Generator().manual_seed(10)
    st = sparsecomm.OkTopkState(k / n, tau=100)
    sparsecomm.allreduce(torch.randn(n, generator=gen), state=st)
    st.local_threshold = 0.01
    sparsecomm.allreduce(torch.randn(n, generator=gen), state=st)
    assert {"local_overflowed", "local_reselected"} <= st.last.events.keys(), st.last.events
    assert "local_recomputed" not in st.last.events
    assert 2 * k / 3 <= st.last.local_selected <= 4 * k // 3
    assert st.local_spacing == _S / 2


def test_a_gradient_past_float32s_range_over_the_threshold_raises_nothing():
    # Magnitudes 1e10 over a threshold of 1e-29: the tail fit's ratios overflowed float32,
    # its exponent came out 0 and the estimate divided by it (on one rank: the others hung).
    from sparsecomm.algorithms.ladder import tail_threshold

    assert tail_threshold(torch.full((80,), 1e10), 80, 5e-30, 100) is not None
    n = 10_000
    for error_feedback in (False, True):
        st = sparsecomm.OkTopkState(0.01, error_feedback=error_feedback)
        for s in range(4):
            sparsecomm.allreduce(torch.randn(n, generator=torch.Generator().manual_seed(s)) * 1e-30, state=st)
        g = torch.zeros(n)
        g[:80] = 1e10
        out = sparsecomm.allreduce(g, state=st)
        assert st.last.local_selected == 80 and torch.equal(out[:80], g[:80])
