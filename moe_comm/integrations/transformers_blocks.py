"""MoE blocks transformers runs without its experts interface: Llama 4 (text), DBRX and JetMoE.

Their experts are not routed through ``ExpertsInterface`` (:mod:`moe_comm.integrations.transformers`),
so :func:`expert_parallel` adapts each MoE block itself: it keeps this rank's slices of the
experts' weights (with the ``moe_comm_expert_ids`` of :mod:`.expert_checkpoints`, so checkpoints
save and load as for the other families) and replaces the forward of one module per block with
dispatch -> this rank's experts -> combine. Routers, shared experts and the blocks' outputs stay
the model's own (recorded router logits included).

- **Llama 4 (text)** ``Llama4TextMoe``: the router's sigmoid score scales each expert's *input*,
  not its output, and the experts are not linear; so each of the K choices is one dispatch of
  the scaled tokens to that one expert (the dispatcher's ``topk`` is 1) with combine weight 1.
  Llama 4's released models route top-1: one dispatch/combine per layer.
- **DBRX** ``DbrxExperts``: called like the interface (tokens, top-k ids, weights); weights
  ``w1``, ``v1``, ``w2`` are ``[E * F, H]`` (expert ``e``'s rows ``e*F:(e+1)*F``).
- **JetMoE** ``JetMoeMoE`` (the MLP experts): ``input_linear.weight [E, 2F, H]``,
  ``output_linear.weight [E, H, F]``. Its mixture-of-attention experts (``JetMoeMoA``) stay whole on
  every rank: their outputs are per (token, choice), not combined, so no dispatch/combine pair fits.
"""

from __future__ import annotations

import types
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from ..dispatcher import Dispatcher
from ..nn.experts import expert_of_rows, resolve_expert_impl
from .expert_checkpoints import attach_expert_ids
from .expert_calls import check_experts_call, dispatched, segmented_linear

__all__ = ["BLOCK_FAMILIES", "BlockFamily", "find_blocks", "keep_local"]


@dataclass(frozen=True)
class BlockFamily:
    """How to make one family's MoE block expert-parallel.

    shape: block -> ``(num_experts, dispatcher topk, hidden, experts' dtype)``.
    sliced: block -> ``[(module holding weights, [parameter names], rows per expert)]``; each
        parameter's dim 0 holds the experts' rows back to back.
    replaced: block -> the module whose forward becomes ``forward`` (the block or its experts).
    forward: the new forward, bound to that module; it finds the dispatcher as ``_moe_comm_dispatcher``.
    """

    shape: Callable[[nn.Module], tuple[int, int, int, torch.dtype]]
    sliced: Callable[[nn.Module], list[tuple[nn.Module, list[str], int]]]
    replaced: Callable[[nn.Module], nn.Module]
    forward: Callable[..., object]


def _gated(dispatcher: Dispatcher, rows: torch.Tensor, offsets: torch.Tensor, ffn: int,
           projections: Callable[[torch.Tensor, torch.Tensor, bool], tuple[torch.Tensor, torch.Tensor]],
           down: tuple[torch.Tensor, bool], act: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``act(gate) * up`` through the down projection for dispatch's expert-major ``rows [N, H]``.

    ``projections(inputs, expert_of_row, grouped)`` gives ``(gate, up)`` ``[N, F]``; ``down`` is
    ``(weight, transposed)`` as :func:`segmented_linear` takes it. Rows past the last segment come out zero.
    """
    grouped = resolve_expert_impl(dispatcher.config, rows.device, ffn) == "grouped_mm"
    expert_of_row = expert_of_rows(offsets, rows.shape[0])
    # Rows past the last segment are unspecified (possibly NaN): zero them before any arithmetic.
    inputs = torch.where(expert_of_row < dispatcher.num_local_experts, rows, torch.zeros_like(rows))
    gate, up = projections(inputs, expert_of_row, grouped)
    out = segmented_linear(act(gate) * up, down[0], None, down[1], offsets, expert_of_row, grouped)
    return out.to(rows.dtype)


# Llama 4 (text)


def _llama4_forward(block: nn.Module, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``Llama4TextMoe.forward``: ``[*, H]`` -> ``([T, H], router_logits [T, E])``, one dispatch per choice."""
    dispatcher: Dispatcher = block._moe_comm_dispatcher
    experts = block.experts
    tokens = hidden_states.reshape(-1, block.hidden_dim)
    check_experts_call(experts, dispatcher, tokens)
    router_scores, router_logits = block.router(tokens)
    top_index = torch.topk(router_logits, block.top_k, dim=1).indices
    scores = router_scores.gather(1, top_index)
    ffn = experts.down_proj.shape[1]

    def local(rows: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        def projections(inputs, expert_of_row, grouped):
            gate_up = segmented_linear(inputs, experts.gate_up_proj, None, True, offsets, expert_of_row, grouped)
            return gate_up.chunk(2, dim=-1)

        return _gated(dispatcher, rows, offsets, ffn, projections, (experts.down_proj, True), experts.act_fn)

    ones = torch.ones_like(scores[:, :1], dtype=torch.float32)
    out = block.shared_expert(tokens)
    for k in range(block.top_k):
        out = out + dispatched(block, tokens * scores[:, k:k + 1], top_index[:, k:k + 1], ones, local,
                               first_slice=8 * k)
    return out, router_logits


LLAMA4 = BlockFamily(
    shape=lambda block: (block.num_experts, 1, block.hidden_dim, block.experts.down_proj.dtype),
    sliced=lambda block: [(block.experts, ["gate_up_proj", "down_proj"], 1)],
    replaced=lambda block: block,
    forward=_llama4_forward,
)


# DBRX


def _dbrx_experts_forward(experts: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                          top_k_weights: torch.Tensor) -> torch.Tensor:
    """``DbrxExperts.forward``: ``hidden_states [B, S, H]``, top-k ids and weights ``[B * S, K]`` -> ``[B, S, H]``."""
    dispatcher: Dispatcher = experts._moe_comm_dispatcher
    mlp, local_count = experts.mlp, dispatcher.num_local_experts
    tokens = hidden_states.reshape(-1, experts.hidden_size)
    check_experts_call(experts, dispatcher, tokens)
    per_expert = (local_count, experts.ffn_hidden_size, experts.hidden_size)

    def local(rows: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        def projections(inputs, expert_of_row, grouped):
            return tuple(segmented_linear(inputs, weight.view(per_expert), None, False, offsets, expert_of_row,
                                          grouped) for weight in (mlp.w1, mlp.v1))

        return _gated(dispatcher, rows, offsets, experts.ffn_hidden_size, projections,
                      (mlp.w2.view(per_expert), True), mlp.activation_fn)

    out = dispatched(experts, tokens, top_k_index, top_k_weights, local)
    return out.view(hidden_states.shape[0], -1, experts.hidden_size)


DBRX = BlockFamily(
    shape=lambda block: (block.experts.num_experts, block.top_k, block.experts.hidden_size, block.experts.mlp.w1.dtype),
    sliced=lambda block: [(block.experts.mlp, ["w1", "v1", "w2"], block.experts.ffn_hidden_size)],
    replaced=lambda block: block.experts,
    forward=_dbrx_experts_forward,
)


# JetMoE


def _jetmoe_forward(block: nn.Module, layer_input: torch.Tensor) -> torch.Tensor:
    """``JetMoeMoE.forward``: ``[B, S, H]`` -> ``[B, S, H]`` (the block's own router, softmax over the top-k logits)."""
    dispatcher: Dispatcher = block._moe_comm_dispatcher
    batch, length, hidden = layer_input.shape
    tokens = layer_input.reshape(-1, hidden)
    check_experts_call(block, dispatcher, tokens)
    # The router is called for the logits it reports (recorded as router_logits); the top-k is taken again
    # from them, as the router does, because its own outputs are sorted for a local grouped run.
    logits = block.router(tokens)[4]
    top_logits, top_index = logits.topk(block.router.top_k, dim=1)
    gates = torch.softmax(top_logits, dim=1).type_as(tokens)
    ffn = block.hidden_size

    def local(rows: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        def projections(inputs, expert_of_row, grouped):
            hidden_states = segmented_linear(inputs, block.input_linear.weight, None, False, offsets,
                                             expert_of_row, grouped)
            return hidden_states.chunk(2, dim=-1)

        return _gated(dispatcher, rows, offsets, ffn, projections, (block.output_linear.weight, False),
                      block.activation)

    out = dispatched(block, tokens, top_index, gates, local)
    return out.view(batch, length, hidden) + block.bias


JETMOE = BlockFamily(
    shape=lambda block: (block.input_linear.num_experts, block.router.top_k, block.input_size,
                         block.input_linear.weight.dtype),
    sliced=lambda block: [(block.input_linear, ["weight"], 1), (block.output_linear, ["weight"], 1)],
    replaced=lambda block: block,
    forward=_jetmoe_forward,
)

# The MoE block's class name -> its family (names, so that no transformers model module is imported).
BLOCK_FAMILIES = {"Llama4TextMoe": LLAMA4, "DbrxFFN": DBRX, "JetMoeMoE": JETMOE}


def find_blocks(model: nn.Module) -> list[tuple[nn.Module, BlockFamily]]:
    """Every MoE block of ``model`` of a family listed in :data:`BLOCK_FAMILIES`, with its family."""
    return [(m, BLOCK_FAMILIES[type(m).__name__]) for m in model.modules() if type(m).__name__ in BLOCK_FAMILIES]


def keep_local(block: nn.Module, family: BlockFamily, dispatcher: Dispatcher) -> None:
    """Keep this rank's experts' rows of the block's weights, mark them with their expert ids and adapt the forward."""
    local = dispatcher.num_local_experts
    first = dispatcher.rank * local
    for module, names, rows_per_expert in family.sliced(block):
        with torch.no_grad():
            for name in names:
                param = getattr(module, name)
                kept = param.detach()[first * rows_per_expert:(first + local) * rows_per_expert].clone()
                setattr(module, name, nn.Parameter(kept, requires_grad=param.requires_grad))
        attach_expert_ids(module, names, first, local)
    replaced = family.replaced(block)
    replaced._moe_comm_dispatcher = dispatcher
    replaced._moe_comm_call_site = dispatcher.new_call_site()  # blocks in model order: the same on every rank
    replaced.forward = types.MethodType(family.forward, replaced)
