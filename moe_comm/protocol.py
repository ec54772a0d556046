"""What the Python side and the CUDA kernels share: every value both must agree on, in one place.

The kernels never spell these values out: :func:`cuda_header` writes them as the ``#define`` lines
of ``protocol.cuh``, which :mod:`moe_comm.cuda.jit` hands to NVRTC next to ``csrc/*.cuh`` (and hashes
into the cache key, so a changed value recompiles). A value only the kernels use stays in ``csrc``.

The module holds, in this order: the status word and its decoding (:class:`StatusReport`,
:func:`decode_status`), the channels, flag kinds and timeout phases of the peer protocol, the
local state words, the limits and block shapes both sides size work with, and the regions of the
symmetric allocation (:class:`SymmetricRegions`). The regions live here rather than with the
launchers because they are the memory layout both sides index: the flags region is
``[CHANNELS][FLAG_KINDS][W]`` (``flag_at`` in ``csrc/common.cuh``) and a metadata row is
``meta_words(K)`` words (``META_WORDS``), so every number that sizes them is defined here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

__all__ = [
    "STATUS_NUM_INVALID",
    "STATUS_FIRST_INVALID",
    "STATUS_NUM_DROPPED",
    "STATUS_FIRST_DROPPED",
    "STATUS_TIMEOUT_PHASE",
    "STATUS_TIMEOUT_PEER",
    "STATUS_FIRST_INVALID_CALL",
    "STATUS_FIRST_DROPPED_CALL",
    "STATUS_ABORT",
    "STATUS_CALL_MISMATCH",
    "STATUS_FIELDS",
    "NO_OFFENDER",
    "ABORT_RAISED",
    "ABORT_NO_PEER",
    "ABORT_CALL_MISMATCH",
    "ABORT_REASONS",
    "COUNT_BITS",
    "CALL_TAG_LIMIT",
    "CH_TO_DEST",
    "CH_TO_SOURCE",
    "CHANNELS",
    "FLAG_ARRIVAL",
    "FLAG_COUNT",
    "FLAG_ACK",
    "FLAG_CHUNK",
    "MAX_CHUNKS",
    "FLAG_KINDS",
    "MIN_CHUNK_TOKENS",
    "TIMEOUT_TO_DEST_ACK",
    "TIMEOUT_TO_DEST_ARRIVAL",
    "TIMEOUT_TO_SOURCE_ACK",
    "TIMEOUT_TO_SOURCE_ARRIVAL",
    "TIMEOUT_GRID_BARRIER",
    "TIMEOUT_PHASES",
    "STATE_EPOCH",
    "STATE_DONE",
    "STATE_CHUNK_DONE",
    "STATE_CLAIM",
    "CLAIM_ARRIVALS",
    "CLAIM_PADDING",
    "STATE_WORDS",
    "SLOT_REDISPATCH_SEND",
    "SLOT_DISPATCH_EXPAND",
    "SLOT_COMBINE_SEND",
    "SLOT_COMBINE_RECV",
    "SLOT_VALUES_SEND",
    "SLOT_VALUES_RECV",
    "MAX_WORLD",
    "MAX_TOPK",
    "REGION_ALIGN",
    "SLAB_COPIES",
    "DISPATCH_THREADS",
    "SEND_VPL",
    "COMBINE_THREADS",
    "COMBINE_SEND_VPL",
    "COMBINE_REDUCED_VPL",
    "VALUES_THREADS",
    "PERMUTE_THREADS",
    "LAYOUT_ROWS_PER_BLOCK",
    "FP8_UNIT_VPL",
    "FP8_PACK_OWN_MAX_TOKENS",
    "LAYOUT_SHARED_LIMIT",
    "AbortReport",
    "CallMismatch",
    "StatusReport",
    "SymmetricRegions",
    "cuda_header",
    "decode_abort",
    "decode_call_mismatch",
    "encode_call_mismatch",
    "decode_status",
    "meta_words",
    "new_status",
]

# ---------------------------------------------------------------------------------- status word

# Fields of the device status word, int64 [STATUS_FIELDS] on the dispatcher's device. The
# "call" fields hold the earliest call (the epoch of CH_TO_DEST: dispatches and redispatches,
# counted from 1) with an offence, the "first" fields the smallest ``(rank << 32) | token`` of
# that call; NO_OFFENDER if none.
STATUS_NUM_INVALID = 0     # assignments whose expert id was neither -1 nor in [0, E)
STATUS_FIRST_INVALID = 1   # (source rank, token) of the first invalid assignment
STATUS_NUM_DROPPED = 2     # assignments dropped because their expert was over capacity
STATUS_FIRST_DROPPED = 3   # (source rank, token) of the first dropped assignment
STATUS_TIMEOUT_PHASE = 4   # phase code (TIMEOUT_*) of the first wait that timed out, 0 if none
STATUS_TIMEOUT_PEER = 5    # the peer that wait was waiting for
STATUS_FIRST_INVALID_CALL = 6  # the call of the first invalid assignment
STATUS_FIRST_DROPPED_CALL = 7  # the call of the first dropped assignment
STATUS_ABORT = 8           # the abort word a call of this rank found raised (0: none), see below
STATUS_CALL_MISMATCH = 9   # 1 << 62 | peer << 24 | peer's call tag << 12 | own call tag of the first mismatch, 0 if none
STATUS_FIELDS = 10
NO_OFFENDER = (1 << 63) - 1

# ------------------------------------------------------------------------------------ the abort word

# A failure is the whole group's: a rank whose wait runs past timeout_s raises the abort word, one
# u64 after the flags of every rank's allocation (SymmetricRegions.abort_offset), in every rank's
# memory and its own. From then on every kernel of every rank gives up its waits at once and records
# the word in its status (STATUS_ABORT), so no call consumes a peer's data of another call, until a
# collective Dispatcher.reset() clears it. The word: ABORT_RAISED | phase << 32 | waited-for peer << 16
# (ABORT_NO_PEER: none) | the failing rank.
ABORT_RAISED = 1 << 63
ABORT_NO_PEER = 0xFFFF

# Calls pair up across ranks by their order; each dispatch carries a call tag (0 <= tag <
# CALL_TAG_LIMIT, Dispatcher.dispatch's call_tag: the library's layers pass their layer and batch
# slice) in the top bits of its count word, below them the sender's T (< 2**COUNT_BITS). A receiver
# whose own tag differs records STATUS_CALL_MISMATCH and raises the abort word with the reason
# ABORT_CALL_MISMATCH: the ranks made different calls, and no result of that call is summed.
COUNT_BITS = 20
CALL_TAG_LIMIT = 1 << 12

# ---------------------------------------------------------------------------- channels and flags

# A channel is one direction of traffic with its own flags and epoch.
CH_TO_DEST = 0     # dispatch, redispatch: source -> destination
CH_TO_SOURCE = 1   # combine, return_entry_values: destination -> source
CHANNELS = 2

# Flag kinds, u64 flags[channel][kind][peer] at offset 0 of every rank's symmetric allocation.
FLAG_ARRIVAL = 0   # written by sender `peer`: its data of this epoch has landed
FLAG_COUNT = 1     # FLAG_COUNT + (epoch & 1): the T of sender `peer` at an even / odd epoch, tagged with it
FLAG_ACK = 3       # written by receiver `peer` once it finished reading what this rank sent it (one slab copy)
FLAG_CHUNK = 4     # FLAG_CHUNK + c: chunk c of dispatch's rows from sender `peer` has landed
# Dispatch's rows land in up to MAX_CHUNKS chunks, each of at least MIN_CHUNK_TOKENS tokens
# (every chunk costs each sending block a system fence).
MAX_CHUNKS = 4
MIN_CHUNK_TOKENS = 256
FLAG_KINDS = FLAG_CHUNK + MAX_CHUNKS

# Phase codes of status[STATUS_TIMEOUT_PHASE]: 1 + 2 * channel while waiting for a peer's ack
# (its slab is still being read), 2 + 2 * channel while waiting for a peer's arrival.
TIMEOUT_TO_DEST_ACK = 1
TIMEOUT_TO_DEST_ARRIVAL = 2
TIMEOUT_TO_SOURCE_ACK = 3
TIMEOUT_TO_SOURCE_ARRIVAL = 4
# A kernel's blocks wait for each other (peer = this rank): a block never started, e.g. other
# kernels held the SMs past timeout_ns.
TIMEOUT_GRID_BARRIER = 5

# Not a timeout, a reason an abort word can carry: a dispatch met a peer's call of another tag.
ABORT_CALL_MISMATCH = 6

TIMEOUT_PHASES = {
    TIMEOUT_TO_DEST_ACK: "dispatch: waiting for a peer to free its receive slab",
    TIMEOUT_TO_DEST_ARRIVAL: "dispatch: waiting for a peer's tokens",
    TIMEOUT_TO_SOURCE_ACK: "combine: waiting for a peer to free its return slab",
    TIMEOUT_TO_SOURCE_ARRIVAL: "combine: waiting for a peer's partial sums",
    TIMEOUT_GRID_BARRIER: "a kernel's blocks waiting for each other (other kernels held the SMs?)",
}

# Why an abort word was raised: a timeout phase, or a call that met a peer's call of another tag.
ABORT_REASONS = {
    **TIMEOUT_PHASES,
    ABORT_CALL_MISMATCH: "dispatch: it met a peer's call of another layer or batch slice",
}

# ---------------------------------------------------------------------------------- state words

# Local (not symmetric) state, u64 [STATE_WORDS] per backend: state[STATE_EPOCH + channel] is the
# epoch of the last completed call on the channel, state[STATE_DONE + slot] the done-counter of
# the last-block pattern of a phase, state[STATE_CHUNK_DONE + c] (c < MAX_CHUNKS) that of
# dispatch's chunk c, state[STATE_CLAIM + 2 * claim + (epoch & 1)] the batch tickets of dispatch's
# arrivals (claim CLAIM_ARRIVALS) and of its zero padding (CLAIM_PADDING) at that epoch parity (each
# dispatch or redispatch zeroes the next call's words when it starts).
STATE_EPOCH = 0
STATE_DONE = 2
STATE_CHUNK_DONE = 16
STATE_CLAIM = 24
CLAIM_ARRIVALS = 0
CLAIM_PADDING = 1
STATE_WORDS = 32

# Done-counter slots, one per phase that ends in a signal (dispatch and redispatch share the
# expand slot: calls of one backend are ordered, and the last block resets the counter).
SLOT_REDISPATCH_SEND = 0
SLOT_DISPATCH_EXPAND = 1
SLOT_COMBINE_SEND = 2
SLOT_COMBINE_RECV = 3
SLOT_VALUES_SEND = 4
SLOT_VALUES_RECV = 5

# ------------------------------------------------------------------------------------- limits

MAX_WORLD = 64   # ranks: destination sets are 64-bit masks, peer bases live in shared memory
MAX_TOPK = 32    # columns of topk_idx: one lane per column
# A dispatch metadata row is one 16-byte entry per column k: two u64 words, the local expert id
# (int32, -1 = none) and the weight (float32 bits) each in the low half, the call's epoch tag in
# the high half (csrc/common.cuh: a reader takes a word only once it carries its call's tag, so the
# metadata needs no flag of its own), 4 * K u32 words (meta_words).
REGION_ALIGN = 256   # bytes: every region of the symmetric allocation starts at a multiple
# Copies of the receive slabs (Config.slab_copies): 2, one per epoch parity, lets a sender write
# without waiting for its peer's ack; 1 halves them and keeps the ack round.
SLAB_COPIES = (1, 2)
# Dynamic shared memory the dispatch kernel's layout phase may use (H100/H200 allow 227 KiB per block).
LAYOUT_SHARED_LIMIT = 200 * 1024

# -------------------------------------------------------------------------------- block shapes

# Threads per block of each kernel (their __launch_bounds__), and the send phases' 16-byte vectors
# per lane per unit, which fix how many warps share a row (a mismatch with the grid the host picks
# only changes how many blocks send, never a result). Combine's: 16 loads in flight per lane with
# top-8 (4 spills registers); the one-rank combine's grid is sized by it.
DISPATCH_THREADS = 512
SEND_VPL = 8
COMBINE_THREADS = 512
COMBINE_SEND_VPL = 2
# Token-major combine's (TOKEN_MAJOR builds): one row read a partial instead of K summed, so a lane keeps
# more of it in flight.
COMBINE_REDUCED_VPL = 8
VALUES_THREADS = 512
PERMUTE_THREADS = 256  # permute_rows and unpermute_rows (csrc/permute.cu): several blocks an SM
# Slab rows per layout block of dispatch: the host sizes the layout group for full slabs by it, and
# each call ranks its rows on as many of those blocks as they fill.
LAYOUT_ROWS_PER_BLOCK = 256
# 16-byte e4m3 vectors per lane of a warp's unit when a kernel quantizes rows (csrc/fp8.cuh).
FP8_UNIT_VPL = 4
# FP8 dispatch of config-dtype rows: the own rows of the first this many tokens are packed while
# the metadata travels and the layout runs, the own expansion quantizes the rest (csrc/dispatch.cu).
# One H200, world 1, T=4096: 110.2 / 107.4 / 107.7 / 108.6 us with 0 / 1024 / 1536 / 2048 packed.
FP8_PACK_OWN_MAX_TOKENS = 1024


def meta_words(topk: int) -> int:
    """Words (u32) of one dispatch metadata row for top-``topk`` (``META_WORDS`` in the kernels)."""
    return 4 * topk


# ------------------------------------------------------------------------------ the CUDA header

# protocol.cuh, group by group: (comment, names). Every name of __all__ that is an int is here.
_HEADER_GROUPS = (
    ("Status word: int64 [STATUS_FIELDS]; the first-offender fields hold the smallest (rank << 32 | token)",
     ("STATUS_NUM_INVALID", "STATUS_FIRST_INVALID", "STATUS_NUM_DROPPED", "STATUS_FIRST_DROPPED",
      "STATUS_TIMEOUT_PHASE", "STATUS_TIMEOUT_PEER", "STATUS_FIRST_INVALID_CALL", "STATUS_FIRST_DROPPED_CALL",
      "STATUS_ABORT", "STATUS_CALL_MISMATCH", "STATUS_FIELDS", "NO_OFFENDER")),
    ("The abort word: ABORT_RAISED | phase << 32 | waited-for peer << 16 | failing rank",
     ("ABORT_RAISED", "ABORT_NO_PEER")),
    ("Channels: CH_TO_DEST carries dispatch and redispatch, CH_TO_SOURCE combine and the values kernels",
     ("CH_TO_DEST", "CH_TO_SOURCE", "CHANNELS")),
    ("Flag kinds of flags[channel][kind][peer]; FLAG_CHUNK + c is chunk c of dispatch's rows",
     ("FLAG_ARRIVAL", "FLAG_COUNT", "FLAG_ACK", "FLAG_CHUNK", "MAX_CHUNKS", "FLAG_KINDS",
      "MIN_CHUNK_TOKENS")),
    ("Timeout phases of status[STATUS_TIMEOUT_PHASE]: 1 + 2 * channel waits for an ack, 2 + 2 * channel "
     "for an arrival",
     ("TIMEOUT_TO_DEST_ACK", "TIMEOUT_TO_DEST_ARRIVAL", "TIMEOUT_TO_SOURCE_ACK", "TIMEOUT_TO_SOURCE_ARRIVAL",
      "TIMEOUT_GRID_BARRIER")),
    ("Call tags: a count word's value is T | call tag << COUNT_BITS; ABORT_CALL_MISMATCH is the abort reason of a "
     "mismatch",
     ("COUNT_BITS", "CALL_TAG_LIMIT", "ABORT_CALL_MISMATCH")),
    ("Local state, u64 [STATE_WORDS]: epochs per channel, done-counters per slot, then per chunk, then "
     "dispatch's batch tickets per claim (arrivals, padding) and epoch parity",
     ("STATE_EPOCH", "STATE_DONE", "STATE_CHUNK_DONE", "STATE_CLAIM", "CLAIM_ARRIVALS", "CLAIM_PADDING",
      "STATE_WORDS")),
    ("Done-counter slots: state[STATE_DONE + slot]",
     ("SLOT_REDISPATCH_SEND", "SLOT_DISPATCH_EXPAND", "SLOT_COMBINE_SEND", "SLOT_COMBINE_RECV",
      "SLOT_VALUES_SEND", "SLOT_VALUES_RECV")),
    ("Limits",
     ("MAX_WORLD", "MAX_TOPK", "REGION_ALIGN", "LAYOUT_SHARED_LIMIT")),
    ("Block shapes: threads per block, the send phases' vectors per lane per unit, slab rows per layout block, "
     "e4m3 vectors per lane per unit of quantized rows, the most tokens whose own rows FP8 dispatch packs first",
     ("DISPATCH_THREADS", "SEND_VPL", "COMBINE_THREADS", "COMBINE_SEND_VPL", "COMBINE_REDUCED_VPL", "VALUES_THREADS",
      "PERMUTE_THREADS",
      "LAYOUT_ROWS_PER_BLOCK", "FP8_UNIT_VPL", "FP8_PACK_OWN_MAX_TOKENS")),
)

# The C spelling of meta_words(TOPK): TOPK is a compile-time define of every kernel build.
_META_WORDS_C = "(4 * TOPK)"


def _c_literal(value: int) -> str:
    # Past int32 a literal needs the long long suffix to keep its type in every expression (past
    # int64, the unsigned one: ABORT_RAISED is a u64 bit).
    if value >= 2**63:
        return f"{value}ULL"
    return f"{value}LL" if not -(2**31) <= value < 2**31 else str(value)


def cuda_header() -> str:
    """The text of ``protocol.cuh``: one ``#define`` per protocol value, grouped, in a fixed order.

    Values are read when called, so the header (and the compile cache key it is part of) follows
    any change to them.
    """
    lines = [
        "// protocol.cuh: the values moe_comm's kernels share with Python.",
        "// Generated by moe_comm.protocol.cuda_header(); edit moe_comm/protocol.py, not this text.",
        "#pragma once",
    ]
    for comment, names in _HEADER_GROUPS:
        lines += ["", f"// {comment}."]
        lines += [f"#define {name} {_c_literal(globals()[name])}" for name in names]
    lines += ["", "// Words of a dispatch metadata row (moe_comm.protocol.meta_words(TOPK)).",
              f"#define META_WORDS {_META_WORDS_C}", ""]
    return "\n".join(lines)


# ----------------------------------------------------------------------------- status decoding


@dataclass(frozen=True)
class AbortReport:
    """A raised abort word (see ``ABORT_RAISED``): which rank failed, in which phase, waiting for which peer.

    failed_rank: the rank whose wait ran past ``timeout_s`` (or whose dispatch met a call of another tag:
    ``mismatch``). phase: why (``ABORT_REASONS``). peer: the rank it waited for or met, or None (a kernel's
    own blocks).
    """

    failed_rank: int
    phase: str
    peer: Optional[int]
    mismatch: bool = False

    def describe(self) -> str:
        if self.mismatch:
            return f"rank {self.failed_rank}'s dispatch met a call of another layer or batch slice of rank {self.peer}"
        peer = "" if self.peer is None else f", waiting for rank {self.peer}"
        return f"rank {self.failed_rank} timed out in {self.phase}{peer}"


def decode_abort(word: int) -> Optional[AbortReport]:
    """The report of an abort word (an int64 or u64 value as read on the host), None when it is not raised."""
    word &= (1 << 64) - 1
    if not word & ABORT_RAISED:
        return None
    phase = (word >> 32) & 0xFF
    peer = (word >> 16) & 0xFFFF
    return AbortReport(failed_rank=word & 0xFFFF, phase=ABORT_REASONS.get(phase, f"phase {phase}"),
                       peer=None if peer == ABORT_NO_PEER else peer, mismatch=phase == ABORT_CALL_MISMATCH)


@dataclass(frozen=True)
class CallMismatch:
    """A dispatch that met a peer's call of another tag: the peer, its tag and this rank's."""

    peer: int
    peer_tag: int
    own_tag: int


def decode_call_mismatch(word: int) -> Optional[CallMismatch]:
    """The report of a ``STATUS_CALL_MISMATCH`` field, None when it holds none."""
    if not word:
        return None
    return CallMismatch(peer=(word >> 24) & 0xFFFF, peer_tag=(word >> 12) & 0xFFF, own_tag=word & 0xFFF)


def encode_call_mismatch(peer: int, peer_tag: int, own_tag: int) -> int:
    """The ``STATUS_CALL_MISMATCH`` field of a mismatch (``status_record_mismatch`` in csrc/common.cuh)."""
    return 1 << 62 | peer << 24 | peer_tag << 12 | own_tag


@dataclass(frozen=True)
class StatusReport:
    """The device status word read on the host.

    num_invalid: assignments with an expert id outside ``[0, num_experts)`` other than -1.
    first_invalid: ``(source rank, token)`` of the first one (in its call), or None.
    first_invalid_call: that call (the Dispatcher's dispatches and redispatches, counted from 1),
        or None.
    num_dropped: assignments dropped because their expert was over ``expert_capacity``.
    first_dropped, first_dropped_call: as for the invalid ones.
    timeout_phase: name of the first wait that timed out, or None. timeout_peer: its peer
        (None also when the transport cannot tell which peer is missing: a collective with more than two ranks).
    abort: the group's abort word as a call of this rank found it raised (a rank failed, possibly this
        one), or None: calls since then gave up their waits and their results are invalid.
    call_mismatch: the first dispatch of this rank that met a peer's call of another call tag, or None.
    """

    num_invalid: int
    first_invalid: Optional[tuple[int, int]]
    first_invalid_call: Optional[int]
    num_dropped: int
    first_dropped: Optional[tuple[int, int]]
    first_dropped_call: Optional[int]
    timeout_phase: Optional[str]
    timeout_peer: Optional[int]
    abort: Optional[AbortReport] = None
    call_mismatch: Optional[CallMismatch] = None

    @property
    def ok(self) -> bool:
        """True when nothing was recorded."""
        return not (self.num_invalid or self.num_dropped or self.broken)

    @property
    def broken(self) -> bool:
        """True when the group's calls are out of step (a timeout, an abort, calls that did not pair up):
        only a reset or a rebuild helps."""
        return bool(self.timeout_phase or self.abort or self.call_mismatch)


def _offender(key: int) -> Optional[tuple[int, int]]:
    return None if key == NO_OFFENDER else (key >> 32, key & 0xFFFFFFFF)


def decode_status(values: Sequence[int], warm_up_calls: int = 0) -> StatusReport:
    """The report of a status word read on the host (``status.tolist()``, ``STATUS_FIELDS`` ints).

    ``warm_up_calls``: calls the backend made itself before the user's (``Backend.warm_up_calls``);
    the report's call numbers count the user's calls from 1.
    """

    def _call(value: int) -> Optional[int]:
        return None if value == NO_OFFENDER else value - warm_up_calls

    phase = values[STATUS_TIMEOUT_PHASE]
    return StatusReport(
        num_invalid=values[STATUS_NUM_INVALID],
        first_invalid=_offender(values[STATUS_FIRST_INVALID]),
        first_invalid_call=_call(values[STATUS_FIRST_INVALID_CALL]),
        num_dropped=values[STATUS_NUM_DROPPED],
        first_dropped=_offender(values[STATUS_FIRST_DROPPED]),
        first_dropped_call=_call(values[STATUS_FIRST_DROPPED_CALL]),
        timeout_phase=TIMEOUT_PHASES.get(phase, f"phase {phase}") if phase else None,
        timeout_peer=values[STATUS_TIMEOUT_PEER] if phase else None,
        abort=decode_abort(values[STATUS_ABORT]),
        call_mismatch=decode_call_mismatch(values[STATUS_CALL_MISMATCH]),
    )


def new_status(device: torch.device) -> torch.Tensor:
    """A cleared status word: int64 ``[STATUS_FIELDS]`` on ``device``."""
    status = torch.zeros(STATUS_FIELDS, dtype=torch.int64, device=device)
    for field in (STATUS_FIRST_INVALID, STATUS_FIRST_DROPPED, STATUS_FIRST_INVALID_CALL, STATUS_FIRST_DROPPED_CALL):
        status[field] = NO_OFFENDER
    return status


# ---------------------------------------------------------------------------- symmetric regions


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


@dataclass(frozen=True)
class SymmetricRegions:
    """Byte offsets of the regions of one rank's symmetric allocation (the same on every rank).

    ``W`` ranks, ``M = max_tokens_per_rank``, ``K = topk``, rows of ``row_bytes``; every region starts at a
    multiple of ``REGION_ALIGN`` bytes.

    * ``flags``    u64 ``[CHANNELS][FLAG_KINDS][W]`` at offset 0: arrival (written by the sender),
      count (the sender's T, one word per epoch parity, tagged with the epoch), ack (written by the
      receiver into the sender's memory; used with one slab copy), then one per chunk of dispatch's
      rows (chunk ``c`` of the sender's rows has landed); then the abort word (u64 at ``abort_offset``).
    * ``slab_copies`` copies (one per epoch parity when 2) of the four receive slabs; the offsets
      below are copy 0's, copy 1's are ``copy_stride`` bytes further (``copy_stride`` 0: one copy).
      Epoch ``e`` reads and writes copy ``e & 1``.

      * ``meta``     u32 ``[W, M, meta_words]``: slab ``s`` written by source ``s`` in dispatch: per column
        k a local expert id (-1 none) and a float32 weight, each in a u64 word tagged with the epoch.
      * ``ret_vals`` f32 ``[W, M, K]``: slab ``r`` written by destination ``r`` (return_entry_values).
      * ``recv_x``   ``[W, M, row]``: slab ``s`` written by source ``s`` (dispatch, redispatch).
      * ``ret_x``    ``[W, M, row]``: slab ``r`` written by destination ``r`` (combine partials).
    * ``stage_x``  ``[W, M, row]``, only with ``put_transport``: this rank's partials
      for source ``s`` before NVSHMEM puts them (NVSHMEM moves symmetric memory only); else size 0.
      It is written and read within one call, so it has one copy.
    """

    world_size: int
    max_tokens_per_rank: int
    topk: int
    row_bytes: int
    meta_words: int
    slab_copies: int
    flags_offset: int
    meta_offset: int
    ret_vals_offset: int
    recv_x_offset: int
    ret_x_offset: int
    copy_stride: int
    stage_x_offset: int
    nbytes: int

    @property
    def abort_offset(self) -> int:
        """Byte offset of the abort word (``ABORT_RAISED``): right after the flags (``abort_word`` in csrc/common.cuh)."""
        return CHANNELS * FLAG_KINDS * self.world_size * 8

    @classmethod
    def plan(
        cls, world_size: int, max_tokens_per_rank: int, topk: int, row_bytes: int, *, put_transport: bool = False,
        slab_copies: int = 2,
    ) -> "SymmetricRegions":
        if slab_copies not in SLAB_COPIES:
            raise ValueError(f"slab_copies must be one of {SLAB_COPIES}, got {slab_copies!r}")
        words = meta_words(topk)
        slab_rows = world_size * max_tokens_per_rank
        flags_bytes = _round_up((CHANNELS * FLAG_KINDS * world_size + 1) * 8, REGION_ALIGN)  # + the abort word
        slabs = []
        offset = flags_bytes
        for size in (slab_rows * words * 4, slab_rows * topk * 4, slab_rows * row_bytes, slab_rows * row_bytes):
            slabs.append(offset)
            offset = _round_up(offset + size, REGION_ALIGN)
        copy_bytes = offset - flags_bytes
        stage_x_offset = flags_bytes + slab_copies * copy_bytes
        stage_bytes = slab_rows * row_bytes if put_transport else 0
        return cls(world_size, max_tokens_per_rank, topk, row_bytes, words, slab_copies, 0, *slabs,
                   copy_stride=copy_bytes if slab_copies == 2 else 0, stage_x_offset=stage_x_offset,
                   nbytes=_round_up(stage_x_offset + stage_bytes, REGION_ALIGN))
