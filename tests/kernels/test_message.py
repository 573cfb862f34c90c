"""Sparse messages (``kernels.message``): layout choice, round trips, every path against the reference.

The blocked layout is checked byte for byte against ``pack_blocked_torch``
on every path in its table, decoded back on every path, and refused (never
decoded into other indexes) when its input or header is wrong.
"""

from __future__ import annotations

import pytest
import torch

from gpu_paths import backend_params, missing, runner

from sparsecomm import kernels
from sparsecomm.kernels import dispatch
from sparsecomm.kernels import message

B = message.INDEX_BLOCK


def _indexes(span: int, count: int, seed: int) -> torch.Tensor:
    """``count`` ascending indexes in [0, span) that include both ends and a block's edges."""
    gen = torch.Generator().manual_seed(seed)
    pick = torch.randperm(span, generator=gen)[:count]
    edges = torch.tensor([0, span - 1, B - 1, B, 2 * B - 1], dtype=torch.int64)
    edges = edges[edges < span][:count]
    pick = torch.cat([edges, pick[~torch.isin(pick, edges)]])[:count]
    return pick.sort().values


def _values(count: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if dtype == torch.uint8:
        return torch.randint(0, 256, (count,), generator=gen, dtype=torch.uint8)
    return (torch.randn(count, generator=gen) * 100).to(dtype)


# (span, count): a region at 1% and 4%; k = n; one entry; a span that is not a whole number
# of blocks; too few entries for blocking (plain); exactly one block; a span over 2**16 blocks.
CASES = [(6_250_000, 62_500), (300_000, 12_000), (B + 17, B + 17), (1, 1), (3 * B + 1, 300),
         (3 * B, 2), (B, 5), (5 * B, 0)]


@pytest.mark.parametrize("span,count", CASES)
@pytest.mark.parametrize("value_dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64,
                                         torch.uint8])
def test_round_trip_and_size(span, count, value_dtype):
    idx, val = _indexes(span, count, span + count), _values(count, value_dtype, count)
    msg = kernels.pack_message(idx, val, span, torch.int32, value_dtype)
    assert msg.dtype == torch.uint8 and msg.dim() == 1
    assert msg.numel() == kernels.message_bytes(count, span, torch.int32, value_dtype)
    plain = count * kernels.record_bytes(torch.int32, value_dtype)
    blocks = -(-span // B)
    if kernels.blocked(count, span, torch.int32):
        assert msg.numel() == 4 * blocks + count * kernels.record_bytes(torch.int16, value_dtype) < plain
    else:
        assert msg.numel() == plain and 4 * blocks >= 2 * count
    ridx, rval = kernels.unpack_message(msg, count, span, torch.int32, value_dtype)
    assert torch.equal(ridx, idx) and ridx.dtype == torch.int64
    assert torch.equal(rval.view(torch.uint8), val.view(torch.uint8))


def test_int64_indexes_block_more_often():
    # 8-byte indexes save 6 bytes an entry: blocking pays from fewer entries a block.
    span = 100 * B  # header: 400 bytes
    assert not kernels.blocked(200, span, torch.int32) and kernels.blocked(201, span, torch.int32)
    assert not kernels.blocked(66, span, torch.int64) and kernels.blocked(67, span, torch.int64)
    idx, val = _indexes(span, 67, 3), _values(67, torch.float32, 3)
    msg = kernels.pack_message(idx, val, span, torch.int64, torch.float32)
    assert msg.numel() == 400 + 67 * 6
    assert torch.equal(kernels.unpack_message(msg, 67, span, torch.int64, torch.float32)[0], idx)


@pytest.mark.parametrize("backend", backend_params("pack_message"))
@pytest.mark.parametrize("span,count", [c for c in CASES if kernels.blocked(c[1], c[0], torch.int32)])
@pytest.mark.parametrize("value_dtype", [torch.float32, torch.bfloat16, torch.float64, torch.uint8])
def test_blocked_paths_match_torch_bytewise(backend, monkeypatch, span, count, value_dtype):
    if backend == "triton" and span > 10**6 and not torch.cuda.is_available():
        # The interpreter takes 5-10 s a dtype at 6.25M; the 300k case runs the same blocked
        # path here (several blocks, a partial last one), and a GPU runs this one compiled.
        pytest.skip("the 6.25M case of the Triton backend runs on a GPU, not in the interpreter")
    run = runner(backend, monkeypatch)
    idx, val = _indexes(span, count, count), _values(count, value_dtype, span)
    expect = kernels.pack_message(idx, val, span, torch.int32, value_dtype, backend="torch")
    head = 4 * (-(-span // B))
    for base in (0, 7 * B + 3):  # (indexes of a region that starts at base)
        got = torch.full_like(expect, 0xAB)  # every byte must be written
        run("pack_message", idx + base, val, value_dtype, got[:head].view(torch.int32), got[head:].view(count, -1),
            base)
        assert torch.equal(got, expect)
    for base, at in ((0, 0), (12345, 3)):  # (at 3: inside a gathered buffer, at an odd byte offset)
        msg = torch.cat([torch.zeros(at, dtype=torch.uint8), expect])[at:]
        ridx = torch.full((count,), -7, dtype=torch.int64)
        rval = torch.zeros(count, dtype=value_dtype)
        run("unpack_message", msg[head:].view(count, -1), msg[:head], value_dtype, base, ridx, rval)
        assert torch.equal(ridx, idx + base)
        assert torch.equal(rval.view(torch.uint8), val.view(torch.uint8))
    if value_dtype in (torch.float32, torch.float64) and idx.unique().numel() == count:  # added while decoded
        region = torch.randn(span + 5, generator=torch.Generator().manual_seed(1)).to(value_dtype)
        want = region.clone().index_add_(0, idx, val)
        run("unpack_message", expect[head:].view(count, -1), expect[:head], value_dtype, 0,
            torch.empty(count, dtype=torch.int64), torch.empty(count, dtype=value_dtype), region)
        assert torch.equal(region, want)


@pytest.mark.parametrize("backend", ["torch", "auto"])
def test_bad_messages_are_refused(backend):
    be = None if backend == "auto" else backend
    span, count = 4 * B, 1000
    idx, val = _indexes(span, count, 1), _values(count, torch.float32, 1)
    msg = kernels.pack_message(idx, val, span, torch.int32, torch.float32, backend=be)
    with pytest.raises(ValueError, match="has"):
        kernels.unpack_message(msg[:-1], count, span, torch.int32, torch.float32, backend=be)
    with pytest.raises(ValueError, match="has"):
        kernels.unpack_message(msg, count + 1, span, torch.int32, torch.float32, backend=be)
    bad = msg.clone()
    bad[:16].view(torch.int32)[1] += 1  # the header counts one entry too many
    with pytest.raises(ValueError, match="header counts 1001"):
        kernels.unpack_message(bad, count, span, torch.int32, torch.float32, backend=be)
    with pytest.raises(ValueError, match="indexes but"):
        kernels.pack_message(idx, val[:-1], span, torch.int32, torch.float32, backend=be)


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_indexes_that_descend_or_leave_the_span_are_refused(backend, monkeypatch):
    if backend == "cpu" and "cpu" not in dispatch.OPS["pack_message"].backends:
        pytest.skip("no cpu path")
    span = 4 * B
    idx, val = _indexes(span, 1000, 2), _values(1000, torch.float32, 2)
    with pytest.raises(ValueError, match="do not ascend"):
        kernels.pack_message(idx.flip(0), val, span, torch.int32, torch.float32, backend=backend)
    with pytest.raises(ValueError, match="outside the span"):
        kernels.pack_message(idx + 2 * B, val, span, torch.int32, torch.float32, backend=backend)
    # The paths themselves refuse what leaves the header's blocks (or is negative).
    msg = torch.empty(4 * 4 + 1000 * 6, dtype=torch.uint8)
    for bad in (idx + 2 * B, idx - 1):
        with pytest.raises(ValueError, match="do not ascend"):
            dispatch.OPS["pack_message"].run(backend, bad, val, torch.float32, msg[:16].view(torch.int32),
                                             msg[16:].view(1000, -1))


@pytest.mark.skipif(missing("triton") is not None, reason=str(missing("triton")))
def test_explicit_gpu_backends_have_a_path_for_blocked_messages(monkeypatch):
    # backend= names a path for the blocked layout too (Triton's: header and records in one
    # kernel), which, in its interpreter here, gives the reference's bytes.
    run = runner("triton", monkeypatch)
    span, count = 3 * B + 5, 700
    idx, val = _indexes(span, count, 4), _values(count, torch.float16, 4)
    expect = kernels.pack_message(idx, val, span, torch.int32, torch.float16, backend="torch")
    assert dispatch.OPS["pack_message"].fallback("triton", idx, val) == "triton"
    got = torch.zeros_like(expect)
    run("pack_message", idx, val, torch.float16, got[:16].view(torch.int32), got[16:].view(count, -1), 0)
    assert torch.equal(got, expect)


@pytest.mark.parametrize("backend", ["torch", "auto"])
def test_unpack_messages_concatenates_with_bases(backend):
    be = None if backend == "auto" else backend
    # Regions as Ok-Topk's allgatherv lays them out: blocked, plain and empty messages end to end.
    spans, counts = [5 * B, 3 * B, 10, 7 * B + 3], [4000, 2, 0, 9000]
    bases = [0, spans[0], spans[0] + spans[1], spans[0] + spans[1] + spans[2]]
    assert [kernels.blocked(c, s, torch.int32) for c, s in zip(counts, spans)] == [True, False, False, True]
    parts = [(_indexes(s, c, j), _values(c, torch.float16, j)) for j, (s, c) in enumerate(zip(spans, counts))]
    buf = torch.cat([kernels.pack_message(i, v, s, torch.int32, torch.float16, backend=be)
                     for (i, v), s in zip(parts, spans)])
    idx, val = kernels.unpack_messages(buf, counts, spans, bases, torch.int32, torch.float16, backend=be)
    assert torch.equal(idx, torch.cat([i + b for (i, _), b in zip(parts, bases)]))
    assert torch.equal(val, torch.cat([v for _, v in parts]))
    with pytest.raises(ValueError, match="the messages take"):
        kernels.unpack_messages(torch.cat([buf, buf[:3]]), counts, spans, bases, torch.int32, torch.float16)
    # int64 indexes and 1-byte codes (q8's wire): 3-byte records at odd offsets in the buffer.
    spans, counts, bases = [3 * B + 1, 100, 9 * B], [5000, 7, 300], [0, 3 * B + 1, 3 * B + 101]
    parts = [(_indexes(s, c, j), _values(c, torch.uint8, j)) for j, (s, c) in enumerate(zip(spans, counts))]
    buf = torch.cat([kernels.pack_message(i, v, s, torch.int64, torch.uint8, backend=be)
                     for (i, v), s in zip(parts, spans)])
    assert buf.numel() == 16 + 5000 * 3 + 4 + 7 * 3 + 36 + 300 * 3
    idx, val = kernels.unpack_messages(buf, counts, spans, bases, torch.int64, torch.uint8, backend=be)
    assert torch.equal(idx, torch.cat([i + b for (i, _), b in zip(parts, bases)]))
    assert torch.equal(val, torch.cat([v for _, v in parts]))


@pytest.mark.parametrize("span,count", [(5 * B, 4000), (5 * B, 3)])  # blocked, plain
def test_a_base_is_subtracted_from_the_indexes(span, count):
    idx, val = _indexes(span, count, 5), _values(count, torch.float32, 5)
    want = kernels.pack_message(idx, val, span, torch.int32, torch.float32)
    assert torch.equal(kernels.pack_message(idx + 3 * B + 1, val, span, torch.int32, torch.float32, base=3 * B + 1),
                       want)
    with pytest.raises(ValueError, match="outside the span"):
        kernels.pack_message(idx + 3 * B + 1, val, span, torch.int32, torch.float32, base=1)


@pytest.mark.parametrize("backend", backend_params("pack_messages"))
@pytest.mark.parametrize("index_dtype,value_dtype", [(torch.int32, torch.float32), (torch.int32, torch.float16),
                                                     (torch.int64, torch.uint8), (torch.int16, torch.bfloat16),
                                                     (torch.int32, torch.float64)])
def test_many_messages_at_once_equal_one_message_at_a_time(backend, index_dtype, value_dtype):
    # A rank's selection cut into regions (pack_messages), every part as pack_message makes it,
    # end to end, one left out; the receiver decodes them in any order of starts.
    if index_dtype == torch.int16:
        spans = [100, 3000, 7, 20_000, 1]
    else:
        spans = [5 * B, 3 * B, 10, 7 * B + 3, 2 * B]
    counts = [min(c, s) for c, s in zip([4000, 2, 0, 9000, 50], spans)]
    bases = [sum(spans[:j]) for j in range(len(spans))]
    parts = [(_indexes(s, c, j) + b, _values(c, value_dtype, j)) for j, (s, c, b) in
             enumerate(zip(spans, counts, bases))]
    idx, val = torch.cat([i for i, _ in parts]), torch.cat([v for _, v in parts])
    cuts = [sum(counts[:j]) for j in range(len(counts) + 1)]
    for skip in (None, 1, 3):
        buf, sizes = kernels.pack_messages(idx, val, cuts, spans, bases, index_dtype, value_dtype, skip=skip,
                                           backend=backend)
        want = [kernels.pack_message(i, v, s, index_dtype, value_dtype, base=b) if j != skip
                else torch.empty(0, dtype=torch.uint8) for j, ((i, v), s, b) in enumerate(zip(parts, spans, bases))]
        assert sizes == [w.numel() for w in want] == kernels.messages_bytes(
            [0 if j == skip else c for j, c in enumerate(counts)], spans, index_dtype, value_dtype)
        assert torch.equal(buf, torch.cat(want))
    buf, sizes = kernels.pack_messages(idx, val, cuts, spans, bases, index_dtype, value_dtype, backend=backend)
    at = [sum(sizes[:j]) for j in range(len(sizes))]
    order = [3, 0, 4, 1, 2]  # decoded in another order than they lie, from their starts
    got_idx, got_val = kernels.unpack_messages(buf, [counts[j] for j in order], [spans[j] for j in order],
                                               [bases[j] for j in order], index_dtype, value_dtype,
                                               starts=[at[j] for j in order], backend=backend)
    assert torch.equal(got_idx, torch.cat([parts[j][0] for j in order]))
    assert torch.equal(got_val, torch.cat([parts[j][1] for j in order]))


@pytest.mark.parametrize("backend", backend_params("pack_messages"))
def test_many_messages_refuse_indexes_outside_their_part_and_headers_that_lie(backend):
    spans, counts, bases = [5 * B, 5 * B], [4000, 4000], [0, 5 * B]
    parts = [_indexes(s, c, j) + b for j, (s, c, b) in enumerate(zip(spans, counts, bases))]
    val = _values(8000, torch.float32, 1)
    with pytest.raises(ValueError, match="outside its part"):  # part 0 reaches into part 1's span
        kernels.pack_messages(torch.cat(parts) + 7, val, [0, 4000, 8000], spans, bases, torch.int32, torch.float32,
                              backend=backend)
    buf, _ = kernels.pack_messages(torch.cat(parts), val, [0, 4000, 8000], spans, bases, torch.int32, torch.float32,
                                   backend=backend)
    for word in (3999, 4001, -1):  # block 0 counts one entry fewer, one more, a negative count
        bad = buf.clone()
        bad[:4] = torch.tensor([word], dtype=torch.int32).view(torch.uint8)
        with pytest.raises(ValueError, match="header"):
            kernels.unpack_messages(bad, counts, spans, bases, torch.int32, torch.float32, backend=backend)


@pytest.mark.parametrize("seed", range(6))
def test_the_compiled_messages_are_the_references_bytes(seed):
    # Random exchanges (world sizes, spans, densities, dtypes, a skipped part, empty parts, k = n):
    # the cpu path writes the bytes pack_messages_torch writes, and decodes them as unpack_messages_torch.
    pytest.importorskip("numba")
    gen = torch.Generator().manual_seed(seed)
    P = int(torch.randint(1, 9, (1,), generator=gen))
    index_dtype, value_dtype = [(torch.int32, torch.float32), (torch.int32, torch.bfloat16),
                                (torch.int64, torch.float16), (torch.int32, torch.uint8)][seed % 4]
    spans = torch.randint(1, 4 * B, (P,), generator=gen).tolist()
    counts = [0 if float(torch.rand(1, generator=gen)) < 0.2 else
              s if float(torch.rand(1, generator=gen)) < 0.1 else
              int(torch.randint(1, min(s, 9000) + 1, (1,), generator=gen)) for s in spans]
    bases = [sum(spans[:j]) for j in range(P)]
    parts = [(_indexes(s, c, seed * 10 + j) + b, _values(c, value_dtype, j)) for j, (s, c, b) in
             enumerate(zip(spans, counts, bases))]
    idx, val = torch.cat([i for i, _ in parts]), torch.cat([v for _, v in parts])
    cuts = [sum(counts[:j]) for j in range(P + 1)]
    skip = seed % P if seed % 2 else None
    ref, ref_sizes = kernels.pack_messages(idx, val, cuts, spans, bases, index_dtype, value_dtype, skip=skip,
                                           backend="torch")
    got, sizes = kernels.pack_messages(idx, val, cuts, spans, bases, index_dtype, value_dtype, skip=skip,
                                       backend="cpu")
    assert sizes == ref_sizes and torch.equal(got, ref)
    sent = [0 if j == skip else c for j, c in enumerate(counts)]
    decoded = [kernels.unpack_messages(got, sent, spans, bases, index_dtype, value_dtype, backend=b) for b in ("torch", "cpu")]
    assert torch.equal(decoded[0][0], decoded[1][0]) and torch.equal(decoded[0][1].view(torch.uint8),
                                                                       decoded[1][1].view(torch.uint8))
    assert torch.equal(decoded[1][0], torch.cat([i for j, (i, _) in enumerate(parts) if j != skip]))
