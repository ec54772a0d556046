"""Routing math shared by every backend: who sends what where, and where each row lands.

Everything here is written with device-agnostic torch ops on static shapes and never
reads a device value on the host, so the same code runs on CPU (the ``reference``
backend), on GPU outside a graph, and under CUDA-graph capture. The GPU kernels in
``csrc`` implement exactly these definitions; the tests compare them bitwise.

Notation: ``W`` world size, ``R`` this rank, ``E`` global experts, ``L = E // W`` local
experts, ``K`` top-k, ``T`` tokens of this call, ``M = max_tokens_per_rank``, ``H`` hidden.

Definitions (the contract the kernels follow):

* An assignment ``(t, k)`` with ``e = topk_idx[t, k]`` is *valid* if ``0 <= e < E``; ``-1``
  means "no expert"; any other value is *invalid*: it is dropped and counted in the status
  word (with the first offending ``(rank, token)``). Its destination is ``r = e // L`` and its
  local expert there is ``j = e % L``.
* Token ``t`` is *sent* to rank ``r`` when at least one of its valid assignments lives there;
  it is sent once however many of its experts ``r`` holds. It lands in row ``t`` of the
  slab that source ``R`` owns in ``r``'s receive buffer ``[W, M, ...]``; rows of a slab that
  carry no token hold local expert ``-1`` everywhere.
* On the destination, the *entries* ``(s, t, k)`` (source, token, column) whose local expert
  ``j >= 0`` are ranked per expert in lexicographic ``(s, t, k)`` order. With a capacity
  ``C`` the entries of rank ``>= C`` are dropped (and counted; their row reads -2, an empty
  entry's -1). Expert ``j`` keeps
  ``n_j`` rows; its segment is ``n_j`` rounded up to ``expert_alignment``; ``expert_offsets``
  are the cumulative segment ends; an entry's row is ``segment start + rank``; padding rows
  of a segment are zero (with the config's ``zero_padding``, the default; without it no
  backend writes zeros there: see ``Config.zero_padding``).
* Combine, on the destination: for every slab row ``(s, t)`` that carries a token,
  ``partial = dtype(sum over kept k, k increasing, of w_k * y[row_k])`` accumulated in
  float32 from ``0.0`` with a separate multiply and add (no fused multiply-add), and zero
  when every entry was dropped. On the source: ``z[t] = dtype(sum over r increasing, for
  every r that t was sent to, of float32(partial_r[t]))``, again from ``0.0``; a token sent
  nowhere gets zeros. The fixed order makes results bitwise reproducible.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .protocol import (
    NO_OFFENDER,
    STATUS_FIRST_DROPPED,
    STATUS_FIRST_DROPPED_CALL,
    STATUS_FIRST_INVALID,
    STATUS_FIRST_INVALID_CALL,
    STATUS_NUM_DROPPED,
    STATUS_NUM_INVALID,
)

__all__ = [
    "Routing",
    "plan_source",
    "gather_send_rows",
    "plan_destination",
    "expand_rows",
    "reduce_partials",
    "sum_returned",
    "scatter_entry_values",
    "gather_entry_values",
    "row_values",
]

@dataclass
class Routing:
    """The routing of one dispatch call, kept by its handle for combine and backward.

    Attributes:
        num_tokens: T, the rows of the ``x`` that was dispatched.
        send_mask: ``[T, W]`` bool, source side: token ``t`` was sent to rank ``r``.
        dest_rank: ``[T, K]`` int32, source side: rank of assignment ``(t, k)``, -1 if none/invalid.
        recv_pos: ``[W, M, K]`` int32, destination side: row of ``out.x`` holding entry
            ``(s, t, k)``; -1 if the entry is empty, -2 if it was dropped (over capacity). A
            slab row ``(s, t)`` carries a token exactly when one of its entries is not -1.
        recv_weight: ``[W, M, K]`` float32, destination side: the router weight of entry
            ``(s, t, k)`` (meaningful where ``recv_pos >= 0``).
    All tensors live on the dispatcher's device. An eager dispatch of the device backends returns
    a ``moe_comm.backends.device.PackedRouting`` instead: the same attributes, in one allocation.
    """

    num_tokens: int
    send_mask: torch.Tensor
    dest_rank: torch.Tensor
    recv_pos: torch.Tensor
    recv_weight: torch.Tensor


def _record(status: torch.Tensor, count_field: int, first_field: int, call_field: int, mask: torch.Tensor,
            keys: torch.Tensor, call: torch.Tensor) -> None:
    """Add ``mask.sum()`` offenders of ``call`` (int64 ``[1]``) to ``status[count_field]``.

    ``status[call_field]`` keeps the earliest offending call and ``status[first_field]`` the
    smallest masked key of that call (as ``status_add_offenders`` in ``csrc/common.cuh``).
    """
    status[count_field : count_field + 1].add_(mask.sum().reshape(1))
    # The extra NO_OFFENDER element keeps the reduction defined when there are no entries (T = 0).
    candidates = torch.where(mask, keys, torch.full_like(keys, NO_OFFENDER)).reshape(-1)
    smallest = torch.cat([candidates, candidates.new_full((1,), NO_OFFENDER)]).min().reshape(1)
    first, earliest = status[first_field : first_field + 1], status[call_field : call_field + 1]
    offended = smallest != NO_OFFENDER
    first.copy_(torch.where(offended & (earliest >= call), torch.minimum(first, smallest), first))
    earliest.copy_(torch.where(offended, torch.minimum(earliest, call), earliest))


def plan_source(
    topk_idx: torch.Tensor, num_experts: int, world_size: int, rank: int, status: torch.Tensor, call: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Source-side routing of one call.

    Args:
        topk_idx: ``[T, K]`` int32/int64 global expert ids, -1 for none.
        num_experts: E. world_size: W. rank: this rank (for the status word).
        status: the device status word; invalid ids are counted into it. call: int64 ``[1]``, this
            call's number (``STATUS_FIRST_INVALID_CALL``).

    Returns:
        ``send_mask`` ``[T, W]`` bool, ``dest_rank`` ``[T, K]`` int32 (-1 if none/invalid) and
        ``slab_expert`` ``[W, T, K]`` int32: for each destination, the local expert of each
        assignment that lives there, -1 elsewhere.
    """
    num_tokens, topk = topk_idx.shape
    local = num_experts // world_size
    idx = topk_idx.to(torch.int64)
    valid = (idx >= 0) & (idx < num_experts)
    invalid = (idx != -1) & ~valid
    token_keys = (rank << 32) + torch.arange(num_tokens, device=idx.device, dtype=torch.int64)
    _record(status, STATUS_NUM_INVALID, STATUS_FIRST_INVALID, STATUS_FIRST_INVALID_CALL, invalid,
            token_keys[:, None].expand(num_tokens, topk), call)
    dest = torch.where(valid, idx // local, torch.full_like(idx, -1))
    ranks = torch.arange(world_size, device=idx.device, dtype=torch.int64)
    here = dest[None, :, :] == ranks[:, None, None]  # [W, T, K]
    slab_expert = torch.where(here, (idx % local)[None], torch.full_like(here, -1, dtype=torch.int64))
    send_mask = here.any(dim=2).transpose(0, 1).contiguous()
    return send_mask, dest.to(torch.int32), slab_expert.to(torch.int32)


def gather_send_rows(rows: torch.Tensor, send_mask: torch.Tensor, max_tokens_per_rank: int) -> torch.Tensor:
    """Source side: the ``[W, M, ...]`` slabs to send, row ``t`` of slab ``r`` = ``rows[t]`` if sent there, else zero.

    Args:
        rows: ``[T, ...]`` per-token rows (token data or metadata). send_mask: ``[T, W]`` bool.
        max_tokens_per_rank: M, the slab height.
    """
    num_tokens = rows.shape[0]
    world_size = send_mask.shape[1]
    slabs = rows.new_zeros((world_size, max_tokens_per_rank) + tuple(rows.shape[1:]))
    mask = send_mask.transpose(0, 1).reshape((world_size, num_tokens) + (1,) * (rows.dim() - 1))
    slabs[:, :num_tokens] = torch.where(mask, rows[None], torch.zeros_like(rows[None]))
    return slabs


@dataclass
class DestinationPlan:
    """Destination-side layout of one call (all on the device).

    recv_pos: ``[W, M, K]`` int32 row of each entry in ``out.x``, -1 if empty, -2 if dropped.
    expert_offsets: ``[L]`` int32 cumulative end offsets of the aligned expert segments.
    tokens_per_expert: ``[L]`` int32 kept rows at the start of each segment.
    """

    recv_pos: torch.Tensor
    expert_offsets: torch.Tensor
    tokens_per_expert: torch.Tensor


def plan_destination(
    recv_expert: torch.Tensor,
    num_local_experts: int,
    expert_alignment: int,
    expert_capacity: Optional[int],
    status: torch.Tensor,
    call: torch.Tensor,
) -> DestinationPlan:
    """Rank the received entries per local expert and place them in the expert-major layout.

    Args:
        recv_expert: ``[W, M, K]`` int32 local expert of each received entry, -1 if none.
        num_local_experts: L. expert_alignment: segment alignment in rows.
        expert_capacity: rows kept per expert, None for all.
        status: the device status word; dropped entries are counted into it. call: int64 ``[1]``,
            this call's number (``STATUS_FIRST_DROPPED_CALL``).
    """
    world_size, max_tokens_per_rank, topk = recv_expert.shape
    device = recv_expert.device
    key = recv_expert.reshape(-1).to(torch.int64)
    key = torch.where(key >= 0, key, torch.full_like(key, num_local_experts))
    sorted_key, order = torch.sort(key, stable=True)
    counts = torch.zeros(num_local_experts + 1, dtype=torch.int64, device=device)
    counts.scatter_add_(0, key, torch.ones_like(key))
    first_of_key = torch.cumsum(counts, 0) - counts
    rank_in_expert = torch.empty_like(key)
    rank_in_expert[order] = torch.arange(key.numel(), device=device) - first_of_key[sorted_key]
    valid = key < num_local_experts
    kept = valid if expert_capacity is None else valid & (rank_in_expert < expert_capacity)
    entry = torch.arange(key.numel(), device=device)
    source_keys = ((entry // (max_tokens_per_rank * topk)) << 32) + (entry // topk) % max_tokens_per_rank
    _record(status, STATUS_NUM_DROPPED, STATUS_FIRST_DROPPED, STATUS_FIRST_DROPPED_CALL, valid & ~kept, source_keys,
            call)
    kept_counts = counts[:num_local_experts]
    if expert_capacity is not None:
        kept_counts = kept_counts.clamp(max=expert_capacity)
    segments = (kept_counts + expert_alignment - 1) // expert_alignment * expert_alignment
    ends = torch.cumsum(segments, 0)
    expert_of_entry = key.clamp(max=num_local_experts - 1)
    starts = ends[expert_of_entry] - segments[expert_of_entry]
    pos = torch.where(kept, starts + rank_in_expert, torch.where(valid, -2, -1))
    return DestinationPlan(
        recv_pos=pos.to(torch.int32).reshape(world_size, max_tokens_per_rank, topk),
        expert_offsets=ends.to(torch.int32),
        tokens_per_expert=kept_counts.to(torch.int32),
    )


def expand_rows(recv_rows: torch.Tensor, recv_pos: torch.Tensor, capacity_rows: int,
                zero_padding: bool) -> torch.Tensor:
    """Destination side: copy each received row to the rows of its kept entries.

    Args:
        recv_rows: ``[W, M, H]`` received token rows. recv_pos: ``[W, M, K]`` int32 (negative: no row).
        capacity_rows: rows of the result. zero_padding: the config's (what the other rows hold).

    Returns:
        ``[capacity_rows, H]`` in ``recv_rows``' dtype; rows no entry maps to (the alignment
        padding among them) are zero, or without ``zero_padding`` all 0xFF bytes: NaN in every
        row format (float rows, and packed FP8 rows' e4m3 bytes and float32 scales), so that a
        consumer that reads rows the config leaves unspecified shows.
    """
    hidden = recv_rows.shape[-1]
    # One extra trash row absorbs the empty entries so the scatter keeps a static shape.
    out = recv_rows.new_empty(capacity_rows + 1, hidden)
    out.view(torch.uint8).fill_(0 if zero_padding else 0xFF)
    target = recv_pos.masked_fill(recv_pos < 0, capacity_rows).to(torch.int64)
    rows = recv_rows.reshape(-1, hidden)
    # One k at a time: a single scatter needed the rows repeated K times ([W * M * K, H], 3.75 GB at
    # 8 ranks, M = 4096, H = 7168 bf16 on nccl-collective's GPUs) and took 1.7-3x the time on a CPU.
    for k in range(recv_pos.shape[-1]):
        out.index_copy_(0, target[:, :, k].reshape(-1), rows)
    return out[:capacity_rows]


def reduce_partials(y: torch.Tensor, recv_pos: torch.Tensor, recv_weight: Optional[torch.Tensor]) -> torch.Tensor:
    """Destination side: one partial row per slab row, the (weighted) sum of its kept entries' rows.

    Args:
        y: ``[capacity_rows, H]`` expert outputs in the expert-major layout.
        recv_pos: ``[W, M, K]`` int32. recv_weight: ``[W, M, K]`` float32, or None for weight 1.

    Returns:
        ``[W, M, H]`` in ``y``'s dtype: float32 sums over ``k`` in increasing order, multiply
        and add rounded separately, rounded to ``y.dtype`` at the end; zero where no entry is kept.
    """
    shape = recv_pos.shape[:2] + (y.shape[-1],)
    absent = recv_pos < 0
    index = recv_pos.masked_fill(absent, 0).to(torch.int64)  # an empty entry reads row 0, then adds 0
    acc = torch.zeros(shape, dtype=torch.float32, device=y.device)
    term = torch.empty_like(acc)
    # One k at a time, in place: gathering every entry's row at once took K times the memory (a
    # [W, M, K, H] float32 buffer: 7.5 GB at 8 ranks, M = 4096, H = 7168 on nccl-collective's GPUs)
    # and 2-4x the time on a CPU. An empty entry adds an exact zero, which leaves the sum as it was
    # bit for bit: it starts at +0 and, rounding to nearest, never becomes -0.
    for k in range(recv_pos.shape[-1]):
        term.copy_(y.index_select(0, index[:, :, k].reshape(-1)).view(shape))
        if recv_weight is not None:
            term.mul_(recv_weight[:, :, k, None])
        term.masked_fill_(absent[:, :, k, None], 0.0)
        acc.add_(term)
    return acc.to(y.dtype)


def sum_returned(returned: torch.Tensor, send_mask: torch.Tensor) -> torch.Tensor:
    """Source side: ``z[t]`` = the sum, over ranks in increasing order, of the partials returned for ``t``.

    Args:
        returned: ``[W, M, H]`` partial rows, slab ``r`` written by rank ``r``.
        send_mask: ``[T, W]`` bool: which ranks token ``t`` was sent to.

    Returns:
        ``[T, H]`` in ``returned``'s dtype, float32 accumulation from 0.
    """
    num_tokens = send_mask.shape[0]
    acc = torch.zeros((num_tokens, returned.shape[-1]), dtype=torch.float32, device=returned.device)
    for r in range(returned.shape[0]):
        acc = torch.where(send_mask[:, r, None], acc + returned[r, :num_tokens].float(), acc)
    return acc.to(returned.dtype)


def row_values(recv_pos: torch.Tensor, entry_values: torch.Tensor, capacity_rows: int) -> torch.Tensor:
    """Destination side: a per-row vector of ``out.x`` from per-entry values (e.g. router weights).

    Args:
        recv_pos: ``[W, M, K]`` int32. entry_values: ``[W, M, K]`` float32.

    Returns:
        ``[capacity_rows]`` float32; rows no entry maps to hold 0.
    """
    out = entry_values.new_zeros(capacity_rows + 1)
    target = torch.where(recv_pos >= 0, recv_pos, torch.full_like(recv_pos, capacity_rows)).reshape(-1).to(torch.int64)
    out.index_copy_(0, target, torch.where(recv_pos >= 0, entry_values, torch.zeros_like(entry_values)).reshape(-1))
    return out[:capacity_rows]


def scatter_entry_values(row_vector: torch.Tensor, recv_pos: torch.Tensor) -> torch.Tensor:
    """Destination side: per-entry values ``[W, M, K]`` float32 read from a per-row vector ``[capacity_rows]``; 0 where empty."""
    present = recv_pos >= 0
    index = torch.where(present, recv_pos, torch.zeros_like(recv_pos)).to(torch.int64)
    return torch.where(present, row_vector[index], torch.zeros_like(row_vector[index]))


def gather_entry_values(returned: torch.Tensor, dest_rank: torch.Tensor) -> torch.Tensor:
    """Source side: value of assignment ``(t, k)`` from the slab its destination returned.

    Args:
        returned: ``[W, M, K]`` float32, slab ``r`` written by rank ``r``.
        dest_rank: ``[T, K]`` int32, -1 where the assignment went nowhere.

    Returns:
        ``[T, K]`` float32, 0 where ``dest_rank`` is -1.
    """
    num_tokens, topk = dest_rank.shape
    rank_index = dest_rank.clamp(min=0).to(torch.int64)
    token_index = torch.arange(num_tokens, device=returned.device)[:, None].expand(num_tokens, topk)
    column_index = torch.arange(topk, device=returned.device)[None, :].expand(num_tokens, topk)
    picked = returned[rank_index, token_index, column_index]
    return torch.where(dest_rank >= 0, picked, torch.zeros_like(picked))
