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

pytest.importorskip("torchtitan", reason="torchtitan is not installed (pip install '.[torchtitan]')")

import torch.distributed as dist  # noqa: E402
from torchtitan.models.common.token_dispatcher import LocalTokenDispatcher  # noqa: E402

from moe_comm import ConfigError, InputError  # noqa: E402
from moe_comm.integrations.torchtitan import MoECommTokenDispatcher, close_dispatchers  # noqa: E402
from multirank import run_ranks  # noqa: E402
from titan_models import (  # noqa: E402
    FLAVOURS, build, debug_model_config, ep_mesh, full_ac, is_expert_weight, make_expert_parallel, moe_of,
    token_batches, train_losses, with_moe_comm,
)

WORLD = 2
BATCH, SEQ = 2, 8  # tokens of one rank: T = 16
# Experts narrower than the flavours' (DeepSeek-V3 256, Qwen3 768) keep a CPU training step short.
EXPERT_HIDDEN = 64
STEPS = 10
MOE_COMM = {"backend": "reference", "dtype": "float32"}


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs().max() / want.abs().max()).item()


def _moe_pair(flavour: str, mesh):
    """A MoE layer of the flavour with all E experts and torchtitan's local dispatcher, and the same
    layer (same weights) at EP=world with moe_comm's."""
    moe = moe_of(debug_model_config(flavour, layers=2, expert_hidden=EXPERT_HIDDEN))
    dispatcher = moe.routed_experts.token_dispatcher
    moe.routed_experts.token_dispatcher = LocalTokenDispatcher.Config(num_experts=dispatcher.num_experts,
                                                                      top_k=dispatcher.top_k)
    reference = build(moe, seed=0)
    parallel = with_moe_comm(moe, BATCH * SEQ, MOE_COMM).build()
    parallel.load_state_dict(reference.state_dict())
    make_expert_parallel(parallel, mesh)
    return reference, parallel


def _grads_against_local(reference, parallel, mesh) -> dict[str, float]:
    """Relative gradient errors per parameter; the experts' against the sum over ranks of the full module's, sliced."""
    rank, world = mesh.get_local_rank(), mesh.size()
    errors = {}
    expected = dict(reference.named_parameters())
    for name, param in parallel.named_parameters():
        want = expected[name].grad
        if is_expert_weight(name):
            want = want.clone()
            dist.all_reduce(want)
            local = want.shape[0] // world
            want = want[rank * local:(rank + 1) * local]
        errors[name] = _relative(param.grad, want)
    return errors


def _rank_modules(rank: int, world: int) -> dict:
    mesh = ep_mesh("cpu")
    gen = torch.Generator().manual_seed(rank)
    results = {}
    for flavour in FLAVOURS:
        reference, parallel = _moe_pair(flavour, mesh)
        dim = reference.router.gate.in_features
        x = torch.randn(BATCH, SEQ, dim, generator=gen)
        grad_out = torch.randn(BATCH, SEQ, dim, generator=gen)

        # RoutedExperts alone, on the router's routing, scores requiring grad.
        with torch.no_grad():
            scores, expert_ids, _ = reference.router(x)
        counts = torch.bincount(expert_ids.flatten(), minlength=reference.router.num_experts)
        outs, grads = [], []
        for module in (reference, parallel):
            xs, ss = x.clone().requires_grad_(), scores.clone().requires_grad_()
            out = module.routed_experts(xs, ss, expert_ids, counts)
            out.backward(grad_out)
            outs.append(out)
            grads.append((xs.grad, ss.grad))
        dispatched = parallel.routed_experts.token_dispatcher.dispatch(
            x.flatten(0, 1), scores.flatten(0, 1), expert_ids.flatten(0, 1), counts)
        received = counts.clone()
        dist.all_reduce(received)
        local = received.numel() // world
        routed = {
            "out": _relative(outs[1], outs[0]),
            "dx": _relative(grads[1][0], grads[0][0]),
            "dscores": _relative(grads[1][1], grads[0][1]),
            "segment_rows": int(dispatched[1].sum()),
            "received_rows": int(received[rank * local:(rank + 1) * local].sum()),
            "capacity_rows": dispatched[0].shape[0],
        }
        errors = _grads_against_local(reference.routed_experts, parallel.routed_experts, mesh)
        routed["dexperts"] = max(errors.values())
        for module in (reference, parallel):
            module.zero_grad()

        # The whole MoE: router, routed experts, shared experts.
        outs, dxs = [], []
        for module in (reference, parallel):
            xs = x.clone().requires_grad_()
            out = module(xs)
            out.backward(grad_out)
            outs.append(out)
            dxs.append(xs.grad)
        errors = _grads_against_local(reference, parallel, mesh)
        whole = {"out": _relative(outs[1], outs[0]), "dx": _relative(dxs[1], dxs[0]),
                 "dexperts": max(e for n, e in errors.items() if is_expert_weight(n)),
                 "drouter": errors["router.gate.weight"],
                 "dshared": max((e for n, e in errors.items() if n.startswith("shared_experts")), default=None)}
        results[flavour] = {"routed": routed, "moe": whole}
    return results


def _rank_all(rank: int, world: int) -> dict:
    """Every multi-rank scenario in one spawn (starting ranks that import torchtitan costs seconds each)."""
    results = {"modules": _rank_modules(rank, world), "errors": _rank_errors(rank, world),
               "shared": _rank_shared(rank, world)}
    results["train"] = {flavour: _rank_train(rank, world, flavour) for flavour in FLAVOURS}
    # EP=1 runs after every EP=2 run, one flavour a rank, so the two cores share them.
    for index, flavour in enumerate(FLAVOURS):
        if index % world == rank:
            results["train"][flavour]["ep1"] = _train_ep1(flavour)
    return results


@pytest.fixture(scope="module")
def ranks() -> list:
    return run_ranks(_rank_all, WORLD, timeout_s=240)


@pytest.fixture(scope="module")
def compared(ranks) -> list:
    return [result["modules"] for result in ranks]


# Both flavours: DeepSeek-V3's MoE has 2 shared experts and a softmax top-3 of 8 experts, Qwen3's
# none and a top-8 of 64.
@pytest.mark.parametrize("flavour", list(FLAVOURS))
def test_routed_experts_match_local_dispatcher(compared, flavour):
    for rank, per_flavour in enumerate(compared):
        result = per_flavour[flavour]["routed"]
        # The experts compute in bf16 both ways; only the summation order of the combine differs.
        for key in ("out", "dx", "dscores", "dexperts"):
            assert result[key] < 1e-2, f"rank {rank} {flavour}: {result}"
        # The counts include the alignment padding (zero rows: 16-row segments here) and stay within the capacity.
        assert result["received_rows"] < result["segment_rows"] <= result["capacity_rows"], f"rank {rank}: {result}"


@pytest.mark.parametrize("flavour", list(FLAVOURS))
def test_whole_moe_matches_local_dispatcher(compared, flavour):
    for rank, per_flavour in enumerate(compared):
        result = per_flavour[flavour]["moe"]
        for key in ("out", "dx", "dexperts", "drouter"):
            assert result[key] < 1e-2, f"rank {rank} {flavour}: {result}"
        if flavour == "deepseek_v3":
            assert result["dshared"] is not None and result["dshared"] < 1e-5, f"rank {rank}: {result}"


def _rank_train(rank: int, world: int, flavour: str) -> dict:
    """EP=2 training with moe_comm (DeepSeek-V3 under torchtitan's full activation checkpointing)."""
    config = debug_model_config(flavour, layers=2, expert_hidden=EXPERT_HIDDEN)
    batches = token_batches(config.vocab_size, STEPS, BATCH * world, SEQ, rank, world, torch.device("cpu"))
    parallel = build(with_moe_comm(config, BATCH * SEQ, MOE_COMM), seed=0)
    make_expert_parallel(parallel, ep_mesh("cpu"))
    if flavour == "deepseek_v3":
        full_ac(parallel)
    losses = {"ep2": train_losses(parallel, batches, world)}
    close_dispatchers()
    return losses


def _train_ep1(flavour: str) -> list[float]:
    """The same training at EP=1 with torchtitan's own dispatcher, on the whole batch."""
    config = debug_model_config(flavour, layers=2, expert_hidden=EXPERT_HIDDEN)
    batches = token_batches(config.vocab_size, STEPS, BATCH * WORLD, SEQ, 0, 1, torch.device("cpu"))
    return train_losses(build(config, seed=0), batches, 1)


@pytest.mark.parametrize("flavour", list(FLAVOURS))
def test_debug_model_trains_at_ep2_as_at_ep1(ranks, flavour):
    ep2 = ranks[0]["train"][flavour]["ep2"]
    ep1 = next(result["train"][flavour]["ep1"] for result in ranks if "ep1" in result["train"][flavour])
    assert ranks[1]["train"][flavour]["ep2"] == ep2  # the mean over ranks, on every rank
    assert len(ep2) == STEPS
    assert ep1[-1] < ep1[0] - 0.1, f"EP=1 did not train: {ep1}"
    # bf16 experts, a different combine order and an averaged all-reduce: the curves agree to bf16
    # rounding, which memorising one batch amplifies as the loss falls (worst seen: 0.015).
    worst = max(abs(a - b) for a, b in zip(ep1, ep2))
    assert worst < 0.05, f"{flavour}: EP=1 {ep1} against EP=2 {ep2}"


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
    moe = moe_of(debug_model_config("deepseek_v3", layers=2))
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
    mesh = ep_mesh("cpu")
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


def test_one_dispatcher_serves_every_layer(ranks):
    # Buffers are sized per (config, group), not per layer: L layers must not hold L sets.
    for rank, shared in enumerate(result["shared"] for result in ranks):
        assert shared == (2, 1), f"rank {rank}: {shared}"


def _rank_shared(rank: int, world: int) -> tuple[int, int]:
    config = with_moe_comm(debug_model_config("deepseek_v3", layers=3), BATCH * SEQ, MOE_COMM)
    routed = make_expert_parallel(config.build(), ep_mesh("cpu"))
    found = (len(routed), len({id(m.token_dispatcher.dispatcher) for m in routed}))
    close_dispatchers()
    return found
