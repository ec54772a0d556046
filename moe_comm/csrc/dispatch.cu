// dispatch.cu: send tokens to the ranks of their experts and lay them out expert-major there.
//
// Protocol: channel 0 ("to destination"). Each call uses epoch e = state.epoch[0] + 1, read from
// device memory by every kernel (never baked into a graph), so a graph replay or an eager call
// always runs at the next epoch. Every rank runs the same sequence of operations, so epochs agree.
//
//   dispatch_send (on the source R, grid of up to num_sms blocks, one warp per (token, row chunk)):
//     every block first waits until ack[0][r] >= e - 1 in R's own flags for every rank r (r has
//     finished reading what R sent it at the previous epoch: a rank that runs ahead never
//     overwrites a slab that is still being read). Then, for each token t < T:
//       * recv_meta[R][t] of EVERY rank r gets t's metadata row: the local expert ids of the
//         assignments living on r (-1 elsewhere) and the K router weights. Every rank gets the
//         row, so a stale row of an earlier call is never read as live;
//       * recv_x[R][t] of every rank t is sent to gets the x row, once per rank (16-byte stores);
//       * send_mask [T, W] and dest_rank [T, K] (local outputs) are written and invalid expert
//         ids are counted into the status word (count + smallest (R << 32 | t)).
//     The last block to finish writes count[0][R] = T and then release-stores arrival[0][R] = e
//     into every rank's flags (after a system-scope fence of every block).
//   dispatch_layout (on the destination, up to one block per SM): waits until arrival[0][s] >= e
//     for every s (acquire), reads T_s = count[0][s]; slab rows t >= T_s are empty. Ranks the
//     entries (s, t, k) of each local expert in lexicographic order (block b takes the b-th range
//     of rows, counts its entries per expert, publishes the counts with a local flag stamped e,
//     and offsets its ranks by the counts of the blocks before it: every block of the grid must be
//     resident at once, so the grid is at most one block per SM), applies the capacity (rank >= C:
//     dropped, pos -2, counted with the smallest (s << 32 | t)), aligns the segments, and writes
//     recv_pos [W, M, K], recv_weight [W, M, K], expert_offsets [L], tokens_per_expert [L]:
//     exactly moe_comm.layout.plan_destination.
//   dispatch_expand (on the destination, many blocks): copies each received row once from
//     recv_x to the out_x row of each of its kept entries and zeroes every segment's padding rows
//     [start_j + n_j, end_j) (rows at or past expert_offsets[-1] are not touched). Its last block
//     release-stores ack[0][R] = e into every source's flags, then sets state.epoch[0] = e.
//   redispatch_send + dispatch_expand(wait_arrivals = 1): the same channel with rows only (no
//     metadata) along an existing routing's send_mask, expanded with its recv_pos; the expand
//     waits for the arrivals itself and, without expert_offsets, zeroes no padding.
//
// A wait that runs past timeout_ns records (phase, peer) into the status word and gives up, so
// every kernel terminates; the results of that call are then invalid (Dispatcher.check() says so).
//
// moe_comm-defines: {"DTYPE": "bf16", "HIDDEN": 1024, "TOPK": 4}
// moe_comm-defines: {"DTYPE": "bf16", "HIDDEN": 7168, "TOPK": 8}

#include "common.cuh"

#define SEND_THREADS 512
#define SEND_VPL 8          // 16-byte vectors per lane per unit in the senders
#define EXPAND_THREADS 512
#define EXPAND_VPL 2         // small units: decode sizes have few rows to spread over the SMs
#define LAYOUT_MAX_THREADS 1024
#define LAYOUT_BATCH 8      // tiles whose metadata a warp loads before it ranks them

// --------------------------------------------------------------------------- dispatch_send

// The ranks of a token's leader lanes (one per destination rank), from every lane's `dest`.
__device__ __forceinline__ u64 leader_dest_set(u32 leaders, int dest) {
    u64 dest_set = 0;
    for (u32 m = leaders; m != 0u; m &= m - 1u) {
        dest_set |= 1ull << __shfl_sync(FULL_MASK, dest, __ffs(static_cast<int>(m)) - 1);
    }
    return dest_set;
}

// Warp-wide: unit `chunk` of token row t of x [T, H] to slab row recv_x[rank][t] of every rank in
// `dests`. With puts the unit is first stored into this rank's own slab row (the copy NVSHMEM
// reads; it is also the delivery when this rank is a destination, and is never read as a token
// otherwise: this rank's metadata row then has no local entry).
__device__ __forceinline__ void send_token_unit(const i64* s_peer, int rank, int max_tokens, i64 off_recv_x,
                                                const void* x, int t, int chunk, u64 dests) {
    typedef RowChunks<SEND_VPL> Chunks;
    const i64 row_offset = off_recv_x + (static_cast<i64>(rank) * max_tokens + t) * ROW_BYTES;
    const int v0 = chunk * Chunks::kVecs + (threadIdx.x & 31);
    Vec16 vals[SEND_VPL];
    load_unit_nc<SEND_VPL>(static_cast<const u8*>(x) + static_cast<i64>(t) * ROW_BYTES, vals, v0);
#if TRANSPORT_PUT
    const u8* staged = reinterpret_cast<const u8*>(s_peer[rank] + row_offset);
    store_unit<SEND_VPL>(const_cast<u8*>(staged), vals, v0);
    for (u64 m = dests & ~(1ull << rank); m != 0ull; m &= m - 1ull) {
        const int r = __ffsll(static_cast<i64>(m)) - 1;
        put_unit<SEND_VPL>(reinterpret_cast<u8*>(s_peer[r] + row_offset), staged, chunk, r);
    }
#else
    for (u64 m = dests; m != 0ull; m &= m - 1ull) {
        store_unit<SEND_VPL>(reinterpret_cast<u8*>(s_peer[__ffsll(static_cast<i64>(m)) - 1] + row_offset), vals, v0);
    }
#endif
}

extern "C" __global__ void __launch_bounds__(SEND_THREADS) dispatch_send(
    const i64* __restrict__ peers, int rank, int world, int max_tokens, u64* state, i64* status, i64 timeout_ns,
    i64 off_meta, i64 off_recv_x, int num_experts,
    const void* __restrict__ x, const void* __restrict__ topk_idx, int idx_is_64,
    const float* __restrict__ topk_weights, int num_tokens,
    u8* __restrict__ send_mask, i32* __restrict__ dest_rank) {
    typedef RowChunks<SEND_VPL> Chunks;
    __shared__ i64 s_peer[MAX_WORLD];
    load_peers(s_peer, peers, world);
    const u64 epoch = state[STATE_EPOCH + CH_TO_DEST] + 1;
    __syncthreads();
    block_wait_flags(s_peer[rank], world, CH_TO_DEST, FLAG_ACK, epoch - 1, status, TIMEOUT_TO_DEST_ACK, timeout_ns);

    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int warps = blockDim.x >> 5;
    const int local_experts = num_experts / world;
    const i64 num_units = static_cast<i64>(num_tokens) * Chunks::kPerRow;
    i64 num_invalid = 0;
    i64 first_invalid = NO_OFFENDER;

    for (i64 unit = static_cast<i64>(blockIdx.x) * warps + warp; unit < num_units;
         unit += static_cast<i64>(gridDim.x) * warps) {
        const int t = static_cast<int>(unit / Chunks::kPerRow);
        const int chunk = static_cast<int>(unit - static_cast<i64>(t) * Chunks::kPerRow);
        i64 expert = -1;
        float weight = 0.0f;
        if (lane < TOPK) {
            const i64 i = static_cast<i64>(t) * TOPK + lane;
            expert = idx_is_64 ? static_cast<const i64*>(topk_idx)[i] : static_cast<i64>(static_cast<const i32*>(topk_idx)[i]);
            weight = topk_weights[i];
        }
        const bool valid = lane < TOPK && expert >= 0 && expert < num_experts;
        const int dest = valid ? static_cast<int>(expert / local_experts) : -1;
        const int local = valid ? static_cast<int>(expert - static_cast<i64>(dest) * local_experts) : -1;
        // One leader lane per destination rank: the token crosses each link once.
        const u32 same_dest = __match_any_sync(FULL_MASK, dest);
        const bool leader = valid && (same_dest & lanemask_lt()) == 0;
        const u32 leaders = __ballot_sync(FULL_MASK, leader);
        const u64 dest_set = leader_dest_set(leaders, dest);

        if (chunk == 0) {
            const u32 invalid = __ballot_sync(FULL_MASK, lane < TOPK && expert != -1 && !valid);
            if (invalid != 0u) {
                num_invalid += __popc(invalid);
                first_invalid = imin64(first_invalid, (static_cast<i64>(rank) << 32) | t);
            }
            if (lane < TOPK) dest_rank[static_cast<i64>(t) * TOPK + lane] = dest;
            for (int r = lane; r < world; r += 32) {
                send_mask[static_cast<i64>(t) * world + r] = static_cast<u8>((dest_set >> r) & 1ull);
            }
            if (lane < TOPK) {
                for (int r = 0; r < world; ++r) {
                    u32* row = reinterpret_cast<u32*>(s_peer[r] + off_meta) +
                               (static_cast<i64>(rank) * max_tokens + t) * META_WORDS;
                    remote_st32(row + lane, static_cast<u32>(dest == r ? local : -1), r);
                    remote_st32(row + TOPK + lane, __float_as_uint(weight), r);
                }
            }
        }

        if (dest_set != 0ull) send_token_unit(s_peer, rank, max_tokens, off_recv_x, x, t, chunk, dest_set);
    }
    if (lane == 0 && num_invalid != 0) status_add_offenders(status, STATUS_NUM_INVALID, num_invalid, first_invalid);

    if (last_block_done(state + STATE_DONE + SLOT_DISPATCH_SEND)) {
        signal_every_rank(s_peer, rank, world, CH_TO_DEST, FLAG_ARRIVAL, epoch, true, static_cast<u64>(num_tokens));
    }
}

// ------------------------------------------------------------------------- dispatch_layout

// The slab row g = s * M + t of virtual row v (rows t < T_s of all sources concatenated): s is
// the largest source with begin[s] <= v.
__device__ __forceinline__ i64 slab_row_of(const i64* begin, int world, int max_tokens, i64 v) {
    int lo = 0, hi = world - 1;
    while (lo < hi) {
        const int mid = (lo + hi + 1) >> 1;
        if (begin[mid] <= v) lo = mid;
        else hi = mid - 1;
    }
    return static_cast<i64>(lo) * max_tokens + (v - begin[lo]);
}

// Dynamic shared memory: (warps + 3) * num_local int32 (per-warp counts, block totals, earlier
// blocks' counts, segment starts). block_counts [gridDim.x, num_local] int32 and block_flags
// [gridDim.x] u64 are local device scratch of this kernel (flags start at 0).
extern "C" __global__ void __launch_bounds__(LAYOUT_MAX_THREADS) dispatch_layout(
    const i64* __restrict__ peers, int rank, int world, int max_tokens, u64* state, i64* status, i64 timeout_ns,
    i64 off_meta, int num_local, int alignment, int capacity,
    i32* __restrict__ recv_pos, float* __restrict__ recv_weight, i32* __restrict__ expert_offsets,
    i32* __restrict__ tokens_per_expert, i32* __restrict__ block_counts, u64* __restrict__ block_flags) {
    extern __shared__ i32 smem[];
    __shared__ i32 s_tokens[MAX_WORLD];
    __shared__ i64 s_begin[MAX_WORLD + 1];
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int warps = blockDim.x >> 5;
    i32* s_count = smem;                           // [warps][num_local]
    i32* s_total = smem + warps * num_local;       // [num_local]: this block's, then every block's
    i32* s_before = s_total + num_local;           // [num_local]: entries of the blocks before this one
    i32* s_start = s_before + num_local;           // [num_local]

    const i64 base = peers[rank];
    const u64 epoch = state[STATE_EPOCH + CH_TO_DEST] + 1;
    for (int p = threadIdx.x; p < world; p += blockDim.x) {
        wait_flag_geq(flag_at(base, world, CH_TO_DEST, FLAG_ARRIVAL, p), epoch, status, TIMEOUT_TO_DEST_ARRIVAL, p,
                      timeout_ns);
        const u64 count = ld_relaxed_sys(flag_at(base, world, CH_TO_DEST, FLAG_COUNT, p));
        s_tokens[p] = count > static_cast<u64>(max_tokens) ? max_tokens : static_cast<int>(count);
    }
    for (int i = threadIdx.x; i < warps * num_local; i += blockDim.x) s_count[i] = 0;
    __syncthreads();
    if (threadIdx.x == 0) {
        i64 acc = 0;
        for (int s = 0; s < world; ++s) {
            s_begin[s] = acc;
            acc += s_tokens[s];
        }
        s_begin[world] = acc;
    }
    __syncthreads();

    // Entries are taken in tiles of whole rows (32 / K rows, one lane per entry), and each warp
    // owns a contiguous range of tiles, so ranks follow the lexicographic (s, t, k) order.
    const u32* meta = reinterpret_cast<const u32*>(base + off_meta);
    const int rows_per_tile = 32 / TOPK;
    const int tile_row = lane / TOPK;
    const int k = lane - tile_row * TOPK;
    const bool lane_used = tile_row < rows_per_tile;
    const i64 total_rows = s_begin[world];
    const i64 num_tiles = (total_rows + rows_per_tile - 1) / rows_per_tile;
    const i64 per_block = (num_tiles + gridDim.x - 1) / gridDim.x;
    const i64 block_begin = imin64(num_tiles, blockIdx.x * per_block);
    const i64 block_end = imin64(num_tiles, block_begin + per_block);
    const i64 per_warp = (block_end - block_begin + warps - 1) / warps;
    const i64 tile_begin = imin64(block_end, block_begin + warp * per_warp);
    const i64 tile_end = imin64(block_end, tile_begin + per_warp);
    const u32 row_lanes = TOPK == 32 ? FULL_MASK : ((1u << (TOPK & 31)) - 1u) << ((tile_row * TOPK) & 31);
    i32* my_count = s_count + warp * num_local;

    // Pass 1: per-warp counts per local expert.
    for (i64 tile0 = tile_begin; tile0 < tile_end; tile0 += LAYOUT_BATCH) {
        int ids[LAYOUT_BATCH];
#pragma unroll
        for (int b = 0; b < LAYOUT_BATCH; ++b) {
            ids[b] = -1;
            const i64 v = (tile0 + b) * rows_per_tile + tile_row;
            if (lane_used && tile0 + b < tile_end && v < total_rows) {
                const i64 g = slab_row_of(s_begin, world, max_tokens, v);
                const int j = static_cast<int>(meta[g * META_WORDS + k]);
                ids[b] = j >= 0 && j < num_local ? j : -1;
            }
        }
#pragma unroll
        for (int b = 0; b < LAYOUT_BATCH; ++b) {
            const int j = ids[b];
            const u32 same = __match_any_sync(FULL_MASK, j);
            if (j >= 0 && (same & lanemask_lt()) == 0u) my_count[j] += __popc(same);
            __syncwarp();
        }
    }
    __syncthreads();

    // Exclusive prefix over warps (each warp's first rank per expert) and totals.
    for (int j = threadIdx.x; j < num_local; j += blockDim.x) {
        int run = 0;
        for (int w = 0; w < warps; ++w) {
            const int c = s_count[w * num_local + j];
            s_count[w * num_local + j] = run;
            run += c;
        }
        s_total[j] = run;
    }
    __syncthreads();

    // Publish this block's counts, wait for every block's, and take the entries of the blocks
    // before this one (they hold the earlier tiles) and every block's totals.
    for (int j = threadIdx.x; j < num_local; j += blockDim.x) block_counts[blockIdx.x * num_local + j] = s_total[j];
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        st_release_gpu(block_flags + blockIdx.x, epoch);
    }
    for (int b = threadIdx.x; b < gridDim.x; b += blockDim.x) {
        wait_flag_geq(block_flags + b, epoch, status, TIMEOUT_LAYOUT_BLOCKS, rank, timeout_ns);
    }
    __syncthreads();
    for (int j = threadIdx.x; j < num_local; j += blockDim.x) {
        int before = 0, total = 0;
        for (int b = 0; b < static_cast<int>(gridDim.x); ++b) {
            const int c = ld_relaxed_gpu_i32(block_counts + b * num_local + j);
            before += b < static_cast<int>(blockIdx.x) ? c : 0;
            total += c;
        }
        s_before[j] = before;
        s_total[j] = total;
    }
    __syncthreads();

    // Kept counts, aligned segments and their cumulative ends (warp 0, 32 experts at a time).
    if (warp == 0) {
        int carry = 0;
        for (int j0 = 0; j0 < num_local; j0 += 32) {
            const int j = j0 + lane;
            int kept = 0, segment = 0;
            if (j < num_local) {
                kept = min(s_total[j], capacity);
                segment = (kept + alignment - 1) / alignment * alignment;
            }
            int inclusive = segment;
#pragma unroll
            for (int offset = 1; offset < 32; offset <<= 1) {
                const int n = __shfl_up_sync(FULL_MASK, inclusive, offset);
                if (lane >= offset) inclusive += n;
            }
            const int end = carry + inclusive;
            if (j < num_local) {
                s_start[j] = end - segment;
                if (blockIdx.x == 0) {
                    expert_offsets[j] = end;
                    tokens_per_expert[j] = kept;
                }
            }
            carry = __shfl_sync(FULL_MASK, end, 31);
        }
    }
    __syncthreads();

    // Pass 2: ranks, positions, weights.
    i64 num_dropped = 0;
    i64 first_dropped = NO_OFFENDER;
    for (i64 tile0 = tile_begin; tile0 < tile_end; tile0 += LAYOUT_BATCH) {
        int ids[LAYOUT_BATCH];
        float weights[LAYOUT_BATCH];
        i64 rows[LAYOUT_BATCH];  // slab row g = s * M + t of the lane's entry, -1 if none
#pragma unroll
        for (int b = 0; b < LAYOUT_BATCH; ++b) {
            ids[b] = -1;
            weights[b] = 0.0f;
            rows[b] = -1;
            const i64 v = (tile0 + b) * rows_per_tile + tile_row;
            if (lane_used && tile0 + b < tile_end && v < total_rows) {
                const i64 g = slab_row_of(s_begin, world, max_tokens, v);
                const int j = static_cast<int>(meta[g * META_WORDS + k]);
                ids[b] = j >= 0 && j < num_local ? j : -1;
                weights[b] = __uint_as_float(meta[g * META_WORDS + TOPK + k]);
                rows[b] = g;
            }
        }
#pragma unroll
        for (int b = 0; b < LAYOUT_BATCH; ++b) {
            const int j = ids[b];
            const u32 same = __match_any_sync(FULL_MASK, j);
            const u32 nonempty = __ballot_sync(FULL_MASK, j >= 0);
            const bool first_of_expert = j >= 0 && (same & lanemask_lt()) == 0u;
            const int rank_in_expert = j >= 0 ? s_before[j] + my_count[j] + __popc(same & lanemask_lt()) : 0;
            __syncwarp();
            if (first_of_expert) my_count[j] += __popc(same);
            __syncwarp();
            const i64 g = rows[b];
            if (g >= 0) {
                int pos = -1;
                if (j >= 0) {
                    if (rank_in_expert < capacity) {
                        pos = s_start[j] + rank_in_expert;
                    } else {
                        pos = -2;
                        ++num_dropped;
                        const i64 s = g / max_tokens;
                        first_dropped = imin64(first_dropped, (s << 32) | (g - s * max_tokens));
                    }
                }
                recv_pos[g * TOPK + k] = pos;
                // A row that carries a token keeps all K weights (as the source sent them).
                recv_weight[g * TOPK + k] = (nonempty & row_lanes) != 0u ? weights[b] : 0.0f;
            }
        }
    }

    // Rows t >= T_s of every slab are empty.
    for (int s = 0; s < world; ++s) {
        const i64 begin = (static_cast<i64>(s) * max_tokens + s_tokens[s]) * TOPK;
        const i64 end = static_cast<i64>(s + 1) * max_tokens * TOPK;
        for (i64 i = begin + blockIdx.x * blockDim.x + threadIdx.x; i < end; i += gridDim.x * blockDim.x) {
            recv_pos[i] = -1;
            recv_weight[i] = 0.0f;
        }
    }

#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) num_dropped += __shfl_xor_sync(FULL_MASK, num_dropped, offset);
    first_dropped = warp_min_i64(first_dropped);
    if (lane == 0 && num_dropped != 0) status_add_offenders(status, STATUS_NUM_DROPPED, num_dropped, first_dropped);
}

// ------------------------------------------------------------------------- dispatch_expand

// Copy rows recv_x -> out_x along recv_pos, zero the segments' padding (when expert_offsets is
// given), then acknowledge channel 0 to every source and advance the epoch. With wait_arrivals
// the kernel first waits for every source's arrival itself (redispatch has no layout kernel).
extern "C" __global__ void __launch_bounds__(EXPAND_THREADS) dispatch_expand(
    const i64* __restrict__ peers, int rank, int world, int max_tokens, u64* state, i64* status, i64 timeout_ns,
    i64 off_recv_x, int wait_arrivals,
    const i32* __restrict__ recv_pos, int capacity_rows,
    const i32* __restrict__ expert_offsets, const i32* __restrict__ tokens_per_expert, int num_local, int alignment,
    void* __restrict__ out_x) {
    typedef RowChunks<EXPAND_VPL> Chunks;
    __shared__ i64 s_peer[MAX_WORLD];
    __shared__ RowBatch batch;
    load_peers(s_peer, peers, world);
    const u64 epoch = state[STATE_EPOCH + CH_TO_DEST] + 1;
    __syncthreads();
    if (wait_arrivals) {
        block_wait_flags(s_peer[rank], world, CH_TO_DEST, FLAG_ARRIVAL, epoch, status, TIMEOUT_TO_DEST_ARRIVAL,
                         timeout_ns);
    }
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int warps = blockDim.x >> 5;
    const u8* recv = reinterpret_cast<const u8*>(s_peer[rank] + off_recv_x);
    u8* out = static_cast<u8*>(out_x);

    const BatchShape shape = batch_shape(static_cast<i64>(world) * max_tokens);
    for (i64 q = blockIdx.x; q < shape.count; q += gridDim.x) {
        const int listed = block_load_rows(batch, recv_pos, nullptr, shape, q, 0);
        for (int unit = warp; unit < listed * Chunks::kPerRow; unit += warps) {
            const int r = batch.list[unit / Chunks::kPerRow];
            const int chunk = unit - (unit / Chunks::kPerRow) * Chunks::kPerRow;
            const int pos = lane < TOPK ? batch.pos[r * TOPK + lane] : -1;
            const u32 kept = __ballot_sync(FULL_MASK, lane < TOPK && pos >= 0 && pos < capacity_rows);
            const u8* src = recv + batch_row(shape, q, r) * ROW_BYTES;
            const int v0 = chunk * Chunks::kVecs + lane;
            Vec16 vals[EXPAND_VPL];
            load_unit<EXPAND_VPL>(src, vals, v0);
            for (u32 m = kept; m != 0u; m &= m - 1u) {
                const int k = __ffs(static_cast<int>(m)) - 1;
                u8* dst = out + static_cast<i64>(batch.pos[r * TOPK + k]) * ROW_BYTES;
#pragma unroll
                for (int u = 0; u < EXPAND_VPL; ++u) {
                    const int v = v0 + 32 * u;
                    if (v < ROW_VECS) st16(dst + static_cast<i64>(v) * 16, vals[u]);
                }
            }
        }
        __syncthreads();  // the batch is overwritten next
    }

    // Padding rows [start_j + n_j, end_j) of every segment: at most alignment - 1 per expert.
    if (expert_offsets != nullptr && alignment > 1) {
        const i64 pad_units = static_cast<i64>(num_local) * (alignment - 1) * Chunks::kPerRow;
        const Vec16 zero = zero16();
        for (i64 unit = static_cast<i64>(blockIdx.x) * warps + warp; unit < pad_units;
             unit += static_cast<i64>(gridDim.x) * warps) {
            const i64 q = unit / Chunks::kPerRow;
            const int chunk = static_cast<int>(unit - q * Chunks::kPerRow);
            const int j = static_cast<int>(q / (alignment - 1));
            const int i = static_cast<int>(q - static_cast<i64>(j) * (alignment - 1));
            const int start = j == 0 ? 0 : expert_offsets[j - 1];
            const int row = start + tokens_per_expert[j] + i;
            if (row >= expert_offsets[j] || row >= capacity_rows) continue;
            u8* dst = out + static_cast<i64>(row) * ROW_BYTES;
            const int v0 = chunk * Chunks::kVecs + lane;
#pragma unroll
            for (int u = 0; u < EXPAND_VPL; ++u) {
                const int v = v0 + 32 * u;
                if (v < ROW_VECS) st16(dst + static_cast<i64>(v) * 16, zero);
            }
        }
    }

    acknowledge_and_advance(state, SLOT_DISPATCH_EXPAND, s_peer, rank, world, CH_TO_DEST, epoch);
}

// ------------------------------------------------------------------------- redispatch_send

// Rows only, along an existing routing: x [T, H] row t goes to recv_x[R][t] of every rank r with
// send_mask[t, r]. Same waits and signals as dispatch_send (count[0][R] = T, arrival[0][R] = e).
extern "C" __global__ void __launch_bounds__(SEND_THREADS) redispatch_send(
    const i64* __restrict__ peers, int rank, int world, int max_tokens, u64* state, i64* status, i64 timeout_ns,
    i64 off_recv_x, const void* __restrict__ x, int num_tokens, const u8* __restrict__ send_mask) {
    typedef RowChunks<SEND_VPL> Chunks;
    __shared__ i64 s_peer[MAX_WORLD];
    load_peers(s_peer, peers, world);
    const u64 epoch = state[STATE_EPOCH + CH_TO_DEST] + 1;
    __syncthreads();
    block_wait_flags(s_peer[rank], world, CH_TO_DEST, FLAG_ACK, epoch - 1, status, TIMEOUT_TO_DEST_ACK, timeout_ns);

    const int warps = blockDim.x >> 5;
    const i64 num_units = static_cast<i64>(num_tokens) * Chunks::kPerRow;
    for (i64 unit = static_cast<i64>(blockIdx.x) * warps + (threadIdx.x >> 5); unit < num_units;
         unit += static_cast<i64>(gridDim.x) * warps) {
        const int t = static_cast<int>(unit / Chunks::kPerRow);
        const int chunk = static_cast<int>(unit - static_cast<i64>(t) * Chunks::kPerRow);
        const u64 dests = warp_dest_set(send_mask + static_cast<i64>(t) * world, world);
        if (dests != 0ull) send_token_unit(s_peer, rank, max_tokens, off_recv_x, x, t, chunk, dests);
    }

    if (last_block_done(state + STATE_DONE + SLOT_REDISPATCH_SEND)) {
        signal_every_rank(s_peer, rank, world, CH_TO_DEST, FLAG_ARRIVAL, epoch, true, static_cast<u64>(num_tokens));
    }
}
