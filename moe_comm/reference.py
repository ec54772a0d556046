"""Single-process references that every backend is compared with.

``dense_moe`` computes ``z[t] = sum_k w[t, k] * expert(e[t, k], x[t])`` directly, with no
communication; the multi-rank tests and ``moe-comm run`` check dispatch -> experts ->
combine against it.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

__all__ = ["dense_moe", "drop_over_capacity"]


def dense_moe(
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_weights: torch.Tensor,
    expert_fn: Callable[[int, torch.Tensor], torch.Tensor],
    num_experts: int,
) -> torch.Tensor:
    """The MoE output computed densely in one process.

    Args:
        x: ``[T, H]`` tokens (any float dtype; compute happens in ``x.dtype``).
        topk_idx: ``[T, K]`` expert ids; entries outside ``[0, num_experts)`` (e.g. -1) contribute nothing.
        topk_weights: ``[T, K]`` router weights.
        expert_fn: ``expert_fn(e, rows [N, H]) -> [N, H]``, the expert ``e`` applied to rows.
        num_experts: E.

    Returns:
        ``[T, H]`` in ``x.dtype``: ``sum_k w[t, k] * expert_fn(e, x[t])``, zeros for a token with no valid expert.
    """
    out = torch.zeros_like(x)
    valid = (topk_idx >= 0) & (topk_idx < num_experts)
    for e in range(num_experts):
        tokens, cols = torch.nonzero(valid & (topk_idx == e), as_tuple=True)
        if tokens.numel() == 0:
            continue
        weights = topk_weights[tokens, cols].to(x.dtype)[:, None]
        out = out.index_add(0, tokens, weights * expert_fn(e, x[tokens]))
    return out


def drop_over_capacity(
    topk_idx_per_rank: list[torch.Tensor], num_experts: int, capacity: Optional[int]
) -> list[torch.Tensor]:
    """The routing with the assignments an ``expert_capacity`` drops replaced by -1.

    Entries of one expert are kept in (source rank, token, column) order up to ``capacity``,
    exactly as ``moe_comm.routing`` defines. Invalid ids are left as they are.

    Args:
        topk_idx_per_rank: every rank's ``[T_r, K]`` expert ids, in rank order.
        num_experts: E. capacity: rows kept per expert (per call), None for all.

    Returns:
        The same list with dropped assignments set to -1 (new tensors).
    """
    result = [idx.clone() for idx in topk_idx_per_rank]
    if capacity is None:
        return result
    seen = torch.zeros(num_experts, dtype=torch.int64)
    for idx in result:
        flat = idx.reshape(-1)
        for i in range(flat.numel()):
            e = int(flat[i])
            if 0 <= e < num_experts:
                if seen[e] >= capacity:
                    flat[i] = -1
                seen[e] += 1
    return result
