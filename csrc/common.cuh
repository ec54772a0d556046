// common.cuh: device helpers shared by moe_comm's kernels (dispatch.cu, combine.cu, fp8.cu).
//
// NVRTC has no standard headers: this file includes only protocol.cuh and transport.cuh (which
// includes NVSHMEM's device headers for the put transport) and defines its own fixed-width types, 16-byte row
// vectors, dtype conversions (inline PTX), system-scope flags, the bounded spin-wait that reports
// timeouts into the device status word, the "last block done" pattern, and the remote writes of
// both transports (the only code that differs between them).
//
// Compile-time defines (set by moe_comm/cuda/kernels.py; they fix the row shape):
//   DTYPE   bf16 | f16 | f32   element type of token rows
//   HIDDEN  elements per row   (HIDDEN * element size is a multiple of 16 bytes)
//   TOPK    columns of topk_idx (1..32)
//   PUT_TRANSPORT  0 (default): peer loads/stores; 1: NVSHMEM puts (see transport.cuh)
//   FP8_ROWS  0 (default): slab and output rows are DTYPE rows; 1 (FP8 dispatch's build of dispatch.cu):
//             they are packed FP8 rows of HIDDEN channels (FP8_ROW_BYTES below; the quantization
//             is fp8.cuh's), and DTYPE rows are what dispatch quantizes from
//   TOKEN_MAJOR  0 (default): dispatch expands rows expert-major and combine sums the experts' rows;
//             1 (Config.receive_layout token_major): dispatch writes one row per slab row and combine
//             sends rows already reduced per slab row (dispatch.cu, combine.cu, permute.cu)
//
// Values shared with Python (status word fields, channels, flag kinds, timeout phases, state
// words and slots, limits, block shapes, META_WORDS) come from protocol.cuh, which
// moe_comm/cuda/jit.py generates from moe_comm/protocol.py; none is written out here. How they are used:
//   * status word  int64 [STATUS_FIELDS], fields STATUS_*; status_* below write it.
//   * flags        u64 at offset 0 of every rank's symmetric allocation:
//                  flags[channel][kind][peer] (flag_at), channel CH_TO_DEST (dispatch, redispatch)
//                  or CH_TO_SOURCE (combine, return_entry_values); kind FLAG_ARRIVAL (written by
//                  sender `peer`), FLAG_COUNT + (epoch & 1) (T of sender `peer`, count_flag, a
//                  tagged word), FLAG_ACK (written by receiver `peer` once it finished reading what
//                  this rank sent it; one slab copy only), FLAG_CHUNK + c (chunk c of dispatch's
//                  rows, c < MAX_CHUNKS).
//   * tagged words u64 words that carry the call's epoch tag in their high half (epoch_tag): the
//                  count words and dispatch's metadata entries. A reader takes one only once it
//                  carries its own call's tag, so no flag stands behind them (see "tagged words" below).
//   * slab copies  the receive slabs (meta, ret_vals, recv_x, ret_x) exist once or twice
//                  (Config.slab_copies), copy_stride bytes apart (0: once); epoch e uses copy e & 1
//                  (slab_copy). With two copies a sender writing at epoch e overwrites only what its
//                  peer read at e - 2, and the peer finished that call before it signalled or wrote
//                  a tagged count word of e - 1, which this rank waited for before its call at e - 1
//                  ended: so no ack is sent or awaited (acks_needed). With one copy every sender
//                  first waits for the peer's ack of e - 1.
//   * state        u64 [STATE_WORDS], local (not symmetric): [STATE_EPOCH + channel] epoch of the
//                  last completed operation on that channel; [STATE_DONE + slot] done-counters of
//                  the last-block pattern (SLOT_*); [STATE_CHUNK_DONE + c] those of dispatch's chunks;
//                  [STATE_CLAIM + 2 * claim + (epoch & 1)] dispatch's batch tickets of its arrivals
//                  (CLAIM_ARRIVALS, expand_arrivals) and of its padding (CLAIM_PADDING, zero_padding).
//   * timeout phases: TIMEOUT_*, recorded by spin_until (wait_flag_geq, wait_tagged).
#pragma once

#ifndef TOKEN_MAJOR
#define TOKEN_MAJOR 0
#endif

#include "protocol.cuh"
#include "transport.cuh"

typedef unsigned char u8;
typedef unsigned short u16;
typedef int i32;
typedef unsigned int u32;
typedef long long i64;
typedef unsigned long long u64;

#define FULL_MASK 0xffffffffu

// ---------------------------------------------------------------------------------------- shape

#define MOE_DTYPE_bf16 1
#define MOE_DTYPE_f16 2
#define MOE_DTYPE_f32 3
#define MOE_CAT_(a, b) a##b
#define MOE_CAT(a, b) MOE_CAT_(a, b)

#if !defined(DTYPE) || !defined(HIDDEN) || !defined(TOPK)
#error "compile with -DDTYPE=bf16|f16|f32 -DHIDDEN=<elements per row> -DTOPK=<columns of topk_idx>"
#endif

#define MOE_DTYPE MOE_CAT(MOE_DTYPE_, DTYPE)
#if MOE_DTYPE == MOE_DTYPE_f32
#define ELEM_BYTES 4
#elif MOE_DTYPE == MOE_DTYPE_bf16 || MOE_DTYPE == MOE_DTYPE_f16
#define ELEM_BYTES 2
#else
#error "DTYPE must be bf16, f16 or f32"
#endif

// A packed FP8 row (moe_comm.fp8.pack): HIDDEN e4m3 bytes, one float32 scale per FP8_BLOCK
// channels, zeros up to a multiple of 64 bytes (moe_comm.fp8.packed_row_bytes says why).
#define FP8_BLOCK 128
#define FP8_SCALE_BYTES (4 * (HIDDEN / FP8_BLOCK))
#define FP8_ROW_BYTES ((HIDDEN + FP8_SCALE_BYTES + 63) / 64 * 64)

#define SOURCE_ROW_BYTES (HIDDEN * ELEM_BYTES)  // a DTYPE row
#if FP8_ROWS
#define ROW_BYTES FP8_ROW_BYTES              // the rows slabs and outputs hold
#else
#define ROW_BYTES SOURCE_ROW_BYTES
#endif
#define ROW_VECS (ROW_BYTES / 16)         // 16-byte vectors per row
#define ELEMS_PER_VEC (16 / ELEM_BYTES)   // elements per 16-byte vector

static_assert(ROW_BYTES % 16 == 0, "rows must be a multiple of 16 bytes");
static_assert(TOPK >= 1 && TOPK <= MAX_TOPK, "TOPK must be in [1, MAX_TOPK] (one lane per column)");

// ------------------------------------------------------------------------------ small helpers

__device__ __forceinline__ u32 lanemask_lt() {
    u32 mask;
    asm("mov.u32 %0, %%lanemask_lt;" : "=r"(mask));
    return mask;
}

// Warp-wide (every lane calls it): the inclusive prefix sum of `value` over lanes 0 .. lane.
__device__ __forceinline__ int warp_inclusive_sum(int value) {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int offset = 1; offset < 32; offset <<= 1) {
        const int n = __shfl_up_sync(FULL_MASK, value, offset);
        if (lane >= offset) value += n;
    }
    return value;
}

// Block-wide (every thread calls it; blockDim.x a multiple of 32, at most 1024): the inclusive
// prefix sums of value(j) over j = 0 .. n - 1, thread j % blockDim.x taking j. emit(j, value,
// inclusive) is called once per j; what it stores in shared memory is visible to every thread on
// return. Returns the sum of all n values. All warps scan at once: a chain of one warp over n
// values costs a dependent shuffle round per 32 of them, microseconds on the layout's path.
template <typename Value, typename Emit>
__device__ __forceinline__ int block_inclusive_scan(int n, Value value, Emit emit) {
    __shared__ int s_warp_sums[32];
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int warps = blockDim.x >> 5;
    int carry = 0;  // the values of the earlier rounds
    for (int j0 = 0; j0 < n; j0 += blockDim.x) {
        const int j = j0 + threadIdx.x;
        const int v = j < n ? value(j) : 0;
        const int in_warp = warp_inclusive_sum(v);
        if (lane == 31) s_warp_sums[warp] = in_warp;
        __syncthreads();
        const int warp_sums = warp_inclusive_sum(lane < warps ? s_warp_sums[lane] : 0);
        const int before = warp == 0 ? 0 : __shfl_sync(FULL_MASK, warp_sums, warp - 1);
        if (j < n) emit(j, v, carry + before + in_warp);
        carry += __shfl_sync(FULL_MASK, warp_sums, 31);
        __syncthreads();  // s_warp_sums is rewritten next round; emitted values are visible
    }
    return carry;
}

__device__ __forceinline__ u64 globaltimer_ns() {
    u64 t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

__device__ __forceinline__ void sleep_ns(u32 ns) { asm volatile("nanosleep.u32 %0;" ::"r"(ns)); }

__device__ __forceinline__ i64 imin64(i64 a, i64 b) { return a < b ? a : b; }

// How many of a[0 .. n) (non-decreasing) are <= v: the binary search behind every "which piece
// holds virtual row v" of the layout and the expansion (with exclusive starts a[1 ..], the piece's
// index).
template <typename T>
__device__ __forceinline__ int count_at_most(const T* a, int n, i64 v) {
    int lo = 0, hi = n;
    while (lo < hi) {
        const int mid = (lo + hi) >> 1;
        if (a[mid] <= v) lo = mid + 1;
        else hi = mid;
    }
    return lo;
}

// Smallest value over the warp (all lanes must call it).
__device__ __forceinline__ i64 warp_min_i64(i64 v) {
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) v = imin64(v, __shfl_xor_sync(FULL_MASK, v, offset));
    return v;
}

// ---------------------------------------------------------------------------- 16-byte vectors

struct alignas(16) Vec16 {
    u32 w[4];
};

// Read-only input of the whole kernel (user tensors x, y): non-coherent path.
__device__ __forceinline__ Vec16 ld16_nc(const void* p) {
    Vec16 v;
    asm("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];"
        : "=r"(v.w[0]), "=r"(v.w[1]), "=r"(v.w[2]), "=r"(v.w[3])
        : "l"(p));
    return v;
}

// Memory another rank wrote (after the acquire that synchronised with it): an ordinary load,
// which the "memory" clobber of the acquire keeps below the wait.
__device__ __forceinline__ Vec16 ld16(const void* p) { return *reinterpret_cast<const Vec16*>(p); }

// A store to local or peer memory (over NVLink when the address maps a peer's allocation).
__device__ __forceinline__ void st16(void* p, const Vec16& v) { *reinterpret_cast<Vec16*>(p) = v; }

// A store of bytes that nothing in this step reads back soon (dispatch's zero padding): evict-first
// in L2 (st.global.cs), so they leave before the rows the next kernel reads.
__device__ __forceinline__ void st16_evict_first(void* p, const Vec16& v) {
    asm volatile("st.global.cs.v4.u32 [%0], {%1, %2, %3, %4};"
                 :: "l"(p), "r"(v.w[0]), "r"(v.w[1]), "r"(v.w[2]), "r"(v.w[3]) : "memory");
}

__device__ __forceinline__ Vec16 zero16() {
    Vec16 v;
    v.w[0] = v.w[1] = v.w[2] = v.w[3] = 0u;
    return v;
}

// ----------------------------------------------------------------------------- conversions
// Round-to-nearest-even, like torch's .to(dtype).

__device__ __forceinline__ float bf16_to_f32(u32 bits16) { return __uint_as_float(bits16 << 16); }

__device__ __forceinline__ float f16_to_f32(u32 bits16) {
    u16 h = static_cast<u16>(bits16);
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

// Two floats to one 32-bit word of two 16-bit values: `lo` in bits 0..15, `hi` in bits 16..31.
__device__ __forceinline__ u32 pack_bf16x2(float lo, float hi) {
    u32 r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

__device__ __forceinline__ u32 pack_f16x2(float lo, float hi) {
    u32 r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

// The ELEMS_PER_VEC values of a row vector as float32.
__device__ __forceinline__ void unpack16(const Vec16& v, float (&f)[ELEMS_PER_VEC]) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
#if MOE_DTYPE == MOE_DTYPE_f32
        f[i] = __uint_as_float(v.w[i]);
#elif MOE_DTYPE == MOE_DTYPE_bf16
        f[2 * i] = bf16_to_f32(v.w[i] & 0xffffu);
        f[2 * i + 1] = bf16_to_f32(v.w[i] >> 16);
#else
        f[2 * i] = f16_to_f32(v.w[i] & 0xffffu);
        f[2 * i + 1] = f16_to_f32(v.w[i] >> 16);
#endif
    }
}

// float32 values rounded (RNE) to the row dtype, packed into a 16-byte vector.
__device__ __forceinline__ Vec16 pack16(const float (&f)[ELEMS_PER_VEC]) {
    Vec16 v;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
#if MOE_DTYPE == MOE_DTYPE_f32
        v.w[i] = __float_as_uint(f[i]);
#elif MOE_DTYPE == MOE_DTYPE_bf16
        v.w[i] = pack_bf16x2(f[2 * i], f[2 * i + 1]);
#else
        v.w[i] = pack_f16x2(f[2 * i], f[2 * i + 1]);
#endif
    }
    return v;
}

// ------------------------------------------------------------------- system-scope flag access

__device__ __forceinline__ u64 ld_acquire_sys(const u64* p) {
    u64 v;
    asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ u64 ld_relaxed_sys(const u64* p) {
    u64 v;
    asm volatile("ld.relaxed.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ void st_release_sys(u64* p, u64 v) {
    asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ void st_release_gpu(u64* p, u64 v) {
    asm volatile("st.release.gpu.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ int ld_relaxed_gpu_i32(const i32* p) {
    int v;
    asm volatile("ld.relaxed.gpu.global.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ void st_relaxed_sys(u64* p, u64 v) {
    asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ u64 atom_add_release_gpu(u64* p, u64 v) {
    u64 old;
    asm volatile("atom.release.gpu.global.add.u64 %0, [%1], %2;" : "=l"(old) : "l"(p), "l"(v) : "memory");
    return old;
}

__device__ __forceinline__ void fence_acq_rel_gpu() { asm volatile("fence.acq_rel.gpu;" ::: "memory"); }

__device__ __forceinline__ u64 atom_add_acq_rel_sys(u64* p, u64 v) {
    u64 old;
    asm volatile("atom.acq_rel.sys.global.add.u64 %0, [%1], %2;" : "=l"(old) : "l"(p), "l"(v) : "memory");
    return old;
}

// Address of flags[channel][kind][peer] in the symmetric allocation that starts at `base`.
__device__ __forceinline__ u64* flag_at(i64 base, int world, int channel, int kind, int peer) {
    return reinterpret_cast<u64*>(base) + (channel * FLAG_KINDS + kind) * world + peer;
}

// Flags[channel][FLAG_COUNT + (epoch & 1)][peer]: a sender's T at `epoch`, one word per parity, so
// a sender one call ahead never overwrites the count its peer may still read.
__device__ __forceinline__ u64* count_flag(i64 base, int world, int channel, int peer, u64 epoch) {
    return flag_at(base, world, channel, FLAG_COUNT + static_cast<int>(epoch & 1ull), peer);
}

// Bytes from copy 0 of a receive slab to the copy `epoch` uses (see "slab copies" above).
__device__ __forceinline__ i64 slab_copy(u64 epoch, i64 copy_stride) {
    return static_cast<i64>(epoch & 1ull) * copy_stride;
}

// With one slab copy a sender must wait for the peer's ack of the previous epoch; with two the
// parity makes the wait unnecessary.
__device__ __forceinline__ bool acks_needed(i64 copy_stride) { return copy_stride == 0; }

// ------------------------------------------------------------------------------ status word

// First timeout wins: the phase is claimed with a CAS, then the peer is written.
__device__ __forceinline__ void status_record_timeout(i64* status, int phase, int peer) {
    u64* slot = reinterpret_cast<u64*>(status + STATUS_TIMEOUT_PHASE);
    if (atomicCAS(slot, 0ull, static_cast<u64>(phase)) == 0ull) {
        atomicExch(reinterpret_cast<u64*>(status + STATUS_TIMEOUT_PEER), static_cast<u64>(peer));
    }
}

// ------------------------------------------------------------------------------ the abort word
// A failure is the whole group's (moe_comm/protocol.py, ABORT_RAISED): the first wait of a rank that
// runs past timeout_ns raises the abort word (one u64 right after the flags) in every rank's
// allocation and its own; every kernel reads its own word as it begins (begin_call) and every wait
// while it spins, gives up at once when it is raised, and records it in the status word. So after
// a timeout on any rank no call of any rank waits out another timeout or takes a peer's data of
// another call for its own (their epochs no longer agree) without its status saying so; only a
// collective reset (DeviceBackend.reset: every rank idle, then the whole allocation, state and
// scratch zeroed between two barriers) lowers the word.

__device__ __forceinline__ u64* abort_word(i64 base, int world) {
    return reinterpret_cast<u64*>(base) + static_cast<i64>(CHANNELS) * FLAG_KINDS * world;
}

// What a wait needs to raise or find the abort word, set by begin_call for the whole block.
struct FaultScope {
    const i64* peers;  // the block's s_peer [world]
    u64* own_abort;    // this rank's abort word
    i64* status;       // this rank's status word
    int rank;
    int world;
    int aborted;       // the word was raised when the call began
};
__shared__ FaultScope s_fault;

// The first abort word a call of this rank found raised goes into status[STATUS_ABORT].
__device__ __forceinline__ void status_record_abort(i64* status, u64 word) {
    atomicCAS(reinterpret_cast<u64*>(status + STATUS_ABORT), 0ull, word);
}

// Whether this rank's abort word is raised now; records it if so (an acquire: see end_call).
__device__ __forceinline__ bool abort_seen(i64* status) {
    const u64 word = ld_acquire_sys(s_fault.own_abort);
    if (word != 0ull) status_record_abort(status, word);
    return word != 0ull;
}

__device__ __forceinline__ void remote_st64(u64* dst, u64 value, int pe);  // "remote writes" below

// One thread: this rank failed waiting for `peer` (rank; the own rank: its blocks) in `phase`.
// Whole word stores, any order: every raised word is some failing rank's, which is all a reader uses.
__device__ __forceinline__ void raise_abort(i64* status, int phase, int peer) {
    const u64 word = ABORT_RAISED | (static_cast<u64>(phase) << 32) |
                     (static_cast<u64>(peer == s_fault.rank ? ABORT_NO_PEER : peer) << 16) |
                     static_cast<u64>(s_fault.rank);
    for (int r = 0; r < s_fault.world; ++r) remote_st64(abort_word(s_fault.peers[r], s_fault.world), word, r);
    status_record_abort(status, word);
}

// Add `count` offenders of call `epoch` to status[count_field]; lower status[call_field] to `epoch`
// and, unless an earlier call offended already, status[count_field + 1] to `first_key`. Calls are
// stream-ordered, so an earlier call's atomics have all landed before a later call's begin.
__device__ __forceinline__ void status_add_offenders(i64* status, int count_field, int call_field, i64 count,
                                                     i64 first_key, u64 epoch) {
    atomicAdd(reinterpret_cast<u64*>(status + count_field), static_cast<u64>(count));
    const i64 call = static_cast<i64>(epoch);
    if (atomicMin(status + call_field, call) >= call) atomicMin(status + count_field + 1, first_key);
}

// Spin until ready() (a load and a test), at most timeout_ns. On timeout record (phase, peer) in
// the status word, raise the group's abort word and return false; once the abort word is raised
// (by this rank or a peer: the protocol is broken until a collective reset) give up at once so
// every kernel of every rank ends, unless `patient`: waits for blocks of the same kernel, which
// always arrive (every wait they make is bounded), keep ordering the kernel's own phases, so a
// broken call never reads unwritten data.
template <typename Ready>
__device__ __forceinline__ bool spin_until(Ready ready, i64* status, int phase, int peer, i64 timeout_ns, bool patient) {
    if (ready()) return true;
    if (!patient && (s_fault.aborted || abort_seen(status))) return false;
    const u64 start = globaltimer_ns();
    for (;;) {
        sleep_ns(32);
        if (ready()) return true;
        if (!patient && abort_seen(status)) return false;
        if (static_cast<i64>(globaltimer_ns() - start) > timeout_ns) {
            status_record_timeout(status, phase, peer);
            raise_abort(status, phase, peer);
            return false;
        }
    }
}

// Spin until *flag >= target (acquire, system scope), as spin_until.
__device__ __noinline__ bool wait_flag_geq(const u64* flag, u64 target, i64* status, int phase, int peer,
                                           i64 timeout_ns, bool patient = false) {
    return spin_until([&]() { return ld_acquire_sys(flag) >= target; }, status, phase, peer, timeout_ns, patient);
}

// Threads [0, world) of the block each wait for flags[channel][kind][p] >= target in this rank's
// allocation at `base`, then the whole block synchronises. Ordinary loads after this call see
// everything the peers wrote before their release of the flag.
__device__ __forceinline__ void block_wait_flags(i64 base, int world, int channel, int kind, u64 target,
                                                 i64* status, int phase, i64 timeout_ns) {
    for (int p = threadIdx.x; p < world; p += blockDim.x) {
        wait_flag_geq(flag_at(base, world, channel, kind, p), target, status, phase, p, timeout_ns);
    }
    __syncthreads();
}

// Warp-wide: lanes p < world (and p + 32, ...) each wait for flags[channel][kind][p] >= target
// in this rank's allocation at `base`, then the warp synchronises: its later loads and stores see
// what the peers wrote before their release. Loads the warp issued before stay in flight meanwhile,
// so a warp that loads its inputs first hides the wait behind them.
__device__ __forceinline__ void warp_wait_flags(i64 base, int world, int channel, int kind, u64 target,
                                                i64* status, int phase, i64 timeout_ns) {
    for (int p = threadIdx.x & 31; p < world; p += 32) {
        wait_flag_geq(flag_at(base, world, channel, kind, p), target, status, phase, p, timeout_ns);
    }
    __syncwarp();
}

// ------------------------------------------------------------------------ last block done

// Every one of `blocks` blocks calls this once at the end of a phase. The block's earlier stores
// (also to peers) are made visible system-wide, the block counts itself in `*counter`, and the
// block that counts last gets true (and resets the counter for the next launch or graph replay).
// What the last block does afterwards (release-store a flag) is ordered after every block's stores
// and loads. One thread per block counts, with a system-scope acq_rel atomic: its release half is
// cumulative over the block's writes that the barrier ordered before it (the pattern of
// cooperative groups' grid sync), its acquire half makes the last block see every other block's.
// A fence in every thread cost several microseconds per kernel; a fence before and after a
// relaxed atomic, instead of the one acq_rel atomic, about 0.45 us per call. A phase of one block
// (decode sizes) is done at its barrier: the release stores of the signal that follows are
// cumulative over the block's writes as the atomic's release half is, and no other block's need
// acquiring, so it skips the atomic's round trip.
__device__ __forceinline__ bool last_block_done(u64* counter, int blocks) {
    __shared__ int is_last;
#if PUT_TRANSPORT
    nvshmem_quiet();  // this thread's puts have landed at their PEs
#endif
    __syncthreads();
    if (blocks == 1) return true;
    if (threadIdx.x == 0) {
        is_last = atom_add_acq_rel_sys(counter, 1ull) == static_cast<u64>(blocks) - 1;
        if (is_last) st_relaxed_sys(counter, 0ull);  // every block of this launch has counted
    }
    __syncthreads();
    return is_last != 0;
}

// Block-wide: the waiting half of blocks_barrier (below), for a block outside [first, last) that
// needs what those blocks stored before their barrier (acquire loads of their stamps).
__device__ __forceinline__ void wait_blocks(const u64* flags, int first, int last, u64 stamp, i64* status, int rank,
                                            i64 timeout_ns) {
    for (int b = first + threadIdx.x; b < last; b += blockDim.x) {
        wait_flag_geq(flags + b, stamp, status, TIMEOUT_GRID_BARRIER, rank, timeout_ns, true);
    }
    __syncthreads();
}

// Block-wide: the arriving half of blocks_barrier (below), for a block that needs nothing the
// others stored: flags[me] = stamp, a GPU-scope release after a barrier of its threads (cumulative:
// the barrier ordered the block's stores before it).
__device__ __forceinline__ void arrive_blocks(u64* flags, int me, u64 stamp) {
    __syncthreads();
    if (threadIdx.x == 0) st_release_gpu(flags + me, stamp);
}

// Block-wide: a barrier of the blocks whose slots are [first, last) (blocks of the same kernel,
// which all run at once: grids of at most one block per SM); every one of them calls it with its
// own slot `me`. Each stamps flags[me] = stamp (a GPU-scope release after a barrier of its
// threads), then waits until every slot holds at least `stamp`, so what every block stored before
// is visible to every block's later loads. Stamps grow from call to call (epochs), so the flags
// never need resetting.
__device__ __forceinline__ void blocks_barrier(u64* flags, int me, int first, int last, u64 stamp, i64* status,
                                               int rank, i64 timeout_ns) {
    arrive_blocks(flags, me, stamp);
    wait_blocks(flags, first, last, stamp, status, rank, timeout_ns);
}

// ------------------------------------------------------------------------- remote writes
// `dst` is always an address computed from s_peer[pe] (see transport.cuh); `pe` the rank it belongs to.

__device__ __forceinline__ void remote_st32(u32* dst, u32 value, int pe) {
#if PUT_TRANSPORT
    nvshmem_uint32_p(dst, value, pe);
#else
    (void)pe;
    *dst = value;
#endif
}

__device__ __forceinline__ void remote_stf32(float* dst, float value, int pe) {
    remote_st32(reinterpret_cast<u32*>(dst), __float_as_uint(value), pe);
}

// A tagged word (whole: single-copy atomic on both transports).
__device__ __forceinline__ void remote_st64(u64* dst, u64 value, int pe) {
#if PUT_TRANSPORT
    nvshmem_uint64_p(dst, value, pe);
#else
    (void)pe;
    st_relaxed_sys(dst, value);
#endif
}

// A tagged word that also releases what this rank did before it (the count words: a peer that
// acquires one may reuse what this rank read in its calls before; see "slab copies" above).
__device__ __forceinline__ void remote_st64_release(u64* dst, u64 value, int pe) {
#if PUT_TRANSPORT
    nvshmem_fence();
    nvshmem_uint64_p(dst, value, pe);
#else
    (void)pe;
    st_release_sys(dst, value);
#endif
}

// Two tagged words at a 16-byte aligned dst: one vector store with peer stores (each word is
// still whole, which is all a reader relies on), two value puts with NVSHMEM.
__device__ __forceinline__ void remote_st64x2(u64* dst, u64 a, u64 b, int pe) {
#if PUT_TRANSPORT
    nvshmem_uint64_p(dst, a, pe);
    nvshmem_uint64_p(dst + 1, b, pe);
#else
    (void)pe;
    asm volatile("st.relaxed.sys.global.v2.u64 [%0], {%1, %2};" ::"l"(dst), "l"(a), "l"(b) : "memory");
#endif
}

// Where a row that a kernel loads lives: a user tensor that is read-only for the whole kernel
// (x, y: the non-coherent path), or memory that peers wrote (read after the acquire that
// synchronised with them) or that this kernel wrote itself.
constexpr bool kUserInput = true;
constexpr bool kWrittenHere = false;

// One unit of a row: lane `lane` loads vectors v0 + 32 u (u < VPL) of the row at `src` into `vals`.
template <int VPL, bool SOURCE>
__device__ __forceinline__ void load_unit(const u8* src, Vec16 (&vals)[VPL], int v0) {
#pragma unroll
    for (int u = 0; u < VPL; ++u) {
        const int v = v0 + 32 * u;
        if (v < ROW_VECS) {
            const u8* p = src + static_cast<i64>(v) * 16;
            vals[u] = SOURCE == kUserInput ? ld16_nc(p) : ld16(p);
        }
    }
}

// How a row store treats L2: rows that are read back (by this kernel, the experts, combine) stay
// as any store leaves them; rows that no kernel of the step reads soon go evict-first.
constexpr bool kReadSoon = false;
constexpr bool kEvictFirst = true;

// One unit of a row: lane `lane` holds vectors v0 + 32 u (u < VPL) of the row in `vals`; they are
// stored at the same vector indices of `dst` (local memory, or a peer's over NVLink).
template <int VPL, bool EVICT = kReadSoon>
__device__ __forceinline__ void store_unit(u8* dst, const Vec16 (&vals)[VPL], int v0) {
#pragma unroll
    for (int u = 0; u < VPL; ++u) {
        const int v = v0 + 32 * u;
        if (v < ROW_VECS) {
            u8* p = dst + static_cast<i64>(v) * 16;
            if (EVICT == kEvictFirst) {
                st16_evict_first(p, vals[u]);
            } else {
                st16(p, vals[u]);
            }
        }
    }
}

#if PUT_TRANSPORT
// Warp-wide: unit `row_unit` (kVecs vectors) of a row staged at `staged` in this rank's allocation
// goes to `dst` on rank `pe`. The warp's stores of the staged unit are ordered before the put.
template <int VPL>
__device__ __forceinline__ void put_unit(u8* dst, const u8* staged, int row_unit, int pe) {
    const int first = row_unit * 32 * VPL;
    const int vecs = ROW_VECS - first < 32 * VPL ? ROW_VECS - first : 32 * VPL;
    __syncwarp();
    nvshmemx_putmem_nbi_warp(dst + static_cast<i64>(first) * 16, staged + static_cast<i64>(first) * 16,
                             static_cast<size_t>(vecs) * 16, pe);
}
#endif

// The last block's signal of a kernel that sent something on `channel`: for every rank r,
// flags[channel][kind][rank] = epoch (a release: everything this rank wrote to r before is visible
// once r sees the epoch).
__device__ __forceinline__ void signal_every_rank(const i64* s_peer, int rank, int world, int channel, int kind,
                                                  u64 epoch) {
    for (int r = threadIdx.x; r < world; r += blockDim.x) {
#if PUT_TRANSPORT
        nvshmem_fence();
        nvshmem_uint64_p(flag_at(s_peer[r], world, channel, kind, rank), epoch, r);
#else
        st_release_sys(flag_at(s_peer[r], world, channel, kind, rank), epoch);
#endif
    }
}

// ------------------------------------------------------------------------------ tagged words
// A value that travels without a flag: a u64 word with the value in its low half and its call's
// epoch tag in the high half, stored whole (8-byte stores and loads are single-copy atomic), so a
// reader that finds its own call's tag has the value of its own call, written by nothing else. The
// tag is the epoch's low 31 bits with the top bit set, so a zero word (the allocation starts
// zeroed) never carries one. Stale words: a count word is rewritten by every call of its parity
// (dispatch and redispatch), so a stale one is two epochs old; a metadata entry is zeroed by the
// layout block that read it, so one that no call of this epoch wrote yet holds zero.

__device__ __forceinline__ u32 epoch_tag(u64 epoch) { return 0x80000000u | static_cast<u32>(epoch); }

__device__ __forceinline__ u64 tagged_word(u32 value, u64 epoch) {
    return (static_cast<u64>(epoch_tag(epoch)) << 32) | value;
}

__device__ __forceinline__ bool has_tag(u64 word, u64 epoch) { return static_cast<u32>(word >> 32) == epoch_tag(epoch); }

// Two tagged words from a 16-byte aligned p, each whole.
__device__ __forceinline__ void ld_relaxed_sys_x2(const u64* p, u64& a, u64& b) {
    asm volatile("ld.relaxed.sys.global.v2.u64 {%0, %1}, [%2];" : "=l"(a), "=l"(b) : "l"(p) : "memory");
}

// Spin until the word at p carries `epoch`'s tag and return it, as spin_until (on timeout the
// stale word comes back; the status word says the call is broken). An acquire: what the writer did
// before its release of the word (remote_st64_release) happens before what this thread does next.
__device__ __forceinline__ u64 wait_tagged(const u64* p, u64 epoch, i64* status, int phase, int peer, i64 timeout_ns) {
    u64 word = 0;
    spin_until([&]() {
        word = ld_acquire_sys(p);
        return has_tag(word, epoch);
    }, status, phase, peer, timeout_ns, false);
    return word;
}

// The first dispatch of this rank that met a peer's call of another tag (moe_comm/protocol.py).
__device__ __forceinline__ void status_record_mismatch(i64* status, int peer, u32 peer_tag, int own_tag) {
    const u64 word = (1ull << 62) | (static_cast<u64>(peer) << 24) | (static_cast<u64>(peer_tag) << 12) |
                     static_cast<u64>(own_tag);
    atomicCAS(reinterpret_cast<u64*>(status + STATUS_CALL_MISMATCH), 0ull, word);
}

// The count word of `epoch`'s parity (count_flag; count words are dispatch's, channel CH_TO_DEST)
// from sender `peer`, at `epoch`: that sender's T, capped at M (waits for the word, wait_tagged).
// Its call tag must be this call's `call_tag`: calls pair up by their order, and a peer's call of
// another layer or batch slice means the ranks made different calls; that is recorded and the
// group's abort word raised, so no rank sums what this call moves.
__device__ __forceinline__ int tagged_count(i64 base, int world, int peer, u64 epoch, int max_tokens_per_rank,
                                            int call_tag, i64* status, i64 timeout_ns) {
    const u64 word = wait_tagged(count_flag(base, world, CH_TO_DEST, peer, epoch), epoch, status,
                                 TIMEOUT_TO_DEST_ARRIVAL, peer, timeout_ns);
    const u32 value = static_cast<u32>(word);
    const u32 peer_tag = value >> COUNT_BITS;
    if (has_tag(word, epoch) && peer_tag != static_cast<u32>(call_tag)) {
        status_record_mismatch(status, peer, peer_tag, call_tag);
        raise_abort(status, ABORT_CALL_MISMATCH, peer);
    }
    const u32 count = value & ((1u << COUNT_BITS) - 1u);
    return count > static_cast<u32>(max_tokens_per_rank) ? max_tokens_per_rank : static_cast<int>(count);
}

// This rank's T and call tag at `epoch` into the count word of `epoch`'s parity in every rank's
// flags, released: the peer that acquires it at `epoch` knows this rank finished every call before
// (its reads of the slab copy the peer writes next among them).
__device__ __forceinline__ void send_count_every_rank(const i64* s_peer, int rank, int world, u64 epoch, int count,
                                                      int call_tag) {
    const u32 value = static_cast<u32>(count) | (static_cast<u32>(call_tag) << COUNT_BITS);
    for (int r = threadIdx.x; r < world; r += blockDim.x) {
        remote_st64_release(count_flag(s_peer[r], world, CH_TO_DEST, rank, epoch), tagged_word(value, epoch), r);
    }
}

// One call on a channel, as every block of its kernel sees it.
struct Call {
    u64 epoch;        // the last completed epoch + 1
    u64 blocks_before;  // thread 0, kernels that end the call with two slab copies: blocks counted in before this one
};

// Block-wide start of every kernel: the peer base addresses into shared memory s_peer [world]
// (visible to every thread on return), the block's FaultScope (and whether the group's abort word
// is raised: the call is then invalid, its status says so, and its waits give up at once), and
// this call's epoch on `channel`. With two slab copies a kernel that ends the call (`ends_call`)
// counts its blocks in at state[STATE_DONE + slot] once every thread of the block has read the
// epoch, so end_call finds the last block without a counter on its own path (the atomic's latency
// hides behind the kernel's work).
__device__ __forceinline__ Call begin_call(i64* s_peer, const i64* peers, int rank, int world, u64* state, i64* status,
                                           int channel, bool ends_call, int slot, i64 copy_stride) {
    for (int p = threadIdx.x; p < world; p += blockDim.x) s_peer[p] = peers[p];
    if (threadIdx.x == 0) {
        s_fault.peers = s_peer;
        s_fault.own_abort = abort_word(peers[rank], world);
        s_fault.status = status;
        s_fault.rank = rank;
        s_fault.world = world;
        s_fault.aborted = abort_seen(status);
    }
    Call call;
    call.epoch = state[STATE_EPOCH + channel] + 1;
    call.blocks_before = 0;
    __syncthreads();
    if (ends_call && !acks_needed(copy_stride) && threadIdx.x == 0) {
        // Release: the block's reads of the epoch (ordered by the barrier) come before the count.
        // No acquire here: it would hold the block until the atomic returns.
        call.blocks_before = atom_add_release_gpu(state + STATE_DONE + slot, 1ull);
    }
    return call;
}

// The end of the kernel that ends a call on `channel` (every block calls it, after begin_call with
// ends_call). With one slab copy the last block done acknowledges `channel` to every rank (their
// slabs here may be overwritten); with two nothing is signalled, and the last block to have begun
// resets the counter. Either way that block records the epoch as completed: every block read it
// before counting itself in, and the next kernel on the stream starts after this one ends.
__device__ __forceinline__ void end_call(const Call& call, u64* state, int slot, const i64* s_peer, int rank,
                                         int world, int channel, i64 copy_stride) {
    // A peer that failed raised the abort word before it signalled anything its failed wait left
    // unfinished, and this block acquired every signal it used: a word raised by then is visible here,
    // so a call that consumed such data has it in its status even if every wait of it was met at once.
    __syncthreads();
    if (threadIdx.x == 0) abort_seen(s_fault.status);
    if (acks_needed(copy_stride)) {
        if (last_block_done(state + STATE_DONE + slot, gridDim.x)) {
            signal_every_rank(s_peer, rank, world, channel, FLAG_ACK, call.epoch);
            if (threadIdx.x == 0) state[STATE_EPOCH + channel] = call.epoch;
        }
    } else if (threadIdx.x == 0 && call.blocks_before == static_cast<u64>(gridDim.x) - 1) {
        fence_acq_rel_gpu();  // the acquire the count left out: every block's read precedes the store
        state[STATE_DONE + slot] = 0;
        state[STATE_EPOCH + channel] = call.epoch;
    }
}

// Warp-level split of a row into chunks of 32 * VPL vectors (VPL vectors per lane), so several
// warps can move one row (decode sizes have few rows). Python mirrors kPerRow to size grids
// (kernels._units_per_row); a mismatch there only changes the grid, never the result.
template <int VPL>
struct RowUnits {
    static constexpr int kVecs = 32 * VPL;
    static constexpr int kPerRow = (ROW_VECS + kVecs - 1) / kVecs;
};

// ---------------------------------------------------------------- batches of slab rows

// Slab rows ([W * M] of them, K entries each) are scanned by a group of blocks in batches: the
// block loads a batch's recv_pos (and optionally recv_weight) into shared memory in one pass and
// lists the rows that carry work, so warps then only touch those rows. A scan covers a set of
// rows: all of them or one rank's slab (M rows from `offset`), numbered v = 0 .. total_rows - 1
// (dispatch's expand_arrivals orders its own batches by chunk). Each block takes n =
// ceil(ceil(total_rows / blocks) / BATCH_ROWS) batches of R = ceil(ceil(total_rows / blocks) / n)
// rows (at most BATCH_ROWS), so every block gets a batch even when there are few rows (decode
// sizes) and every block the same number when there are many (4096 rows on 108 blocks: 216
// batches of 19 rows, not 128 of 32 of which 20 blocks took two while 88 idled). Batch q of Q =
// ceil(total_rows / R) holds the rows v = q, q + Q, q + 2Q, ...: interleaved, so the rows that
// carry tokens (the first T_s of each slab) spread evenly over all batches and blocks even when T
// is much smaller than M.
#define BATCH_ROWS 32

struct RowBatch {
    i32 pos[BATCH_ROWS * TOPK];
    float weight[BATCH_ROWS * TOPK];
    i64 row[BATCH_ROWS];  // slab row of batch row j (-1: none)
    i32 list[BATCH_ROWS];
    u32 mask;
};

// How `blocks` blocks split a set of slab rows into batches.
struct BatchShape {
    int rows;         // rows per batch (1..BATCH_ROWS)
    i64 count;        // number of batches
    i64 total_rows;   // rows of the set
    i64 offset;       // slab row of v = 0
};

__device__ __forceinline__ BatchShape batch_shape(i64 total_rows, int blocks, i64 offset = 0) {
    BatchShape shape;
    const i64 per_block = (total_rows + blocks - 1) / blocks;
    const i64 batches_per_block = per_block > BATCH_ROWS ? (per_block + BATCH_ROWS - 1) / BATCH_ROWS : 1;
    const i64 rows = (per_block + batches_per_block - 1) / batches_per_block;  // at most BATCH_ROWS
    shape.rows = static_cast<int>(rows < 1 ? 1 : rows);
    shape.count = (total_rows + shape.rows - 1) / shape.rows;
    shape.total_rows = total_rows;
    shape.offset = offset;
    return shape;
}

// Block-wide (every thread calls it; blockDim.x >= 32). Loads `rows` (<= BATCH_ROWS) rows of
// recv_pos [W * M, TOPK] (and of recv_weight unless it is null) into `b`: batch row j is slab row
// row_of(j), or none when that is -1 (plain loads: recv_pos may come from other blocks of the same
// kernel). Lists in b.list the batch rows j with an entry >= min_pos (min_pos 0: a kept entry;
// -2: any entry that is not empty) and returns how many were listed; b.row[j] is j's slab row.
// Ends with __syncthreads(); the caller must __syncthreads() before the next call overwrites `b`.
template <typename RowOf>
__device__ __forceinline__ int block_load_rows(RowBatch& b, const i32* recv_pos, const float* __restrict__ recv_weight,
                                               int rows, RowOf row_of, int min_pos) {
    for (int i = threadIdx.x; i < rows * TOPK; i += blockDim.x) {
        const int j = i / TOPK;
        const int k = i - j * TOPK;
        const i64 g = row_of(j);
        b.pos[i] = g >= 0 ? recv_pos[g * TOPK + k] : -1;
        if (recv_weight != nullptr) b.weight[i] = g >= 0 ? recv_weight[g * TOPK + k] : 0.0f;
        if (k == 0) b.row[j] = g;
    }
    __syncthreads();
    if (threadIdx.x < 32) {
        const int j = threadIdx.x;
        bool carries = false;
        if (j < rows) {
#pragma unroll
            for (int k = 0; k < TOPK; ++k) {
                const int pos = b.pos[j * TOPK + k];
                // -1 marks an empty entry; with min_pos -2 a dropped entry (-2) still carries its token.
                carries |= pos != -1 && pos >= min_pos;
            }
        }
        const u32 m = __ballot_sync(FULL_MASK, carries);
        if (carries) b.list[__popc(m & lanemask_lt())] = j;
        if (j == 0) b.mask = m;
    }
    __syncthreads();
    return __popc(b.mask);
}

// block_load_rows for batch `batch` of an interleaved set (BatchShape): row j is v = batch + j Q.
__device__ __forceinline__ int block_load_batch(RowBatch& b, const i32* recv_pos, const float* __restrict__ recv_weight,
                                                const BatchShape& shape, i64 batch, int min_pos) {
    return block_load_rows(b, recv_pos, recv_weight, shape.rows, [&](int j) -> i64 {
        const i64 v = batch + j * shape.count;
        if (v >= shape.total_rows) return -1;
        return shape.offset + v;
    }, min_pos);
}

// Warp-wide: the entries k (bit k) of a row whose position is kept, in [0, capacity_rows) (lane
// k < TOPK holds entry k's position in `pos`; -1 empty, -2 dropped). `lane` is the caller's lane.
__device__ __forceinline__ u32 kept_entries(int lane, int pos, int capacity_rows) {
    return __ballot_sync(FULL_MASK, lane < TOPK && pos >= 0 && pos < capacity_rows);
}

// The set of ranks a token was sent to, from its send_mask row [world] (bool bytes), as a
// 64-bit mask. Warp-wide (every lane calls it, same row).
__device__ __forceinline__ u64 warp_dest_set(const u8* __restrict__ send_mask_row, int world) {
    const int lane = threadIdx.x & 31;
    const bool lo = lane < world && send_mask_row[lane] != 0;
    const bool hi = lane + 32 < world && send_mask_row[lane + 32] != 0;
    return static_cast<u64>(__ballot_sync(FULL_MASK, lo)) | (static_cast<u64>(__ballot_sync(FULL_MASK, hi)) << 32);
}
