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
//   send rows (senders, one warp per (token, row unit), one unit per warp per round): recv_x[R][t]
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
//   padding (zero_pad: Config.zero_padding; without it no block writes them: they keep what
//     they held): every segment's padding rows [start_j + n_j, end_j) are zeroed (rows at or past
//     expert_offsets[-1] are not touched), evict-first in L2 (nothing reads them before the
//     experts; the rows combine reads next stay). Where the group has blocks that do not lay out,
//     they zero it before the group's barrier, once the first layout block has stamped the
//     segments (they arrive at the barrier before it and wait for it after; past decode sizes the
//     layout blocks join by ticket once their layout is done, state[STATE_CLAIM + 2 * CLAIM_PADDING
//     + (e & 1)]); else the group zeroes it after the own rows.
//   own expansion (the same group after a barrier of it; at decode sizes with several ranks the
//     senders too): copies each of R's own rows (from x) to the out_x row of each of its kept
//     entries.
//   arrivals (the same group, and the senders once their rows are out): the same copy for the rows
//     the other ranks send, chunk by chunk as chunk_c[0][s] >= e says they have landed, so the
//     expansion trails the transfer. Past one batch per block of the arrival group, batches go by
//     ticket (state[STATE_CLAIM + 2 * CLAIM_ARRIVALS + (e & 1)], zeroed by the call before), so
//     late blocks take fewer.
//   Past decode sizes every block of the group copies own rows, then takes arrival batches; at
//   decode sizes (expand_roles) past the barrier every block, the senders too, copies its share
//   of the units of the own rows and of the arrived rows, one space of units over every warp of
//   the grid (expand_units; an arrived row's unit waits for its chunk flag).
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
// (the padding's words), to them and to the own-row blocks once their rows are out.
// FP8 dispatch runs a build with FP8_ROWS (common.cuh): slabs and out_x hold packed FP8 rows, and
// with `quantize` the send and own-expansion phases build them as they go, from config-dtype x or
// from the pre-quantized pair x (e4m3) and x_scales ("FP8 rows built on the way" below); without
// it x holds packed rows, copied like any rows.
// TOKEN_MAJOR builds (dispatch of the token-major layout, Config.receive_layout): every phase is the
// same, except that the expansion copies each slab row that has a kept entry once, to row s * M + t of
// out_x [W * M, ...] (for_each_target_row in expand.cuh), and no padding is zeroed (the host passes
// zero_pad 0): the comm kernel writes one row per (token, destination rank), and the caller's permute
// (permute.cu) expands it to the expert-major layout with every SM, along the same recv_pos.
// `redispatch` runs the same channel with rows only (no metadata) along an existing routing's
// send_mask: it writes its tagged count word as dispatch does (every call of a parity rewrites
// that word), its senders ((one copy:) after the acks of e - 1) release-store arrival[0][R] = e
// when done (at world 1 one block, which sends nothing, only signals), and every block then expands
// every slab with the routing's recv_pos (no layout, no padding).
//
// A wait that runs past timeout_ns records (phase, peer) into the status word and gives up, so
// every kernel terminates; the results of that call are then invalid (Dispatcher.check() says so).
//
// This file holds the protocol, the send phase and the kernels; the layout is layout.cuh's, the
// expansion (own rows, arrivals, padding, the decode roles) expand.cuh's.
//
// moe_comm-defines: {"DTYPE": "bf16", "HIDDEN": 1024, "TOPK": 4}
// moe_comm-defines: {"DTYPE": "bf16", "HIDDEN": 7168, "TOPK": 8}
// moe_comm-defines: {"DTYPE": "bf16", "HIDDEN": 7168, "TOPK": 8, "FP8_ROWS": 1, "FP8_INV_MAX_BITS": 991054117}
// moe_comm-defines: {"DTYPE": "bf16", "HIDDEN": 7168, "TOPK": 8, "TOKEN_MAJOR": 1}

#include "common.cuh"
#if FP8_ROWS
#include "fp8.cuh"
#endif
#include "expand.cuh"
#include "layout.cuh"

// ----------------------------------------------------------------- FP8 rows built on the way
#if FP8_ROWS
// FP8 dispatch of config-dtype x (`quantize`, no x_scales) builds the packed rows (FP8_ROW_BYTES)
// from x's DTYPE rows itself, so no pass over x runs before the kernel: the senders quantize each
// unit as they send it (fp8.cuh's quantize_unit). This rank's own rows: those of the first
// FP8_PACK_OWN_MAX_TOKENS tokens are packed into the own slab by the early group's blocks that do
// not lay out, while the metadata travels and the layout runs, and the own expansion copies them
// from there like any slab rows (their quantization off the expansion's path, their packed bytes
// still in L2); more would outlast the layout, so the own expansion quantizes each unit of the
// rest as it copies it (no round trip of those rows through memory). A pre-quantized pair (x_fp8
// and x_scales, `quantize` with x_scales set) takes the same paths, each unit read from the pair
// instead of quantized (fp8_source_unit), and packs no own rows first (they are as small as packed
// rows already). Packed rows given as such (fp8.cu's pack_pairs) are copied like any rows.

#if PUT_TRANSPORT
// Warp-wide: what unit `row_unit` of a quantized row stored into the staged row (store_fp8_unit) goes
// to `dst` on rank `pe`: its e4m3 vectors, its blocks' scales (and the zeros after the last).
template <int VPL>
__device__ __forceinline__ void put_fp8_unit(u8* dst, const u8* staged, int row_unit, int pe) {
    const int first = row_unit * 32 * VPL;
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

// Warp-wide: send_token_unit's FP8 path, for own row t (fp8_source_unit): the unit in two halves
// (a whole unit's DTYPE vectors at once would spill registers).
__device__ __forceinline__ void send_fp8_unit(const i64* s_peer, int rank, i64 row_offset, const OwnRows& own, int t,
                                              int row_unit, int v0, u64 others) {
    constexpr int kHalf = SEND_VPL / 2;
#if PUT_TRANSPORT
    u8* staged = reinterpret_cast<u8*>(s_peer[rank] + row_offset);
#else
    (void)rank;
    (void)row_unit;
#endif
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const int half_v0 = v0 + 32 * kHalf * half;
        Vec16 vals[kHalf];
        Vec16 quad;
        fp8_source_unit<kHalf>(own.x, own.scales, t, vals, quad, half_v0);
#if PUT_TRANSPORT
        store_fp8_unit<kHalf>(staged, vals, quad, half_v0);
#else
        for (u64 m = others; m != 0ull; m &= m - 1ull) {
            store_fp8_unit<kHalf>(reinterpret_cast<u8*>(s_peer[__ffsll(static_cast<i64>(m)) - 1] + row_offset), vals,
                                  quad, half_v0);
        }
#endif
    }
#if PUT_TRANSPORT
    for (u64 m = others; m != 0ull; m &= m - 1ull) {
        const int r = __ffsll(static_cast<i64>(m)) - 1;
        put_fp8_unit<SEND_VPL>(reinterpret_cast<u8*>(s_peer[r] + row_offset), staged, row_unit, r);
    }
#endif
}
#endif  // FP8_ROWS

// ------------------------------------------------------------------------------- send phase

// Warp-wide: unit `row_unit` of own row t (OwnRows: x's row, or with `quantize` in FP8_ROWS builds
// the packed row built on the way, send_fp8_unit) to slab row recv_x[rank][t] of every OTHER rank
// in `dests` (this rank's expand reads its own tokens from x). With puts the unit is first stored
// into this rank's own slab row, the copy NVSHMEM reads.
__device__ __forceinline__ void send_token_unit(const i64* s_peer, int rank, int max_tokens_per_rank, i64 off_recv_x,
                                                const OwnRows& own, int t, int row_unit, u64 dests) {
    typedef RowUnits<SEND_VPL> Units;
    const u64 others = dests & ~(1ull << rank);
    if (others == 0ull) return;
    const i64 row_offset = off_recv_x + (static_cast<i64>(rank) * max_tokens_per_rank + t) * ROW_BYTES;
    const int v0 = row_unit * Units::kVecs + (threadIdx.x & 31);
#if FP8_ROWS
    if (own.quantize) {
        send_fp8_unit(s_peer, rank, row_offset, own, t, row_unit, v0, others);
        return;
    }
#endif
    Vec16 vals[SEND_VPL];
    load_unit<SEND_VPL, kUserInput>(own.x + static_cast<i64>(t) * ROW_BYTES, vals, v0);
#if PUT_TRANSPORT
    const u8* staged = reinterpret_cast<const u8*>(s_peer[rank] + row_offset);
    store_unit<SEND_VPL>(const_cast<u8*>(staged), vals, v0);
    for (u64 m = others; m != 0ull; m &= m - 1ull) {
        const int r = __ffsll(static_cast<i64>(m)) - 1;
        put_unit<SEND_VPL>(reinterpret_cast<u8*>(s_peer[r] + row_offset), staged, row_unit, r);
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

// Block-wide, block `meta_block` of meta_blocks, one warp per token: the metadata row of every token t < T
// into recv_meta[R][t] of every rank as tagged words (with write_rows; the one-rank kernel's layout
// reads the routing itself), send_mask and dest_rank, and the invalid expert ids; block 0 first
// writes T and the call's tag into every rank's count word. (One copy:) every warp first waits until ack[0][r] >= e - 1
// for every rank r (r has finished reading what this rank sent it at the previous epoch), its
// first token's inputs loading meanwhile; so every store of the block after its next barrier (the
// flags, the senders' rows) is safe.
__device__ __forceinline__ void send_metadata(const i64* s_peer, int rank, int world, int max_tokens_per_rank, u64 epoch,
                                              i64* status, i64 timeout_ns, i64 off_meta, int num_experts,
                                              int meta_block, int meta_blocks, const void* topk_idx, int idx_is_64,
                                              const float* topk_weights, int num_tokens, u8* send_mask,
                                              i32* dest_rank, bool wait_for_acks, bool write_rows, int call_tag) {
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
    if (write_rows && meta_block == 0) send_count_every_rank(s_peer, rank, world, epoch, num_tokens, call_tag);
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

// Block-wide, blocks [0, num_senders), one warp per (token, row unit): token rows of x [T, H] to
// the ranks of their experts (routed from topk_idx again: cheaper than waiting for send_mask). The
// warps move one unit per round; tokens [c * chunk_tokens, (c + 1) * chunk_tokens) form chunk c,
// and after the round that moved a chunk's last unit, the last sender block to get there
// release-stores chunk[c][R] = e into every rank's flags, so receivers expand while rows land.
__device__ __forceinline__ void send_token_rows(u64* state, const i64* s_peer, int rank, int world, int max_tokens_per_rank,
                                                u64 epoch, i64 off_recv_x, int num_experts, int num_senders,
                                                int chunk_tokens, const OwnRows& own, const void* topk_idx,
                                                int idx_is_64) {
    typedef RowUnits<SEND_VPL> Units;
    const int warps = blockDim.x >> 5;
    const int num_local_experts = num_experts / world;
    const int num_tokens = own.num_tokens;
    const i64 num_units = static_cast<i64>(num_tokens) * Units::kPerRow;
    const i64 per_round = static_cast<i64>(num_senders) * warps;
    const i64 rounds = (num_units + per_round - 1) / per_round;
    const int chunks = (num_tokens + chunk_tokens - 1) / chunk_tokens;
    int chunk = 0;
    for (i64 round = 0; round < rounds; ++round) {
        const i64 unit = round * per_round + static_cast<i64>(blockIdx.x) * warps + (threadIdx.x >> 5);
        if (unit < num_units) {
            const int t = static_cast<int>(unit / Units::kPerRow);
            const int row_unit = static_cast<int>(unit - static_cast<i64>(t) * Units::kPerRow);
            const TokenRoute route = route_token(topk_idx, idx_is_64, t, num_experts, num_local_experts);
            send_token_unit(s_peer, rank, max_tokens_per_rank, off_recv_x, own, t, row_unit, route.dest_set);
        }
        for (; chunk < chunks; ++chunk) {
            const i64 last_token = imin64(static_cast<i64>(chunk + 1) * chunk_tokens, num_tokens) - 1;
            if ((last_token + 1) * Units::kPerRow - 1 >= (round + 1) * per_round) break;  // ends in a later round
            if (last_block_done(state + STATE_CHUNK_DONE + chunk, num_senders)) {
                signal_every_rank(s_peer, rank, world, CH_TO_DEST, FLAG_CHUNK + chunk, epoch);
            }
        }
    }
}

// Rows only, along an existing routing: x [T, H] row t goes to recv_x[R][t] of every other rank r
// with send_mask[t, r] (blocks [0, num_senders)).
__device__ __forceinline__ void send_rows(const i64* s_peer, int rank, int world, int max_tokens_per_rank, i64 off_recv_x,
                                          int num_senders, const OwnRows& own, const u8* send_mask) {
    typedef RowUnits<SEND_VPL> Units;
    const int warps = blockDim.x >> 5;
    const i64 num_units = static_cast<i64>(own.num_tokens) * Units::kPerRow;
    for (i64 unit = static_cast<i64>(blockIdx.x) * warps + (threadIdx.x >> 5); unit < num_units;
         unit += static_cast<i64>(num_senders) * warps) {
        const int t = static_cast<int>(unit / Units::kPerRow);
        const int row_unit = static_cast<int>(unit - static_cast<i64>(t) * Units::kPerRow);
        const u64 dests = warp_dest_set(send_mask + static_cast<i64>(t) * world, world);
        send_token_unit(s_peer, rank, max_tokens_per_rank, off_recv_x, own, t, row_unit, dests);
    }
}

// ---------------------------------------------------------------------------------- kernels

// This call's batch tickets of `claim` (CLAIM_ARRIVALS: expand_arrivals; CLAIM_PADDING:
// zero_padding), state[STATE_CLAIM + 2 * claim + (epoch & 1)], zeroed by the previous call's start
// (zero_next_call_tickets).
__device__ __forceinline__ u64* call_tickets(u64* state, u64 epoch, int claim) {
    return state + STATE_CLAIM + 2 * claim + (epoch & 1);
}

// Block 0 zeroes the other parity's ticket words for the next call on the channel, whichever kernel
// it is: the previous call, which used them, has ended (calls of one backend run in stream order).
__device__ __forceinline__ void zero_next_call_tickets(u64* state, u64 epoch) {
    if (blockIdx.x == 0 && threadIdx.x == 0) {
        *call_tickets(state, epoch + 1, CLAIM_ARRIVALS) = 0;
        *call_tickets(state, epoch + 1, CLAIM_PADDING) = 0;
    }
}

// The parameters of both dispatch kernels (below), and their names.
#define DISPATCH_PARAMS                                                                                            \
    const i64* __restrict__ peers, int rank, int world, int max_tokens_per_rank, u64* state, i64* status,          \
    i64 timeout_ns, i64 off_meta, i64 off_recv_x, i64 copy_stride, int num_experts, int chunk_tokens,              \
    int num_local_experts, int alignment, int zero_pad, int capacity, i32* block_counts, u64* barrier_flags,       \
    int capacity_rows, int num_senders, int layout_blocks, const void* __restrict__ x, int quantize,               \
    const float* __restrict__ x_scales, const void* __restrict__ topk_idx, int idx_is_64,                          \
    const float* __restrict__ topk_weights, int num_tokens, u8* __restrict__ send_mask,                            \
    i32* __restrict__ dest_rank, i32* recv_pos, float* recv_weight, i32* expert_offsets, i32* tokens_per_expert,   \
    void* __restrict__ out_x, int call_tag
#define DISPATCH_ARGS                                                                                              \
    peers, rank, world, max_tokens_per_rank, state, status, timeout_ns, off_meta, off_recv_x, copy_stride,         \
    num_experts, chunk_tokens, num_local_experts, alignment, zero_pad, capacity, block_counts, barrier_flags,      \
    capacity_rows, num_senders, layout_blocks, x, quantize, x_scales, topk_idx, idx_is_64, topk_weights,           \
    num_tokens, send_mask, dest_rank, recv_pos, recv_weight, expert_offsets, tokens_per_expert, out_x, call_tag

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
    const Call call = begin_call(s_peer, peers, rank, world, state, status,
                                 CH_TO_DEST, true, SLOT_DISPATCH_EXPAND, copy_stride);
    const u64 epoch = call.epoch;
    zero_next_call_tickets(state, epoch);
    off_meta += slab_copy(epoch, copy_stride);
    off_recv_x += slab_copy(epoch, copy_stride);
    const int grid = gridDim.x;
    const int block = blockIdx.x;
    const int early = num_senders < grid ? num_senders : 0;  // first block of the early group
    const int layout_first = grid - layout_blocks;
    u64* segments_stamp = barrier_flags + 2 * grid;
    u8* out = static_cast<u8*>(out_x);
    const u8* recv = reinterpret_cast<const u8*>(s_peer[rank] + off_recv_x);
    // With one rank, rows that fit one layout block are laid out by every block for itself: no
    // barrier (LayoutScope).
    const bool replicated = kOneRank && num_tokens <= LAYOUT_ROWS_PER_BLOCK;
    // FP8 from DTYPE rows: this rank's rows t < packed_own are packed into its own slab, where the
    // own expansion reads them; it quantizes the rest from x. A replicated layout has no barrier to
    // order packed rows before the own expansion: it packs none; nor does a pre-quantized pair.
#if FP8_ROWS
    const int packed_own =
        quantize && x_scales == nullptr && !replicated ? min(num_tokens, FP8_PACK_OWN_MAX_TOKENS) : 0;
#else
    const int packed_own = 0;
#endif
    const OwnRows own{static_cast<const u8*>(x), x_scales, quantize != 0, packed_own, num_tokens};

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
                      dest_rank, acks_needed(copy_stride), !kOneRank, call_tag);
    }
    if (block < num_senders) {
        send_token_rows(state, s_peer, rank, world, max_tokens_per_rank, epoch, off_recv_x, num_experts, num_senders,
                        chunk_tokens, own, topk_idx, idx_is_64);
    }

    // Every receiving block first learns T_s from the count words (load_slab_tokens), so a missing
    // peer shows as a dispatch timeout naming it on every block, not as blocks waiting for a layout.
    __shared__ i32 s_tokens[MAX_WORLD];
    __shared__ i64 s_begin[MAX_WORLD + 1];
    const EntrySource<kOneRank> entries{s_peer[rank] + off_meta, epoch, status, timeout_ns, topk_idx, idx_is_64,
                                        topk_weights, num_tokens, call_tag};
    const LayoutShared shared = layout_shared(smem, num_local_experts);
    const ExpandRoles roles = expand_roles(early, layout_first, grid, world, num_tokens, replicated, zero_pad != 0);
    if (block >= early) {
#if FP8_ROWS
        // Own rows packed while the metadata travels and the layout runs, on the blocks that do not
        // lay out (all of the group when every one does); the barrier below orders them before the
        // own expansion. With puts the senders stage rows in the same slab rows: the same bytes.
        if (packed_own > 0) {
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
                           tokens_per_expert, block_counts, barrier_flags, replicated ? nullptr : segments_stamp);
        }
    } else if (!kOneRank) {
        // A sender beside an early group, its rows out: it helps expand, once the group's layout is
        // visible to it.
        load_slab_tokens(s_tokens, s_begin, entries, s_peer[rank], world, max_tokens_per_rank);
    }
    // The segments are in shared memory (s_end, s_kept, s_pad: they overlay LayoutShared's per-warp
    // counts, no longer needed) when a block zeroes padding.
    i32* s_end = smem;
    i32* s_kept = smem + num_local_experts;
    i32* s_pad = smem + 2 * num_local_experts;
    // The padding needs only the segments, which the first layout block stamps before its pass 2.
    // Where blocks of the group do not lay out (roles.pads_first), they arrive at the group's barrier
    // (what they packed is then ordered before the own rows), zero the padding while the layout
    // ends, and then wait for the group, whose positions the row copies need. At decode sizes on
    // several ranks they zero all of it, a static share each; past them the layout blocks, their
    // layout done, join by ticket, so the padding fills the layout's window, where HBM is idle.
    const bool pads_first = roles.pads_first && block >= roles.pad_first && (!roles.split || block < roles.pad_last);
    if (pads_first) {
        arrive_blocks(barrier_flags + grid, block, epoch);
        wait_blocks(segments_stamp, 0, 1, epoch, status, rank, timeout_ns);
        load_segments(s_end, s_kept, s_pad, expert_offsets, tokens_per_expert, num_local_experts);
        zero_padding(s_end, s_pad, num_local_experts, capacity_rows, roles.pad_first, roles.pad_last,
                     roles.split ? nullptr : call_tickets(state, epoch, CLAIM_PADDING), out);
        wait_blocks(barrier_flags + grid, early, grid, epoch, status, rank, timeout_ns);
    } else if (block >= early && !replicated) {
        blocks_barrier(barrier_flags + grid, block, early, grid, epoch, status, rank, timeout_ns);
    } else if (block < early) {
        wait_blocks(barrier_flags + grid, early, grid, epoch, status, rank, timeout_ns);
    }

    // Own rows: unit by unit on the blocks of the roles' part (at decode sizes; with several ranks
    // the arrived rows' units with them), else in batches on the group.
    if (replicated || roles.split) {
        if (block >= roles.own_first && block < roles.own_end) {
            const ArrivalRows arrivals{s_peer[rank], chunk_tokens, epoch, status, timeout_ns};
            expand_units<!kOneRank>(roles.own_first, roles.own_end - roles.own_first, arrivals, s_begin, recv, own,
                                    rank, world, max_tokens_per_rank, replicated ? shared.positions : recv_pos,
                                    capacity_rows, out);
        }
    } else if (block >= early) {
        expand_rows(batch, slab_rows(OWN_SLAB, rank, world, max_tokens_per_rank, grid - early), early, recv, own,
                    rank, max_tokens_per_rank, recv_pos, capacity_rows, out);
    }
    // The padding after the own rows, unless it went first. One rank: the own-row blocks of a split
    // join it by ticket once their rows are out.
    const bool pads_after = zero_pad && !roles.pads_first &&
                            ((block >= roles.pad_first && block < roles.pad_last) ||
                             (replicated && own_blocks_join_padding(shared, num_local_experts, alignment, capacity,
                                                                    grid - roles.pad_first)));
    if (pads_after) {
        // In the batched path the segments come only after the own rows: their loads would delay the
        // first row copies.
        if (replicated) {
            layout_segments(s_end, s_kept, s_pad, shared, num_local_experts, alignment, capacity);
        } else {
            load_segments(s_end, s_kept, s_pad, expert_offsets, tokens_per_expert, num_local_experts);
        }
        zero_padding(s_end, s_pad, num_local_experts, capacity_rows, roles.pad_first, roles.pad_last,
                     kOneRank ? call_tickets(state, epoch, CLAIM_PADDING) : nullptr, out);
    }
    // The other ranks' rows, unless the own rows' units took them (decode sizes).
    if (!kOneRank && !roles.split) {
        expand_arrivals(batch, s_peer[rank], s_tokens, rank, world, max_tokens_per_rank, chunk_tokens, epoch, status,
                        timeout_ns, early, call_tickets(state, epoch, CLAIM_ARRIVALS), recv, recv_pos, capacity_rows,
                        out);
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
    const Call call = begin_call(s_peer, peers, rank, world, state, status,
                                 CH_TO_DEST, true, SLOT_DISPATCH_EXPAND, copy_stride);
    const u64 epoch = call.epoch;
    zero_next_call_tickets(state, epoch);
    off_recv_x += slab_copy(epoch, copy_stride);
    const OwnRows own{static_cast<const u8*>(x), nullptr, false, 0, num_tokens};

    // No receiver of a redispatch reads its count (it follows the routing): tag 0.
    if (blockIdx.x == 0 && world > 1) send_count_every_rank(s_peer, rank, world, epoch, num_tokens, 0);
    if (static_cast<int>(blockIdx.x) < num_senders) {
        if (acks_needed(copy_stride)) {
            block_wait_flags(s_peer[rank], world, CH_TO_DEST, FLAG_ACK, epoch - 1, status, TIMEOUT_TO_DEST_ACK,
                             timeout_ns);
        }
        // At world 1 no row leaves the rank (the expansion reads them from x): only the signal.
        if (world > 1) {
            send_rows(s_peer, rank, world, max_tokens_per_rank, off_recv_x, num_senders, own, send_mask);
        }
        if (last_block_done(state + STATE_DONE + SLOT_REDISPATCH_SEND, num_senders)) {
            signal_every_rank(s_peer, rank, world, CH_TO_DEST, FLAG_ARRIVAL, epoch);
        }
    }
    block_wait_flags(s_peer[rank], world, CH_TO_DEST, FLAG_ARRIVAL, epoch, status, TIMEOUT_TO_DEST_ARRIVAL,
                     timeout_ns);
    expand_rows(batch, slab_rows(ALL_SLABS, rank, world, max_tokens_per_rank, gridDim.x), 0,
                reinterpret_cast<const u8*>(s_peer[rank] + off_recv_x), own, rank, max_tokens_per_rank, recv_pos,
                capacity_rows, static_cast<u8*>(out_x));
    end_call(call, state, SLOT_DISPATCH_EXPAND, s_peer, rank, world, CH_TO_DEST, copy_stride);
}
