"""Tiny HuggingFace transformers MoE models and the check that ``expert_parallel`` keeps them exact.

Shared by the CPU and GPU transformers tests. :func:`build_model` makes a tiny random model of
one architecture (every bias randomised, so that biases count); :func:`compare_with_unmodified`
makes it expert-parallel, runs it and an unmodified copy on this rank's tokens, forward and
backward, and returns scale-free relative errors (``max |got - want| / max |want|``). The
unmodified model sees only this rank's tokens, so an expert's gradient there is this rank's
share: the shares of every rank are summed before they are compared with the expert-parallel
model's slice.
"""

from __future__ import annotations

import copy
import inspect

import torch
import torch.distributed as dist
import transformers
from torch import nn
from transformers.integrations.moe import use_experts_implementation
from transformers.modeling_outputs import CausalLMOutput

from moe_comm.integrations import transformers as moe_transformers

__all__ = ["ARCHS", "BLOCK_ARCHS", "VOCAB", "build_model", "rel_err", "compare_with_unmodified"]

VOCAB = 64
# Three expert layouts of transformers' experts interface: Qwen3-MoE (concatenated gate/up,
# [E, 2F, H]), Mixtral (the same layout, softmax-then-top-k router, no renormalisation) and gpt-oss
# (transposed [E, H, 2F], interleaved gate/up, biases, a clamped gate); "plain" is PlainExperts
# below (no gate, post-expert norm). Three MoE blocks moe_comm adapts itself: Llama 4 text (the
# router's score scales the experts' input; a shared expert), DBRX (flat [E * F, H] weights) and
# JetMoE (its MLP experts; a bias after the combine).
INTERFACE_ARCHS = ("qwen3_moe", "mixtral", "gpt_oss", "plain")
BLOCK_ARCHS = ("llama4_text", "dbrx", "jetmoe")
ARCHS = INTERFACE_ARCHS + BLOCK_ARCHS
_COMMON = dict(vocab_size=VOCAB, hidden_size=32, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
               num_experts_per_tok=2)


# transformers releases before the post-expert norm flag (5.17 on the GPU machines) get PlainExperts without it.
_POST_NORM = "has_post_expert_norm" in inspect.signature(use_experts_implementation).parameters


@use_experts_implementation(has_gate=False, is_transposed=True, has_bias=True,
                            **({"has_post_expert_norm": True} if _POST_NORM else {}))
class PlainExperts(nn.Module):
    """Ungated experts (``act(x @ up + b) @ down + b``), transposed weights, a post-expert LayerNorm where supported."""

    def __init__(self, config) -> None:
        super().__init__()
        experts, hidden, ffn = config.num_experts, config.hidden_size, config.intermediate_size
        self.num_experts = experts
        self.up_proj = nn.Parameter(torch.randn(experts, hidden, ffn) / hidden ** 0.5)
        self.up_proj_bias = nn.Parameter(torch.randn(experts, ffn) * 0.1)
        self.down_proj = nn.Parameter(torch.randn(experts, ffn, hidden) / ffn ** 0.5)
        self.down_proj_bias = nn.Parameter(torch.randn(experts, hidden) * 0.1)
        self.act_fn = nn.GELU()
        self.post_expert_norm = nn.LayerNorm(hidden) if _POST_NORM else nn.Identity()

    def forward(self, hidden_states, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden_states)
        for k in range(top_k_index.shape[1]):
            expert = top_k_index[:, k]
            hidden = self.act_fn(torch.einsum("th,thf->tf", hidden_states, self.up_proj[expert])
                                 + self.up_proj_bias[expert])
            expert_out = torch.einsum("tf,tfh->th", hidden, self.down_proj[expert]) + self.down_proj_bias[expert]
            out = out + self.post_expert_norm(expert_out) * top_k_weights[:, k, None]
        return out


class PlainMoeModel(nn.Module):
    """Embedding -> (softmax top-k router -> PlainExperts, residual) x 2 -> logits, the shape of a causal LM's output."""

    def __init__(self, num_experts: int) -> None:
        super().__init__()
        self.config = transformers.PreTrainedConfig(hidden_size=32, intermediate_size=24, num_experts=num_experts,
                                                    num_experts_per_tok=2)
        self.config._experts_implementation = "eager"
        self.embed = nn.Embedding(VOCAB, 32)
        self.routers = nn.ModuleList(nn.Linear(32, num_experts, bias=False) for _ in range(2))
        self.experts = nn.ModuleList(PlainExperts(self.config) for _ in range(2))
        self.head = nn.Linear(32, VOCAB)

    def forward(self, input_ids):
        x = self.embed(input_ids)
        for router, experts in zip(self.routers, self.experts):
            tokens = x.reshape(-1, x.shape[-1])
            weights, index = router(tokens).softmax(-1).topk(2, dim=-1)
            x = x + experts(tokens, index, weights).reshape(x.shape)
        return CausalLMOutput(logits=self.head(x))


def build_model(arch: str, num_experts: int = 4, seed: int = 0, layers: int = 2, hidden: int = 32) -> nn.Module:
    """A tiny float32 model of ``arch`` (one of :data:`ARCHS`) on the CPU, the same on every rank.

    ``layers`` decoder layers and ``hidden`` channels (``plain`` always has two layers of 32).
    """
    torch.manual_seed(seed)
    common = dict(_COMMON, num_hidden_layers=layers, hidden_size=hidden)
    if arch == "qwen3_moe":
        model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
            intermediate_size=48, moe_intermediate_size=16, num_experts=num_experts, **common))
    elif arch == "mixtral":
        model = transformers.MixtralForCausalLM(transformers.MixtralConfig(
            intermediate_size=16, num_local_experts=num_experts, **common))
    elif arch == "gpt_oss":
        model = transformers.GptOssForCausalLM(transformers.GptOssConfig(
            intermediate_size=16, num_local_experts=num_experts, layer_types=["full_attention"] * layers, **common))
    elif arch == "llama4_text":
        model = transformers.Llama4ForCausalLM(transformers.Llama4TextConfig(
            intermediate_size=16, intermediate_size_mlp=48, num_local_experts=num_experts, **common))
    elif arch == "dbrx":
        model = transformers.DbrxForCausalLM(transformers.DbrxConfig(
            d_model=hidden, n_heads=2, n_layers=layers, vocab_size=VOCAB,
            attn_config={"kv_n_heads": 1, "rope_theta": 10000.0, "clip_qkv": 8.0},
            ffn_config={"ffn_hidden_size": 16, "moe_num_experts": num_experts, "moe_top_k": 2}))
    elif arch == "jetmoe":
        model = transformers.JetMoeForCausalLM(transformers.JetMoeConfig(
            vocab_size=VOCAB, hidden_size=hidden, num_hidden_layers=layers, num_key_value_heads=2, kv_channels=16,
            intermediate_size=16, num_local_experts=num_experts, num_experts_per_tok=2))
    elif arch == "plain":
        return PlainMoeModel(num_experts)
    else:
        raise ValueError(f"unknown arch {arch!r}; expected one of {ARCHS}")
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(0, 0.05)
            elif arch in BLOCK_ARCHS and "norm" not in name:
                # Their experts start zero or uninitialised ("empty") here: random weights make every expert count.
                param.normal_(0, param.shape[-1] ** -0.5)
    return model.float()


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """``max |got - want| / max |want|`` in float32 (0 for two zero tensors)."""
    got, want = got.detach().float().cpu(), want.detach().float().cpu()
    return ((got - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()


def _summed_over_ranks(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` summed over the ranks, as float32 on its device (the default group's backend reduces it there)."""
    total = tensor.detach().float().clone()
    dist.all_reduce(total)
    return total


def _loss(logits: torch.Tensor) -> torch.Tensor:
    return (logits.float() ** 2).mean()


def compare_with_unmodified(model: nn.Module, rank: int, tokens: tuple, device: torch.device,
                            dtype: torch.dtype, **overrides) -> dict:
    """Errors of ``model`` made expert-parallel against an unmodified copy, on this rank's tokens.

    Collective. ``model`` is this rank's copy (the same on every rank, float32 on the CPU); both
    runs move to ``device`` in ``dtype``. Returns ``logits`` (relative error), ``grads`` (the
    largest relative gradient error and its parameter), ``calls`` (the forward's dispatch
    calls: the experts forwards that went through moe_comm) and ``kept`` (whether every experts
    parameter holds exactly this rank's slice).
    """
    reference = copy.deepcopy(model).to(device, dtype)
    originals = {name: param.detach().clone() for name, param in reference.named_parameters()}
    moe_transformers.expert_parallel(model.to(dtype), **overrides)
    model.to(device)
    dispatcher = model.moe_comm_dispatcher

    calls = []
    dispatch = dispatcher.dispatch

    def counted(*args, **kwargs):
        calls.append(1)
        return dispatch(*args, **kwargs)

    dispatcher.dispatch = counted
    try:
        gen = torch.Generator().manual_seed(100 + rank)
        input_ids = torch.randint(0, VOCAB, tokens, generator=gen).to(device)
        logits = model(input_ids).logits
    finally:
        del dispatcher.dispatch
    _loss(logits).backward()
    want_logits = reference(input_ids).logits
    _loss(want_logits).backward()

    grads, kept = {}, True
    mine = dict(model.named_parameters())
    experts_prefixes = tuple(f"{name}." for name, module in model.named_modules()
                             if hasattr(module, "_moe_comm_dispatcher"))
    for name, param in reference.named_parameters():
        got, want = mine[name].grad, param.grad
        if mine[name].shape != param.shape:
            # Dim 0 holds the experts' rows back to back (one row per expert, or F of them in DBRX's flat layout).
            rows = mine[name].shape[0]
            start = dispatcher.rank * rows
            want = _summed_over_ranks(want)[start:start + rows]
            kept = kept and torch.equal(mine[name].detach(), originals[name][start:start + rows])
        elif name.startswith(experts_prefixes):
            # Shared by the experts (a post-expert norm) or in an adapted block (its router, shared
            # expert, bias): each rank holds the gradient of the rows it computed, the model's
            # gradient once summed over the ranks (data parallelism's all-reduce).
            got, want = _summed_over_ranks(got), _summed_over_ranks(want)
        grads[name] = rel_err(got, want)
    worst = max(grads, key=grads.get)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dispatcher.check()
    return dict(logits=rel_err(logits, want_logits), grads=(grads[worst], worst), calls=len(calls), kept=kept)
