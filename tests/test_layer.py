"""MoELayer against the dense single-process reference: forward output and the gradients of
the input, the router weight and the expert weights (contract: layer / autograd)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from moe_comm import ConfigError, Dispatcher, InputError, load_config
from moe_comm.nn.experts import (
    grouped_experts,
    grouped_mm_unsupported,
    masked_experts,
    resolve_expert_impl,
    sliced_experts,
    swiglu,
)
from moe_comm.nn.layer import MoELayer, MoEWeights, moe_aux_loss, route, update_expert_biases
from moe_comm.nn.reference import build_dense_weights, dense_forward, dense_route
from layer_checks import BASE, FFN, TOLERANCE, assert_within, gather, layer_errors
from multirank import run_ranks
from requirements import missing
from segments import padding_rows
from token_major_checks import differing_tensors

# DeepSeek-V3's router on 8 experts: sigmoid scores, 4 groups of 2 of which each token keeps 2,
# a selection bias (aux-loss-free balancing), renormalised weights scaled by 2.5.
DEEPSEEK_ROUTER = dict(score="sigmoid", n_group=4, topk_group=2, routed_scaling_factor=2.5, bias_update_rate=0.01)
LOSSES = dict(aux_loss_coef=0.1, seq_aux_loss_coef=0.05, z_loss_coef=0.01)

# Scenario name -> (config overrides, renormalize, token shape, number of stacked layers, shared_ffn_hidden).
# BASE has max_tokens_per_rank 16: a shape of more tokens is sent in batch slices.
SCENARIOS = {
    # float32 end to end: the layer must match the reference to rounding.
    "float32": (dict(dtype="float32"), True, (16,), 1, None),
    # renormalize=False takes the other router path; [2, 5, H] input checks token flattening.
    "float32_raw_weights_3d": (dict(dtype="float32"), False, (2, 5), 1, None),
    # two layers sharing one Dispatcher, stacked: handles of one dispatcher across layers,
    # and gradients flowing through two dispatch/combine pairs.
    "float32_shared_dispatcher": (dict(dtype="float32"), True, (12,), 2, None),
    # bf16 is what GPUs run: the layer rounds to bf16 where the float32 reference does not.
    # expert_impl: loop named explicitly (auto resolves to it on CPU as well).
    "bfloat16": (dict(dtype="bfloat16", expert_impl="loop"), True, (16,), 1, None),
    # Router variants (renormalize None: the config's router section decides).
    "deepseek_router": (dict(dtype="float32", num_experts=8, router=DEEPSEEK_ROUTER), None, (16,), 2, None),
    "softmax_after_topk_raw": (dict(dtype="float32", router=dict(softmax_after_topk=True, renormalize=False)),
                               None, (16,), 1, None),
    # Every balancing loss in the training loss, over [2, 20, H]: 40 tokens in 3 batch slices, two sequences.
    "losses_sliced": (dict(dtype="float32", router=LOSSES), None, (2, 20), 2, None),
    "shared_experts": (dict(dtype="float32"), None, (12,), 2, 16),
    # Everything at once, in bf16: 24 tokens (2 batch slices) of 3 sequences.
    "bfloat16_all_features": (dict(dtype="bfloat16", num_experts=8, router={**DEEPSEEK_ROUTER, **LOSSES}),
                              None, (3, 8), 2, 16),
}


def _scenario(rank, world_size, backend, overrides, renormalize, shape, num_layers, shared_ffn_hidden):
    cfg = load_config(None, backend=backend, **{**BASE, **overrides})
    with Dispatcher(cfg) as disp:
        return layer_errors(disp, rank, world_size, renormalize, shape, num_layers,
                            shared_ffn_hidden=shared_ffn_hidden)


def _argument_errors(rank, world_size, backend):
    """Misuse is refused with typed errors that name the argument."""
    cfg = load_config(None, backend=backend, dtype="float32", **BASE)
    messages = {}
    with MoELayer(cfg, FFN) as layer:
        try:
            layer(torch.zeros(3, cfg.hidden + 1, device=layer.dispatcher.device))
        except InputError as exc:
            messages["bad_hidden"] = str(exc)
        try:
            layer(torch.zeros(3, cfg.hidden, dtype=torch.float64, device=layer.dispatcher.device))
        except InputError as exc:
            messages["bad_dtype"] = str(exc)
        try:
            MoELayer(cfg, FFN, group=dist.group.WORLD, dispatcher=layer.dispatcher)
        except ConfigError as exc:
            messages["group_and_dispatcher"] = str(exc)
        try:
            MoELayer(load_config(None, backend=backend, dtype="float32", **{**BASE, "topk": 1}), FFN,
                     dispatcher=layer.dispatcher)
        except ConfigError as exc:
            messages["other_config"] = str(exc)
        try:
            MoELayer(load_config(None, backend=backend, dtype="float32", expert_impl="grouped_mm", **BASE), FFN)
        except ConfigError as exc:
            messages["grouped_mm_on_cpu"] = str(exc)
    return messages


SHARED = 8  # the shared experts' width in the weights-loading checks


def _random_weights(cfg, seed: int, shared: bool = False) -> MoEWeights:
    """Every expert's weights (and shared experts' if ``shared``), the same on every rank (as a checkpoint gives them)."""
    gen = torch.Generator().manual_seed(seed)
    experts, hidden = cfg.num_experts, cfg.hidden
    return MoEWeights(router=torch.randn(experts, hidden, generator=gen) / hidden**0.5,
                      w_gate_up=torch.randn(experts, hidden, 2 * FFN, generator=gen) / hidden**0.5,
                      w_down=torch.randn(experts, FFN, hidden, generator=gen) / FFN**0.5,
                      shared_w_gate_up=torch.randn(hidden, 2 * SHARED, generator=gen) / hidden**0.5 if shared else None,
                      shared_w_down=torch.randn(SHARED, hidden, generator=gen) / SHARED**0.5 if shared else None)


def _given_weights(rank, world_size, backend):
    """Layers built from given weights (every expert's, or this rank's only) against the dense
    reference on the same weights; the state dict round trip and its refusals."""
    cfg = load_config(None, backend=backend, dtype="float32", **BASE)
    results = {}
    with Dispatcher(cfg) as disp:
        given = [_random_weights(cfg, 40 + i) for i in range(2)]
        for local in (False, True):
            results[f"given_{'local' if local else 'global'}"] = layer_errors(
                disp, rank, world_size, True, (10,), 2, given=given, local=local)
        with_shared = [_random_weights(cfg, 50 + i, shared=True) for i in range(2)]
        results["given_shared"] = layer_errors(disp, rank, world_size, True, (10,), 2, given=with_shared, local=True)
        shared_layer = MoELayer(cfg, dispatcher=disp, weights=with_shared[0])
        results["shared_width"] = shared_layer.shared_ffn_hidden
        results["shared_state"] = sorted(k for k in shared_layer.state_dict() if k.startswith("shared"))
        layer = MoELayer(cfg, dispatcher=disp, weights=given[0])
        state = layer.state_dict()
        results["expert_ids"] = state["expert_ids"].tolist()
        other = MoELayer(cfg, FFN, dispatcher=disp, seed=3)
        other.load_state_dict(state)
        results["round_trip"] = all(torch.equal(a, b) for a, b in zip(other.state_dict().values(), state.values()))
        foreign = dict(state, expert_ids=state["expert_ids"] + 1)
        messages = {}
        for name, build in {
            "foreign_state": lambda: other.load_state_dict(foreign),
            "experts_dim": lambda: MoELayer(cfg, dispatcher=disp, weights=MoEWeights(
                given[0].router, given[0].w_gate_up[:3], given[0].w_down[:3])),
            "ffn_mismatch": lambda: MoELayer(cfg, FFN + 1, dispatcher=disp, weights=given[0]),
            "router_shape": lambda: MoELayer(cfg, dispatcher=disp, weights=MoEWeights(
                given[0].router.t(), given[0].w_gate_up, given[0].w_down)),
            "not_weights": lambda: MoELayer(cfg, dispatcher=disp, weights={"router": given[0].router}),
            "shared_missing": lambda: MoELayer(cfg, dispatcher=disp, weights=given[0], shared_ffn_hidden=SHARED),
            "shared_width": lambda: MoELayer(cfg, dispatcher=disp, weights=with_shared[0], shared_ffn_hidden=SHARED + 1),
            "shared_bad": lambda: MoELayer(cfg, FFN, dispatcher=disp, shared_ffn_hidden=0),
            "renormalize_bad": lambda: MoELayer(cfg, FFN, dispatcher=disp, renormalize="yes"),
        }.items():
            try:
                build()
            except ConfigError as exc:
                messages[name] = str(exc)
        results["weight_errors"] = messages
    return results


def _balancing_state(rank, world_size, backend):
    """The per-expert loads, the aux-loss-free bias update and the model-level helpers on two layers
    with batches sent in slices, against counts of the gathered routings; and what eval mode leaves alone."""
    cfg = load_config(None, backend=backend, dtype="float32", **{**BASE, "num_experts": 8},
                      router=dict(bias_update_rate=0.05, aux_loss_coef=0.01))
    rate = cfg.router.bias_update_rate
    results = {}
    with Dispatcher(cfg) as disp:
        model = torch.nn.Sequential(*(MoELayer(cfg, FFN, dispatcher=disp, seed=s) for s in (1, 2)))
        gen = torch.Generator().manual_seed(50 + rank)
        lo, hi = rank * disp.num_local_experts, (rank + 1) * disp.num_local_experts
        loads = [torch.zeros(cfg.num_experts, dtype=torch.int64) for _ in model]
        received_ok = True
        for _ in range(2):
            model(torch.randn(20, cfg.hidden, generator=gen))  # 20 tokens > max_tokens_per_rank: 2 batch slices
            for i, layer in enumerate(model):
                per_rank = gather(world_size, layer.expert_load)
                total = sum(per_rank)
                loads[i] += total
                # The rows this rank's experts received: every rank's assignments to them.
                received_ok &= torch.equal(layer.last_tokens_per_expert.long(), total[lo:hi])
                counted = torch.bincount(layer.last_topk_idx.reshape(-1), minlength=cfg.num_experts)
                received_ok &= torch.equal(per_rank[rank], counted)
        results["received_ok"] = received_ok
        results["aux_sum"] = float((moe_aux_loss(model) - (model[0].aux_loss + model[1].aux_loss)).detach())
        update_expert_biases(model)
        results["bias_ok"] = all(
            torch.equal(layer.expert_bias, rate * torch.sign(load.float().mean() - load.float()))
            for layer, load in zip(model, loads))
        results["biases"] = [layer.expert_bias.clone() for layer in model]
        results["pending_zero"] = all(int(layer.pending_load.abs().sum()) == 0 for layer in model)
        results["state_keys"] = sorted(k for k in model[0].state_dict() if k.startswith(("expert_bias", "pending")))
        # The bias chooses the experts: a forward now picks as the reference does with it.
        model.eval()
        x = torch.randn(16, cfg.hidden, generator=gen)
        model(x)
        results["eval"] = (model[0].aux_loss, moe_aux_loss(model), int(model[0].pending_load.abs().sum()))
        want, _ = dense_route(x, model[0].router.weight.detach(), cfg.topk, cfg.router,
                              expert_bias=model[0].expert_bias)
        results["biased_choice_ok"] = torch.equal(want.sort(-1).values, model[0].last_topk_idx.sort(-1).values)
        plain = MoELayer(load_config(cfg.to_dict(), router={"bias_update_rate": 0.0}), FFN)
        try:
            plain.update_expert_bias()
        except ConfigError as exc:
            results["no_bias_error"] = str(exc)
        plain.close()
    return results


def _unwritten_padding(rank, world_size, backend):
    """zero_padding off: the padding rows (all 0xFF bytes, NaN, on the reference backend) reach no
    output of an inference step, and the layer refuses to record the experts' weight gradients."""
    cfg = load_config(None, backend=backend, dtype="float32", **BASE)
    generator = torch.Generator().manual_seed(90 + rank)
    x = torch.randn(BASE["max_tokens_per_rank"], BASE["hidden"], generator=generator)
    layers = [MoELayer(load_config(cfg.to_dict(), zero_padding=zero), FFN, seed=4) for zero in (True, False)]
    results = {}
    try:
        with torch.no_grad():
            results["same_outputs"] = torch.equal(layers[0](x), layers[1](x))
        with torch.inference_mode():
            results["inference_mode_ok"] = torch.equal(layers[0](x), layers[1](x))
        out = layers[1].dispatcher.dispatch(x, layers[1].last_topk_idx, layers[1].last_topk_weights)
        padding = padding_rows(out)
        results["padding_rows"] = padding.numel()
        results["padding_nan"] = bool(out.x[padding].isnan().all())
        try:
            layers[1](x)
        except ConfigError as exc:
            results["grad_error"] = str(exc)
        # Frozen weights: autograd records no weight gradient, so the layer runs under grad mode.
        for param in layers[1].parameters():
            param.requires_grad_(False)
        results["frozen_ok"] = torch.equal(layers[1](x), layers[0](x).detach())
    finally:
        for layer in layers:
            layer.close()
    return results


def _layouts_bitwise(rank, world_size, backend) -> list[str]:
    """The bfloat16_all_features scenario's layers once on an expert-major and once on a token-major
    Dispatcher (the same seeds, tokens and upstream): the names of the tensors that differ in any bit
    (output, balancing loss, the input's and every parameter's gradient)."""
    overrides, _, shape, num_layers, shared_ffn_hidden = SCENARIOS["bfloat16_all_features"]
    runs = []
    for layout in ("expert_major", "token_major"):
        cfg = load_config(None, backend=backend, receive_layout=layout, **{**BASE, **overrides})
        with Dispatcher(cfg) as disp:
            model = torch.nn.Sequential(*(MoELayer(cfg, FFN, dispatcher=disp, seed=7 + i,
                                                   shared_ffn_hidden=shared_ffn_hidden) for i in range(num_layers)))
            gen = torch.Generator().manual_seed(1000 + rank)
            x = torch.randn(*shape, cfg.hidden, generator=gen).to(cfg.torch_dtype).requires_grad_()
            upstream = torch.randn(*shape, cfg.hidden, generator=gen)
            z = model(x)
            aux_loss = moe_aux_loss(model)
            (aux_loss + (z.float() * upstream).sum()).backward()
            runs.append({"output": z, "aux_loss": aux_loss, "grad x": x.grad,
                         **{f"grad {name}": param.grad for name, param in model.named_parameters()}})
    return differing_tensors(*runs)


def _layer_repr(backend):
    with MoELayer(load_config(None, backend=backend, dtype="float32", **BASE), FFN) as layer:
        return repr(layer)


def _all_scenarios(rank, world_size, backend, names):
    results = {name: _scenario(rank, world_size, backend, *SCENARIOS[name]) for name in names}
    results["errors"] = _argument_errors(rank, world_size, backend)
    results["repr"] = _layer_repr(backend)
    results["weights"] = _given_weights(rank, world_size, backend)
    results["balancing"] = _balancing_state(rank, world_size, backend)
    results["unwritten_padding"] = _unwritten_padding(rank, world_size, backend)
    results["layouts_differ_in"] = _layouts_bitwise(rank, world_size, backend)
    return results


def _check(per_rank: list, names) -> None:
    for rank, results in enumerate(per_rank):
        for name in names:
            dtype = load_config(None, **{**BASE, **SCENARIOS[name][0]}).torch_dtype
            assert_within(results[name], TOLERANCE[dtype], f"rank {rank}, scenario {name}")
        messages = results["errors"]
        assert "hidden" in messages["bad_hidden"] and "33" in messages["bad_hidden"]
        assert messages["bad_dtype"] == "MoELayer x: expected dtype float32 (the config's dtype), got torch.float64"
        assert "group" in messages["group_and_dispatcher"]
        assert "config differs" in messages["other_config"]
        assert "'expert_impl'" in messages["grouped_mm_on_cpu"] and "not a CUDA GPU" in messages["grouped_mm_on_cpu"]
        # Each count and the expert implementation under its own name.
        world_size = len(per_rank)
        layer_repr = results["repr"]
        assert f"num_experts={BASE['num_experts']}, num_local_experts={BASE['num_experts'] // world_size}, " \
               f"rank={rank}/{world_size}" in layer_repr, layer_repr
        assert "expert_impl='loop'" in layer_repr and " experts=" not in layer_repr, layer_repr
        weights = results["weights"]
        for name in ("given_global", "given_local", "given_shared"):
            assert_within(weights[name], TOLERANCE[torch.float32], f"rank {rank}, {name}")
        assert weights["shared_width"] == SHARED
        assert weights["shared_state"] == ["shared_w_down", "shared_w_gate_up"]
        local = BASE["num_experts"] // world_size
        assert weights["expert_ids"] == list(range(rank * local, (rank + 1) * local))
        assert weights["round_trip"]
        errors = weights["weight_errors"]
        assert "holds global experts" in errors["foreign_state"] and "this rank holds" in errors["foreign_state"]
        assert "weights.w_gate_up" in errors["experts_dim"] and "[3, 32, 48]" in errors["experts_dim"]
        assert "weights.w_gate_up" in errors["ffn_mismatch"] and f"2 * {FFN + 1}" not in errors["ffn_mismatch"]
        assert "weights.router" in errors["router_shape"] and "[4, 32]" in errors["router_shape"]
        assert "MoEWeights" in errors["not_weights"]
        assert "weights.shared_w_gate_up" in errors["shared_missing"] and "got None" in errors["shared_missing"]
        assert "weights.shared_w_gate_up" in errors["shared_width"] and f"[32, {2 * (SHARED + 1)}]" in errors["shared_width"]
        assert "shared_ffn_hidden: got 0" in errors["shared_bad"]
        assert "renormalize: got 'yes'" in errors["renormalize_bad"]
        balancing = results["balancing"]
        assert balancing["received_ok"] and balancing["bias_ok"] and balancing["pending_zero"], balancing
        assert balancing["aux_sum"] == 0.0
        assert balancing["state_keys"] == ["expert_bias"]  # the pending load is not saved
        assert balancing["eval"] == (None, 0.0, 0), balancing["eval"]  # eval mode: no loss, no load counted
        assert balancing["biased_choice_ok"]
        assert "'router.bias_update_rate' is 0" in balancing["no_bias_error"]
        for mine, first in zip(balancing["biases"], per_rank[0]["balancing"]["biases"]):
            assert torch.equal(mine, first), "the expert bias must stay the same on every rank"
        unwritten = results["unwritten_padding"]
        assert unwritten["same_outputs"] and unwritten["inference_mode_ok"] and unwritten["frozen_ok"], unwritten
        assert unwritten["padding_rows"] > 0 and unwritten["padding_nan"], unwritten
        assert "MoELayer: config key 'zero_padding' is false" in unwritten["grad_error"]
        assert "torch.no_grad()" in unwritten["grad_error"]
        # receive_layout token_major: the same bits as expert_major, forward and backward.
        assert results["layouts_differ_in"] == [], f"rank {rank}: {results['layouts_differ_in']}"


# World 1 keeps every expert local (no exchange); world 2 moves tokens between ranks. One
# spawn per world size runs every scenario (each spawn costs every rank an `import torch`).
@pytest.mark.parametrize("world_size", [1, 2])
def test_layer_matches_dense_reference_cpu(world_size):
    per_rank = run_ranks(_all_scenarios, world_size, "reference", list(SCENARIOS), timeout_s=180)
    _check(per_rank, SCENARIOS)


def test_dense_forward_matches_per_token_loop():
    # dense_forward (route + reference.dense_moe) against the definition written out per token.
    cfg = load_config(None, backend="reference", dtype="float32", **BASE)
    weights = build_dense_weights(cfg, FFN, seed=3)
    x = torch.randn(9, cfg.hidden, generator=torch.Generator().manual_seed(0))
    for renormalize in (True, False):
        probs = torch.softmax(x @ weights.router.T, dim=-1)
        want = torch.zeros_like(x)
        for t in range(x.shape[0]):
            top = probs[t].topk(cfg.topk)
            scale = top.values.sum() if renormalize else 1.0
            for w, e in zip(top.values, top.indices):
                want[t] += (w / scale) * swiglu(x[t : t + 1], weights.w_gate_up[e], weights.w_down[e])[0]
        got = dense_forward(x, weights, topk=cfg.topk, renormalize=renormalize)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_dense_weights_are_deterministic_and_seeded():
    cfg = load_config(None, backend="reference", dtype="bfloat16", **BASE)
    a, b = build_dense_weights(cfg, FFN, seed=1), build_dense_weights(cfg, FFN, seed=1)
    c = build_dense_weights(cfg, FFN, seed=2)
    assert torch.equal(a.w_gate_up, b.w_gate_up) and torch.equal(a.router, b.router)
    assert not torch.equal(a.w_gate_up, c.w_gate_up) and not torch.equal(a.router, c.router)
    assert a.router.dtype == torch.float32 and a.w_down.dtype == torch.bfloat16
    assert a.w_gate_up.shape == (cfg.num_experts, cfg.hidden, 2 * FFN) and a.w_down.shape == (cfg.num_experts, FFN, cfg.hidden)
    # Experts differ from each other (each has its own stream of the seed).
    assert not torch.equal(a.w_gate_up[0], a.w_gate_up[1])
    with pytest.raises(ConfigError, match="seed"):
        build_dense_weights(cfg, FFN, seed=-1)


def test_route_with_given_ids_reweights_them():
    router = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))
    x = torch.randn(5, 8, generator=torch.Generator().manual_seed(1))
    idx, weights = route(x, router, 2, True)
    assert idx.dtype == torch.int64 and weights.dtype == torch.float32
    torch.testing.assert_close(weights.sum(-1), torch.ones(5))
    same_idx, same_weights = route(x, router, 2, True, topk_idx=idx.to(torch.int32))
    assert torch.equal(same_idx, idx)
    torch.testing.assert_close(same_weights, weights)


def _segments(lengths, align, extra_rows):
    """expert_offsets int32 for segments holding ``lengths`` rows, each padded to ``align``; total rows."""
    ends, end = [], 0
    for n in lengths:
        end += -(-n // align) * align
        ends.append(end)
    return torch.tensor(ends, dtype=torch.int32), end + extra_rows


# Every implementation must give the sliced loop's outputs and gradients on the rows a segment
# holds, and stay finite when the rows past the last segment (unspecified in the dispatch
# contract) hold NaN: their zero output gradient must not become 0 * NaN in a weight gradient.
# Lengths include an empty expert and one that fills its aligned segment exactly.
@pytest.mark.parametrize("impl", ["masked", "grouped"])
def test_expert_implementations_match_sliced_loop(impl):
    gen = torch.Generator().manual_seed(5)
    hidden, ffn = 16, 8
    offsets, num_rows = _segments([5, 0, 8, 3], align=4, extra_rows=6)
    end = int(offsets[-1])
    rows = torch.randn(num_rows, hidden, generator=gen)
    rows[end:] = float("nan")
    w_gate_up = torch.randn(4, hidden, 2 * ffn, generator=gen) / 4
    w_down = torch.randn(4, ffn, hidden, generator=gen) / 3
    upstream = torch.randn(num_rows, hidden, generator=gen)
    upstream[end:] = 0.0  # what combine's backward gives rows no entry maps to

    def run(fn):
        leaves = [t.clone().requires_grad_() for t in (rows, w_gate_up, w_down)]
        out = fn(leaves[0], offsets, leaves[1], leaves[2])
        (out[:end] * upstream[:end]).sum().backward()
        return out[:end].detach(), [leaf.grad for leaf in leaves]

    if impl == "grouped":
        try:
            torch._grouped_mm(rows[:4], w_gate_up, offs=torch.tensor([4, 4, 4, 4], dtype=torch.int32))
        except (AttributeError, RuntimeError, NotImplementedError) as exc:
            missing("grouped_mm", f"torch._grouped_mm does not run on this torch's CPU: {exc}")
    fn = masked_experts if impl == "masked" else grouped_experts
    want, want_grads = run(sliced_experts)
    got, got_grads = run(fn)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_grads[0][:end], want_grads[0][:end], rtol=1e-5, atol=1e-5)
    for name, g, w in zip(("w_gate_up", "w_down"), got_grads[1:], want_grads[1:]):
        assert torch.isfinite(g).all(), f"{impl}: NaN/Inf in the gradient of {name}"
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    if impl == "masked":
        assert torch.equal(fn(rows, offsets, w_gate_up, w_down)[end:], torch.zeros(num_rows - end, hidden))


def test_expert_impl_choice(monkeypatch):
    cfg = load_config(None, backend="reference", dtype="bfloat16", **BASE)
    cpu = torch.device("cpu")
    assert resolve_expert_impl(cfg, cpu, FFN) == "loop"
    assert resolve_expert_impl(load_config(cfg.to_dict(), expert_impl="loop"), cpu, FFN) == "loop"
    with pytest.raises(ConfigError, match=r"'expert_impl'.*not a CUDA GPU"):
        resolve_expert_impl(load_config(cfg.to_dict(), expert_impl="grouped_mm"), cpu, FFN)
    # The GPU conditions, with the device's compute capability faked (no GPU needed).
    gpu = torch.device("cuda", 0)
    capability = {"value": (9, 0)}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability["value"])
    assert grouped_mm_unsupported(gpu, torch.bfloat16, FFN) is None
    assert resolve_expert_impl(cfg, gpu, FFN) == "grouped_mm"
    assert "not bfloat16" in grouped_mm_unsupported(gpu, torch.float32, FFN)
    assert "multiple of 8" in grouped_mm_unsupported(gpu, torch.bfloat16, 12)
    assert resolve_expert_impl(cfg, gpu, 12) == "loop"  # auto falls back where grouped_mm cannot run
    capability["value"] = (10, 0)
    assert grouped_mm_unsupported(gpu, torch.bfloat16, FFN) is None
    capability["value"] = (8, 0)
    assert "compute capability 8.0" in grouped_mm_unsupported(gpu, torch.bfloat16, FFN)
    with pytest.raises(ConfigError, match=r"'expert_impl': got 'grouped_mm'.*compute capability 8\.0"):
        resolve_expert_impl(load_config(cfg.to_dict(), expert_impl="grouped_mm"), gpu, FFN)
