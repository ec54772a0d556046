// fp8.cu: rows into the packed FP8 rows that FP8 dispatch moves, in one pass over the input.
//
// quantize_pack: x [T, HIDDEN] DTYPE -> packed [T, PACKED_BYTES] bytes, bit for bit what
// moe_comm.fp8.pack(*moe_comm.fp8.quantize(x)) gives (round_scale false): per block of 128
// channels, amax = max |x| in float32 (NaN if any value is NaN), at least 1e-4f; scale = amax *
// FP8_INV_MAX (float32(1/448), passed as its bits); each value float(x) / scale (IEEE division),
// clamped to +-448 (a NaN stays NaN), converted to e4m3 rounding to nearest even. The packed row:
// the HIDDEN e4m3 bytes, the HIDDEN/128 float32 scales, zeros up to PACKED_BYTES (a multiple of 16).
// One group of 128 / ELEMS_PER_VEC lanes per block: lane l holds one 16-byte vector of it.
//
// pack_pairs: x_fp8 [T, HIDDEN] e4m3 and scales [T, HIDDEN/128] float32 -> packed [T, PACKED_BYTES]
// (moe_comm.fp8.pack), one thread per 4-byte word of the packed rows.
//
// dequantize_rows: packed rows [N, PACKED_BYTES] -> out [N, HIDDEN] DTYPE, bit for bit what
// moe_comm.fp8.dequantize(*moe_comm.fp8.unpack(packed, HIDDEN), DTYPE) gives: float(e4m3) * scale
// in float32, rounded to DTYPE; one thread per 16-byte vector of the output.
//
// The e4m3 conversion instructions need sm_89 or newer; the Dispatcher uses torch elsewhere.
//
// TOPK is 1 in every build (common.cuh asks for it; these kernels do not use it).
//
// moe_comm-defines: {"DTYPE": "bf16", "HIDDEN": 1024, "TOPK": 1, "FP8_INV_MAX_BITS": 991054117}
// moe_comm-defines: {"DTYPE": "bf16", "HIDDEN": 7168, "TOPK": 1, "FP8_INV_MAX_BITS": 991054117}

#include "common.cuh"

#define FP8_BLOCK 128
#define FP8_MAX_VALUE 448.0f
#define FP8_MIN_AMAX 1e-4f
#define SCALE_BYTES (4 * (HIDDEN / FP8_BLOCK))
#define PACKED_BYTES (HIDDEN + ((SCALE_BYTES + 15) / 16) * 16)
#define GROUP_LANES (FP8_BLOCK / ELEMS_PER_VEC)  // lanes per 128-channel block: 16 for 16-bit rows, 32 for f32

static_assert(HIDDEN % FP8_BLOCK == 0, "FP8 rows need HIDDEN a multiple of 128");

// Two float32 values as two e4m3 bytes (lo in the low byte), rounded to nearest even.
__device__ __forceinline__ u32 e4m3x2(float lo, float hi) {
    u16 r = 0;
#if __CUDA_ARCH__ >= 890
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
#else
    __trap();  // builds for older GPUs compile (moe-comm compile), but are never launched there
#endif
    return r;
}

extern "C" __global__ void quantize_pack(const void* __restrict__ x, int num_tokens, u8* __restrict__ packed) {
    constexpr int kGroupsPerWarp = 32 / GROUP_LANES;
    const int lane_in_group = threadIdx.x % GROUP_LANES;
    const i64 groups = static_cast<i64>(num_tokens) * (HIDDEN / FP8_BLOCK);
    const i64 warps = static_cast<i64>(gridDim.x) * (blockDim.x / 32);
    const float inv_max = __int_as_float(FP8_INV_MAX_BITS);
    // Whole warps go round the loop together (the shuffles need every lane); a group past the end
    // computes on zeros and stores nothing.
    for (i64 w = static_cast<i64>(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32; w * kGroupsPerWarp < groups;
         w += warps) {
        const i64 g = w * kGroupsPerWarp + (threadIdx.x % 32) / GROUP_LANES;
        const bool active = g < groups;
        const i64 t = active ? g / (HIDDEN / FP8_BLOCK) : 0;
        const int b = active ? static_cast<int>(g - t * (HIDDEN / FP8_BLOCK)) : 0;
        const int c0 = b * FP8_BLOCK + lane_in_group * ELEMS_PER_VEC;
        float f[ELEMS_PER_VEC];
        unpack16(active ? ld16_nc(static_cast<const u8*>(x) + (t * HIDDEN + c0) * ELEM_BYTES) : zero16(), f);
        float amax = 0.0f;
        bool nan = false;
#pragma unroll
        for (int e = 0; e < ELEMS_PER_VEC; ++e) {
            nan |= f[e] != f[e];
            amax = fmaxf(amax, fabsf(f[e]));
        }
#pragma unroll
        for (int offset = GROUP_LANES / 2; offset > 0; offset >>= 1) {
            amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, offset));
            nan |= __shfl_xor_sync(0xffffffffu, static_cast<int>(nan), offset) != 0;
        }
        if (!active) continue;
        // fmaxf drops NaN, torch's amax and clamp_min keep it.
        const float scale = nan ? __int_as_float(0x7fc00000) : fmaxf(amax, FP8_MIN_AMAX) * inv_max;
        u8* row = packed + t * PACKED_BYTES;
        u32 bytes[ELEMS_PER_VEC / 4];
#pragma unroll
        for (int word = 0; word < ELEMS_PER_VEC / 4; ++word) {
            float v[4];
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const float q = f[4 * word + e] / scale;
                v[e] = q != q ? q : fminf(fmaxf(q, -FP8_MAX_VALUE), FP8_MAX_VALUE);
            }
            bytes[word] = e4m3x2(v[0], v[1]) | (e4m3x2(v[2], v[3]) << 16);
        }
#if ELEMS_PER_VEC == 8
        *reinterpret_cast<u64*>(row + c0) = static_cast<u64>(bytes[0]) | (static_cast<u64>(bytes[1]) << 32);
#else
        *reinterpret_cast<u32*>(row + c0) = bytes[0];
#endif
        if (lane_in_group == 0) {
            *reinterpret_cast<float*>(row + HIDDEN + 4 * b) = scale;
            if (b == 0) {
                for (int p = HIDDEN + SCALE_BYTES; p < PACKED_BYTES; p += 4) *reinterpret_cast<u32*>(row + p) = 0u;
            }
        }
    }
}

// Two e4m3 bytes (lo in the low byte) as float32, exactly (through f16, which holds every e4m3 value).
__device__ __forceinline__ void e4m3x2_to_f32(u32 two, float& lo, float& hi) {
    u32 halves = 0;
#if __CUDA_ARCH__ >= 890
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(halves) : "h"(static_cast<u16>(two)));
#else
    __trap();  // as e4m3x2 above
#endif
    lo = f16_to_f32(halves & 0xffffu);
    hi = f16_to_f32(halves >> 16);
}

extern "C" __global__ void dequantize_rows(const u8* __restrict__ packed, int num_rows, void* __restrict__ out) {
    constexpr int kRowVecs = HIDDEN / ELEMS_PER_VEC;
    const i64 vectors = static_cast<i64>(num_rows) * kRowVecs;
    for (i64 i = static_cast<i64>(blockIdx.x) * blockDim.x + threadIdx.x; i < vectors;
         i += static_cast<i64>(gridDim.x) * blockDim.x) {
        const i64 r = i / kRowVecs;
        const int c0 = static_cast<int>(i - r * kRowVecs) * ELEMS_PER_VEC;
        const u8* row = packed + r * PACKED_BYTES;
        const float scale = *reinterpret_cast<const float*>(row + HIDDEN + 4 * (c0 / FP8_BLOCK));
        float f[ELEMS_PER_VEC];
#if ELEMS_PER_VEC == 8
        const u64 bytes = *reinterpret_cast<const u64*>(row + c0);
#else
        const u64 bytes = *reinterpret_cast<const u32*>(row + c0);
#endif
#pragma unroll
        for (int e = 0; e < ELEMS_PER_VEC; e += 2) {
            float lo, hi;
            e4m3x2_to_f32(static_cast<u32>(bytes >> (8 * e)) & 0xffffu, lo, hi);
            f[e] = __fmul_rn(lo, scale);
            f[e + 1] = __fmul_rn(hi, scale);
        }
        st16(static_cast<u8*>(out) + (r * HIDDEN + c0) * ELEM_BYTES, pack16(f));
    }
}

extern "C" __global__ void pack_pairs(const u8* __restrict__ x_fp8, const float* __restrict__ scales, int num_tokens,
                                      u8* __restrict__ packed) {
    const i64 words = static_cast<i64>(num_tokens) * (PACKED_BYTES / 4);
    for (i64 i = static_cast<i64>(blockIdx.x) * blockDim.x + threadIdx.x; i < words;
         i += static_cast<i64>(gridDim.x) * blockDim.x) {
        const i64 t = i / (PACKED_BYTES / 4);
        const int p = 4 * static_cast<int>(i - t * (PACKED_BYTES / 4));
        u32 word = 0u;
        if (p < HIDDEN) {
            word = *reinterpret_cast<const u32*>(x_fp8 + t * HIDDEN + p);
        } else if (p < HIDDEN + SCALE_BYTES) {
            word = __float_as_uint(scales[t * (HIDDEN / FP8_BLOCK) + (p - HIDDEN) / 4]);
        }
        *reinterpret_cast<u32*>(packed + t * PACKED_BYTES + p) = word;
    }
}
