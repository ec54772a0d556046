"""Checks shared by the CPU and GPU tests of the token-major layout (``Config.receive_layout``).

Two Dispatchers of one group, alike but for the layout, dispatch the same tokens; the token-major
path (dispatch -> permute -> experts -> unpermute -> combine) must give the expert-major path's bits
(dispatch -> experts -> combine): the same expert-major rows, the same ``z``, the same gradients.
"""

from __future__ import annotations

from typing import Callable

import torch

import moe_comm


def experts_by_scale(scale: torch.Tensor) -> Callable:
    """Experts that need no segment bounds on the host (graph-capturable): ``y = x * scale`` per column,
    ``scale [H]`` float32, computed in float32 and rounded to ``x``'s dtype."""
    return lambda out: (out.x.float() * scale).to(out.x.dtype)


def experts_by_segment(weights_local: torch.Tensor) -> Callable:
    """``y[segment j] = x[segment j] @ weights_local[j]`` over every aligned segment (reads the offsets on the host)."""
    def run(out) -> torch.Tensor:
        pieces, start = [], 0
        for j, end in enumerate(out.expert_offsets.tolist()):
            pieces.append(out.x[start:end] @ weights_local[j].to(out.x.dtype))
            start = end
        pieces.append(out.x.new_zeros(out.x.shape[0] - start, out.x.shape[1]))
        return torch.cat(pieces)
    return run


def both_paths(em: moe_comm.Dispatcher, tm: moe_comm.Dispatcher, x, topk_idx, topk_weights, experts: Callable):
    """Run one step on each layout. Returns ``(expert-major output, its z, token-major output, its permuted
    output, its z)``; with FP8 dispatch the experts get the dequantized rows."""
    def rows_for_experts(disp, out):
        return out if out.x_scales is None else _Dequantized(disp.dequantize(out), out.expert_offsets)

    out_em = em.dispatch(x, topk_idx, topk_weights)
    z_em = em.combine(experts(rows_for_experts(em, out_em)), out_em.handle)
    out_tm = tm.dispatch(x, topk_idx, topk_weights)
    permuted = tm.permute(out_tm)
    z_tm = tm.combine(tm.unpermute(experts(rows_for_experts(tm, permuted)), out_tm), out_tm.handle)
    return out_em, z_em, out_tm, permuted, z_tm


class _Dequantized:
    """What ``experts`` reads of an FP8 output: its rows dequantized, and its segments."""

    def __init__(self, x: torch.Tensor, expert_offsets: torch.Tensor) -> None:
        self.x = x
        self.expert_offsets = expert_offsets


def assert_same_rows(out_em, permuted) -> None:
    """The permuted rows are the expert-major dispatch's, bit for bit, on every row the contract defines."""
    assert torch.equal(permuted.expert_offsets, out_em.expert_offsets)
    assert torch.equal(permuted.tokens_per_expert, out_em.tokens_per_expert)
    end = int(out_em.expert_offsets[-1]) if out_em.expert_offsets.numel() else 0
    assert torch.equal(permuted.x[:end].view(torch.uint8), out_em.x[:end].view(torch.uint8)), "permuted rows differ"
    if out_em.x_scales is not None:
        assert torch.equal(permuted.x_scales[:end], out_em.x_scales[:end]), "permuted scales differ"


def expected_local_ids(rank: int, world: int, max_tokens: int, num_experts: int, idxs: list,
                       kept_idxs: list) -> torch.Tensor:
    """``[W * M, K]`` int32: what a token-major output's ``topk_idx`` holds on ``rank`` (``idxs``: every rank's
    ``topk_idx``; ``kept_idxs``: the same after the capacity's drops, -1 where dropped)."""
    local = num_experts // world
    topk = idxs[0].shape[1]
    ids = torch.full((world * max_tokens, topk), -1, dtype=torch.int32)
    for s, kept in enumerate(kept_idxs):
        here = (kept >= rank * local) & (kept < (rank + 1) * local)
        ids[s * max_tokens:s * max_tokens + kept.shape[0]] = torch.where(here, kept - rank * local, -1).to(torch.int32)
    return ids


def assert_token_rows(out_tm, rank: int, world: int, max_tokens: int, xs: list) -> None:
    """Row ``s * M + t`` of the token-major output holds token ``t`` of rank ``s`` wherever it has a kept entry."""
    ids = out_tm.topk_idx.cpu()
    rows = out_tm.rows.cpu()
    for s, x in enumerate(xs):
        for t in range(x.shape[0]):
            if bool((ids[s * max_tokens + t] >= 0).any()):
                assert torch.equal(rows[s * max_tokens + t].view(torch.uint8), x[t].cpu().view(torch.uint8)), (s, t)


def differing_tensors(expert_major: dict, token_major: dict) -> list[str]:
    """The names whose tensors differ in any bit between two runs, one per layout (``name -> tensor or None``,
    e.g. an output and every parameter's gradient; a gradient that only one run has differs too)."""
    return [name for name, tensor in expert_major.items()
            if (tensor is None) != (token_major[name] is None)
            or (tensor is not None and not torch.equal(tensor, token_major[name]))]
