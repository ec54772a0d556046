"""moe_comm.integrations.transformers on the GPU (contract: integrations).

Tiny models of every architecture in ``hf_models.ARCHS`` made expert-parallel give the unmodified
model's logits and gradients: in float32 (the per-expert loop) on ``vmm`` at world 2 (ranks
time-sliced on one GPU when only one is present), and in bf16 (one
decoder layer, ``torch._grouped_mm`` on sm_90) within bf16 rounding. A Qwen3-MoE decode step with a
static KV cache, captured once in a CUDA graph and replayed along a decode (new tokens, next
positions), gives eager's logits bit for bit.
"""

from __future__ import annotations

import pytest
import torch

from requirements import require

require("transformers")

from capture import warm_up_on_side_stream  # noqa: E402
from gpu_backends import GPU_BACKENDS, dist_backend_for, gpus_needed  # noqa: E402
from hf_models import ARCHS, VOCAB, build_model, compare_with_unmodified  # noqa: E402
from moe_comm.integrations.transformers import expert_parallel  # noqa: E402
from multirank import run_ranks  # noqa: E402

pytestmark = pytest.mark.gpu

TOKENS = (2, 8)
BATCH, PROMPT, CACHE, DECODE_STEPS = 4, 6, 16, 4


def _cache_state(cache) -> list[torch.Tensor]:
    """Every tensor a StaticCache holds (keys, values and, in newer transformers, the filled length)."""
    return [value for layer in cache.layers for _, value in sorted(vars(layer).items())
            if isinstance(value, torch.Tensor)]


def _restore(cache, saved: list[torch.Tensor]) -> None:
    for tensor, value in zip(_cache_state(cache), saved):
        tensor.copy_(value)


def _captured_decode(device: torch.device, rank: int, options: dict) -> dict:
    """Logit errors of a captured decode step of an expert-parallel bf16 Qwen3-MoE, replayed along a decode.

    After an eager prefill into a StaticCache, DECODE_STEPS steps with new tokens at successive
    positions run eagerly; from the same cache state the graph captured once replays them.
    """
    from transformers import StaticCache

    model = build_model("qwen3_moe", layers=2)
    # The model stays in float32 on the CPU until after expert_parallel (as a checkpoint is loaded);
    # dtype names what it will run in.
    expert_parallel(model, max_tokens_per_rank=BATCH * PROMPT, dtype="bfloat16", **options)
    model.to(device, torch.bfloat16).eval()
    gen = torch.Generator().manual_seed(7 + rank)
    cache = StaticCache(config=model.config, max_cache_len=CACHE)
    tokens = [torch.randint(0, VOCAB, (BATCH, 1), generator=gen).to(device) for _ in range(DECODE_STEPS)]
    with torch.no_grad():
        prompt = torch.randint(0, VOCAB, (BATCH, PROMPT), generator=gen).to(device)
        model(prompt, past_key_values=cache, cache_position=torch.arange(PROMPT, device=device))
        saved = [tensor.clone() for tensor in _cache_state(cache)]

        def decode(ids, position):
            return model(ids, past_key_values=cache, cache_position=position).logits

        eager = [decode(ids, torch.tensor([PROMPT + i], device=device)).clone() for i, ids in enumerate(tokens)]
        static_ids, static_position = tokens[0].clone(), torch.tensor([PROMPT], device=device)

        def warm_up():
            for _ in range(2):
                _restore(cache, saved)
                decode(static_ids, static_position)

        warm_up_on_side_stream(warm_up, device)
        _restore(cache, saved)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_logits = decode(static_ids, static_position)
        _restore(cache, saved)
        errors = []
        for i, (ids, want) in enumerate(zip(tokens, eager)):
            static_ids.copy_(ids)
            static_position.fill_(PROMPT + i)
            graph.replay()
            errors.append((static_logits.float() - want.float()).abs().max().item())
        torch.cuda.synchronize(device)
        model.moe_comm_dispatcher.check()
        step_change = min((a.float() - b.float()).abs().max().item() for a, b in zip(eager, eager[1:]))
    return dict(replay_errors=errors, step_change=step_change)


def _rank_main(rank: int, world: int, backend_id: str, receive_layout: str) -> dict:
    backend, section = GPU_BACKENDS[backend_id]
    device = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    options = dict(backend=backend, receive_layout=receive_layout, **section)
    results = {arch: compare_with_unmodified(build_model(arch), rank, TOKENS, device, torch.float32,
                                             max_tokens_per_rank=8, **options) for arch in ARCHS}
    results["bf16"] = {arch: compare_with_unmodified(build_model(arch, layers=1), rank, TOKENS, device,
                                                     torch.bfloat16, max_tokens_per_rank=16, **options)
                       for arch in ("qwen3_moe", "gpt_oss", "llama4_text", "dbrx")}
    results["decode"] = _captured_decode(device, rank, options)
    return results


# The integration only calls Dispatcher (every backend's agreement with the reference is
# test_gpu_dispatch's, at every world size): one backend, at world 2, where tokens cross ranks. A world
# of 1 runs the same integration code with nothing to exchange: the case this test ran besides cost
# ~20 s of the GPU suite and checked nothing that world 2 and test_gpu_dispatch's world 1 do not.
# Both receive layouts: token-major permutes and unpermutes around the same experts' calls.
@pytest.mark.parametrize("receive_layout", ["expert_major", "token_major"])
@pytest.mark.parametrize("backend_id, world", [("vmm", 2)])
def test_expert_parallel_transformers_on_gpu(backend_id, world, receive_layout, requires_gpus):
    gpus = requires_gpus(gpus_needed(backend_id, world))
    per_rank = run_ranks(_rank_main, world, backend_id, receive_layout, reuse=backend_id,
                         dist_backend=dist_backend_for(world, gpus), gpu=True, timeout_s=400)
    for rank, results in enumerate(per_rank):
        for arch in ARCHS:
            result = results[arch]
            # Llama 4 dispatches each of its 2 choices apart.
            assert result["calls"] == (8 if arch == "llama4_text" else 4) and result["kept"], \
                f"rank {rank} {arch}: {result}"
            assert result["logits"] < 1e-5 and result["grads"][0] < 1e-4, f"rank {rank} {arch}: {result}"
        for arch, result in results["bf16"].items():
            # One layer: the routing is the unmodified model's; only bf16 rounding differs.
            calls = 2 if arch == "llama4_text" else 1
            assert result["calls"] == calls and result["logits"] < 2e-2, f"rank {rank} bf16 {arch}: {result}"
            assert result["grads"][0] < 5e-2, f"rank {rank} bf16 {arch}: {result}"
        decode = results["decode"]
        assert decode["step_change"] > 0, f"rank {rank}: successive steps gave the same logits: {decode}"
        assert decode["replay_errors"] == [0.0] * DECODE_STEPS, f"rank {rank}: {decode}"
