"""The expert call every transformers adapter shares: checks, dispatch -> local experts -> combine,
and the projection of expert-major rows through their experts' weights.

:mod:`.transformers` (the ``"moe_comm"`` experts implementation) and :mod:`.transformers_blocks`
(whole MoE blocks) both build on it, so neither imports the other for it.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import nn

from ..dispatcher import Dispatcher
from ..errors import InputError
from ..nn.experts import check_padding_for_gradients
from ..nn.receive_layout import combine_rows, expert_rows

__all__ = ["segmented_linear", "check_experts_call", "dispatched"]


def segmented_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], transposed: bool,
                     expert_offsets: torch.Tensor, expert_of_row: torch.Tensor, grouped: bool) -> torch.Tensor:
    """Row ``r`` of ``x [N, in]`` through local expert ``expert_of_row[r]``'s projection: ``[N, out]``.

    ``weight`` is ``[E_local, in, out]`` when ``transposed``, else ``[E_local, out, in]``; ``bias``
    ``[E_local, out]`` or None. Rows past the last segment come out zero (their gradient too).
    ``grouped``: one ``torch._grouped_mm`` (offsets read on the device); otherwise every expert runs
    over all rows and keeps its own (static shapes, any device and dtype).
    """
    local = weight.shape[0]
    if grouped:
        out = torch._grouped_mm(x, weight if transposed else weight.transpose(1, 2), offs=expert_offsets)
        if bias is not None:
            out = out + bias[expert_of_row[:, 0].clamp(max=local - 1)]
    else:
        out = None
        for j in range(local):
            expert_out = x @ (weight[j] if transposed else weight[j].transpose(0, 1))
            if bias is not None:
                expert_out = expert_out + bias[j]
            out = expert_out if out is None else torch.where(expert_of_row == j, expert_out, out)
    return torch.where(expert_of_row < local, out, torch.zeros_like(out))


def check_experts_call(module: nn.Module, dispatcher: Dispatcher, hidden_states: torch.Tensor) -> None:
    """Refuse a call whose dtype the dispatcher was not built for, or gradients through unzeroed padding.

    Raises:
        InputError: ``hidden_states`` is not in the dtype the model was made expert-parallel for.
        ConfigError: ``zero_padding`` is off and ``module``'s parameters require grad.
    """
    if hidden_states.dtype != dispatcher.config.torch_dtype:
        raise InputError(f"{type(module).__name__} hidden_states: the model runs in {hidden_states.dtype} but was "
                         f"made expert-parallel for {dispatcher.config.dtype}: convert it before expert_parallel, or "
                         f"pass expert_parallel(..., dtype=...) with the dtype it will run in")
    check_padding_for_gradients(dispatcher.config, module.parameters(), f"{type(module).__name__} (moe_comm experts)")


def dispatched(module: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
               top_k_weights: torch.Tensor, local_experts: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
               first_slice: int = 0) -> torch.Tensor:
    """``hidden_states [T, H]`` -> dispatch -> ``local_experts(rows [N, H], offsets [E_local])`` -> combine -> ``[T, H]``.

    In either receive layout ``local_experts`` gets expert-major rows (token-major: permuted from dispatch's,
    its outputs unpermuted for combine: :mod:`moe_comm.nn.receive_layout`).

    ``module``: the module made expert-parallel (its ``_moe_comm_dispatcher`` and ``_moe_comm_call_site``).
    ``top_k_index`` ``[T, K]`` global expert ids, ``top_k_weights`` ``[T, K]`` (any float dtype: the
    combine weights). ``local_experts`` returns ``[N, H]`` (rows past the last segment zero).
    More than ``max_tokens_per_rank`` tokens go in batch slices of that many (one dispatch/combine
    pair each), as many on every rank (:meth:`moe_comm.Dispatcher.split_batch`); slice ``i`` carries
    the call tag of the module's call site and ``first_slice + i`` (a block that dispatches several
    times per forward numbers them apart).
    """
    dispatcher: Dispatcher = module._moe_comm_dispatcher
    pieces = []
    for i, (tokens, topk_idx, topk_weights) in enumerate(
            dispatcher.split_batch(hidden_states, top_k_index, top_k_weights)):
        out = dispatcher.dispatch(tokens.contiguous(), topk_idx.contiguous(), topk_weights.float().contiguous(),
                                  call_tag=dispatcher.call_tag(module._moe_comm_call_site, first_slice + i))
        rows = expert_rows(dispatcher, out)
        # FP8 dispatch (dispatch_dtype): the experts run on the dequantized rows (differentiable straight through).
        y = local_experts(dispatcher.dequantize(rows), rows.expert_offsets)
        pieces.append(dispatcher.combine(combine_rows(dispatcher, y.contiguous(), out), out.handle))
    combined = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
    return combined.to(hidden_states.dtype)
