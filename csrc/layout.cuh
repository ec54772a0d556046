// layout.cuh: dispatch's layout phase (dispatch.cu): where each metadata entry lives in the slab,
// and how the receiving rank ranks the entries of its local experts into expert-major positions
// (recv_pos, recv_weight, expert_offsets, tokens_per_expert), exactly moe_comm.routing.plan_destination.
// The protocol that delivers the entries (tagged words) is at the top of dispatch.cu.
#pragma once

#include "common.cuh"

#define LAYOUT_BATCH 4      // tiles whose metadata a warp loads before it ranks them

// Element i of topk_idx (int32 or int64, idx_is_64).
__device__ __forceinline__ i64 expert_id_at(const void* topk_idx, int idx_is_64, i64 i) {
    return idx_is_64 ? static_cast<const i64*>(topk_idx)[i] : static_cast<i64>(static_cast<const i32*>(topk_idx)[i]);
}

// Entry k of metadata row g (tagged words: its local expert id, then its weight's bits) in the
// slab copy at `meta` (recv_meta [W * M, K, 2] u64; META_WORDS u32 a row).
__device__ __forceinline__ u64* meta_entry(i64 meta, i64 g, int k) {
    return reinterpret_cast<u64*>(meta) + (g * META_WORDS) / 2 + 2 * k;
}

// The slab row g = s * M + t of virtual row v (rows t < T_s of all sources concatenated): s is
// the largest source with begin[s] <= v.
__device__ __forceinline__ i64 slab_row_of(const i64* begin, int world, int max_tokens_per_rank, i64 v) {
    const int s = count_at_most(begin + 1, world - 1, v);
    return static_cast<i64>(s) * max_tokens_per_rank + (v - begin[s]);
}

// Entry (g, k) as loaded, before it is taken apart: its two tagged words, or with kRouting the
// expert id and the weight's bits (the weight only when asked for).
struct RawEntry {
    u64 id;
    u64 weight;
};

// Where the layout reads the entries of slab row g: the metadata entries the sources wrote (T_s from
// their count words; an entry is taken once its words carry this call's tag, and zeroed once read
// for the last time, see "tagged words" in common.cuh), or with kRouting (world 1: the one-rank
// kernel) this rank's routing itself: nothing crosses a rank there (T_0 = T; the local expert ids
// are the global ones).
template <bool kRouting>
struct EntrySource {
    i64 meta;                   // recv_meta of this call's copy (meta_entry)
    u64 epoch;
    i64* status;
    i64 timeout_ns;
    const void* topk_idx;       // kRouting: [T, K] int32 or int64 (idx_is_64)
    int idx_is_64;
    const float* topk_weights;  // kRouting: [T, K]
    int num_tokens;             // kRouting: T
    int call_tag;               // this call's tag, which every peer's count word must carry (tagged_count)

    // Issues the loads of entry (g, k); nothing waits for them here.
    __device__ __forceinline__ RawEntry load(i64 g, int k, bool with_weights) const {
        RawEntry raw{0ull, 0ull};
        if (kRouting) {
            raw.id = static_cast<u64>(expert_id_at(topk_idx, idx_is_64, g * TOPK + k));
            if (with_weights) raw.weight = __float_as_uint(topk_weights[g * TOPK + k]);
        } else if (with_weights) {
            ld_relaxed_sys_x2(meta_entry(meta, g, k), raw.id, raw.weight);
        } else {
            raw.id = ld_relaxed_sys(meta_entry(meta, g, k));
        }
        return raw;
    }
    // Waits until the words of a loaded entry carry this call's tag (the source's store may still be
    // in flight).
    __device__ __forceinline__ void settle(RawEntry& raw, i64 g, int k, bool with_weights, int max_tokens_per_rank) const {
        if (kRouting) return;
        const bool id_late = !has_tag(raw.id, epoch);
        const bool weight_late = with_weights && !has_tag(raw.weight, epoch);
        if (id_late || weight_late) {
            const int source = static_cast<int>(g / max_tokens_per_rank);
            const u64* entry = meta_entry(meta, g, k);
            if (id_late) raw.id = wait_tagged(entry, epoch, status, TIMEOUT_TO_DEST_ARRIVAL, source, timeout_ns);
            if (weight_late) raw.weight = wait_tagged(entry + 1, epoch, status, TIMEOUT_TO_DEST_ARRIVAL, source, timeout_ns);
        }
    }
    // The local expert id, -1 if none or invalid.
    __device__ __forceinline__ int local_expert(const RawEntry& raw, int num_local_experts) const {
        const i64 j = kRouting ? static_cast<i64>(raw.id) : static_cast<i64>(static_cast<i32>(static_cast<u32>(raw.id)));
        return j >= 0 && j < num_local_experts ? static_cast<int>(j) : -1;
    }
    __device__ __forceinline__ float weight(const RawEntry& raw) const {
        return __uint_as_float(static_cast<u32>(raw.weight));
    }
    // Entry (g, k) read for the last time: zeroed, so no later call takes it for its own.
    __device__ __forceinline__ void retire(i64 g, int k) const {
        if (kRouting) return;
        asm volatile("st.global.v2.u64 [%0], {%1, %1};" ::"l"(meta_entry(meta, g, k)), "l"(0ull) : "memory");
    }
    // T_p, capped at M.
    __device__ __forceinline__ int tokens(i64 base, int world, int p, int max_tokens_per_rank) const {
        if (kRouting) return num_tokens > max_tokens_per_rank ? max_tokens_per_rank : num_tokens;
        return tagged_count(base, world, p, epoch, max_tokens_per_rank, call_tag, status, timeout_ns);
    }
};

// The entries of LAYOUT_BATCH consecutive tiles of a warp, one lane per entry (k) of a row.
struct TileBatch {
    int ids[LAYOUT_BATCH];         // local expert id, -1 if none or invalid
    float weights[LAYOUT_BATCH];   // router weight (loaded only when asked for)
    i64 rows[LAYOUT_BATCH];        // slab row g = s * M + t, -1 if the lane has no entry
};

// Warp-wide: tiles [tile0, min(tile0 + LAYOUT_BATCH, tile_end)) of the virtual rows v <
// total_rows (tile i holds rows [i * rows_per_tile, (i + 1) * rows_per_tile)) from `src`; all of
// the batch's loads are issued before any is used.
template <typename Entries>
__device__ __forceinline__ void load_tile_batch(TileBatch& batch, const Entries& src, const i64* begin, int world,
                                                int max_tokens_per_rank, int num_local_experts, i64 tile0, i64 tile_end,
                                                i64 total_rows, bool with_weights) {
    const int rows_per_tile = 32 / TOPK;
    const int lane = threadIdx.x & 31;
    const int tile_row = lane / TOPK;
    const int k = lane - tile_row * TOPK;
    RawEntry raw[LAYOUT_BATCH];
#pragma unroll
    for (int b = 0; b < LAYOUT_BATCH; ++b) {
        batch.rows[b] = -1;
        const i64 v = (tile0 + b) * rows_per_tile + tile_row;
        if (tile_row < rows_per_tile && tile0 + b < tile_end && v < total_rows) {
            const i64 g = slab_row_of(begin, world, max_tokens_per_rank, v);
            raw[b] = src.load(g, k, with_weights);
            batch.rows[b] = g;
        }
    }
#pragma unroll
    for (int b = 0; b < LAYOUT_BATCH; ++b) {
        batch.ids[b] = -1;
        batch.weights[b] = 0.0f;
        if (batch.rows[b] >= 0) {
            src.settle(raw[b], batch.rows[b], k, with_weights, max_tokens_per_rank);
            batch.ids[b] = src.local_expert(raw[b], num_local_experts);
            if (with_weights) batch.weights[b] = src.weight(raw[b]);
        }
    }
}

// Block-wide: the tokens T_s of every source (its count word, at most M; at world 1 the routing's
// T) into s_tokens [W], where each source's rows start among the concatenated rows t < T_s into
// s_begin [W + 1] (s_begin[W]: all of them). Ends with __syncthreads().
template <typename Entries>
__device__ __forceinline__ void load_slab_tokens(i32* s_tokens, i64* s_begin, const Entries& src, i64 base, int world,
                                                 int max_tokens_per_rank) {
    for (int p = threadIdx.x; p < world; p += blockDim.x) s_tokens[p] = src.tokens(base, world, p, max_tokens_per_rank);
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
}

// Warp-wide, pass 1 of the layout: the entries of the warp's tiles [tile_begin, tile_end) counted
// per local expert into my_count [num_local_experts]; a warp with one batch keeps its entries in
// `entries` for pass 2. Ends with __syncthreads().
template <typename Entries>
__device__ __forceinline__ void count_entries(TileBatch& entries, i32* my_count, const Entries& src, const i64* begin,
                                              int world, int max_tokens_per_rank, int num_local_experts,
                                              i64 tile_begin, i64 tile_end, i64 total_rows, bool one_batch) {
    for (i64 tile0 = tile_begin; tile0 < tile_end; tile0 += LAYOUT_BATCH) {
        load_tile_batch(entries, src, begin, world, max_tokens_per_rank, num_local_experts, tile0, tile_end, total_rows, one_batch);
#pragma unroll
        for (int b = 0; b < LAYOUT_BATCH; ++b) {
            if (tile0 + b >= tile_end) break;  // the warp's last batch may be short
            // Counts need no order: a shared atomic per entry, not the warp-wide match of pass 2.
            if (entries.ids[b] >= 0) atomicAdd(my_count + entries.ids[b], 1);
        }
    }
    __syncthreads();
}

// Block-wide: s_count [warps][num_local_experts] becomes each warp's first rank per expert (an
// exclusive prefix over warps), s_total [num_local_experts] the block's entries per expert.
__device__ __forceinline__ void prefix_over_warps(i32* s_count, i32* s_total, int warps, int num_local_experts) {
    for (int j = threadIdx.x; j < num_local_experts; j += blockDim.x) {
        int run = 0;
        for (int w = 0; w < warps; ++w) {
            const int c = s_count[w * num_local_experts + j];
            s_count[w * num_local_experts + j] = run;
            run += c;
        }
        s_total[j] = run;
    }
    __syncthreads();
}

// Block-wide: s_before [num_local_experts] = the entries of the layout blocks before this one
// (they hold the earlier tiles) and s_total = every block's. With several layout blocks each
// publishes its counts in block_counts and waits for the others' behind a barrier; one block
// (decode sizes) has them all already.
__device__ __forceinline__ void gather_block_counts(i32* s_total, i32* s_before, int num_local_experts, int block,
                                                    int blocks, i32* block_counts, u64* barrier_flags, u64 epoch,
                                                    i64* status, int rank, i64 timeout_ns) {
    if (blocks > 1) {
        for (int j = threadIdx.x; j < num_local_experts; j += blockDim.x) block_counts[block * num_local_experts + j] = s_total[j];
        blocks_barrier(barrier_flags, block, 0, blocks, epoch, status, rank, timeout_ns);
        for (int j = threadIdx.x; j < num_local_experts; j += blockDim.x) {
            int before = 0, total = 0;
            for (int b = 0; b < blocks; ++b) {
                const int c = ld_relaxed_gpu_i32(block_counts + b * num_local_experts + j);
                before += b < block ? c : 0;
                total += c;
            }
            s_before[j] = before;
            s_total[j] = total;
        }
    } else {
        for (int j = threadIdx.x; j < num_local_experts; j += blockDim.x) s_before[j] = 0;
    }
    __syncthreads();
}

// The layout blocks together: the entries of the rows t >= T_s of every slab s are empty.
__device__ __forceinline__ void clear_empty_rows(const i32* s_tokens, int world, int max_tokens_per_rank, int block,
                                                 int blocks, i32* recv_pos, float* recv_weight) {
    for (int s = 0; s < world; ++s) {
        const i64 begin = (static_cast<i64>(s) * max_tokens_per_rank + s_tokens[s]) * TOPK;
        const i64 end = static_cast<i64>(s + 1) * max_tokens_per_rank * TOPK;
        for (i64 i = begin + static_cast<i64>(block) * blockDim.x + threadIdx.x; i < end;
             i += static_cast<i64>(blocks) * blockDim.x) {
            recv_pos[i] = -1;
            recv_weight[i] = 0.0f;
        }
    }
}

// Warp-wide: the warp's drops of call `epoch` (count and smallest (s << 32 | t)) into the status word.
__device__ __forceinline__ void report_drops(i64* status, i64 num_dropped, i64 first_dropped, u64 epoch) {
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) num_dropped += __shfl_xor_sync(FULL_MASK, num_dropped, offset);
    first_dropped = warp_min_i64(first_dropped);
    if ((threadIdx.x & 31) == 0 && num_dropped != 0) {
        status_add_offenders(status, STATUS_NUM_DROPPED, STATUS_FIRST_DROPPED_CALL, num_dropped, first_dropped, epoch);
    }
}

// (s << 32) | t of slab row g = s * M + t: the status word's key of a dropped entry. Out of line:
// drops are rare, and the 64-bit division would sit in the code of the ranking loop.
__device__ __noinline__ i64 slab_key(i64 g, int max_tokens_per_rank) {
    const i64 s = g / max_tokens_per_rank;
    return (s << 32) | (g - s * max_tokens_per_rank);
}

// Rows of a segment of `kept` rows, rounded up to the alignment.
__device__ __forceinline__ int aligned_rows(int kept, int alignment) {
    return (kept + alignment - 1) / alignment * alignment;
}

// The layout's dynamic shared memory (32-bit words): per-warp counts [warps][L], then L each of
// block totals, earlier blocks' counts and segment starts, per-warp lane sets [warps][L], then (a
// replicated layout) the positions of the carried rows [LAYOUT_ROWS_PER_BLOCK][K]. The host sizes
// it (kernels.DispatchKernels).
struct LayoutShared {
    i32* count;      // [warps][L]
    i32* total;      // [L]: this block's entries per expert, then every block's
    i32* before;     // [L]: entries of the layout blocks before this one
    i32* start;      // [L]: segment starts
    u32* lanes;      // [warps][L]: zero between tiles (same_expert_lanes)
    i32* positions;  // [LAYOUT_ROWS_PER_BLOCK][K]: recv_pos of virtual row v (rows t < T_s concatenated)
};

__device__ __forceinline__ LayoutShared layout_shared(i32* smem, int num_local_experts) {
    const int per_warp = (blockDim.x >> 5) * num_local_experts;
    LayoutShared shared;
    shared.count = smem;
    shared.total = smem + per_warp;
    shared.before = shared.total + num_local_experts;
    shared.start = shared.before + num_local_experts;
    shared.lanes = reinterpret_cast<u32*>(shared.start + num_local_experts);
    shared.positions = shared.start + num_local_experts + per_warp;
    return shared;
}

// Warp-wide: the lanes whose local expert j equals this lane's (none for j < 0), what
// __match_any_sync gives, through the warp's row of LayoutShared::lanes: MATCH.ANY's cost grows
// with the distinct values in the warp (one H200, 16 warps of a block, 32 distinct values a warp:
// ~460 ns a warp per match against ~50 for a ballot), and a tile's lanes hold up to 32 experts.
// The caller zeroes the word once every lane has read it (the first lane of each expert, after a
// __syncwarp), so the row is zero again before the next tile.
__device__ __forceinline__ u32 same_expert_lanes(u32* lanes, int j) {
    if (j >= 0) atomicOr(lanes + j, 1u << (threadIdx.x & 31));
    __syncwarp();
    return j >= 0 ? lanes[j] : 0u;
}

// Which part of the layout a block does. The layout blocks split the rows, each writing its part of
// the outputs; with one rank at decode sizes (its rows fit one layout block) every block of the
// group lays out all of them for itself instead, keeping the positions in shared memory, so no
// barrier stands between the layout and the copies; one block (`writes`) writes the outputs.
struct LayoutScope {
    int block, blocks;              // this block among those that rank the rows
    int clear_block, clear_blocks;  // this block among those that clear the empty slab rows
    bool writes;                    // writes recv_pos, recv_weight, the segments, and reports drops
    bool keeps_positions;           // fills LayoutShared::positions (the whole layout is this block's);
                                    // a block that neither keeps nor writes them stops at the segments
};

// Block-wide, after every source's metadata was acquired (or at world 1 at once): the layout (see
// the top of this file) of the rows of s_tokens / s_begin (load_slab_tokens) read from `src`, this
// block's part of it by `scope`. block_counts [blocks, num_local_experts] int32 and barrier_flags
// [blocks] u64 are local scratch (flags start at 0). With `segments_stamp` the first layout block
// stamps it with the epoch once the segments (expert_offsets, tokens_per_expert) are written,
// before pass 2. Pass 2 and the segment scan stay inline here: as helpers they changed the machine
// code (more registers for pass 2).
template <typename Entries>
__device__ __forceinline__ void layout_entries(const LayoutShared& shared, const Entries& src, const i32* s_tokens,
                                               const i64* s_begin, int rank, int world, int max_tokens_per_rank, u64 epoch,
                                               i64* status, i64 timeout_ns, int num_local_experts, int alignment,
                                               int capacity, const LayoutScope& scope, i32* recv_pos, float* recv_weight,
                                               i32* expert_offsets, i32* tokens_per_expert, i32* block_counts,
                                               u64* barrier_flags, u64* segments_stamp) {
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int warps = blockDim.x >> 5;
    const int block = scope.block;
    for (int i = threadIdx.x; i < warps * num_local_experts; i += blockDim.x) {
        shared.count[i] = 0;
        shared.lanes[i] = 0u;
    }

    // Entries are taken in tiles of whole rows (32 / K rows, one lane per entry), and each warp
    // owns a contiguous range of tiles, so ranks follow the lexicographic (s, t, k) order.
    const int rows_per_tile = 32 / TOPK;
    const int tile_row = lane / TOPK;
    const int k = lane - tile_row * TOPK;
    const i64 total_rows = s_begin[world];
    // The host sized `blocks` for full slabs; the rows of this call fill only `busy` of them (one
    // at decode sizes, which then needs no barrier). Every layout block reads the same counts.
    const i64 filled = (total_rows + LAYOUT_ROWS_PER_BLOCK - 1) / LAYOUT_ROWS_PER_BLOCK;
    const int busy = static_cast<int>(imin64(scope.blocks, filled > 1 ? filled : 1));
    if (block >= busy) {
        clear_empty_rows(s_tokens, world, max_tokens_per_rank, scope.clear_block, scope.clear_blocks, recv_pos,
                         recv_weight);
        return;
    }
    const i64 num_tiles = (total_rows + rows_per_tile - 1) / rows_per_tile;
    const i64 per_block = (num_tiles + busy - 1) / busy;
    const i64 block_begin = imin64(num_tiles, block * per_block);
    const i64 block_end = imin64(num_tiles, block_begin + per_block);
    const i64 per_warp = (block_end - block_begin + warps - 1) / warps;
    const i64 tile_begin = imin64(block_end, block_begin + warp * per_warp);
    const i64 tile_end = imin64(block_end, tile_begin + per_warp);
    const u32 row_lanes = TOPK == 32 ? FULL_MASK : ((1u << (TOPK & 31)) - 1u) << ((tile_row * TOPK) & 31);
    i32* my_count = shared.count + warp * num_local_experts;
    u32* my_lanes = shared.lanes + warp * num_local_experts;

    // Pass 1. A warp with one batch (decode sizes) keeps its entries, weights too, in registers
    // for pass 2: one round trip to the metadata fewer.
    const bool one_batch = tile_end - tile_begin <= LAYOUT_BATCH;
    TileBatch entries;
    __syncthreads();  // the counts are zero
    count_entries(entries, my_count, src, s_begin, world, max_tokens_per_rank, num_local_experts, tile_begin, tile_end,
                  total_rows, one_batch);
    prefix_over_warps(shared.count, shared.total, warps, num_local_experts);
    gather_block_counts(shared.total, shared.before, num_local_experts, block, busy, block_counts, barrier_flags, epoch,
                        status, rank, timeout_ns);

    // Kept counts, aligned segments and their cumulative ends.
    block_inclusive_scan(num_local_experts, [&](int j) {
        const int kept = min(shared.total[j], capacity);
        return aligned_rows(kept, alignment);
    }, [&](int j, int segment, int end) {
        shared.start[j] = end - segment;
        if (block == 0 && scope.writes) {
            expert_offsets[j] = end;
            tokens_per_expert[j] = min(shared.total[j], capacity);
        }
    });
    // Cumulative: the scan's closing barrier ordered the block's segment stores before it.
    if (segments_stamp != nullptr && block == 0 && scope.writes && threadIdx.x == 0) st_release_gpu(segments_stamp, epoch);

    // Pass 2: ranks, positions, weights (none for a block that neither keeps nor writes them).
    i64 num_dropped = 0;
    i64 first_dropped = NO_OFFENDER;
    const i64 ranked_end = scope.keeps_positions || scope.writes ? tile_end : tile_begin;
    for (i64 tile0 = tile_begin; tile0 < ranked_end; tile0 += LAYOUT_BATCH) {
        if (!one_batch) {
            load_tile_batch(entries, src, s_begin, world, max_tokens_per_rank, num_local_experts, tile0, tile_end, total_rows, true);
        }
        // One copy of the ranking code for every tile of the batch (the batch's arrays shift down a
        // tile per iteration, so they stay in registers): a block runs it once per call, and each
        // unrolled copy of it was fetched cold (2x H200, per-warp stamps: 0.6-0.9 us a tile
        // unrolled, ~0.35 looped).
#pragma unroll 1
        for (int b = 0; b < LAYOUT_BATCH && tile0 + b < tile_end; ++b) {
            const int j = entries.ids[0];
            const float weight = entries.weights[0];
            const i64 g = entries.rows[0];
#pragma unroll
            for (int i = 0; i + 1 < LAYOUT_BATCH; ++i) {
                entries.ids[i] = entries.ids[i + 1];
                entries.weights[i] = entries.weights[i + 1];
                entries.rows[i] = entries.rows[i + 1];
            }
            const u32 same = same_expert_lanes(my_lanes, j);
            const u32 nonempty = __ballot_sync(FULL_MASK, j >= 0);
            const bool first_of_expert = j >= 0 && (same & lanemask_lt()) == 0u;
            const int rank_in_expert = j >= 0 ? shared.before[j] + my_count[j] + __popc(same & lanemask_lt()) : 0;
            __syncwarp();
            if (first_of_expert) {
                my_count[j] += __popc(same);
                my_lanes[j] = 0u;
            }
            __syncwarp();
            if (g >= 0) {
                src.retire(g, k);
                int pos = -1;
                if (j >= 0) {
                    if (rank_in_expert < capacity) {
                        pos = shared.start[j] + rank_in_expert;
                    } else {
                        pos = -2;
                        ++num_dropped;
                        first_dropped = imin64(first_dropped, slab_key(g, max_tokens_per_rank));
                    }
                }
                if (scope.keeps_positions) shared.positions[((tile0 + b) * rows_per_tile + tile_row) * TOPK + k] = pos;
                if (scope.writes) {
                    recv_pos[g * TOPK + k] = pos;
                    // A row that carries a token keeps all K weights (as the source sent them).
                    recv_weight[g * TOPK + k] = (nonempty & row_lanes) != 0u ? weight : 0.0f;
                }
            }
        }
    }

    clear_empty_rows(s_tokens, world, max_tokens_per_rank, scope.clear_block, scope.clear_blocks, recv_pos, recv_weight);
    if (scope.writes) report_drops(status, num_dropped, first_dropped, epoch);
    __syncthreads();  // the positions are complete
}
