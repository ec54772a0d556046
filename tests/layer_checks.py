"""MoELayer against the dense single-process reference, shared by the CPU and GPU layer tests.

``layer_errors`` runs stacked ``MoELayer``s on one rank's tokens, forward and backward, and
recomputes every rank's tokens densely in float32 (:func:`moe_comm.reference.dense_forward`, with the
routing the layers chose, so a near-tie cannot pick different experts in the two runs). It
returns scale-free relative errors: ``max |got - want| / max |want|`` per tensor.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from moe_comm import Dispatcher
from moe_comm.layer import MoELayer, MoEWeights
from moe_comm.reference import build_dense_weights, dense_forward

__all__ = ["FFN", "BASE", "TOLERANCE", "rel_err", "gather", "layer_errors", "assert_within"]

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


def gather(world_size: int, tensor: torch.Tensor) -> list:
    """Every rank's ``tensor`` (moved through the CPU), in rank order."""
    gathered = [None] * world_size
    dist.all_gather_object(gathered, tensor.detach().cpu())
    return gathered


def layer_errors(disp: Dispatcher, rank: int, world_size: int, renormalize: bool, shape: tuple,
                 num_layers: int, given: Optional[list] = None, local: bool = False) -> dict:
    """Relative errors of ``num_layers`` stacked layers on ``disp`` against the dense reference.

    Args:
        disp: the shared Dispatcher (its config picks dtype and expert implementation).
        shape: the token dimensions of the input (``[*shape, H]``).
        given: one global :class:`MoEWeights` per layer to build the layers from (else from seeds);
            the reference uses the same weights. local: hand each layer only this rank's experts.

    Returns:
        name -> relative error: ``output``, ``grad_x`` and per layer ``i`` the router and both
        expert weights' gradients, plus ``weights_match{i}`` (0 when the layer's experts are the
        dense weights' slice of this rank, bit for bit).
    """
    cfg = disp.config
    device = disp.device
    lo, hi = rank * disp.num_local_experts, (rank + 1) * disp.num_local_experts
    if given is None:
        layers = [MoELayer(cfg, FFN, dispatcher=disp, renormalize=renormalize, seed=7 + i) for i in range(num_layers)]
        dense = [build_dense_weights(cfg, FFN, 7 + i, dtype=torch.float32, device=device) for i in range(num_layers)]
    else:
        handed = [MoEWeights(w.router, w.w_gate_up[lo:hi], w.w_down[lo:hi]) if local else w for w in given]
        layers = [MoELayer(cfg, dispatcher=disp, renormalize=renormalize, weights=w) for w in handed]
        # The reference computes with the values the layers hold (rounded to the config dtype), in
        # copies of its own: its gradients must not accumulate into the caller's tensors.
        def held(tensor, dtype):
            return tensor.detach().to(dtype).to(device=device, dtype=torch.float32, copy=True)

        dense = [MoEWeights(held(w.router, torch.float32), held(w.w_gate_up, cfg.torch_dtype),
                            held(w.w_down, cfg.torch_dtype)) for w in given]
    gen = torch.Generator().manual_seed(1000 + rank)
    x = torch.randn(*shape, cfg.hidden, generator=gen).to(device=device, dtype=cfg.torch_dtype).requires_grad_()
    upstream = torch.randn(*shape, cfg.hidden, generator=gen).to(device=device, dtype=cfg.torch_dtype)
    z = x
    routings = []
    for layer in layers:
        z = layer(z)
        routings.append(gather(world_size, layer.last_topk_idx))
    (z.float() * upstream.float()).sum().backward()

    xs = [t.to(device).float().requires_grad_() for t in gather(world_size, x)]
    upstreams = [t.to(device).float() for t in gather(world_size, upstream)]
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

    errors = {"output": rel_err(z, z_ref), "grad_x": rel_err(x.grad, xs[rank].grad)}
    for i, (layer, weights) in enumerate(zip(layers, dense)):
        router_grad = layer.router.weight.grad.clone()
        dist.all_reduce(router_grad)  # each rank's router gradient covers its own tokens only
        errors[f"grad_router{i}"] = rel_err(router_grad, weights.router.grad)
        errors[f"grad_w_gate_up{i}"] = rel_err(layer.w_gate_up.grad, weights.w_gate_up.grad[lo:hi])
        errors[f"grad_w_down{i}"] = rel_err(layer.w_down.grad, weights.w_down.grad[lo:hi])
        same = torch.equal(layer.w_gate_up.detach().float(), weights.w_gate_up.detach()[lo:hi])
        errors[f"weights_match{i}"] = 0.0 if same else 1.0
    disp.check()
    return errors


def assert_within(errors: dict, tolerance: float, what: str) -> None:
    """Fail naming every error over ``tolerance`` (a NaN fails too)."""
    bad = {key: err for key, err in errors.items() if not err <= tolerance}
    assert not bad, f"{what}: relative errors over {tolerance}: {bad}"
