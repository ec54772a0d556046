"""torchtitan's debug MoE models for the torchtitan integration's tests, EP = 1 against EP = world.

The models are torchtitan's own classes and flavours (DeepSeek-V3 ``debugmodel``, Qwen3
``debugmodel_moe``), cut to their first ``layers`` blocks to keep CPU runs short, with torchtitan's
``ScaledDotProductAttention`` inside: its default FlexAttention has no backward on CPU. EP = world
is what torchtitan's ``parallelize`` leaves on each rank, built without it (it needs FSDP and CUDA):
every ``RoutedExperts`` keeps its block of ``E / world`` experts and the moe_comm dispatcher,
selected with the integration's override, is wired to the EP mesh.
"""

from __future__ import annotations

import copy
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from torchtitan.config import OverrideConfig, apply_overrides
from torchtitan.distributed.activation_checkpoint import FullAC
from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention
from torchtitan.models.common.moe import MoE, RoutedExperts
from torchtitan.models.deepseek_v3 import model_registry as deepseek_v3_registry
from torchtitan.models.qwen3 import model_registry as qwen3_registry

from moe_comm.integrations.torchtitan import MoECommTokenDispatcher

OVERRIDE = "moe_comm.integrations.torchtitan.moe_comm_dispatcher"
FLAVOURS = {
    "deepseek_v3": lambda: deepseek_v3_registry("debugmodel").model,
    "qwen3": lambda: qwen3_registry("debugmodel_moe").model,
}
EXPERT_WEIGHTS = ("w1_EFD", "w2_EDF", "w3_EFD")


def debug_model_config(flavour: str, layers: int, expert_hidden: Optional[int] = None):
    """The flavour's torchtitan debug model config, its first ``layers`` blocks, SDPA attention, and
    routed experts ``expert_hidden`` wide (None: the flavour's)."""
    config = FLAVOURS[flavour]()
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


def ep_mesh(device_type: str):
    return init_device_mesh(device_type, (dist.get_world_size(),))


def make_expert_parallel(model: nn.Module, mesh) -> list[RoutedExperts]:
    """Keep each moe_comm ``RoutedExperts``' block of experts (``e // (E / EP)`` is this rank) and wire the mesh."""
    rank, world = mesh.get_local_rank(), mesh.size()
    routed = [m for m in model.modules()
              if isinstance(m, RoutedExperts) and isinstance(m.token_dispatcher, MoECommTokenDispatcher)]
    for module in routed:
        experts = module.inner_experts
        local = experts.num_experts // world
        for name in EXPERT_WEIGHTS:
            block = getattr(experts, name).detach()[rank * local:(rank + 1) * local].clone()
            setattr(experts, name, nn.Parameter(block))
        experts.num_experts = local
        module.token_dispatcher.wire_meshes(ep_mesh=mesh)
    return routed


def is_expert_weight(name: str) -> bool:
    return name.rsplit(".", 1)[-1] in EXPERT_WEIGHTS


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
                    dist.all_reduce(param.grad, op=dist.ReduceOp.AVG)
            loss = loss.detach().clone()
            dist.all_reduce(loss, op=dist.ReduceOp.AVG)
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


def moe_of(config) -> MoE.Config:
    """The config of the model's first MoE layer (router, routed experts, shared experts when the flavour has them)."""
    return next(layer.moe for layer in config.layers if getattr(layer, "moe", None) is not None)
