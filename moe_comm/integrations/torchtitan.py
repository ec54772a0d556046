"""torchtitan (0.3): moe_comm as the token dispatcher of torchtitan's MoE models.

Every MoE model torchtitan ships (DeepSeek-V3, Qwen3, Llama 4, gpt-oss, ...) runs its routed
experts through ``torchtitan.models.common.moe.RoutedExperts``, which calls the token dispatcher
its config builds: ``dispatch`` -> ``GroupedExperts`` (``torch._grouped_mm`` over the cumulative sum
of the counts dispatch returns) -> ``combine``. :class:`MoECommTokenDispatcher` is such a
dispatcher: one path that trains (backward), captures into a CUDA graph (a no_grad forward reads
nothing on the host), compiles and recomputes under activation checkpointing, where torchtitan's
DeepEP dispatcher needs two configs (a host-synced trainable one and a capturable one without backward).

A torchtitan user selects it with the override this module registers, on the command line::

    --override.imports 'moe_comm.integrations.torchtitan.moe_comm_dispatcher={"num_max_tokens_per_rank": 8192}'

(``training.local_batch_size * training.seq_len``; add ``"moe_comm_config": {"backend": "vmm"}`` or
a YAML path to choose moe_comm's keys), or in Python with ``MoECommTokenDispatcher.Config`` as the
``token_dispatcher`` of a ``RoutedExperts.Config``. torchtitan's whole-step CUDA graphs accept only
its own host-sync-free dispatchers by type: train with ``--training.disable_cuda_graphs``.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Mapping, Optional, Union

import torch
import torch.distributed as dist
from torch import nn

from ..config import Config, load_config
from ..dispatcher import Dispatcher
from ..outputs import DispatchOutput, TokenMajorOutput
from ..errors import ConfigError, InputError
from ..nn.experts import check_padding_for_gradients
from ..nn.receive_layout import combine_rows, expert_rows

try:
    from torchtitan.config import override
    from torchtitan.models.common.moe import GroupedExperts, RoutedExperts
    from torchtitan.models.common.token_dispatcher import BaseEPTokenDispatcher, LocalTokenDispatcher
except ImportError as exc:
    raise ImportError(f"moe_comm.integrations.torchtitan needs torchtitan 0.3 (pip install 'moe_comm[torchtitan]'): "
                      f"{exc}") from exc

__all__ = ["MoECommTokenDispatcher", "moe_comm_dispatcher", "expert_parallel", "close_dispatchers"]

MoECommConfigSource = Union[None, str, os.PathLike, Mapping[str, Any], Config]

# One moe_comm Dispatcher per (config, EP group), shared by every MoE layer that asks for it: a
# handle carries its own routing, so layers may share buffers, and a model of L layers then holds
# one set of receive buffers instead of L (DeepEP's and HybridEP's dispatchers share one buffer too).
# Every rank wires its layers in the same order, so every rank builds the same Dispatchers in the same order.
_dispatchers: dict[tuple[Config, dist.ProcessGroup], Dispatcher] = {}


def close_dispatchers() -> None:
    """Close every shared moe_comm Dispatcher of this process, newest first (the same order on every rank); idempotent.

    The token dispatchers that used them raise on their next call; wire the model again to go on.
    """
    while _dispatchers:
        _, dispatcher = _dispatchers.popitem()
        dispatcher.close()


def _shared_dispatcher(config: Config, group: dist.ProcessGroup) -> Dispatcher:
    key = (config, group)
    dispatcher = _dispatchers.get(key)
    if dispatcher is None:
        dispatcher = _dispatchers[key] = Dispatcher(config, group)
    return dispatcher


class MoECommTokenDispatcher(BaseEPTokenDispatcher):
    """torchtitan's ``BaseEPTokenDispatcher`` over a moe_comm :class:`~moe_comm.Dispatcher`.

    ``dispatch`` returns moe_comm's expert-major rows ``[capacity_rows, D]`` and, per local expert,
    its whole aligned segment's row count (received rows plus zero padding): the cumulative sum
    ``GroupedExperts`` takes of them is moe_comm's ``expert_offsets``, so the zero rows add nothing
    to the outputs or the weights' gradients, and rows past the last segment are in no group.
    Nothing is read on the host. With no EP mesh (EP = 1) it is torchtitan's local dispatcher.

    With moe_comm's ``receive_layout: token_major`` the experts still get expert-major rows: ``dispatch``
    permutes the token-major rows it receives and ``combine`` unpermutes the experts' outputs before
    combining them (:mod:`moe_comm.nn.receive_layout`), the same bits as the expert-major layout.
    """

    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(BaseEPTokenDispatcher.Config):
        """``num_experts`` (global E) and ``top_k`` as every dispatcher's; the rest sizes moe_comm's buffers.

        num_max_tokens_per_rank: most tokens ``T`` of one dispatch on one rank (torchtitan pads every
            rank to ``local_batch_size * seq_len / (CP * TP)``).
        hidden_dim: the model width ``D`` of a token row.
        moe_comm_config: moe_comm's config keys as a YAML path, a dict (e.g. ``{"backend": "vmm"}``) or a
            :class:`moe_comm.Config`; None: the embedded default. ``num_experts``, ``topk``, ``hidden`` and
            ``max_tokens_per_rank`` come from the fields above; ``dtype`` must be the tokens' dtype.
        """

        num_max_tokens_per_rank: Optional[int] = None
        hidden_dim: Optional[int] = None
        moe_comm_config: MoECommConfigSource = None

    def __init__(self, config: Config):
        super().__init__(config)
        for name in ("num_max_tokens_per_rank", "hidden_dim"):
            value = getattr(config, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ConfigError(f"MoECommTokenDispatcher.Config.{name}: expected a positive integer, got {value!r}")
        self.num_max_tokens_per_rank = config.num_max_tokens_per_rank
        self.hidden_dim = config.hidden_dim
        self.moe_comm_config = config.moe_comm_config
        self.dispatcher: Optional[Dispatcher] = None

    def init_buffer(self) -> None:
        """Build (or join) the moe_comm Dispatcher of the EP group: collective over it, allocates and compiles.
        Without an EP mesh (EP = 1) there is nothing to build: dispatch and combine are then local.

        Raises:
            ConfigError: ``hidden_dim`` or ``num_max_tokens_per_rank`` is unset, or moe_comm's config is invalid.
        """
        if self.ep_mesh is None:
            return
        missing = [name for name in ("num_max_tokens_per_rank", "hidden_dim") if getattr(self, name) is None]
        if missing:
            raise ConfigError(
                f"MoECommTokenDispatcher.Config: {', '.join(missing)} unset; moe_comm sizes its buffers from them "
                "(the moe_comm_dispatcher override sets hidden_dim from the model and takes num_max_tokens_per_rank: "
                "training.local_batch_size * training.seq_len)"
            )
        source = self.moe_comm_config
        if isinstance(source, Config):
            source = source.to_dict()
        config = load_config(source, num_experts=self.num_experts, topk=self.top_k, hidden=self.hidden_dim,
                             max_tokens_per_rank=self.num_max_tokens_per_rank)
        self.dispatcher = _shared_dispatcher(config, self.ep_mesh.get_group())
        # Layers wire their meshes in model order on every rank: the site, and each call's tag, agree.
        self._call_site = self.dispatcher.new_call_site()

    def _live_dispatcher(self) -> Dispatcher:
        if self.dispatcher is None:
            raise ConfigError("MoECommTokenDispatcher: no moe_comm Dispatcher yet; torchtitan builds it in "
                              "wire_meshes(ep_mesh=...) (RoutedExperts.parallelize), call that first")
        return self.dispatcher

    def dispatch(
        self,
        x_TD: torch.Tensor,
        topk_scores_TK: torch.Tensor,
        topk_expert_ids_TK: torch.Tensor,
        num_local_tokens_per_expert_E: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, Union[DispatchOutput, TokenMajorOutput, Any]]:
        """Send every token to the ranks of its experts; rows come back expert-major (token-major: permuted here).

        Args:
            x_TD: ``[T, D]`` tokens in moe_comm's ``dtype``, ``T <= num_max_tokens_per_rank``, on this rank's device.
            topk_scores_TK: ``[T, K]`` router weights (float32, or cast to it; gradients flow back to them).
            topk_expert_ids_TK: ``[T, K]`` int64 global expert ids.
            num_local_tokens_per_expert_E: ``[E]`` counts of this rank's assignments (unused: moe_comm
                counts on the device).

        Returns:
            ``routed_input_RD [capacity_rows, D]``, ``num_tokens_per_local_expert_e [E / EP]`` int32 segment
            sizes (padding included; their sum is at most ``capacity_rows``) and the metadata ``combine`` takes:
            moe_comm's dispatch output (its handle and, token-major, what the unpermute reads).
        """
        if self.ep_mesh is None:
            return LocalTokenDispatcher.dispatch(self, x_TD, topk_scores_TK, topk_expert_ids_TK,
                                                 num_local_tokens_per_expert_E)
        dispatcher = self._live_dispatcher()
        config = dispatcher.config
        if x_TD.shape[0] > config.max_tokens_per_rank:
            raise InputError(f"MoECommTokenDispatcher x_TD: {x_TD.shape[0]} tokens, more than the config's "
                             f"num_max_tokens_per_rank={config.max_tokens_per_rank} that sized the buffers")
        if x_TD.dtype != config.torch_dtype:
            raise InputError(f"MoECommTokenDispatcher x_TD: tokens in {x_TD.dtype}, but moe_comm moves {config.dtype} "
                             "rows; set moe_comm_config's dtype to the dtype the MoE layers run in")
        check_padding_for_gradients(config, (x_TD,), "MoECommTokenDispatcher")
        out = dispatcher.dispatch(x_TD.contiguous(), topk_expert_ids_TK.contiguous(),
                                  topk_scores_TK.float().contiguous(), call_tag=dispatcher.call_tag(self._call_site))
        rows = expert_rows(dispatcher, out)
        offsets = rows.expert_offsets
        segment_rows = torch.diff(offsets, prepend=offsets.new_zeros(1))
        # GroupedExperts multiplies rows in the model's dtype: FP8 dispatch's rows are dequantized (straight
        # through for the gradient); otherwise the rows themselves.
        return dispatcher.dequantize(rows), segment_rows, out

    def combine(self, routed_output_RD: torch.Tensor, metadata: Union[DispatchOutput, TokenMajorOutput, Any],
                x_TD: torch.Tensor) -> torch.Tensor:
        """Bring the experts' outputs back and sum them with the router weights: ``[T, D]`` in x_TD's dtype.

        Args:
            routed_output_RD: ``[capacity_rows, D]`` the experts' outputs in dispatch's layout.
            metadata: what dispatch returned for it. x_TD: the dispatched tokens (for the EP = 1 path's shape).
        """
        if self.ep_mesh is None:
            return LocalTokenDispatcher.combine(self, routed_output_RD, metadata, x_TD)
        dispatcher = self._live_dispatcher()
        return dispatcher.combine(combine_rows(dispatcher, routed_output_RD.contiguous(), metadata), metadata.handle)


@override(target=RoutedExperts.Config, description="moe_comm token dispatcher (trains and captures in one path)")
def moe_comm_dispatcher(
    cfg: RoutedExperts.Config,
    *,
    num_max_tokens_per_rank: int,
    moe_comm_config: MoECommConfigSource = None,
) -> RoutedExperts.Config:
    """torchtitan override: every ``RoutedExperts`` of the model dispatches through moe_comm.

    Args:
        cfg: the routed experts' config; its dispatcher gives ``num_experts`` and ``top_k``, its
            experts the width ``hidden_dim``.
        num_max_tokens_per_rank: most tokens of one forward on one rank (``local_batch_size * seq_len``).
        moe_comm_config: moe_comm's keys (a dict or a YAML path); None: the embedded default.
    """
    dispatcher = cfg.token_dispatcher
    return dataclasses.replace(cfg, token_dispatcher=MoECommTokenDispatcher.Config(
        num_experts=dispatcher.num_experts,
        top_k=dispatcher.top_k,
        num_max_tokens_per_rank=num_max_tokens_per_rank,
        hidden_dim=cfg.inner_experts.dim,
        moe_comm_config=moe_comm_config,
    ))


def expert_parallel(model: nn.Module, ep_mesh) -> list[RoutedExperts]:
    """Make a torchtitan model built on one rank expert-parallel over ``ep_mesh``, without torchtitan's ``parallelize``.

    For training loops of one's own (torchtitan's trainer shards the experts and wires the mesh in
    ``parallelize``): every ``RoutedExperts`` whose dispatcher is :class:`MoECommTokenDispatcher`
    keeps its block of experts (global expert ``e`` on rank ``e // (E / EP)``; the other experts'
    weights are freed) and builds its moe_comm Dispatcher (collective over the mesh). Every rank
    calls it on the same model, in the same order.

    Args:
        model: a torchtitan model or module with plain-tensor (not DTensor) expert weights ``[E, ., .]``.
        ep_mesh: the 1-d expert-parallel ``DeviceMesh``.

    Returns:
        The ``RoutedExperts`` modules made expert-parallel.

    Raises:
        ConfigError: the mesh size does not divide an experts module's ``num_experts``.
    """
    rank, world = ep_mesh.get_local_rank(), ep_mesh.size()
    routed = [m for m in model.modules()
              if isinstance(m, RoutedExperts) and isinstance(m.token_dispatcher, MoECommTokenDispatcher)]
    for module in routed:
        experts: GroupedExperts = module.inner_experts
        if experts.num_experts % world:
            raise ConfigError(f"expert_parallel: {experts.num_experts} experts do not split over an EP mesh of {world}")
        local = experts.num_experts // world
        for name, weight in list(experts.named_parameters(recurse=False)):
            block = weight.detach()[rank * local:(rank + 1) * local].clone()
            setattr(experts, name, nn.Parameter(block, requires_grad=weight.requires_grad))
        experts.num_experts = local
        module.token_dispatcher.wire_meshes(ep_mesh=ep_mesh)
    return routed
