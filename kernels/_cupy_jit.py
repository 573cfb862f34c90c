"""CUDA C source of the CuPy kernels behind ``kernels.cupy_backend`` (no imports of cupy).

:data:`CUDA_SOURCE` is compiled just in time by CuPy's NVRTC
(``cupy_backend``) and, without a GPU, by nvcc in the tests for sm_80/sm_90.
The launch constants baked into the source live here; the launch shapes
that are only launch arguments live in ``cupy_backend``.
"""

from __future__ import annotations

import torch

__all__ = ["CUDA_SOURCE", "SELECT_THREADS", "SELECT_ITEMS", "GRAD_TYPES", "RES_TYPES"]

SELECT_THREADS = 256
SELECT_ITEMS = 16    # per thread: a 4096-element tile per block, like the Triton kernel

GRAD_TYPES = {torch.float32: ("float", "f32"), torch.float16: ("__half", "f16"),
               torch.bfloat16: ("__nv_bfloat16", "bf16"), torch.float64: ("double", "f64")}
RES_TYPES = {torch.float32: ("float", "f32"), torch.float64: ("double", "f64")}

_HEAD = r"""
#include <cuda_fp16.h>
#include <cuda_bf16.h>

#define SELECT_THREADS %(threads)d
#define SELECT_ITEMS %(items)d
#define SELECT_TILE (SELECT_THREADS * SELECT_ITEMS)

template <typename R> __device__ __forceinline__ R widen(float v) { return (R)v; }
template <typename R> __device__ __forceinline__ R widen(double v) { return (R)v; }
template <typename R> __device__ __forceinline__ R widen(__half v) { return (R)__half2float(v); }
template <typename R> __device__ __forceinline__ R widen(__nv_bfloat16 v) { return (R)__bfloat162float(v); }

// A thread's SELECT_ITEMS consecutive elements in 16-byte loads when the run is
// whole and aligned (every tile but the last, for tensors from the allocator),
// else element by element with zeros past n. One 16-byte load per 4 floats
// instead of 4 loads: a warp's 32 threads then read whole 32-byte sectors.
template <typename T>
__device__ __forceinline__ void load_items(const T* p, long long base, long long n,
                                           T (&v)[SELECT_ITEMS]) {
    const T* q = p + base;
    if (base + SELECT_ITEMS <= n && (reinterpret_cast<unsigned long long>(q) & 15ull) == 0) {
        constexpr int VEC = SELECT_ITEMS * sizeof(T) / 16;
        uint4 w[VEC];
#pragma unroll
        for (int k = 0; k < VEC; ++k) w[k] = reinterpret_cast<const uint4*>(q)[k];
        memcpy(v, w, sizeof(w));  // a register move after unrolling
    } else {
#pragma unroll
        for (int j = 0; j < SELECT_ITEMS; ++j) v[j] = base + j < n ? q[j] : (T)0.0f;
    }
}

template <typename T>
__device__ __forceinline__ void store_items(T* p, long long base, long long n,
                                            const T (&v)[SELECT_ITEMS]) {
    T* q = p + base;
    if (base + SELECT_ITEMS <= n && (reinterpret_cast<unsigned long long>(q) & 15ull) == 0) {
        constexpr int VEC = SELECT_ITEMS * sizeof(T) / 16;
        uint4 w[VEC];
        memcpy(w, v, sizeof(w));
#pragma unroll
        for (int k = 0; k < VEC; ++k) reinterpret_cast<uint4*>(q)[k] = w[k];
    } else {
#pragma unroll
        for (int j = 0; j < SELECT_ITEMS; ++j) if (base + j < n) q[j] = v[j];
    }
}

// Fused error-feedback select for one 4096-element tile (see ef_select_cupy).
template <typename G, typename R>
__device__ __forceinline__ void ef_select_tile(
    const G* __restrict__ g, R* __restrict__ r, long long* __restrict__ out_idx,
    R* __restrict__ out_val, unsigned long long* status, unsigned int* ticket,
    long long n, R scale, R th, long long capacity, int zero)
{
    __shared__ unsigned int s_tile;
    __shared__ long long s_warp[SELECT_THREADS / 32];
    __shared__ long long s_excl;
    // Tile numbers from a ticket, not blockIdx: a block only waits for tiles
    // whose blocks already started, so the look-back cannot deadlock.
    if (threadIdx.x == 0) s_tile = atomicAdd(ticket, 1u);
    __syncthreads();
    const long long tile = s_tile;
    const long long base = tile * SELECT_TILE + (long long)threadIdx.x * SELECT_ITEMS;
    R acc[SELECT_ITEMS];
    G gv[SELECT_ITEMS];
    load_items<R>(r, base, n, acc);
    load_items<G>(g, base, n, gv);
    unsigned int sel = 0;
    int cnt = 0;
#pragma unroll
    for (int j = 0; j < SELECT_ITEMS; ++j) {
        // Past n both loads gave 0, so acc is 0 and never selected. A non-finite acc (NaN,
        // Inf, an overflowing sum) is always selected (NaN fails every comparison) and
        // leaves r as it was, so the caller sees it in the output and can undo the call
        // (kernels.ef_select).
        const R a = acc[j] + scale * widen<R>(gv[j]);
        const bool s = (a != (R)0) && !(fabs(a) < th);
        sel |= (unsigned int)s << j;
        cnt += s;
        acc[j] = a;
    }
    // Block-wide exclusive scan of per-thread counts: warp shuffles, then warp totals.
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    long long incl = cnt;
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
        const long long v = __shfl_up_sync(0xffffffffu, incl, d);
        if (lane >= d) incl += v;
    }
    if (lane == 31) s_warp[warp] = incl;
    __syncthreads();
    long long warp_off = 0, total = 0;
#pragma unroll
    for (int w = 0; w < SELECT_THREADS / 32; ++w) {
        if (w < warp) warp_off += s_warp[w];
        total += s_warp[w];
    }
    // Decoupled look-back (one thread): status words are value << 2 | flag,
    // flag 1 = this tile's count, 2 = inclusive prefix.
    if (threadIdx.x == 0) {
        long long excl = 0;
        if (tile == 0) {
            atomicExch(status, ((unsigned long long)total << 2) | 2ull);
        } else {
            atomicExch(status + tile, ((unsigned long long)total << 2) | 1ull);
            long long j = tile - 1;
            while (true) {
                const unsigned long long w = atomicAdd(status + j, 0ull);  // coherent read
                const unsigned int f = (unsigned int)(w & 3ull);
                if (f == 0) continue;
                excl += (long long)(w >> 2);
                if (f == 2) break;
                --j;
            }
            atomicExch(status + tile, ((unsigned long long)(excl + total) << 2) | 2ull);
        }
        s_excl = excl;
    }
    __syncthreads();
    long long pos = s_excl + warp_off + incl - cnt;
#pragma unroll
    for (int j = 0; j < SELECT_ITEMS; ++j) {
        if ((sel >> j) & 1u) {
            const bool f = isfinite(acc[j]);
            if (pos < capacity) {
                out_idx[pos] = base + j;
                out_val[pos] = acc[j];
                if (zero && f) acc[j] = (R)0;
            }
            if (!f) acc[j] = r[base + j];  // rare: the old residual, not yet overwritten in memory
            ++pos;
        }
    }
    store_items<R>(r, base, n, acc);
}

// Histogram of one 8-bit digit of sign-less keys matching a prefix (see kth_largest_cupy).
template <typename K>
__device__ __forceinline__ void radix_hist_body(
    const K* __restrict__ x, long long n, const int* __restrict__ prefix_p,
    unsigned int* __restrict__ hist, int shift, int first, unsigned int keymask)
{
    __shared__ unsigned int h[256];
    for (int t = threadIdx.x; t < 256; t += blockDim.x) h[t] = 0;
    __syncthreads();
    const unsigned int prefix = (unsigned int)*prefix_p;
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        const unsigned int key = (unsigned int)x[i] & keymask;
        // Shared-memory atomics: cheap, and one global add per bin per block.
        if (first || (key >> (shift + 8)) == prefix) atomicAdd(&h[(key >> shift) & 255u], 1u);
    }
    __syncthreads();
    for (int t = threadIdx.x; t < 256; t += blockDim.x)
        if (h[t]) atomicAdd(hist + t, h[t]);
}

extern "C" __global__ void radix_hist_u32(const unsigned int* x, long long n, const int* prefix,
                                          unsigned int* hist, int shift, int first) {
    radix_hist_body<unsigned int>(x, n, prefix, hist, shift, first, 0x7fffffffu);
}
// counts[j] += #{i : |x_i| >= th[j]} for nt <= COUNT_MAX descending thresholds (see count_above_cupy).
#define COUNT_MAX 16
template <typename X>
__device__ __forceinline__ void count_above_body(
    const X* __restrict__ x, long long n, const float* __restrict__ th, int nt,
    unsigned long long* __restrict__ counts)
{
    __shared__ unsigned long long s_counts[COUNT_MAX];
    __shared__ float s_th[COUNT_MAX];
    if (threadIdx.x < COUNT_MAX) {
        s_counts[threadIdx.x] = 0;
        s_th[threadIdx.x] = threadIdx.x < nt ? th[threadIdx.x] : __int_as_float(0x7f800000);
    }
    __syncthreads();
    unsigned int c[COUNT_MAX];
#pragma unroll
    for (int j = 0; j < COUNT_MAX; ++j) c[j] = 0;
    const float last = s_th[nt - 1];
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        const float v = fabsf(widen<float>(x[i]));
        if (v >= last) {  // rare: most entries are below the smallest threshold
#pragma unroll
            for (int j = 0; j < COUNT_MAX; ++j) c[j] += (v >= s_th[j]);
        }
    }
#pragma unroll
    for (int j = 0; j < COUNT_MAX; ++j)
        if (j < nt && c[j]) atomicAdd(&s_counts[j], (unsigned long long)c[j]);
    __syncthreads();
    if (threadIdx.x < nt && s_counts[threadIdx.x]) atomicAdd(counts + threadIdx.x, s_counts[threadIdx.x]);
}

#define COUNT_ENTRY(NAME, X) \
extern "C" __global__ void NAME(const X* x, long long n, const float* th, int nt, \
                                unsigned long long* counts) { \
    count_above_body<X>(x, n, th, nt, counts); \
}
COUNT_ENTRY(count_above_f32, float)
COUNT_ENTRY(count_above_f16, __half)
COUNT_ENTRY(count_above_bf16, __nv_bfloat16)

// COO records (index: IB bytes, value: VB bytes, little-endian), one thread per record.
template <int IB, int VB>
__device__ __forceinline__ void pack_body(const long long* __restrict__ idx,
                                          const unsigned char* __restrict__ bits,
                                          unsigned char* __restrict__ out, long long count) {
    const long long r = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= count) return;
    const unsigned long long i = (unsigned long long)idx[r];
    unsigned char* o = out + r * (IB + VB);
#pragma unroll
    for (int b = 0; b < IB; ++b) o[b] = (unsigned char)(i >> (8 * b));
#pragma unroll
    for (int b = 0; b < VB; ++b) o[IB + b] = bits[r * VB + b];
}

template <int IB, int VB>
__device__ __forceinline__ void unpack_body(const unsigned char* __restrict__ rec,
                                            long long* __restrict__ idx,
                                            unsigned char* __restrict__ bits, long long count) {
    const long long r = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= count) return;
    const unsigned char* p = rec + r * (IB + VB);
    unsigned long long i = 0;
#pragma unroll
    for (int b = 0; b < IB; ++b) i |= (unsigned long long)p[b] << (8 * b);
    // A 2- or 4-byte index is sign-extended, as viewing it as int16/int32 and widening does.
    idx[r] = IB == 2 ? (long long)(short)(unsigned short)i
           : IB == 4 ? (long long)(int)(unsigned int)i : (long long)i;
#pragma unroll
    for (int b = 0; b < VB; ++b) bits[r * VB + b] = p[IB + b];
}

#define RECORD_ENTRIES(IB, VB) \
extern "C" __global__ void pack_i##IB##_v##VB(const long long* idx, const unsigned char* bits, \
                                             unsigned char* out, long long count) { \
    pack_body<IB, VB>(idx, bits, out, count); \
} \
extern "C" __global__ void unpack_i##IB##_v##VB(const unsigned char* rec, long long* idx, \
                                               unsigned char* bits, long long count) { \
    unpack_body<IB, VB>(rec, idx, bits, count); \
}
RECORD_ENTRIES(2, 1) RECORD_ENTRIES(2, 2) RECORD_ENTRIES(2, 4) RECORD_ENTRIES(2, 8)
RECORD_ENTRIES(4, 1) RECORD_ENTRIES(4, 2) RECORD_ENTRIES(4, 4) RECORD_ENTRIES(4, 8)
RECORD_ENTRIES(8, 1) RECORD_ENTRIES(8, 2) RECORD_ENTRIES(8, 4) RECORD_ENTRIES(8, 8)

// Quantise with a factor and pack 8/BITS codes per byte (see kernels.payload.encode_codes);
// one thread per output byte. rintf rounds half to even, like torch.round.
template <int BITS>
__device__ __forceinline__ void encode_codes_body(const float* __restrict__ v, unsigned char* __restrict__ out,
                                                  long long n, long long nbytes, float f) {
    const long long b = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (b >= nbytes) return;
    constexpr int PER = 8 / BITS;
    constexpr float LEVELS = (float)((1 << (BITS - 1)) - 1);
    unsigned int acc = 0;
#pragma unroll
    for (int j = 0; j < PER; ++j) {
        const long long i = b * PER + j;
        if (i < n) {
            const int q = (int)fminf(fmaxf(rintf(v[i] * f), -LEVELS), LEVELS);
            acc |= (BITS == 8 ? (unsigned int)(q & 255) : (unsigned int)(q + (1 << (BITS - 1)))) << (BITS * j);
        }
    }
    out[b] = (unsigned char)acc;
}

template <int BITS>
__device__ __forceinline__ void decode_codes_body(const unsigned char* __restrict__ packed,
                                                  float* __restrict__ out, long long count, float g) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= count) return;
    constexpr int PER = 8 / BITS;
    const int u = (packed[i / PER] >> (BITS * (int)(i %% PER))) & ((1 << BITS) - 1);
    const int q = BITS == 8 ? (u > 127 ? u - 256 : u) : u - (1 << (BITS - 1));
    out[i] = (float)q * g;
}

#define CODES_ENTRIES(BITS) \
extern "C" __global__ void encode_codes_b##BITS(const float* v, unsigned char* out, long long n, \
                                                long long nbytes, float f) { \
    encode_codes_body<BITS>(v, out, n, nbytes, f); \
} \
extern "C" __global__ void decode_codes_b##BITS(const unsigned char* packed, float* out, \
                                                long long count, float g) { \
    decode_codes_body<BITS>(packed, out, count, g); \
}
CODES_ENTRIES(2) CODES_ENTRIES(4) CODES_ENTRIES(8)

// Deterministic scatter-add of stably sorted indexes (see scatter_add_sorted_cupy).
template <typename T>
__device__ __forceinline__ void scatter_add_sorted_body(
    T* __restrict__ out, const long long* __restrict__ idx, const T* __restrict__ val, long long m)
{
    const long long p = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (p >= m) return;
    const long long i = idx[p];
    if (p > 0 && idx[p - 1] == i) return;  // not the first of its run
    T acc = out[i] + val[p];
    // In input order, like a sequential loop: no atomics, so the same bits every run.
    for (long long q = p + 1; q < m && idx[q] == i; ++q) acc += val[q];
    out[i] = acc;
}

extern "C" __global__ void scatter_add_sorted_f32(float* out, const long long* idx, const float* val,
                                                  long long m) {
    scatter_add_sorted_body<float>(out, idx, val, m);
}
extern "C" __global__ void scatter_add_sorted_f64(double* out, const long long* idx, const double* val,
                                                  long long m) {
    scatter_add_sorted_body<double>(out, idx, val, m);
}

extern "C" __global__ void radix_hist_u16(const unsigned short* x, long long n, const int* prefix,
                                          unsigned int* hist, int shift, int first) {
    radix_hist_body<unsigned short>(x, n, prefix, hist, shift, first, 0x7fffu);
}
"""

_SELECT_ENTRY = r"""
extern "C" __global__ void __launch_bounds__(SELECT_THREADS)
ef_select_%(gn)s_%(rn)s(const %(gt)s* g, %(rt)s* r, long long* out_idx, %(rt)s* out_val,
                        unsigned long long* status, unsigned int* ticket, long long n,
                        %(rt)s scale, %(rt)s th, long long capacity, int zero) {
    ef_select_tile<%(gt)s, %(rt)s>(g, r, out_idx, out_val, status, ticket, n, scale, th,
                                   capacity, zero);
}
"""


def _source() -> str:
    parts = [_HEAD % {"threads": SELECT_THREADS, "items": SELECT_ITEMS}]
    for gt, gn in GRAD_TYPES.values():
        for rt, rn in RES_TYPES.values():
            parts.append(_SELECT_ENTRY % {"gt": gt, "gn": gn, "rt": rt, "rn": rn})
    return "".join(parts)


CUDA_SOURCE = _source()
