// fp8.cuh: the FP8 row format of moe_comm.fp8 on the device, shared by fp8.cu (the packing
// kernels) and dispatch.cu's quantizing build (QUANTIZE_FP8), so that both give the reference's
// bytes: per block of 128 channels, amax = max |x| in float32 (NaN if any value is NaN), at least
// 1e-4f; scale = amax * FP8_INV_MAX (float32(1/448), passed as its bits); each value float(x) /
// scale (IEEE division), clamped to +-448 (a NaN stays NaN), converted to e4m3 rounding to
// nearest even. The packed row (FP8_PACKED_BYTES, common.cuh): the HIDDEN e4m3 bytes, the
// HIDDEN/128 float32 scales, zeros up to a multiple of 16 bytes.
//
// The e4m3 conversion instructions need sm_89 or newer; older builds compile (moe-comm compile)
// but trap, and moe_comm never launches them there.
#pragma once

#include "common.cuh"

#ifndef FP8_INV_MAX_BITS
#error "compile with -DFP8_INV_MAX_BITS=<the bits of float32(1 / 448)>"
#endif

#define FP8_MAX_VALUE 448.0f
#define FP8_MIN_AMAX 1e-4f

static_assert(HIDDEN % FP8_BLOCK == 0, "FP8 rows need HIDDEN a multiple of 128");

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

// Warp-wide (every lane calls it): the scale of a block of 128 channels held by GROUP aligned
// lanes, N values each (GROUP * N = 128).
template <int GROUP, int N>
__device__ __forceinline__ float fp8_block_scale(const float (&f)[N]) {
    static_assert(GROUP * N == FP8_BLOCK, "a group of lanes holds one block");
    float amax = 0.0f;
    bool nan = false;
#pragma unroll
    for (int e = 0; e < N; ++e) {
        nan |= f[e] != f[e];
        amax = fmaxf(amax, fabsf(f[e]));
    }
#pragma unroll
    for (int offset = GROUP / 2; offset > 0; offset >>= 1) {
        amax = fmaxf(amax, __shfl_xor_sync(FULL_MASK, amax, offset));
        nan |= __shfl_xor_sync(FULL_MASK, static_cast<int>(nan), offset) != 0;
    }
    // fmaxf drops NaN, torch's amax and clamp_min keep it.
    return nan ? __int_as_float(0x7fc00000) : fmaxf(amax, FP8_MIN_AMAX) * __int_as_float(FP8_INV_MAX_BITS);
}

// N values (a multiple of 4) divided by `scale` as N e4m3 bytes, four to a word (first value lowest).
template <int N>
__device__ __forceinline__ void fp8_quantize_words(const float (&f)[N], float scale, u32 (&words)[N / 4]) {
#pragma unroll
    for (int word = 0; word < N / 4; ++word) {
        float v[4];
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const float q = f[4 * word + e] / scale;
            v[e] = q != q ? q : fminf(fmaxf(q, -FP8_MAX_VALUE), FP8_MAX_VALUE);
        }
        words[word] = e4m3x2(v[0], v[1]) | (e4m3x2(v[2], v[3]) << 16);
    }
}
