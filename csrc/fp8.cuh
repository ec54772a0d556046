// fp8.cuh: the quantization of moe_comm.fp8 on the GPU, shared by fp8.cu (the packing pass) and
// dispatch.cu (FP8 dispatch quantizing config-dtype rows as it sends them and packing its own
// rows), so both give the bytes of moe_comm.fp8.pack(*moe_comm.fp8.quantize(x)) (round_scale false).
//
// Rows are quantized by units, as the kernels move rows (common.cuh's RowParts, over the e4m3
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

// Warp-wide: unit v0 (RowParts numbering) of the DTYPE row at src_row, quantized: lane l gets
// the e4m3 vectors v0 + 32 u (u < VPL, those < FP8_VECS) in vals and, first in its group, the
// scale of their block in scales[u].
template <int VPL>
__device__ __forceinline__ void quantize_unit(const u8* src_row, Vec16 (&vals)[VPL], float (&scales)[VPL], int v0) {
    const int warp_v0 = v0 & ~31;  // the same for the whole warp: whole parts past the row are skipped
    Vec16 raw[VPL][ELEM_BYTES];    // the ELEM_BYTES DTYPE vectors of an e4m3 vector's 16 channels
#pragma unroll
    for (int u = 0; u < VPL; ++u) {
        const int v = v0 + 32 * u;
#pragma unroll
        for (int i = 0; i < ELEM_BYTES; ++i) {
            raw[u][i] = v < FP8_VECS ? ld16_nc(src_row + (static_cast<i64>(v) * ELEM_BYTES + i) * 16) : zero16();
        }
    }
#pragma unroll
    for (int u = 0; u < VPL; ++u) {
        if (warp_v0 + 32 * u >= FP8_VECS) break;
        float f[16];
#pragma unroll
        for (int i = 0; i < ELEM_BYTES; ++i) {
            float part[ELEMS_PER_VEC];
            unpack16(raw[u][i], part);
#pragma unroll
            for (int e = 0; e < ELEMS_PER_VEC; ++e) f[i * ELEMS_PER_VEC + e] = part[e];
        }
        scales[u] = fp8_block_scale<FP8_GROUP>(f);
        fp8_encode(f, scales[u], vals[u].w);
    }
}

// Warp-wide: unit v0 of row t of an FP8 dispatch's own rows, as quantize_unit gives it (the e4m3
// vectors in vals, each block's scale at the lane first in its group): x's DTYPE rows [T, HIDDEN]
// quantized (scales null), or the pre-quantized pair x [T, HIDDEN] e4m3 and scales [T, HIDDEN /
// FP8_BLOCK] float32 (moe_comm.quantize's format), copied: no pass packs the pair first.
template <int VPL>
__device__ __forceinline__ void fp8_source_unit(const u8* x, const float* scales, i64 t, Vec16 (&vals)[VPL],
                                                float (&block_scales)[VPL], int v0) {
    if (scales == nullptr) {
        quantize_unit<VPL>(x + t * SOURCE_ROW_BYTES, vals, block_scales, v0);
        return;
    }
    const u8* row = x + t * HIDDEN;
    const float* row_scales = scales + t * (HIDDEN / FP8_BLOCK);
#pragma unroll
    for (int u = 0; u < VPL; ++u) {
        const int v = v0 + 32 * u;
        vals[u] = v < FP8_VECS ? ld16_nc(row + static_cast<i64>(v) * 16) : zero16();
        block_scales[u] = v < FP8_VECS && v % FP8_GROUP == 0 ? __ldg(row_scales + v / FP8_GROUP) : 0.0f;
    }
}

// A quantized unit (quantize_unit) into the packed row at dst (local, or a peer's over NVLink):
// its e4m3 vectors, its blocks' scales, and after the row's last scale the zeros up to FP8_ROW_BYTES.
template <int VPL>
__device__ __forceinline__ void store_fp8_unit(u8* dst, const Vec16 (&vals)[VPL], const float (&scales)[VPL], int v0) {
#pragma unroll
    for (int u = 0; u < VPL; ++u) {
        const int v = v0 + 32 * u;
        if (v >= FP8_VECS) continue;
        st16(dst + static_cast<i64>(v) * 16, vals[u]);
        if (v % FP8_GROUP != 0) continue;
        const int block = v / FP8_GROUP;
        *reinterpret_cast<float*>(dst + HIDDEN + 4 * block) = scales[u];
        if (block == HIDDEN / FP8_BLOCK - 1) {
            for (int p = HIDDEN + FP8_SCALE_BYTES; p < FP8_ROW_BYTES; p += 4) *reinterpret_cast<u32*>(dst + p) = 0u;
        }
    }
}

// Warp `warp` of `warps` (every lane calling), one (token, unit) at a time: rows t < num_tokens of
// x [T, HIDDEN] DTYPE into packed [T, FP8_ROW_BYTES] (all of each row's bytes).
template <int VPL>
__device__ __forceinline__ void quantize_rows(const u8* x, int num_tokens, u8* packed, i64 warp, i64 warps) {
    constexpr int kUnitVecs = 32 * VPL;
    constexpr int kParts = (FP8_VECS + kUnitVecs - 1) / kUnitVecs;
    for (i64 unit = warp; unit < static_cast<i64>(num_tokens) * kParts; unit += warps) {
        const i64 t = unit / kParts;
        const int v0 = static_cast<int>(unit - t * kParts) * kUnitVecs + (threadIdx.x & 31);
        Vec16 vals[VPL];
        float scales[VPL];
        quantize_unit<VPL>(x + t * SOURCE_ROW_BYTES, vals, scales, v0);
        store_fp8_unit<VPL>(packed + t * FP8_ROW_BYTES, vals, scales, v0);
    }
}
