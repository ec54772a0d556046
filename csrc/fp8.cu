// fp8.cu: rows into the packed FP8 rows that FP8 dispatch moves, in one pass over the input.
//
// quantize_pack: x [T, HIDDEN] DTYPE -> packed [T, FP8_ROW_BYTES] bytes, bit for bit what
// moe_comm.fp8.pack(*moe_comm.fp8.quantize(x)) gives (round_scale false; the math is fp8.cuh's).
// The packed row: the HIDDEN e4m3 bytes, the HIDDEN/128 float32 scales, zeros up to FP8_ROW_BYTES
// (a multiple of 64). One warp per (token, unit of FP8_UNIT_VPL e4m3 vectors per lane). The
// backends whose dispatch kernels quantize as they send (dispatch.cu built with FP8_ROWS) do not
// need this pass; the collective backends do.
//
// pack_pairs: x_fp8 [T, HIDDEN] e4m3 and scales [T, HIDDEN/128] float32 -> packed [T, FP8_ROW_BYTES]
// (moe_comm.fp8.pack), one thread per 4-byte word of the packed rows.
//
// dequantize_rows: packed rows [N, FP8_ROW_BYTES] -> out [N, HIDDEN] DTYPE, bit for bit what
// moe_comm.fp8.dequantize(*moe_comm.fp8.unpack(packed, HIDDEN), DTYPE) gives: float(e4m3) * scale
// in float32, rounded to DTYPE; one thread per 16-byte vector of the output. With `end` (an int32
// in device memory: a dispatch output's expert_offsets[-1], the rows it fills) only the rows below
// min(N, *end); the others are left as they were (a dispatch output's rows there are unspecified,
// and a grid sized for N reads the bound itself, so the call needs no host sync and replays in a
// graph with a different bound every step).
//
// TOPK is 1 in every build (common.cuh asks for it; these kernels do not use it).
//
// moe_comm-defines: {"DTYPE": "bf16", "HIDDEN": 1024, "TOPK": 1, "FP8_INV_MAX_BITS": 991054117}
// moe_comm-defines: {"DTYPE": "bf16", "HIDDEN": 7168, "TOPK": 1, "FP8_INV_MAX_BITS": 991054117}

#include "common.cuh"
#include "fp8.cuh"

extern "C" __global__ void quantize_pack(const void* __restrict__ x, int num_tokens, u8* __restrict__ packed) {
    const i64 warps_per_block = blockDim.x >> 5;
    quantize_rows<FP8_UNIT_VPL>(static_cast<const u8*>(x), num_tokens, packed,
                                static_cast<i64>(blockIdx.x) * warps_per_block + (threadIdx.x >> 5),
                                static_cast<i64>(gridDim.x) * warps_per_block);
}

extern "C" __global__ void dequantize_rows(const u8* __restrict__ packed, int num_rows, const i32* __restrict__ end,
                                           void* __restrict__ out) {
    constexpr int kRowVecs = HIDDEN / ELEMS_PER_VEC;
    const int rows = end == nullptr ? num_rows : min(num_rows, max(*end, 0));
    const i64 vectors = static_cast<i64>(rows) * kRowVecs;
    for (i64 i = static_cast<i64>(blockIdx.x) * blockDim.x + threadIdx.x; i < vectors;
         i += static_cast<i64>(gridDim.x) * blockDim.x) {
        const i64 r = i / kRowVecs;
        const int c0 = static_cast<int>(i - r * kRowVecs) * ELEMS_PER_VEC;
        const u8* row = packed + r * FP8_ROW_BYTES;
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
    const i64 words = static_cast<i64>(num_tokens) * (FP8_ROW_BYTES / 4);
    for (i64 i = static_cast<i64>(blockIdx.x) * blockDim.x + threadIdx.x; i < words;
         i += static_cast<i64>(gridDim.x) * blockDim.x) {
        const i64 t = i / (FP8_ROW_BYTES / 4);
        const int p = 4 * static_cast<int>(i - t * (FP8_ROW_BYTES / 4));
        u32 word = 0u;
        if (p < HIDDEN) {
            word = *reinterpret_cast<const u32*>(x_fp8 + t * HIDDEN + p);
        } else if (p < HIDDEN + FP8_SCALE_BYTES) {
            word = __float_as_uint(scales[t * (HIDDEN / FP8_BLOCK) + (p - HIDDEN) / 4]);
        }
        *reinterpret_cast<u32*>(packed + t * FP8_ROW_BYTES + p) = word;
    }
}
