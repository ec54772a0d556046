"""moe_comm.integrations.torchtitan on 2 gloo ranks with the reference backend (contract: integrations).

torchtitan's ``RoutedExperts`` and whole ``MoE`` (router, shared experts) holding E/2 experts a rank
with ``MoECommTokenDispatcher`` give what the same module holding all E experts with torchtitan's
``LocalTokenDispatcher`` gives: output, d x, d router weights and d expert weights. torchtitan's
debug DeepSeek-V3 (under torchtitan's full activation checkpointing) and Qwen3 MoE models trained at
EP=2 follow the EP=1 loss curve. The override selects the dispatcher; bad input is refused.
"""

from __future__ import annotations

import pytest
import torch

from requirements import require

require("torchtitan")

from moe_comm import ConfigError, InputError  # noqa: E402
from moe_comm.integrations.torchtitan import (  # noqa: E402
    MoECommTokenDispatcher, close_dispatchers, expert_parallel,
)
from multirank import run_ranks  # noqa: E402
from titan_models import (  # noqa: E402
    FLAVOURS, MOE_SHAPES, build, compare_moe, debug_model_config, ep_mesh, moe_config, moe_pair, train_ep,
    train_ep1, with_moe_comm,
)
from token_major_checks import differing_tensors  # noqa: E402

WORLD = 2
BATCH, SEQ = 2, 8  # tokens of one rank: T = 16
# Experts narrower than the flavours' (DeepSeek-V3 256, Qwen3 768) keep a CPU training step short.
EXPERT_HIDDEN = 64
STEPS = 10
MOE_COMM = {"backend": "reference", "dtype": "float32"}


def _rank_modules(rank: int, world: int) -> dict:
    mesh = ep_mesh()
    return {flavour: compare_moe(flavour, mesh, torch.device("cpu"), torch.float32, MOE_COMM, BATCH, SEQ,
                                 EXPERT_HIDDEN) for flavour in FLAVOURS}


def _rank_layouts(rank: int, world: int) -> list[str]:
    """DeepSeek-V3's whole MoE (router, routed and shared experts) at EP=world with moe_comm's ``receive_layout``
    expert_major and token_major, on the same weights and tokens: the names of the tensors (output, d x,
    every parameter's gradient) that differ in any bit."""
    mesh = ep_mesh()
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(BATCH, SEQ, MOE_SHAPES["deepseek_v3"][0], generator=gen)
    grad_out = torch.randn(x.shape, generator=gen)
    runs = []
    for layout in ("expert_major", "token_major"):
        _, parallel = moe_pair("deepseek_v3", mesh, torch.device("cpu"), torch.float32,
                               {**MOE_COMM, "receive_layout": layout}, BATCH * SEQ, EXPERT_HIDDEN)
        xs = x.clone().requires_grad_()
        out = parallel(xs)
        out.backward(grad_out)
        runs.append({"out": out, "dx": xs.grad, **{name: param.grad for name, param in parallel.named_parameters()}})
    close_dispatchers()
    return differing_tensors(*runs)


def _rank_all(rank: int, world: int) -> dict:
    """Every multi-rank scenario in one spawn (starting ranks that import torchtitan costs seconds each)."""
    results = {"modules": _rank_modules(rank, world), "layouts": _rank_layouts(rank, world),
               "errors": _rank_errors(rank, world), "shared": _rank_shared(rank, world), "fp8": _rank_fp8(rank, world)}
    # DeepSeek-V3 under torchtitan's full activation checkpointing: recomputed dispatches and combines.
    results["train"] = {flavour: {"ep2": train_ep(flavour, STEPS, BATCH * world, SEQ, torch.device("cpu"), MOE_COMM,
                                                  EXPERT_HIDDEN, activation_checkpointing=flavour == "deepseek_v3")}
                        for flavour in FLAVOURS}
    # EP=1 runs after every EP=2 run, one flavour a rank, so the two cores share them.
    for index, flavour in enumerate(FLAVOURS):
        if index % world == rank:
            results["train"][flavour]["ep1"] = train_ep1(flavour, STEPS, BATCH * world, SEQ, torch.device("cpu"),
                                                         EXPERT_HIDDEN)
    return results


@pytest.fixture(scope="module")
def ranks() -> list:
    return run_ranks(_rank_all, WORLD, timeout_s=240)


@pytest.fixture(scope="module")
def compared(ranks) -> list:
    return [result["modules"] for result in ranks]


def _check_against_local(compared: list, flavour: str, part: str, equal_keys: tuple) -> list[dict]:
    """Every rank's errors of ``part`` ("routed" or "moe"), checked; returned for the part's own checks.

    float32 tokens, experts computing in bf16 both ways: outputs and input gradients differ by the
    combine's summation order (worst seen 1.3e-7; d x, d scores, d router and d shared equal); the
    experts' weight gradients by bf16 rounding, one grouped GEMM over both ranks' rows against a sum
    of two (worst seen 5.5e-3).
    """
    results = [per_flavour[flavour][part] for per_flavour in compared]
    for rank, result in enumerate(results):
        for key in equal_keys:
            assert result[key] < 1e-6, f"rank {rank} {flavour} {part}: {result}"
        assert result["dexperts"] < 2e-2, f"rank {rank} {flavour} {part}: {result}"
    return results


# Both flavours: DeepSeek-V3's MoE has 2 shared experts and a softmax top-3 of 8 experts, Qwen3's
# none and a top-8 of 64.
@pytest.mark.parametrize("flavour", list(FLAVOURS))
def test_routed_experts_match_local_dispatcher(compared, flavour):
    for rank, result in enumerate(_check_against_local(compared, flavour, "routed", ("out", "dx", "dscores"))):
        # The counts include the alignment padding (zero rows: 16-row segments here) and stay within the capacity.
        assert result["received_rows"] < result["segment_rows"] <= result["capacity_rows"], f"rank {rank}: {result}"


@pytest.mark.parametrize("flavour", list(FLAVOURS))
def test_whole_moe_matches_local_dispatcher(compared, flavour):
    keys = ("out", "dx", "drouter") + (("dshared",) if flavour == "deepseek_v3" else ())
    _check_against_local(compared, flavour, "moe", keys)


@pytest.mark.parametrize("flavour", list(FLAVOURS))
def test_debug_model_trains_at_ep2_as_at_ep1(ranks, flavour):
    ep2 = ranks[0]["train"][flavour]["ep2"]
    ep1 = next(result["train"][flavour]["ep1"] for result in ranks if "ep1" in result["train"][flavour])
    assert ranks[1]["train"][flavour]["ep2"] == ep2  # the mean over ranks, on every rank
    assert len(ep2) == STEPS
    assert ep1[-1] < ep1[0] - 0.1, f"EP=1 did not train: {ep1}"
    # A different combine order, the experts' weight gradients rounded differently (above) and an
    # averaged all-reduce: the curves agree closely (worst seen 4.9e-5 on losses from 7.6 to 0.18).
    worst = max(abs(a - b) for a, b in zip(ep1, ep2))
    assert worst < 1e-3, f"{flavour}: EP=1 {ep1} against EP=2 {ep2}"


def test_token_major_layout_gives_the_expert_major_bits(ranks):
    # dispatch permutes, combine unpermutes: torchtitan's experts see the same rows, so every bit agrees.
    for rank, result in enumerate(ranks):
        assert result["layouts"] == [], f"rank {rank}: {result['layouts']}"


def test_override_selects_moe_comm_for_every_routed_experts():
    config = debug_model_config("deepseek_v3", layers=3)
    replaced = with_moe_comm(config, 4096, {"backend": "vmm"})
    dispatchers = [layer.moe.routed_experts.token_dispatcher for layer in replaced.layers if layer.moe is not None]
    originals = [layer.moe.routed_experts.token_dispatcher for layer in config.layers if layer.moe is not None]
    assert len(dispatchers) == 2
    for dispatcher, original in zip(dispatchers, originals):
        assert isinstance(dispatcher, MoECommTokenDispatcher.Config)
        assert (dispatcher.num_experts, dispatcher.top_k) == (original.num_experts, original.top_k)
        assert dispatcher.hidden_dim == config.dim
        assert dispatcher.num_max_tokens_per_rank == 4096
        assert dispatcher.moe_comm_config == {"backend": "vmm"}


def test_without_ep_mesh_it_is_the_local_dispatcher():
    moe = moe_config("deepseek_v3", EXPERT_HIDDEN)
    reference = build(moe, seed=0)
    local = with_moe_comm(moe, BATCH * SEQ, MOE_COMM).build()
    local.load_state_dict(reference.state_dict())
    local.routed_experts.token_dispatcher.wire_meshes(ep_mesh=None)
    x = torch.randn(BATCH, SEQ, reference.router.gate.in_features)
    assert torch.equal(local(x), reference(x))


def test_config_refuses_bad_sizes():
    with pytest.raises(ConfigError, match="num_max_tokens_per_rank: expected a positive integer, got 0"):
        MoECommTokenDispatcher.Config(num_experts=8, top_k=2, hidden_dim=64, num_max_tokens_per_rank=0).build()
    with pytest.raises(ConfigError, match="hidden_dim: expected a positive integer, got 6.5"):
        MoECommTokenDispatcher.Config(num_experts=8, top_k=2, hidden_dim=6.5).build()


def _rank_errors(rank: int, world: int) -> dict:
    mesh = ep_mesh()
    messages = {}
    unsized = MoECommTokenDispatcher.Config(num_experts=8, top_k=2, hidden_dim=64).build()
    try:
        unsized.wire_meshes(ep_mesh=mesh)
    except ConfigError as exc:
        messages["unsized"] = str(exc)
    dispatcher = MoECommTokenDispatcher.Config(num_experts=8, top_k=2, hidden_dim=64, num_max_tokens_per_rank=4,
                                               moe_comm_config=MOE_COMM).build()
    dispatcher.wire_meshes(ep_mesh=mesh)
    ids, scores = torch.zeros(5, 2, dtype=torch.int64), torch.ones(5, 2)
    counts = torch.zeros(8, dtype=torch.int64)
    for name, x in (("too_many", torch.zeros(5, 64)), ("dtype", torch.zeros(4, 64, dtype=torch.bfloat16))):
        try:
            dispatcher.dispatch(x, scores[:x.shape[0]], ids[:x.shape[0]], counts)
        except InputError as exc:
            messages[name] = str(exc)
    uneven = moe_config("deepseek_v3", EXPERT_HIDDEN)
    uneven.routed_experts.inner_experts.num_experts = 5
    try:
        expert_parallel(with_moe_comm(uneven, 4, MOE_COMM).build(), mesh)
    except ConfigError as exc:
        messages["uneven"] = str(exc)
    close_dispatchers()
    try:
        dispatcher.dispatch(torch.zeros(4, 64), scores[:4], ids[:4], counts)
    except Exception as exc:  # noqa: BLE001 - the type is part of what is checked
        messages["closed"] = f"{type(exc).__name__}: {exc}"
    return messages


def test_bad_input_gets_a_clear_error(ranks):
    for rank, messages in enumerate(result["errors"] for result in ranks):
        assert "num_max_tokens_per_rank unset" in messages.get("unsized", ""), f"rank {rank}: {messages}"
        assert "5 tokens, more than the config's num_max_tokens_per_rank=4" in messages.get("too_many", ""), messages
        assert "tokens in torch.bfloat16, but moe_comm moves float32 rows" in messages.get("dtype", ""), messages
        assert messages.get("closed", "").startswith("MoeCommError: this Dispatcher is closed"), messages
        assert "5 experts do not split over an EP mesh of 2" in messages.get("uneven", ""), messages


def _rank_fp8(rank: int, world: int) -> dict:
    """FP8 dispatch in both layouts: the experts get rows in the model's dtype (dequantized), and the rows' and
    the scores' gradients come back."""
    found = {}
    for layout in ("expert_major", "token_major"):
        config = {**MOE_COMM, "dispatch_dtype": "float8_e4m3fn", "receive_layout": layout}
        dispatcher = MoECommTokenDispatcher.Config(num_experts=4, top_k=2, hidden_dim=128, num_max_tokens_per_rank=8,
                                                   moe_comm_config=config).build()
        dispatcher.wire_meshes(ep_mesh=ep_mesh())
        gen = torch.Generator().manual_seed(rank)
        x = torch.randn(8, 128, generator=gen, requires_grad=True)
        scores = torch.rand(8, 2, generator=gen, requires_grad=True)
        ids = torch.randint(0, 4, (8, 2), generator=gen)
        rows, _, metadata = dispatcher.dispatch(x, scores, ids, torch.zeros(4, dtype=torch.int64))
        z = dispatcher.combine(rows * 2, metadata, x)
        z.sum().backward()
        found[layout] = (rows.dtype, x.grad is not None and bool(x.grad.abs().sum() > 0), scores.grad is not None)
        close_dispatchers()
    return found


def test_fp8_dispatch_hands_the_experts_rows_in_the_model_dtype(ranks):
    for rank, found in enumerate(result["fp8"] for result in ranks):
        assert found == {layout: (torch.float32, True, True) for layout in ("expert_major", "token_major")}, \
            f"rank {rank}: {found}"


def test_one_dispatcher_serves_every_layer(ranks):
    # Buffers are sized per (config, group), not per layer: L layers must not hold L sets.
    for rank, shared in enumerate(result["shared"] for result in ranks):
        assert shared == (2, 1), f"rank {rank}: {shared}"


def _rank_shared(rank: int, world: int) -> tuple[int, int]:
    config = with_moe_comm(debug_model_config("deepseek_v3", layers=3), BATCH * SEQ, MOE_COMM)
    routed = expert_parallel(config.build(), ep_mesh())
    found = (len(routed), len({id(m.token_dispatcher.dispatcher) for m in routed}))
    close_dispatchers()
    return found
