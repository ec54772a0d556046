// expand.cuh: dispatch's expansion (dispatch.cu): copying the rank's own rows and the rows other
// ranks send to the out_x rows of their kept entries, zeroing the segments' padding rows, and how the
// blocks share that work at decode sizes (expand_roles). The protocol (which flags say that rows
// have landed) is at the top of dispatch.cu; the positions come from layout.cuh's layout.
#pragma once

#include "common.cuh"
#if FP8_ROWS
#include "fp8.cuh"
#endif
#include "layout.cuh"

// Small units: decode sizes have few rows to spread over the SMs. Token-major builds copy a row once,
// not to K rows, so a lane keeps more of it in flight.
#if TOKEN_MAJOR
#define EXPAND_VPL 8
#else
#define EXPAND_VPL 4
#endif
#define ROLE_COPIES_PER_WARP 8  // row unit copies a warp makes at decode sizes (expand_roles)
#define PAD_BATCH_UNITS 2       // padding row units a warp zeroes per batch (zero_padding)

// The slab rows an expansion covers: every slab (redispatch), this rank's own (its rows are in x
// before any peer's arrive), or every other rank's.
enum SlabRows { ALL_SLABS, OWN_SLAB };

__device__ __forceinline__ BatchShape slab_rows(SlabRows set, int rank, int world, int max_tokens_per_rank, int blocks) {
    const i64 m = max_tokens_per_rank;
    if (set == OWN_SLAB) return batch_shape(m, blocks, rank * m);
    return batch_shape(world * m, blocks);
}

// This rank's own rows, which no sender copies into its own slab: dispatch reads them where they
// are, x [num_tokens, ...] in the row format (ROW_BYTES a row), or, in an FP8 build with
// `quantize`, the source of fp8_source_unit (x's DTYPE rows, or with `scales` the pre-quantized
// pair x e4m3 / scales float32). Rows t < `packed` were packed into the own slab first (FP8 from
// DTYPE rows): they are read from there.
struct OwnRows {
    const u8* x;
    const float* scales;
    bool quantize;
    int packed;
    int num_tokens;
};

// Warp-wide: store(row) for the out_x rows slab row g goes to (lane k < TOPK holds entry k's position
// in `pos`; kept_entries; pos_at(k): entry k's position, for a kept k, warp-uniform; `lane` is the
// caller's lane). Expert-major: the row of each kept entry, k increasing. TOKEN_MAJOR builds: row g
// itself, once, when an entry is kept (out_x [W * M, ...]; the local permute expands it later).
template <typename PosAt, typename Store>
__device__ __forceinline__ void for_each_target_row(i64 g, int lane, int pos, PosAt pos_at, int capacity_rows, u8* out,
                                                    Store store) {
#if TOKEN_MAJOR
    (void)pos_at;
    if (kept_entries(lane, pos, capacity_rows) != 0u) store(out + g * ROW_BYTES);
#else
    (void)g;
    for (u32 m = kept_entries(lane, pos, capacity_rows); m != 0u; m &= m - 1u) {
        store(out + static_cast<i64>(pos_at(__ffs(static_cast<int>(m)) - 1)) * ROW_BYTES);
    }
#endif
}

// Warp-wide: unit `row_unit` of slab row g to the out_x rows of its kept entries (lane k < TOPK holds
// entry k's recv_pos in `pos`; kept: in [0, capacity_rows)). Rows t >= own.packed of this rank's
// own slab come from `own` (OwnRows: x, or built as they are read); the own rows below own.packed
// and the others from recv_x, where their sources wrote them before a flag this block acquired. A
// call whose waits timed out may carry own rows past own.num_tokens: they are skipped. The
// unit's loads are issued before `pos` is used, so a caller that has just loaded it from memory
// waits for both at once. pos_at(k): entry k's position, for a kept k (warp-uniform).
template <typename PosAt>
__device__ __forceinline__ void copy_row_unit(i64 g, int row_unit, int pos, PosAt pos_at, const u8* recv,
                                              const OwnRows& own, int rank, int max_tokens_per_rank, int capacity_rows,
                                              u8* out) {
    typedef RowUnits<EXPAND_VPL> Units;
    const int lane = threadIdx.x & 31;
    const i64 t = g - static_cast<i64>(rank) * max_tokens_per_rank;
    const bool from_x = t >= own.packed && t < max_tokens_per_rank;  // own.packed >= 0: g is in the own slab
    if (from_x && t >= own.num_tokens) return;
    const int v0 = row_unit * Units::kVecs + lane;
    Vec16 vals[EXPAND_VPL];
#if FP8_ROWS
    if (from_x && own.quantize) {
        Vec16 quad;
        fp8_source_unit<EXPAND_VPL>(own.x, own.scales, t, vals, quad, v0);
        for_each_target_row(g, lane, pos, pos_at, capacity_rows, out,
                            [&](u8* row) { store_fp8_unit<EXPAND_VPL>(row, vals, quad, v0); });
        return;
    }
#endif
    if (from_x) {
        load_unit<EXPAND_VPL, kUserInput>(own.x + t * ROW_BYTES, vals, v0);
    } else {
        load_unit<EXPAND_VPL, kWrittenHere>(recv + g * ROW_BYTES, vals, v0);
    }
    for_each_target_row(g, lane, pos, pos_at, capacity_rows, out,
                        [&](u8* row) { store_unit<EXPAND_VPL>(row, vals, v0); });
}

// Block-wide: copy_row_unit for every unit of the listed rows of `batch` (slab rows batch.row[...]).
__device__ __forceinline__ void copy_listed_rows(const RowBatch& batch, int listed, const u8* recv, const OwnRows& own,
                                                 int rank, int max_tokens_per_rank, int capacity_rows, u8* out) {
    typedef RowUnits<EXPAND_VPL> Units;
    const int lane = threadIdx.x & 31;
    const int warps = blockDim.x >> 5;
    for (int unit = threadIdx.x >> 5; unit < listed * Units::kPerRow; unit += warps) {
        const int r = batch.list[unit / Units::kPerRow];
        const int row_unit = unit - (unit / Units::kPerRow) * Units::kPerRow;
        copy_row_unit(batch.row[r], row_unit, lane < TOPK ? batch.pos[r * TOPK + lane] : -1,
                      [&](int k) { return batch.pos[r * TOPK + k]; }, recv, own, rank, max_tokens_per_rank,
                      capacity_rows, out);
    }
}

// Where the rows of the other ranks' slabs land (expand_units): their chunk flags, in this rank's
// allocation at `base`.
struct ArrivalRows {
    i64 base;
    int chunk_tokens;
    u64 epoch;
    i64* status;
    i64 timeout_ns;
};

// Warp-wide, the warps of blocks [first_block, first_block + blocks), at decode sizes: the units of
// the rows t < T_s of every slab s (s_begin [W + 1], load_slab_tokens) as one space of units, this
// rank's own rows first and then the other slabs in the order of their virtual rows, wrapping
// around (unit u to warp u / blocks of block u % blocks, round after round: the units spread over
// every block's store rate, and over all of a block's warps, before any warp takes a second).
// Each warp loads its row's K positions alongside the unit, slab row g at row g of `positions`
// (recv_pos [W * M, K], written by the layout before a barrier, plain loads; or, with one rank,
// the block's own copy of the layout in shared memory, where g = t); with several ranks
// (kArrivals) a unit of another rank's row first waits for its chunk's flag. No batch of
// positions, loaded by the block before any row, stands between the layout and the rows, and no
// block waits for the rows of others before its own are out (2x H200, T=128: the own rows on 7 of
// each block's 16 warps and then one arrival batch a block, on 7 warps again, ended 3-6 us past
// the barrier).
template <bool kArrivals>
__device__ __forceinline__ void expand_units(int first_block, int blocks, const ArrivalRows& arrivals, const i64* s_begin,
                                             const u8* recv, const OwnRows& own, int rank, int world,
                                             int max_tokens_per_rank, const i32* positions, int capacity_rows,
                                             u8* out) {
    typedef RowUnits<EXPAND_VPL> Units;
    const int lane = threadIdx.x & 31;
    const i64 warps = blockDim.x >> 5;
    const i64 rows = s_begin[world];
    const i64 units = rows * Units::kPerRow;
    for (i64 unit = (threadIdx.x >> 5) * blocks + (blockIdx.x - first_block); unit < units; unit += blocks * warps) {
        i64 v = unit / Units::kPerRow + s_begin[rank];
        if (v >= rows) v -= rows;
        const i64 g = slab_row_of(s_begin, world, max_tokens_per_rank, v);
        const int source = static_cast<int>(g / max_tokens_per_rank);
        if (kArrivals && source != rank) {
            const int t = static_cast<int>(g - static_cast<i64>(source) * max_tokens_per_rank);
            // Every lane acquires the flag: its own loads of the row come after its acquire.
            wait_flag_geq(flag_at(arrivals.base, world, CH_TO_DEST, FLAG_CHUNK + t / arrivals.chunk_tokens, source),
                          arrivals.epoch, arrivals.status, TIMEOUT_TO_DEST_ARRIVAL, source, arrivals.timeout_ns);
        }
        const int pos = lane < TOPK ? positions[g * TOPK + lane] : -1;
        copy_row_unit(g, static_cast<int>(unit % Units::kPerRow), pos,
                      [&](int k) { return __shfl_sync(FULL_MASK, pos, k); }, recv, own, rank, max_tokens_per_rank,
                      capacity_rows, out);
    }
}

// Block-wide, blocks [first_block, gridDim.x): expand every carried slab row of `shape`'s set
// (recv_pos [W * M, K] may have been written by other blocks of this kernel: plain loads).
__device__ __forceinline__ void expand_rows(RowBatch& batch, const BatchShape& shape, int first_block, const u8* recv,
                                            const OwnRows& own, int rank, int max_tokens_per_rank, const i32* recv_pos,
                                            int capacity_rows, u8* out) {
    for (i64 q = blockIdx.x - first_block; q < shape.count; q += gridDim.x - first_block) {
        const int listed = block_load_batch(batch, recv_pos, nullptr, shape, q, 0);
        copy_listed_rows(batch, listed, recv, own, rank, max_tokens_per_rank, capacity_rows, out);
        __syncthreads();  // the batch is overwritten next
    }
}

// The index of a batch drawn by ticket: batches [0, handed_out) went one per block of a group
// first, the rest go one atomic add on `tickets` (zero at the call's start) each. Thread 0 draws
// for its block (expand_arrivals, zero_padding).
__device__ __forceinline__ i64 ticket_batch(u64* tickets, int handed_out) {
    return handed_out + static_cast<i64>(atomicAdd(tickets, 1ull));
}

// Block-wide, after the layout is visible, past decode sizes (expand_units takes them there):
// expand the rows the other ranks send, chunk by chunk as they land. The rows t < T_s (s_tokens
// [W], load_slab_tokens) of every other slab s form pieces p = c * (W - 1) + i (chunk c of the
// i-th other rank), numbered in that order and cut into batches of consecutive rows, so the
// blocks sweep the chunks in the order the senders complete them; before a batch, thread j waits
// for the chunk flag of row j. The batches are sized so that each chunk's rows spread over the
// group, blocks [first_block, gridDim.x), which takes one batch per block first; the batches
// past those go by ticket (atomic adds on `tickets`, zero at the call's
// start), to the group's blocks and to every other block that calls this once its own work is
// done (senders whose rows are out), so blocks that come late take fewer.
__device__ __forceinline__ void expand_arrivals(RowBatch& batch, i64 base, const i32* s_tokens, int rank, int world,
                                                int max_tokens_per_rank, int chunk_tokens, u64 epoch, i64* status,
                                                i64 timeout_ns, int first_block, u64* tickets, const u8* recv,
                                                const i32* recv_pos, int capacity_rows, u8* out) {
    __shared__ i64 s_next;  // the block's next batch
    __shared__ i32 s_piece[(MAX_WORLD - 1) * MAX_CHUNKS];  // rows of the pieces before p
    const int others = world - 1;
    const int pieces = others * MAX_CHUNKS;
    __syncthreads();  // s_piece may still be read by an earlier call's last batch
    const i64 total = block_inclusive_scan(pieces, [&](int p) {
        const int i = p % others;
        const int s = i < rank ? i : i + 1;
        return min(max(s_tokens[s] - (p / others) * chunk_tokens, 0), chunk_tokens);
    }, [&](int p, int rows, int inclusive) { s_piece[p] = inclusive - rows; });

    // Batches small enough that every chunk's rows spread over the group: the rows of the last
    // chunk to land are what is left to expand after the transfer.
    const int blocks = gridDim.x - first_block;
    const i64 chunk_rows = imin64(total, static_cast<i64>(others) * chunk_tokens);
    const i64 per_block = (chunk_rows + blocks - 1) / blocks;
    const int rows = static_cast<int>(per_block < 1 ? 1 : (per_block > BATCH_ROWS ? BATCH_ROWS : per_block));
    // Piece p and slab row of virtual row v < total.
    auto locate = [&](i64 v, int& piece, int& source) -> i64 {
        const int lo = count_at_most(s_piece + 1, pieces - 1, v);  // the last piece starting at or before v
        const int i = lo % others;
        piece = lo;
        source = i < rank ? i : i + 1;
        return static_cast<i64>(source) * max_tokens_per_rank + (lo / others) * static_cast<i64>(chunk_tokens) +
               (v - s_piece[lo]);
    };
    const i64 batches = (total + rows - 1) / rows;
    const bool ticketed = batches > blocks;
    const bool in_group = static_cast<int>(blockIdx.x) >= first_block;
    if (!in_group && !ticketed) return;
    if (!in_group) {
        if (threadIdx.x == 0) s_next = ticket_batch(tickets, blocks);
        __syncthreads();
    }
    for (i64 q = in_group ? blockIdx.x - first_block : s_next; q < batches;) {
        // The next batch's ticket, drawn now: its round trip hides behind this batch.
        const i64 next = threadIdx.x == 0 && ticketed ? ticket_batch(tickets, blocks) : batches;
        if (threadIdx.x < rows && q * rows + threadIdx.x < total) {
            int piece, source;
            locate(q * rows + threadIdx.x, piece, source);
            wait_flag_geq(flag_at(base, world, CH_TO_DEST, FLAG_CHUNK + piece / others, source), epoch, status,
                          TIMEOUT_TO_DEST_ARRIVAL, source, timeout_ns);
        }
        __syncthreads();
        const int listed = block_load_rows(batch, recv_pos, nullptr, rows, [&](int j) -> i64 {
            const i64 v = q * rows + j;
            if (v >= total) return -1;
            int piece, source;
            return locate(v, piece, source);
        }, 0);
        copy_listed_rows(batch, listed, recv, OwnRows{}, rank, max_tokens_per_rank, capacity_rows, out);
        if (threadIdx.x == 0) s_next = next;
        __syncthreads();  // the batch is overwritten next
        q = s_next;
    }
}

// Block-wide: the segments of the local experts in shared memory [num_local_experts] each: s_end (their
// ends, expert_offsets), s_kept (rows kept, tokens_per_expert) and s_pad (padding rows of the
// experts up to and including j, cumulative), from kept_and_end(j, kept, end).
template <typename KeptAndEnd>
__device__ __forceinline__ void segments(i32* s_end, i32* s_kept, i32* s_pad, int num_local_experts, KeptAndEnd kept_and_end) {
    for (int j = threadIdx.x; j < num_local_experts; j += blockDim.x) kept_and_end(j, s_kept[j], s_end[j]);
    __syncthreads();
    block_inclusive_scan(num_local_experts, [&](int j) { return s_end[j] - (j == 0 ? 0 : s_end[j - 1]) - s_kept[j]; },
                         [&](int j, int, int pad) { s_pad[j] = pad; });
}

// segments() from expert_offsets and tokens_per_expert, which the layout's first block wrote
// before a barrier this block passed: coherent loads.
__device__ __forceinline__ void load_segments(i32* s_end, i32* s_kept, i32* s_pad, const i32* expert_offsets,
                                              const i32* tokens_per_expert, int num_local_experts) {
    segments(s_end, s_kept, s_pad, num_local_experts, [&](int j, i32& kept, i32& end) {
        end = ld_relaxed_gpu_i32(expert_offsets + j);
        kept = ld_relaxed_gpu_i32(tokens_per_expert + j);
    });
}

// The end of local expert j's segment in this block's own layout (LayoutShared's totals and starts).
__device__ __forceinline__ i32 layout_segment_end(const LayoutShared& shared, int j, int alignment, int capacity) {
    return shared.start[j] + aligned_rows(min(shared.total[j], capacity), alignment);
}

// segments() from this block's own layout (s_end, s_kept and s_pad may overlay its per-warp
// counts, which are no longer needed).
__device__ __forceinline__ void layout_segments(i32* s_end, i32* s_kept, i32* s_pad, const LayoutShared& shared,
                                                int num_local_experts, int alignment, int capacity) {
    segments(s_end, s_kept, s_pad, num_local_experts, [&](int j, i32& kept, i32& end) {
        kept = min(shared.total[j], capacity);
        end = layout_segment_end(shared, j, alignment, capacity);
    });
}

// Block-wide: zero the padding rows [start_j + n_j, end_j) of every segment (s_end, s_pad from
// segments()), in batches of up to PAD_BATCH_UNITS row units a warp. The zeros go evict-first:
// nothing reads them before the experts, and the rows that combine reads next then stay in L2
// (one H200, one rank, T=128: a graph of dispatch and combine 35.2-36.3 -> 31.5-31.7 us). The
// group, blocks [first_block, last_block), takes one batch per block first; with `tickets` (zero at
// the call's start) the batches past those go by ticket, to the group and to every other block
// that calls this once its own work is done, so blocks that come late take fewer; without, each
// block of the group takes every group-th batch.
__device__ __forceinline__ void zero_padding(const i32* s_end, const i32* s_pad, int num_local_experts, int capacity_rows,
                                             int first_block, int last_block, u64* tickets, u8* out) {
    typedef RowUnits<EXPAND_VPL> Units;
    __shared__ i64 s_next;  // the block's next batch
    const int lane = threadIdx.x & 31;
    const int warps = blockDim.x >> 5;
    const i64 pad_units = static_cast<i64>(s_pad[num_local_experts - 1]) * Units::kPerRow;
    const int group = last_block - first_block;
    // Fewer units a warp when they fill the group's blocks in one batch each (T=1: one unit a warp
    // on as many blocks as it takes; four a warp on 14 blocks cost ~1.6 us of per-SM store rate).
    const i64 spread = (pad_units + static_cast<i64>(group) * warps - 1) / (static_cast<i64>(group) * warps);
    const i64 per_batch = static_cast<i64>(warps) * imin64(spread > 1 ? spread : 1, PAD_BATCH_UNITS);
    const i64 batches = (pad_units + per_batch - 1) / per_batch;
    const bool in_group = static_cast<int>(blockIdx.x) >= first_block && static_cast<int>(blockIdx.x) < last_block;
    const bool ticketed = tickets != nullptr && batches > group;
    if (!in_group && !ticketed) return;
    Vec16 zeros[EXPAND_VPL];
#pragma unroll
    for (int u = 0; u < EXPAND_VPL; ++u) zeros[u] = zero16();
    if (!in_group) {
        if (threadIdx.x == 0) s_next = ticket_batch(tickets, group);
        __syncthreads();
    }
    for (i64 q = in_group ? blockIdx.x - first_block : s_next; q < batches;) {
        // The next batch's ticket, drawn now: its round trip hides behind this batch.
        i64 next = q + group;
        if (ticketed) next = threadIdx.x == 0 ? ticket_batch(tickets, group) : batches;
        const i64 end = imin64((q + 1) * per_batch, pad_units);
        for (i64 unit = q * per_batch + (threadIdx.x >> 5); unit < end; unit += warps) {
            const int p = static_cast<int>(unit / Units::kPerRow);
            const int row_unit = static_cast<int>(unit - static_cast<i64>(p) * Units::kPerRow);
            // The first expert j with s_pad[j] > p (p < s_pad[num_local_experts - 1]).
            const int lo = count_at_most(s_pad, num_local_experts - 1, p);
            const int row = s_end[lo] - (s_pad[lo] - p);
            if (row < capacity_rows) {
                store_unit<EXPAND_VPL, kEvictFirst>(out + static_cast<i64>(row) * ROW_BYTES, zeros,
                                                    row_unit * Units::kVecs + lane);
            }
        }
        if (ticketed) {
            __syncthreads();  // every thread has read this batch's s_next
            if (threadIdx.x == 0) s_next = next;
            __syncthreads();
            next = s_next;
        }
        q = next;
    }
}

// Who expands what around the early group's layout barrier. The padding needs only the segments,
// so where the group has blocks that do not lay out (the layout blocks are its last), those zero it
// before the barrier (`pads_first`, [pad_first, pad_last) = [early, layout_first)): at decode sizes
// on several ranks they alone (2x H200, T=128: the padding on 44 blocks after the segments stamp
// ended 6-8 us after the barrier), past decode sizes with the layout blocks joining by ticket once
// their layout is done (one H200, graph: dispatch T=4096 170.0 -> 168.0 us, FP8 T=512 26.4 ->
// 23.8). Past decode sizes every block of the group then copies own rows in batches (and zeroes
// padding after them when the padding did not go first), then takes arrival batches (the
// senders join by ticket once their rows are out). Decode sizes (`split`): the own rows fill at
// most half of the group at ROLE_COPIES_PER_WARP unit copies a warp (ceil(K / W) copies a row:
// uniform routing keeps K / W of a token's entries on each rank), and the steps are chains of
// round trips more than bytes. One rank (a replicated layout): own rows unit by unit on
// [own_first, own_end), as many blocks as that sizing gives, the padding on [pad_first, grid)
// beside them. Several ranks: past the barrier every block, the senders too (their few rows went
// out before it), copies its share of the units of the own rows and of the arrived ones
// (expand_units). A group whose every block lays out does not split. Without zero padding
// (Config.zero_padding off) no block zeroes: [pad_first, pad_last) is empty, nothing goes before
// the barrier, and one rank's own rows take every block of the group.
struct ExpandRoles {
    bool split;
    bool pads_first;  // the padding goes before the group's barrier, on [pad_first, pad_last) first
    int own_first;  // own rows (and at decode sizes with several ranks the arrived ones) unit by unit on
    int own_end;    // [own_first, own_end) (split or replicated)
    int pad_first;  // the padding on [pad_first, pad_last)
    int pad_last;
};

// num_tokens: this rank's T; layout_first: the first block that lays out; replicated: one rank at
// decode sizes, every block laying out for itself (no barrier); zero_pad: Config.zero_padding.
__device__ __forceinline__ ExpandRoles expand_roles(int early, int layout_first, int grid, int world, int num_tokens,
                                                    bool replicated, bool zero_pad) {
    const i64 warps = blockDim.x >> 5;
    const int group = grid - early;
    // A row's copies: one (token-major), else ceil(K / W) (uniform routing keeps K / W entries on each rank).
    const i64 row_copies = TOKEN_MAJOR ? 1 : (TOPK + world - 1) / world;
    const i64 unit_copies = static_cast<i64>(num_tokens) * RowUnits<EXPAND_VPL>::kPerRow * row_copies;
    const i64 copy_warps = (unit_copies + ROLE_COPIES_PER_WARP - 1) / ROLE_COPIES_PER_WARP;
    const int own = static_cast<int>((copy_warps + warps - 1) / warps);
    const bool split = 2 * own <= group && (world == 1 ? replicated : layout_first > early);
    // Past decode sizes only where at least half of the group is free in the layout's window: on
    // fewer blocks the padding would push the own rows' static batches to the end and lose its
    // tickets' balancing of the tail (one H200, 24 SMs, 8 of them free: T=4096 dispatch 388 -> 406-410 us).
    const bool pads_first =
        zero_pad && !replicated && layout_first > early && (split || 2 * (layout_first - early) >= group);
    ExpandRoles roles{split, pads_first, early, grid, zero_pad ? early : grid, pads_first ? layout_first : grid};
    if (!roles.split) return roles;
    if (world == 1) {
        roles.own_end = roles.pad_first = zero_pad ? early + own : grid;
        return roles;
    }
    roles.own_first = 0;
    return roles;
}

// A replicated layout's own-row blocks (one rank, decode sizes), their rows out: whether they join
// the padding. They do when it may be more than one batch per padding block (zero_padding's
// tickets; its rows are at most the segments' end, from this block's own layout); at T=1 it is
// not, and they end without building the segments.
__device__ __forceinline__ bool own_blocks_join_padding(const LayoutShared& shared, int num_local_experts, int alignment,
                                                        int capacity, int pad_blocks) {
    const i64 rows = layout_segment_end(shared, num_local_experts - 1, alignment, capacity);
    return rows * RowUnits<EXPAND_VPL>::kPerRow > static_cast<i64>(pad_blocks) * (blockDim.x >> 5) * PAD_BATCH_UNITS;
}
