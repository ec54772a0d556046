"""Single-process references that every backend and the layer are compared with.

``dense_moe`` computes ``z[t] = sum_k w[t, k] * expert(e[t, k], x[t])`` directly, with no
communication; the multi-rank tests and ``moe-comm run`` check dispatch -> experts ->
combine against it. :func:`build_dense_weights` rebuilds the weights of every rank's
:class:`~moe_comm.nn.layer.MoELayer` in one process (they are drawn from the seed, each expert from
its global id) and :func:`dense_forward` computes the whole layer with them. :func:`dense_route`
and :func:`dense_balancing_losses` are the router and its balancing losses written out from their
definitions (per token, per expert, per sequence), apart from :mod:`moe_comm.nn.router` and
:mod:`moe_comm.nn.balancing`, so that the layer's fixed-shape versions are checked against them.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from ..config import Config, RouterConfig
from ..errors import InputError
from .experts import swiglu
from .layer import MoEWeights, check_layer_args, init_expert_weights, init_router_weight, init_shared_weights

__all__ = ["dense_moe", "drop_over_capacity", "build_dense_weights", "dense_route", "dense_balancing_losses",
           "dense_forward"]


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
    shared_ffn_hidden: Optional[int] = None,
) -> MoEWeights:
    """The weights of every expert exactly as the ``MoELayer`` of each rank initialises them.

    Args:
        config, ffn_hidden, seed, shared_ffn_hidden: as given to :class:`~moe_comm.nn.layer.MoELayer`.
        dtype: dtype of the expert weights returned. Their values are always the config dtype's
            (what the layer holds); ``torch.float32`` returns those values widened, for a reference
            computed without further rounding. Default: the config dtype.
        device: where the tensors are put.

    Returns:
        :class:`MoEWeights`; tensors that do not require grad (call ``requires_grad_`` for a reference).
    """
    check_layer_args(config, ffn_hidden, seed, shared_ffn_hidden)
    dtype = config.torch_dtype if dtype is None else dtype
    experts = [init_expert_weights(config, ffn_hidden, e, seed) for e in range(config.num_experts)]
    shared = (None, None) if shared_ffn_hidden is None else init_shared_weights(config, shared_ffn_hidden, seed)
    return MoEWeights(
        router=init_router_weight(config, seed).to(device),
        w_gate_up=torch.stack([gu for gu, _ in experts]).to(device=device, dtype=dtype),
        w_down=torch.stack([d for _, d in experts]).to(device=device, dtype=dtype),
        shared_w_gate_up=None if shared[0] is None else shared[0].to(device=device, dtype=dtype),
        shared_w_down=None if shared[1] is None else shared[1].to(device=device, dtype=dtype),
    )


def _scores(logits: torch.Tensor, router: RouterConfig) -> torch.Tensor:
    if router.score == "softmax":
        return logits.exp() / logits.exp().sum(dim=-1, keepdim=True)
    return 1.0 / (1.0 + (-logits).exp())


def _choose(choice: list[float], topk: int, router: RouterConfig) -> list[int]:
    """One token's experts from its ``[E]`` choice scores (a list), best first, by sorting."""
    experts = len(choice)
    size = experts // router.n_group
    allowed = range(experts)
    if router.n_group > 1:
        group_score = [sum(sorted(choice[g * size:(g + 1) * size], reverse=True)[:2]) for g in range(router.n_group)]
        groups = sorted(range(router.n_group), key=lambda g: -group_score[g])[:router.topk_group]
        allowed = [e for g in groups for e in range(g * size, (g + 1) * size)]
    return sorted(allowed, key=lambda e: -choice[e])[:topk]


def dense_route(
    x: torch.Tensor,
    router_weight: torch.Tensor,
    topk: int,
    router: RouterConfig,
    *,
    renormalize: Optional[bool] = None,
    expert_bias: Optional[torch.Tensor] = None,
    topk_idx: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The router from its definition, token by token (see :mod:`moe_comm.nn.router` for the steps).

    Args:
        x: ``[T, H]``. router_weight: ``[E, H]`` float32. topk: K. router: the settings.
        renormalize: None uses ``router.renormalize``. expert_bias: ``[E]`` float32 or None.
        topk_idx: ``[T, K]`` ids to use instead of choosing.

    Returns:
        ``topk_idx [T, K]`` int64 (each row best first) and ``topk_weights [T, K]`` float32,
        differentiable w.r.t. ``x`` and ``router_weight``.
    """
    renormalize = router.renormalize if renormalize is None else renormalize
    logits = x.float() @ router_weight.T
    scores = _scores(logits, router)
    if topk_idx is None:
        choice = scores.detach() if expert_bias is None else scores.detach() + expert_bias
        topk_idx = torch.tensor([_choose(row, topk, router) for row in choice.tolist()],
                                dtype=torch.int64, device=x.device).reshape(-1, topk)
    rows = []
    for t in range(logits.shape[0]):
        chosen = topk_idx[t].to(torch.int64)
        if router.softmax_after_topk:
            weights = logits[t, chosen].exp() / logits[t, chosen].exp().sum()
        else:
            weights = scores[t, chosen]
        if renormalize:
            weights = weights / weights.sum()
        rows.append(weights * router.routed_scaling_factor)
    weights = torch.stack(rows) if rows else logits.new_zeros(0, topk)
    return topk_idx.to(torch.int64), weights


def dense_balancing_losses(
    x: torch.Tensor, router_weight: torch.Tensor, topk_idx: torch.Tensor, router: RouterConfig
) -> dict[str, torch.Tensor]:
    """The balancing losses of one forward from their definitions (see :mod:`moe_comm.nn.balancing`).

    Args:
        x: ``[..., S, H]`` (sequences along dim -2; ``[T, H]`` is one sequence) or ``[T, H]``.
        router_weight: ``[E, H]`` float32. topk_idx: ``[T, K]`` the routing chosen for ``x``'s tokens.
        router: the settings; only the losses with a coefficient are returned, times it.

    Returns:
        ``{"aux", "seq_aux", "z"}`` (those with a coefficient), 0-d float32, differentiable.
    """
    experts, hidden = router_weight.shape
    seq_len = x.shape[-2] if x.dim() >= 3 else x.reshape(-1, hidden).shape[0]
    logits = x.reshape(-1, hidden).float() @ router_weight.T
    scores = _scores(logits, router)
    probs = scores if router.score == "softmax" else scores / scores.sum(dim=-1, keepdim=True)
    topk = topk_idx.shape[1]

    def switch(p: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        tokens = p.shape[0]
        return experts * sum((idx == e).sum().item() / (tokens * topk) * p[:, e].mean() for e in range(experts))

    losses = {}
    if router.aux_loss_coef:
        losses["aux"] = router.aux_loss_coef * switch(probs, topk_idx)
    if router.seq_aux_loss_coef:
        per_sequence = [switch(probs[b:b + seq_len], topk_idx[b:b + seq_len])
                        for b in range(0, probs.shape[0], seq_len)]
        losses["seq_aux"] = router.seq_aux_loss_coef * sum(per_sequence) / len(per_sequence)
    if router.z_loss_coef:
        losses["z"] = router.z_loss_coef * (logits.exp().sum(dim=-1).log() ** 2).mean()
    return losses


def dense_forward(
    x: torch.Tensor,
    weights: MoEWeights,
    *,
    topk: int,
    renormalize: Optional[bool] = None,
    topk_idx: Optional[torch.Tensor] = None,
    router: Optional[RouterConfig] = None,
    expert_bias: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """The whole layer in one process, no communication: the reference for :class:`~moe_comm.nn.layer.MoELayer`.

    Args:
        x: ``[..., H]`` tokens on ``weights``' device; computed in the dtype of ``weights.w_gate_up``.
        weights: from :func:`build_dense_weights` (make them require grad to get reference gradients).
        topk, renormalize: as the layer's (renormalize None: the router's).
        topk_idx: ``[T, K]`` expert ids (``T`` = tokens of ``x``) to use instead of the router's
            top-k choice, e.g. the layer's ``last_topk_idx``; every id must be in ``[0, E)``.
        router: the layer's ``config.router`` (None: the default softmax router), routed as
            :func:`dense_route` does. expert_bias: the layer's ``expert_bias`` (choice only).

    The shared experts of ``weights`` (if any) are added to every token.

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
    idx, topk_weights = dense_route(x2d, weights.router, topk, RouterConfig() if router is None else router,
                                    renormalize=renormalize, expert_bias=expert_bias, topk_idx=topk_idx)
    compute = x2d.to(weights.w_gate_up.dtype)
    # unbind once: indexing the stacked weights per expert would make backward build a
    # full-size gradient for every expert (E times the weights' memory traffic).
    gate_ups, downs = weights.w_gate_up.unbind(0), weights.w_down.unbind(0)
    z = dense_moe(compute, idx, topk_weights, lambda e, rows: swiglu(rows, gate_ups[e], downs[e]), num_experts)
    if weights.shared_w_gate_up is not None:
        z = z + swiglu(compute, weights.shared_w_gate_up, weights.shared_w_down)
    return z.reshape(x.shape)
