"""What the numba kernels share: the block size, bit tricks, LLVM intrinsics (non-temporal stores, fences, prefetch) and span cutting."""

from __future__ import annotations

import platform

import numpy as np

from ..dispatch import import_numba

import_numba()

from llvmlite import ir  # noqa: E402  (numba's own dependency)
from numba import njit, types  # noqa: E402
from numba.extending import intrinsic  # noqa: E402

__all__ = ["BLOCK", "PREFETCH_AHEAD", "chunk_bounds"]


# Block of the fused select: one vectorised pass builds a bit mask of the block's
# selections (32 bits: 4 AVX2 vectors of fp32); at density 1% two blocks in three
# hold none and are never looked at again.
BLOCK = 32


# De Bruijn table: the position of the lowest set bit of a 32-bit word in one multiply
# and one lookup (numba has no count-trailing-zeros).
_DEBRUIJN = np.array([0, 1, 28, 2, 29, 14, 24, 3, 30, 22, 20, 15, 25, 17, 4, 8,
                      31, 27, 13, 23, 21, 19, 16, 7, 26, 12, 18, 6, 11, 5, 10, 9], dtype=np.int64)


@njit(nogil=True, cache=True, inline="always")
def _lowest_bit(m):
    """(position of the lowest set bit of uint32 ``m`` != 0, that bit)."""
    low = m & (~m + np.uint32(1))
    return _DEBRUIJN[((low * np.uint32(0x077CB531)) & np.uint32(0xFFFFFFFF)) >> np.uint32(27)], low


@intrinsic
def _stream_zero_block(typingctx, arr, start):
    """arr[start:start + BLOCK] = 0 by non-temporal 32-byte vector stores (``!nontemporal``:
    x86 ``vmovntps``), which skip the read a cached store makes of each line it writes
    and leave the cache to the data the pass reads. &arr[start] must be 32-byte aligned."""
    sig = types.void(arr, start)

    def codegen(context, builder, signature, args):
        arrty = signature.args[0]
        data = context.make_array(arrty)(context, builder, args[0]).data
        elt = context.get_data_type(arrty.dtype)
        lanes = 32 // context.get_abi_sizeof(elt)
        vec = ir.VectorType(elt, lanes)
        nontemporal = builder.module.add_metadata([ir.Constant(ir.IntType(32), 1)])
        for part in range(BLOCK // lanes):
            at = builder.add(args[1], ir.Constant(args[1].type, part * lanes))
            ptr = builder.bitcast(builder.gep(data, [at]), vec.as_pointer())
            builder.store(ir.Constant(vec, None), ptr, align=32).set_metadata("nontemporal", nontemporal)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def _store_fence(typingctx):
    """Orders the non-temporal stores before whatever the thread does next, such as handing
    the span to another thread: x86 ``sfence`` (LLVM's own fence lowers to a locked
    instruction there, which is not documented to drain write-combining buffers), else a
    full fence (``dmb`` on ARM)."""
    def codegen(context, builder, signature, args):
        if platform.machine().lower() in ("x86_64", "amd64", "i386", "i686"):
            sfence = builder.module.declare_intrinsic("llvm.x86.sse.sfence", fnty=ir.FunctionType(ir.VoidType(), []))
            builder.call(sfence, [])
        else:
            builder.fence("seq_cst")
        return context.get_dummy_value()

    return types.void(), codegen


@intrinsic
def _prefetch_for_write(typingctx, arr, i):
    """Start fetching the line of arr[i] for a write (``llvm.prefetch``, x86 ``prefetchw``);
    a hint: it never faults, whatever i is."""
    sig = types.void(arr, i)

    def codegen(context, builder, signature, args):
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        ptr = builder.bitcast(builder.gep(data, [args[1]]), ir.IntType(8).as_pointer())
        i32 = ir.IntType(32)
        fn = builder.module.declare_intrinsic("llvm.prefetch", [ptr.type],
                                              ir.FunctionType(ir.VoidType(), [ptr.type, i32, i32, i32]))
        # (address, write, locality 3: keep in all levels, data cache)
        builder.call(fn, [ptr, ir.Constant(i32, 1), ir.Constant(i32, 3), ir.Constant(i32, 1)])
        return context.get_dummy_value()

    return sig, codegen


# How many writes ahead put_at/add_at fetch: a scattered write into a vector far larger
# than the caches waits for its line, and the core alone keeps too few such misses in
# flight (250k sorted writes into 25M float32: 3.8 ms plain, 2.7-3.0 ms at 16 or 32 ahead).
PREFETCH_AHEAD = 16


def chunk_bounds(n: int, chunks: int, align: int = 64) -> np.ndarray:
    """``chunks + 1`` boundaries cutting ``[0, n)`` into near-equal aligned chunks."""
    step = -(-n // chunks)
    step = -(-step // align) * align
    return np.minimum(np.arange(chunks + 1, dtype=np.int64) * step, n)
