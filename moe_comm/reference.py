"""Single-process references that every backend and the layer are compared with.

``dense_moe`` computes ``z[t] = sum_k w[t, k] * expert(e[t, k], x[t])`` directly, with no
communication; the multi-rank tests and ``moe-comm run`` check dispatch -> experts ->
combine against it. :func:`build_dense_weights` rebuilds the weights of every rank's
:class:`~moe_comm.layer.MoELayer` in one process (they are drawn from the seed, each expert from
its global id) and :func:`dense_forward` computes the whole layer with them.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from .config import Config
from .errors import InputError
from .experts import swiglu
from .layer import MoEWeights, check_layer_args, init_expert_weights, init_router_weight, route

__all__ = ["dense_moe", "drop_over_capacity", "build_dense_weights", "dense_forward"]


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


def build_dense_weights(
    config: Config,
    ffn_hidden: int,
    seed: int = 0,
    *,
    dtype: Optional[torch.dtype] = None,
    device: torch.device | str = "cpu",
) -> MoEWeights:
    """The weights of every expert exactly as the ``MoELayer`` of each rank initialises them.

    Args:
        config, ffn_hidden, seed: as given to :class:`~moe_comm.layer.MoELayer`.
        dtype: dtype of the expert weights returned. Their values are always the config dtype's
            (what the layer holds); ``torch.float32`` returns those values widened, for a reference
            computed without further rounding. Default: the config dtype.
        device: where the tensors are put.

    Returns:
        :class:`MoEWeights`; tensors that do not require grad (call ``requires_grad_`` for a reference).
    """
    check_layer_args(config, ffn_hidden, seed)
    dtype = config.torch_dtype if dtype is None else dtype
    experts = [init_expert_weights(config, ffn_hidden, e, seed) for e in range(config.num_experts)]
    return MoEWeights(
        router=init_router_weight(config, seed).to(device),
        w_gate_up=torch.stack([gu for gu, _ in experts]).to(device=device, dtype=dtype),
        w_down=torch.stack([d for _, d in experts]).to(device=device, dtype=dtype),
    )


def dense_forward(
    x: torch.Tensor,
    weights: MoEWeights,
    *,
    topk: int,
    renormalize: bool = True,
    topk_idx: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """The whole layer in one process, no communication: the reference for :class:`~moe_comm.layer.MoELayer`.

    Args:
        x: ``[..., H]`` tokens on ``weights``' device; computed in the dtype of ``weights.w_gate_up``.
        weights: from :func:`build_dense_weights` (make them require grad to get reference gradients).
        topk, renormalize: as the layer's.
        topk_idx: ``[T, K]`` expert ids (``T`` = tokens of ``x``) to use instead of the router's
            top-k choice, e.g. the layer's ``last_topk_idx``; every id must be in ``[0, E)``.

    Returns:
        ``[..., H]`` in the compute dtype, differentiable w.r.t. ``x`` and every weight.
    """
    num_experts, hidden = weights.router.shape
    x2d = x.reshape(-1, hidden)
    if topk_idx is not None:
        if topk_idx.shape != (x2d.shape[0], topk):
            raise InputError(f"dense_forward topk_idx: expected shape {(x2d.shape[0], topk)}, got {tuple(topk_idx.shape)}")
        if topk_idx.numel() and not (0 <= int(topk_idx.min()) and int(topk_idx.max()) < num_experts):
            raise InputError(f"dense_forward topk_idx: expected ids in [0, {num_experts}), got some outside")
    idx, topk_weights = route(x2d, weights.router, topk, renormalize, topk_idx)
    compute = x2d.to(weights.w_gate_up.dtype)
    # unbind once: indexing the stacked weights per expert would make backward build a
    # full-size gradient for every expert (E times the weights' memory traffic).
    gate_ups, downs = weights.w_gate_up.unbind(0), weights.w_down.unbind(0)
    z = dense_moe(compute, idx, topk_weights, lambda e, rows: swiglu(rows, gate_ups[e], downs[e]), num_experts)
    return z.reshape(x.shape)
