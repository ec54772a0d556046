"""The router of :class:`moe_comm.MoELayer`: scores, expert choice and combine weights (float32).

One token's path, as :class:`moe_comm.config.RouterConfig` sets it:

1. logits ``x @ W.T`` in float32; scores ``softmax(logits)`` or ``sigmoid(logits)``.
2. Choice: ``scores + expert_bias`` (the aux-loss-free bias, if any) picks the experts. With
   ``n_group > 1`` the token first keeps its ``topk_group`` best groups (a group's score is the sum
   of its two best choice scores) and takes the top-k among their experts only.
3. Weights, from the unbiased scores: the chosen scores (``softmax_after_topk``: a softmax over
   the chosen logits only), renormalised to sum to 1 if asked, times ``routed_scaling_factor``.

Every step is a fixed-shape tensor op on the device (``topk``, ``gather``, ``scatter``), so routing
reads nothing on the host and is captured in CUDA graphs and compiled with ``fullgraph=True``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from ..config import RouterConfig

__all__ = ["RouterOutput", "router_scores", "select_experts", "route"]

_DEFAULT = RouterConfig()


@dataclass(frozen=True)
class RouterOutput:
    """What the router computed for ``T`` tokens (all on the tokens' device).

    topk_idx: ``[T, K]`` int64 global expert ids, best first.
    topk_weights: ``[T, K]`` float32 combine weights (differentiable w.r.t. the input and router weight).
    logits: ``[T, E]`` float32. scores: ``[T, E]`` float32, softmax or sigmoid of the logits.
    """

    topk_idx: torch.Tensor
    topk_weights: torch.Tensor
    logits: torch.Tensor
    scores: torch.Tensor


def router_scores(logits: torch.Tensor, router: RouterConfig) -> torch.Tensor:
    """``[T, E]`` float32 scores of ``[T, E]`` float32 logits: softmax over the experts, or sigmoid per expert."""
    return torch.softmax(logits, dim=-1) if router.score == "softmax" else torch.sigmoid(logits)


def _group_limit(choice: torch.Tensor, router: RouterConfig) -> torch.Tensor:
    """``choice [T, E]`` with the experts outside each token's ``topk_group`` best groups set to -inf."""
    tokens, experts = choice.shape
    grouped = choice.view(tokens, router.n_group, experts // router.n_group)
    # DeepSeek-V3 ranks a group by the sum of its two best scores (its one best in groups of one).
    best = min(2, grouped.shape[-1])
    group_scores = grouped.topk(best, dim=-1).values.sum(dim=-1)
    kept = group_scores.topk(router.topk_group, dim=-1).indices
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept, True)
    return grouped.masked_fill(~keep[..., None], float("-inf")).view(tokens, experts)


def select_experts(
    logits: torch.Tensor,
    topk: int,
    router: RouterConfig = _DEFAULT,
    *,
    renormalize: Optional[bool] = None,
    expert_bias: Optional[torch.Tensor] = None,
    topk_idx: Optional[torch.Tensor] = None,
) -> RouterOutput:
    """Choose (or take) every token's K experts and compute their combine weights.

    Args:
        logits: ``[T, E]`` float32 router logits.
        topk: K. router: the routing settings. renormalize: None uses ``router.renormalize``.
        expert_bias: ``[E]`` float32 added to the scores for the choice only, or None.
        topk_idx: ``[T, K]`` int32/int64 ids to use instead of choosing (a reference uses the
            layer's choice, so near-ties cannot flip between two computations).

    Returns:
        A :class:`RouterOutput` on ``logits.device``.
    """
    renormalize = router.renormalize if renormalize is None else renormalize
    scores = router_scores(logits, router)
    if topk_idx is None:
        choice = scores if expert_bias is None else scores + expert_bias
        if router.n_group > 1:
            choice = _group_limit(choice, router)
        topk_idx = choice.topk(topk, dim=-1).indices
    else:
        topk_idx = topk_idx.to(torch.int64)
    if router.softmax_after_topk:
        topk_weights = torch.softmax(logits.gather(-1, topk_idx), dim=-1)
    else:
        topk_weights = scores.gather(-1, topk_idx)
    if renormalize:
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
    if router.routed_scaling_factor != 1.0:
        topk_weights = topk_weights * router.routed_scaling_factor
    return RouterOutput(topk_idx, topk_weights, logits, scores)


def route(
    x: torch.Tensor,
    router_weight: torch.Tensor,
    topk: int,
    renormalize: bool,
    topk_idx: Optional[torch.Tensor] = None,
    *,
    router: RouterConfig = _DEFAULT,
    expert_bias: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Route ``x``: pick (or take) the top-k experts of every token and their weights.

    Args:
        x: ``[T, H]`` tokens, any float dtype (the logits are computed in float32).
        router_weight: ``[E, H]`` float32.
        topk: K. renormalize: scale each token's K weights to sum to 1.
        topk_idx, expert_bias, router: as :func:`select_experts` (the default router is a softmax).

    Returns:
        ``topk_idx`` ``[T, K]`` int64 and ``topk_weights`` ``[T, K]`` float32, on ``x.device``;
        the weights are differentiable with respect to ``x`` and ``router_weight``.
    """
    out = select_experts(F.linear(x.float(), router_weight), topk, router, renormalize=renormalize,
                         expert_bias=expert_bias, topk_idx=topk_idx)
    return out.topk_idx, out.topk_weights
