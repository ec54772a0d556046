// permute.cu: the two local conversions of the token-major layout, on the caller's stream with every
// SM: permute_rows (token-major rows -> dispatch's expert-major layout) and unpermute_rows
// (expert-major expert outputs -> one weighted sum per slab row). Launched by
// moe_comm/cuda/kernels.py's PermuteKernels.
//
// Protocol: nothing crosses a rank. Both kernels read and write this rank's memory only, behind the
// kernels before them on the stream: no flag, epoch, status word or wait, and no block waits for
// another, so any grid works (a block with no batch and no padding ends at once). Every value that
// changes from call to call is read from device memory as the kernel runs (the rows, recv_pos,
// recv_weight, expert_offsets, tokens_per_expert); the arguments are addresses and static sizes, so
// a graph replay after those tensors were rewritten in place converts the new routing.
//   permute_rows: rows [W * M, ROW_BYTES] (slab row g = s * M + t holds token t of source s: DTYPE
//     rows, or packed FP8 rows in the FP8_ROWS build, moved as bytes) -> out [capacity_rows,
//     ROW_BYTES]: out[recv_pos[g, k]] = rows[g] for every kept entry (0 <= pos < capacity_rows),
//     copied by the one warp that holds the row's unit (kept positions are distinct rows). With
//     zero_pad (Config.zero_padding) every segment's padding rows [start_j + tokens_per_expert[j],
//     expert_offsets[j]) below capacity_rows are zeroed, evict-first (expand.cuh's zero_padding,
//     as dispatch zeroes them). Nothing else is written: moe_comm.routing.expand_rows on every row
//     below expert_offsets[-1] (without zero_pad: on every kept row).
//   unpermute_rows (DTYPE builds only: expert outputs are never FP8): y [capacity_rows, HIDDEN] ->
//     out [W * M, HIDDEN]: for every slab row g with a kept entry,
//         out[g] = dtype(sum over kept k, k increasing, of w_k * float(y[recv_pos[g, k]]))
//     (w = recv_weight [W * M, K]; a null recv_weight: unweighted, w_k = 1 and no multiply), by
//     row_sums.cuh's sum_kept_rows, the sum combine's send phase computes: bit for bit that partial
//     row (moe_comm.routing.reduce_partials). Rows with no kept entry are not written.
// Both scan the slab rows in interleaved batches (common.cuh's RowBatch): a block loads a batch's
// positions (and weights) once and lists the rows with a kept entry, so the many rows that carry
// nothing here (slab rows past a source's T, tokens sent elsewhere) cost one load of K positions each.
//
// moe_comm-defines: {"DTYPE": "bf16", "HIDDEN": 7168, "TOPK": 8}
// moe_comm-defines: {"DTYPE": "bf16", "HIDDEN": 7168, "TOPK": 8, "FP8_ROWS": 1, "FP8_INV_MAX_BITS": 991054117}

#include "common.cuh"
#include "expand.cuh"
#include "row_sums.cuh"

#if TOKEN_MAJOR
#error "permute.cu lays rows out expert-major (expand.cuh's for_each_target_row): build it without TOKEN_MAJOR"
#endif

// Permute's 16-byte vectors per lane per unit: one load round of a unit feeds up to K row stores.
#define PERMUTE_VPL 4

// Block-wide: body(r, row_unit) for every unit (RowUnits<VPL>) of every slab row of [0, num_slab_rows)
// with a kept entry, r its batch row in `batch` (positions, weights when recv_weight is not null);
// one warp per unit.
template <int VPL, typename Body>
__device__ __forceinline__ void for_each_kept_row_unit(RowBatch& batch, int num_slab_rows, const i32* recv_pos,
                                                       const float* recv_weight, Body body) {
    typedef RowUnits<VPL> Units;
    const int warps = blockDim.x >> 5;
    const BatchShape shape = batch_shape(num_slab_rows, gridDim.x);
    for (i64 q = blockIdx.x; q < shape.count; q += gridDim.x) {
        const int listed = block_load_batch(batch, recv_pos, recv_weight, shape, q, 0);
        for (int unit = threadIdx.x >> 5; unit < listed * Units::kPerRow; unit += warps) {
            const int r = batch.list[unit / Units::kPerRow];
            body(r, unit - (unit / Units::kPerRow) * Units::kPerRow);
        }
        __syncthreads();  // the batch is overwritten next
    }
}

// Four blocks an SM (at most 64 registers a thread; the builds use 50-57): a block's batch loads
// hide behind the others' copies.
extern "C" __global__ void __launch_bounds__(PERMUTE_THREADS, 4) permute_rows(
    int num_slab_rows, int num_local_experts, int zero_pad, int capacity_rows, const u8* __restrict__ rows,
    const i32* __restrict__ recv_pos, const i32* __restrict__ expert_offsets, const i32* __restrict__ tokens_per_expert,
    u8* __restrict__ out) {
    __shared__ RowBatch batch;
    const int lane = threadIdx.x & 31;
    for_each_kept_row_unit<PERMUTE_VPL>(batch, num_slab_rows, recv_pos, nullptr, [&](int r, int row_unit) {
        const int v0 = row_unit * RowUnits<PERMUTE_VPL>::kVecs + lane;
        Vec16 vals[PERMUTE_VPL];
        load_unit<PERMUTE_VPL, kUserInput>(rows + batch.row[r] * ROW_BYTES, vals, v0);
        for_each_target_row(batch.row[r], lane, lane < TOPK ? batch.pos[r * TOPK + lane] : -1,
                            [&](int k) { return batch.pos[r * TOPK + k]; }, capacity_rows, out,
                            [&](u8* row) { store_unit<PERMUTE_VPL>(row, vals, v0); });
    });
    if (zero_pad) {
        // Dynamic shared memory: the segments, 3 * num_local_experts int32 (load_segments). After the
        // rows: their loads would delay the first row copies.
        extern __shared__ i32 smem[];
        i32* s_end = smem;
        i32* s_kept = smem + num_local_experts;
        i32* s_pad = smem + 2 * num_local_experts;
        load_segments(s_end, s_kept, s_pad, expert_offsets, tokens_per_expert, num_local_experts);
        zero_padding(s_end, s_pad, num_local_experts, capacity_rows, 0, gridDim.x, nullptr, out);
    }
}

#if !FP8_ROWS
// Two blocks an SM (the sum keeps COMBINE_GROUP rows' vectors in flight: 100-116 registers a thread), so
// a block's batch loads hide behind the other's sums. The sum's vectors per lane are combine's send
// phase's (COMBINE_SEND_VPL, sized for that same sum's registers).
extern "C" __global__ void __launch_bounds__(PERMUTE_THREADS, 2) unpermute_rows(
    int num_slab_rows, int capacity_rows, const void* __restrict__ y, const i32* __restrict__ recv_pos,
    const float* __restrict__ recv_weight, void* __restrict__ out) {
    __shared__ RowBatch batch;
    const int lane = threadIdx.x & 31;
    const bool weighted = recv_weight != nullptr;
    for_each_kept_row_unit<COMBINE_SEND_VPL>(batch, num_slab_rows, recv_pos, recv_weight, [&](int r, int row_unit) {
        const int v0 = row_unit * RowUnits<COMBINE_SEND_VPL>::kVecs + lane;
        const int pos = lane < TOPK ? batch.pos[r * TOPK + lane] : -1;
        float acc[COMBINE_SEND_VPL][ELEMS_PER_VEC];
        zero_acc<COMBINE_SEND_VPL>(acc);
        sum_kept_rows(acc, static_cast<const u8*>(y), kept_entries(lane, pos, capacity_rows),
                      [&](int k) { return batch.pos[r * TOPK + k]; }, [&](int k) { return batch.weight[r * TOPK + k]; },
                      weighted, v0, []() {});
        Vec16 sum[COMBINE_SEND_VPL];
#pragma unroll
        for (int u = 0; u < COMBINE_SEND_VPL; ++u) sum[u] = pack16(acc[u]);
        store_unit<COMBINE_SEND_VPL>(static_cast<u8*>(out) + batch.row[r] * ROW_BYTES, sum, v0);
    });
}
#endif
