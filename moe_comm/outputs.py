"""What dispatch returns: the handle combine takes, and the rows of each receive layout (``Config.receive_layout``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .errors import InputError
from .routing import Routing

__all__ = ["DispatchHandle", "DispatchOutput", "TokenMajorOutput"]


@dataclass(frozen=True)
class DispatchHandle:
    """What ``combine`` needs from its ``dispatch``: the routing, and the weights for autograd.

    A handle holds its own routing tensors (nothing of it lives in the dispatcher's buffers), so a
    handle from an older step stays valid after later dispatch calls: a backward pass combines
    several steps back, and two micro-batches may be dispatched before either is combined. Every
    rank must combine the same step's handle (combine is collective, like dispatch).
    """

    dispatcher_id: int
    routing: Routing
    topk_weights: torch.Tensor


@dataclass(frozen=True)
class DispatchOutput:
    """The result of :meth:`Dispatcher.dispatch` (tensors on the dispatcher's device).

    x: ``[capacity_rows, H]`` rows grouped by local expert; expert ``j`` owns rows
        ``[expert_offsets[j-1], expert_offsets[j])`` (from 0 for ``j = 0``): its
        ``tokens_per_expert[j]`` received rows first (by source rank, then token), then padding
        rows up to the alignment: zeros, or with the config's ``zero_padding`` off unwritten
        (stale bytes, possibly NaN). Rows at or past ``expert_offsets[-1]`` are unspecified.
    expert_offsets: ``[L]`` int32 cumulative end offsets (the ``offs`` of ``torch._grouped_mm``).
    tokens_per_expert: ``[L]`` int32 valid rows per local expert.
    handle: pass to :meth:`Dispatcher.combine`.
    x_scales: with the config's ``dispatch_dtype`` (``x`` is then e4m3): ``[capacity_rows, H / 128]``
        float32, one scale per 128 channels of each row of ``x`` (:mod:`moe_comm.fp8`; on the
        padding rows zeros, or as ``x``'s without ``zero_padding``); ``x`` and ``x_scales`` are
        views of one allocation of packed rows, so neither is contiguous (row stride
        ``moe_comm.fp8.packed_row_bytes(H)`` bytes). None otherwise.
    quantized_from: with FP8 dispatch of a config-dtype ``x`` that requires grad, that ``x``:
        :meth:`Dispatcher.dequantize` makes the rows differentiable with respect to it (``x`` e4m3
        itself carries no gradient). None otherwise.
    """

    x: torch.Tensor
    expert_offsets: torch.Tensor
    tokens_per_expert: torch.Tensor
    handle: DispatchHandle
    x_scales: Optional[torch.Tensor] = None
    quantized_from: Optional[torch.Tensor] = None


@dataclass(frozen=True)
class TokenMajorOutput:
    """The result of :meth:`Dispatcher.dispatch` with the config's ``receive_layout`` ``token_major``
    (tensors on the dispatcher's device; ``W`` ranks, ``M = max_tokens_per_rank``, ``L`` local experts).

    x: ``[W * M, H]`` each arrived token once, rank-major: row ``s * M + t`` holds token ``t`` of rank ``s``
        wherever ``topk_idx`` of that row has an entry ``>= 0`` (rows with none are unspecified; a rank's
        own tokens are there too). With the config's ``dispatch_dtype``: e4m3, and ``x_scales``
        ``[W * M, H / 128]`` float32, both views of ``rows`` (as :class:`DispatchOutput`'s).
    topk_idx: ``[W * M, K]`` int32, the local expert (``[0, L)``) of each entry kept on this rank, -1 for the
        others (experts of other ranks, no expert, dropped over ``expert_capacity``). Computed on access from
        the routing (two small kernels), so a step that only permutes does not run them.
    topk_weights: ``[W * M, K]`` float32, the router weight of each entry (meaningful where ``topk_idx >= 0``);
        differentiable with respect to dispatch's ``topk_weights`` (:meth:`Dispatcher.unpermute` applies them).
    permuted_offsets, tokens_per_expert: ``[L]`` int32, the segments :meth:`Dispatcher.permute` lays out (its
        output's ``expert_offsets``; named apart so that experts written for a :class:`DispatchOutput`,
        which read ``out.x`` with ``out.expert_offsets``, raise on this one instead of reading token rows
        as expert segments: permute first).
    handle: pass to :meth:`Dispatcher.combine` with :meth:`Dispatcher.unpermute`'s rows.
    rows: the rows as the kernels hold them: ``x`` itself, or with FP8 the packed rows ``[W * M,
        moe_comm.fp8.packed_row_bytes(H)]`` uint8.
    x_scales, quantized_from: as :class:`DispatchOutput`'s.
    """

    x: torch.Tensor
    topk_weights: torch.Tensor
    permuted_offsets: torch.Tensor
    tokens_per_expert: torch.Tensor
    handle: DispatchHandle
    rows: torch.Tensor
    x_scales: Optional[torch.Tensor] = None
    quantized_from: Optional[torch.Tensor] = None

    @property
    def topk_idx(self) -> torch.Tensor:
        positions = self.handle.routing.recv_pos
        positions = positions.reshape(-1, positions.shape[-1])
        experts = torch.searchsorted(self.permuted_offsets, positions, right=True).to(torch.int32)
        return torch.where(positions >= 0, experts, torch.full_like(experts, -1))

    @property
    def expert_offsets(self) -> torch.Tensor:
        raise InputError(
            "expert_offsets: a token-major dispatch output holds each arrived token once (x [W * M, H]), not rows "
            "grouped by expert; call Dispatcher.permute(out) for the expert-major rows and their expert_offsets "
            "(the config's receive_layout is token_major)"
        )

