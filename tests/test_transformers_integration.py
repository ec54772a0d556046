"""moe_comm.integrations.transformers.expert_parallel on 2 gloo ranks with the reference backend
(contract: integrations): a tiny model of each architecture (the experts interface's families and
the MoE blocks moe_comm adapts: Llama 4 text, DBRX, JetMoE) made expert-parallel gives the
unmodified model's logits and gradients (within e4m3's rounding with FP8 dispatch), each rank keeps
only its experts, the model compiles into one graph (fullgraph), bad input is refused."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from requirements import require

require("transformers")

from hf_models import ARCHS, VOCAB, PlainExperts, build_model, compare_with_unmodified, rel_err  # noqa: E402
from moe_comm import ConfigError, InputError, load_config  # noqa: E402
from moe_comm.integrations.transformers import expert_parallel  # noqa: E402
from multirank import run_ranks  # noqa: E402
from token_major_checks import differing_tensors  # noqa: E402

WORLD = 2
# 2 x 8 tokens a rank with max_tokens_per_rank 8: every experts forward makes two dispatch/combine pairs.
TOKENS, MAX_TOKENS = (2, 8), 8


def _rank_compare(rank: int, world: int) -> dict:
    results = {}
    for arch in ARCHS:
        # One arch from a moe_comm Config (whose model-given keys are replaced), the others from overrides.
        config = load_config(None, num_experts=64, hidden=8) if arch == "mixtral" else None
        results[arch] = compare_with_unmodified(build_model(arch), rank, TOKENS, torch.device("cpu"),
                                                torch.float32, config=config, backend="reference",
                                                max_tokens_per_rank=MAX_TOKENS)
    return results


@pytest.fixture(scope="module")
def compared() -> list:
    return run_ranks(_rank_compare, WORLD, timeout_s=300)


@pytest.mark.parametrize("arch", ARCHS)
def test_expert_parallel_model_matches_unmodified(compared, arch):
    for rank, per_arch in enumerate(compared):
        result = per_arch[arch]
        # 2 layers x 2 batch slices, all through moe_comm; Llama 4 dispatches each of its 2 choices apart.
        assert result["calls"] == (8 if arch == "llama4_text" else 4), f"rank {rank} {arch}: {result}"
        assert result["kept"], f"rank {rank} {arch}: the experts' weights are not this rank's slices"
        # float32 both ways; only the summation order differs.
        assert result["logits"] < 1e-5, f"rank {rank} {arch}: {result}"
        assert result["grads"][0] < 1e-4, f"rank {rank} {arch}: {result}"


def _rank_fp8(rank: int, world: int) -> dict:
    # FP8 dispatch scales blocks of 128 channels: a model that wide.
    return compare_with_unmodified(build_model("qwen3_moe", hidden=128), rank, TOKENS, torch.device("cpu"),
                                   torch.float32, backend="reference", max_tokens_per_rank=MAX_TOKENS,
                                   dispatch_dtype="float8_e4m3fn")


def test_expert_parallel_model_with_fp8_dispatch_trains_close_to_unmodified():
    # The experts run on dequantized e4m3 rows and the gradients pass straight through: logits and
    # gradients within e4m3's few percent. The bounds are ~3x and ~2.4x the largest relative errors
    # seen here (logits 0.25%, gradients 6.2%), so a change that doubles either error shows.
    for rank, result in enumerate(run_ranks(_rank_fp8, WORLD, timeout_s=120)):
        assert result["calls"] == 4 and result["kept"], f"rank {rank}: {result}"
        assert 0 < result["logits"] < 0.008, f"rank {rank}: {result}"
        assert 0 < result["grads"][0] < 0.15, f"rank {rank}: {result}"


def _rank_layouts(rank: int, world: int) -> dict:
    """Per arch (the experts interface's path, and an adapted block's), the names of the tensors (logits and
    every parameter's gradient) that differ in any bit between the model made expert-parallel with
    ``receive_layout`` expert_major and with token_major."""
    differ = {}
    for arch in ("qwen3_moe", "llama4_text"):
        runs = []
        for layout in ("expert_major", "token_major"):
            model = expert_parallel(build_model(arch), backend="reference", max_tokens_per_rank=MAX_TOKENS,
                                    receive_layout=layout)
            input_ids = torch.randint(0, VOCAB, TOKENS, generator=torch.Generator().manual_seed(rank))
            logits = model(input_ids).logits
            (logits.float() ** 2).mean().backward()
            runs.append({"logits": logits, **{name: param.grad for name, param in model.named_parameters()}})
            model.moe_comm_dispatcher.close()
        differ[arch] = differing_tensors(*runs)
    return differ


def test_token_major_layout_gives_the_expert_major_bits():
    # Batch slices of MAX_TOKENS (two per forward), forward and backward.
    for rank, differ in enumerate(run_ranks(_rank_layouts, WORLD, timeout_s=120)):
        assert differ == {"qwen3_moe": [], "llama4_text": []}, f"rank {rank}: {differ}"


def _rank_meta_device(rank: int, world: int) -> float:
    """The README's low-memory recipe: a model built on the meta device, made expert-parallel, materialised
    and loaded with this rank's slices (here from a model made expert-parallel the usual way); its logits'
    relative error against the same model never made expert-parallel."""
    unmodified = build_model("qwen3_moe")
    usual = expert_parallel(build_model("qwen3_moe"), backend="reference")
    with torch.device("meta"):
        model = type(usual)(usual.config)
    expert_parallel(model, backend="reference", dtype="float32")
    model.to_empty(device="cpu")
    # to_empty leaves non-persistent buffers (not in any checkpoint) uninitialised: build them again.
    model.model.rotary_emb = type(model.model.rotary_emb)(model.config)
    model.load_state_dict(usual.state_dict())
    input_ids = torch.randint(0, VOCAB, TOKENS, generator=torch.Generator().manual_seed(rank))
    return rel_err(model(input_ids).logits, unmodified(input_ids).logits)


def test_a_model_built_on_the_meta_device_loads_only_its_experts():
    errors = run_ranks(_rank_meta_device, WORLD, timeout_s=120)
    # float32 both ways; only the summation order differs.
    assert all(error < 1e-5 for error in errors), errors


def _rank_refusals(rank: int, world: int) -> dict:
    """The errors of a world size that does not divide the experts, of a model converted afterwards and
    of training without zero padding; inference without it."""
    messages = {}
    try:
        expert_parallel(build_model("qwen3_moe", num_experts=3), backend="reference")
    except ConfigError as exc:
        messages["world"] = str(exc)
    model = expert_parallel(build_model("plain"), backend="reference")
    try:
        model.to(torch.bfloat16)(torch.zeros(1, 4, dtype=torch.long))
    except InputError as exc:
        messages["dtype"] = str(exc)
    # zero_padding off: gradients through the experts refused; inference as with zero padding.
    zeroed = expert_parallel(build_model("plain"), backend="reference")
    unwritten = expert_parallel(build_model("plain"), backend="reference", zero_padding=False)
    tokens = torch.arange(8).reshape(1, 8) % VOCAB
    try:
        unwritten(tokens)
    except ConfigError as exc:
        messages["zero_padding"] = str(exc)
    with torch.no_grad():
        messages["inference_same"] = torch.equal(unwritten(tokens).logits, zeroed(tokens).logits)
    return messages


def test_refusals_a_world_size_not_dividing_the_experts_a_later_dtype_change_and_training_without_zero_padding():
    for messages in run_ranks(_rank_refusals, WORLD, timeout_s=120):
        assert "num_experts" in messages["world"] and "3" in messages["world"], messages
        assert all(word in messages["dtype"] for word in ("PlainExperts", "bfloat16", "float32", "dtype=")), messages
        assert messages["zero_padding"].startswith("PlainExperts (moe_comm experts): config key 'zero_padding'"), \
            messages
        assert messages["inference_same"], messages


class _NoMoe(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)


def _renamed_weights() -> nn.Module:
    """An experts module that declares the interface's flags but names its weights otherwise."""
    model = build_model("plain")
    for experts in model.experts:
        experts.w1 = experts.up_proj
        del experts.up_proj
    return model


def _wrong_shape() -> nn.Module:
    model = build_model("plain")
    experts = model.experts[1]
    experts.down_proj_bias = nn.Parameter(torch.zeros(experts.num_experts, 31))
    return model


def _twice() -> nn.Module:
    model = build_model("plain")
    model.moe_comm_dispatcher = object()
    return model


@pytest.mark.parametrize("make, words", [
    (_NoMoe, ["_NoMoe", "no MoE experts module"]),
    (_renamed_weights, [PlainExperts.__name__, "cannot handle", "up_proj"]),
    (_wrong_shape, [PlainExperts.__name__, "wrong shape", "down_proj_bias (4, 31)", "(4, 32)"]),
    (_twice, ["PlainMoeModel", "already"]),
])
def test_bad_model_is_refused_with_its_name(make, words):
    with pytest.raises(ConfigError) as info:
        expert_parallel(make(), backend="reference")
    for word in words:
        assert word in str(info.value), str(info.value)


def _rank_compiled(rank: int, world: int, dispatch_dtype) -> dict:
    # FP8 dispatch scales blocks of 128 channels: a model that wide.
    model = build_model("gpt_oss", hidden=32 if dispatch_dtype is None else 128)
    expert_parallel(model, backend="reference", max_tokens_per_rank=MAX_TOKENS, dispatch_dtype=dispatch_dtype)
    input_ids = torch.randint(0, VOCAB, TOKENS, generator=torch.Generator().manual_seed(rank))
    explain = torch._dynamo.explain(model)(input_ids)
    results = {"graphs": explain.graph_count, "breaks": explain.graph_break_count}
    for name, forward in (("eager", model), ("compiled", torch.compile(model, fullgraph=True, backend="aot_eager"))):
        model.zero_grad(set_to_none=True)
        logits = forward(input_ids).logits
        (logits.float() ** 2).mean().backward()
        results[name] = [logits.detach()] + [param.grad.clone() for param in model.parameters()]
    results["max_diff"] = max((a - b).abs().max().item() for a, b in zip(results.pop("eager"), results.pop("compiled")))
    return results


@pytest.mark.parametrize("dispatch_dtype", [None, "float8_e4m3fn"])
def test_expert_parallel_model_compiles_into_one_graph(dispatch_dtype):
    # The traced graph run without code generation (aot_eager): the ops and their autograd exactly,
    # FP8 dispatch's too (the same e4m3 bytes, the same straight-through backward).
    for rank, result in enumerate(run_ranks(_rank_compiled, WORLD, dispatch_dtype, timeout_s=300)):
        assert (result["graphs"], result["breaks"]) == (1, 0), f"rank {rank}: {result}"
        assert result["max_diff"] == 0.0, f"rank {rank}: {result}"
