"""Collective backends: the routing math of ``moe_comm.layout`` with ``all_to_all_single``.

Every exchange moves fixed ``[W, M, ...]`` slabs (one per peer, ``M = max_tokens_per_rank``
rows), so shapes never depend on the routing and no count has to reach the host. Two backends
are this one class:

* ``reference``: CPU tensors over a gloo group; the yardstick every other backend is compared with.
* ``nccl`` with ``transport: collective``: CUDA tensors over an NCCL group. Works across nodes and
  is captured in a CUDA graph like any NCCL call.

NOTE: what the collective transport costs: it moves whole slabs, ``W * M`` rows each way per
exchange whatever the routing (a padded, capacity-sized all-to-all), plus two small metadata
exchanges in dispatch, and runs the layout as a chain of small torch kernels; the device
kernels of ``vmm``/``nvshmem``/``nccl symmetric`` move only the rows that are sent.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .. import layout
from ..config import Config
from ..errors import BackendError
from .base import Backend, DispatchResult

__all__ = ["CollectiveBackend"]


class CollectiveBackend(Backend):
    """Dispatch/combine with ``torch.distributed.all_to_all_single`` on padded slabs.

    Args:
        config: the validated config. group: the process group (gloo for CPU tensors, NCCL
            for CUDA tensors). device: where the tensors live.
        name: the backend name users chose (``reference`` or ``nccl``).

    Raises:
        BackendError: the group cannot move tensors of ``device`` (e.g. CPU tensors on an
            NCCL-only group).
    """

    def __init__(self, config: Config, group, device: torch.device, name: str) -> None:
        needed = "gloo" if device.type == "cpu" else "nccl"
        group_backend = str(dist.get_backend(group))
        if needed not in group_backend:
            raise BackendError(
                f"backend {name!r} moves {device.type} tensors and needs a process group with {needed}; the group's "
                f"backend is {group_backend!r} (pass group=torch.distributed.new_group(backend={needed!r}))"
            )
        super().__init__(config, group, device, name)
        if device.type == "cuda":
            # NCCL calls are captured into a CUDA graph only after they ran once on the stream;
            # one empty step here keeps that warm-up out of the user's first capture.
            self._warm_up()

    def _warm_up(self) -> None:
        cfg = self.config
        empty = torch.empty((0, cfg.hidden), dtype=cfg.torch_dtype, device=self.device)
        result = self.dispatch(empty, torch.empty((0, cfg.topk), dtype=torch.int64, device=self.device),
                               torch.empty((0, cfg.topk), dtype=torch.float32, device=self.device))
        self.combine(result.x, result.routing)
        torch.cuda.synchronize(self.device)

    def _exchange(self, slabs: torch.Tensor) -> torch.Tensor:
        """Send slab ``r`` of ``slabs [W, ...]`` to rank ``r``; slab ``s`` of the result came from rank ``s``."""
        received = torch.empty_like(slabs)
        dist.all_to_all_single(received, slabs.contiguous(), group=self.group)
        return received

    def _send_tokens(self, rows: torch.Tensor, send_mask: torch.Tensor) -> torch.Tensor:
        return self._exchange(layout.gather_send_rows(rows, send_mask, self.config.max_tokens_per_rank))

    def dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor) -> DispatchResult:
        cfg = self.config
        send_mask, dest_rank, slab_expert = layout.plan_source(
            topk_idx, cfg.num_experts, self.world_size, self.rank, self.status
        )
        num_tokens = x.shape[0]
        expert_slabs = torch.full(
            (self.world_size, cfg.max_tokens_per_rank, cfg.topk), -1, dtype=torch.int32, device=x.device
        )
        expert_slabs[:, :num_tokens] = slab_expert
        recv_expert = self._exchange(expert_slabs)
        recv_weight = self._send_tokens(topk_weights, send_mask)
        recv_rows = self._send_tokens(x, send_mask)
        plan = layout.plan_destination(
            recv_expert, self.num_local_experts, cfg.expert_alignment, cfg.expert_capacity, self.status
        )
        routing = layout.Routing(num_tokens, send_mask, dest_rank, plan.recv_pos, recv_weight)
        out_x = layout.expand_rows(recv_rows, plan.recv_pos, self.capacity_rows)
        return DispatchResult(out_x, plan.expert_offsets, plan.tokens_per_expert, routing)

    def redispatch(self, x: torch.Tensor, routing: layout.Routing) -> torch.Tensor:
        recv_rows = self._send_tokens(x, routing.send_mask)
        return layout.expand_rows(recv_rows, routing.recv_pos, self.capacity_rows)

    def combine(self, y: torch.Tensor, routing: layout.Routing, weighted: bool = True) -> torch.Tensor:
        weights = routing.recv_weight if weighted else None
        partials = layout.reduce_partials(y, routing.recv_pos, weights)
        return layout.sum_returned(self._exchange(partials), routing.send_mask)

    def return_entry_values(self, row_vector: torch.Tensor, routing: layout.Routing) -> torch.Tensor:
        entry_values = layout.scatter_entry_values(row_vector, routing.recv_pos)
        return layout.gather_entry_values(self._exchange(entry_values), routing.dest_rank)
