"""The router and the balancing terms (contract: layer / router): :mod:`moe_comm.nn.router` and
:mod:`moe_comm.nn.balancing` (fixed-shape tensor code) against :mod:`moe_comm.nn.reference`'s versions
written from the definitions (per token, per expert, per sequence), values and gradients."""

from __future__ import annotations

import itertools

import pytest
import torch

from moe_comm.nn.balancing import balancing_losses, bias_step, expert_counts
from moe_comm.config import RouterConfig
from moe_comm.nn.reference import dense_balancing_losses, dense_route
from moe_comm.nn.router import select_experts

EXPERTS, HIDDEN, TOPK = 8, 16, 3

# Every router option, each alone and combined (sigmoid scores cannot take softmax_after_topk).
VARIANTS = {
    "softmax": RouterConfig(),
    "softmax_raw": RouterConfig(renormalize=False),
    "softmax_after_topk": RouterConfig(softmax_after_topk=True),
    "softmax_after_topk_raw_scaled": RouterConfig(softmax_after_topk=True, renormalize=False, routed_scaling_factor=3.0),
    "sigmoid": RouterConfig(score="sigmoid"),
    "sigmoid_raw": RouterConfig(score="sigmoid", renormalize=False),
    "softmax_groups": RouterConfig(n_group=4, topk_group=2),
    # DeepSeek-V3: sigmoid, 4 groups of 2 keeping 2, renormalised, scaled by 2.5.
    "deepseek_v3": RouterConfig(score="sigmoid", n_group=4, topk_group=2, routed_scaling_factor=2.5),
    "groups_of_one": RouterConfig(score="sigmoid", n_group=8, topk_group=4),
}


def _inputs(seed: int = 0, tokens: int = 24):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, HIDDEN, generator=gen)
    weight = torch.randn(EXPERTS, HIDDEN, generator=gen) / HIDDEN**0.5
    bias = torch.randn(EXPERTS, generator=gen) * 0.3
    return x, weight, bias


@pytest.mark.parametrize("name, with_bias", list(itertools.product(VARIANTS, (False, True))))
def test_select_experts_matches_per_token_reference(name, with_bias):
    router = VARIANTS[name]
    x, weight, bias = _inputs()
    bias = bias if with_bias else None
    upstream = torch.randn(x.shape[0], TOPK, generator=torch.Generator().manual_seed(9))

    def run(fn):
        leaves = [x.clone().requires_grad_(), weight.clone().requires_grad_()]
        idx, weights = fn(*leaves)
        (weights * upstream).sum().backward()
        return idx, weights.detach(), [leaf.grad for leaf in leaves]

    got_idx, got, got_grads = run(lambda x, w: _layer_route(x, w, router, bias))
    want_idx, want, want_grads = run(lambda x, w: dense_route(x, w, TOPK, router, expert_bias=bias))
    assert torch.equal(got_idx, want_idx)  # the same experts, best first
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-6)
    # The weights come from the unbiased scores: the same ids give the same weights without the bias.
    _, unbiased = _layer_route(x, weight, router, None, topk_idx=got_idx)
    torch.testing.assert_close(got, unbiased.detach(), rtol=0, atol=0)


def _layer_route(x, weight, router, bias, topk_idx=None):
    out = select_experts(x.float() @ weight.T, TOPK, router, expert_bias=bias, topk_idx=topk_idx)
    return out.topk_idx, out.topk_weights


def test_group_limited_choice_stays_in_the_kept_groups():
    router = VARIANTS["deepseek_v3"]
    x, weight, bias = _inputs(tokens=64)
    idx, _ = _layer_route(x, weight, router, bias)
    groups = idx // (EXPERTS // router.n_group)
    assert all(len(set(row)) <= router.topk_group for row in groups.tolist())
    # Without the group limit some tokens would pick from more groups (the limit does something).
    free, _ = _layer_route(x, weight, RouterConfig(score="sigmoid"), bias)
    assert any(len(set(row)) > router.topk_group for row in (free // 2).tolist())


def test_bias_changes_the_choice():
    x, weight, bias = _inputs(tokens=64)
    plain, _ = _layer_route(x, weight, RouterConfig(score="sigmoid"), None)
    biased, _ = _layer_route(x, weight, RouterConfig(score="sigmoid"), bias * 10)
    assert not torch.equal(plain, biased)


@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
def test_balancing_losses_match_their_definitions(score):
    router = RouterConfig(score=score, aux_loss_coef=0.1, seq_aux_loss_coef=0.3, z_loss_coef=0.02)
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(3, 10, HIDDEN, generator=gen)  # 3 sequences of 10 tokens
    _, weight, _ = _inputs()

    def run(fn):
        leaves = [x.clone().requires_grad_(), weight.clone().requires_grad_()]
        losses = fn(*leaves)
        sum(losses.values()).backward()
        return {k: v.detach() for k, v in losses.items()}, [leaf.grad for leaf in leaves]

    idx = _layer_route(x.reshape(-1, HIDDEN), weight, router, None)[0]

    def layer_losses(x, w):
        out = select_experts(x.reshape(-1, HIDDEN) @ w.T, TOPK, router, topk_idx=idx)
        return balancing_losses(out.logits, out.scores, out.topk_idx, x.shape[-2], router)

    got, got_grads = run(layer_losses)
    want, want_grads = run(lambda x, w: dense_balancing_losses(x, w, idx, router))
    assert set(got) == {"aux", "seq_aux", "z"}
    for name in got:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-7)
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-7)


def test_balanced_load_gives_a_loss_of_one():
    # The common scale of Switch, GShard and DeepSeek-V3 (their coefficients carry over): uniform
    # probabilities and an even load give exactly 1 for both balancing losses.
    tokens, experts = 8, 4
    idx = torch.tensor([[t % experts, (t + 1) % experts] for t in range(tokens)])
    logits = torch.zeros(tokens, experts)
    router = RouterConfig(aux_loss_coef=1.0, seq_aux_loss_coef=1.0)
    losses = balancing_losses(logits, torch.softmax(logits, -1), idx, 4, router)
    assert {k: float(v) for k, v in losses.items()} == {"aux": 1.0, "seq_aux": 1.0}
    assert balancing_losses(logits, logits, idx, 4, RouterConfig()) == {}  # no coefficient, no term


def test_expert_counts_and_bias_step():
    idx = torch.tensor([[0, 2], [2, 3], [2, 0]])
    assert expert_counts(idx, 5).tolist() == [2, 0, 3, 1, 0]
    bias = torch.zeros(5)
    bias_step(bias, expert_counts(idx, 5), 0.5)  # mean load 1.2: under-loaded experts go up
    assert bias.tolist() == [-0.5, 0.5, -0.5, 0.5, 0.5]
