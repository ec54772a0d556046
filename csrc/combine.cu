// combine.cu: bring expert outputs back to their tokens (combine) and per-entry values back to
// their assignments (return_entry_values).
//
// Protocol: channel 1 ("to source"). Each call uses epoch e = state.epoch[1] + 1, read from
// device memory by every kernel, so graph replays and eager calls always run at the next epoch.
//
// One kernel per call, `combine`, on one block per SM (its blocks wait for each other, so all of
// them must be resident at once). Its phases, on rank R:
//   send (as a destination): every warp, before its first store, waits until ack[1][s] >= e - 1
//     in R's own flags for every rank s (s has finished reading what R returned to it at the
//     previous epoch), the loads of its first row in flight meanwhile. For every slab row (s, t)
//     that carries a token (an entry of recv_pos[s, t, :] is not -1) it computes
//         partial = dtype(sum over kept k (pos >= 0), k increasing, of w_k * float(y[pos_k]))
//     (w_k = 1 unweighted) in float32 from 0.0f with separate __fmul_rn / __fadd_rn (no fused
//     multiply-add: the reference rounds the product), rounded to nearest even, and stores it into
//     ret_x[R][t] of rank s (16-byte stores); a row whose entries were all dropped sends zeros.
//     Every block counts itself done; the last one release-stores arrival[1][R] = e into every
//     rank's flags.
//   sum (as a source): every block waits until arrival[1][r] >= e for every r (acquire), then
//         z[t] = dtype(sum over r increasing with send_mask[t, r] of float(ret_x[r][t]))
//     from 0.0f with __fadd_rn; a token sent nowhere gets zeros. The last block release-stores
//     ack[1][R] = e into every rank's flags and sets state.epoch[1] = e.
//   TOKEN_MAJOR builds (combine of the token-major layout): the partial rows were summed beforehand, by
//     unpermute (permute.cu) on the caller's stream with the same float32 sums: y is [W * M, H], one
//     row per slab row, and the send phase reads row (s, t) of y instead of summing K rows (zeros
//     when no entry of the row is kept). Everything else is as above, so z is bitwise the same.
//   One rank (world 1) runs `combine_one_rank`: z[t] is the partial row of slab row t summed as
//     the sum phase sums it (0.0f + the dtype-rounded partial, so bitwise the same), written
//     straight into z: no slab, signal or wait, one warp per (token, unit) on the blocks the
//     units fill.
//   values_send / values_recv (two kernels, for return_entry_values): the same channel for one
//     float per entry. The destination writes row_vector[pos] (0 where pos < 0) for every entry
//     (s, t, k) with pos != -1 into ret_vals[R][t][k] of rank s; the source gathers out[t, k] =
//     ret_vals[dest_rank[t, k]][t][k] (0 where dest_rank < 0). Waits, signals and acks as above.
//
// A wait that runs past timeout_ns records (phase, peer) into the status word and gives up, so
// every kernel terminates; the results of that call are then invalid (Dispatcher.check() says so).
//
// moe_comm-defines: {"DTYPE": "bf16", "HIDDEN": 1024, "TOPK": 4}
// moe_comm-defines: {"DTYPE": "bf16", "HIDDEN": 7168, "TOPK": 8}
// moe_comm-defines: {"DTYPE": "bf16", "HIDDEN": 7168, "TOPK": 8, "TOKEN_MAJOR": 1}

#include "common.cuh"
#include "row_sums.cuh"

#define COMBINE_RECV_VPL 4
// 16-byte vectors a lane holds of a partial row: the expert-major sum's (COMBINE_SEND_VPL), or in
// TOKEN_MAJOR builds, which read one row a partial, COMBINE_REDUCED_VPL.
#if TOKEN_MAJOR
#define PARTIAL_VPL COMBINE_REDUCED_VPL
#else
#define PARTIAL_VPL COMBINE_SEND_VPL
#endif

// ------------------------------------------------------------------------------ send phase

// Warp-wide: the unit's vectors, from v0, of slab row g's partial row (kept: its kept entries, bit k;
// pos_at / weight_at: entry k's row of y and weight, warp-uniform). Expert-major: summed from the kept
// entries' rows of y [capacity_rows, H] (sum_kept_rows, rounded to DTYPE). TOKEN_MAJOR builds: read
// from row g of y [W * M, H], where unpermute (permute.cu) summed it with the same sum_kept_rows;
// zeros when no entry is kept. before_sums() runs once the unit's first loads are issued. acc: zeros
// on entry, the expert-major sum's scratch.
template <typename PosAt, typename WeightAt, typename BeforeSums>
__device__ __forceinline__ void partial_unit(Vec16 (&partial)[PARTIAL_VPL], float (&acc)[PARTIAL_VPL][ELEMS_PER_VEC],
                                             const u8* rows, i64 g, u32 kept,
                                             PosAt pos_at, WeightAt weight_at, bool weighted, int v0,
                                             BeforeSums before_sums) {
#if TOKEN_MAJOR
    (void)acc;
    (void)pos_at;
    (void)weight_at;
    (void)weighted;
    if (kept != 0u) {
        load_unit<PARTIAL_VPL, kUserInput>(rows + g * ROW_BYTES, partial, v0);
    } else {
#pragma unroll
        for (int u = 0; u < PARTIAL_VPL; ++u) partial[u] = zero16();
    }
    before_sums();
#else
    (void)g;
    sum_kept_rows(acc, rows, kept, pos_at, weight_at, weighted, v0, before_sums);
#pragma unroll
    for (int u = 0; u < PARTIAL_VPL; ++u) partial[u] = pack16(acc[u]);
#endif
}

// Block-wide: one partial row per carried slab row of recv_pos [W * M, K], from the rows of
// y [capacity_rows, H], into ret_x[R][t] of its source s, once the acks of epoch - 1 are in (see
// the top of this file).
__device__ __forceinline__ void send_partials(RowBatch& batch, const i64* s_peer, int rank, int world, int max_tokens_per_rank,
                                              u64 epoch, i64* status, i64 timeout_ns, i64 off_ret_x,
                                              i64 off_stage_x, const void* y, int capacity_rows,
                                              const i32* recv_pos, const float* recv_weight, int weighted,
                                              bool wait_for_acks) {
    typedef RowUnits<PARTIAL_VPL> Units;
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int warps = blockDim.x >> 5;
    const u8* rows = static_cast<const u8*>(y);
    const BatchShape shape = batch_shape(static_cast<i64>(world) * max_tokens_per_rank, gridDim.x);
    bool acked = !wait_for_acks;
    for (i64 q = blockIdx.x; q < shape.count; q += gridDim.x) {
        const int listed = block_load_batch(batch, recv_pos, weighted ? recv_weight : nullptr, shape, q, -2);
        for (int unit = warp; unit < listed * Units::kPerRow; unit += warps) {
            const int r = batch.list[unit / Units::kPerRow];
            const int row_unit = unit - (unit / Units::kPerRow) * Units::kPerRow;
            const int pos = lane < TOPK ? batch.pos[r * TOPK + lane] : -1;
            const u32 kept = kept_entries(lane, pos, capacity_rows);
            const int v0 = row_unit * Units::kVecs + lane;
            float acc[PARTIAL_VPL][ELEMS_PER_VEC];
            zero_acc<PARTIAL_VPL>(acc);
            Vec16 partial[PARTIAL_VPL];
            partial_unit(partial, acc, rows, TOKEN_MAJOR ? batch.row[r] : 0, kept,
                         [&](int k) { return batch.pos[r * TOPK + k]; },
                         [&](int k) { return batch.weight[r * TOPK + k]; }, weighted != 0, v0, [&]() {
                if (!acked) {
                    warp_wait_flags(s_peer[rank], world, CH_TO_SOURCE, FLAG_ACK, epoch - 1, status,
                                    TIMEOUT_TO_SOURCE_ACK, timeout_ns);
                    acked = true;
                }
            });
            const i64 g = batch.row[r];
            const int s = static_cast<int>(g / max_tokens_per_rank);
            const i64 t = g - static_cast<i64>(s) * max_tokens_per_rank;
            u8* dst = reinterpret_cast<u8*>(s_peer[s] + off_ret_x) + (static_cast<i64>(rank) * max_tokens_per_rank + t) * ROW_BYTES;
#if PUT_TRANSPORT
            if (s != rank) {  // staged in this rank's own allocation, the copy NVSHMEM reads
                u8* staged = reinterpret_cast<u8*>(s_peer[rank] + off_stage_x) + g * ROW_BYTES;
                store_unit<PARTIAL_VPL>(staged, partial, v0);
                put_unit<PARTIAL_VPL>(dst, staged, row_unit, s);
                continue;
            }
#endif
            store_unit<PARTIAL_VPL>(dst, partial, v0);
        }
        __syncthreads();  // the batch is overwritten next
    }
}

// ------------------------------------------------------------------------------- sum phase

// Block-wide: z [T, H] row t = the sum of the partial rows ret_x[r][t] of the ranks r of
// send_mask [T, W] row t, in increasing r (zeros for a token sent nowhere).
__device__ __forceinline__ void sum_partials(const i64* s_peer, int rank, int world, int max_tokens_per_rank, i64 off_ret_x,
                                             const u8* send_mask, int num_tokens, void* z) {
    typedef RowUnits<COMBINE_RECV_VPL> Units;
    const int lane = threadIdx.x & 31;
    const int warps = blockDim.x >> 5;
    const u8* returned = reinterpret_cast<const u8*>(s_peer[rank] + off_ret_x);
    const i64 num_units = static_cast<i64>(num_tokens) * Units::kPerRow;
    for (i64 unit = static_cast<i64>(blockIdx.x) * warps + (threadIdx.x >> 5); unit < num_units;
         unit += static_cast<i64>(gridDim.x) * warps) {
        const int t = static_cast<int>(unit / Units::kPerRow);
        const int row_unit = static_cast<int>(unit - static_cast<i64>(t) * Units::kPerRow);
        const int v0 = row_unit * Units::kVecs + lane;
        float acc[COMBINE_RECV_VPL][ELEMS_PER_VEC];
        zero_acc<COMBINE_RECV_VPL>(acc);
        // Ranks in increasing order, up to four partial rows in flight at once.
        u64 pending = warp_dest_set(send_mask + static_cast<i64>(t) * world, world);
        while (pending != 0ull) {
            int from[4];
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                from[i] = -1;
                if (pending != 0ull) {
                    from[i] = __ffsll(static_cast<i64>(pending)) - 1;
                    pending &= pending - 1ull;
                }
            }
            Vec16 vals[4][COMBINE_RECV_VPL];
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                if (from[i] >= 0) {
                    const u8* row = returned + (static_cast<i64>(from[i]) * max_tokens_per_rank + t) * ROW_BYTES;
                    load_unit<COMBINE_RECV_VPL, kWrittenHere>(row, vals[i], v0);
                }
            }
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                if (from[i] >= 0) accumulate<COMBINE_RECV_VPL>(acc, vals[i], 1.0f, false, v0);
            }
        }
        u8* dst = static_cast<u8*>(z) + static_cast<i64>(t) * ROW_BYTES;
#pragma unroll
        for (int u = 0; u < COMBINE_RECV_VPL; ++u) {
            const int v = v0 + 32 * u;
            if (v < ROW_VECS) st16(dst + static_cast<i64>(v) * 16, pack16(acc[u]));
        }
    }
}

// ------------------------------------------------------------------------------- world 1

// Block-wide, world 1 (no peer: nothing is sent, signalled or awaited): z [T, H] row t = the
// partial row of slab row t, computed as send_partials does from y [capacity_rows, H], then summed
// as sum_partials sums one rank's partial (from 0.0f, so z is bitwise what the two phases give).
// One warp per (token, unit), each loading its token's recv_pos [M, K] (and recv_weight) with it;
// a token with no kept entry gets zeros.
__device__ __forceinline__ void combine_own_tokens(const void* y, int capacity_rows, const i32* recv_pos,
                                                   const float* recv_weight, int weighted, int num_tokens, void* z) {
    typedef RowUnits<PARTIAL_VPL> Units;
    const int lane = threadIdx.x & 31;
    const int warps = blockDim.x >> 5;
    const i64 num_units = static_cast<i64>(num_tokens) * Units::kPerRow;
    for (i64 unit = static_cast<i64>(blockIdx.x) * warps + (threadIdx.x >> 5); unit < num_units;
         unit += static_cast<i64>(gridDim.x) * warps) {
        const i64 t = unit / Units::kPerRow;
        const int row_unit = static_cast<int>(unit - t * Units::kPerRow);
        const int pos = lane < TOPK ? recv_pos[t * TOPK + lane] : -1;
        const float w = lane < TOPK && weighted ? recv_weight[t * TOPK + lane] : 1.0f;
        const u32 kept = kept_entries(lane, pos, capacity_rows);
        const int v0 = row_unit * Units::kVecs + lane;
        float acc[PARTIAL_VPL][ELEMS_PER_VEC];
        zero_acc<PARTIAL_VPL>(acc);
        Vec16 partial[PARTIAL_VPL];
        partial_unit(partial, acc, static_cast<const u8*>(y), t, kept,
                     [&](int k) { return __shfl_sync(FULL_MASK, pos, k); },
                     [&](int k) { return __shfl_sync(FULL_MASK, w, k); }, weighted != 0, v0, []() {});
        zero_acc<PARTIAL_VPL>(acc);
        accumulate<PARTIAL_VPL>(acc, partial, 1.0f, false, v0);
#pragma unroll
        for (int u = 0; u < PARTIAL_VPL; ++u) partial[u] = pack16(acc[u]);
        store_unit<PARTIAL_VPL>(static_cast<u8*>(z) + t * ROW_BYTES, partial, v0);
    }
}

// --------------------------------------------------------------------------------- combine

// The parameters of both combine kernels (below).
#define COMBINE_PARAMS                                                                                        \
    const i64* __restrict__ peers, int rank, int world, int max_tokens_per_rank, u64* state, i64* status,    \
    i64 timeout_ns, i64 off_ret_x, i64 copy_stride, i64 off_stage_x, int capacity_rows,                      \
    const void* __restrict__ y, const i32* __restrict__ recv_pos, const float* __restrict__ recv_weight,     \
    int weighted, const u8* __restrict__ send_mask, int num_tokens, void* __restrict__ z

// One block per SM (gridDim.x <= SMs: blocks wait for the arrival the last of them signals).
extern "C" __global__ void __launch_bounds__(COMBINE_THREADS) combine(COMBINE_PARAMS) {
    __shared__ i64 s_peer[MAX_WORLD];
    __shared__ RowBatch batch;
    const Call call = begin_call(s_peer, peers, rank, world, state, status,
                                 CH_TO_SOURCE, true, SLOT_COMBINE_RECV, copy_stride);
    const u64 epoch = call.epoch;
    off_ret_x += slab_copy(epoch, copy_stride);
    send_partials(batch, s_peer, rank, world, max_tokens_per_rank, epoch, status, timeout_ns, off_ret_x, off_stage_x, y,
                  capacity_rows, recv_pos, recv_weight, weighted, acks_needed(copy_stride));
    if (last_block_done(state + STATE_DONE + SLOT_COMBINE_SEND, gridDim.x)) {
        signal_every_rank(s_peer, rank, world, CH_TO_SOURCE, FLAG_ARRIVAL, epoch);
    }
    block_wait_flags(s_peer[rank], world, CH_TO_SOURCE, FLAG_ARRIVAL, epoch, status, TIMEOUT_TO_SOURCE_ARRIVAL,
                     timeout_ns);
    sum_partials(s_peer, rank, world, max_tokens_per_rank, off_ret_x, send_mask, num_tokens, z);
    end_call(call, state, SLOT_COMBINE_RECV, s_peer, rank, world, CH_TO_SOURCE, copy_stride);
}

// World 1: combine's result without the slab (combine_own_tokens), as a kernel of its own, so
// the multi-rank kernel's registers stay its own.
extern "C" __global__ void __launch_bounds__(COMBINE_THREADS) combine_one_rank(COMBINE_PARAMS) {
    __shared__ i64 s_peer[MAX_WORLD];
    const Call call = begin_call(s_peer, peers, rank, world, state, status,
                                 CH_TO_SOURCE, true, SLOT_COMBINE_RECV, copy_stride);
    combine_own_tokens(y, capacity_rows, recv_pos, recv_weight, weighted, num_tokens, z);
    end_call(call, state, SLOT_COMBINE_RECV, s_peer, rank, world, CH_TO_SOURCE, copy_stride);
}

// ---------------------------------------------------------------------------- values_send

extern "C" __global__ void __launch_bounds__(VALUES_THREADS) values_send(
    const i64* __restrict__ peers, int rank, int world, int max_tokens_per_rank, u64* state, i64* status, i64 timeout_ns,
    i64 off_ret_vals, i64 copy_stride, const float* __restrict__ row_vector, int capacity_rows,
    const i32* __restrict__ recv_pos) {
    __shared__ i64 s_peer[MAX_WORLD];
    const u64 epoch = begin_call(s_peer, peers, rank, world, state, status, CH_TO_SOURCE, false, 0, copy_stride).epoch;
    off_ret_vals += slab_copy(epoch, copy_stride);
    if (acks_needed(copy_stride)) {
        block_wait_flags(s_peer[rank], world, CH_TO_SOURCE, FLAG_ACK, epoch - 1, status, TIMEOUT_TO_SOURCE_ACK,
                         timeout_ns);
    }

    const i64 per_slab = static_cast<i64>(max_tokens_per_rank) * TOPK;
    const i64 total = static_cast<i64>(world) * per_slab;
    for (i64 i = static_cast<i64>(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
         i += static_cast<i64>(gridDim.x) * blockDim.x) {
        const int pos = recv_pos[i];
        if (pos == -1) continue;
        const i64 s = i / per_slab;
        const i64 within = i - s * per_slab;  // t * K + k
        float* dst = reinterpret_cast<float*>(s_peer[s] + off_ret_vals) + static_cast<i64>(rank) * per_slab + within;
        remote_stf32(dst, pos >= 0 && pos < capacity_rows ? row_vector[pos] : 0.0f, static_cast<int>(s));
    }

    if (last_block_done(state + STATE_DONE + SLOT_VALUES_SEND, gridDim.x)) {
        signal_every_rank(s_peer, rank, world, CH_TO_SOURCE, FLAG_ARRIVAL, epoch);
    }
}

// ---------------------------------------------------------------------------- values_recv

extern "C" __global__ void __launch_bounds__(VALUES_THREADS) values_recv(
    const i64* __restrict__ peers, int rank, int world, int max_tokens_per_rank, u64* state, i64* status, i64 timeout_ns,
    i64 off_ret_vals, i64 copy_stride, const i32* __restrict__ dest_rank, int num_tokens, float* __restrict__ out) {
    __shared__ i64 s_peer[MAX_WORLD];
    const Call call = begin_call(s_peer, peers, rank, world, state, status,
                                 CH_TO_SOURCE, true, SLOT_VALUES_RECV, copy_stride);
    const u64 epoch = call.epoch;
    off_ret_vals += slab_copy(epoch, copy_stride);
    block_wait_flags(s_peer[rank], world, CH_TO_SOURCE, FLAG_ARRIVAL, epoch, status, TIMEOUT_TO_SOURCE_ARRIVAL,
                     timeout_ns);

    const float* returned = reinterpret_cast<const float*>(s_peer[rank] + off_ret_vals);
    const i64 per_slab = static_cast<i64>(max_tokens_per_rank) * TOPK;
    const i64 total = static_cast<i64>(num_tokens) * TOPK;
    for (i64 i = static_cast<i64>(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
         i += static_cast<i64>(gridDim.x) * blockDim.x) {
        const int r = dest_rank[i];
        out[i] = r >= 0 && r < world ? returned[r * per_slab + i] : 0.0f;
    }

    end_call(call, state, SLOT_VALUES_RECV, s_peer, rank, world, CH_TO_SOURCE, copy_stride);
}
