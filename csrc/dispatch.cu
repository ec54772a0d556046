// dispatch.cu: send tokens to the ranks of their experts and lay them out expert-major there.
//
// Protocol: channel 0 ("to destination"). Each call uses epoch e = state.epoch[0] + 1, read from
// device memory by every kernel (never baked into a graph), so a graph replay or an eager call
// always runs at the next epoch. Every rank runs the same sequence of operations, so epochs agree.
// The slabs (recv_meta, recv_x) and the count words exist twice, by epoch parity (Config.slab_copies
// 2, the default; see "slab copies" in common.cuh): call e writes copy e & 1, which its peer last
// read at e - 2. The peer ended that call before it wrote its count word of e - 1 or signalled
// anything of e - 1, and this rank's call at e - 1 read that count word (dispatch's layout) or
// waited for that arrival signal (redispatch) before it ended: so no call waits for an ack. With
// slab_copies 1 the waits and signals marked "(one copy)" below come back. Memory: the two copies
// of recv_x are 2 * W * M * row bytes of every rank's allocation (2 x 470 MB at W = 8, M = 4096,
// H = 7168 bf16); moe-comm info --config gives the total.
//
// One kernel per call, `dispatch` (`dispatch_one_rank` at world 1, below), on one block per SM (its
// blocks wait for each other, so all of them must be resident at once). Blocks [0, num_senders) send (num_senders: the SM budget of
// pushing rows; 0 at world 1, where no row leaves the rank); the blocks after them, when there are
// any, form the "early group", which lays out and expands what it can while the rows are still in
// flight. Phases, on rank R:
//   send metadata (blocks [0, meta_blocks), one warp per token; meta_blocks = the larger of
//     num_senders and min(grid, ceil(T / warps per block)): the layout waits for all of it, so at
//     large T it is spread over the whole grid). (One copy:) every warp of these blocks first
//     waits until ack[0][r] >= e - 1 in R's own flags for every rank r (r has finished reading
//     what R sent it at the previous epoch), its first token's inputs loading meanwhile.
//     Block 0 first writes count[0][e & 1][R] = T, a tagged word (common.cuh), into every rank's
//     flags (a word per parity, never acked). Then for each token t < T, recv_meta[R][t] of EVERY
//     rank r gets t's metadata row, per column k one 16-byte store of two tagged words: the local
//     expert id of the assignment if it lives on r (-1 elsewhere) and the router weight;
//     send_mask [T, W] and dest_rank [T, K] (local outputs) are written and invalid expert ids
//     are counted into the status word (count + smallest (R << 32 | t)). No done-counter or
//     signal follows: a reader takes each word once it carries the call's tag.
//   send rows (senders, one warp per (token, row part), one unit per warp per round): recv_x[R][t]
//     of every OTHER rank t is sent to gets the x row, once per rank (16-byte stores); R's own
//     rows are never copied, the expansion reads them from x. Tokens [c * chunk_tokens,
//     (c + 1) * chunk_tokens) form chunk c (at most MAX_CHUNKS): after the round that moved its
//     last row, the last sender block to get there release-stores chunk_c[0][R] = e into every
//     rank's flags.
//   layout (early group, or every block when all send; its last layout_blocks blocks rank): T_s =
//     count[0][e & 1][s] once it carries the tag of e; slab rows t >= T_s are empty. Each entry is
//     taken once both its words carry that tag, and zeroed by the block that read it last. Ranks
//     the entries (s, t, k) of each local expert in lexicographic order (the rows t < T_s fill
//     the first ceil(sum T_s / LAYOUT_ROWS_PER_BLOCK) layout blocks, the busy ones;
//     busy block b takes the b-th range of rows, counts its entries per expert, publishes the
//     counts in local scratch behind a barrier of the busy blocks (none when one is busy), and
//     offsets its ranks by the counts of the blocks before it), applies the capacity (rank >= C:
//     dropped, pos -2, counted with the smallest (s << 32 | t)), aligns the segments, and writes
//     recv_pos [W, M, K], recv_weight [W, M, K], expert_offsets [L], tokens_per_expert [L]: exactly
//     moe_comm.routing.plan_destination.
//   own expansion (the same group, after a barrier of it): copies each of R's own rows (from x)
//     to the out_x row of each of its kept entries and zeroes every segment's padding rows
//     [start_j + n_j, end_j) (rows at or past expert_offsets[-1] are not touched), evict-first in
//     L2 (nothing reads them before the experts; the rows combine reads next stay).
//   arrivals (the same group, and the senders once their rows are out): the same copy for the rows
//     the other ranks send, chunk by chunk as chunk_c[0][s] >= e says they have landed, so the
//     expansion trails the transfer. Past one batch per block of the arrival group, batches go by
//     ticket (state[STATE_CLAIM + (e & 1)], zeroed by the call before), so late blocks take fewer;
//     at decode sizes the batches are sized for the whole grid, so every block joins once its own
//     part is done.
//   Past decode sizes every block of the group copies own rows, zeroes padding, then takes arrival
//   batches; at decode sizes the three run side by side on parts of the group (expand_roles), and
//   the padding blocks start once the first layout block has stamped the segments, before the
//   positions (they pass the group's barrier without waiting, and wait for it before arrivals).
//   The call ends (end_call): the block counted in last at the start sets state.epoch[0] = e.
//   (One copy:) instead every block counts itself done at the end, and the last one release-stores
//   ack[0][R] = e into every source's flags, then sets state.epoch[0] = e.
// One rank (world 1) runs `dispatch_one_rank`, the same phases less what only peers need: no
// senders, no metadata rows or signal (the metadata phase, on the last blocks, writes send_mask,
// dest_rank and the status word only), and the layout reads topk_idx and topk_weights themselves,
// so it starts at once. When the T rows fit one layout block (decode sizes) every block lays them
// all out for itself, keeping the positions in shared memory, and copies its part of the own rows
// and padding with no barrier; one block writes the outputs (LayoutScope). The padding blocks stop
// the layout at the segments (no positions), and their batches past one per block go by ticket
// (the arrivals' words, unused at one rank), to them and to the own-row blocks once their rows are
// out.
// FP8 dispatch runs a build with FP8_ROWS (common.cuh): slabs and out_x hold packed FP8 rows, and
// with `quantize` the send and own-expansion phases build them from config-dtype x as they go
// ("FP8 rows from DTYPE rows" below); without it x holds packed rows, copied like any rows.
// `redispatch` runs the same channel with rows only (no metadata) along an existing routing's
// send_mask: it writes its tagged count word as dispatch does (every call of a parity rewrites
// that word), its senders ((one copy:) after the acks of e - 1) release-store arrival[0][R] = e
// when done (at world 1 one block, which sends nothing, only signals), and every block then expands
// every slab with the routing's recv_pos (no layout, no padding).
//
// A wait that runs past timeout_ns records (phase, peer) into the status word and gives up, so
// every kernel terminates; the results of that call are then invalid (Dispatcher.check() says so).
//
// moe_comm-defines: {"DTYPE": "bf16", "HIDDEN": 1024, "TOPK": 4}
// moe_comm-defines: {"DTYPE": "bf16", "HIDDEN": 7168, "TOPK": 8}
// moe_comm-defines: {"DTYPE": "bf16", "HIDDEN": 7168, "TOPK": 8, "FP8_ROWS": 1, "FP8_INV_MAX_BITS": 991054117}

#include "common.cuh"
#if FP8_ROWS
#include "fp8.cuh"
#endif

#define EXPAND_VPL 4        // small units: decode sizes have few rows to spread over the SMs
#define LAYOUT_BATCH 4      // tiles whose metadata a warp loads before it ranks them
#define ROLE_COPIES_PER_WARP 8  // row unit copies a warp makes at decode sizes (expand_roles)
#define PAD_BATCH_UNITS 2       // padding row units a warp zeroes per batch (zero_padding)

// ------------------------------------------------------------------ FP8 rows from DTYPE rows
#if FP8_ROWS
// FP8 dispatch of config-dtype x (`quantize`) builds the packed rows (common.cuh's FP8_ROW_BYTES)
// from x's DTYPE rows itself, so no pass over x runs before the kernel: the senders quantize each
// unit as they send it (fp8.cuh's quantize_unit). This rank's own rows: those of the first
// FP8_PACK_OWN_MAX_TOKENS tokens are packed into the own slab by the early group's blocks that do
// not lay out, while the metadata travels and the layout runs, and the own expansion copies them
// from there like any slab rows (their quantization off the expansion's path, their packed bytes
// still in L2); more would outlast the layout, so the own expansion quantizes each unit of the
// rest as it copies it (no round trip of those rows through memory). FP8 dispatch of packed rows
// (x_fp8 and scales, packed by fp8.cu's pack_pairs) copies them like any rows.

#if PUT_TRANSPORT
// Warp-wide: what unit `chunk` of a quantized row stored into the staged row (store_fp8_unit) goes
// to `dst` on rank `pe`: its e4m3 vectors, its blocks' scales (and the zeros after the last).
template <int VPL>
__device__ __forceinline__ void put_fp8_unit(u8* dst, const u8* staged, int chunk, int pe) {
    const int first = chunk * 32 * VPL;
    if (first >= FP8_VECS) return;
    const int vecs = FP8_VECS - first < 32 * VPL ? FP8_VECS - first : 32 * VPL;
    const int scales_begin = HIDDEN + 4 * (first / FP8_GROUP);
    const int scales_end = first + vecs == FP8_VECS ? FP8_ROW_BYTES : HIDDEN + 4 * ((first + vecs) / FP8_GROUP);
    __syncwarp();
    nvshmemx_putmem_nbi_warp(dst + static_cast<i64>(first) * 16, staged + static_cast<i64>(first) * 16,
                             static_cast<size_t>(vecs) * 16, pe);
    nvshmemx_putmem_nbi_warp(dst + scales_begin, staged + scales_begin, static_cast<size_t>(scales_end - scales_begin),
                             pe);
}
#endif

// Warp-wide: send_token_unit's quantizing path, for the DTYPE row at src_row: the unit in two
// halves (a whole unit's DTYPE vectors at once would spill registers).
__device__ __forceinline__ void send_fp8_unit(const i64* s_peer, int rank, i64 row_offset, const u8* src_row, int chunk,
                                              int v0, u64 others) {
    constexpr int kHalf = SEND_VPL / 2;
#if PUT_TRANSPORT
    u8* staged = reinterpret_cast<u8*>(s_peer[rank] + row_offset);
#else
    (void)rank;
    (void)chunk;
#endif
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const int half_v0 = v0 + 32 * kHalf * half;
        Vec16 vals[kHalf];
        float scales[kHalf];
        quantize_unit<kHalf>(src_row, vals, scales, half_v0);
#if PUT_TRANSPORT
        store_fp8_unit<kHalf>(staged, vals, scales, half_v0);
#else
        for (u64 m = others; m != 0ull; m &= m - 1ull) {
            store_fp8_unit<kHalf>(reinterpret_cast<u8*>(s_peer[__ffsll(static_cast<i64>(m)) - 1] + row_offset), vals,
                                  scales, half_v0);
        }
#endif
    }
#if PUT_TRANSPORT
    for (u64 m = others; m != 0ull; m &= m - 1ull) {
        const int r = __ffsll(static_cast<i64>(m)) - 1;
        put_fp8_unit<SEND_VPL>(reinterpret_cast<u8*>(s_peer[r] + row_offset), staged, chunk, r);
    }
#endif
}
#endif  // FP8_ROWS

// ------------------------------------------------------------------------------- send phase

// Warp-wide: unit `chunk` of token row t of x [T, H] to slab row recv_x[rank][t] of every OTHER
// rank in `dests` (this rank's expand reads its own tokens from x); with `quantize` (FP8_ROWS
// builds) x holds DTYPE rows, quantized on the way (send_fp8_unit). With puts the unit is first
// stored into this rank's own slab row, the copy NVSHMEM reads.
__device__ __forceinline__ void send_token_unit(const i64* s_peer, int rank, int max_tokens_per_rank, i64 off_recv_x,
                                                const void* x, bool quantize, int t, int chunk, u64 dests) {
    typedef RowParts<SEND_VPL> Chunks;
    const u64 others = dests & ~(1ull << rank);
    if (others == 0ull) return;
    const i64 row_offset = off_recv_x + (static_cast<i64>(rank) * max_tokens_per_rank + t) * ROW_BYTES;
    const int v0 = chunk * Chunks::kVecs + (threadIdx.x & 31);
#if FP8_ROWS
    if (quantize) {
        send_fp8_unit(s_peer, rank, row_offset, static_cast<const u8*>(x) + static_cast<i64>(t) * SOURCE_ROW_BYTES,
                      chunk, v0, others);
        return;
    }
#else
    (void)quantize;
#endif
    Vec16 vals[SEND_VPL];
    load_unit<SEND_VPL, kUserInput>(static_cast<const u8*>(x) + static_cast<i64>(t) * ROW_BYTES, vals, v0);
#if PUT_TRANSPORT
    const u8* staged = reinterpret_cast<const u8*>(s_peer[rank] + row_offset);
    store_unit<SEND_VPL>(const_cast<u8*>(staged), vals, v0);
    for (u64 m = others; m != 0ull; m &= m - 1ull) {
        const int r = __ffsll(static_cast<i64>(m)) - 1;
        put_unit<SEND_VPL>(reinterpret_cast<u8*>(s_peer[r] + row_offset), staged, chunk, r);
    }
#else
    for (u64 m = others; m != 0ull; m &= m - 1ull) {
        store_unit<SEND_VPL>(reinterpret_cast<u8*>(s_peer[__ffsll(static_cast<i64>(m)) - 1] + row_offset), vals, v0);
    }
#endif
}

// Warp-wide: where token t goes. Lane k < TOPK gets its assignment's expert id (`expert`, as
// given), destination rank (`dest`, -1 when the id is -1 or invalid) and local expert id
// (`local`); every lane gets the set of destination ranks.
struct TokenRoute {
    i64 expert;
    int dest;
    int local;
    u64 dest_set;
};

// Element i of topk_idx (int32 or int64, idx_is_64).
__device__ __forceinline__ i64 expert_id_at(const void* topk_idx, int idx_is_64, i64 i) {
    return idx_is_64 ? static_cast<const i64*>(topk_idx)[i] : static_cast<i64>(static_cast<const i32*>(topk_idx)[i]);
}

// Lane k < TOPK: topk_idx[t, k]; other lanes: -1.
__device__ __forceinline__ i64 load_expert_id(const void* topk_idx, int idx_is_64, int t) {
    const int lane = threadIdx.x & 31;
    if (lane >= TOPK) return -1;
    return expert_id_at(topk_idx, idx_is_64, static_cast<i64>(t) * TOPK + lane);
}

// Warp-wide: the route of a token from every lane's load_expert_id.
__device__ __forceinline__ TokenRoute route_expert_ids(i64 expert, int num_experts, int num_local_experts) {
    const int lane = threadIdx.x & 31;
    TokenRoute route;
    route.expert = expert;
    const bool valid = lane < TOPK && route.expert >= 0 && route.expert < num_experts;
    route.dest = valid ? static_cast<int>(route.expert / num_local_experts) : -1;
    route.local = valid ? static_cast<int>(route.expert - static_cast<i64>(route.dest) * num_local_experts) : -1;
    // Two warp reductions, not a match of equal ranks (MATCH.ANY's cost grows with the distinct values).
    const u32 lo = valid && route.dest < 32 ? 1u << route.dest : 0u;
    const u32 hi = valid && route.dest >= 32 ? 1u << (route.dest - 32) : 0u;
    route.dest_set = static_cast<u64>(__reduce_or_sync(FULL_MASK, lo)) |
                     (static_cast<u64>(__reduce_or_sync(FULL_MASK, hi)) << 32);
    return route;
}

__device__ __forceinline__ TokenRoute route_token(const void* topk_idx, int idx_is_64, int t, int num_experts,
                                                  int num_local_experts) {
    return route_expert_ids(load_expert_id(topk_idx, idx_is_64, t), num_experts, num_local_experts);
}

// Entry k of metadata row g (tagged words: its local expert id, then its weight's bits) in the
// slab copy at `meta` (recv_meta [W * M, K, 2] u64; META_WORDS u32 a row).
__device__ __forceinline__ u64* meta_entry(i64 meta, i64 g, int k) {
    return reinterpret_cast<u64*>(meta) + (g * META_WORDS) / 2 + 2 * k;
}

// Block-wide, block `meta_block` of meta_blocks, one warp per token: the metadata row of every token t < T
// into recv_meta[R][t] of every rank as tagged words (with write_rows; the one-rank kernel's layout
// reads the routing itself), send_mask and dest_rank, and the invalid expert ids; block 0 first
// writes T into every rank's count word. (One copy:) every warp first waits until ack[0][r] >= e - 1
// for every rank r (r has finished reading what this rank sent it at the previous epoch), its
// first token's inputs loading meanwhile; so every store of the block after its next barrier (the
// flags, the senders' rows) is safe.
__device__ __forceinline__ void send_metadata(const i64* s_peer, int rank, int world, int max_tokens_per_rank, u64 epoch,
                                              i64* status, i64 timeout_ns, i64 off_meta, int num_experts,
                                              int meta_block, int meta_blocks, const void* topk_idx, int idx_is_64,
                                              const float* topk_weights, int num_tokens, u8* send_mask,
                                              i32* dest_rank, bool wait_for_acks, bool write_rows) {
    const int lane = threadIdx.x & 31;
    const int warps = blockDim.x >> 5;
    const int num_local_experts = num_experts / world;
    i64 num_invalid = 0;
    i64 first_invalid = NO_OFFENDER;
    bool acked = !wait_for_acks;
    auto wait_acks = [&]() {
        warp_wait_flags(s_peer[rank], world, CH_TO_DEST, FLAG_ACK, epoch - 1, status, TIMEOUT_TO_DEST_ACK, timeout_ns);
        acked = true;
    };
    // The count words have a word per parity and are never acked: a peer read this one at e - 2.
    if (write_rows && meta_block == 0) send_count_every_rank(s_peer, rank, world, epoch, num_tokens);
    for (int t = meta_block * warps + (threadIdx.x >> 5); t < num_tokens; t += meta_blocks * warps) {
        const i64 expert = load_expert_id(topk_idx, idx_is_64, t);
        const u32 weight = lane < TOPK ? __float_as_uint(topk_weights[static_cast<i64>(t) * TOPK + lane]) : 0u;
        if (!acked) wait_acks();
        const TokenRoute route = route_expert_ids(expert, num_experts, num_local_experts);
        const u32 invalid = __ballot_sync(FULL_MASK, lane < TOPK && route.expert != -1 && route.dest < 0);
        if (invalid != 0u) {
            num_invalid += __popc(invalid);
            first_invalid = imin64(first_invalid, (static_cast<i64>(rank) << 32) | t);
        }
        for (int r = lane; r < world; r += 32) {
            send_mask[static_cast<i64>(t) * world + r] = static_cast<u8>((route.dest_set >> r) & 1ull);
        }
        if (lane < TOPK) {
            const i64 i = static_cast<i64>(t) * TOPK + lane;
            dest_rank[i] = route.dest;
            for (int r = 0; r < world && write_rows; ++r) {
                u64* entry = meta_entry(s_peer[r] + off_meta, static_cast<i64>(rank) * max_tokens_per_rank + t, lane);
                remote_st64x2(entry, tagged_word(static_cast<u32>(route.dest == r ? route.local : -1), epoch),
                              tagged_word(weight, epoch), r);
            }
        }
    }
    if (!acked) wait_acks();
    if (lane == 0 && num_invalid != 0) {
        status_add_offenders(status, STATUS_NUM_INVALID, STATUS_FIRST_INVALID_CALL, num_invalid, first_invalid, epoch);
    }
}

// Block-wide, blocks [0, num_senders), one warp per (token, row chunk): token rows of x [T, H] to
// the ranks of their experts (routed from topk_idx again: cheaper than waiting for send_mask). The
// warps move one unit per round; tokens [c * chunk_tokens, (c + 1) * chunk_tokens) form chunk c,
// and after the round that moved a chunk's last unit, the last sender block to get there
// release-stores chunk[c][R] = e into every rank's flags, so receivers expand while rows land.
__device__ __forceinline__ void send_token_rows(u64* state, const i64* s_peer, int rank, int world, int max_tokens_per_rank,
                                                u64 epoch, i64 off_recv_x, int num_experts, int num_senders,
                                                int chunk_tokens, const void* x, bool quantize, const void* topk_idx,
                                                int idx_is_64, int num_tokens) {
    typedef RowParts<SEND_VPL> Chunks;
    const int warps = blockDim.x >> 5;
    const int num_local_experts = num_experts / world;
    const i64 num_units = static_cast<i64>(num_tokens) * Chunks::kPerRow;
    const i64 per_round = static_cast<i64>(num_senders) * warps;
    const i64 rounds = (num_units + per_round - 1) / per_round;
    const int chunks = (num_tokens + chunk_tokens - 1) / chunk_tokens;
    int chunk = 0;
    for (i64 round = 0; round < rounds; ++round) {
        const i64 unit = round * per_round + static_cast<i64>(blockIdx.x) * warps + (threadIdx.x >> 5);
        if (unit < num_units) {
            const int t = static_cast<int>(unit / Chunks::kPerRow);
            const int part = static_cast<int>(unit - static_cast<i64>(t) * Chunks::kPerRow);
            const TokenRoute route = route_token(topk_idx, idx_is_64, t, num_experts, num_local_experts);
            send_token_unit(s_peer, rank, max_tokens_per_rank, off_recv_x, x, quantize, t, part, route.dest_set);
        }
        for (; chunk < chunks; ++chunk) {
            const i64 last_token = imin64(static_cast<i64>(chunk + 1) * chunk_tokens, num_tokens) - 1;
            if ((last_token + 1) * Chunks::kPerRow - 1 >= (round + 1) * per_round) break;  // ends in a later round
            if (last_block_done(state + STATE_CHUNK_DONE + chunk, num_senders)) {
                signal_every_rank(s_peer, rank, world, CH_TO_DEST, FLAG_CHUNK + chunk, epoch);
            }
        }
    }
}

// Rows only, along an existing routing: x [T, H] row t goes to recv_x[R][t] of every other rank r
// with send_mask[t, r] (blocks [0, num_senders)).
__device__ __forceinline__ void send_rows(const i64* s_peer, int rank, int world, int max_tokens_per_rank, i64 off_recv_x,
                                          int num_senders, const void* x, int num_tokens, const u8* send_mask) {
    typedef RowParts<SEND_VPL> Chunks;
    const int warps = blockDim.x >> 5;
    const i64 num_units = static_cast<i64>(num_tokens) * Chunks::kPerRow;
    for (i64 unit = static_cast<i64>(blockIdx.x) * warps + (threadIdx.x >> 5); unit < num_units;
         unit += static_cast<i64>(num_senders) * warps) {
        const int t = static_cast<int>(unit / Chunks::kPerRow);
        const int chunk = static_cast<int>(unit - static_cast<i64>(t) * Chunks::kPerRow);
        const u64 dests = warp_dest_set(send_mask + static_cast<i64>(t) * world, world);
        send_token_unit(s_peer, rank, max_tokens_per_rank, off_recv_x, x, false, t, chunk, dests);
    }
}

// ----------------------------------------------------------------------------- layout phase

// The slab row g = s * M + t of virtual row v (rows t < T_s of all sources concatenated): s is
// the largest source with begin[s] <= v.
__device__ __forceinline__ i64 slab_row_of(const i64* begin, int world, int max_tokens_per_rank, i64 v) {
    int lo = 0, hi = world - 1;
    while (lo < hi) {
        const int mid = (lo + hi + 1) >> 1;
        if (begin[mid] <= v) lo = mid;
        else hi = mid - 1;
    }
    return static_cast<i64>(lo) * max_tokens_per_rank + (v - begin[lo]);
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
        return tagged_count(base, world, p, epoch, max_tokens_per_rank, status, timeout_ns);
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

// ----------------------------------------------------------------------------- expand phase

// The slab rows an expansion covers: every slab (redispatch), this rank's own (its rows are in x
// before any peer's arrive), or every other rank's.
enum SlabRows { ALL_SLABS, OWN_SLAB };

__device__ __forceinline__ BatchShape slab_rows(SlabRows set, int rank, int world, int max_tokens_per_rank, int blocks) {
    const i64 m = max_tokens_per_rank;
    if (set == OWN_SLAB) return batch_shape(m, blocks, rank * m);
    return batch_shape(world * m, blocks);
}

// Warp-wide: store(row) for the out_x row of each kept entry, k increasing (lane k < TOPK holds
// entry k's position in `pos`; kept_entries; pos_at(k): entry k's position, for a kept k,
// warp-uniform). `lane` is the caller's lane.
template <typename PosAt, typename Store>
__device__ __forceinline__ void for_each_kept_row(int lane, int pos, PosAt pos_at, int capacity_rows, u8* out,
                                                  Store store) {
    for (u32 m = kept_entries(lane, pos, capacity_rows); m != 0u; m &= m - 1u) {
        store(out + static_cast<i64>(pos_at(__ffs(static_cast<int>(m)) - 1)) * ROW_BYTES);
    }
}

// Warp-wide: unit `chunk` of slab row g to the out_x rows of its kept entries (lane k < TOPK holds
// entry k's recv_pos in `pos`; kept: in [0, capacity_rows)). Rows t >= packed_own of this rank's
// own slab come from x [num_tokens, H] (they are never sent; with quantize_own DTYPE rows,
// quantized on the way); the own rows below packed_own (FP8 dispatch packed them into the own slab
// first) and the others from recv_x, where their sources wrote them before a flag this block
// acquired. A call whose waits timed out may carry own rows past num_tokens: they are skipped. The
// unit's loads are issued before `pos` is used, so a caller that has just loaded it from memory
// waits for both at once. pos_at(k): entry k's position, for a kept k (warp-uniform).
template <typename PosAt>
__device__ __forceinline__ void copy_row_unit(i64 g, int chunk, int pos, PosAt pos_at, const u8* recv, const u8* x,
                                              bool quantize_own, int packed_own, int num_tokens, int rank,
                                              int max_tokens_per_rank, int capacity_rows, u8* out) {
    typedef RowParts<EXPAND_VPL> Chunks;
    const int lane = threadIdx.x & 31;
    const i64 t = g - static_cast<i64>(rank) * max_tokens_per_rank;
    const bool from_x = t >= packed_own && t < max_tokens_per_rank;  // packed_own >= 0: g is in the own slab
    if (from_x && t >= num_tokens) return;
    const int v0 = chunk * Chunks::kVecs + lane;
    Vec16 vals[EXPAND_VPL];
#if FP8_ROWS
    if (from_x && quantize_own) {
        float scales[EXPAND_VPL];
        quantize_unit<EXPAND_VPL>(x + t * SOURCE_ROW_BYTES, vals, scales, v0);
        for_each_kept_row(lane, pos, pos_at, capacity_rows, out,
                          [&](u8* row) { store_fp8_unit<EXPAND_VPL>(row, vals, scales, v0); });
        return;
    }
#else
    (void)quantize_own;
#endif
    if (from_x) {
        load_unit<EXPAND_VPL, kUserInput>(x + t * ROW_BYTES, vals, v0);
    } else {
        load_unit<EXPAND_VPL, kWrittenHere>(recv + g * ROW_BYTES, vals, v0);
    }
    for_each_kept_row(lane, pos, pos_at, capacity_rows, out, [&](u8* row) { store_unit<EXPAND_VPL>(row, vals, v0); });
}

// Block-wide: copy_row_unit for every unit of the listed rows of `batch` (slab rows batch.row[...]).
__device__ __forceinline__ void copy_listed_rows(const RowBatch& batch, int listed, const u8* recv, const u8* x,
                                                 bool quantize_own, int packed_own, int num_tokens, int rank,
                                                 int max_tokens_per_rank, int capacity_rows, u8* out) {
    typedef RowParts<EXPAND_VPL> Chunks;
    const int lane = threadIdx.x & 31;
    const int warps = blockDim.x >> 5;
    for (int unit = threadIdx.x >> 5; unit < listed * Chunks::kPerRow; unit += warps) {
        const int r = batch.list[unit / Chunks::kPerRow];
        const int chunk = unit - (unit / Chunks::kPerRow) * Chunks::kPerRow;
        copy_row_unit(batch.row[r], chunk, lane < TOPK ? batch.pos[r * TOPK + lane] : -1,
                      [&](int k) { return batch.pos[r * TOPK + k]; }, recv, x, quantize_own, packed_own, num_tokens,
                      rank, max_tokens_per_rank, capacity_rows, out);
    }
}

// Warp-wide, the warps of blocks [first_block, first_block + blocks): this rank's own rows t <
// num_tokens unit by unit (warp w of them takes units w, w + blocks * warps, ...), each warp
// loading its row's K positions, row pos_row0 + t of `positions` [rows, K] (recv_pos [W * M, K]
// written by the layout before a barrier, plain loads; or the block's own copy of the layout in
// shared memory), alongside the unit. Decode sizes: no batch of positions, loaded by the block
// before any row, stands between the layout and the rows.
__device__ __forceinline__ void expand_own_units(int first_block, int blocks, const u8* recv, const u8* x,
                                                 bool quantize_own, int packed_own, int num_tokens, int rank,
                                                 int max_tokens_per_rank, const i32* positions, i64 pos_row0,
                                                 int capacity_rows, u8* out) {
    typedef RowParts<EXPAND_VPL> Chunks;
    const int lane = threadIdx.x & 31;
    const i64 warps = blockDim.x >> 5;
    const i64 units = static_cast<i64>(num_tokens) * Chunks::kPerRow;
    for (i64 unit = (blockIdx.x - first_block) * warps + (threadIdx.x >> 5); unit < units; unit += blocks * warps) {
        const i64 t = unit / Chunks::kPerRow;
        const int chunk = static_cast<int>(unit % Chunks::kPerRow);
        const int pos = lane < TOPK ? positions[(pos_row0 + t) * TOPK + lane] : -1;
        copy_row_unit(static_cast<i64>(rank) * max_tokens_per_rank + t, chunk, pos,
                      [&](int k) { return __shfl_sync(FULL_MASK, pos, k); }, recv, x, quantize_own, packed_own,
                      num_tokens, rank, max_tokens_per_rank, capacity_rows, out);
    }
}

// Block-wide, blocks [first_block, gridDim.x): expand every carried slab row of `shape`'s set
// (recv_pos [W * M, K] may have been written by other blocks of this kernel: plain loads).
__device__ __forceinline__ void expand_rows(RowBatch& batch, const BatchShape& shape, int first_block, const u8* recv,
                                            const u8* x, bool quantize_own, int packed_own, int num_tokens, int rank,
                                            int max_tokens_per_rank, const i32* recv_pos, int capacity_rows, u8* out) {
    for (i64 q = blockIdx.x - first_block; q < shape.count; q += gridDim.x - first_block) {
        const int listed = block_load_batch(batch, recv_pos, nullptr, shape, q, 0);
        copy_listed_rows(batch, listed, recv, x, quantize_own, packed_own, num_tokens, rank, max_tokens_per_rank,
                         capacity_rows, out);
        __syncthreads();  // the batch is overwritten next
    }
}

// The index of a batch drawn by ticket: batches [0, handed_out) went one per block of a group
// first, the rest go one atomic add on `tickets` (zero at the call's start) each. Thread 0 draws
// for its block (expand_arrivals, zero_padding).
__device__ __forceinline__ i64 ticket_batch(u64* tickets, int handed_out) {
    return handed_out + static_cast<i64>(atomicAdd(tickets, 1ull));
}

// Block-wide, after the layout is visible: expand the rows the other ranks send, chunk by chunk
// as they land. The rows t < T_s (s_tokens [W], load_slab_tokens) of every other slab s form
// pieces p = c * (W - 1) + i (chunk c of the i-th other rank), numbered in that order and cut
// into batches of consecutive rows, so the blocks sweep the chunks in the order the senders
// complete them; before a batch, thread j waits for the chunk flag of row j. The batches are sized
// so that each chunk's rows spread over `batch_blocks` blocks. The group, blocks [first_block,
// last_block), takes one batch per block first; the batches past those go by ticket (atomic adds
// on `tickets`, zero at the call's start), to the group's blocks and to every other block that
// calls this once its own work is done (senders whose rows are out, blocks of other roles), so
// blocks that come late take fewer.
__device__ __forceinline__ void expand_arrivals(RowBatch& batch, i64 base, const i32* s_tokens, int rank, int world,
                                                int max_tokens_per_rank, int chunk_tokens, u64 epoch, i64* status,
                                                i64 timeout_ns, int first_block, int last_block, int batch_blocks,
                                                u64* tickets, const u8* recv, const i32* recv_pos, int capacity_rows,
                                                u8* out) {
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

    // Batches small enough that every chunk's rows spread over batch_blocks blocks: the rows of
    // the last chunk to land are what is left to expand after the transfer.
    const int blocks = last_block - first_block;
    const i64 chunk_rows = imin64(total, static_cast<i64>(others) * chunk_tokens);
    const i64 per_block = (chunk_rows + batch_blocks - 1) / batch_blocks;
    const int rows = static_cast<int>(per_block < 1 ? 1 : (per_block > BATCH_ROWS ? BATCH_ROWS : per_block));
    // Piece p and slab row of virtual row v < total.
    auto locate = [&](i64 v, int& piece, int& source) -> i64 {
        int lo = 0, hi = pieces - 1;  // the last piece starting at or before v
        while (lo < hi) {
            const int mid = (lo + hi + 1) >> 1;
            if (s_piece[mid] <= v) lo = mid;
            else hi = mid - 1;
        }
        const int i = lo % others;
        piece = lo;
        source = i < rank ? i : i + 1;
        return static_cast<i64>(source) * max_tokens_per_rank + (lo / others) * static_cast<i64>(chunk_tokens) +
               (v - s_piece[lo]);
    };
    const i64 batches = (total + rows - 1) / rows;
    const bool ticketed = batches > blocks;
    const bool in_group = static_cast<int>(blockIdx.x) >= first_block && static_cast<int>(blockIdx.x) < last_block;
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
        copy_listed_rows(batch, listed, recv, nullptr, false, 0, 0, rank, max_tokens_per_rank, capacity_rows, out);
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

// segments() from this block's own layout (LayoutShared's totals and starts; s_end, s_kept and
// s_pad may overlay its per-warp counts, which are no longer needed).
__device__ __forceinline__ void layout_segments(i32* s_end, i32* s_kept, i32* s_pad, const LayoutShared& shared,
                                                int num_local_experts, int alignment, int capacity) {
    segments(s_end, s_kept, s_pad, num_local_experts, [&](int j, i32& kept, i32& end) {
        kept = min(shared.total[j], capacity);
        end = shared.start[j] + aligned_rows(kept, alignment);
    });
}

// Block-wide: zero the padding rows [start_j + n_j, end_j) of every segment (s_end, s_pad from
// segments()), in batches of up to PAD_BATCH_UNITS row units a warp. The zeros go evict-first:
// nothing reads them before the experts, and the rows that combine reads next then stay in L2
// (one H200, one rank, T=128: a graph of dispatch and combine 35.2-36.3 -> 31.5-31.7 us). The
// group, blocks [first_block, gridDim.x), takes one batch per block first; with `tickets` (zero at
// the call's start) the batches past those go by ticket, to the group and to every other block
// that calls this once its own work is done, so blocks that come late take fewer; without, each
// block of the group takes every group-th batch.
__device__ __forceinline__ void zero_padding(const i32* s_end, const i32* s_pad, int num_local_experts, int capacity_rows,
                                             int first_block, u64* tickets, u8* out) {
    typedef RowParts<EXPAND_VPL> Chunks;
    __shared__ i64 s_next;  // the block's next batch
    const int lane = threadIdx.x & 31;
    const int warps = blockDim.x >> 5;
    const i64 pad_units = static_cast<i64>(s_pad[num_local_experts - 1]) * Chunks::kPerRow;
    const int group = gridDim.x - first_block;
    // Fewer units a warp when they fill the group's blocks in one batch each (T=1: one unit a warp
    // on as many blocks as it takes; four a warp on 14 blocks cost ~1.6 us of per-SM store rate).
    const i64 spread = (pad_units + static_cast<i64>(group) * warps - 1) / (static_cast<i64>(group) * warps);
    const i64 per_batch = static_cast<i64>(warps) * imin64(spread > 1 ? spread : 1, PAD_BATCH_UNITS);
    const i64 batches = (pad_units + per_batch - 1) / per_batch;
    const bool in_group = static_cast<int>(blockIdx.x) >= first_block;
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
            const int p = static_cast<int>(unit / Chunks::kPerRow);
            const int chunk = static_cast<int>(unit - static_cast<i64>(p) * Chunks::kPerRow);
            int lo = 0, hi = num_local_experts - 1;  // the first expert j with s_pad[j] > p
            while (lo < hi) {
                const int mid = (lo + hi) >> 1;
                if (s_pad[mid] > p) hi = mid;
                else lo = mid + 1;
            }
            const int row = s_end[lo] - (s_pad[lo] - p);
            if (row < capacity_rows) {
                store_unit<EXPAND_VPL, kEvictFirst>(out + static_cast<i64>(row) * ROW_BYTES, zeros,
                                                    chunk * Chunks::kVecs + lane);
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

// The roles of the early group's blocks [early, grid) after its layout barrier. Past decode sizes
// every block copies own rows in batches, then zeroes padding, then takes arrival batches. At
// decode sizes the steps are chains of round trips more than bytes, so they run side by side on
// parts of the group: own rows on [early, own_end) (expand_own_units), the other ranks' rows on
// the arrival group [arrivals_first, arrivals_last), the padding from pad_first on. A part's
// blocks are sized by its unit copies at ROLE_COPIES_PER_WARP a warp (ceil(K / W) copies a row:
// uniform routing keeps K / W of a token's entries on each rank; the arrivals counted for M rows
// a source). Own rows split off when they fit half of the group, the arrivals too when both fit
// two thirds of it; blocks outside the arrival group still take ticketed batches past its one
// batch a block.
struct ExpandRoles {
    bool split;          // own rows on their own blocks
    int own_end;
    int pad_first;
    int arrivals_first;  // the arrival group
    int arrivals_last;
    int arrival_batch_blocks;  // the arrival batches are sized for this many blocks (expand_arrivals):
                               // at decode sizes the whole grid, the blocks of the other roles and the
                               // senders taking by ticket what the arrival group has not
};

__device__ __forceinline__ ExpandRoles expand_roles(int early, int grid, int world, int num_tokens, int max_tokens_per_rank) {
    const i64 warps = blockDim.x >> 5;
    const int group = grid - early;
    const i64 copies = (TOPK + world - 1) / world;
    auto blocks_for = [&](i64 rows) {
        const i64 unit_copies = rows * RowParts<EXPAND_VPL>::kPerRow * copies;
        const i64 copy_warps = (unit_copies + ROLE_COPIES_PER_WARP - 1) / ROLE_COPIES_PER_WARP;
        return static_cast<int>((copy_warps + warps - 1) / warps);
    };
    const int own = blocks_for(num_tokens);
    const int arrivals = blocks_for(static_cast<i64>(world - 1) * max_tokens_per_rank);
    ExpandRoles roles{2 * own <= group, early, early, early, grid, group};
    if (!roles.split) return roles;
    roles.arrival_batch_blocks = grid;
    roles.own_end = roles.pad_first = early + own;
    if (arrivals > 0 && 3 * (own + arrivals) <= 2 * group) {
        roles.arrivals_first = roles.own_end;
        roles.arrivals_last = roles.pad_first = roles.own_end + arrivals;
    }
    return roles;
}

// A replicated layout's own-row blocks (one rank, decode sizes), their rows out: whether they join
// the padding. They do when it may be more than one batch per padding block (zero_padding's
// tickets; its rows are at most the segments' end, from this block's own layout); at T=1 it is
// not, and they end without building the segments.
__device__ __forceinline__ bool own_blocks_join_padding(const LayoutShared& shared, int num_local_experts, int alignment,
                                                        int capacity, int pad_blocks) {
    const int last = num_local_experts - 1;
    const i64 rows = shared.start[last] + aligned_rows(min(shared.total[last], capacity), alignment);
    return rows * RowParts<EXPAND_VPL>::kPerRow > static_cast<i64>(pad_blocks) * (blockDim.x >> 5) * PAD_BATCH_UNITS;
}

// ---------------------------------------------------------------------------------- kernels

// This call's arrival batch tickets (expand_arrivals), state[STATE_CLAIM + (epoch & 1)]; block 0
// zeroes the other parity's word for the next call on the channel, whichever kernel it is. The
// previous call, which used that word, has ended (calls of one backend run in stream order), and
// this one's word was zeroed by the previous call's start.
__device__ __forceinline__ u64* next_call_tickets_zeroed(u64* state, u64 epoch) {
    if (blockIdx.x == 0 && threadIdx.x == 0) state[STATE_CLAIM + ((epoch + 1) & 1)] = 0;
    return state + STATE_CLAIM + (epoch & 1);
}

// The parameters of both dispatch kernels (below), and their names.
#define DISPATCH_PARAMS                                                                                            \
    const i64* __restrict__ peers, int rank, int world, int max_tokens_per_rank, u64* state, i64* status,         \
    i64 timeout_ns, i64 off_meta, i64 off_recv_x, i64 copy_stride, int num_experts, int chunk_tokens,             \
    int num_local_experts, int alignment, int capacity, i32* block_counts, u64* barrier_flags, int capacity_rows, \
    int num_senders, int layout_blocks, const void* __restrict__ x, int quantize,                                 \
    const void* __restrict__ topk_idx, int idx_is_64, const float* __restrict__ topk_weights, int num_tokens,     \
    u8* __restrict__ send_mask, i32* __restrict__ dest_rank, i32* recv_pos, float* recv_weight,                   \
    i32* expert_offsets, i32* tokens_per_expert, void* __restrict__ out_x
#define DISPATCH_ARGS                                                                                              \
    peers, rank, world, max_tokens_per_rank, state, status, timeout_ns, off_meta, off_recv_x, copy_stride,        \
    num_experts, chunk_tokens, num_local_experts, alignment, capacity, block_counts, barrier_flags, capacity_rows, \
    num_senders, layout_blocks, x, quantize, topk_idx, idx_is_64, topk_weights, num_tokens, send_mask, dest_rank, \
    recv_pos, recv_weight, expert_offsets, tokens_per_expert, out_x

// One block per SM (gridDim.x <= SMs: blocks wait for each other). Blocks [0, num_senders) send;
// the blocks after them (the early group; every block when all send), the last layout_blocks of
// them laying out, receive while the senders still send, and the senders then join the arrivals.
// kOneRank (world 1, no senders): the layout reads the routing itself, at decode sizes on every
// block for itself (LayoutScope), and nothing is sent or awaited. Dynamic shared memory:
// LayoutShared's. block_counts [layout_blocks, num_local_experts] int32 and barrier_flags [2 *
// gridDim.x + 1] u64 (zero at first: the layout blocks' stamps, the group's, then the segments')
// are this kernel's local scratch.
template <bool kOneRank>
__device__ __forceinline__ void dispatch_call(DISPATCH_PARAMS) {
    extern __shared__ i32 smem[];
    __shared__ i64 s_peer[MAX_WORLD];
    __shared__ RowBatch batch;
    const Call call = begin_call(s_peer, peers, world, state, CH_TO_DEST, true, SLOT_DISPATCH_EXPAND, copy_stride);
    const u64 epoch = call.epoch;
    u64* tickets = next_call_tickets_zeroed(state, epoch);
    off_meta += slab_copy(epoch, copy_stride);
    off_recv_x += slab_copy(epoch, copy_stride);
    const int grid = gridDim.x;
    const int block = blockIdx.x;
    const int early = num_senders < grid ? num_senders : 0;  // first block of the early group
    const int layout_first = grid - layout_blocks;
    u64* segments_stamp = barrier_flags + 2 * grid;
    u8* out = static_cast<u8*>(out_x);
    const u8* recv = reinterpret_cast<const u8*>(s_peer[rank] + off_recv_x);

    // Metadata on the senders (before their rows: at decode sizes rows sent alongside delay the
    // metadata, which the layout waits for), and on more blocks when they have a token per warp.
    // With one rank nothing waits for it (only send_mask, dest_rank and the status word), and it
    // goes on the last blocks: the first ones copy the own rows.
    const int warps = blockDim.x >> 5;
    const int meta_blocks = max(max(num_senders, 1), min(grid, (num_tokens + warps - 1) / warps));
    const int meta_first = kOneRank ? grid - meta_blocks : 0;
    if (block >= meta_first && block < meta_first + meta_blocks) {
        send_metadata(s_peer, rank, world, max_tokens_per_rank, epoch, status, timeout_ns, off_meta, num_experts,
                      block - meta_first, meta_blocks, topk_idx, idx_is_64, topk_weights, num_tokens, send_mask,
                      dest_rank, acks_needed(copy_stride), !kOneRank);
    }
    if (block < num_senders) {
        send_token_rows(state, s_peer, rank, world, max_tokens_per_rank, epoch, off_recv_x, num_experts, num_senders,
                        chunk_tokens, x, quantize != 0, topk_idx, idx_is_64, num_tokens);
    }

    // Every receiving block first learns T_s from the count words (load_slab_tokens), so a missing
    // peer shows as a dispatch timeout naming it on every block, not as blocks waiting for a layout.
    __shared__ i32 s_tokens[MAX_WORLD];
    __shared__ i64 s_begin[MAX_WORLD + 1];
    const EntrySource<kOneRank> entries{s_peer[rank] + off_meta, epoch, status, timeout_ns, topk_idx, idx_is_64,
                                        topk_weights, num_tokens};
    if (block >= early) {
        const LayoutShared shared = layout_shared(smem, num_local_experts);
        // With one rank, rows that fit one layout block are laid out by every block for itself:
        // no barrier (LayoutScope).
        const bool replicated = kOneRank && num_tokens <= LAYOUT_ROWS_PER_BLOCK;
        const ExpandRoles roles = expand_roles(early, grid, world, num_tokens, max_tokens_per_rank);
        // FP8: this rank's rows t < packed_own were packed into its own slab, where the own
        // expansion reads them; it quantizes the rest from x.
        int packed_own = 0;
#if FP8_ROWS
        // Own rows packed while the metadata travels and the layout runs, on the blocks that do not
        // lay out (all of the group when every one does); the barrier below orders them before the
        // own expansion (a replicated layout has none: it packs nothing). With puts the senders
        // stage rows in the same slab rows: the same bytes.
        if (quantize && !replicated) {
            packed_own = min(num_tokens, FP8_PACK_OWN_MAX_TOKENS);
            const int packers_end = layout_first > early ? layout_first : grid;
            if (block < packers_end) {
                const i64 warps_per_block = blockDim.x >> 5;
                u8* own_slab = reinterpret_cast<u8*>(s_peer[rank] + off_recv_x) +
                               static_cast<i64>(rank) * max_tokens_per_rank * ROW_BYTES;
                quantize_rows<FP8_UNIT_VPL>(static_cast<const u8*>(x), packed_own, own_slab,
                                            (block - early) * warps_per_block + (threadIdx.x >> 5),
                                            (packers_end - early) * warps_per_block);
            }
        }
#endif
        load_slab_tokens(s_tokens, s_begin, entries, s_peer[rank], world, max_tokens_per_rank);
        if (replicated || block >= layout_first) {
            // A replicated layout's padding blocks need only its segments: they skip the positions.
            const int b = block - layout_first;
            const bool copies_own = !roles.split || block < roles.own_end;
            const LayoutScope scope = replicated
                ? LayoutScope{0, 1, block - early, grid - early, block == grid - 1, copies_own}
                : LayoutScope{b, layout_blocks, b, layout_blocks, true, false};
            layout_entries(shared, entries, s_tokens, s_begin, rank, world, max_tokens_per_rank, epoch, status, timeout_ns,
                           num_local_experts, alignment, capacity, scope, recv_pos, recv_weight, expert_offsets,
                           tokens_per_expert, block_counts, barrier_flags, kOneRank ? nullptr : segments_stamp);
        }
        // The padding blocks of a split need only the segments, which the first layout block stamps
        // before its pass 2: they arrive at the group's barrier (what they packed is then ordered
        // before the own rows) and zero rows while pass 2 runs, waiting for the group only before
        // arrival batches, which need the positions.
        const bool pads_first = !kOneRank && roles.split && block >= roles.pad_first;
        if (pads_first) {
            arrive_blocks(barrier_flags + grid, block, epoch);
            wait_blocks(segments_stamp, 0, 1, epoch, status, rank, timeout_ns);
        } else if (!replicated) {
            blocks_barrier(barrier_flags + grid, block, early, grid, epoch, status, rank, timeout_ns);
        }
        const int own_last = roles.split ? roles.own_end : grid;
        if (replicated || roles.split) {
            if (block < own_last) {
                expand_own_units(early, own_last - early, recv, static_cast<const u8*>(x), quantize != 0, packed_own,
                                 num_tokens, rank, max_tokens_per_rank, replicated ? shared.positions : recv_pos,
                                 replicated ? 0 : static_cast<i64>(rank) * max_tokens_per_rank, capacity_rows, out);
            }
        } else {
            expand_rows(batch, slab_rows(OWN_SLAB, rank, world, max_tokens_per_rank, grid - early), early, recv,
                        static_cast<const u8*>(x), quantize != 0, packed_own, num_tokens, rank, max_tokens_per_rank,
                        recv_pos, capacity_rows, out);
        }
        // One rank: the own-row blocks of a split join the padding by ticket once their rows are out.
        if (block >= roles.pad_first ||
            (replicated && own_blocks_join_padding(shared, num_local_experts, alignment, capacity, grid - roles.pad_first))) {
            // In the batched path the segments come only after the own rows: their loads would delay
            // the first row copies.
            i32* s_end = smem;
            i32* s_kept = smem + num_local_experts;
            i32* s_pad = smem + 2 * num_local_experts;
            if (replicated) {
                layout_segments(s_end, s_kept, s_pad, shared, num_local_experts, alignment, capacity);
            } else {
                load_segments(s_end, s_kept, s_pad, expert_offsets, tokens_per_expert, num_local_experts);
            }
            zero_padding(s_end, s_pad, num_local_experts, capacity_rows, roles.pad_first, kOneRank ? tickets : nullptr,
                         out);
        }
        if (!kOneRank) {
            if (pads_first) wait_blocks(barrier_flags + grid, early, grid, epoch, status, rank, timeout_ns);
            expand_arrivals(batch, s_peer[rank], s_tokens, rank, world, max_tokens_per_rank, chunk_tokens, epoch,
                            status, timeout_ns, roles.arrivals_first, roles.arrivals_last,
                            roles.arrival_batch_blocks, tickets, recv, recv_pos, capacity_rows, out);
        }
    } else if (!kOneRank) {
        // A sender beside an early group, its rows out: it helps expand the rows that arrive, once
        // the group's layout is visible to it.
        load_slab_tokens(s_tokens, s_begin, entries, s_peer[rank], world, max_tokens_per_rank);
        wait_blocks(barrier_flags + grid, early, grid, epoch, status, rank, timeout_ns);
        const ExpandRoles roles = expand_roles(early, grid, world, num_tokens, max_tokens_per_rank);
        expand_arrivals(batch, s_peer[rank], s_tokens, rank, world, max_tokens_per_rank, chunk_tokens, epoch, status,
                        timeout_ns, roles.arrivals_first, roles.arrivals_last, roles.arrival_batch_blocks, tickets,
                        recv, recv_pos, capacity_rows, out);
    }
    end_call(call, state, SLOT_DISPATCH_EXPAND, s_peer, rank, world, CH_TO_DEST, copy_stride);
}

extern "C" __global__ void __launch_bounds__(DISPATCH_THREADS) dispatch(DISPATCH_PARAMS) {
    dispatch_call<false>(DISPATCH_ARGS);
}

extern "C" __global__ void __launch_bounds__(DISPATCH_THREADS) dispatch_one_rank(DISPATCH_PARAMS) {
    dispatch_call<true>(DISPATCH_ARGS);
}

// Rows only, along an existing routing (send_mask [T, W], recv_pos [W, M, K]): the same channel,
// waits and signals as dispatch; rows no kept entry maps to are left as they were.
extern "C" __global__ void __launch_bounds__(DISPATCH_THREADS) redispatch(
    const i64* __restrict__ peers, int rank, int world, int max_tokens_per_rank, u64* state, i64* status, i64 timeout_ns,
    i64 off_recv_x, i64 copy_stride, int capacity_rows, int num_senders, const void* __restrict__ x, int num_tokens,
    const u8* __restrict__ send_mask, const i32* __restrict__ recv_pos, void* __restrict__ out_x) {
    __shared__ i64 s_peer[MAX_WORLD];
    __shared__ RowBatch batch;
    const Call call = begin_call(s_peer, peers, world, state, CH_TO_DEST, true, SLOT_DISPATCH_EXPAND, copy_stride);
    const u64 epoch = call.epoch;
    next_call_tickets_zeroed(state, epoch);
    off_recv_x += slab_copy(epoch, copy_stride);

    if (blockIdx.x == 0 && world > 1) send_count_every_rank(s_peer, rank, world, epoch, num_tokens);
    if (static_cast<int>(blockIdx.x) < num_senders) {
        if (acks_needed(copy_stride)) {
            block_wait_flags(s_peer[rank], world, CH_TO_DEST, FLAG_ACK, epoch - 1, status, TIMEOUT_TO_DEST_ACK,
                             timeout_ns);
        }
        // At world 1 no row leaves the rank (the expansion reads them from x): only the signal.
        if (world > 1) {
            send_rows(s_peer, rank, world, max_tokens_per_rank, off_recv_x, num_senders, x, num_tokens, send_mask);
        }
        if (last_block_done(state + STATE_DONE + SLOT_REDISPATCH_SEND, num_senders)) {
            signal_every_rank(s_peer, rank, world, CH_TO_DEST, FLAG_ARRIVAL, epoch);
        }
    }
    block_wait_flags(s_peer[rank], world, CH_TO_DEST, FLAG_ARRIVAL, epoch, status, TIMEOUT_TO_DEST_ARRIVAL,
                     timeout_ns);
    expand_rows(batch, slab_rows(ALL_SLABS, rank, world, max_tokens_per_rank, gridDim.x), 0,
                reinterpret_cast<const u8*>(s_peer[rank] + off_recv_x), static_cast<const u8*>(x), false, 0, num_tokens, rank,
                max_tokens_per_rank, recv_pos, capacity_rows, static_cast<u8*>(out_x));
    end_call(call, state, SLOT_DISPATCH_EXPAND, s_peer, rank, world, CH_TO_DEST, copy_stride);
}
