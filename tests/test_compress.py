"""Compressors: round-trip bounds, and error feedback of the compression error in every algorithm."""

from __future__ import annotations

import importlib
import io

import pytest
import torch
from conservation import assert_conserved

import sparsecomm
from sparsecomm.compress import Quantize, get_compressor, pack_bits, unpack_bits

ALGORITHMS = sparsecomm.algorithms()


def test_cast_and_truncation_bounds():
    x = torch.randn(10_000, generator=torch.Generator().manual_seed(0)) * 10
    for name, rel in (("fp16", 2 ** -11), ("bf16", 2 ** -8), ("trunc16", 2 ** -7)):
        c = get_compressor(name, torch.float32)
        y = c.roundtrip(x)
        assert y.dtype == torch.float32
        assert ((y - x).abs() <= rel * x.abs() + 1e-30).all(), name
    t = get_compressor("trunc16", torch.float32).roundtrip(x)
    assert (t.abs() <= x.abs()).all()  # truncation goes toward zero


@pytest.mark.parametrize("name", [None, "fp16", "bf16", "trunc16", "fp8", "q8", "q8s"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("divisor", [1, 3])
def test_exact_for_says_whether_values_come_back_bit_for_bit(name, dtype, divisor):
    # exact_for lets a call skip keeping re-encoding errors: it must never claim exactness
    # for a compressor that changes a value.
    work = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
    c = get_compressor(name, dtype, divisor=divisor)
    x = (torch.randn(5000, generator=torch.Generator().manual_seed(0)) * 7).to(work)
    back = c.roundtrip(x, float(x.abs().max()) if c.needs_scale else 1.0)
    if c.exact_for(work):
        assert torch.equal(back, x)
    assert c.exact_for(work) == (name is None and work == dtype)  # Divided wraps float16 wires only


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_quantization_bound_and_unbiased_stochastic_rounding(bits):
    x = torch.randn(20_000, generator=torch.Generator().manual_seed(bits))
    q = Quantize(bits)
    scale = float(x.abs().max())
    err = (q.roundtrip(x, scale) - x).abs()
    assert float(err.max()) <= scale / q.levels / 2 * (1 + 1e-6)
    s = Quantize(bits, stochastic=True, seed=1)
    mean = torch.stack([s.roundtrip(x, scale) for _ in range(200)]).mean(0)
    assert float((mean - x).abs().mean()) < 0.1 * scale / s.levels  # unbiased on average
    assert float((s.roundtrip(x, scale) - x).abs().max()) <= scale / s.levels * (1 + 1e-6)


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("count", [0, 1, 7, 1000])
def test_pack_bits_round_trip(bits, count):
    levels = 2 ** (bits - 1) - 1
    codes = torch.randint(-levels, levels + 1, (count,), dtype=torch.int8)
    packed = pack_bits(codes, bits)
    assert packed.numel() == -(-count * bits // 8)
    assert torch.equal(unpack_bits(packed, bits, count), codes)


def test_unknown_compressor_is_bad_input_on_every_rank():
    res = sparsecomm.simulate(3, lambda r: sparsecomm.allreduce(torch.randn(10), 0.5, compressor="zip"),
                              return_exceptions=True)
    assert all(isinstance(e, sparsecomm.InputError) and "compressor" in str(e) for e in res.results)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("compressor", ["q2", "q4s", "q8", "fp8", "trunc16", "fp16"])
@pytest.mark.parametrize("P", [1, 3, 5])
def test_error_feedback_keeps_the_compression_error(algorithm, compressor, P):
    steps, n = 6, 2000

    def body(rank):
        st = sparsecomm.registry.get(algorithm).state_class(0.05, error_feedback=True)
        fed = torch.zeros(n, dtype=torch.float64)
        results = torch.zeros(n, dtype=torch.float64)
        for s in range(steps):
            g = torch.randn(n, generator=torch.Generator().manual_seed(100 * rank + s))
            fed += g.double()
            results += sparsecomm.allreduce(g, state=st, compressor=compressor).double()
        return fed, results, st.residual.double()

    out = sparsecomm.simulate(P, body).results
    for o in out:
        assert torch.equal(o[1], out[0][1]), "ranks disagree"
    assert_conserved(out[0][1], [o[2] for o in out], [o[0] for o in out])
    residual = sum(o[2] for o in out)
    # The compression really happened: something was lost to it and kept in the residuals
    # (without a compressor Dense keeps nothing).
    assert float(residual.abs().max()) > 0


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_compression_shrinks_the_bytes(algorithm):
    def sent(compressor):
        def body(rank):
            comm = sparsecomm.resolve()
            g = torch.randn(400_000, generator=torch.Generator().manual_seed(rank))
            sparsecomm.allreduce(g, 0.01, algorithm=algorithm, compressor=compressor, check=False)
            return comm.stats.bytes_sent

        return max(sparsecomm.simulate(4, body).results)

    plain, q4, q8, fp8 = sent(None), sent("q4"), sent("q8"), sent("fp8")
    if algorithm == "dense":
        assert q4 < 0.2 * plain and q8 < 0.3 * plain  # 4 or 8 bits instead of 32
    else:
        assert q8 < 0.8 * plain  # 1-byte codes instead of 4 next to each 2- or 4-byte index (+ control)
    # One byte a value either way; Ok-Topk's later phases may send a few more or fewer
    # entries (a sum whose 8-bit code is 0 is not sent again).
    assert abs(fp8 - q8) <= 0.02 * q8


def test_fp8_keeps_relative_precision_where_8_bit_codes_lose_small_values():
    # A heavy tail, as top-k selections and DCT components have: one value 10^3 above the
    # rest, which lie within the 2^15 below the scale that fp8 codes to 2^-4.
    x = torch.rand(10_000, generator=torch.Generator().manual_seed(0)).mul_(3).add_(1)
    x[0] = 1e3 * float(x[1:].max())
    scale = float(x.abs().max())
    fp8, q8 = get_compressor("fp8", torch.float32), get_compressor("q8", torch.float32)
    back = fp8.roundtrip(x, scale)
    assert fp8.encode(x, scale).element_size() == 1 and fp8.value_bits == 8
    assert ((back - x).abs() <= 2 ** -4 * x.abs()).all()  # within rounding of 3 mantissa bits
    assert float(back[0]) == pytest.approx(float(x[0]), rel=1e-6)  # the largest maps to 448 and back
    assert (back <= fp8.decoded_bound(scale) * (1 + 1e-6)).all()
    assert (q8.roundtrip(x, scale)[1:] == 0).all()  # evenly spaced levels: everything below 1/254 is 0
    assert torch.equal(fp8.roundtrip(-x, scale), -back)  # symmetric
    assert (fp8.encode(torch.zeros(3), 0.0).float() == 0).all()  # an all-zero message: scale 0


# ---- stochastic rounding: noise per rank and per step, reproducible from a seed ---------------
def _stochastic_run(P, steps, seed=0, checkpoint_at=None):
    """Per rank: the dense q8s results and residuals of ``steps`` calls on the same input."""
    compressor = Quantize(8, stochastic=True, seed=seed) if seed else "q8s"

    def body(rank):
        x = torch.linspace(-1, 1, 999)  # the same on every rank and every step
        st = sparsecomm.DenseState(error_feedback=True)
        outs, residuals = [], []
        for step in range(steps):
            if step == checkpoint_at:  # as a resumed run would
                buf = io.BytesIO()
                torch.save(st, buf)
                buf.seek(0)
                st = torch.load(buf)
            outs.append(sparsecomm.allreduce(x, algorithm="dense", state=st, compressor=compressor))
            residuals.append(st.residual.clone())
        return outs, residuals

    return sparsecomm.simulate(P, body).results


def test_stochastic_rounding_noise_differs_per_rank_and_per_step():
    (outs0, res0), (outs1, res1) = _stochastic_run(2, 3)
    # Same input, same residual history length: only the rounding noise can differ.
    assert not torch.equal(res0[0], res1[0]), "ranks drew the same rounding noise"
    stateless = sparsecomm.simulate(2, lambda r: [sparsecomm.allreduce(
        torch.linspace(-1, 1, 999), algorithm="dense", compressor="q8s") for _ in range(2)]).results
    assert not torch.equal(stateless[0][0], stateless[0][1]), "two calls drew the same noise"
    # Independent noise averages out: the sum's error is well below twice one rank's.
    x = torch.linspace(-1, 1, 999)
    err = (outs0[0] - 2 * x).abs().mean()
    one = res0[0].abs().mean()  # one rank's rounding error: what its residual keeps
    assert err < 1.8 * one


def test_stochastic_rounding_is_reproducible_from_its_seed_across_a_checkpoint():
    a, b = _stochastic_run(2, 4, seed=7), _stochastic_run(2, 4, seed=7, checkpoint_at=2)
    for (oa, ra), (ob, rb) in zip(a, b):
        assert all(torch.equal(x, y) for x, y in zip(oa, ob))
        assert all(torch.equal(x, y) for x, y in zip(ra, rb))
    other = _stochastic_run(2, 4, seed=8)
    assert not torch.equal(other[0][0][0], a[0][0][0])


# ---- the compressed dense allreduce settles its residual while encoding -------------------
@pytest.mark.parametrize("compressor", ["q8", "q4", "q2s"])
@pytest.mark.parametrize("P", [2, 3, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_dense_settling_while_encoding_changes_no_bit(monkeypatch, compressor, P, dtype):
    # With error feedback, each chunk keeps its quantisation error in the residual in the
    # encoding pass (SparseResult.settled), instead of the update subtracting the decoded
    # values after. The results, residuals and kept errors must be those of the old order.
    dense_module = importlib.import_module("sparsecomm.algorithms.dense")  # the package re-exports the function

    def body(rank):
        st = sparsecomm.DenseState(error_feedback=True)
        outs, settled = [], []
        for step in range(4):
            g = (torch.randn(5003, generator=torch.Generator().manual_seed(10 * rank + step)) * 3).to(dtype)
            outs.append(sparsecomm.allreduce(g, state=st, compressor=compressor, algorithm="dense"))
            settled.append(st.residual.clone())
        return outs, settled

    def runs():
        return sparsecomm.simulate(P, body).results

    fused = runs()
    last = {}
    real = dense_module._allgather

    def spy(h, comm):  # the settled path really ran
        result = real(h, comm)
        last[comm.rank] = result.settled
        return result

    monkeypatch.setattr(dense_module, "_allgather", spy)
    assert [o[0] for o in runs()] and all(last.values()) and len(last) == P
    monkeypatch.setattr(dense_module, "_BOUND_MARGIN", float("inf"))  # no bound: never settle
    last.clear()
    unfused = runs()
    assert not any(last.values())
    for (outs_a, res_a), (outs_b, res_b) in zip(fused, unfused):
        assert all(torch.equal(a, b) for a, b in zip(outs_a, outs_b))
        assert all(torch.equal(a, b) for a, b in zip(res_a, res_b))


def test_dense_q8_sum_that_overflows_float16_is_refused_and_keeps_the_gradient():
    # The scales bound the sum above float16's range: the call must not settle (a refused
    # call puts the whole input back in the residual), and the overflow check must run.
    def body(rank):
        st = sparsecomm.DenseState(error_feedback=True)
        for _ in range(2):  # small calls first: the refused one runs the fused accumulation
            sparsecomm.allreduce(torch.full((40,), 0.5, dtype=torch.float16), state=st, compressor="q8",
                                 algorithm="dense")
        assert st.fuses_next()
        st.residual.zero_()
        x = torch.zeros(40, dtype=torch.float16)
        x[3], x[5] = 30000, 1.0
        try:
            sparsecomm.allreduce(x, state=st, compressor="q8", algorithm="dense")
        except sparsecomm.InputError as exc:
            return str(exc), st.residual
        return "returned", None

    for msg, residual in sparsecomm.simulate(3, body).results:
        assert "overflows torch.float16" in msg, msg
        assert residual[3] == 30000 and residual[5] == 1.0 and int(torch.count_nonzero(residual)) == 2


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_dense_q8_fused_accumulation_rejects_a_nonfinite_gradient_and_takes_it_back_out(bad):
    # After its first call the dense q8 state accumulates in the fused pass (with the
    # finite check folded in): a NaN/Inf gradient on one rank is refused on every rank,
    # and every residual is what it was before the call (up to the rounding of adding the
    # gradient and taking it back out; the entry whose sum was not finite never changed).
    def body(rank):
        st = sparsecomm.DenseState(error_feedback=True)
        for step in range(3):
            sparsecomm.allreduce(torch.randn(3001, generator=torch.Generator().manual_seed(rank + 10 * step)),
                                 state=st, compressor="q8", algorithm="dense")
        assert st.fuses_next()
        before = st.residual.clone()
        g = torch.randn(3001, generator=torch.Generator().manual_seed(99))
        if rank == 1:
            g[17] = bad
        try:
            sparsecomm.allreduce(g, state=st, compressor="q8", algorithm="dense")
        except sparsecomm.InputError as exc:
            return str(exc), st.residual, before
        return "returned", None, None

    for rank, (msg, residual, before) in enumerate(sparsecomm.simulate(3, body).results):
        assert "NaN or Inf on rank(s) [1]" in msg, msg
        torch.testing.assert_close(residual, before, rtol=0, atol=1e-6)
        if rank == 1:
            assert residual[17] == before[17]



def test_dense_q8_residual_plus_gradient_that_overflows_is_refused_and_left_as_it_was():
    # A residual plus gradient can overflow even when every gradient is finite (here on
    # rank 2, which owns the last chunk). The accumulation writes only finite sums and counts
    # the others, so the call is refused on every rank and no inf enters the residual.
    def body(rank):
        st = sparsecomm.DenseState(error_feedback=True)
        sparsecomm.allreduce(torch.ones(300), state=st, compressor="q8", algorithm="dense")
        g = torch.ones(300)
        if rank == 2:
            st.residual[250], g[250] = 3e38, 3e38
        before = st.residual.clone()
        try:
            out = sparsecomm.allreduce(g, state=st, compressor="q8", algorithm="dense")
        except sparsecomm.InputError as exc:
            return str(exc), before, st.residual
        return f"returned, finite: {bool(torch.isfinite(out).all())}", None, None

    for rank, (msg, before, residual) in enumerate(sparsecomm.simulate(3, body).results):
        assert "overflows on rank(s) [2]" in msg, msg
        assert torch.isfinite(residual).all()
        torch.testing.assert_close(residual, before, rtol=0, atol=1e-6)


def test_a_bound_comes_only_from_finite_scales():
    # An infinite chunk scale decodes to NaN, and Python's max() skips a NaN that is not
    # first: either must leave the result unbounded, so that the overflow check runs.
    from sparsecomm.compress import Divided, get_compressor

    bound = importlib.import_module("sparsecomm.algorithms.dense")._decoded_bound
    q8 = get_compressor("q8", torch.float32)
    assert bound(q8, [1.0, 2.0]) == pytest.approx(2.0 * 1.01)
    assert bound(q8, [1.0, float("nan")]) is None and bound(q8, [float("inf"), 1.0]) is None
    assert bound(Divided(q8, 4), [1.0, 2.0]) == pytest.approx(8.0 * 1.01)  # decodes times the divisor
    assert bound(get_compressor("fp16", torch.float32), [1.0]) is None  # a cast's scale bounds nothing


@pytest.mark.parametrize("compressor", ["q8", "q4"])
def test_dense_quantised_call_matches_a_hand_written_reference(compressor):
    # The semantics, written out: per chunk a scale agreed as the max over ranks of max |acc|;
    # each rank sends its chunks quantised; each owner sums what it received in rank order
    # from itself on, re-encodes the sum with its own scale and keeps that error; everyone
    # decodes every owner's payload. With error feedback a rank's residual is acc minus what
    # it sent (as decoded), plus its owner's re-encoding error.
    from sparsecomm.algorithms.exchange import equal_boundaries
    from sparsecomm.kernels import payload

    P, n, steps, bits = 3, 1001, 3, int(compressor[1:])
    grads = [[torch.randn(n, generator=torch.Generator().manual_seed(7 * r + s)) * (r + 1) for s in range(steps)]
             for r in range(P)]

    def body(rank):
        st = sparsecomm.DenseState(error_feedback=True)
        return [(sparsecomm.allreduce(grads[rank][s], state=st, compressor=compressor, algorithm="dense"),
                 st.residual.clone()) for s in range(steps)]

    got = sparsecomm.simulate(P, body).results
    starts = equal_boundaries(n, P, torch.device("cpu")).tolist()
    chunks = [slice(starts[j], starts[j + 1]) for j in range(P)]

    def enc(v, scale):
        return payload.encode_codes_torch(v, bits, scale)

    def dec(p, count, scale):
        return payload.decode_codes_torch(p, bits, count, scale, torch.float32)

    residual = [torch.zeros(n) for _ in range(P)]
    for s in range(steps):
        acc = [residual[r] + grads[r][s] for r in range(P)]
        scales = [max(float(acc[r][c].abs().max()) for r in range(P)) for c in chunks]
        sent = [[dec(enc(acc[r][c], scales[j]), c.stop - c.start, scales[j]) for j, c in enumerate(chunks)]
                for r in range(P)]
        result, kept = torch.empty(n), []
        for j, c in enumerate(chunks):
            mine = sent[j][j].clone()
            for t in range(1, P):
                mine += sent[(j - t) % P][j]
            own = float(mine.abs().max())
            delivered = dec(enc(mine, own), mine.numel(), own)
            result[c] = delivered  # op="sum", the default
            kept.append(mine - delivered)
        for r in range(P):
            residual[r] = acc[r] - torch.cat(sent[r])
            residual[r][chunks[r]] += kept[r]
        for r in range(P):
            out, res = got[r][s]
            assert torch.equal(out, result), (s, r)
            assert torch.equal(res, residual[r]), (s, r)


@pytest.mark.parametrize("compressor", ["q8", "q4", "q8s"])
def test_dense_quantised_at_world_size_one_is_not_clipped_to_one(compressor):
    # A world of one round-trips acc through the quantiser with acc's own scale; with the
    # default scale 1.0 every |value| above 1 came back as 1.
    x = torch.linspace(-100, 100, 1001)
    out = sparsecomm.simulate(1, lambda r: sparsecomm.allreduce(x, algorithm="dense", compressor=compressor)
                              ).results[0]
    levels = 2 ** (int(compressor[1]) - 1) - 1
    assert float((out - x).abs().max()) <= 100 / levels  # half a step to nearest, a step stochastic
    assert float(out.abs().max()) > 50
