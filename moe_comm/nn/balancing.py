"""Load balancing of :class:`moe_comm.MoELayer`: per-expert loads, the balancing losses, the bias step.

Everything here is a fixed-shape device computation (no host reads, no shapes from the
routing), so it is captured in CUDA graphs and compiled with ``fullgraph=True``. The counts are
exact integers; the losses are float32 and differentiable with respect to the router's logits
(the counts, which come from a top-k choice, are not).

The two balancing losses share one form, equal to 1 when every expert gets the same load and
the same mean probability (so the coefficients of Switch, GShard and DeepSeek-V3 carry over):

* ``aux`` (Switch/GShard, over one forward's tokens): ``E * sum_e f_e * P_e``, with ``f_e`` the
  fraction of the ``T * K`` assignments that go to expert ``e`` and ``P_e`` the mean over the tokens
  of its probability;
* ``seq_aux`` (DeepSeek-V3's sequence-wise loss): the same per sequence, averaged over the sequences.

The probabilities are the softmax over all experts (``score: softmax``, whichever order the
top-k takes) or the sigmoid scores normalised to sum to 1 per token (``score: sigmoid``, as
DeepSeek-V3). The z-loss is ``mean_t logsumexp(logits_t)^2`` (ST-MoE).
"""

from __future__ import annotations

import torch

from ..config import RouterConfig

__all__ = ["expert_counts", "balance_probs", "aux_loss", "seq_aux_loss", "z_loss", "balancing_losses",
           "bias_step"]


def expert_counts(topk_idx: torch.Tensor, num_experts: int) -> torch.Tensor:
    """``[E]`` int64: how many of the assignments in ``topk_idx [T, K]`` (ids in ``[0, E)``) go to each expert."""
    flat = topk_idx.reshape(-1)
    return torch.zeros(num_experts, dtype=torch.int64, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))


def balance_probs(scores: torch.Tensor, router: RouterConfig) -> torch.Tensor:
    """``[T, E]`` float32 per-token probabilities the balancing losses use (see the module docstring).

    ``scores`` are the router's (softmax or sigmoid, :func:`moe_comm.nn.router.router_scores`).
    """
    if router.score == "softmax":
        return scores
    return scores / scores.sum(dim=-1, keepdim=True)


def aux_loss(probs: torch.Tensor, counts: torch.Tensor, topk: int) -> torch.Tensor:
    """Switch/GShard loss, 0-d float32: ``E * sum_e (counts_e / (T K)) * mean_t probs[t, e]``.

    Args:
        probs: ``[T, E]`` float32 from :func:`balance_probs`. counts: ``[E]`` from :func:`expert_counts`.
    """
    tokens, experts = probs.shape
    fraction = counts.float() / max(tokens * topk, 1)
    return experts * (fraction * probs.sum(dim=0) / max(tokens, 1)).sum()


def seq_aux_loss(probs: torch.Tensor, topk_idx: torch.Tensor, seq_len: int) -> torch.Tensor:
    """DeepSeek-V3's sequence-wise loss, 0-d float32: :func:`aux_loss` per sequence, averaged.

    Args:
        probs: ``[T, E]`` float32 (:func:`balance_probs`). topk_idx: ``[T, K]`` ids in ``[0, E)``.
        seq_len: S >= 1, a divisor of T; the tokens are ``T / S`` sequences of ``S`` consecutive tokens.
    """
    tokens, experts = probs.shape
    topk = topk_idx.shape[1]
    sequences = tokens // seq_len
    # One counter per (sequence, expert): its index in a flat [sequences * E] table.
    seq_of = torch.arange(tokens, device=topk_idx.device).div(seq_len, rounding_mode="floor")
    flat = (seq_of[:, None] * experts + topk_idx).reshape(-1)
    counts = probs.new_zeros(sequences * experts).index_add_(0, flat, torch.ones_like(flat, dtype=probs.dtype))
    fraction = counts.view(sequences, experts) / (seq_len * topk)
    mean_probs = probs.view(sequences, seq_len, experts).mean(dim=1)
    return experts * (fraction * mean_probs).sum() / max(sequences, 1)


def z_loss(logits: torch.Tensor) -> torch.Tensor:
    """Router z-loss (ST-MoE), 0-d float32: ``mean_t logsumexp(logits[t])^2`` of ``[T, E]`` float32 logits."""
    return torch.logsumexp(logits, dim=-1).square().mean()


def balancing_losses(logits: torch.Tensor, scores: torch.Tensor, topk_idx: torch.Tensor, seq_len: int,
                     router: RouterConfig) -> dict[str, torch.Tensor]:
    """The losses ``router`` gives a coefficient, each already multiplied by it.

    Args:
        logits, scores: ``[T, E]`` float32 (:class:`moe_comm.nn.router.RouterOutput`).
        topk_idx: ``[T, K]`` the chosen ids. seq_len: tokens per sequence for ``seq_aux`` (>= 1, divides ``T``).

    Returns:
        ``{"aux": ..., "seq_aux": ..., "z": ...}`` (only the terms with a coefficient), 0-d float32 tensors.
    """
    losses = {}
    if router.aux_loss_coef or router.seq_aux_loss_coef:
        probs = balance_probs(scores, router)
        if router.aux_loss_coef:
            counts = expert_counts(topk_idx, logits.shape[1])
            losses["aux"] = router.aux_loss_coef * aux_loss(probs, counts, topk_idx.shape[1])
        if router.seq_aux_loss_coef:
            losses["seq_aux"] = router.seq_aux_loss_coef * seq_aux_loss(probs, topk_idx, seq_len)
    if router.z_loss_coef:
        losses["z"] = router.z_loss_coef * z_loss(logits)
    return losses


def bias_step(expert_bias: torch.Tensor, load: torch.Tensor, rate: float) -> None:
    """DeepSeek-V3's aux-loss-free update, in place: ``bias += rate * sign(mean(load) - load)``.

    Args:
        expert_bias: ``[E]`` float32, updated in place (a captured graph keeps reading the same storage).
        load: ``[E]`` assignments per expert (any number dtype) on the bias' device.
    """
    load = load.float()
    expert_bias.add_(torch.sign(load.mean() - load), alpha=rate)
