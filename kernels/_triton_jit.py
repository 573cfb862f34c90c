"""Triton kernels behind ``kernels.triton_backend`` (imports triton at import time).

Only ``kernels.triton_backend`` imports this module, inside its functions, so
``sparsecomm.kernels`` never needs triton. ``triton.jit`` reads
``TRITON_INTERPRET`` when it wraps each kernel, i.e. when this module is
imported. Sized for large tensors on A100/H100 (block sizes and warps: see
``triton_backend``; 8-16 elements per thread, vectorised 16-byte loads), one
program per tile for the single-pass select, a capped grid with a loop for
the histograms.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["ef_select_kernel", "compact_above_kernel", "ef_accumulate_kernel", "choose_digit_kernel", "radix_hist_kernel", "scatter_add_sorted_kernel",
           "count_above_kernel", "tally_kernel", "pack_records_kernel", "pack_blocked_kernel", "unpack_blocked_kernel", "unpack_records_kernel", "encode_codes_kernel",
           "decode_codes_kernel"]


@triton.jit
def _look_back(status_ptr, tile, count):
    """The tiles before ``tile`` hold this many selected entries (decoupled look-back).

    Publish the tile's count (flag 1; tile 0 its inclusive prefix at once, flag 2), walk
    back over earlier tiles summing counts until one with an inclusive prefix, publish
    ours (flag 2). Status words pack ``value << 2 | flag`` so one atomic read sees both.
    """
    first = tile == 0
    tl.atomic_xchg(status_ptr + tile, (count << 2) | tl.where(first, 2, 1))
    excl = count * 0
    done = first.to(tl.int32)
    j = tile - 1
    while done == 0:
        # An atomic add of 0 is an atomic read that cannot be served from a stale cache line.
        w = tl.atomic_add(status_ptr + j, 0)
        flag = w & 3
        excl += tl.where(flag != 0, w >> 2, 0)
        done = (flag == 2).to(tl.int32)
        j -= (flag == 1).to(j.dtype)
    tl.atomic_xchg(status_ptr + tile, ((excl + count) << 2) | 2, mask=tile > 0)
    return excl


@triton.jit
def ef_select_kernel(g_ptr, r_ptr, out_idx_ptr, out_val_ptr, status_ptr, ticket_ptr,
                     n, scale, th, capacity,
                     ZERO: tl.constexpr, BLOCK: tl.constexpr, FMAX: tl.constexpr):
    """One tile of the fused error-feedback select, compacted by a single-pass scan.

    1. Draw a tile number from an atomic ticket, not ``program_id``: a tile
       then only ever waits for tiles whose programs already started, so the
       look-back below cannot deadlock whatever order the GPU schedules in.
    2. acc = r + scale * g; sel = (acc != 0 and |acc| >= th) or acc not
       finite (FMAX: the residual dtype's largest finite value); the tile count.
    3. Decoupled look-back: publish the tile count (flag 1), then walk back
       over earlier tiles summing counts until one with an inclusive prefix
       (flag 2); publish our inclusive prefix. Status words pack
       ``value << 2 | flag`` so one atomic read sees both.
    4. Output slot = exclusive prefix + in-tile exclusive cumsum; slots past
       ``capacity`` are not written; written entries are zeroed in r when ZERO.
    """
    tile = tl.atomic_add(ticket_ptr, 1)
    offs = tile.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    r = tl.load(r_ptr + offs, mask=m, other=0.0)
    g = tl.load(g_ptr + offs, mask=m, other=0.0).to(r.dtype)
    acc = r + scale * g
    # A non-finite acc (NaN, Inf, an overflowing sum) is always selected and leaves r as it
    # was: the caller sees it in the output and can undo the call (kernels.ef_select).
    finite = tl.abs(acc) <= FMAX
    sel = m & ((acc != 0) & (tl.abs(acc) >= th) | ~finite)
    # In-tile counts and offsets in int32 (a tile holds < 2**31 entries): an
    # int64 cumsum over the tile doubled the registers and halved occupancy.
    s = sel.to(tl.int32)
    count = tl.sum(s, axis=0).to(tl.int64)
    excl = _look_back(status_ptr, tile, count)
    pos = excl + (tl.cumsum(s, axis=0) - s).to(tl.int64)
    write = sel & (pos < capacity)
    tl.store(out_idx_ptr + pos, offs, mask=write)
    tl.store(out_val_ptr + pos, acc, mask=write)
    if ZERO:
        acc = tl.where(write, 0.0, acc)
    tl.store(r_ptr + offs, tl.where(finite, acc, r), mask=m)


@triton.jit
def compact_above_kernel(x_ptr, th_ptr, out_ptr, count_ptr, n, capacity, BLOCK: tl.constexpr):
    """|x| of the entries not below ``*th_ptr`` (NaN too: it ranks above all), compacted into
    ``out`` (the first ``capacity``) in one pass, ``*count_ptr`` += their count: the exact
    k-th largest's candidates (``triton_backend.kth_largest``).

    The candidates' order does not matter (a select runs over them), so each tile takes its
    slots with one atomic add on the count, in no order, instead of the decoupled look-back
    of ``ef_select_kernel``: on an H100 that chain of 6,104 tiles kept the pass at 0.71 ms
    for 100M float32 entries, a fifth of the copy bandwidth; 0.38 ms without it
    (``benchmarks/gpu/profile_call.py``).
    """
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    mag = tl.abs(tl.load(x_ptr + offs, mask=m, other=0.0))
    sel = m & ~(mag < tl.load(th_ptr))
    s = sel.to(tl.int32)
    base = tl.atomic_add(count_ptr, tl.sum(s, axis=0).to(tl.int64))
    pos = base + (tl.cumsum(s, axis=0) - s).to(tl.int64)
    tl.store(out_ptr + pos, mag, mask=sel & (pos < capacity))


@triton.jit
def ef_accumulate_kernel(g_ptr, r_ptr, maxima_ptr, bad_ptr, n,
                         FMAX: tl.constexpr, BLOCK: tl.constexpr, MAXIMA: tl.constexpr):
    """One block of ``kernels.ef_accumulate``: r += g where the sum is finite.

    1. acc = r + g in r's dtype (one rounding, as torch's add); finite:
       |acc| <= FMAX (False for NaN and +-Inf), else r keeps its value.
    2. The block's count of non-finite sums is added to ``bad_ptr`` (int64),
       only when there is one: a steady call makes no atomic at all.
    3. MAXIMA: maxima[block] = max |r| over the block, as written (the residual holds
       no NaN: non-finite sums are never written; tl.max here would skip one).
    """
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    r = tl.load(r_ptr + offs, mask=m, other=0.0)
    acc = r + tl.load(g_ptr + offs, mask=m, other=0.0).to(r.dtype)
    finite = tl.abs(acc) <= FMAX
    new = tl.where(finite, acc, r)
    tl.store(r_ptr + offs, new, mask=m)
    bad = tl.sum((m & ~finite).to(tl.int32), axis=0)
    if bad > 0:
        tl.atomic_add(bad_ptr, bad.to(tl.int64))
    if MAXIMA:
        tl.store(maxima_ptr + pid, tl.max(tl.where(m, tl.abs(new), 0.0), axis=0))


@triton.jit
def radix_hist_kernel(x_ptr, n, prefix_ptr, hist_ptr,
                      KEY_BITS: tl.constexpr, SHIFT: tl.constexpr, FIRST: tl.constexpr,
                      BLOCK: tl.constexpr):
    """Histogram of one 8-bit digit of |x|'s bit pattern, over entries matching a prefix.

    1. key = bits of x without the sign bit: for non-negative floats the
       integer order of the bits is the numeric order, so a radix select over
       keys is a select over magnitudes.
    2. Entries whose bits above ``SHIFT + 8`` equal ``*prefix_ptr`` (every
       entry when FIRST) add one to bin ``(key >> SHIFT) & 255``.
    3. Each program loops over tiles (grid capped at a few waves), keeps its
       histogram in registers and adds it to the global one once: 256 atomics
       per program instead of one per element.
    """
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    if KEY_BITS == 16:
        sign_off: tl.constexpr = 0x7FFF
    else:
        sign_off: tl.constexpr = 0x7FFFFFFF
    prefix = tl.load(prefix_ptr)
    hist = tl.zeros((256,), dtype=tl.int32)
    # int64 start: with n just below 2**31 an int32 start + nprog * BLOCK would wrap.
    for start in range(pid.to(tl.int64) * BLOCK, n, nprog * BLOCK):
        offs = start + tl.arange(0, BLOCK)
        m = offs < n
        x = tl.load(x_ptr + offs, mask=m, other=0.0)
        if KEY_BITS == 16:
            key = (x.to(tl.int16, bitcast=True).to(tl.int32)) & sign_off
        else:
            key = x.to(tl.int32, bitcast=True) & sign_off
        if FIRST:
            match = m
        else:
            match = m & ((key >> (SHIFT + 8)) == prefix)
        digit = (key >> SHIFT) & 255
        hist += tl.histogram(digit, 256, mask=match)
    tl.atomic_add(hist_ptr + tl.arange(0, 256), hist)


@triton.jit
def choose_digit_kernel(hist_ptr, krem_ptr, prefix_ptr, prefix32_ptr):
    """``radix.choose_digit`` in one program: the digit holding the ``*krem``-th largest.

    1. above[d] = keys with digit >= d, from the 256-bin histogram; the digit is the
       largest d with above[d] >= krem.
    2. krem -= keys with a larger digit; prefix = prefix * 256 + d, also as int32 for the
       next digit's histogram; the histogram is zeroed for it.
    """
    d = tl.arange(0, 256)
    h = tl.load(hist_ptr + d).to(tl.int64)
    total = tl.sum(h, axis=0)
    above = total - tl.cumsum(h, axis=0) + h
    krem = tl.load(krem_ptr)
    digit = tl.sum((above >= krem).to(tl.int64), axis=0) - 1
    tl.store(krem_ptr, krem - tl.sum(tl.where(d > digit, h, 0), axis=0))
    prefix = tl.load(prefix_ptr) * 256 + digit
    tl.store(prefix_ptr, prefix)
    tl.store(prefix32_ptr, prefix.to(tl.int32))
    tl.store(hist_ptr + d, tl.zeros((256,), dtype=tl.int32))


@triton.jit
def scatter_add_sorted_kernel(out_ptr, idx_ptr, val_ptr, m, BLOCK: tl.constexpr):
    """out[i] += the run of values of index i, for idx sorted (stably) ascending.

    1. A position starts a run when its index differs from the previous one.
    2. Each run start sums its run in input order, ((out + v0) + v1) + ...,
       reading ahead while the index repeats (a program loops as long as its
       longest run: at most P for gathered records), and writes once. No
       atomics: the result does not depend on scheduling, so every rank and
       every run gets the same bits.
    """
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inb = offs < m
    i = tl.load(idx_ptr + offs, mask=inb, other=-1)
    prev = tl.load(idx_ptr + offs - 1, mask=inb & (offs > 0), other=-1)
    start = inb & (i != prev)
    acc = tl.load(out_ptr + i, mask=start, other=0.0)
    acc += tl.load(val_ptr + offs, mask=start, other=0.0)
    active = start
    d = 1
    more = tl.max(active.to(tl.int32), axis=0)
    while more > 0:
        nxt = offs + d
        ok = active & (nxt < m)
        j = tl.load(idx_ptr + nxt, mask=ok, other=-1)
        ok = ok & (j == i)
        v = tl.load(val_ptr + nxt, mask=ok, other=0.0)
        acc = tl.where(ok, acc + v, acc)  # not acc + 0.0: that would turn -0.0 into +0.0
        active = ok
        d += 1
        more = tl.max(active.to(tl.int32), axis=0)
    tl.store(out_ptr + i, acc, mask=start)


@triton.jit
def count_above_kernel(x_ptr, n, th_ptr, nt, counts_ptr, every, tiles, NT: tl.constexpr, BLOCK: tl.constexpr,
                       TILE: tl.constexpr):
    """counts[j] += #{i : |x_i| >= th[j]} for up to NT thresholds, over the tiles of TILE entries
    starting at multiples of ``every`` TILE (``every`` = 1: every entry), in one pass.

    Each program loops over those ``tiles`` (grid capped at a few waves), compares every
    |x| with every threshold (a BLOCK x NT tile of compares in registers:
    thresholds are few), keeps its counts in registers and adds them to the
    global counts once.
    """
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    tj = tl.arange(0, NT)
    th = tl.load(th_ptr + tj, mask=tj < nt, other=float("inf"))
    acc = tl.zeros((NT,), dtype=tl.int64)
    for q in range(pid.to(tl.int64), tiles, nprog):  # int64: see radix_hist_kernel
        for s in tl.static_range(TILE // BLOCK):
            offs = q * every * TILE + s * BLOCK + tl.arange(0, BLOCK)
            m = offs < n
            x = tl.abs(tl.load(x_ptr + offs, mask=m, other=0.0).to(tl.float32))
            ge = (x[:, None] >= th[None, :]) & m[:, None]
            acc += tl.sum(ge.to(tl.int32), axis=0).to(tl.int64)
    tl.atomic_add(counts_ptr + tj, acc, mask=tj < nt)


@triton.jit
def tally_kernel(val_ptr, count_ptr, capacity, rungs_ptr, nr, bucket_ptr, words_ptr,
                 NT: tl.constexpr, BLOCK: tl.constexpr, FMAX: tl.constexpr, IBITS: tl.constexpr):
    """What the host reads after a fused select, in one pass over its buffer (``kernels.tally``).

    1. The first min(count, capacity) values are kept (``*count_ptr``, left on the device by
       the select); past them a value counts as 0.
    2. words[1] += kept values that are not finite (|v| > FMAX, or NaN).
    3. Per entry, its bucket: the rungs it is not below (NaN: all of them, like
       ``torch.bucketize``); words[2 + j] += entries at or above rung j (a BLOCK x NT tile
       of compares: rungs are few).
    4. With rungs, words[2 + nr] = max over entries of |v|'s bits: for non-negative floats
       the integer order is the numeric order, NaN above all (as ``amax``). Program 0
       writes words[0].
    """
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    count = tl.load(count_ptr)
    inb = offs < capacity
    valid = offs < tl.minimum(count, capacity)
    mag = tl.abs(tl.load(val_ptr + offs, mask=valid, other=0.0))
    bad = tl.sum((valid & ~(mag <= FMAX)).to(tl.int32), axis=0)
    if bad > 0:
        tl.atomic_add(words_ptr + 1, bad.to(tl.int64))
    tj = tl.arange(0, NT)
    th = tl.load(rungs_ptr + tj, mask=tj < nr, other=0.0)
    up = ~(mag[:, None] < th[None, :]) & (tj < nr)[None, :] & inb[:, None]
    tl.store(bucket_ptr + offs, tl.sum(up.to(tl.int32), axis=1).to(tl.int64), mask=inb)
    tl.atomic_add(words_ptr + 2 + tj, tl.sum(up.to(tl.int32), axis=0).to(tl.int64), mask=tj < nr)
    if nr > 0:
        bits = tl.max(tl.where(inb, mag.to(tl.int32 if IBITS == 32 else tl.int64, bitcast=True), 0), axis=0)
        tl.atomic_max(words_ptr + 2 + nr, bits.to(tl.int64))
    if pid == 0:
        tl.store(words_ptr, count)


@triton.jit
def pack_records_kernel(idx_ptr, bits_ptr, out_ptr, count, IB: tl.constexpr, VB: tl.constexpr,
                        BLOCK: tl.constexpr):
    """Records ``(index: IB bytes, value: VB bytes)``, little-endian, one per entry.

    The value arrives as its bit pattern (an integer of VB bytes), so one
    kernel serves every wire dtype; the index is int64 and keeps its low IB
    bytes. One pass: each entry's bytes are written once.
    """
    pid = tl.program_id(0)
    rec = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = rec < count
    i = tl.load(idx_ptr + rec, mask=m, other=0)
    v = tl.load(bits_ptr + rec, mask=m, other=0).to(tl.int64)
    base = out_ptr + rec * (IB + VB)
    for b in tl.static_range(IB):
        tl.store(base + b, ((i >> (8 * b)) & 255).to(tl.uint8), mask=m)
    for b in tl.static_range(VB):
        tl.store(base + IB + b, ((v >> (8 * b)) & 255).to(tl.uint8), mask=m)


@triton.jit
def unpack_records_kernel(rec_ptr, idx_ptr, bits_ptr, count, IB: tl.constexpr, VB: tl.constexpr,
                          BLOCK: tl.constexpr):
    """Inverse of :func:`pack_records_kernel`: int64 indexes and value bit patterns.

    A 2- or 4-byte index is sign-extended, as viewing it as int16/int32 and widening does.
    """
    pid = tl.program_id(0)
    rec = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = rec < count
    base = rec_ptr + rec * (IB + VB)
    i = tl.zeros((BLOCK,), dtype=tl.int64)
    for b in tl.static_range(IB):
        i |= tl.load(base + b, mask=m, other=0).to(tl.int64) << (8 * b)
    if IB == 4:
        i = i.to(tl.int32).to(tl.int64)
    if IB == 2:
        i = i.to(tl.int16).to(tl.int64)
    v = tl.zeros((BLOCK,), dtype=tl.int64)
    for b in tl.static_range(VB):
        v |= tl.load(base + IB + b, mask=m, other=0).to(tl.int64) << (8 * b)
    tl.store(idx_ptr + rec, i, mask=m)
    tl.store(bits_ptr + rec, v.to(bits_ptr.dtype.element_ty), mask=m)


@triton.jit
def _lower_bound(ptr, n, key):
    """First position in the ascending int64 ``ptr[0:n]`` whose value is not below ``key``."""
    lo = n * 0
    hi = n + 0
    while lo < hi:
        mid = (lo + hi) // 2
        below = tl.load(ptr + mid) < key
        lo = tl.where(below, mid + 1, lo)
        hi = tl.where(below, hi, mid)
    return lo


@triton.jit
def pack_blocked_kernel(idx_ptr, bits_ptr, header_ptr, rows_ptr, count, nblocks, base, VB: tl.constexpr,
                        BLOCK: tl.constexpr):
    """A blocked message (``kernels.message``) of the indexes minus ``base``, in one launch.

    1. Program b < nblocks: header[b] = the ascending indexes in base + [b, b + 1) * 65536,
       the difference of two binary searches (``torch.searchsorted``'s lower bounds).
    2. Every other program: BLOCK records, each the index's offset within its block (2
       bytes, little-endian) and the value's VB bytes.
    """
    pid = tl.program_id(0)
    if pid < nblocks:
        lo = _lower_bound(idx_ptr, count, base + pid.to(tl.int64) * 65536)
        hi = _lower_bound(idx_ptr, count, base + (pid.to(tl.int64) + 1) * 65536)
        tl.store(header_ptr + pid, (hi - lo).to(tl.int32))
    else:
        rec = (pid - nblocks).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        m = rec < count
        i = tl.load(idx_ptr + rec, mask=m, other=0) - base
        v = tl.load(bits_ptr + rec, mask=m, other=0).to(tl.int64)
        at = rows_ptr + rec * (2 + VB)
        tl.store(at, (i & 255).to(tl.uint8), mask=m)
        tl.store(at + 1, ((i >> 8) & 255).to(tl.uint8), mask=m)
        for b in tl.static_range(VB):
            tl.store(at + 2 + b, ((v >> (8 * b)) & 255).to(tl.uint8), mask=m)


@triton.jit
def _header_word(header_ptr, j, m):
    """Header entries ``j`` (int32, little-endian, at any byte offset) where ``m``, else 0."""
    w = tl.load(header_ptr + 4 * j, mask=m, other=0).to(tl.int64)
    w |= tl.load(header_ptr + 4 * j + 1, mask=m, other=0).to(tl.int64) << 8
    w |= tl.load(header_ptr + 4 * j + 2, mask=m, other=0).to(tl.int64) << 16
    w |= tl.load(header_ptr + 4 * j + 3, mask=m, other=0).to(tl.int64) << 24
    return w


@triton.jit
def unpack_blocked_kernel(header_ptr, rows_ptr, count, base, idx_ptr, bits_ptr, acc_ptr, VB: tl.constexpr,
                          BLOCK: tl.constexpr, HB: tl.constexpr, ADD: tl.constexpr):
    """Decode a blocked message in one launch: program b decodes block b's entries.

    1. Its first entry is the sum of the header before it (read as bytes: a header inside a
       gathered buffer sits at any byte offset), HB words at a time.
    2. Each of its entries: index = base + b * 65536 + the record's 2-byte offset (unsigned),
       and the value's VB bytes; never past ``count`` (a header that overcounts writes no
       further: on a GPU nothing checks it).
    3. ADD: acc[index] += the value (float32 or float64; indexes are unique in a message, so
       each is one addition, as ``index_add_`` makes it).
    """
    b = tl.program_id(0).to(tl.int64)
    start = b * 0
    for j0 in range(0, b, HB):
        j = j0 + tl.arange(0, HB)
        start += tl.sum(_header_word(header_ptr, j, j < b), axis=0)
    end = tl.minimum(start + _header_word(header_ptr, b, b >= 0), count)
    for i0 in range(start, end, BLOCK):
        rec = i0 + tl.arange(0, BLOCK)
        m = rec < end
        at = rows_ptr + rec * (2 + VB)
        off = tl.load(at, mask=m, other=0).to(tl.int64) | (tl.load(at + 1, mask=m, other=0).to(tl.int64) << 8)
        v = tl.zeros((BLOCK,), dtype=tl.int64)
        for k in tl.static_range(VB):
            v |= tl.load(at + 2 + k, mask=m, other=0).to(tl.int64) << (8 * k)
        tl.store(idx_ptr + rec, base + b * 65536 + off, mask=m)
        tl.store(bits_ptr + rec, v.to(bits_ptr.dtype.element_ty), mask=m)
        if ADD:
            if VB == 4:
                value = v.to(tl.int32).to(tl.float32, bitcast=True)
            else:
                value = v.to(tl.float64, bitcast=True)
            at_acc = acc_ptr + base + b * 65536 + off
            tl.store(at_acc, tl.load(at_acc, mask=m, other=0.0) + value, mask=m)


@triton.jit
def _round_half_even(x):
    # floor + exact fraction (x - floor(x) is exact in float32): floor(x + 0.5)
    # would round 0.49999997 up, and ties must go to the even neighbour like torch.round.
    # The caller's kernel must be launched with enable_fp_fusion=False: fused into an
    # FMA, x - floor(x) would use the unrounded product and round differently.
    fl = tl.floor(x)
    d = x - fl
    odd = (fl - 2.0 * tl.floor(fl * 0.5)) != 0.0
    up = (d > 0.5) | ((d == 0.5) & odd)
    return fl + up.to(tl.float32)


@triton.jit
def encode_codes_kernel(v_ptr, out_ptr, n, nbytes, f, g, BITS: tl.constexpr, BLOCK: tl.constexpr,
                        KEEP: tl.constexpr):
    """BLOCK output bytes of ``kernels.payload.encode_codes``: each gathers its 8/BITS codes.
    With KEEP, each value becomes its quantisation error v - q * g (g = scale / L)."""
    PER: tl.constexpr = 8 // BITS
    LEVELS: tl.constexpr = (1 << (BITS - 1)) - 1
    pid = tl.program_id(0)
    ob = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    j = tl.arange(0, PER)
    i = ob[:, None] * PER + j[None, :]
    m = i < n
    v = tl.load(v_ptr + i, mask=m, other=0.0).to(tl.float32)
    qf = tl.minimum(tl.maximum(_round_half_even(v * f), -LEVELS), LEVELS)
    if KEEP:
        tl.store(v_ptr + i, v - qf * g, mask=m)
    q = qf.to(tl.int32)
    if BITS == 8:
        u = q & 255
    else:
        u = q + (1 << (BITS - 1))
    u = tl.where(m, u, 0) << (j[None, :] * BITS)
    tl.store(out_ptr + ob, tl.sum(u, axis=1).to(tl.uint8), mask=ob < nbytes)


@triton.jit
def decode_codes_kernel(packed_ptr, out_ptr, count, g, BITS: tl.constexpr, BLOCK: tl.constexpr,
                        ACC: tl.constexpr):
    """BLOCK values of ``kernels.payload.decode_codes`` (float32), added to out with ACC."""
    PER: tl.constexpr = 8 // BITS
    pid = tl.program_id(0)
    i = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = i < count
    byte = tl.load(packed_ptr + i // PER, mask=m, other=0).to(tl.int32)
    u = (byte >> ((i % PER).to(tl.int32) * BITS)) & ((1 << BITS) - 1)
    if BITS == 8:
        q = tl.where(u > 127, u - 256, u)
    else:
        q = u - (1 << (BITS - 1))
    x = q.to(tl.float32) * g
    if ACC:
        x += tl.load(out_ptr + i, mask=m, other=0.0)
    tl.store(out_ptr + i, x, mask=m)
