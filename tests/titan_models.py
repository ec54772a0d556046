"""torchtitan's debug MoE models for the torchtitan integration's tests, EP = 1 against EP = world.

The models are torchtitan's own classes and flavours (DeepSeek-V3 ``debugmodel``, Qwen3
``debugmodel_moe``), cut to their first ``layers`` blocks to keep CPU runs short, with torchtitan's
``ScaledDotProductAttention`` inside: its default FlexAttention has no backward on CPU. EP = world
is what torchtitan's ``parallelize`` leaves on each rank, built without it (it needs FSDP and CUDA)
by the integration's ``expert_parallel``: every ``RoutedExperts`` keeps its block of ``E / world``
experts and the moe_comm dispatcher, selected with the integration's override, is wired to the EP mesh.
"""

from __future__ import annotations

import copy
from functools import partial
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from torchtitan.config import OverrideConfig, apply_overrides
from torchtitan.distributed.activation_checkpoint import FullAC
from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention
from torchtitan.models.common.config_utils import (
    make_ffn_config, make_moe_config, make_routed_experts_config, make_router_config,
)
from torchtitan.models.common.moe import MoE
from torchtitan.models.common.token_dispatcher import LocalTokenDispatcher

from moe_comm.integrations.torchtitan import close_dispatchers, expert_parallel

OVERRIDE = "moe_comm.integrations.torchtitan.moe_comm_dispatcher"
FLAVOURS = ("deepseek_v3", "qwen3")
# The MoE layer of each flavour's debug model: (dim, experts, top-k, expert width, shared experts,
# router options). torchtitan 0.3's model packages need a torch newer than 2.11 (they import
# torch.distributed.fsdp.DataParallelMeshDims); its MoE layer and configs do not, so the layer is
# built from torchtitan's config helpers and runs on torch 2.11 too.
MOE_SHAPES = {
    "deepseek_v3": (256, 8, 3, 256, 2, {"score_func": "softmax"}),
    "qwen3": (256, 64, 8, 768, 0, {"score_func": "softmax", "route_norm": True}),
}
EXPERT_WEIGHTS = ("w1_EFD", "w2_EDF", "w3_EFD")
_INIT = {"weight": partial(nn.init.trunc_normal_, std=0.02), "bias": nn.init.zeros_}
_EXPERTS_INIT = {name: partial(nn.init.trunc_normal_, std=0.02) for name in EXPERT_WEIGHTS}


def _registry(flavour: str):
    if flavour == "deepseek_v3":
        from torchtitan.models.deepseek_v3 import model_registry

        return model_registry("debugmodel")
    from torchtitan.models.qwen3 import model_registry

    return model_registry("debugmodel_moe")


def moe_config(flavour: str, expert_hidden: Optional[int] = None) -> MoE.Config:
    """A torchtitan ``MoE`` shaped as the flavour's debug model's (router, routed experts, shared experts
    when it has them) with torchtitan's local dispatcher; experts ``expert_hidden`` wide (None: the flavour's)."""
    dim, experts, top_k, width, shared, router = MOE_SHAPES[flavour]
    width = expert_hidden or width
    return make_moe_config(
        num_experts=experts,
        router=make_router_config(dim=dim, num_experts=experts, gate_param_init=_INIT, top_k=top_k, **router),
        routed_experts=make_routed_experts_config(dim=dim, hidden_dim=width, num_experts=experts, top_k=top_k,
                                                  param_init=_EXPERTS_INIT, comm_backend="standard"),
        shared_experts=make_ffn_config(dim=dim, hidden_dim=width * shared, w1_param_init=_INIT,
                                       w2w3_param_init=_INIT) if shared else None,
    )


def debug_model_config(flavour: str, layers: int, expert_hidden: Optional[int] = None):
    """The flavour's torchtitan debug model config, its first ``layers`` blocks, SDPA attention, and
    routed experts ``expert_hidden`` wide (None: the flavour's)."""
    config = _registry(flavour).model
    config.layers = config.layers[:layers]
    if expert_hidden is not None:
        for layer in config.layers:
            if getattr(layer, "moe", None) is not None:
                layer.moe.routed_experts.inner_experts.hidden_dim = expert_hidden
    for _, _, parent, attr in list(config.traverse(FlexAttention.Config)):
        setattr(parent, attr, ScaledDotProductAttention.Config())
    return config


def with_moe_comm(config, num_max_tokens_per_rank: int, moe_comm_config: dict):
    """A copy of a torchtitan config with every ``RoutedExperts`` on moe_comm, through the integration's override."""
    config = copy.deepcopy(config)
    apply_overrides(OverrideConfig(imports=[(OVERRIDE, {"num_max_tokens_per_rank": num_max_tokens_per_rank,
                                                        "moe_comm_config": moe_comm_config})]), config)
    return config


def build(config, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    module = config.build()
    module.init_states()
    return module


def ep_mesh():
    """The EP mesh over every rank, of the default group's kind (gloo: CPU, also for GPU ranks sharing a GPU)."""
    return init_device_mesh("cuda" if dist.get_backend() == "nccl" else "cpu", (dist.get_world_size(),))


def to_device(module: nn.Module, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """``module`` on ``device`` with its parameters in ``dtype``; buffers keep theirs (RoPE's complex cache)."""
    module.to(device)
    for param in module.parameters():
        param.data = param.data.to(dtype)
    return module


def is_expert_weight(name: str) -> bool:
    return name.rsplit(".", 1)[-1] in EXPERT_WEIGHTS


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.float(), want.float()
    return ((got - want).abs().max() / want.abs().max()).item()


def all_reduce(tensor: torch.Tensor, op=dist.ReduceOp.SUM) -> None:
    """``dist.all_reduce`` in place through a float32 copy, on the CPU under gloo (GPU ranks that share a GPU)."""
    reduced = tensor.detach().float()
    if dist.get_backend() == "gloo":
        reduced = reduced.cpu()
    dist.all_reduce(reduced, op=op)
    tensor.copy_(reduced)


def moe_pair(flavour: str, mesh, device: torch.device, dtype: torch.dtype, moe_comm_config: dict,
             num_max_tokens_per_rank: int, expert_hidden: Optional[int]):
    """A MoE layer of the flavour with all E experts and torchtitan's local dispatcher, and the same
    layer (same weights) at EP=world with moe_comm's, on ``device`` in ``dtype``."""
    moe = moe_config(flavour, expert_hidden)
    dispatcher = moe.routed_experts.token_dispatcher
    moe.routed_experts.token_dispatcher = LocalTokenDispatcher.Config(num_experts=dispatcher.num_experts,
                                                                      top_k=dispatcher.top_k)
    reference = to_device(build(moe, seed=0), device, dtype)
    parallel = to_device(with_moe_comm(moe, num_max_tokens_per_rank, moe_comm_config).build(), device, dtype)
    parallel.load_state_dict(reference.state_dict())
    expert_parallel(parallel, mesh)
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
            all_reduce(want)
            local = want.shape[0] // world
            want = want[rank * local:(rank + 1) * local]
        errors[name] = relative_error(param.grad, want)
    return errors


def compare_moe(flavour: str, mesh, device: torch.device, dtype: torch.dtype, moe_comm_config: dict, batch: int,
                seq: int, expert_hidden: Optional[int]) -> dict:
    """Relative errors of the flavour's ``RoutedExperts`` and whole ``MoE`` at EP=world (moe_comm) against
    all E experts with torchtitan's ``LocalTokenDispatcher``, on this rank's ``[batch, seq, D]`` tokens:
    outputs, d x, d scores (``RoutedExperts`` alone, on the router's routing), d router, d shared
    experts and d expert weights (against the full module's summed over the ranks, this rank's block).
    Also the rows dispatch returns in its counts, those received and the capacity."""
    rank, world = mesh.get_local_rank(), mesh.size()
    gen = torch.Generator().manual_seed(rank)
    reference, parallel = moe_pair(flavour, mesh, device, dtype, moe_comm_config, batch * seq, expert_hidden)
    dim = reference.router.gate.in_features
    x = torch.randn(batch, seq, dim, generator=gen).to(device, dtype)
    grad_out = torch.randn(batch, seq, dim, generator=gen).to(device, dtype)

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
    all_reduce(received)
    local = received.numel() // world
    routed = {
        "out": relative_error(outs[1], outs[0]),
        "dx": relative_error(grads[1][0], grads[0][0]),
        "dscores": relative_error(grads[1][1], grads[0][1]),
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
    whole = {"out": relative_error(outs[1], outs[0]), "dx": relative_error(dxs[1], dxs[0]),
             "dexperts": max(e for n, e in errors.items() if is_expert_weight(n)),
             "drouter": errors["router.gate.weight"],
             "dshared": max((e for n, e in errors.items() if n.startswith("shared_experts")), default=None)}
    return {"routed": routed, "moe": whole}


def train_losses(model: nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]], world: int,
                 lr: float = 3e-3) -> list[float]:
    """Train ``model`` one step per ``(tokens, labels)`` batch (this rank's share); the mean loss over ranks per step.

    At world > 1 the replicated (dense) weights' gradients are averaged over the ranks and the experts'
    are divided by the world size: each rank's experts got the gradients of every rank's tokens
    through combine's backward, and the EP = 1 loss is the mean of the ranks' losses.
    """
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for tokens, labels in batches:
        logits = model(tokens)
        loss = nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
        optimizer.zero_grad()
        loss.backward()
        if world > 1:
            for name, param in model.named_parameters():
                if is_expert_weight(name):
                    param.grad.div_(world)
                else:
                    all_reduce(param.grad, op=dist.ReduceOp.AVG)
            loss = loss.detach().clone()
            all_reduce(loss, op=dist.ReduceOp.AVG)
        optimizer.step()
        losses.append(loss.item())
    return losses


def token_batches(vocab: int, steps: int, batch: int, seq: int, rank: int, world: int,
                  device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One batch of ``batch`` sequences of ``seq`` tokens (the same on every call) ``steps`` times, this
    rank's ``batch / world`` rows of it; labels are the tokens shifted by one. The model memorises it,
    so the loss falls within a few steps."""
    share = batch // world
    ids = torch.randint(0, vocab, (batch, seq + 1), generator=torch.Generator().manual_seed(1234))
    ids = ids[rank * share:(rank + 1) * share].to(device)
    return [(ids[:, :-1], ids[:, 1:])] * steps


def full_ac(model: nn.Module) -> None:
    """torchtitan's full activation checkpointing on every block."""
    FullAC(FullAC.Config()).apply(model)



def train_ep(flavour: str, steps: int, batch: int, seq: int, device: torch.device, moe_comm_config: dict,
             expert_hidden: Optional[int], activation_checkpointing: bool) -> list[float]:
    """The flavour's 2-block debug model trained ``steps`` steps at EP = world with moe_comm, on this rank's
    ``batch / world`` sequences (optionally under torchtitan's full activation checkpointing); the mean losses."""
    world = dist.get_world_size()
    config = debug_model_config(flavour, layers=2, expert_hidden=expert_hidden)
    batches = token_batches(config.vocab_size, steps, batch, seq, dist.get_rank(), world, device)
    model = build(with_moe_comm(config, batch // world * seq, moe_comm_config), seed=0).to(device)
    expert_parallel(model, ep_mesh())
    if activation_checkpointing:
        full_ac(model)
    losses = train_losses(model, batches, world)
    close_dispatchers()
    return losses


def train_ep1(flavour: str, steps: int, batch: int, seq: int, device: torch.device,
              expert_hidden: Optional[int]) -> list[float]:
    """The same training at EP = 1 with torchtitan's own dispatcher, on all ``batch`` sequences."""
    config = debug_model_config(flavour, layers=2, expert_hidden=expert_hidden)
    batches = token_batches(config.vocab_size, steps, batch, seq, 0, 1, device)
    return train_losses(build(config, seed=0).to(device), batches, 1)
