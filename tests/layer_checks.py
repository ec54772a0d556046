"""MoELayer against the dense single-process reference, shared by the CPU and GPU layer tests.

``layer_errors`` runs stacked ``MoELayer``s on one rank's tokens, forward and backward, and
recomputes every rank's tokens densely in float32 (:func:`moe_comm.nn.reference.dense_forward`, with the
routing the layers chose, so a near-tie cannot pick different experts in the two runs). The
config's ``router`` section applies to both; the first layer's choice is checked on its own
against :func:`moe_comm.nn.reference.dense_route`, and the balancing losses the config enables are
added to the training loss on both sides (:func:`moe_comm.nn.reference.dense_balancing_losses`). It
returns scale-free relative errors: ``max |got - want| / max |want|`` per tensor.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist

from capture import warm_up_on_side_stream
from moe_comm import Dispatcher
from moe_comm.nn.balancing import expert_counts
from moe_comm.nn.layer import MoELayer, MoEWeights
from moe_comm.nn.reference import build_dense_weights, dense_balancing_losses, dense_forward, dense_route

__all__ = ["FFN", "BASE", "TOLERANCE", "rel_err", "gather", "layer_errors", "assert_within", "paired_layer_errors",
           "decode_graph_errors"]

FFN = 24  # a multiple of 8: bf16 rows of 48 bytes, as torch._grouped_mm needs
# Small shapes so one spawn runs every scenario in a few seconds on a 2-core CI machine;
# expert_alignment 4 makes the experts' segments carry zero padding rows.
BASE = dict(num_experts=4, topk=2, hidden=32, max_tokens_per_rank=16, expert_alignment=4)
# float32: rounding only. bfloat16: the layer rounds activations and outputs to bf16 (8 bits of
# mantissa) where the float32 reference does not.
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max |want|: scale-free, so one tolerance per dtype fits every tensor."""
    got, want = got.detach().float(), want.detach().float()
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-30))


def _norm_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.detach().float() - want.detach().float()).norm() / want.detach().float().norm())


def paired_layer_errors(layer: MoELayer, baseline: MoELayer, x: torch.Tensor) -> dict:
    """``layer`` against ``baseline`` (the same weights, e.g. FP8 dispatch against config-dtype dispatch)
    on ``x`` [T, H], forward and backward of ``mean(out ** 2)``: the relative norm of the difference
    ``|got - want| / |want|`` of the output (``output``), the input gradient (``input_grad``) and the
    largest over the parameters' gradients (``weight_grad``)."""
    outputs, input_grads = [], []
    for model in (layer, baseline):
        leaf = x.clone().requires_grad_()
        out = model(leaf)
        out.float().square().mean().backward()
        outputs.append(out)
        input_grads.append(leaf.grad)
    return {"output": _norm_err(*outputs), "input_grad": _norm_err(*input_grads),
            "weight_grad": max(_norm_err(a.grad, b.grad) for a, b in zip(layer.parameters(), baseline.parameters())
                               if b.grad is not None)}


def gather(world_size: int, tensor: torch.Tensor) -> list:
    """Every rank's ``tensor`` (moved through the CPU), in rank order."""
    gathered = [None] * world_size
    dist.all_gather_object(gathered, tensor.detach().cpu())
    return gathered


def _random_bias(cfg, layer_index: int) -> torch.Tensor:
    """A selection bias the same on every rank, large enough to change some tokens' choice."""
    gen = torch.Generator().manual_seed(77 + layer_index)
    return torch.randn(cfg.num_experts, generator=gen) * 0.2


def layer_errors(disp: Dispatcher, rank: int, world_size: int, renormalize: Optional[bool], shape: tuple,
                 num_layers: int, given: Optional[list] = None, local: bool = False,
                 shared_ffn_hidden: Optional[int] = None) -> dict:
    """Relative errors of ``num_layers`` stacked layers on ``disp`` against the dense reference.

    Args:
        disp: the shared Dispatcher (its config picks dtype, expert implementation and router).
        renormalize: as ``MoELayer``'s (None: the config's).
        shape: the token dimensions of the input (``[*shape, H]``); more than
            ``max_tokens_per_rank`` tokens are sent in batch slices.
        given: one global :class:`MoEWeights` per layer to build the layers from (else from seeds);
            the reference uses the same weights (shared experts included). local: hand each layer only
            this rank's experts.
        shared_ffn_hidden: build the (seeded) layers with shared experts of this width.

    Returns:
        name -> relative error: ``output``, ``grad_x`` and per layer ``i`` the router and both
        expert weights' gradients (and the shared experts', if any), ``weights_match{i}`` (0 when
        the layer's experts are the dense weights' slice of this rank, bit for bit), ``aux_loss{i}``
        when the config enables a balancing loss, ``pending_load{i}`` when it keeps a bias (0 when
        the accumulated load is this rank's count of the routing, exactly), and ``choice0`` (the
        fraction of tokens whose experts differ from the reference's choice for the first layer).
    """
    cfg = disp.config
    device = disp.device
    lo, hi = rank * disp.num_local_experts, (rank + 1) * disp.num_local_experts
    if given is None:
        layers = [MoELayer(cfg, FFN, dispatcher=disp, renormalize=renormalize, seed=7 + i,
                           shared_ffn_hidden=shared_ffn_hidden) for i in range(num_layers)]
        dense = [build_dense_weights(cfg, FFN, 7 + i, dtype=torch.float32, device=device,
                                     shared_ffn_hidden=shared_ffn_hidden) for i in range(num_layers)]
    else:
        handed = [dataclasses.replace(w, w_gate_up=w.w_gate_up[lo:hi], w_down=w.w_down[lo:hi]) if local else w
                  for w in given]
        layers = [MoELayer(cfg, dispatcher=disp, renormalize=renormalize, weights=w) for w in handed]
        # The reference computes with the values the layers hold (rounded to the config dtype), in
        # copies of its own: its gradients must not accumulate into the caller's tensors.
        def held(tensor, dtype):
            if tensor is None:
                return None
            return tensor.detach().to(dtype).to(device=device, dtype=torch.float32, copy=True)

        dense = [MoEWeights(held(w.router, torch.float32), held(w.w_gate_up, cfg.torch_dtype),
                            held(w.w_down, cfg.torch_dtype), held(w.shared_w_gate_up, cfg.torch_dtype),
                            held(w.shared_w_down, cfg.torch_dtype)) for w in given]
    gen = torch.Generator().manual_seed(1000 + rank)
    x = torch.randn(*shape, cfg.hidden, generator=gen).to(device=device, dtype=cfg.torch_dtype).requires_grad_()
    upstream = torch.randn(*shape, cfg.hidden, generator=gen).to(device=device, dtype=cfg.torch_dtype)
    biases = []
    for i, layer in enumerate(layers):
        if layer.expert_bias is not None:
            layer.expert_bias.copy_(_random_bias(cfg, i))
        biases.append(layer.expert_bias)
    z = x
    routings = []
    loss = 0.0
    for layer in layers:
        z = layer(z)
        routings.append(gather(world_size, layer.last_topk_idx))
        if layer.aux_loss is not None:
            loss = loss + layer.aux_loss
    (loss + (z.float() * upstream.float()).sum()).backward()

    xs = [t.to(device).float().requires_grad_() for t in gather(world_size, x)]
    upstreams = [t.to(device).float() for t in gather(world_size, upstream)]
    for weights in dense:
        for tensor in (weights.router, weights.w_gate_up, weights.w_down, weights.shared_w_gate_up,
                       weights.shared_w_down):
            if tensor is not None:
                tensor.requires_grad_()
    losses = [[None] * num_layers for _ in range(world_size)]
    ref_loss = 0.0
    for r in range(world_size):
        zr = xs[r]
        for i, (weights, idx) in enumerate(zip(dense, routings)):
            terms = dense_balancing_losses(zr, weights.router, idx[r].to(device), cfg.router)
            if terms:
                losses[r][i] = sum(terms.values())
                ref_loss = ref_loss + losses[r][i]
            zr = dense_forward(zr, weights, topk=cfg.topk, renormalize=renormalize, topk_idx=idx[r].to(device),
                               router=cfg.router)
        ref_loss = ref_loss + (zr * upstreams[r]).sum()
        if r == rank:
            z_ref = zr
    ref_loss.backward()

    errors = {"output": rel_err(z, z_ref), "grad_x": rel_err(x.grad, xs[rank].grad)}
    # The first layer's choice against the reference's, on the same tokens (rounded as the layer saw them).
    want_idx, _ = dense_route(x.detach().reshape(-1, cfg.hidden), dense[0].router, cfg.topk, cfg.router,
                              expert_bias=biases[0])
    got_idx = layers[0].last_topk_idx
    errors["choice0"] = float((want_idx.sort(-1).values != got_idx.sort(-1).values).any(-1).float().mean())
    for i, (layer, weights) in enumerate(zip(layers, dense)):
        replicated = [("router", layer.router.weight, weights.router)]
        if layer.shared_w_gate_up is not None:
            replicated += [("shared_w_gate_up", layer.shared_w_gate_up, weights.shared_w_gate_up),
                           ("shared_w_down", layer.shared_w_down, weights.shared_w_down)]
        for name, param, want in replicated:
            grad = param.grad.clone()
            dist.all_reduce(grad)  # each rank's gradient of a replicated weight covers its own tokens only
            errors[f"grad_{name}{i}"] = rel_err(grad, want.grad)
        errors[f"grad_w_gate_up{i}"] = rel_err(layer.w_gate_up.grad, weights.w_gate_up.grad[lo:hi])
        errors[f"grad_w_down{i}"] = rel_err(layer.w_down.grad, weights.w_down.grad[lo:hi])
        same = torch.equal(layer.w_gate_up.detach().float(), weights.w_gate_up.detach()[lo:hi])
        errors[f"weights_match{i}"] = 0.0 if same else 1.0
        if losses[rank][i] is not None:
            errors[f"aux_loss{i}"] = rel_err(layer.aux_loss, losses[rank][i])
        if layer.pending_load is not None:
            counted = torch.equal(layer.pending_load, expert_counts(routings[i][rank].to(device), cfg.num_experts))
            errors[f"pending_load{i}"] = 0.0 if counted else 1.0
    disp.check()
    return errors


def decode_graph_errors(layer: MoELayer, tokens: Callable[[int], torch.Tensor], buckets: Sequence[int],
                        order: Sequence[int], before_replay: Callable[[], None] = lambda: None) -> dict:
    """Graph-replayed forwards of ``layer`` (on a CUDA device) against eager calls, as a decode loop runs them.

    One forward per batch size of ``buckets`` is captured, in that order, sharing one memory pool,
    after a warm-up of each on a side stream (torch's whole-network capture recipe). Then for each
    batch size ``n`` of ``order``: ``before_replay()`` (e.g. to move state the graphs must read),
    fresh tokens ``tokens(n)`` ``[n, H]`` into the graph's static input, its output filled with NaN
    (a row the replay does not write fails the comparison), a replay, and an eager call on the same
    tokens. Returns ``{"replay i (T=n)": rel_err}``; no gradients are recorded.
    """
    static = {n: tokens(n) for n in buckets}
    graphs = {}
    with torch.no_grad():
        def warm_up():
            for n in buckets:
                layer(static[n])

        warm_up_on_side_stream(warm_up)
        pool = torch.cuda.graph_pool_handle()
        for n in buckets:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = layer(static[n])
            graphs[n] = (graph, out)
        errors = {}
        for step, n in enumerate(order):
            before_replay()
            x = tokens(n)
            graph, out = graphs[n]
            static[n].copy_(x)
            out.fill_(float("nan"))
            graph.replay()
            got = out.clone()
            errors[f"replay {step} (T={n})"] = rel_err(got, layer(x))
    return errors


def assert_within(errors: dict, tolerance: float, what: str) -> None:
    """Fail naming every error over ``tolerance`` (a NaN fails too)."""
    bad = {key: err for key, err in errors.items() if not err <= tolerance}
    assert not bad, f"{what}: relative errors over {tolerance}: {bad}"
