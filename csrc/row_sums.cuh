// row_sums.cuh: the float32 sums of rows that combine (combine.cu) and unpermute (permute.cu) share, so
// that a partial row is the same bits whichever kernel builds it: moe_comm.routing's definition,
// w_k * row rounded, then added, per operation (__fmul_rn / __fadd_rn, no fused multiply-add), from 0.0f.
#pragma once

#include "common.cuh"

#define COMBINE_GROUP 8      // entries whose vectors are loaded at once (one round trip for top-8)

template <int VPL>
__device__ __forceinline__ void zero_acc(float (&acc)[VPL][ELEMS_PER_VEC]) {
#pragma unroll
    for (int u = 0; u < VPL; ++u) {
#pragma unroll
        for (int e = 0; e < ELEMS_PER_VEC; ++e) acc[u][e] = 0.0f;
    }
}

// acc[u][:] += (weighted ? w * row : row) for the VPL vectors of one unit, rounded per operation.
template <int VPL>
__device__ __forceinline__ void accumulate(float (&acc)[VPL][ELEMS_PER_VEC], const Vec16 (&vals)[VPL], float w,
                                           bool weighted, int v0) {
#pragma unroll
    for (int u = 0; u < VPL; ++u) {
        if (v0 + 32 * u < ROW_VECS) {
            float f[ELEMS_PER_VEC];
            unpack16(vals[u], f);
#pragma unroll
            for (int e = 0; e < ELEMS_PER_VEC; ++e) acc[u][e] = __fadd_rn(acc[u][e], weighted ? __fmul_rn(w, f[e]) : f[e]);
        }
    }
}


// Warp-wide: acc += the kept entries' rows of y (kept: bit k set, entry k at row pos_at(k) with
// weight weight_at(k), both warp-uniform), k increasing, for the unit's vectors from v0:
// COMBINE_GROUP rows' loads first, then their ordered sums. before_sums() runs once the first
// group's loads are issued (a wait whose latency they hide).
template <int VPL, typename PosAt, typename WeightAt, typename BeforeSums>
__device__ __forceinline__ void sum_kept_rows(float (&acc)[VPL][ELEMS_PER_VEC], const u8* rows, u32 kept,
                                              PosAt pos_at, WeightAt weight_at, bool weighted, int v0,
                                              BeforeSums before_sums) {
#pragma unroll
    for (int k0 = 0; k0 < TOPK; k0 += COMBINE_GROUP) {
        Vec16 vals[COMBINE_GROUP][VPL];
#pragma unroll
        for (int i = 0; i < COMBINE_GROUP; ++i) {
            const int k = k0 + i;
            if (k < TOPK && ((kept >> k) & 1u)) {
                load_unit<VPL, kUserInput>(rows + static_cast<i64>(pos_at(k)) * ROW_BYTES, vals[i], v0);
            }
        }
        if (k0 == 0) before_sums();
#pragma unroll
        for (int i = 0; i < COMBINE_GROUP; ++i) {
            const int k = k0 + i;
            if (k < TOPK && ((kept >> k) & 1u)) {
                accumulate<VPL>(acc, vals[i], weighted ? weight_at(k) : 1.0f, weighted, v0);
            }
        }
    }
}
