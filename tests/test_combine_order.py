"""Combine's fixed summation order, bit for bit, on 3 gloo ranks of the reference backend
(contract: dispatch/combine, ``moe_comm.routing``'s definitions).

A token's result is the sum of the partials its destination ranks return, in float32 over the
ranks in increasing order; each partial is the float32 sum over its columns k in increasing
order of ``w_k * y``. Two ranks cannot show the order of the rank sum (``a + b == b + a``), so
this runs on three, with weights of very different magnitudes, where summing in another order
rounds otherwise; the test checks that its data tells the orders apart.
"""

from __future__ import annotations

import torch

import moe_comm
from multirank import run_ranks

WORLD = 3
EXPERTS, TOPK, HIDDEN, TOKENS = 6, 3, 16, 8
LOCAL = EXPERTS // WORLD


def _inputs(rank: int):
    """This rank's ``x [T, H]``, ``topk_idx [T, K]`` and ``topk_weights [T, K]`` float32."""
    gen = torch.Generator().manual_seed(40 + rank)
    x = torch.randn(TOKENS, HIDDEN, generator=gen)
    # Every token reaches every rank, its columns in a random order of the ranks (so k order is
    # not rank order); on two tokens two columns share a rank, on one a column is empty.
    ranks = torch.stack([torch.randperm(WORLD, generator=gen) for _ in range(TOKENS)])
    ranks[1, 2] = ranks[1, 0]
    ranks[2, 0] = ranks[2, 1]
    idx = ranks * LOCAL + torch.randint(0, LOCAL, (TOKENS, TOPK), generator=gen)
    idx[3, 1] = -1
    # Weights from 1 down to 2^-24: the partials' magnitudes differ by up to the float32 precision.
    weights = torch.rand(TOKENS, TOPK, generator=gen) * 2.0 ** -torch.randint(0, 25, (TOKENS, TOPK), generator=gen)
    return x, idx, weights


def _expert_scales() -> torch.Tensor:
    """``[E]`` float32: expert ``e`` multiplies its rows by ``scales[e]``."""
    return torch.rand(EXPERTS, generator=torch.Generator().manual_seed(7)) + 0.5


def _expected(x, idx, weights, rank_order) -> torch.Tensor:
    """The definition, one token at a time: partials over k increasing, their sum over ``rank_order``."""
    scales = _expert_scales()
    z = torch.zeros(TOKENS, HIDDEN)
    for t in range(TOKENS):
        acc = torch.zeros(HIDDEN)
        for r in rank_order:
            columns = [k for k in range(TOPK) if idx[t, k] >= 0 and idx[t, k] // LOCAL == r]
            if not columns:
                continue
            partial = torch.zeros(HIDDEN)
            for k in columns:
                partial = partial + weights[t, k] * (x[t] * scales[idx[t, k]])
            acc = acc + partial
        z[t] = acc
    return z


def _rank_combine(rank: int, world: int) -> dict:
    x, idx, weights = _inputs(rank)
    cfg = moe_comm.load_config(None, backend="reference", num_experts=EXPERTS, topk=TOPK, hidden=HIDDEN,
                               max_tokens_per_rank=TOKENS, dtype="float32", expert_alignment=1)
    with moe_comm.Dispatcher(cfg) as disp:
        out = disp.dispatch(x, idx, weights)
        segments = torch.diff(out.expert_offsets.long(), prepend=torch.zeros(1, dtype=torch.long))
        row_scales = torch.repeat_interleave(_expert_scales()[rank * LOCAL:(rank + 1) * LOCAL], segments)
        y = out.x.clone()
        end = int(out.expert_offsets[-1])
        y[:end] = out.x[:end] * row_scales[:, None]
        z = disp.combine(y, out.handle)
    increasing = _expected(x, idx, weights, range(WORLD))
    decreasing = _expected(x, idx, weights, range(WORLD - 1, -1, -1))
    return {"z": z, "increasing": increasing, "orders_differ": int((increasing != decreasing).sum())}


def test_combine_sums_the_partials_over_ranks_in_increasing_order_bit_for_bit():
    for rank, result in enumerate(run_ranks(_rank_combine, WORLD, timeout_s=120)):
        assert result["orders_differ"] > 0, f"rank {rank}: this data does not tell the rank orders apart"
        got, want = result["z"], result["increasing"]
        assert torch.equal(got.view(torch.int32), want.view(torch.int32)), \
            f"rank {rank}: {int((got != want).sum())} of {got.numel()} values differ from the definition"
