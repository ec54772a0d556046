// fp8.cuh: the quantization of moe_comm.fp8 on the GPU, shared by fp8.cu (the packing pass) and
// dispatch.cu (FP8 dispatch quantizing config-dtype rows as it sends them and packing its own
// rows), so both give the bytes of moe_comm.fp8.pack(*moe_comm.fp8.quantize(x)) (round_scale false).
//
// Rows are quantized by units, as the kernels move rows (common.cuh's RowUnits, over the e4m3
// vectors of a packed row): lane l of a warp holds e4m3 vectors v0 + 32 u (u < VPL), each the 16
// channels of ELEM_BYTES DTYPE vectors, so FP8_GROUP aligned lanes hold one block.
//
// Per block of FP8_BLOCK channels: amax = max |x| in float32 (NaN if any value is NaN), at least
// FP8_MIN_AMAX; scale = amax * FP8_INV_MAX (float32(1/448), passed as its bits in the define
// FP8_INV_MAX_BITS); each value float(x) * (1 / scale) (an IEEE reciprocal per block, then one
// rounded multiply per value), clamped to +-448 (a NaN stays NaN), converted to e4m3 rounding to
// nearest even. The row format (FP8_ROW_BYTES) is in common.cuh. Per value that is a conversion,
// a max, a multiply and half a conversion instruction: the arithmetic hides behind the loads.
//
// The e4m3 conversion instructions need sm_89 or newer: builds for older GPUs compile (moe-comm
// compile) but trap if launched; the Python side never launches them there.
#pragma once

#include "common.cuh"

#ifndef FP8_INV_MAX_BITS
#error "compile with -DFP8_INV_MAX_BITS=<bits of float32(1/448)>"
#endif

#define FP8_MIN_AMAX 1e-4f

static_assert(HIDDEN % FP8_BLOCK == 0, "FP8 rows need HIDDEN a multiple of 128");

#define FP8_VECS (HIDDEN / 16)       // 16-byte e4m3 vectors of a packed row; its scales follow them
#define FP8_GROUP (FP8_BLOCK / 16)   // lanes of one block in a unit

// Two float32 values as two e4m3 bytes (lo in the low byte), rounded to nearest even.
__device__ __forceinline__ u32 e4m3x2(float lo, float hi) {
    u16 r = 0;
#if __CUDA_ARCH__ >= 890
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
#else
    __trap();
#endif
    return r;
}

// Two e4m3 bytes (lo in the low byte) as float32, exactly (through f16, which holds every e4m3 value).
__device__ __forceinline__ void e4m3x2_to_f32(u32 two, float& lo, float& hi) {
    u32 halves = 0;
#if __CUDA_ARCH__ >= 890
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(halves) : "h"(static_cast<u16>(two)));
#else
    __trap();
#endif
    lo = f16_to_f32(halves & 0xffffu);
    hi = f16_to_f32(halves >> 16);
}

// max(a, b), NaN if either is NaN (fmaxf drops a NaN; torch's amax and clamp_min keep it).
__device__ __forceinline__ float fmax_nan(float a, float b) {
    float r;
    asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
    return r;
}

// Warp-wide: the scale of a block whose values the GROUP lanes of an aligned group of the warp
// hold, N each. Every lane of the warp calls (the shuffles need them all); a lane whose group
// holds no block passes anything and ignores the result.
template <int GROUP, int N>
__device__ __forceinline__ float fp8_block_scale(const float (&f)[N]) {
    float amax = 0.0f;
#pragma unroll
    for (int e = 0; e < N; ++e) amax = fmax_nan(amax, fabsf(f[e]));
#pragma unroll
    for (int offset = GROUP / 2; offset > 0; offset >>= 1) amax = fmax_nan(amax, __shfl_xor_sync(FULL_MASK, amax, offset));
    return __fmul_rn(fmax_nan(amax, FP8_MIN_AMAX), __int_as_float(FP8_INV_MAX_BITS));
}

// N values (a multiple of 4) of a block with scale `scale` as N e4m3 bytes, four to a word, the
// first value in the lowest byte. The conversion saturates (satfinite): that is the clamp to
// +-448, for infinities too (an inf value of a block whose scale is finite cannot occur: its amax
// is inf; x * (1 / inf) is 0, or NaN for the inf itself, as in the reference).
template <int N>
__device__ __forceinline__ void fp8_encode(const float (&f)[N], float scale, u32 (&words)[N / 4]) {
    const float inverse = __frcp_rn(scale);
#pragma unroll
    for (int word = 0; word < N / 4; ++word) {
        const float* v = f + 4 * word;
        words[word] = e4m3x2(__fmul_rn(v[0], inverse), __fmul_rn(v[1], inverse)) |
                      (e4m3x2(__fmul_rn(v[2], inverse), __fmul_rn(v[3], inverse)) << 16);
    }
}

// The row's scale quad (its blocks 4 * quad .. 4 * quad + 3) that this lane holds in unit v0
// (RowUnits numbering, lane included): the unit's first quad (its first vector / FP8_GROUP is a
// multiple of 4) plus the lane; lanes q < VPL hold one.
__device__ __forceinline__ int scale_quad_of_lane(int v0) {
    return (v0 & ~31) / (4 * FP8_GROUP) + (threadIdx.x & 31);
}

// A unit's scale quads: lane q < VPL holds the scales of the unit's blocks 4q .. 4q + 3
// (scale_quad_of_lane) as one 16-byte vector, a block past the row's last as 0.0f (the zeros that
// follow the scales in a packed row); the other lanes hold nothing. One 16-byte store a lane
// writes a unit's scales (a 4-byte store per block took VPL stores of four lanes each, per
// destination: eight a unit in the expansion). Warp-wide: the quads of a unit whose lanes hold
// scales[u], the scale of the block of their vectors v0 + 32 u (every lane of a group: the
// butterfly of fp8_block_scale).
template <int VPL>
__device__ __forceinline__ Vec16 gather_scale_quads(const float (&scales)[VPL], int v0) {
    const int lane = threadIdx.x & 31;
    const int first = 4 * scale_quad_of_lane(v0);
    Vec16 quad = zero16();
#pragma unroll
    for (int u = 0; u < VPL; ++u) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const u32 bits = __float_as_uint(__shfl_sync(FULL_MASK, scales[u], i * FP8_GROUP));
            if (lane == u) quad.w[i] = bits;
        }
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        if (first + i >= HIDDEN / FP8_BLOCK) quad.w[i] = 0u;
    }
    return quad;
}

// Warp-wide: unit v0 (RowUnits numbering) of the DTYPE row at src_row, quantized: lane l gets
// the e4m3 vectors v0 + 32 u (u < VPL, those < FP8_VECS) in vals, and the unit's scale quads in quad.
template <int VPL>
__device__ __forceinline__ void quantize_unit(const u8* src_row, Vec16 (&vals)[VPL], Vec16& quad, int v0) {
    const int warp_v0 = v0 & ~31;  // the same for the whole warp: whole units past the row are skipped
    Vec16 raw[VPL][ELEM_BYTES];    // the ELEM_BYTES DTYPE vectors of an e4m3 vector's 16 channels
#pragma unroll
    for (int u = 0; u < VPL; ++u) {
        const int v = v0 + 32 * u;
#pragma unroll
        for (int i = 0; i < ELEM_BYTES; ++i) {
            raw[u][i] = v < FP8_VECS ? ld16_nc(src_row + (static_cast<i64>(v) * ELEM_BYTES + i) * 16) : zero16();
        }
    }
    float scales[VPL];
#pragma unroll
    for (int u = 0; u < VPL; ++u) {
        scales[u] = 0.0f;
        if (warp_v0 + 32 * u >= FP8_VECS) continue;
        float f[16];
#pragma unroll
        for (int i = 0; i < ELEM_BYTES; ++i) {
            float elems[ELEMS_PER_VEC];
            unpack16(raw[u][i], elems);
#pragma unroll
            for (int e = 0; e < ELEMS_PER_VEC; ++e) f[i * ELEMS_PER_VEC + e] = elems[e];
        }
        scales[u] = fp8_block_scale<FP8_GROUP>(f);
        fp8_encode(f, scales[u], vals[u].w);
    }
    quad = gather_scale_quads<VPL>(scales, v0);
}

// Warp-wide: unit v0 of row t of an FP8 dispatch's own rows, as quantize_unit gives it (the e4m3
// vectors in vals, the unit's scale quads in quad): x's DTYPE rows [T, HIDDEN] quantized (scales
// null), or the pre-quantized pair x [T, HIDDEN] e4m3 and scales [T, HIDDEN / FP8_BLOCK] float32
// (moe_comm.quantize's format), copied: no pass packs the pair first.
template <int VPL>
__device__ __forceinline__ void fp8_source_unit(const u8* x, const float* scales, i64 t, Vec16 (&vals)[VPL],
                                                Vec16& quad, int v0) {
    if (scales == nullptr) {
        quantize_unit<VPL>(x + t * SOURCE_ROW_BYTES, vals, quad, v0);
        return;
    }
    const u8* row = x + t * HIDDEN;
#pragma unroll
    for (int u = 0; u < VPL; ++u) {
        const int v = v0 + 32 * u;
        vals[u] = v < FP8_VECS ? ld16_nc(row + static_cast<i64>(v) * 16) : zero16();
    }
    // Lane q < VPL loads its scale quad (4-byte loads: a row's scales need not start on 16 bytes).
    const int lane = threadIdx.x & 31;
    const int first = 4 * scale_quad_of_lane(v0);
    const float* row_scales = scales + t * (HIDDEN / FP8_BLOCK);
    quad = zero16();
    if (lane < VPL) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            if (first + i < HIDDEN / FP8_BLOCK) quad.w[i] = __float_as_uint(__ldg(row_scales + first + i));
        }
    }
}

// A quantized unit (quantize_unit) into the packed row at dst (local, or a peer's over NVLink):
// its e4m3 vectors, its scale quads, and after the quad that holds the row's last scale the zero
// quads up to FP8_ROW_BYTES.
template <int VPL>
__device__ __forceinline__ void store_fp8_unit(u8* dst, const Vec16 (&vals)[VPL], const Vec16& quad, int v0) {
#pragma unroll
    for (int u = 0; u < VPL; ++u) {
        const int v = v0 + 32 * u;
        if (v < FP8_VECS) st16(dst + static_cast<i64>(v) * 16, vals[u]);
    }
    constexpr int kLastQuad = (HIDDEN / FP8_BLOCK - 1) / 4;
    const int lane = threadIdx.x & 31;
    const int q = scale_quad_of_lane(v0);
    if (lane < VPL && q <= kLastQuad) {
        st16(dst + HIDDEN + 16 * q, quad);
        if (q == kLastQuad) {
            for (int p = HIDDEN + 16 * (kLastQuad + 1); p < FP8_ROW_BYTES; p += 16) st16(dst + p, zero16());
        }
    }
}

// Warp `warp` of `warps` (every lane calling), one (token, unit) at a time: rows t < num_tokens of
// x [T, HIDDEN] DTYPE into packed [T, FP8_ROW_BYTES] (all of each row's bytes).
template <int VPL>
__device__ __forceinline__ void quantize_rows(const u8* x, int num_tokens, u8* packed, i64 warp, i64 warps) {
    constexpr int kUnitVecs = 32 * VPL;
    constexpr int kUnits = (FP8_VECS + kUnitVecs - 1) / kUnitVecs;
    for (i64 unit = warp; unit < static_cast<i64>(num_tokens) * kUnits; unit += warps) {
        const i64 t = unit / kUnits;
        const int v0 = static_cast<int>(unit - t * kUnits) * kUnitVecs + (threadIdx.x & 31);
        Vec16 vals[VPL];
        Vec16 quad;
        quantize_unit<VPL>(x + t * SOURCE_ROW_BYTES, vals, quad, v0);
        store_fp8_unit<VPL>(packed + t * FP8_ROW_BYTES, vals, quad, v0);
    }
}
