"""MoELayer against the dense single-process reference: forward output and the gradients of
the input, the router weight and the expert weights (contract: layer / autograd)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from moe_comm import ConfigError, Dispatcher, InputError, load_config
from moe_comm.layer import MoELayer, build_dense_weights, dense_forward, route, swiglu
from multirank import run_ranks

FFN = 24
# Small shapes so one spawn runs every scenario in a few seconds on a 2-core CI machine;
# expert_alignment 4 makes the experts' segments carry zero padding rows.
BASE = dict(num_experts=4, topk=2, hidden=32, max_tokens_per_rank=16, expert_alignment=4)
# Scenario name -> (config overrides, renormalize, token shape, number of stacked layers).
SCENARIOS = {
    # float32 end to end: the layer must match the reference to rounding.
    "float32": (dict(dtype="float32"), True, (16,), 1),
    # renormalize=False takes the other router path; [2, 5, H] input checks token flattening.
    "float32_raw_weights_3d": (dict(dtype="float32"), False, (2, 5), 1),
    # two layers sharing one Dispatcher, stacked: handles of one dispatcher across layers,
    # and gradients flowing through two dispatch/combine pairs.
    "float32_shared_dispatcher": (dict(dtype="float32"), True, (12,), 2),
    # bf16 is what GPUs run: the layer rounds to bf16 where the float32 reference does not.
    "bfloat16": (dict(dtype="bfloat16"), True, (16,), 1),
}
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max |want|: scale-free, so one tolerance per dtype fits every tensor."""
    got, want = got.detach().float(), want.detach().float()
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-30))


def _gather(rank, world_size, tensor):
    """Every rank's ``tensor`` (moved through the CPU), in rank order."""
    gathered = [None] * world_size
    dist.all_gather_object(gathered, tensor.detach().cpu())
    return gathered


def _scenario(rank, world_size, backend, overrides, renormalize, shape, num_layers):
    cfg = load_config(None, backend=backend, **BASE, **overrides)
    disp = Dispatcher(cfg)
    device = disp.device
    layers = [MoELayer(cfg, FFN, dispatcher=disp, renormalize=renormalize, seed=7 + i) for i in range(num_layers)]
    gen = torch.Generator().manual_seed(1000 + rank)
    x = torch.randn(*shape, cfg.hidden, generator=gen).to(device=device, dtype=cfg.torch_dtype).requires_grad_()
    upstream = torch.randn(*shape, cfg.hidden, generator=gen).to(device=device, dtype=cfg.torch_dtype)
    z = x
    routings = []
    for layer in layers:
        z = layer(z)
        routings.append(_gather(rank, world_size, layer.last_topk_idx))
    (z.float() * upstream.float()).sum().backward()

    # The reference: every rank recomputes all ranks' tokens densely, in float32, with the
    # routing the layers chose (so a near-tie cannot pick different experts in the two runs).
    xs = [t.to(device).float().requires_grad_() for t in _gather(rank, world_size, x)]
    upstreams = [t.to(device).float() for t in _gather(rank, world_size, upstream)]
    dense = [build_dense_weights(cfg, FFN, 7 + i, dtype=torch.float32, device=device) for i in range(num_layers)]
    for weights in dense:
        for tensor in (weights.router, weights.w_gate_up, weights.w_down):
            tensor.requires_grad_()
    loss = 0.0
    for r in range(world_size):
        zr = xs[r]
        for weights, idx in zip(dense, routings):
            zr = dense_forward(zr, weights, topk=cfg.topk, renormalize=renormalize, topk_idx=idx[r].to(device))
        loss = loss + (zr * upstreams[r]).sum()
        if r == rank:
            z_ref = zr
    loss.backward()

    lo, hi = rank * disp.num_local_experts, (rank + 1) * disp.num_local_experts
    errors = {"output": _rel_err(z, z_ref), "grad_x": _rel_err(x.grad, xs[rank].grad)}
    for i, (layer, weights) in enumerate(zip(layers, dense)):
        router_grad = layer.router.weight.grad.clone()
        dist.all_reduce(router_grad)  # each rank's router gradient covers its own tokens only
        errors[f"grad_router{i}"] = _rel_err(router_grad, weights.router.grad)
        errors[f"grad_w_gate_up{i}"] = _rel_err(layer.w_gate_up.grad, weights.w_gate_up.grad[lo:hi])
        errors[f"grad_w_down{i}"] = _rel_err(layer.w_down.grad, weights.w_down.grad[lo:hi])
        # The layer's experts are the dense weights' slice of this rank, bit for bit.
        same = torch.equal(layer.w_gate_up.detach().float(), weights.w_gate_up.detach()[lo:hi])
        errors[f"weights_match{i}"] = 0.0 if same else 1.0
    disp.check()
    disp.close()
    return errors


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
            MoELayer(cfg, FFN, group=dist.group.WORLD, dispatcher=layer.dispatcher)
        except ConfigError as exc:
            messages["group_and_dispatcher"] = str(exc)
        try:
            MoELayer(load_config(None, backend=backend, dtype="float32", **{**BASE, "topk": 1}), FFN,
                     dispatcher=layer.dispatcher)
        except ConfigError as exc:
            messages["other_config"] = str(exc)
    return messages


def _all_scenarios(rank, world_size, backend, names):
    results = {name: _scenario(rank, world_size, backend, *SCENARIOS[name]) for name in names}
    results["errors"] = _argument_errors(rank, world_size, backend)
    return results


def _check(per_rank: list, names) -> None:
    for rank, results in enumerate(per_rank):
        for name in names:
            dtype = load_config(None, **SCENARIOS[name][0]).torch_dtype
            bad = {key: err for key, err in results[name].items() if not err <= TOLERANCE[dtype]}
            assert not bad, f"rank {rank}, scenario {name}: relative errors over {TOLERANCE[dtype]}: {bad}"
        messages = results["errors"]
        assert "hidden" in messages["bad_hidden"] and "33" in messages["bad_hidden"]
        assert "group" in messages["group_and_dispatcher"]
        assert "config differs" in messages["other_config"]


# World 1 keeps every expert local (no exchange); world 2 moves tokens between ranks. One
# spawn per world size runs every scenario (each spawn costs every rank an `import torch`).
@pytest.mark.parametrize("world_size", [1, 2])
def test_layer_matches_dense_reference_cpu(world_size):
    per_rank = run_ranks(_all_scenarios, world_size, "reference", list(SCENARIOS), timeout_s=180)
    _check(per_rank, SCENARIOS)


@pytest.mark.gpu
def test_layer_matches_dense_reference_gpu(requires_gpus):
    # The GPU backend with bf16 takes the torch._grouped_mm expert path (sm_90+).
    world_size = requires_gpus(2)
    per_rank = run_ranks(_all_scenarios, world_size, "vmm", list(SCENARIOS), gpu=True,
                         dist_backend="cpu:gloo,cuda:nccl", timeout_s=300)
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
